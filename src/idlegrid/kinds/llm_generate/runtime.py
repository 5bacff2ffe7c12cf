"""llama.cpp on the worker: model files by hash, loaded models kept between tasks, the
token loop of a generation and the batched prefill of a check.

A task process lives across tasks (worker/runner.py), so a model loaded for one shard
serves the next shard of the same model (same file hash, context and threads) without a
second load. Model files are written once per hash into the worker's state directory
(`models/`), from the blob cache's verified bytes.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from idlegrid.kinds.base import RunContext

MODELS_KEPT = 1  # loaded models a task process keeps (each holds its weights in memory)
# llama.cpp's micro-batch (n_ubatch): the most positions one graph evaluates. Below 64,
# ggml's CPU flash attention runs every position through the kernel a one-token decode
# runs (64 and more take a tiled kernel that accumulates in another precision), so a
# batched check reproduces a token-by-token generation's logits bit for bit on the same
# build, whatever the batch size or thread count (measured: benchmarks/llm_verify.py).
UBATCH = 32
# Threads of a micro-batch of one token (llama.cpp's n_threads; n_threads_batch serves
# the others). Past 256 cached positions (512 cells attended, the cache padded to 256),
# ggml's CPU flash attention splits a lone query's cache across its threads and adds the
# parts in another order than the kernel a batch runs: on two threads a lone token's
# logits were off by up to 0.16 in a log-probability from the check's
# (benchmarks/llm_generate.py --exactness). On one thread the split is one part, and the
# logits are the batch kernel's bit for bit. A lone token is rare when prompts are
# decoded together (batched.py): the last sequence of a shard, or a shard of one prompt.
LONE_TOKEN_THREADS = 1


class ModelLoadFailed(RuntimeError):
    """This node's llama.cpp build cannot load the model (the shard goes to another node)."""


@dataclass(frozen=True)
class ModelKey:
    digest: str
    n_ctx: int
    threads: int
    n_batch: int


@dataclass
class LoadStats:
    """How often this process loaded a model and how often it reused one (measured)."""

    loads: int = 0
    reuses: int = 0
    load_seconds: float = 0.0


class Models:
    """Loaded llama.cpp models of this task process, most recently used kept."""

    def __init__(self, kept: int = MODELS_KEPT) -> None:
        self._kept = kept
        self._models: dict[ModelKey, Any] = {}
        self._lock = threading.Lock()
        self.stats = LoadStats()
        atexit.register(self.close)  # before llama-cpp-python's library is torn down

    def close(self) -> None:
        with self._lock:
            for llm in self._models.values():
                llm.close()
            self._models.clear()

    def get(self, key: ModelKey, path: Callable[[], Path]) -> Any:
        import time

        with self._lock:
            llm = self._models.pop(key, None)
            if llm is not None:
                self.stats.reuses += 1
            else:
                while len(self._models) >= self._kept:
                    self._models.pop(next(iter(self._models))).close()
                started = time.perf_counter()
                llm = load(path(), n_ctx=key.n_ctx, threads=key.threads, n_batch=key.n_batch)
                self.stats.loads += 1
                self.stats.load_seconds += time.perf_counter() - started
            self._models[key] = llm  # last: most recently used
            return llm


def load(path: Path, *, n_ctx: int, threads: int, n_batch: int = 512) -> Any:
    """A llama.cpp model on this node's best device (all layers offloaded where it can)."""
    # llama.cpp's CPU threads are OpenMP's: idle ones sleep rather than spin, so a
    # volunteer's busy machine is not made busier (and a shared one not slower).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from llama_cpp import Llama

    try:
        with plain_cpu_buffers():
            return Llama(
                model_path=str(path),
                n_ctx=n_ctx,
                n_batch=n_batch,
                n_ubatch=min(n_batch, UBATCH),
                flash_attn=True,
                n_threads=LONE_TOKEN_THREADS,
                n_threads_batch=max(1, threads),
                n_gpu_layers=-1,
                seed=0,
                verbose=False,
            )
    except (ValueError, RuntimeError, OSError) as exc:
        raise ModelLoadFailed(f"llama.cpp cannot load the model: {exc}") from None


_patch_lock = threading.Lock()


@contextlib.contextmanager
def plain_cpu_buffers() -> Iterator[None]:
    """Load models without llama.cpp's extra CPU buffer types where the build has AMX
    kernels: a native build on a CPU that reports AMX (Sapphire Rapids and later) crashes
    in them under some hypervisors (measured on this project's CI VMs, where every
    decode of a Q4_1 model died in `ggml_backend_amx_mul_mat`). The plain CPU kernels
    (AVX-512, AVX2) run instead. llama-cpp-python has no argument for it, so its default
    model parameters are wrapped while one model loads."""
    import llama_cpp
    import llama_cpp.llama_cpp as library

    if b"AMX_INT8 = 1" not in llama_cpp.llama_print_system_info():
        yield
        return
    with _patch_lock:
        original = library.llama_model_default_params

        def without_extra_buffers() -> Any:
            params = original()
            params.use_extra_bufts = False
            return params

        library.llama_model_default_params = without_extra_buffers
        try:
            yield
        finally:
            library.llama_model_default_params = original


