"""Every benchmark's goals in one place, below the benchmarks and their pages: a benchmark judges
its rows by them and its page (`taskrt.bench.pages`) states them, neither importing the other."""

# bench kernels
KERNELS_GOAL, KERNELS_MOONSHOT = 0.5, 0.7  # of the GEMM rate, large conv layers
# bench overhead
OVERHEAD_HOP_GOAL = 1.1  # taskrt's overhead against Dask's own on the same graph (equal hops: per hop too)
# bench programs
TASKS_GOAL = 2  # Dask tasks per step and device
HOP_GOAL_S, HOP_MOONSHOT_S = 1e-3, 0.3e-3
PROGRAMS_RATE_GOAL = 5e9  # bytes/s, 64 MB between two workers on one host
# bench data
GOAL_BYTES = 1024  # sample data from the client per step on the dataset path
# bench gpu
GPU_STEP_GOAL, GPU_STEP_FLOOR = 0.8, 0.5  # taskrt's step against PyTorch eager: goal, and no network below the floor
MEMORY_GOAL = 1.3  # taskrt's peak GPU memory against PyTorch's
BF16_ACCURACY_POINTS = 0.5  # bf16's held-out accuracy after training against fp32's (percentage points)
BF16_CURVE_FACTOR = 2.0  # bf16's loss curve from fp32's at most this many times another fp32 run's
GPU_TRANSFER_RATE_GOAL = 100e9  # bytes/s, a 64 MB device array between two workers on one GPU (CUDA IPC)
# bench optim
OPTIM_GOAL = 1.1  # an AdamW step at most this many times an SGD-with-momentum step (local(2))
# bench zoo
ZOO_EQUAL = 1e-9  # one float64 SGD step against PyTorch's, relative
ZOO_SPEED = {"resnet50": 0.8, "mobilenet_v2": 0.5, "efficientnet_b0": 0.5}  # local(1) / PyTorch one thread
ZOO_TWO_DEVICES = {"resnet50": 1.3}  # the searched strategy on local(2) / local(1)
ZOO_SEARCH_S = 2.0  # search.optimize on 16 simulated GPUs, every family
# bench hypergraph: the thesis's figures its partitions are set beside
# The thesis's forward communication volume in its "MB" (MV), batch 32, final imbalance 0.1 unless named
THESIS_VOLUME = {
    "layer-wise": {2: 24.5, 4: 85.7, 8: 131.6, 16: 273.5},
    "horizontal": {2: 484, 4: 1144, 8: 2307, 16: 4556, 32: 9016, 64: 17916, 128: 35707},
    "filter-wise incremental": {2: 42, 4: 117, 8: 372, 16: 667, 32: 1294, 64: 2212, 128: 4091},
    "channel-wise incremental": {2: 42, 4: 118, 8: 373, 16: 663, 32: 1275, 64: 2371, 128: 4471},
    "coarse hypergraph": {2: 27, 4: 61, 8: 298, 16: 661, 32: 1300, 64: 2388, 128: 4604},
    "fine hypergraph": {2: 27.5, 4: 56.3, 8: 307.3, 16: 549.2, 32: 916.8, 64: 1340.1, 128: 1964.0},
}
# bench memory
MEMORY_PEAK_GOAL = 0.10  # |measured / predicted - 1| of every device's peak (CPU workers)
MEMORY_EXACT = 1e-9  # float64 loss against one device's, relative (the demonstration's, a recomputing strategy's)
MEMORY_RECOMPUTE_GOAL = 0.10  # recomputation's simulated step-time increase against the measured one
MEMORY_SEARCH_GOAL = 2.0  # the search under a binding budget against the unconstrained search
