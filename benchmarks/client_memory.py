"""A coordinator's memory under clients that send or fetch a lot at once.

    PYTHONPATH=src .venv/bin/python benchmarks/client_memory.py [--sockets 20] [--frame-mb 15]
        [--downloads 16] [--blob-mb 64]

Starts `idlegrid serve` (SQLite, temporary directory; the pending-socket cap per address
lifted so that every socket reaches the frame limit, not the 429), then:

1. Frames before hello: `--sockets` WebSockets each send one binary frame of `--frame-mb`
   MB before their hello, the payload 1 MiB every 0.1 s, all at once (so a server that
   buffers frames holds them all together). Prints the close codes, the MiB each could
   send, and the coordinator's RSS before and at its peak (sampled every 20 ms).
2. Slow downloads: one `--blob-mb` MiB blob, fetched by `--downloads` clients at once,
   each reading about 10 MiB/s. Prints RSS before and at the peak, and whether every copy
   was intact.

The last line is `frames_peak_mb: X downloads_peak_mb: Y` (peak RSS over the start).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import struct
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import websockets

from idlegrid.devtools.localgrid import LocalGrid

MIB = 1024 * 1024


class Peak:
    """The highest RSS of a process, sampled every 20 ms while in use."""

    def __init__(self, process: psutil.Process) -> None:
        self.process = process
        self.start = process.memory_info().rss
        self.peak = self.start
        self._task: asyncio.Task[None] | None = None

    async def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.process.memory_info().rss)
            await asyncio.sleep(0.02)

    async def __aenter__(self) -> Peak:
        self._task = asyncio.create_task(self._sample())
        return self

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.sleep(0.5)
        assert self._task is not None
        self._task.cancel()

    def line(self) -> str:
        return f"RSS {self.start / MIB:.0f} MB before, peak {self.peak / MIB:.0f} MB"


async def _frame_before_hello(url: str, frame_bytes: int) -> tuple[int | None, int]:
    chunk = b"x" * MIB
    async with websockets.connect(url, max_size=None, compression=None, open_timeout=60) as ws:
        # FIN + binary, masked with a zero key (the payload goes as is), 64-bit length.
        ws.transport.write(bytes([0x82, 0x80 | 127]) + struct.pack("!Q", frame_bytes) + bytes(4))
        sent = 0
        try:
            while sent < frame_bytes and not ws.transport.is_closing():
                piece = chunk[: frame_bytes - sent]
                ws.transport.write(piece)
                sent += len(piece)
                await asyncio.sleep(0.1)
            await asyncio.wait_for(ws.recv(), 30)
        except (websockets.ConnectionClosed, ConnectionError, TimeoutError):
            pass
        return ws.close_code, round(sent / MIB)


async def frames(grid: LocalGrid, process: psutil.Process, sockets: int, frame_mb: int) -> Peak:
    url = grid.url.replace("http://", "ws://") + "/v1/nodes/ws"
    async with Peak(process) as peak:
        ends = await asyncio.gather(
            *(_frame_before_hello(url, frame_mb * 10**6) for _ in range(sockets))
        )
    codes = sorted({str(code) for code, _ in ends})
    sent = sorted({mib for _, mib in ends})
    print(f"{sockets} frames of {frame_mb} MB before hello: closes {codes}, MiB sent {sent}")
    print(f"  {peak.line()}")
    return peak


async def downloads(grid: LocalGrid, process: psutil.Process, clients: int, blob_mb: int) -> Peak:
    auth = {"Authorization": f"Bearer {grid.admin_token}"}
    data = os.urandom(blob_mb * MIB)
    digest = hashlib.sha256(data).hexdigest()
    async with httpx.AsyncClient(base_url=grid.url, headers=auth, timeout=300) as http:
        stored = await http.put(f"/v1/blobs/{digest}", content=data)
        assert stored.status_code == 201, stored.text
    del data
    await asyncio.sleep(2)

    async def fetch() -> bool:
        got = hashlib.sha256()
        async with (
            httpx.AsyncClient(base_url=grid.url, headers=auth, timeout=300) as http,
            http.stream("GET", f"/v1/blobs/{digest}") as response,
        ):
            async for chunk in response.aiter_bytes(256 * 1024):
                got.update(chunk)
                await asyncio.sleep(0.025)  # about 10 MiB/s
        return got.hexdigest() == digest

    started = time.monotonic()
    async with Peak(process) as peak:
        intact = await asyncio.gather(*(fetch() for _ in range(clients)))
    took = time.monotonic() - started
    print(f"{clients} slow downloads of a {blob_mb} MiB blob: intact {all(intact)}, {took:.1f} s")
    print(f"  {peak.line()}")
    return peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sockets", type=int, default=20)
    parser.add_argument("--frame-mb", type=int, default=15)
    parser.add_argument("--downloads", type=int, default=16)
    parser.add_argument("--blob-mb", type=int, default=64)
    args = parser.parse_args()
    env = {"IDLEGRID_MAX_PENDING_SOCKETS_PER_ADDRESS": str(args.sockets + 16)}
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalGrid(Path(tmp), extra_env=env) as grid,
    ):
        assert grid.coordinator is not None
        process = psutil.Process(grid.coordinator.pid)
        time.sleep(2)  # past start-up's allocations
        framed = asyncio.run(frames(grid, process, args.sockets, args.frame_mb))
        fetched = asyncio.run(downloads(grid, process, args.downloads, args.blob_mb))
    print(
        f"frames_peak_mb: {(framed.peak - framed.start) / MIB:.0f} "
        f"downloads_peak_mb: {(fetched.peak - fetched.start) / MIB:.0f}"
    )


if __name__ == "__main__":
    main()
