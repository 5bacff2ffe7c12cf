"""How fast this node is: dense matmul GFLOPS and items per second of the kinds it runs.

The scheduler uses these figures to pick nodes and size deadlines. Measuring takes a few
seconds (plus a model load), so the result is cached in the node's state directory and
measured again only when the hardware, the kinds, the device or idlegrid itself change.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from pydantic import ValidationError

from idlegrid.protocol import Benchmark, HardwareProfile
from idlegrid.worker.hardware import backend_of

log = logging.getLogger(__name__)

CACHE_FILE = "benchmark.json"
MATMUL_SIZE = 1024
MATMUL_SECONDS = 0.4
EMBED_BENCHMARK_TEXTS = 64


def run_benchmark(kinds: Sequence[str], device: str = "cpu") -> Benchmark:
    """Measure matmul GFLOPS on `device` and the rate of each benchmarked kind in `kinds`."""
    kind_rates: dict[str, float] = {}
    if "embed-text" in kinds:
        rate = embed_text_rate(device)
        if rate is not None:
            kind_rates["embed-text"] = rate
    return Benchmark(
        backend=backend_of(device), matmul_gflops=matmul_gflops(device), kind_rates=kind_rates
    )


def matmul_gflops(device: str = "cpu", size: int = MATMUL_SIZE) -> float:
    """float32 matmul throughput on `device` with torch, or on the CPU with numpy."""
    try:
        import torch
    except Exception:  # absent or broken: either way numpy can still measure the CPU
        if device != "cpu":
            log.warning("torch is unusable; measuring the CPU instead of %s", device)
        return numpy_matmul_gflops(size)
    first = torch.randn(size, size, device=device)
    second = torch.randn(size, size, device=device)

    def synchronize() -> None:
        # GPU kernels run asynchronously: time them only once they have finished.
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        elif device.startswith("mps"):
            torch.mps.synchronize()

    with torch.inference_mode():
        matmuls_per_second = _matmul_rate(lambda: first @ second, synchronize)
    return _gflops(size, matmuls_per_second)


def numpy_matmul_gflops(size: int = MATMUL_SIZE) -> float:
    """float32 matmul throughput of numpy's BLAS on the CPU."""
    rng = np.random.default_rng(0)
    first = rng.standard_normal((size, size), dtype=np.float32)
    second = rng.standard_normal((size, size), dtype=np.float32)
    return _gflops(size, _matmul_rate(lambda: first @ second, lambda: None))


def _matmul_rate(matmul: Callable[[], object], synchronize: Callable[[], None]) -> float:
    """Matmuls per second over at least MATMUL_SECONDS, after one warm-up."""
    matmul()
    synchronize()
    repetitions, block = 0, 1
    start = time.perf_counter()
    while True:
        for _ in range(block):
            matmul()
        synchronize()
        repetitions += block
        elapsed = time.perf_counter() - start
        if elapsed >= MATMUL_SECONDS:
            return repetitions / elapsed
        # Doubling keeps a fast GPU from spending the window on synchronizations.
        block *= 2


def _gflops(size: int, matmuls_per_second: float) -> float:
    return 2 * size**3 * matmuls_per_second / 1e9


def embed_text_rate(device: str = "cpu") -> float | None:
    """Texts per second of the embed-text kind on a shard of stdlib paragraphs.

    One warm-up run loads the model first, so the figure is steady-state throughput.
    None when the worker's ML stack is not installed.
    """
    from idlegrid.kinds import get_kind
    from idlegrid.kinds.base import RunContext

    kind = get_kind("embed-text")
    params = kind.parse_params({"shard_size": EMBED_BENCHMARK_TEXTS})
    inputs = kind.builtin_inputs(EMBED_BENCHMARK_TEXTS)
    assert inputs is not None  # embed-text ships its sample texts
    shard = kind.split(inputs, params)[0]
    context = RunContext(device=device)
    try:
        kind.run(shard.payload, params, context)
    except ImportError:
        log.warning("embed-text is not benchmarked: its ML stack is missing", exc_info=True)
        return None
    start = time.perf_counter()
    kind.run(shard.payload, params, context)
    return shard.items / (time.perf_counter() - start)


def slowed(result: Benchmark, factor: float) -> Benchmark:
    """The figures of a machine `factor` times slower (WorkerSettings.slowdown)."""
    return result.model_copy(
        update={
            "matmul_gflops": result.matmul_gflops / factor,
            "kind_rates": {kind: rate / factor for kind, rate in result.kind_rates.items()},
        }
    )


# -- cache -----------------------------------------------------------------------------


def load_or_run(
    state_dir: Path,
    profile: HardwareProfile,
    kinds: Sequence[str],
    device: str,
    rerun: bool = False,
) -> Benchmark:
    """The cached benchmark of this setup, measuring (and caching) it when missing or stale."""
    path = state_dir / CACHE_FILE
    key = fingerprint(profile, kinds, device)
    if not rerun:
        cached = _read_cache(path, key)
        if cached is not None:
            return cached
    log.info("benchmarking %s on %s", ", ".join(kinds) or "matmul", device)
    benchmark = run_benchmark(kinds, device)
    _write_cache(path, key, benchmark)
    return benchmark


def fingerprint(profile: HardwareProfile, kinds: Sequence[str], device: str) -> str:
    """A digest of everything a benchmark result depends on."""
    identity = {
        # Free disk changes every run and has no bearing on speed.
        "profile": profile.model_dump(mode="json", exclude={"disk_free_mb"}),
        "kinds": sorted(set(kinds)),
        "device": device,
        "idlegrid": idlegrid_version(),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def idlegrid_version() -> str:
    """The installed idlegrid version; a placeholder when running from a source tree."""
    try:
        return importlib.metadata.version("idlegrid")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _read_cache(path: Path, key: str) -> Benchmark | None:
    try:
        cached = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        log.warning("ignoring unreadable benchmark cache %s", path)
        return None
    if not isinstance(cached, dict) or cached.get("fingerprint") != key:
        return None
    try:
        return Benchmark.model_validate(cached.get("benchmark"))
    except ValidationError:
        log.warning("ignoring invalid benchmark cache %s", path)
        return None


def _write_cache(path: Path, key: str, benchmark: Benchmark) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    document = {"fingerprint": key, "benchmark": benchmark.model_dump(mode="json")}
    # Write then rename, so a crash mid-write never leaves half a file to parse.
    with tempfile.NamedTemporaryFile(
        "w", dir=path.parent, prefix=".benchmark-", suffix=".tmp", delete=False
    ) as handle:
        json.dump(document, handle, indent=2)
    os.replace(handle.name, path)
