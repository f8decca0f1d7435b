"""`dask scheduler --preload taskrt.dashboard`: adds the taskrt page to a separately started
scheduler's dashboard.  The page itself lives in `taskrt.observing.dashboard`."""

from taskrt.observing import dashboard  # noqa: F401  (registers the page on import)
