"""uvicorn as `idlegrid serve` runs it (coordinator/serving.py), on a real socket in this
process: request heads bounded in time and size, connections per address, node socket
frames limited to the hello's size until the hello is accepted."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import struct
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
import websockets
from grids import serving_in_thread
from helpers import eventually

from idlegrid.app import create_app
from idlegrid.coordinator.serving import ConnectionTable, uvicorn_config
from idlegrid.settings import CoordinatorSettings

HEAD_TIMEOUT_S = 0.5


def test_connection_table_counts_per_address() -> None:
    table = ConnectionTable(per_address=2)
    a, b, c = object(), object(), object()
    assert table.admit("x", a) and table.admit("x", b)  # type: ignore[arg-type]
    assert not table.admit("x", c)  # type: ignore[arg-type]
    assert table.admit("y", c)  # type: ignore[arg-type]
    table.release(a)  # type: ignore[arg-type]
    table.release(a)  # type: ignore[arg-type]
    assert table.count("x") == 1 and table.admit("x", a)  # type: ignore[arg-type]
    assert ConnectionTable(per_address=0).admit("x", a)  # type: ignore[arg-type]


@pytest.fixture
def served(settings: CoordinatorSettings) -> Iterator[tuple[str, int, CoordinatorSettings]]:
    limited = dataclasses.replace(
        settings,
        request_head_timeout_s=HEAD_TIMEOUT_S,
        max_request_head_bytes=2048,
        max_connections_per_address=4,
        hello_max_bytes=1024,
        max_frame_bytes=8192,
    )
    server = uvicorn.Server(uvicorn_config(create_app(limited), limited, log_level="warning"))
    with serving_in_thread(limited, server) as url:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        yield host, int(port), limited


async def _exchange(
    host: str, port: int, data: bytes, *, pause_s: float = 0
) -> tuple[bytes, float]:
    """Send `data` (a byte at a time every `pause_s`, if given, until an answer comes);
    what came back, and when."""
    reader, writer = await asyncio.open_connection(host, port)
    started = time.monotonic()
    answer = asyncio.create_task(reader.read())
    for piece in [bytes([b]) for b in data] if pause_s else [data]:
        if answer.done():
            break
        writer.write(piece)
        await asyncio.sleep(pause_s)  # pacing: a client this slow is what the test is about
    try:
        got = await asyncio.wait_for(answer, 10)
    except ConnectionError:
        got = b""
    writer.close()
    return got, time.monotonic() - started


async def test_a_slow_request_head_is_cut_off(served: tuple[str, int, CoordinatorSettings]) -> None:
    host, port, _ = served
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"
    answer, took_s = await _exchange(host, port, request, pause_s=0.02)
    assert answer.startswith(b"HTTP/1.1 408") and took_s < HEAD_TIMEOUT_S + 1
    answer, took_s = await _exchange(host, port, b"")  # nothing at all: closed, no answer
    assert answer == b"" and took_s < HEAD_TIMEOUT_S + 1


async def test_a_kept_alive_connection_gets_the_same_deadline(
    served: tuple[str, int, CoordinatorSettings],
) -> None:
    host, port, _ = served
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    await reader.readexactly(length)
    writer.write(b"GET /healthz HTTP/1.1\r\n")  # the next head, never finished
    started = time.monotonic()
    rest = await asyncio.wait_for(reader.read(), 10)
    assert rest.startswith(b"HTTP/1.1 408") and time.monotonic() - started < HEAD_TIMEOUT_S + 1
    writer.close()


async def test_a_large_request_head_is_refused(
    served: tuple[str, int, CoordinatorSettings],
) -> None:
    host, port, _ = served
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 4096 + b"\r\n\r\n"
    answer, _ = await _exchange(host, port, request)
    assert answer.startswith(b"HTTP/1.1 431")
    fine = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    assert (await _exchange(host, port, fine))[0].startswith(b"HTTP/1.1 200")


async def test_connections_per_address_are_capped(
    served: tuple[str, int, CoordinatorSettings],
) -> None:
    host, port, _ = served
    url = f"ws://{host}:{port}/v1/nodes/ws"
    sockets = [await websockets.connect(url) for _ in range(3)]
    _, writer = await asyncio.open_connection(host, port)  # the fourth
    answer, _ = await _exchange(host, port, b"")  # answered before it says anything
    assert answer.startswith(b"HTTP/1.1 429") and b"max_connections_per_address 4" in answer
    await sockets.pop().close()
    fine = b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"

    async def answered() -> bool:
        return (await _exchange(host, port, fine))[0].startswith(b"HTTP/1.1 200")

    # Once the server has seen the close, the freed place takes a new connection.
    await eventually(answered, "a freed place for a new connection", poll_s=0.1)
    writer.close()
    for ws in sockets:
        await ws.close()


def _hello(api_token: str) -> str:
    return json.dumps(
        {
            "type": "hello",
            "token": api_token,
            "node_key": "node-key-1",
            "worker_version": "0.1.0",
            "hardware": {"cpu_cores": 1, "memory_mb": 1024},
            "benchmark": {"matmul_gflops": 1.0},
            "slots": 1,
            "kinds": ["sleep"],
        }
    )


async def test_frames_are_refused_on_their_header(
    served: tuple[str, int, CoordinatorSettings],
) -> None:
    host, port, settings = served
    url = f"ws://{host}:{port}/v1/nodes/ws"
    async with websockets.connect(url, compression=None) as ws:
        # A header announcing 1 GB, and nothing after: refused without waiting for it.
        ws.transport.write(bytes([0x82, 0xFF]) + struct.pack("!Q", 2**30) + bytes(4))
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        assert ws.close_code == 1009

    admin = settings.admin_token_file.read_text().strip()
    async with httpx.AsyncClient(base_url=f"http://{host}:{port}") as http:
        made = await http.post(
            "/v1/tokens",
            json={"kind": "node", "account": "volunteer"},
            headers={"Authorization": f"Bearer {admin}"},
        )
        node_token = made.json()["token"]
    async with websockets.connect(url, compression=None) as ws:
        await ws.send(_hello(node_token))
        assert json.loads(await ws.recv())["type"] == "welcome"
        padded = json.dumps({"type": "heartbeat", "seq": 3}) + " " * 6000  # > hello limit
        await ws.send(padded)
        assert json.loads(await ws.recv())["type"] == "heartbeat_ack"
        await ws.send(" " * 9000)  # > frame limit
        with pytest.raises(websockets.ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 5)
        assert ws.close_code == 1009
