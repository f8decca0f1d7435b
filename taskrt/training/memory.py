"""Memory per device, a part of the Trainer: each device's predicted peak of a step
(`taskrt.planning.peak`) beside what its worker measured (`taskrt.execution.held`), the check that
a strategy fits before any step, and what the trainer says when a device runs out anyway.

    use = trainer.memory()[0]          # MemoryUse
    use.predicted.total, use.measured, use.measured_max, use.capacity
    print(summary(trainer.memory()))   # predicted by kind against measured, per device

A trainer whose strategy's predicted peak, with its kernels' scratch on top (`PeakMemory.needed`),
exceeds a device's memory (`Device.memory`: a CPU
worker's memory_limit, a GPU's memory; None: not checked) raises DeviceMemoryError before any step
(`Trainer(..., check_memory=False)` trains anyway); so does a strategy re-planned after a lost
worker.  A step that runs out of memory on its worker (an allocator's MemoryError, torch's or
cupy's out-of-memory error), or whose worker a Dask nanny restarts for going over its
memory_limit, raises DeviceMemoryError naming the device and the step; the parameters are those
of the last finished step.
"""

from __future__ import annotations

from dataclasses import dataclass

from taskrt.machines.devices import DeviceMemoryError
from taskrt.planning.peak import KINDS, PeakMemory

MIB = 2**20
MEMORY_EVENTS = "worker-restart-memory"  # the scheduler's topic for a nanny restarting a worker over its memory_limit
ADVICE = ("Search for a strategy that fits (taskrt.search.optimize(graph, machine, memory=...)), use more "
          "devices, or a smaller batch.")


@dataclass(frozen=True)
class MemoryUse:
    """One device's memory in a training step: `predicted` (its peak by kind, `taskrt.planning.peak`),
    `measured` (the most the last finished step's values held on its worker, counted as predicted;
    None before any), `measured_max` (the most over the steps so far), `allocated` (on a GPU
    worker: the allocator's peak over the last finished step, kernels' temporaries included; None
    elsewhere) and `capacity` (the device's memory; None when unknown), in bytes."""

    predicted: PeakMemory
    measured: int | None = None
    measured_max: int | None = None
    allocated: int | None = None
    capacity: float | None = None

    @property
    def observed(self) -> int | None:
        """The last step's peak as shown: a GPU allocator's where measured, else the held values."""
        return self.allocated if self.allocated is not None else self.measured

    def to_dict(self) -> dict:
        return {"predicted": self.predicted.to_dict(), "measured": self.measured, "measured_max": self.measured_max,
                "allocated": self.allocated, "capacity": self.capacity}


def summary(memory: dict) -> str:
    """One line per device (MiB): the predicted peak by kind and in all, the last step's measured
    peak and the most so far, the kernels' scratch on top of the predicted peak, the device's memory."""
    short = {"parameters": "params", "optimizer": "optim", "activations": "activ", "gradients": "grads",
             "transfers": "transfer", "workspace": "work"}
    rows = ["predicted peak by kind, against the peak measured on the workers; the kernels' scratch on top "
            "of the peak and the device's memory (MiB):",
            f"{'device':>6} " + " ".join(f"{short[k]:>9}" for k in KINDS)
            + f" {'predicted':>10} {'measured':>9} {'max':>9} {'scratch':>9} {'capacity':>9}"]
    for device, use in memory.items():
        p = use.predicted
        rows.append(f"{device:>6} " + " ".join(f"{getattr(p, k) / MIB:9.2f}" for k in KINDS)
                    + f" {p.total / MIB:10.2f} {_mib(use.observed, 9)} {_mib(use.measured_max, 9)}"
                    + f" {p.scratch / MIB:9.2f} {_mib(use.capacity, 9)}")
    if any(use.allocated is not None for use in memory.values()):
        rows.append("(measured on GPU devices: the allocator's peak, kernels' temporaries included)")
    return "\n".join(rows)


