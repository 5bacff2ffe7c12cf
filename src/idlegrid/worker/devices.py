"""The worker's slots follow its devices: one task at a time on each GPU, plus CPU slots.

Each slot is a task process bound to one device for its life. A GPU slot's process sees
only its own GPU (`CUDA_VISIBLE_DEVICES`, `HIP_VISIBLE_DEVICES`, set before anything in
it starts CUDA or ROCm), so every runtime in it (torch, ONNX Runtime, llama.cpp) uses that
GPU and no other, and the kind is handed the first visible device. A CPU slot's process
sees no GPU at all: a llama.cpp or torch build with CUDA would otherwise offload to one.
Apple's GPU cannot be hidden; an `mps` slot is the machine's one GPU.

The indices are those NVML and ROCm SMI list (worker/gpus.py), in PCI bus order, which
`CUDA_DEVICE_ORDER=PCI_BUS_ID` makes CUDA's order too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from idlegrid.protocol import Gpu

CPU = "cpu"


class DeviceError(ValueError):
    """A device the settings name that this machine does not have; the message names it."""


@dataclass(frozen=True)
class Device:
    """Where a slot's tasks run: "cpu", or one GPU by its listed index and backend."""

    backend: str  # "cpu", "cuda", "rocm", "mps"
    index: int | None = None  # the GPU's listed index; None for the CPU
    name: str = ""

    @property
    def label(self) -> str:
        """The device as the pages and the coordinator name it: "cpu", "cuda:1", "mps:0"."""
        return CPU if self.index is None else f"{self.backend}:{self.index}"

    @property
    def gpu(self) -> bool:
        return self.index is not None

    def environment(self) -> dict[str, str]:
        """What the slot's process sets before it starts: which GPUs it may see."""
        if self.backend == "cuda":
            return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(self.index)}
        if self.backend == "rocm":
            return {"HIP_VISIBLE_DEVICES": str(self.index), "CUDA_VISIBLE_DEVICES": ""}
        if self.backend == "mps":
            return {}
        return {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}

    def runtime_device(self) -> str:
        """The torch device string a kind gets inside the slot's process (ROCm builds of
        torch name AMD GPUs "cuda"); its one visible GPU is device 0."""
        if self.backend in ("cuda", "rocm"):
            return "cuda:0"
        return "mps" if self.backend == "mps" else CPU


CPU_DEVICE = Device(CPU)


def plan_slots(gpus: Sequence[Gpu], *, cpu_slots: int, device: str | None) -> list[Device]:
    """The device of each slot: every GPU once, then `cpu_slots` CPU slots; with `device`
    set ("cpu", "cuda:1"), `cpu_slots` slots all on that device (DeviceError: none such)."""
    if cpu_slots < 0:
        raise DeviceError(f"slots: {cpu_slots} is negative")
    listed = [Device(gpu.backend, gpu.index, gpu.name) for gpu in gpus]
    if device:
        return [named_device(device, listed)] * max(1, cpu_slots)
    planned = [*listed, *[Device(CPU)] * cpu_slots]
    if not planned:
        raise DeviceError("slots: 0 CPU slots and no GPU: nothing would run")
    return planned


def named_device(device: str, listed: Sequence[Device]) -> Device:
    """The listed device `device` names ("cpu", "cuda", "cuda:1", "rocm:0", "mps")."""
    kind, _, number = device.partition(":")
    if kind == CPU and not number:
        return Device(CPU)
    if number and not number.isdigit():
        raise DeviceError(f"device {device!r}: not cpu or BACKEND:INDEX (cuda:1)")
    index = int(number) if number else None
    for found in listed:
        if kind in (found.backend, "cuda" if found.backend == "rocm" else found.backend) and (
            index is None or found.index == index
        ):
            return found
    raise DeviceError(f"device {device!r}: this machine has no such GPU ({_listing(listed)})")


def check_gpu_indices(indices: Sequence[int], gpus: Sequence[int], *, setting: str) -> None:
    """DeviceError naming the first index that is not one of this node's GPUs."""
    for index in indices:
        if index not in gpus:
            has = ", ".join(str(i) for i in sorted(gpus)) or "none"
            raise DeviceError(f"{setting}: this node has no GPU {index} (its GPUs: {has})")


def _listing(listed: Sequence[Device]) -> str:
    gpus = [device.label for device in listed]
    return "its GPUs: " + ", ".join(gpus) if gpus else "it has no GPU"
