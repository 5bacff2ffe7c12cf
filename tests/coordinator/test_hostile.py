"""Hostile clients against a real `idlegrid serve`, over raw sockets, while an honest
worker runs a job: bad JSON, unknown types, messages before hello, oversized frames
before and after hello, another node's task, a replayed result, 1,000 connect and
disconnect cycles, idle sockets and half-sent HTTP requests. The job completes with
one result per shard, and the coordinator's memory stays within a bound throughout.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sqlite3
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import websockets
from helpers import wait_until

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.sleep import _digest

pytestmark = pytest.mark.slow

HELLO_TIMEOUT_S = 2.0
HEAD_TIMEOUT_S = 2.0
PENDING_PER_ADDRESS = 32
BIG_FRAME = 15 * 1024 * 1024
MIB_OF_X = b"x" * (1024 * 1024)
# Over the coordinator's footprint at rest. Without the limits, 20 frames of 15 MB
# before hello alone took it 570 MB higher.
RSS_HEADROOM = 150 * 1024 * 1024


class PeakRss:
    """Samples a process's resident memory in a thread; `peak` is the highest seen."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def grid(tmp_path: Path) -> Iterator[LocalGrid]:
    env = {
        "IDLEGRID_HELLO_TIMEOUT_S": str(HELLO_TIMEOUT_S),
        "IDLEGRID_REQUEST_HEAD_TIMEOUT_S": str(HEAD_TIMEOUT_S),
        "IDLEGRID_MAX_PENDING_SOCKETS_PER_ADDRESS": str(PENDING_PER_ADDRESS),
    }
    with LocalGrid(
        tmp_path, heartbeat_s=0.5, node_timeout_s=5.0, replication=1, extra_env=env
    ) as local:
        yield local


def _ws_url(grid: LocalGrid) -> str:
    return grid.url.replace("http://", "ws://") + "/v1/nodes/ws"


def _hello(token: str, key: str) -> str:
    return json.dumps(
        {
            "type": "hello",
            "token": token,
            "node_key": key,
            "name": key,
            "worker_version": "0.1.0",
            "hardware": {"cpu_cores": 1, "memory_mb": 1024},
            "benchmark": {"matmul_gflops": 1.0},
            "slots": 1,
            "kinds": ["sleep"],
        }
    )


async def _reply(ws: Any) -> dict[str, Any]:
    return dict(json.loads(await asyncio.wait_for(ws.recv(), 10)))


async def _garbage_before_hello(url: str) -> list[str]:
    """Bad JSON, unknown types, messages before hello: each answered, the socket kept."""
    codes = []
    async with websockets.connect(url) as ws:
        for frame in (
            "{not json",
            json.dumps({"type": "launch_missiles"}),
            json.dumps({"type": "ready", "free_slots": 1}),
            json.dumps(
                {
                    "type": "result",
                    "task_id": 1,
                    "output": "ab" * 32,
                    "output_size": 1,
                    "elapsed_s": 1,
                }
            ),
            "[" * 50_000,
        ):
            await ws.send(frame)
            codes.append((await _reply(ws))["code"])
    return codes


async def _big_frame_before_hello(url: str) -> tuple[int | None, int]:
    """A 15 MB frame before hello, its payload sent 1 MiB at a time (so that, were it
    buffered, all of them would be at once): the close code, and the MiB it took."""
    async with websockets.connect(url, max_size=None, compression=None, open_timeout=30) as ws:
        # FIN + binary, masked with a zero key (the payload goes as is), 64-bit length.
        ws.transport.write(bytes([0x82, 0x80 | 127]) + struct.pack("!Q", BIG_FRAME) + bytes(4))
        sent = 0
        try:
            while sent < BIG_FRAME and not ws.transport.is_closing():
                ws.transport.write(MIB_OF_X)
                sent += len(MIB_OF_X)
                await asyncio.sleep(0.1)  # pacing: a MiB at a time is the attack
            await asyncio.wait_for(ws.recv(), 30)
        except (websockets.ConnectionClosed, ConnectionError):
            pass
        return ws.close_code, sent // len(MIB_OF_X)


async def _idle_ws(url: str) -> tuple[str, float]:
    """A socket that never says hello: how it ended, and when."""
    started = time.monotonic()
    try:
        async with websockets.connect(url, open_timeout=30) as ws:
            reply = await _reply(ws)
            await ws.wait_closed()
            return f"{reply['code']}:{ws.close_code}", time.monotonic() - started
    except websockets.InvalidStatus as exc:
        return f"http:{exc.response.status_code}", time.monotonic() - started


async def _half_request(host: str, port: int) -> float:
    """A request head that never ends, one header line a second: when it was cut off."""
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    writer.write(b"GET /v1/nodes/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n")
    try:
        for _ in range(30):
            await asyncio.sleep(0.5)  # pacing: the slow header lines are the attack
            writer.write(b"X-Slow: 1\r\n")
            await writer.drain()
            if reader.at_eof():
                break
        await asyncio.wait_for(reader.read(), 10)
    except (ConnectionError, TimeoutError):
        pass
    writer.close()
    return time.monotonic() - started


