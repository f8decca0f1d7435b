"""What the GPU benchmark's parts share: their log line, a seeded batch, handing GPU memory back.
Below `gpu`, `gpu_steps`, `gpu_kernels` and `gpu_transfer`, which all use them."""

from __future__ import annotations

import gc
import sys

import numpy as np


def log(message: str) -> None:
    print(f"[bench gpu] {message}", flush=True)


def random_batch(graph, seed=0):
    rng = np.random.default_rng(seed)
    image, labels = graph.inputs[0], graph.inputs[1]
    classes = graph[graph.losses[0].inputs[0]].shape[1]
    return rng.standard_normal(image.shape, dtype=np.float32), rng.integers(0, classes, labels.shape)


def release_gpu_memory() -> None:
    """Hand cached GPU memory back (cupy's pool, torch's cache): the next model starts from empty pools.
    Module-level, so `client.run` can run it on workers too."""
    gc.collect()
    if "cupy" in sys.modules:
        sys.modules["cupy"].get_default_memory_pool().free_all_blocks()
    if "taskrt.gpu.cuda_graphs" in sys.modules:
        sys.modules["taskrt.gpu.cuda_graphs"].clear()
        gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()
