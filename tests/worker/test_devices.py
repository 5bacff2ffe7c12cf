"""Each device on its own: slots follow the GPUs (listed through NVML, faked at the gpus.py
boundary: this machine has none), a slot's process sees only its GPU, tasks are placed on
a device, and one GPU pauses while the CPU and the other GPUs go on."""

from __future__ import annotations

import asyncio
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import pytest
from test_gpus import FakeNvml

from idlegrid.protocol import Gpu
from idlegrid.worker import gpus
from idlegrid.worker.devices import CPU, Device, DeviceError, check_gpu_indices, plan_slots
from idlegrid.worker.governor import Governor, apply_overrides
from idlegrid.worker.idle.policy import (
    Action,
    Controls,
    IdleSettings,
    Mode,
    Readings,
    SettingError,
    decide,
)
from idlegrid.worker.runner import TaskHost, TaskSpec
from idlegrid.worker.slots import Slots

LISTED = gpus.nvml_gpus(FakeNvml())  # two NVIDIA GPUs, 0 and 1
NOON = datetime(2026, 1, 5, 12)


def test_one_slot_per_gpu_then_the_cpu_slots() -> None:
    labels = [d.label for d in plan_slots(LISTED, cpu_slots=2, device=None)]
    assert labels == ["cuda:0", "cuda:1", "cpu", "cpu"]
    assert [d.label for d in plan_slots([], cpu_slots=1, device=None)] == ["cpu"]
    # A device named in the settings: every slot on it.
    assert [d.label for d in plan_slots(LISTED, cpu_slots=2, device="cuda:1")] == ["cuda:1"] * 2
    assert [d.label for d in plan_slots(LISTED, cpu_slots=1, device="cpu")] == ["cpu"]
    amd = [Gpu(index=0, backend="rocm", name="RX 7900", memory_mb=24_000)]
    assert plan_slots(amd, cpu_slots=1, device="cuda")[0].label == "rocm:0"  # torch's name