async def _cycles(host: str, port: int, count: int, *, at_once: int = 8) -> int:
    """Open a WebSocket and go away, `count` times (`at_once` in parallel): half close
    after the upgrade, half drop the connection mid-handshake."""
    upgrade = (
        b"GET /v1/nodes/ws HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    upgraded = 0

    async def cycle(i: int) -> None:
        nonlocal upgraded
        reader, writer = await asyncio.open_connection(host, port)
        if i % 2:
            writer.write(upgrade)
            head = await reader.readuntil(b"\r\n\r\n")  # awaited before `+=` reads the count
            upgraded += head.startswith(b"HTTP/1.1 101")
        else:
            writer.write(upgrade[:40])
        writer.transport.abort()

    for start in range(0, count, at_once):
        await asyncio.gather(*(cycle(i) for i in range(start, min(start + at_once, count))))
    return upgraded


def _tasks(grid: LocalGrid, query: str, *args: object) -> list[tuple[Any, ...]]:
    with sqlite3.connect(grid.data_dir / "idlegrid.db") as db:
        return db.execute(query, args).fetchall()


async def _rogue_node(grid: LocalGrid, token: str) -> dict[str, Any]:
    """A node of its own account: takes a task, answers it, replays the answer, answers
    another node's task, then sends a frame over the frame limit."""
    seen: dict[str, Any] = {}
    async with websockets.connect(_ws_url(grid), max_size=None) as ws:
        await ws.send(_hello(token, "rogue-node-1"))
        welcome = await _reply(ws)
        assert welcome["type"] == "welcome", welcome
        await ws.send(json.dumps({"type": "ready", "free_slots": 1}))
        assign = await _reply(ws)
        while assign["type"] != "assign":
            assign = await _reply(ws)
        output = _digest(assign["shard_index"])
        digest = hashlib.sha256(output).hexdigest()
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {token}"}) as http:
            put = await http.put(f"{grid.url}/v1/blobs/{digest}", content=output)
            assert put.status_code == 201, put.text
        result = {
            "type": "result",
            "task_id": assign["task_id"],
            "output": digest,
            "output_size": len(output),
            "elapsed_s": 0.1,
        }
        for name in ("first", "replay"):
            await ws.send(json.dumps(result))
            reply = await _reply(ws)
            while reply["type"] == "heartbeat_ack":
                reply = await _reply(ws)
            seen[name] = reply
        others = _tasks(grid, "SELECT id FROM tasks WHERE node_id != ? LIMIT 1", welcome["node_id"])
        await ws.send(json.dumps({**result, "task_id": others[0][0]}))
        seen["other"] = await _reply(ws)
        seen["task_id"] = assign["task_id"]
        try:
            await ws.send(json.dumps({"type": "heartbeat", "pad": "x" * (2 * 1024 * 1024)}))
            await asyncio.wait_for(ws.recv(), 10)
        except websockets.ConnectionClosed:
            pass
        seen["close_code"] = ws.close_code
    return seen


async def _attack(grid: LocalGrid, rogue_token: str) -> dict[str, Any]:
    url = _ws_url(grid)
    host, port = grid.url.removeprefix("http://").rsplit(":", 1)
    found: dict[str, Any] = {"garbage": await _garbage_before_hello(url)}
    found["big"] = await asyncio.gather(*(_big_frame_before_hello(url) for _ in range(20)))
    found["rogue"] = await _rogue_node(grid, rogue_token)
    found["cycles"] = await _cycles(host, int(port), 1000)
    idle = [_idle_ws(url) for _ in range(PENDING_PER_ADDRESS + 4)]
    half = [_half_request(host, int(port)) for _ in range(10)]
    ends = await asyncio.gather(*idle, *half)
    found["idle"], found["half"] = ends[: len(idle)], ends[len(idle) :]
    return found


def test_hostile_clients_leave_an_honest_job_intact(grid: LocalGrid) -> None:
    with grid.client() as client:
        baseline = psutil.Process(grid.coordinator.pid).memory_info().rss  # type: ignore[union-attr]
        grid.start_worker("honest", kinds="sleep", slots=2, benchmark=False)
        grid.wait_for_nodes(1)
        job = client.submit("sleep", params={"tasks": 40, "seconds": 0.1})
        wait_until(
            lambda: _tasks(grid, "SELECT 1 FROM tasks WHERE node_id IS NOT NULL"),
            "the honest worker's first task",
        )
        with PeakRss(grid.coordinator.pid) as rss:  # type: ignore[union-attr]
            found = asyncio.run(_attack(grid, grid.volunteer_token("mallory")))
            info = job.wait(timeout=60)
            result = job.result()

    assert found["garbage"] == ["malformed", "unknown_type", "out_of_order", "out_of_order"] + [
        "malformed"
    ]
    for code, mib_sent in found["big"]:
        assert code == 1009 and mib_sent < 5  # refused on the frame's header
    rogue = found["rogue"]
    assert rogue["first"] == {**rogue["first"], "type": "result_ack", "status": "accepted"}
    assert rogue["replay"]["type"] == "result_ack" and rogue["replay"]["status"] == "duplicate"
    assert rogue["other"]["type"] == "error" and rogue["other"]["code"] == "rejected"
    assert rogue["close_code"] == 1009
    assert found["cycles"] == 500
    endings = sorted(end for end, _ in found["idle"])
    assert endings.count("out_of_order:1008") == PENDING_PER_ADDRESS, endings
    assert endings.count("http:429") == 4, endings
    assert all(took_s < HELLO_TIMEOUT_S + 5 for _, took_s in found["idle"])
    assert all(took_s < HEAD_TIMEOUT_S + 5 for took_s in found["half"])

    assert info["state"] == "completed"
    assert result == [json.loads(_digest(i)) for i in range(40)]
    per_shard = _tasks(
        grid,
        "SELECT shard_id, COUNT(*) FROM tasks WHERE state = 'completed' GROUP BY shard_id",
    )
    assert len(per_shard) == 40 and all(n == 1 for _, n in per_shard)
    credited = _tasks(
        grid, "SELECT COUNT(*) FROM tasks WHERE id = ? AND state = 'completed'", rogue["task_id"]
    )
    assert credited == [(1,)]
    assert rss.peak - baseline < RSS_HEADROOM, (rss.peak - baseline) / 2**20
