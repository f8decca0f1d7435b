"""taskrt: a Legion-style task-graph runtime on Dask for layer-wise parallel CNN training."""

from ops.rect import Rect  # the region algebra lives beside the region rules in ops
from taskrt import models
from taskrt.checkpoint import CheckpointError, Checkpoints
from taskrt.config import ParallelConfig
from taskrt.datasets import ArrayDataset, DataReadError, Dataset, DatasetError, NpyDataset, Synthetic, digits
from taskrt.fit import EpochStats, Evaluation, History
from taskrt.graph import Graph, GraphError, Layer, Tensor
from taskrt.ist import ISTTrainer, LocalSGDTrainer
from taskrt.lowering import lower
from taskrt.machine import Machine, MachineError
from taskrt.reference import SingleDeviceTrainer
from taskrt.strategy import Strategy, StrategyError
from taskrt.trainer import Trainer

__all__ = [
    "Rect", "Graph", "GraphError", "Layer", "Tensor", "ParallelConfig", "Strategy", "StrategyError",
    "Machine", "MachineError", "Checkpoints", "CheckpointError", "Trainer", "SingleDeviceTrainer", "ISTTrainer",
    "LocalSGDTrainer", "lower", "models", "Dataset", "ArrayDataset", "NpyDataset", "Synthetic", "digits",
    "DatasetError", "DataReadError", "History", "EpochStats", "Evaluation",
]
