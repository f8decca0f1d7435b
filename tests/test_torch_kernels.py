"""The torch kernels (cuDNN on GPU) against the numpy reference, tile by tile, and the precision switch.

On this machine the torch path is forced on numpy arrays (torch's CPU kernels); the `gpu` class runs
the same comparisons with cupy arrays on a CUDA device, for the torch path and cupy's im2col path.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import subprocess
import sys
import types
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from taskrt import (  # noqa: E402
    SingleDeviceTrainer,
    models,
    ops,  # noqa: E402
)
from taskrt.ops import BatchNorm, Conv2d, Linear, Pool2d, Relu, SoftmaxCrossEntropy, torch_kernels  # noqa: E402
from taskrt.ops.batchnorm import combine_stats, partial_stats  # noqa: E402
from taskrt.ops.precision import get_precision, set_precision  # noqa: E402
from taskrt.ops.rect import Rect  # noqa: E402

TOLERANCE = {np.float64: 1e-10, np.float32: 1e-4}

CONVS = [
    Conv2d(((2, 4, 9, 9),), 5, (1, 1), (1, 1), (0, 0)),
    Conv2d(((2, 3, 10, 9),), 4, (3, 3), (1, 1), (1, 1), "relu"),
    Conv2d(((2, 3, 11, 10),), 4, (3, 3), (2, 2), (1, 1), None, False),
    Conv2d(((1, 3, 12, 12),), 4, (5, 5), (1, 1), (2, 2), "relu", False),
    Conv2d(((2, 3, 9, 10),), 3, (1, 7), (1, 1), (0, 3), "relu"),
    Conv2d(((2, 3, 10, 9),), 3, (7, 1), (1, 1), (3, 0)),
    Conv2d(((2, 3, 35, 35),), 4, (11, 11), (4, 4), (2, 2), "relu"),  # AlexNet's stem: unequal padding
    Conv2d(((1, 2, 9, 11),), 3, (3, 3), (2, 3), (0, 0)),
]
LINEARS = [
    Linear(((5, 7),), 4),
    Linear(((5, 7),), 6, "relu"),
    Linear(((4, 9),), 3, "relu", False),
]
POOLS = [
    Pool2d(((2, 3, 9, 9),), (3, 3), (2, 2), (0, 0), "max"),
    Pool2d(((2, 3, 10, 9),), (3, 3), (1, 1), (1, 1), "max"),
    Pool2d(((2, 3, 8, 8),), (2, 2), (2, 2), (0, 0), "max"),
    Pool2d(((2, 3, 9, 10),), (3, 3), (1, 1), (1, 1), "avg"),
    Pool2d(((1, 2, 11, 11),), (5, 5), (3, 3), (2, 2), "avg"),
]
TILINGS = [(1, 1, 1, 1), (2, 2, 2, 2), (1, 1, 3, 2)]


def op_id(op):
    if isinstance(op, Pool2d):
        return f"{op.mode}{op.kernel[0]}x{op.kernel[1]}s{op.stride[0]}p{op.padding[0]}"
    if isinstance(op, Conv2d):
        return (f"{op.kernel[0]}x{op.kernel[1]}s{op.stride[0]}{op.stride[1]}p{op.padding[0]}{op.padding[1]}"
                f"{'-relu' if op.activation else ''}{'' if op.bias else '-nobias'}")
    return f"linear{op.out_features}{'-relu' if op.activation else ''}{'' if op.bias else '-nobias'}"


def rel_error(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape
    return float(np.max(np.abs(a - b), initial=0.0) / max(np.max(np.abs(b), initial=0.0), 1e-300))


def grid_partition(shape, degrees):
    """Rects of a grid split of `shape` (blocks as equal as possible, first ones larger)."""
    bounds = []
    for size, d in zip(shape, degrees):
        d = min(d, size)
        q, r = divmod(size, d)
        edges = np.cumsum([0] + [q + (i < r) for i in range(d)])
        bounds.append(list(zip(edges[:-1], edges[1:])))
    for combo in np.ndindex(*[len(b) for b in bounds]):
        yield Rect.from_ranges(bounds[dim][i] for dim, i in enumerate(combo))


def random_case(op, rng):
    x = rng.standard_normal(op.in_shapes[0])
    params = {k: rng.standard_normal(s) * 0.5 for k, s in op.param_shapes().items()}
    return x, params, rng.standard_normal(op.out_shape)


def check_tiles(op, degrees, dtype, seed=0, to_device=np.asarray, to_host=np.asarray, kernels="torch"):
    """Every tile computed by `kernels` (on device arrays of `dtype`) against the float64 numpy reference:
    its output against the slice of the whole output, its gradients against the reference's gradients of
    the same tile, and the scatter-sum of its input and parameter gradients against the whole ones."""
    x, params, dy = random_case(op, np.random.default_rng(seed))
    whole = Rect.full(op.out_shape)
    with torch_kernels.backend("reference"):
        y = op.forward([x], params, whole)
        (dx_whole,), dp_whole = op.backward(dy, [x], y, params, whole, [True])
    tol = TOLERANCE[dtype]
    dx_sum = np.zeros_like(x)
    dp_sum = {k: np.zeros_like(v) for k, v in params.items()}
    for out in grid_partition(op.out_shape, degrees):
        x_rect = op.input_rects(out)[0]
        x_tile = x[x_rect.relative_to(Rect.full(x.shape))]
        p_tile = {k: params[k][r.relative_to(Rect.full(params[k].shape))] for k, r in op.param_rects(out).items()}
        sl = out.relative_to(whole)
        with torch_kernels.backend("reference"):
            (dx_ref,), dp_ref = op.backward(dy[sl], [x_tile], y[sl], p_tile, out, [True])

        def dev(a):
            return to_device(np.ascontiguousarray(a, dtype=dtype))

        # Both sides get the same y, so a fused relu masks the same elements.
        xt, pt = dev(x_tile), {k: dev(v) for k, v in p_tile.items()}
        with torch_kernels.backend(kernels):
            y_tile = op.forward([xt], pt, out)
            (dx_tile,), dp_tile = op.backward(dev(dy[sl]), [xt], dev(y[sl]), pt, out, [True])
        assert y_tile.dtype == dtype and dx_tile.dtype == dtype
        assert rel_error(to_host(y_tile), y[sl]) < tol, f"forward of tile {out}"
        assert rel_error(to_host(dx_tile), dx_ref) < tol, f"input gradient of tile {out}"
        assert set(dp_tile) == set(dp_ref)
        for k in dp_ref:
            assert rel_error(to_host(dp_tile[k]), dp_ref[k]) < tol, f"{k} gradient of tile {out}"
        dx_sum[x_rect.relative_to(Rect.full(x.shape))] += to_host(dx_tile)
        for k, rect in op.param_rects(out).items():
            dp_sum[k][rect.relative_to(Rect.full(params[k].shape))] += to_host(dp_tile[k])
    assert rel_error(dx_sum, dx_whole) < tol
    for k in params:
        assert rel_error(dp_sum[k], dp_whole[k]) < tol


# ---- the torch path on CPU (forced on numpy arrays) --------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("op", CONVS, ids=op_id)
def test_conv_tiles_match_reference(op, dtype):
    for degrees in TILINGS:
        check_tiles(op, degrees, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("op", LINEARS, ids=op_id)
def test_linear_tiles_match_reference(op, dtype):
    for degrees in [(1, 1), (2, 3), (5, 1)]:
        check_tiles(op, degrees, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("op", POOLS, ids=op_id)
def test_pool_tiles_match_reference(op, dtype):
    """Border tiles pad unequally (explicit padding, then cropped from the gradient); inner ones not at all."""
    for degrees in TILINGS:
        check_tiles(op, degrees, dtype)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_relu_and_loss_match_reference(dtype):
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal((3, 4, 5, 5)).astype(dtype), rng.standard_normal((3, 4, 5, 5)).astype(dtype)
    relu = Relu(((3, 4, 5, 5),))
    whole = Rect.full((3, 4, 5, 5))
    results = {}
    for kernels in ("reference", "torch"):
        with torch_kernels.backend(kernels):
            results[kernels] = (relu.forward([x], {}, whole), relu.backward(dy, [x], None, {}, whole, [True])[0][0])
    for a, b in zip(results["torch"], results["reference"]):
        assert a.dtype == dtype and rel_error(a, b) < TOLERANCE[dtype]
    loss = SoftmaxCrossEntropy(((6, 7), (6,)))
    logits, labels = rng.standard_normal((6, 7)).astype(dtype), rng.integers(0, 7, 6)
    dl = np.full(6, 1 / 6, dtype=dtype)
    rows = Rect.full((6,))
    for kernels in ("reference", "torch"):
        with torch_kernels.backend(kernels):
            results[kernels] = (loss.forward([logits, labels], {}, rows),
                                loss.backward(dl, [logits, labels], None, {}, rows, [True, False])[0][0])
    for a, b in zip(results["torch"], results["reference"]):
        assert a.dtype == dtype and rel_error(a, b) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape, parts", [((6, 4, 5, 3), [(0, 2), (2, 6)]), ((7, 3), [(0, 3), (3, 5), (5, 7)])])
def test_batch_norm_pieces_match_reference(shape, parts, dtype):
    """The pieces a split over samples runs (partial statistics per part, combined; normalize, gradient sums
    and input gradient per part with the group's sums), torch against the array kernels."""
    rng = np.random.default_rng(2)
    op = BatchNorm((shape,))
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    params = {k: rng.standard_normal(shape[1]).astype(dtype) for k in ("weight", "bias")}
    results = {}
    for kernels in ("reference", "torch"):
        with torch_kernels.backend(kernels):
            tiles = [(x[lo:hi], dy[lo:hi]) for lo, hi in parts]
            stats = combine_stats([partial_stats(t) for t, _ in tiles])
            part_sums = [op.grad_sums(g, t, stats) for t, g in tiles]
            sums = {k: sum(s[k] for s in part_sums) for k in ("weight", "bias")}
            results[kernels] = [stats, *[op.normalize(t, stats, params) for t, _ in tiles], sums["weight"],
                                sums["bias"], *[op.input_grad(g, t, stats, sums, params) for t, g in tiles]]
    for a, b in zip(results["torch"], results["reference"]):
        assert a.dtype == dtype and rel_error(a, b) < TOLERANCE[dtype]


@pytest.mark.parametrize("make", [
    lambda: models.alexnet(batch=2, image_size=67, num_classes=5, width=1 / 16),  # the 11x11 stride-4 stem
    lambda: models.inception_v3(batch=1, image_size=75, num_classes=5, width=1 / 16),
    lambda: models.splitbrain_vgg(batch=2, image_size=16, width=1 / 16),  # no biases anywhere
], ids=["alexnet", "inception_v3", "splitbrain_vgg"])
def test_whole_network_through_torch_matches_reference(make):
    """The dispatch inside a network: every conv and linear layer on the torch path, float64."""
    graph = make()
    rng = np.random.default_rng(0)
    x = rng.standard_normal(graph.inputs[0].shape)
    y = rng.integers(0, graph[graph.losses[0].inputs[0]].shape[1], graph.inputs[1].shape)
    trainer = SingleDeviceTrainer(graph, dtype="float64", seed=0)
    with torch_kernels.backend("reference"):
        loss, grads = trainer.loss(x, y), trainer.gradients(x, y)
    with torch_kernels.backend("torch"):
        assert abs(trainer.loss(x, y) - loss) < 1e-10 * abs(loss)
        torch_grads = trainer.gradients(x, y)
    for layer, expected in grads.items():
        assert torch_grads[layer].keys() == expected.keys()
        for k in expected:
            assert rel_error(torch_grads[layer][k], expected[k]) < 1e-10, f"{layer}.{k}"


@st.composite
def convs_and_tilings(draw):
    kh, kw = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    sh, sw = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    ph, pw = draw(st.integers(0, kh)), draw(st.integers(0, kw))
    h = draw(st.integers(max(1, kh - 2 * ph), 14))
    w = draw(st.integers(max(1, kw - 2 * pw), 14))
    op = Conv2d(((draw(st.integers(1, 3)), draw(st.integers(1, 4)), h, w),), draw(st.integers(1, 4)),
                (kh, kw), (sh, sw), (ph, pw), draw(st.sampled_from([None, "relu"])), draw(st.booleans()))
    degrees = tuple(draw(st.integers(1, s)) for s in op.out_shape)
    return op, degrees


@settings(max_examples=40, deadline=None)
@given(case=convs_and_tilings(), seed=st.integers(0, 2**16))
def test_random_conv_tilings_match_reference(case, seed):
    op, degrees = case
    check_tiles(op, degrees, np.float64, seed)


@settings(max_examples=300, deadline=None)
@given(before=st.integers(0, 6), after=st.integers(0, 6), size=st.integers(0, 20), kernel=st.integers(1, 9),
       stride=st.integers(1, 5))
def test_split_padding_reads_the_same_windows(before, after, size, kernel, stride):
    if size + before + after < kernel:
        return
    padding, (extra_before, extra_after) = torch_kernels.split_padding(before, after, size, kernel, stride)
    assert min(padding, extra_before, extra_after) >= 0
    assert padding + extra_before == before  # windows start at the same place
    out = (size + before + after - kernel) // stride + 1
    assert (size + 2 * padding + extra_before + extra_after - kernel) // stride + 1 == out
    # the last window ends inside the input plus its zeros
    assert (out - 1) * stride + kernel <= size + 2 * padding + extra_before + extra_after


def test_stem_padding_needs_no_copy():
    """AlexNet's conv1 at 224 pads (2, 1): the extra zero row fits no window, so cuDNN pads alone."""
    assert torch_kernels.split_padding(2, 1, 224, 11, 4) == (2, (0, 0))
    assert torch_kernels.split_padding(1, 2, 10, 3, 1) == (1, (0, 1))
    assert torch_kernels.split_padding(2, 0, 10, 3, 1) == (0, (2, 0))
    assert torch_kernels.split_padding(1, 0, 0, 1, 3) == (0, (1, 0))  # a tile of padding only


# ---- dispatch and precision ---------------------------------------------------------------------------
def test_dispatch_uses_the_reference_for_numpy_unless_forced():
    x = np.zeros((1, 1, 3, 3))
    assert torch_kernels.get_backend() == "auto"
    assert not torch_kernels.use_torch(x)
    with torch_kernels.backend("torch"):
        assert torch_kernels.use_torch(x)
    with torch_kernels.backend("reference"):
        assert not torch_kernels.use_torch(x)
    with pytest.raises(ValueError, match="backend must be one of"):
        torch_kernels.set_backend("cudnn")


def test_read_only_inputs_are_accepted():
    op = CONVS[1]
    x, params, _ = random_case(op, np.random.default_rng(0))
    x.flags.writeable = False
    with torch_kernels.backend("reference"):
        expected = op.forward([x], params, Rect.full(op.out_shape))
    with torch_kernels.backend("torch"):
        got = op.forward([x], params, Rect.full(op.out_shape))
    assert rel_error(got, expected) < 1e-10


@pytest.fixture
def restore_precision(monkeypatch):
    """Afterwards: the precision as before, and CUPY_TF32 as before (set_precision writes it)."""
    monkeypatch.setenv("CUPY_TF32", os.environ.get("CUPY_TF32", ""))
    previous = get_precision()
    yield
    set_precision(previous)


def test_set_precision_sets_the_libraries_switches(restore_precision):
    set_precision("tf32")
    assert get_precision() == "tf32"
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    assert os.environ["CUPY_TF32"] == "1"
    assert set_precision("fp32") == "tf32"
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert os.environ["CUPY_TF32"] == "0"


@pytest.mark.parametrize("bad", ["fp16", "TF32", None, 32])
def test_set_precision_rejects_anything_else(bad, restore_precision):
    before = get_precision()
    with pytest.raises(ValueError, match="'fp32'.*'tf32'.*'bf16'"):
        set_precision(bad)
    assert get_precision() == before


@pytest.mark.parametrize("op", [CONVS[1], CONVS[6], LINEARS[1]], ids=op_id)
def test_bf16_computes_in_bfloat16_and_returns_float32(op, restore_precision):
    """Under "bf16" the torch kernels take bfloat16 copies (an 8-bit mantissa: errors near 1e-2 of the
    largest value, not float32's 1e-6) and hand back float32 tiles."""
    x, params, dy = random_case(op, np.random.default_rng(5))
    whole = Rect.full(op.out_shape)
    with torch_kernels.backend("reference"):
        y = op.forward([x], params, whole)
        (dx,), dp = op.backward(dy, [x], y, params, whole, [True])
    f32 = {k: v.astype(np.float32) for k, v in params.items()}
    x32, dy32, y32 = (a.astype(np.float32) for a in (x, dy, y))
    set_precision("bf16")
    with torch_kernels.backend("torch"):
        y_b = op.forward([x32], f32, whole)
        (dx_b,), dp_b = op.backward(dy32, [x32], y32, f32, whole, [True])
    for got, expected in [(y_b, y), (dx_b, dx), (dp_b["weight"], dp["weight"])]:
        assert got.dtype == np.float32
        assert 1e-5 < rel_error(got, expected) < 3e-2  # bfloat16's rounding, not float32's
    if "bias" in dp:  # a sum of the float32 output gradient (a convolution's comes from its bf16 kernel)
        assert rel_error(dp_b["bias"], dp["bias"]) < 3e-2


@contextmanager
def fake_cupy(linalg):
    """A loaded 'cupy' whose _core._routines_linalg is `linalg`, while the block runs."""
    core = types.ModuleType("cupy._core")
    core._routines_linalg = linalg
    cupy = types.ModuleType("cupy")
    cupy._core = core
    with pytest.MonkeyPatch.context() as patch:
        for name, module in (("cupy", cupy), ("cupy._core", core), ("cupy._core._routines_linalg", linalg)):
            patch.setitem(sys.modules, name, module)
        yield


def test_set_precision_sets_cupys_compute_type(restore_precision):
    calls = []
    linalg = types.ModuleType("cupy._core._routines_linalg")
    linalg.COMPUTE_TYPE_DEFAULT, linalg.COMPUTE_TYPE_TF32 = 1, 7
    linalg.set_compute_type = lambda dtype, compute_type: calls.append((np.dtype(dtype), compute_type))
    with fake_cupy(linalg):
        set_precision("tf32")
        set_precision("fp32")
    assert calls == [(np.float32, 7), (np.float32, 1)]


def test_a_cupy_without_the_switch_is_told_through_its_variable(restore_precision):
    with fake_cupy(types.ModuleType("cupy._core._routines_linalg")), pytest.warns(RuntimeWarning, match="CUPY_TF32"):
        set_precision("tf32")
    assert os.environ["CUPY_TF32"] == "1" and get_precision() == "tf32"


def test_set_precision_travels_to_workers():
    """client.run pickles the function by reference: it must be a module-level name."""
    assert pickle.loads(pickle.dumps(ops.precision.set_precision)) is set_precision
    assert ops.set_precision is set_precision and ops.get_precision is get_precision


def test_ops_imports_no_torch_and_a_loaded_torch_is_strict():
    code = (
        "import sys\nfrom taskrt import ops\n"
        "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, 'importing taskrt.ops imported torch'\n"
        "assert ops.get_precision() == 'fp32'\n"
        "torch = ops.torch_kernels.load_torch()\n"
        "assert not torch.backends.cudnn.allow_tf32, 'torch kept its TF32 default for convolutions'\n"
        "assert not torch.backends.cuda.matmul.allow_tf32\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "CUPY_TF32"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr


def test_precision_starts_from_cupys_variable():
    code = "from taskrt import ops; assert ops.get_precision() == 'tf32'"
    env = {**os.environ, "CUPY_TF32": "1"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr


# ---- the same comparisons on a GPU --------------------------------------------------------------------
def cuda_device_present() -> bool:
    """cupy imports and sees at least one CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # cupy without a driver or device raises its own CUDA errors
        return False


requires_gpu = pytest.mark.skipif(not cuda_device_present(), reason="needs cupy and a CUDA device")


@pytest.mark.gpu
@requires_gpu
class TestOnGpu:
    """`auto` on cupy arrays is the torch path (cuDNN) when torch has CUDA; `reference` is cupy's im2col."""

    @pytest.fixture(autouse=True)
    def cupy(self, restore_precision):
        import cupy

        set_precision("fp32")
        return cupy

    @pytest.mark.parametrize("kernels", ["auto", "reference"])
    @pytest.mark.parametrize("dtype", [np.float64, np.float32])
    @pytest.mark.parametrize("op", CONVS + LINEARS + POOLS, ids=op_id)
    def test_tiles_match_reference(self, cupy, op, dtype, kernels):
        degrees = (2, 2) if isinstance(op, Linear) else (2, 2, 2, 2)
        check_tiles(op, degrees, dtype, to_device=cupy.asarray, to_host=cupy.asnumpy, kernels=kernels)

    @pytest.mark.parametrize("dtype", [np.float64, np.float32])
    def test_batch_norm_pieces_on_cuda_match_reference(self, cupy, dtype):
        """The CUDA-only fused kernels (torch's SyncBatchNorm pieces) against the array kernels."""
        rng = np.random.default_rng(3)
        shape = (6, 5, 7, 4)
        op = BatchNorm((shape,))
        x = (rng.standard_normal(shape) * 2 - 1).astype(dtype)
        dy = rng.standard_normal(shape).astype(dtype)
        params = {"weight": rng.standard_normal(5).astype(dtype), "bias": rng.standard_normal(5).astype(dtype)}
        results = {}
        for kernels, move in (("reference", np.asarray), ("auto", cupy.asarray)):
            with torch_kernels.backend(kernels):
                tiles = [(move(x[lo:hi]), move(dy[lo:hi])) for lo, hi in ((0, 4), (4, 6))]
                p = {k: move(v) for k, v in params.items()}
                stats = combine_stats([partial_stats(t) for t, _ in tiles])
                part_sums = [op.grad_sums(g, t, stats) for t, g in tiles]
                sums = {k: part_sums[0][k] + part_sums[1][k] for k in ("weight", "bias")}
                results[kernels] = [stats, *[op.normalize(t, stats, p) for t, _ in tiles], sums["weight"],
                                    sums["bias"], *[op.input_grad(g, t, stats, sums, p) for t, g in tiles]]
        for a, b in zip(results["auto"], results["reference"]):
            assert isinstance(a, cupy.ndarray) and rel_error(cupy.asnumpy(a), b) < TOLERANCE[dtype]

    def test_auto_runs_cudnn_on_cupy_arrays(self, cupy):
        if not torch.cuda.is_available():
            pytest.skip("this torch has no CUDA")
        assert torch_kernels.use_torch(cupy.zeros(3))
        x = cupy.arange(12, dtype=cupy.float32)
        assert torch_kernels.to_tensor(x).data_ptr() == x.data.ptr  # DLPack: no copy

    @pytest.mark.parametrize("kernels", ["auto", "reference"])
    def test_fp32_is_strict(self, cupy, kernels):
        """A 576-long reduction: strict float32 is within 1e-5 of float64; TF32 (10-bit mantissa) is not."""
        op = Conv2d(((8, 64, 28, 28),), 64, (3, 3), (1, 1), (1, 1))
        x, params, _ = random_case(op, np.random.default_rng(0))
        whole = Rect.full(op.out_shape)
        with torch_kernels.backend("reference"):
            expected = op.forward([x], params, whole)
        errors = {}
        for precision in ("fp32", "tf32"):
            set_precision(precision)
            with torch_kernels.backend(kernels):
                got = op.forward([cupy.asarray(x, dtype=np.float32)],
                                 {k: cupy.asarray(v, dtype=np.float32) for k, v in params.items()}, whole)
            errors[precision] = rel_error(cupy.asnumpy(got), expected)
        assert errors["fp32"] < 1e-5, errors
        assert errors["tf32"] < 1e-2, errors
