"""The network and how it is split: the graph-building API (`graph`), a layer's split over
n/c/h/w and its devices (`config`), a split for every layer (`strategy`, saved as JSON), the model
zoo (`models`) and files written whole or not at all (`files`).

Imports only `taskrt.ops` below it."""
