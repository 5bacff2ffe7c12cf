"""ONNX Runtime on the worker: the best execution provider a node has, one session a model.

ONNX Runtime is the worker's dependency (the `worker` extra), imported inside functions
only: the coordinator imports the kinds but never runs a model.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Best first: a node runs a model on the first of these it has (and that the job allows);
# ONNX Runtime places operators a GPU provider lacks on the CPU provider after it.
PREFERENCE = (
    "CUDAExecutionProvider",
    "ROCMExecutionProvider",
    "MIGraphXExecutionProvider",
    "CoreMLExecutionProvider",
    "DmlExecutionProvider",
    "OpenVINOExecutionProvider",
    "CPUExecutionProvider",
)
CPU = "CPUExecutionProvider"
# Options that keep float32 float32: TF32 matmuls on NVIDIA GPUs differ from float32 by
# ~1e-3 relative, past the kind's tolerance (docs/verification.md).
PROVIDER_OPTIONS: dict[str, dict[str, str]] = {"CUDAExecutionProvider": {"use_tf32": "0"}}
SESSIONS_KEPT = 4


def compute_providers(available: Iterable[str]) -> list[str]:
    """The execution providers of `available` that run models, best first."""
    have = set(available)
    return [name for name in PREFERENCE if name in have]


def choose_providers(available: Iterable[str], allowed: Sequence[str] = ()) -> list[str]:
    """Providers to open a session with: the best allowed one, then CPU as the fallback
    for operators it lacks (when the job allows CPU). Empty when none is usable."""
    usable = [p for p in compute_providers(available) if not allowed or p in allowed]
    if not usable:
        return []
    chosen = [usable[0]]
    if usable[0] != CPU and CPU in usable:
        chosen.append(CPU)
    return chosen


@dataclass(frozen=True)
class SessionKey:
    model_hash: str
    providers: tuple[str, ...]
    threads: int
    optimization: str


class Sessions:
    """Open inference sessions, a few models at a time (most recently used kept)."""

    def __init__(self, kept: int = SESSIONS_KEPT) -> None:
        self._kept = kept
        self._sessions: OrderedDict[SessionKey, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: SessionKey, model: Callable[[], bytes]) -> Any:
        """The session for `key`; `model` gives the model's bytes when one must be opened
        (a cached session needs no fetch of a large model for every shard)."""
        with self._lock:  # one load per model, even when tasks of it start together
            session = self._sessions.get(key)
            if session is None:
                session = open_session(model(), key)
                self._sessions[key] = session
                while len(self._sessions) > self._kept:
                    self._sessions.popitem(last=False)
            self._sessions.move_to_end(key)
            return session


def open_session(model: bytes, key: SessionKey) -> Any:
    """An ONNX Runtime session of `model` on `key`'s providers, threads and optimisation."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, key.threads)
    options.inter_op_num_threads = 1
    options.graph_optimization_level = _levels(ort)[key.optimization]
    options.log_severity_level = 3  # errors only: warnings about node placement are noise
    providers = [(name, PROVIDER_OPTIONS.get(name, {})) for name in key.providers]
    return ort.InferenceSession(model, sess_options=options, providers=providers)


def _levels(ort: Any) -> dict[str, Any]:
    return {
        "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
        "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
        "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
        "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    }


def available_providers() -> list[str]:
    """What this machine's ONNX Runtime offers (empty without one)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    return list(ort.get_available_providers())


def runtime_version() -> str:
    import onnxruntime as ort

    return str(ort.__version__)