@pytest.mark.parametrize(
    ("gpus_listed", "device", "message"),
    [
        (
            LISTED,
            "cuda:5",
            "device 'cuda:5': this machine has no such GPU (its GPUs: cuda:0, cuda:1)",
        ),
        ([], "cuda", "device 'cuda': this machine has no such GPU (it has no GPU)"),
        (LISTED, "cuda:x", "not cpu or BACKEND:INDEX"),
        (LISTED, "rocm:0", "no such GPU"),
    ],
)
def test_a_device_the_machine_lacks_is_refused_by_name(
    gpus_listed: list[Gpu], device: str, message: str
) -> None:
    with pytest.raises(DeviceError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan_slots(gpus_listed, cpu_slots=1, device=device)


def test_a_slot_sees_its_own_gpu_only() -> None:
    first, second = plan_slots(LISTED, cpu_slots=0, device=None)
    assert second.environment() == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "1"}
    assert second.runtime_device() == "cuda:0"  # its one visible GPU
    assert Device("rocm", 1).environment()["HIP_VISIBLE_DEVICES"] == "1"
    assert Device(CPU).environment() == {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    assert Device(CPU).runtime_device() == "cpu" and Device("mps", 0).runtime_device() == "mps"


async def test_a_gpu_slots_process_runs_with_only_that_gpu_visible() -> None:
    """A real task process: its environment is what the runtimes in it read."""
    gpu1 = plan_slots(LISTED, cpu_slots=0, device=None)[1]
    hosts = [TaskHost(name="gpu-1", device=gpu1), TaskHost(name="cpu", device=Device(CPU))]
    try:
        for host, visible in zip(hosts, ("1", ""), strict=True):
            spec = TaskSpec(
                task_id=1, kind="sleep", params={}, device=host.device.runtime_device(),
                payload=b'{"index": 0, "seconds": 0}', threads=1, slowdown=1.0,
            )  # fmt: skip
            await host.run(spec, fetch=_no_fetch, progress=lambda fraction: None)
            assert host.pid is not None
            environ = psutil.Process(host.pid).environ()
            assert environ["CUDA_VISIBLE_DEVICES"] == visible, host.name
    finally:
        for host in hosts:
            host.stop()


async def _no_fetch(blob_hash: str) -> bytes:
    raise AssertionError("no blob is fetched")


class Host:
    """A slot without a process: what the governor and the slots read of one."""

    def __init__(self, device: Device) -> None:
        self.device, self.suspended, self.task_id = device, False, None
        self.name = device.label

    def suspend(self) -> None:
        self.suspended = True

    def resume(self) -> None:
        self.suspended = False

    def set_affinity(self, cores: list[int] | None) -> None:
        pass

    def rss_bytes(self) -> int:
        return 0


def _hosts() -> list[Any]:
    return [Host(device) for device in plan_slots(LISTED, cpu_slots=1, device=None)]


def test_tasks_are_placed_by_what_they_need() -> None:
    gpu0, gpu1, cpu = _hosts()
    slots = Slots([gpu0, gpu1, cpu])
    anything = lambda host: True  # noqa: E731
    # Work a CPU does as well keeps off the GPUs while a CPU slot is free.
    assert slots.pick(needs_gpu=False, wants_gpu=False, may_run=anything) is cpu
    # A kind that can use a GPU takes one; a task that needs one takes only one.
    assert slots.pick(needs_gpu=False, wants_gpu=True, may_run=anything) is gpu0
    not_gpu1 = lambda host: host is not gpu1  # noqa: E731  (GPU 1 paused)
    assert slots.pick(needs_gpu=True, wants_gpu=True, may_run=not_gpu1) is None
    assert slots.pick(needs_gpu=True, wants_gpu=True, may_run=anything) is gpu1
    slots.put(cpu)
    assert slots.pick(needs_gpu=True, wants_gpu=True, may_run=anything) is None  # CPU only


async def test_a_task_waits_for_a_slot_of_a_device_that_may_run() -> None:
    gpu0, gpu1, cpu = _hosts()
    slots = Slots([cpu])
    waiting = asyncio.create_task(
        slots.take(needs_gpu=True, wants_gpu=True, may_run=lambda host: True)
    )
    await asyncio.sleep(0.01)  # time to prove the take waits: a wait for it would not end
    assert not waiting.done()  # no GPU slot is free
    slots.put(gpu1)
    assert await asyncio.wait_for(waiting, 5) is gpu1


def _decide(**settings: Any) -> Any:
    readings = Readings(now=NOON, user_idle_s=900, gpu_other_use=((0, 2.0), (1, 80.0)))
    return decide(IdleSettings(**settings), readings, Controls())


def test_each_gpu_steps_aside_on_its_own() -> None:
    # A game on GPU 1: GPU 1 pauses, GPU 0 and the CPU go on.
    decision = _decide()
    assert [decision.device_action(i) for i in (None, 0, 1)] == [Action.RUN, Action.RUN,
                                                                 Action.PAUSE]  # fmt: skip
    assert "GPU 1 paused: other programs use 80% of GPU 1" in decision.reason
    # The owner paused GPU 0 (GPU 1 is still busy): only the CPU runs.
    decision = _decide(paused_gpus=(0,))
    assert decision.gpu_paused_why(0) == "paused by the owner"
    assert [decision.device_action(i) for i in (None, 0, 1)] == [Action.RUN, Action.PAUSE,
                                                                 Action.PAUSE]  # fmt: skip
    # GPUs only: the CPU's mode never, the free GPU computes.
    decision = _decide(cpu_mode=Mode.NEVER)
    assert [decision.device_action(i) for i in (None, 0)] == [Action.PAUSE, Action.RUN]


class Still:
    """Sensors that read an idle machine with a busy-free GPU."""

    def read(self) -> Readings:
        return Readings(now=NOON, user_idle_s=900)


async def test_pausing_one_gpu_suspends_its_slot_only(tmp_path: Path) -> None:
    gpu0, gpu1, cpu = hosts = _hosts()
    told: list[tuple[Action, ...]] = []

    async def on_change(decision: Any) -> None:
        told.append(tuple(decision.device_action(i) for i in (None, 0, 1)))

    governor = Governor(IdleSettings(), Still(), hosts, state_dir=tmp_path,  # type: ignore[arg-type]
                        on_change=on_change)  # fmt: skip
    governor.gpus = (0, 1)
    await governor.step()
    governor.change({"paused_gpus": [1]})
    await governor.step()
    assert (gpu0.suspended, gpu1.suspended, cpu.suspended) == (False, True, False)
    assert governor.action() is Action.RUN and not governor.may_take(gpu1)
    assert told == [(Action.RUN,) * 3, (Action.RUN, Action.RUN, Action.PAUSE)]
    # Kept across a restart, with the rest of the owner's settings.
    again = Governor(IdleSettings(), Still(), hosts, state_dir=tmp_path)  # type: ignore[arg-type]
    assert again.settings.paused_gpus == (1,)
    # An index this node does not have changes nothing, and says which.
    with pytest.raises(
        SettingError, match=r"paused_gpus: this node has no GPU 5 \(its GPUs: 0, 1\)"
    ):
        governor.change({"paused_gpus": [0, 5]})
    assert governor.settings.paused_gpus == (1,)
    governor.change({"paused_gpus": []})
    await governor.step()
    assert not gpu1.suspended


@pytest.mark.parametrize("value", [[-1], ["1"], [True], "1", [64]])
def test_paused_gpus_must_be_gpu_indices(value: Any) -> None:
    with pytest.raises(SettingError, match="paused_gpus"):
        apply_overrides(IdleSettings(), {"paused_gpus": value})


def test_check_gpu_indices_names_the_missing_one() -> None:
    check_gpu_indices([0, 1], [0, 1], setting="paused_gpus")
    with pytest.raises(DeviceError, match="no GPU 2 \\(its GPUs: none\\)"):
        check_gpu_indices([2], [], setting="paused_gpus")


async def test_a_node_on_the_cpu_alone_asks_for_no_gpu_task_and_fails_one_it_gets(
    tmp_path: Path,
) -> None:
    from datetime import UTC

    from idlegrid import protocol
    from idlegrid.settings import WorkerSettings
    from idlegrid.worker.daemon import Worker

    worker = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",),
                                   device="cpu", dedicated=True, control_port=-1))  # fmt: skip
    worker.hardware = protocol.HardwareProfile(gpus=LISTED)
    worker._place_devices()
    assert [host.device.label for host in worker.hosts] == ["cpu"]
    assert worker._free_gpu_slots(worker.hosts) == 0  # the coordinator sends it none
    assign = protocol.Assign(
        task_id=9, job_id=1, shard_index=0, kind="sleep", params={}, gpu=True,
        input=protocol.BlobRef(hash="ab" * 32, size=1), lease_deadline=datetime.now(UTC),
    )  # fmt: skip
    worker.governor.may_run.set()
    await worker._start(assign)
    await asyncio.wait_for(asyncio.gather(*worker._task_runs), 10)
    failure = worker.outbox[9]
    assert isinstance(failure, protocol.Failure) and "needs a GPU" in failure.reason
