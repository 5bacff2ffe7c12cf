"""A real worker daemon against a real coordinator, in one process: uvicorn on a loopback
port, real WebSockets and HTTP. Proves what the hand-spoken protocol tests cannot: the
daemon batches results that finish together, claims several tasks per `ready`, skips
uploading an output blob twice, and times its heartbeats by their acknowledgements."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from pydantic import BaseModel

from idlegrid.coordinator.app import create_app
from idlegrid.protocol import HardwareProfile
from idlegrid.settings import CoordinatorSettings, WorkerSettings
from idlegrid.worker.daemon import Worker


@pytest.fixture
async def coordinator(tmp_path: Path) -> AsyncIterator[tuple[str, str]]:
    """(URL, admin token) of a coordinator served in this process."""
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", heartbeat_interval_s=0.1)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), lifespan="on", log_level="warning")
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        assert not serving.done(), "the coordinator did not start"
        await asyncio.sleep(0.02)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        yield url, settings.admin_token_file.read_text().strip()
    finally:
        server.should_exit = True
        await serving
        sock.close()


async def test_daemon_runs_noop_tasks_in_batches_and_times_heartbeats(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    headers = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        made = await http.post("/v1/tokens", json={"kind": "node"})
        worker = Worker(
            WorkerSettings(
                servers=(url,),
                token=made.json()["token"],
                state_dir=tmp_path / "worker",
                slots=4,
                kinds=("noop",),
                benchmark=False,
                dedicated=True,
                control_port=-1,
            )
        )
        worker.hardware = HardwareProfile()  # no probe: this test is about the protocol
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
            for _ in range(600):
                info = (await http.get(f"/v1/jobs/{job['id']}")).json()
                if info["state"] != "queued" and info["state"] != "running":
                    break
                await asyncio.sleep(0.05)
            assert info["state"] == "completed", info
            assert info["tasks_completed"] == 40
            result = await http.get(f"/v1/jobs/{job['id']}/result")
            assert result.json() == {"tasks": 40}
            for _ in range(100):  # heartbeats come every 0.1 s
                if worker.heartbeat_rtt_s is not None:
                    break
                await asyncio.sleep(0.05)
        finally:
            worker.stop()
            await running
    assert worker.completed == 40
    assert 0 <= worker.heartbeat_rtt_s < 5.0
    # 40 results in fewer frames than results: tasks that finished together went together.
    assert sent["results"] >= 1
    assert sent["results"] + sent["result"] < 40
    assert sent["ready"] < 40  # one ready per batch, each asking for several tasks
    # Every noop shard has the one input blob: fetched by the first tasks, at once, only.
    assert worker.cache.misses <= 4 and worker.cache.hits >= 36


async def test_a_work_buffer_holds_tasks_beyond_the_slots_but_runs_only_the_slots(
    coordinator: tuple[str, str], tmp_path: Path
) -> None:
    url, admin = coordinator
    headers = {"Authorization": f"Bearer {admin}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=30) as http:
        made = await http.post("/v1/tokens", json={"kind": "node"})
        worker = Worker(
            WorkerSettings(
                servers=(url,),
                token=made.json()["token"],
                state_dir=tmp_path / "worker",
                slots=2,
                prefetch=3,
                kinds=("sleep",),
                benchmark=False,
                dedicated=True,
                control_port=-1,
            )
        )
        worker.hardware = HardwareProfile()
        held, computing, most_computing = [0], [0], [0]
        compute = worker._compute

        async def counting_compute(task):  # type: ignore[no-untyped-def]
            computing[0] += 1
            most_computing[0] = max(most_computing[0], computing[0])
            held[0] = max(held[0], len(worker.running))
            try:
                return await compute(task)
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
            for _ in range(600):
                info = (await http.get(f"/v1/jobs/{job['id']}")).json()
                if info["state"] not in ("queued", "running"):
                    break
                await asyncio.sleep(0.05)
        finally:
            worker.stop()
            await running
    assert info["state"] == "completed", info
    assert most_computing[0] == 2  # never more than its slots at once
    assert 3 <= held[0] <= 5  # the buffer was used, and never beyond slots + prefetch
