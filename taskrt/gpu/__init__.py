"""What a worker computes on: its CPU (numpy) or a GPU (cupy), chosen per worker process
(`device`); copies to a GPU that overlap the kernels before them (`staging`); a device's fused
run replayed as a CUDA graph (`cuda_graphs`).  Imported lazily wherever a GPU may be absent.

Imports only `taskrt.ops` below it."""
