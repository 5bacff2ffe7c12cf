"""Hardware probe, device choice, benchmark figures and the benchmark cache."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from helpers import run_python

from idlegrid.protocol import Benchmark, Gpu, HardwareProfile
from idlegrid.worker import benchmark, hardware

GIB = 2**30


# -- probe -------------------------------------------------------------------------------


def test_probe_describes_this_machine() -> None:
    import torch

    profile = hardware.probe()
    assert profile.os
    assert profile.cpu_model and profile.cpu_model != "unknown"
    assert 1 <= profile.cpu_cores <= (os.cpu_count() or 1)
    assert profile.memory_mb == psutil.virtual_memory().total // 2**20
    assert profile.memory_mb > 100
    assert profile.torch_version == str(torch.__version__)
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert profile.gpus == []
        assert hardware.best_device(profile) == "cpu"


def test_probe_without_torch_reports_cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules makes `import torch` raise ImportError, as if it were absent.
    monkeypatch.setitem(sys.modules, "torch", None)
    profile = hardware.probe()
    assert profile.gpus == []
    assert profile.torch_version is None
    assert profile.cpu_cores >= 1


def test_probe_survives_a_broken_gpu_stack(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(torch: object) -> list[Gpu]:
        raise RuntimeError("CUDA driver version is insufficient")

    monkeypatch.setattr(hardware, "_cuda_gpus", broken)
    with caplog.at_level(logging.WARNING, logger=hardware.__name__):
        profile = hardware.probe()
    assert profile.gpus == []
    assert profile.torch_version is not None
    assert "reporting CPU only" in caplog.text


def _fake_torch(hip: str | None = None, cuda_count: int = 2, mps: bool = False) -> Any:
    name = "Radeon RX 7900" if hip else "RTX 4090"
    properties = SimpleNamespace(name=name, total_memory=24 * GIB)
    return SimpleNamespace(
        version=SimpleNamespace(hip=hip),
        cuda=SimpleNamespace(
            is_available=lambda: cuda_count > 0,
            device_count=lambda: cuda_count,
            get_device_properties=lambda index: properties,
        ),
        backends=SimpleNamespace(mps=SimpleNamespace(is_available=lambda: mps)),
    )


def test_cuda_and_rocm_gpus_are_read_from_torch() -> None:
    nvidia = hardware._cuda_gpus(_fake_torch())
    assert nvidia == [
        Gpu(index=index, backend="cuda", name="RTX 4090", memory_mb=24 * 1024) for index in (0, 1)
    ]  # each GPU on its own, with the index of its torch device string
    amd = hardware._cuda_gpus(_fake_torch(hip="6.1"))
    assert [gpu.backend for gpu in amd] == ["rocm", "rocm"]
    assert hardware._cuda_gpus(_fake_torch(cuda_count=0)) == []


def test_mps_reports_unified_memory() -> None:
    (apple,) = hardware._mps_gpus(_fake_torch(cuda_count=0, mps=True))
    assert apple.backend == "mps"
    assert apple.memory_mb == hardware.memory_mb()
    assert hardware._mps_gpus(_fake_torch(cuda_count=0)) == []


def test_cpu_model_is_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Ryzen 9 7950X\nflags\t: avx2\n")
    assert hardware._cpuinfo_model_name(cpuinfo) == "Ryzen 9 7950X"
    assert hardware._cpuinfo_model_name(tmp_path / "missing") == ""


@pytest.mark.parametrize(
    ("gpus", "device"),
    [
        ([], "cpu"),
        ([Gpu(backend="cuda", name="RTX 4090", memory_mb=24_000)], "cuda"),
        ([Gpu(backend="rocm", name="RX 7900", memory_mb=24_000)], "cuda"),
        ([Gpu(backend="mps", name="Apple GPU", memory_mb=16_000)], "mps"),
    ],
)
def test_best_device(gpus: list[Gpu], device: str) -> None:
    assert hardware.best_device(HardwareProfile(gpus=gpus)) == device


def test_backend_of() -> None:
    assert hardware.backend_of("cpu") == "cpu"
    assert hardware.backend_of("mps") == "mps"
    assert hardware.backend_of("cuda:1") == "cuda"  # this torch build is not ROCm


# -- benchmark ---------------------------------------------------------------------------


def test_matmul_figures_are_positive() -> None:
    assert benchmark.numpy_matmul_gflops(size=256) > 0
    result = benchmark.run_benchmark([], "cpu")
    assert result.backend == "cpu"
    assert result.matmul_gflops > 0
    assert result.kind_rates == {}


@pytest.mark.slow
def test_benchmark_measures_embed_text() -> None:
    result = benchmark.run_benchmark(["embed-text", "sleep"], "cpu")
    assert result.matmul_gflops > 0
    assert set(result.kind_rates) == {"embed-text"}
    assert result.kind_rates["embed-text"] > 0


class _CountingBenchmark:
    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, ...], str]] = []

    def __call__(self, kinds: list[str], device: str = "cpu") -> Benchmark:
        self.calls.append((tuple(kinds), device))
        return Benchmark(backend="cpu", matmul_gflops=100.0 + len(self.calls))


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> _CountingBenchmark:
    fake = _CountingBenchmark()
    monkeypatch.setattr(benchmark, "run_benchmark", fake)
    return fake


PROFILE = HardwareProfile(os="Linux", cpu_model="Test CPU", cpu_cores=4, memory_mb=8000)


def test_cache_is_reused_for_the_same_setup(tmp_path: Path, counting: _CountingBenchmark) -> None:
    first = benchmark.load_or_run(tmp_path / "state", PROFILE, ["embed-text"], "cpu")
    again = benchmark.load_or_run(tmp_path / "state", PROFILE, ["embed-text"], "cpu")
    assert again == first
    assert len(counting.calls) == 1
    cached = json.loads((tmp_path / "state" / benchmark.CACHE_FILE).read_text())
    assert cached["benchmark"]["matmul_gflops"] == first.matmul_gflops


@pytest.mark.parametrize(
    ("profile", "kinds", "device"),
    [
        (PROFILE.model_copy(update={"memory_mb": 16000}), ["embed-text"], "cpu"),
        (PROFILE, ["embed-text", "sleep"], "cpu"),
        (PROFILE, ["embed-text"], "cuda"),
    ],
)
def test_cache_is_invalidated_by_a_changed_setup(
    tmp_path: Path,
    counting: _CountingBenchmark,
    profile: HardwareProfile,
    kinds: list[str],
    device: str,
) -> None:
    first = benchmark.load_or_run(tmp_path, PROFILE, ["embed-text"], "cpu")
    second = benchmark.load_or_run(tmp_path, profile, kinds, device)
    assert second != first
    assert len(counting.calls) == 2
    # The new result replaced the old one in the cache.
    assert benchmark.load_or_run(tmp_path, profile, kinds, device) == second
    assert len(counting.calls) == 2


def test_cache_is_invalidated_by_a_new_idlegrid_version(
    tmp_path: Path, counting: _CountingBenchmark, monkeypatch: pytest.MonkeyPatch
) -> None:
    benchmark.load_or_run(tmp_path, PROFILE, [], "cpu")
    monkeypatch.setattr(benchmark, "idlegrid_version", lambda: "99.0")
    benchmark.load_or_run(tmp_path, PROFILE, [], "cpu")
    assert len(counting.calls) == 2


def test_rerun_measures_again(tmp_path: Path, counting: _CountingBenchmark) -> None:
    benchmark.load_or_run(tmp_path, PROFILE, [], "cpu")
    benchmark.load_or_run(tmp_path, PROFILE, [], "cpu", rerun=True)
    assert len(counting.calls) == 2


@pytest.mark.parametrize(
    "content", ["{not json", "[]", '{"fingerprint": "%s", "benchmark": {"matmul_gflops": -1}}']
)
def test_unusable_cache_is_measured_again(
    tmp_path: Path, counting: _CountingBenchmark, content: str
) -> None:
    key = benchmark.fingerprint(PROFILE, [], "cpu")
    (tmp_path / benchmark.CACHE_FILE).write_text(content.replace("%s", key))
    result = benchmark.load_or_run(tmp_path, PROFILE, [], "cpu")
    assert len(counting.calls) == 1
    assert benchmark.load_or_run(tmp_path, PROFILE, [], "cpu") == result


def test_fingerprint_ignores_kind_order_and_duplicates() -> None:
    assert benchmark.fingerprint(PROFILE, ["a", "b", "a"], "cpu") == benchmark.fingerprint(
        PROFILE, ["b", "a"], "cpu"
    )


# -- import hygiene ----------------------------------------------------------------------


def test_importing_kinds_and_worker_modules_does_not_import_torch() -> None:
    script = (
        "import sys\n"
        "import idlegrid.kinds, idlegrid.kinds.embed_text.samples, idlegrid.worker.hardware\n"
        "import idlegrid.worker.benchmark\n"
        "heavy = [name for name in ('torch', 'sentence_transformers', 'transformers')\n"
        "         if name in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    run_python(script)
