"""A real worker daemon with two GPUs (listed through a fake NVML at the gpus.py boundary:
this machine has none) against a real coordinator in this process: one slot per GPU
plus a CPU slot, tasks that need a GPU placed on one, and one GPU paused while the other
goes on."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from grids import serving
from helpers import eventually
from test_gpus import FakeNvml

from idlegrid import protocol
from idlegrid.protocol import HardwareProfile
from idlegrid.settings import CoordinatorSettings, WorkerSettings
from idlegrid.worker import gpus
from idlegrid.worker.daemon import Worker


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", heartbeat_interval_s=0.1)
    async with serving(settings) as url:
        yield url, settings.admin_token_file.read_text().strip()


async def _run_job(http: httpx.AsyncClient, **params: Any) -> dict[str, Any]:
    job = (
        await http.post("/v1/jobs", json={"kind": "sleep", "params": params, "replication": 1})
    ).json()

    async def ended() -> dict[str, Any] | None:
        info: dict[str, Any] = (await http.get(f"/v1/jobs/{job['id']}")).json()
        return info if info["state"] not in ("queued", "running") else None

    return await eventually(ended, f"job {job['id']} to end", timeout_s=60)


async def test_tasks_run_one_per_gpu_and_a_paused_gpu_takes_none(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=30
    ) as http:
        token = (await http.post("/v1/tokens", json={"kind": "node"})).json()["token"]
        worker = Worker(
            WorkerSettings(
                servers=(url,),
                token=token,
                state_dir=tmp_path / "worker",
                benchmark=False,
                dedicated=True,
                control_port=-1,
                kinds=("sleep",),
                prefetch=0,
            )  # fmt: skip
        )
        worker.hardware = HardwareProfile(gpus=gpus.nvml_gpus(FakeNvml()))
        placed: list[tuple[str, bool]] = []  # (the slot's device, the task needs a GPU)
        running_at_once = [0, 0]
        compute = worker._compute

        async def placing(task, data):  # type: ignore[no-untyped-def]
            placed.append((task.host.device.label, task.assign.gpu))
            running_at_once[0] += 1
            running_at_once[1] = max(running_at_once)
            try:
                return await compute(task, data)
            finally:
                running_at_once[0] -= 1

        worker._compute = placing  # type: ignore[method-assign]
        serving_worker = asyncio.create_task(worker.run())
        try:
            info = await _run_job(http, tasks=4, seconds=0.2, backend="cuda")
            assert info["state"] == "completed", info
            assert [host.device.label for host in worker.hosts] == ["cuda:0", "cuda:1", "cpu"]
            assert {device for device, _ in placed} == {"cuda:0", "cuda:1"}
            assert all(needs for _, needs in placed) and running_at_once[1] == 2
            # Work a CPU does as well takes the CPU slot while it is free.
            placed.clear()
            assert (await _run_job(http, tasks=1))["state"] == "completed"
            assert placed == [("cpu", False)]
            # GPU 1 paused by its owner: GPU 0 takes every GPU task, GPU 1 none.
            worker.governor.change({"paused_gpus": [1]})
            await worker.governor.step()
            placed.clear()
            assert (await _run_job(http, tasks=3, seconds=0.1, backend="cuda"))["state"] == (
                "completed"
            )
            assert {device for device, _ in placed} == {"cuda:0"}
            told = {d.device: d for d in worker._devices_told or []}
            assert told["cuda:1"].state == "paused"
            assert told["cuda:1"].reason == "paused by the owner"
            assert told["cuda:0"].state == told["cpu"].state == "running"
        finally:
            worker.stop()
            await serving_worker


def test_the_status_names_each_device() -> None:
    status = protocol.Status(
        state="running",
        devices=[protocol.DeviceStatus(device="cuda:1", state="paused", reason="a game")],
    )
    again = protocol.parse_node_message(status.model_dump_json())
    assert again == status
