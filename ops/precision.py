"""Float32 precision of GPU kernels: strict IEEE float32 ("fp32", the default), TensorFloat-32
("tf32") or bfloat16 compute ("bf16").

TF32 rounds the inputs of float32 matrix products and convolutions to a 10-bit mantissa on tensor
cores (several times faster on an H100, relative error about 1e-3).  "bf16" runs the convolutions
and matrix products of the torch kernels (`ops.torch_kernels`) on bfloat16 copies of their inputs
and weights (8-bit mantissa, twice TF32's tensor-core rate on an H100) and returns float32 results:
parameters, their updates, batch norms and the loss stay float32, as under PyTorch's autocast.
Either changes results, so it is an explicit choice made once per process, never a library's default:

    ops.precision.set_precision("tf32")
    client.run(ops.precision.set_precision, "tf32")      # on every Dask worker

What each library is told:
- torch: `torch.backends.cudnn.allow_tf32` (convolutions; torch's own default allows TF32) and
  `torch.backends.cuda.matmul.allow_tf32` (matrix products).  A torch imported after the call is
  told by `ops.torch_kernels` when it loads it.
- cupy: its float32 GEMM compute type.  cupy reads the environment variable CUPY_TF32 once, at the
  first float32 matrix product of the process, and keeps the result; afterwards only its runtime
  switch `cupy._core._routines_linalg.set_compute_type` changes it.  So the variable is set for a
  cupy that has not multiplied yet, and the switch is used when cupy is loaded.

The choice starts from CUPY_TF32 (unset or 0: "fp32"), so worker processes started after a call
inherit it through the environment and agree with the process that started them.  Numpy never
uses TF32.
"""

from __future__ import annotations

import os
import sys
import warnings

PRECISIONS = ("fp32", "tf32", "bf16")


def _cupy_tf32_variable() -> bool:
    """CUPY_TF32 read as cupy reads it: a positive integer allows TF32."""
    try:
        return int(os.environ.get("CUPY_TF32") or "0") > 0
    except ValueError:
        return False


_precision = "tf32" if _cupy_tf32_variable() else "fp32"


def get_precision() -> str:
    return _precision


def set_precision(precision: str = "fp32") -> str:
    """Choose "fp32" (strict float32), "tf32" or "bf16" for this process; returns the previous choice."""
    global _precision
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be 'fp32' (strict float32), 'tf32' (TensorFloat-32) or 'bf16' (bfloat16 "
                         f"compute), got {precision!r}")
    previous, _precision = _precision, precision
    os.environ["CUPY_TF32"] = "1" if precision == "tf32" else "0"
    if "torch" in sys.modules:
        apply_to_torch(sys.modules["torch"])
    if "cupy" in sys.modules:
        apply_to_cupy()
    return previous


def apply_to_torch(torch) -> None:
    tf32 = _precision == "tf32"
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32


def apply_to_cupy() -> None:
    """Set cupy's float32 GEMM compute type (cupy warns and keeps full float32 on GPUs older than Ampere)."""
    import numpy

    try:
        from cupy._core import _routines_linalg as linalg

        compute_type = linalg.COMPUTE_TYPE_TF32 if _precision == "tf32" else linalg.COMPUTE_TYPE_DEFAULT
        set_compute_type = linalg.set_compute_type
    except (ImportError, AttributeError):
        warnings.warn("this cupy has no runtime TF32 switch: its float32 products follow CUPY_TF32 as it was at "
                      "their first use in this process", RuntimeWarning, stacklevel=3)
        return
    set_compute_type(numpy.float32, compute_type)