def _mib(value, width: int) -> str:
    return f"{value / MIB:{width}.2f}" if value is not None else f"{'-':>{width}}"


def described(peak: PeakMemory, layers: int = 3) -> str:
    """The largest kinds and the layers holding most at a predicted peak, and where it is."""
    kinds = ", ".join(f"{kind} {nbytes / MIB:.1f}" for kind, nbytes in peak.kinds()[:4])
    most = ", ".join(f"{layer} {nbytes / MIB:.1f}" for layer, nbytes in peak.layers[:layers])
    return f"{kinds} MiB; layers holding most: {most} MiB; the peak is {where(peak.at)}"


def where(at) -> str:
    """Where in the step a predicted peak is (`PeakMemory.at`), in words."""
    if at is None:
        return "at the step's start"
    if at[0] == "recv":
        return f"as {at[1].key!r} arrives from another device"
    return f"while task {at!r} runs"


def check_fits(peaks: dict, machine, numbering, graph_name: str, strategy_name: str, replanned: bool = False) -> None:
    """Raise DeviceMemoryError naming each device whose predicted peak with its kernels' scratch
    (`peaks`: {device: PeakMemory}; `PeakMemory.needed`) exceeds its memory on `machine`;
    `numbering[d]`: device d's number on the whole machine (what the message says)."""
    over = {d: peak for d, peak in peaks.items()
            if machine.devices[d].memory is not None and peak.needed > machine.devices[d].memory}
    if not over:
        return
    lines = [f"device {numbering[d]}: predicted peak {peak.total / MIB:.1f} MiB held + {peak.scratch / MIB:.1f} MiB "
             f"of kernels' scratch{_scratch_at(peak)} = {peak.needed / MIB:.1f} MiB against its memory "
             f"{machine.devices[d].memory / MIB:.1f} MiB ({described(peak)})" for d, peak in over.items()]
    what = f"{graph_name} under strategy {strategy_name!r}" if strategy_name else graph_name
    when = ", re-planned on the devices left after a lost worker," if replanned else ""
    raise DeviceMemoryError(
        f"{what}{when} does not fit the memory of {len(over)} device(s), before any step:\n  " + "\n  ".join(lines)
        + f"\n{ADVICE} (Trainer(..., check_memory=False) trains anyway.)",
        devices=[numbering[d] for d in over])


def _scratch_at(peak: PeakMemory) -> str:
    return f" (while task {peak.scratch_at!r} runs)" if peak.scratch_at is not None else ""


def ran_out(device: int, step, cause: str, use: MemoryUse | None, good_step: int,
            kept: str | None = None) -> DeviceMemoryError:
    """The error of a step that ran out of memory on `device` (its number on the whole machine);
    `kept`: what became of the parameters (None: those of `good_step`, the last finished step)."""
    if use is None:
        figures = "nothing predicted or measured for it"
    else:
        last = (f"last measured peak {use.measured / MIB:.1f} MiB (at most {use.measured_max / MIB:.1f} MiB so far)"
                if use.measured is not None else "no step measured yet")
        capacity = f" of its {use.capacity / MIB:.1f} MiB" if use.capacity else ""
        figures = f"predicted peak {use.predicted.total / MIB:.1f} MiB{capacity}, {last}"
    kept = kept or (f"The step and those sent after it never happened: the parameters are those after step "
                    f"{good_step}, the last finished step.")
    return DeviceMemoryError(f"device {device} ran out of memory in step {step} ({cause}); {figures}. {kept} {ADVICE}",
                             devices=[device])


def memory_kills(client) -> set:
    """(time, worker address) of each restart of a worker by its Dask nanny for going over its
    memory_limit that the scheduler has heard of (empty where it cannot say)."""
    try:
        return {(t, event.get("worker")) for t, event in client.get_events(MEMORY_EVENTS)}
    except Exception:  # noqa: BLE001  (an old scheduler, or none: no restart heard of)
        return set()
