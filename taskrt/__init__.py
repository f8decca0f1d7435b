"""taskrt: a Legion-style task-graph runtime on Dask for layer-wise parallel CNN training.

The package face: the names a user imports (`import taskrt as tr`).  The rooms behind it, lowest
floor first (each imports only from its own floor or lower ones; tests/test_layers.py checks it):

    taskrt.ops        kernels (numpy or cupy), Rect, each op's region rules and FLOP counts
    taskrt.graph      the network and how it is split: Graph, ParallelConfig, Strategy, the model zoo
    taskrt.gpu        what a worker computes on: numpy or cupy, copies to a GPU, CUDA graphs
    taskrt.data       datasets, arrays bound to input layers, a device reading its own tile
    taskrt.planning   (graph, strategy) -> Plan: lowering, fusion, programs, memory, simulation
    taskrt.observing  timelines, traces, Gantt charts, the dashboard page, profiling
    taskrt.transport  values between workers (mailbox, sockets, shared memory, CUDA IPC) and to the client
    taskrt.machines   Machine, local clusters, link probes, calibration, worker set-up
    taskrt.execution  plans run on Dask: a task per fused run, or a program per device
    taskrt.training   Trainer and its parts, fit, checkpoints, recovery, the single-device and IST trainers
    taskrt.search     configuration space, cost model, node/edge elimination, seed families (above the runtime)
    taskrt.bench      the benchmark runner (`taskrt bench`, `python -m taskrt.bench`)
"""

from taskrt.data.datasets import ArrayDataset, DataReadError, Dataset, DatasetError, NpyDataset, Synthetic, digits
from taskrt.graph import models
from taskrt.graph.config import ParallelConfig
from taskrt.graph.from_torch import from_torch
from taskrt.graph.graph import Graph, GraphError, Layer, Tensor
from taskrt.graph.strategy import Strategy, StrategyError
from taskrt.machines.devices import DeviceMemoryError
from taskrt.machines.machine import Machine, MachineError
from taskrt.ops import optim
from taskrt.ops.rect import Rect  # the region algebra lives beside the region rules in ops
from taskrt.planning.lowering import lower
from taskrt.training.checkpoint import CheckpointError, Checkpoints
from taskrt.training.fit import EpochStats, Evaluation, History
from taskrt.training.ist import ISTTrainer, LocalSGDTrainer
from taskrt.training.reference import SingleDeviceTrainer
from taskrt.training.trainer import Trainer

__all__ = [
    "Rect", "Graph", "GraphError", "Layer", "Tensor", "ParallelConfig", "Strategy", "StrategyError",
    "Machine", "MachineError", "DeviceMemoryError", "Checkpoints", "CheckpointError", "Trainer",
    "SingleDeviceTrainer", "ISTTrainer", "LocalSGDTrainer", "lower", "models", "Dataset", "ArrayDataset",
    "NpyDataset", "Synthetic", "digits", "DatasetError", "DataReadError", "History", "EpochStats", "Evaluation",
    "optim", "from_torch",
]
