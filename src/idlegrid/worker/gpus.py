"""Each GPU of this machine on its own: what it is (index, name, memory, backend), and how
much of it other programs use.

The list comes from the vendor's own interface where it answers: NVML (nvidia-ml-py) for
NVIDIA, ROCm SMI (`rocm-smi --json`) for AMD; torch's CUDA and MPS lists fill in where
neither does (worker/hardware.py). The indices are the ones the torch device strings use
(`cuda:1`), so a task placed on a device runs on the GPU the volunteer sees listed.

Other programs' use is what the idle policy reads to step aside on a GPU that a game or
another job is using, as it does for the CPU: NVML reports each process's share, so the
worker's own tasks are left out exactly; ROCm SMI and Apple's counters (ioreg's
`Device Utilization %`) report the device's whole use, which counts as others' only while
no task of the worker runs on it (otherwise the reading is "cannot tell").
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

from idlegrid.protocol import Gpu

log = logging.getLogger(__name__)

_MAX_TEXT = 200
_MB = 2**20
# A reader of other programs' use: (own process ids) -> {device index: percent}.
UseReader = Callable[[Collection[int]], dict[int, float]]


def _nvml() -> ModuleType | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # NVMLError: no driver, or no NVIDIA GPU
        return None
    return pynvml


def _text(value: bytes | str) -> str:
    return (value.decode(errors="replace") if isinstance(value, bytes) else str(value))[:_MAX_TEXT]


def nvml_gpus(nvml: Any) -> list[Gpu]:
    """NVIDIA GPUs in NVML's order (CUDA's too, with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total // _MB)
        name = _text(nvml.nvmlDeviceGetName(handle))
        gpus.append(Gpu(index=index, backend="cuda", name=name, memory_mb=memory))
    return gpus


def nvml_other_use(nvml: Any, own_pids: Collection[int]) -> dict[int, float]:
    """Per NVIDIA GPU, the percent of its time that processes other than `own_pids` used
    over the last sampling window."""
    use = {}
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, 0)
            use[index] = float(min(100, sum(s.smUtil for s in samples if s.pid not in own_pids)))
            continue
        except nvml.NVMLError:
            pass  # no samples (nothing ran), or not supported: judge by the processes
        total = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        holders = {
            p.pid
            for query in (nvml.nvmlDeviceGetComputeRunningProcesses,
                          nvml.nvmlDeviceGetGraphicsRunningProcesses)
            for p in query(handle)
        }  # fmt: skip
        use[index] = total if holders - set(own_pids) else 0.0
    return use


def rocm_smi(*args: str, run: Callable[..., Any] = subprocess.run) -> dict[str, Any]:
    """`rocm-smi ARGS --json` as a dict ({} without ROCm or on any failure)."""
    if run is subprocess.run and shutil.which("rocm-smi") is None:
        return {}
    try:
        done = run(["rocm-smi", *args, "--json"], capture_output=True, text=True, timeout=10)
        data = json.loads(done.stdout) if done.returncode == 0 else {}
    except (OSError, ValueError, subprocess.SubprocessError):
        return {}
    return data if isinstance(data, dict) else {}


def _card_index(key: str) -> int | None:
    match = re.fullmatch(r"card(\d+)", key)
    return int(match.group(1)) if match else None


def rocm_gpus(info: dict[str, Any]) -> list[Gpu]:
    """AMD GPUs from `rocm-smi --showproductname --showmeminfo vram --json`."""
    gpus = []
    for key, card in sorted(info.items()):
        index = _card_index(key)
        if index is None or not isinstance(card, dict):
            continue
        name = card.get("Card Series") or card.get("Card series") or card.get("Card model")
        memory = card.get("VRAM Total Memory (B)", "0")
        gpus.append(
            Gpu(index=index, backend="rocm", name=_text(str(name or f"AMD GPU {index}")),
                memory_mb=int(str(memory)) // _MB if str(memory).isdigit() else 0)
        )  # fmt: skip
    return gpus


def rocm_use(info: dict[str, Any]) -> dict[int, float]:
    """Each AMD GPU's whole use, from `rocm-smi --showuse --json`."""
    use = {}
    for key, card in info.items():
        index = _card_index(key)
        value = card.get("GPU use (%)") if isinstance(card, dict) else None
        if index is not None and value is not None and str(value).isdigit():
            use[index] = float(value)
    return use


_APPLE_USE = re.compile(r'"Device Utilization %"\s*=\s*(\d+)')


def apple_use(ioreg_output: str) -> dict[int, float]:
    """Apple GPUs' whole use, from `ioreg -r -d 1 -w 0 -c IOAccelerator`."""
    return {index: float(m.group(1)) for index, m in enumerate(_APPLE_USE.finditer(ioreg_output))}


def listed_gpus() -> list[Gpu]:
    """This machine's GPUs from NVML or ROCm SMI; [] when neither answers."""
    nvml = _nvml()
    if nvml is not None:
        try:
            return nvml_gpus(nvml)
        except Exception:  # a driver that answers init but not the queries
            log.warning("NVML could not list the GPUs", exc_info=True)
    return rocm_gpus(rocm_smi("--showproductname", "--showmeminfo", "vram"))


def use_reader(backend: str) -> UseReader | None:
    """Other programs' use of each GPU of `backend`, or None where nothing can tell."""
    if backend == "cuda":
        nvml = _nvml()
        return None if nvml is None else (lambda own: nvml_other_use(nvml, own))
    if backend == "rocm" and shutil.which("rocm-smi"):
        return _whole_use(lambda: rocm_use(rocm_smi("--showuse")))
    if backend == "mps" and shutil.which("ioreg"):
        command = ["ioreg", "-r", "-d", "1", "-w", "0", "-c", "IOAccelerator"]
        return _whole_use(
            lambda: apple_use(subprocess.run(command, capture_output=True, text=True).stdout)
        )
    return None


def combined(readers: Collection[UseReader]) -> UseReader:
    """One reader over several backends' (a machine with NVIDIA and AMD GPUs)."""

    def reader(own_pids: Collection[int]) -> dict[int, float]:
        use: dict[int, float] = {}
        for read in readers:
            use.update(read(own_pids))
        return use

    return next(iter(readers)) if len(readers) == 1 else reader


def _whole_use(read: Callable[[], dict[int, float]]) -> UseReader:
    """A device's whole use counts as others' only while none of our tasks runs."""

    def reader(own_pids: Collection[int]) -> dict[int, float]:
        return {} if own_pids else read()

    return reader


def device_index(device: str) -> int | None:
    """The GPU index of a torch device string: "cuda:1" -> 1, "cuda"/"mps" -> 0."""
    kind, _, number = device.partition(":")
    if kind == "cpu":
        return None
    return int(number) if number.isdigit() else 0
