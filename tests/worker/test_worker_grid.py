"""A real worker daemon against a real coordinator, in one process: uvicorn on a loopback
port, real WebSockets and HTTP. Proves what the hand-spoken protocol tests cannot: the
daemon batches results that finish together, claims several tasks per `ready`, skips
uploading an output blob twice, and times its heartbeats by their acknowledgements."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from grids import serving
from helpers import eventually
from pydantic import BaseModel

from idlegrid.protocol import HardwareProfile
from idlegrid.settings import CoordinatorSettings, WorkerSettings
from idlegrid.worker.daemon import Worker


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(URL, admin token) of a coordinator served in this process."""
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", heartbeat_interval_s=0.1)
    async with serving(settings) as url:
        yield url, settings.admin_token_file.read_text().strip()


async def _finished(http: httpx.AsyncClient, job_id: int) -> dict[str, Any]:
    """The job's info once it is no longer queued or running."""

    async def ended() -> dict[str, Any] | None:
        info: dict[str, Any] = (await http.get(f"/v1/jobs/{job_id}")).json()
        return info if info["state"] not in ("queued", "running") else None

    return await eventually(ended, f"job {job_id} to end", timeout_s=60)


def _worker(url: str, token: str, state_dir: Path, **settings: Any) -> Worker:
    """A daemon for `url` without a hardware probe or benchmark: these tests are about the
    protocol."""
    worker = Worker(
        WorkerSettings(
            servers=(url,),
            token=token,
            state_dir=state_dir,
            benchmark=False,
            dedicated=True,  # a test machine is never idle
            control_port=-1,  # no local control page
            **settings,
        )
    )
    worker.hardware = HardwareProfile()
    return worker


async def test_daemon_runs_noop_tasks_in_batches_and_times_heartbeats(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    headers = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        made = await http.post("/v1/tokens", json={"kind": "node"})
        worker = _worker(url, made.json()["token"], tmp_path / "worker", slots=4, kinds=("noop",))
        sent: Counter[str] = Counter()
        send = worker._send

        async def counting_send(message: BaseModel) -> bool:
            sent[getattr(message, "type", "")] += 1
            return await send(message)

        worker._send = counting_send  # type: ignore[method-assign]
        running = asyncio.create_task(worker.run())
        try:
            job = (
                await http.post(
                    "/v1/jobs", json={"kind": "noop", "params": {"tasks": 40}, "replication": 1}
                )
            ).json()
            info = await _finished(http, job["id"])
            assert info["state"] == "completed", info
            assert info["tasks_completed"] == 40
            result = await http.get(f"/v1/jobs/{job['id']}/result")
            assert result.json() == {"tasks": 40}
            # Heartbeats come every 0.1 s.
            await eventually(lambda: worker.heartbeat_rtt_s is not None, "a heartbeat's ack")
        finally:
            worker.stop()
            await running
    assert worker.completed == 40
    assert 0 <= worker.heartbeat_rtt_s < 5.0
    # 40 results in fewer frames than results: tasks that finished together went together.
    assert sent["results"] >= 1
    assert sent["results"] + sent["result"] < 40
    assert sent["ready"] < 40  # one ready per batch, each asking for several tasks
    # Every noop shard has the one input blob: downloaded once, though the first five
    # tasks (four slots and one held) asked for it at the same moment.
    assert worker.cache.misses == 1 and worker.cache.hits == 39


async def test_a_work_buffer_holds_tasks_beyond_the_slots_but_runs_only_the_slots(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    headers = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        made = await http.post("/v1/tokens", json={"kind": "node"})
        worker = _worker(
            url, made.json()["token"], tmp_path / "worker", slots=2, prefetch=3, kinds=("sleep",)
        )
        held, computing, most_computing = [0], [0], [0]
        compute = worker._compute

        async def counting_compute(task, data):  # type: ignore[no-untyped-def]
            computing[0] += 1
            most_computing[0] = max(most_computing[0], computing[0])
            held[0] = max(held[0], len(worker.running))
            try:
                return await compute(task, data)
            finally:
                computing[0] -= 1

        worker._compute = counting_compute  # type: ignore[method-assign]
        running = asyncio.create_task(worker.run())
        try:
            job = (
                await http.post(
                    "/v1/jobs",
                    json={
                        "kind": "sleep",
                        "params": {"tasks": 12, "seconds": 0.15},
                        "replication": 1,
                    },
                )
            ).json()
            info = await _finished(http, job["id"])
        finally:
            worker.stop()
            await running
    assert info["state"] == "completed", info
    assert most_computing[0] == 2  # never more than its slots at once
    assert 3 <= held[0] <= 5  # the buffer was used, and never beyond slots + prefetch


async def test_a_held_task_downloads_its_input_while_the_slot_computes(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    headers = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        made = await http.post("/v1/tokens", json={"kind": "node"})
        worker = _worker(url, made.json()["token"], tmp_path / "worker", kinds=("sleep",))
        assert (worker.settings.slots, worker.settings.prefetch) == (1, 1)  # the defaults
        computing: list[int] = []  # task ids in a slot now
        fetched_while_busy: list[int] = []  # tasks whose input came while another computed
        compute, fetch = worker._compute, worker._fetch

        async def watched_compute(task, data):  # type: ignore[no-untyped-def]
            computing.append(task.assign.task_id)
            try:
                return await compute(task, data)
            finally:
                computing.remove(task.assign.task_id)

        async def watched_fetch(blob_hash: str) -> bytes:
            for task_id, task in worker.running.items():
                if task.assign.input.hash == blob_hash and computing and task_id not in computing:
                    fetched_while_busy.append(task_id)
            return await fetch(blob_hash)

        worker._compute = watched_compute  # type: ignore[method-assign]
        worker._fetch = watched_fetch  # type: ignore[method-assign]
        running = asyncio.create_task(worker.run())
        try:
            job = (
                await http.post(
                    "/v1/jobs",
                    json={
                        "kind": "sleep",
                        "params": {"tasks": 6, "seconds": 0.3},
                        "replication": 1,
                    },
                )
            ).json()
            info = await _finished(http, job["id"])
        finally:
            worker.stop()
            await running
    assert info["state"] == "completed", info
    # The next task's input came while the one slot computed: the hand-over waits for no
    # download. (The sleep kind fetches nothing itself while it runs.)
    assert fetched_while_busy