def model_path(digest: str, ctx: RunContext) -> Path:
    """The model's file on this node, written from the blob cache on first use."""
    root = ctx.scratch.parent.parent if ctx.scratch is not None else Path(tempfile.gettempdir())
    folder = root / "models"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{digest}.gguf"
    if path.exists():
        return path
    if ctx.fetch is None:
        raise RuntimeError("llm-generate needs the worker's blob fetch for its model")
    data = ctx.fetch(digest)  # checked against the SHA-256 on arrival
    partial = folder / f"{digest}.{os.getpid()}.part"
    partial.write_bytes(data)
    partial.replace(path)
    return path


def backend() -> str:
    """The llama.cpp backend this build runs on ("cpu", "cuda", "metal", "vulkan", ...)."""
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        return "cpu"
    info = llama_cpp.llama_print_system_info().decode(errors="replace").lower()
    for name in ("cuda", "hip", "metal", "vulkan", "sycl", "opencl"):
        if name in info:
            return "rocm" if name == "hip" else name
    return "gpu"


def build() -> str:
    """This node's llama.cpp build: llama-cpp-python's version, the backend, and the CPU
    features its kernels use (two nodes with the same build compute the same logits)."""
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    # The settings that decide the logits too: a worker that ran a lone token on several
    # threads (before LONE_TOKEN_THREADS) names no such part and is held to the
    # cross-build margins, which its honest long outputs pass.
    settings = f"lone token on {LONE_TOKEN_THREADS} thread"
    return (
        f"llama-cpp-python {llama_cpp.__version__}; {backend()}; {settings}; "
        f"{' '.join(info.split())}"
    )


# -- the token loop and the prefill -----------------------------------------------------


def tokenize(llm: Any, text: str) -> list[int]:
    """A prompt's tokens as both sides count them (special tokens parsed, the model's BOS)."""
    return list(llm.tokenize(text.encode("utf-8"), add_bos=True, special=True))


def start(llm: Any, tokens: list[int], *, logits: bool = True) -> None:
    """Make `tokens` the model's context, keeping the KV cache of a common prefix. With
    `logits`, at least the last token is evaluated again (its logits are then at hand)."""
    keep = 0
    held = llm.n_tokens
    limit = min(held, len(tokens) - 1 if logits else len(tokens))
    ids = llm.input_ids
    while keep < limit and ids[keep] == tokens[keep]:
        keep += 1
    llm.n_tokens = keep
    if keep < len(tokens):
        llm.eval(tokens[keep:])


def last_logits(llm: Any) -> np.ndarray:
    """Logits of the last evaluated position (a view, valid until the next eval)."""
    pointer = llm._ctx.get_logits_ith(-1)
    return np.ctypeslib.as_array(
        ctypes.cast(pointer, ctypes.POINTER(ctypes.c_float)), (llm.n_vocab(),)
    )


def prefill(llm: Any, prompt: list[int], completion: list[int]) -> Iterator[np.ndarray]:
    """Logits that predicted each completion token, in blocks of rows (row i of the
    concatenation for token i): one batched pass over the prompt and the completion, in
    micro-batches (`UBATCH`), logits read out only for the completion's rows."""
    start(llm, prompt[:-1], logits=False)
    rows = [prompt[-1], *completion[:-1]]
    vocab = llm.n_vocab()
    for offset in range(0, len(rows), llm.n_batch):
        chunk = rows[offset : offset + llm.n_batch]
        n_past = llm.n_tokens
        llm._ctx.kv_cache_seq_rm(-1, n_past, -1)
        llm._batch.set_batch(batch=chunk, n_past=n_past, logits_all=True)
        llm._ctx.decode(llm._batch)
        llm.input_ids[n_past : n_past + len(chunk)] = chunk
        llm.n_tokens += len(chunk)
        pointer = ctypes.cast(llm._ctx.get_logits(), ctypes.POINTER(ctypes.c_float))
        block = np.ctypeslib.as_array(pointer, (len(chunk), vocab))
        for row in range(0, len(chunk), UBATCH):  # float64 copies stay small
            yield block[row : row + UBATCH]


def is_end(llm: Any, token: int) -> bool:
    """Whether `token` ends generation (end of sequence, end of turn)."""
    import llama_cpp

    return bool(llama_cpp.llama_vocab_is_eog(llm._model.vocab, token))


def piece(llm: Any, token: int) -> bytes:
    return bytes(llm.detokenize([token]))


def devices() -> list[tuple[str, int]]:
    """llama.cpp's devices beyond the CPU (name, memory in MiB), the first used first."""
    import llama_cpp

    # ggml's device API, where this llama-cpp-python binds it (0.3.36 on CPU does not).
    count = getattr(llama_cpp, "ggml_backend_dev_count", None)
    get = getattr(llama_cpp, "ggml_backend_dev_get", None)
    describe = getattr(llama_cpp, "ggml_backend_dev_description", None)
    memory = getattr(llama_cpp, "ggml_backend_dev_memory", None)
    if None in (count, get, describe, memory) or not llama_cpp.llama_supports_gpu_offload():
        return []
    assert count is not None and get is not None and describe is not None and memory
    found = []
    for index in range(count()):
        device = get(index)
        name = describe(device).decode(errors="replace")
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        memory(device, ctypes.byref(free), ctypes.byref(total))
        if "cpu" not in name.lower():
            found.append((name, int(total.value // 2**20)))
    return found
