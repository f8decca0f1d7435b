"""Every torchvision family of `bench zoo` imported with its code unchanged: one SGD step on one device
in float64 equals PyTorch's (loss, every parameter's update, running statistics, the batch counts)
within 1e-9 relative, dropout and stochastic depth given taskrt's masks on both sides."""

from __future__ import annotations

import pytest

pytest.importorskip("torchvision.models")

from taskrt.bench.zoo import FAMILIES, ZOO_EQUAL, equality_row  # noqa: E402

# the smaller families run by default; the rest (seconds to tens of seconds each) with -m slow
QUICK = {"resnet18", "squeezenet1_0", "mobilenet_v2", "mnasnet0_5", "shufflenet_v2_x0_5"}


@pytest.mark.parametrize("family", [f if f in QUICK else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def test_one_float64_step_equals_pytorchs(family):
    row = equality_row(family)
    assert row["keys_equal"] and row["batches_tracked"], row
    assert max(row["loss_rel"], row["param_rel"], row["running_rel"]) <= ZOO_EQUAL, row
    assert row["equal"]
