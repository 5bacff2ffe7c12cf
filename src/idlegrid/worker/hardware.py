"""What this machine has: OS, CPU, memory and each GPU (worker/gpus.py lists them).

torch is optional on a node (a CPU-only volunteer may run kinds that need no torch), so it
is imported inside `probe`, and any failure of it degrades to a CPU-only profile.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from pathlib import Path
from types import ModuleType
from typing import Literal

import psutil

from idlegrid.protocol import Gpu, HardwareProfile, LlamaInfo
from idlegrid.worker.gpus import listed_gpus

log = logging.getLogger(__name__)

_MAX_TEXT = 200  # the profile's string fields are capped at 200 characters
_MB = 2**20


def probe(disk_path: Path | None = None) -> HardwareProfile:
    """Describe this machine. Never raises because of torch: without it, reports CPU only.

    `disk_path`: where the worker keeps its blobs, whose free space is reported.
    """
    gpus, torch_version = _probe_torch()
    # The vendor's own list (NVML, ROCm SMI) names and sizes each GPU best; torch's list
    # stands in where neither answers, and is the only one for Apple's GPU.
    vendor = listed_gpus()
    if vendor:
        gpus = [*vendor, *(gpu for gpu in gpus if gpu.backend == "mps")]
    return HardwareProfile(
        os=platform.platform()[:_MAX_TEXT],
        cpu_model=cpu_model()[:_MAX_TEXT],
        cpu_cores=cpu_cores(),
        memory_mb=memory_mb(),
        gpus=gpus,
        torch_version=torch_version,
        disk_free_mb=disk_free_mb(disk_path or Path.home()),
        onnx_providers=onnx_providers(),
        onnx_opset=onnx_opset(),
        llama=llama_info(),
    )


def llama_info() -> LlamaInfo | None:
    """This node's llama.cpp: backend, device and its memory; None when it is absent."""
    try:
        import llama_cpp
    except Exception:  # noqa: BLE001 - a broken build is a node without llama.cpp
        return None
    from idlegrid.kinds.llm_generate.runtime import backend, build, devices

    found = devices()
    name, memory = found[0] if found else (cpu_model(), memory_mb())
    return LlamaInfo(
        backend=backend(),
        device=name[:_MAX_TEXT],
        memory_mb=memory,
        version=str(getattr(llama_cpp, "__version__", ""))[:50],
        build=build()[:500],
    )


def disk_free_mb(path: Path) -> int | None:
    """Free MiB on the file system holding `path` (or its nearest existing parent)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return int(shutil.disk_usage(candidate).free // _MB)
            except OSError:
                return None
    return None


def onnx_providers() -> list[str]:
    """Execution providers ONNX Runtime offers here; empty when it is absent or broken."""
    try:
        import onnxruntime
    except Exception:  # absent or broken: either way this node runs no ONNX kind
        return []
    return [str(name)[:_MAX_TEXT] for name in onnxruntime.get_available_providers()][:32]


def onnx_opset(highest: int = 64) -> int | None:
    """Newest default-domain opset this machine's ONNX Runtime loads (None without one).

    ONNX Runtime has no call that tells; it refuses to load a model stamped with an opset
    it does not know, so a one-node model is loaded at each candidate (a binary search,
    milliseconds in all).
    """
    try:
        import onnxruntime
    except Exception:  # absent or broken: no ONNX kind runs here
        return None
    if not _loads_opset(onnxruntime, 7):
        return None
    low, high = 7, highest  # low loads; find the last that does
    while low < high:
        middle = (low + high + 1) // 2
        if _loads_opset(onnxruntime, middle):
            low = middle
        else:
            high = middle - 1
    return low


def _loads_opset(onnxruntime: ModuleType, opset: int) -> bool:
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7  # old enough for every runtime this kind supports
    options = onnxruntime.SessionOptions()
    options.log_severity_level = 4
    try:
        onnxruntime.InferenceSession(
            model.SerializeToString(), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception:  # the runtime's own error type: "opset N is not supported"
        return False
    return True


def best_device(profile: HardwareProfile) -> str:
    """The torch device string to run on: a GPU when the profile has one, else "cpu"."""
    backends = profile.backends
    # ROCm builds of torch expose AMD GPUs under the "cuda" device type.
    if "cuda" in backends or "rocm" in backends:
        return "cuda"
    if "mps" in backends:
        return "mps"
    return "cpu"


def backend_of(device: str) -> str:
    """The backend name ("cpu", "cuda", "rocm", "mps") of a torch device string."""
    device_type = device.split(":", 1)[0]
    if device_type == "cuda" and _torch_is_rocm():
        return "rocm"
    return device_type


def cpu_model() -> str:
    """The CPU's marketing name, or the best the platform offers."""
    return _cpuinfo_model_name() or platform.processor() or platform.machine() or "unknown"


def cpu_cores() -> int:
    """Logical cores this process may use (the container's share where it is limited)."""
    if hasattr(os, "sched_getaffinity"):
        count = len(os.sched_getaffinity(0))
    else:
        count = os.cpu_count() or psutil.cpu_count(logical=True) or 1
    return max(1, min(count, 4096))


def memory_mb() -> int:
    """Total physical memory in MiB."""
    return int(psutil.virtual_memory().total // _MB)


def _cpuinfo_model_name(path: Path = Path("/proc/cpuinfo")) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return ""


def _probe_torch() -> tuple[list[Gpu], str | None]:
    torch = _import_torch()
    if torch is None:
        return [], None
    try:
        gpus = [*_cuda_gpus(torch), *_mps_gpus(torch)]
    except Exception:
        # A broken driver must not keep a volunteer's CPU out of the pool.
        log.warning("torch could not list its devices; reporting CPU only", exc_info=True)
        gpus = []
    return gpus, str(torch.__version__)[:100]


def _import_torch() -> ModuleType | None:
    try:
        import torch
    except ImportError:
        log.info("torch is not installed; reporting CPU only")
        return None
    except Exception:
        log.warning("torch is installed but fails to import; reporting CPU only", exc_info=True)
        return None
    return torch


def _cuda_gpus(torch: ModuleType) -> list[Gpu]:
    if not torch.cuda.is_available():
        return []
    backend: Literal["cuda", "rocm"] = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    gpus = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        gpus.append(
            Gpu(
                index=index,
                backend=backend,
                name=str(properties.name)[:_MAX_TEXT],
                memory_mb=int(properties.total_memory // _MB),
            )
        )
    return gpus


def _mps_gpus(torch: ModuleType) -> list[Gpu]:
    mps = getattr(torch.backends, "mps", None)
    if mps is None or not mps.is_available():
        return []
    # Apple GPUs share the machine's unified memory; torch reports no separate figure,
    # so the total RAM is the honest upper bound.
    name = f"Apple GPU ({cpu_model()})"[:_MAX_TEXT]
    return [Gpu(index=0, backend="mps", name=name, memory_mb=memory_mb())]


def _torch_is_rocm() -> bool:
    torch = _import_torch()
    return torch is not None and bool(getattr(torch.version, "hip", None))
