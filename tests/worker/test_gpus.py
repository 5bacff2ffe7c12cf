"""Each GPU on its own: the vendor lists (NVML, ROCm SMI), other programs' use of each GPU
(NVML per process, ROCm SMI and Apple's counters per device), and the idle sensors that
hand it to the policy. Fake devices stand in for the drivers, which this machine lacks."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from idlegrid.protocol import Gpu, HardwareProfile
from idlegrid.worker import gpus, hardware
from idlegrid.worker.idle import IdleSource
from idlegrid.worker.idle.system import Sensors

OUR_TASK, GAME = 4242, 777


class FakeNvml:
    """pynvml's calls, over two GPUs: a game on GPU 1, and per-process samples or not."""

    class NVMLError(Exception):
        pass

    def __init__(self, *, samples: bool = True) -> None:
        self.samples = samples
        self.devices = [
            {"name": b"NVIDIA GeForce RTX 4090", "memory": 24564 * 2**20, "use": 60,
             "processes": [(OUR_TASK, 60)]},
            {"name": "NVIDIA RTX A2000", "memory": 6138 * 2**20, "use": 87,
             "processes": [(GAME, 80), (OUR_TASK, 7)]},
        ]  # fmt: skip

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        return self.devices[index]

    def nvmlDeviceGetName(self, handle: dict[str, Any]) -> Any:
        return handle["name"]

    def nvmlDeviceGetMemoryInfo(self, handle: dict[str, Any]) -> Any:
        return SimpleNamespace(total=handle["memory"])

    def nvmlDeviceGetProcessUtilization(self, handle: dict[str, Any], since: int) -> Any:
        if not self.samples:
            raise self.NVMLError("Not Supported")
        return [SimpleNamespace(pid=pid, smUtil=share) for pid, share in handle["processes"]]

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> Any:
        return SimpleNamespace(gpu=handle["use"])

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict[str, Any]) -> Any:
        return [SimpleNamespace(pid=pid) for pid, _ in handle["processes"]]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: dict[str, Any]) -> Any:
        return []


def test_nvml_lists_every_gpu_with_its_index_name_and_memory() -> None:
    assert gpus.nvml_gpus(FakeNvml()) == [
        Gpu(index=0, backend="cuda", name="NVIDIA GeForce RTX 4090", memory_mb=24564),
        Gpu(index=1, backend="cuda", name="NVIDIA RTX A2000", memory_mb=6138),
    ]


def test_nvml_counts_other_programs_use_without_the_workers_own() -> None:
    # Per-process samples: exact, our task's share left out.
    assert gpus.nvml_other_use(FakeNvml(), {OUR_TASK}) == {0: 0.0, 1: 80.0}
    # Without samples: a device that another process holds counts whole.
    assert gpus.nvml_other_use(FakeNvml(samples=False), {OUR_TASK}) == {0: 0.0, 1: 87.0}


def _run(stdout: str, returncode: int = 0) -> Any:
    return lambda *a, **k: subprocess.CompletedProcess(a, returncode, stdout=stdout, stderr="")


ROCM_INFO = (
    '{"card0": {"Card Series": "Radeon RX 7900 XTX", "VRAM Total Memory (B)": "25753026560"},'
    ' "card1": {"Card series": "AMD Instinct MI210", "VRAM Total Memory (B)": "68702699520"},'
    ' "system": {"Driver version": "6.7.0"}}'
)


def test_rocm_smi_lists_each_amd_gpu_and_its_use() -> None:
    info = gpus.rocm_smi("--showproductname", run=_run(ROCM_INFO))
    assert gpus.rocm_gpus(info) == [
        Gpu(index=0, backend="rocm", name="Radeon RX 7900 XTX", memory_mb=24560),
        Gpu(index=1, backend="rocm", name="AMD Instinct MI210", memory_mb=65520),
    ]
    use = gpus.rocm_smi("--showuse", run=_run('{"card0": {"GPU use (%)": "93"}, "card1": {}}'))
    assert gpus.rocm_use(use) == {0: 93.0}
    assert gpus.rocm_smi("--showuse", run=_run("not json")) == {}
    assert gpus.rocm_smi("--showuse", run=_run("{}", returncode=2)) == {}


def test_apples_counters_give_each_gpus_use() -> None:
    ioreg = '| "PerformanceStatistics" = {"Device Utilization %"=41,"Renderer Utilization %"=40}'
    assert gpus.apple_use(ioreg) == {0: 41.0}
    assert gpus.apple_use("no accelerator") == {}


def test_a_whole_device_reading_counts_as_others_only_while_no_task_of_ours_runs() -> None:
    reader = gpus._whole_use(lambda: {0: 93.0})
    assert reader(set()) == {0: 93.0}
    assert reader({OUR_TASK}) == {}  # cannot tell ours from theirs: no judgement


@pytest.mark.parametrize(
    ("device", "index"), [("cpu", None), ("cuda", 0), ("cuda:3", 3), ("mps", 0)]
)
def test_device_index(device: str, index: int | None) -> None:
    assert gpus.device_index(device) == index


def test_the_sensors_read_the_use_of_the_gpus_the_worker_computes_on() -> None:
    sensors = Sensors(IdleSource([]), lambda: [OUR_TASK])
    sensors.gpu_devices = (1,)
    sensors.gpu_reader = lambda own: gpus.nvml_other_use(FakeNvml(), own)
    assert sensors.read().gpu_other_use == ((1, 80.0),)

    def broken(own: object) -> dict[int, float]:
        raise OSError("the driver went away")

    sensors = Sensors(IdleSource([]), lambda: [])
    sensors.gpu_devices, sensors.gpu_reader = (0,), broken
    assert sensors.read().gpu_other_use == () and sensors.gpu_reader is None


def test_the_probe_prefers_the_vendors_list(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = gpus.nvml_gpus(FakeNvml())
    monkeypatch.setattr(hardware, "listed_gpus", lambda: listed)
    profile = hardware.probe()
    assert [(g.index, g.name) for g in profile.gpus] == [
        (0, "NVIDIA GeForce RTX 4090"), (1, "NVIDIA RTX A2000"),
    ]  # fmt: skip
    assert HardwareProfile.model_validate_json(profile.model_dump_json()) == profile
    assert hardware.best_device(profile) == "cuda"
