"""taskrt: a Legion-style task-graph runtime on Dask for layer-wise parallel CNN training."""

from ops.rect import Rect  # the region algebra lives beside the region rules in ops
from taskrt.graph import Graph, GraphError, Layer, Tensor

__all__ = ["Rect", "Graph", "GraphError", "Layer", "Tensor"]
