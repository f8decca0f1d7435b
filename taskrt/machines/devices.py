"""A machine's devices: what each is, the Dask resource tag that pins tasks to it, and the error a
machine raises.  Below `machine` and `local_cluster`, which both need them."""

from __future__ import annotations

from dataclasses import dataclass


class MachineError(RuntimeError):
    """A cluster that cannot serve as a machine, or a device that was lost."""


class DeviceMemoryError(MemoryError):
    """A strategy's step does not fit a device's memory: predicted before any step, or found when
    a device ran out of it.  `devices`: the devices (numbered on the whole machine) it names."""

    def __init__(self, message: str, devices=()):
        super().__init__(message)
        self.devices = tuple(devices)

    def __reduce__(self):
        return (type(self), (str(self), self.devices))


@dataclass(frozen=True)
class Device:
    id: int
    node: int
    kind: str
    memory: float | None  # bytes available to tasks, if known


def resource_tag(device: int) -> str:
    """The resource tag of `device`: survives a nanny restarting its worker on a new port."""
    return f"dev{device}"
