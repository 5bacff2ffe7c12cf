"""What moving a blob costs in CPU: the coordinator's and a worker-like client's.

    PYTHONPATH=src python benchmarks/blob_transfer.py [--mb 2] [--times 50]

Starts a `LocalGrid` coordinator (SQLite, a temporary directory) and, from this process,
with the httpx `AsyncClient` the worker daemon uses: downloads one `--mb` MB blob
`--times` times (`GET /v1/blobs/{hash}`, the bytes only: no hash, no cache) and uploads
`--times` new blobs of a quarter of that size (`PUT`, the size of an onnx-infer shard's
output beside its input). CPU seconds (user + system) of both processes around each
loop, per blob, and the wall time per blob. The coordinator's figure includes its token
and access checks and, for uploads, hashing, writing and fsync.

The last line is `download_ms: coordinator X client Y upload_ms: coordinator Z client W`
(CPU milliseconds a blob).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import httpx
import psutil

from idlegrid.devtools.localgrid import LocalGrid


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=2.0, help="downloaded blob size (MB)")
    parser.add_argument("--times", type=int, default=50, help="transfers of each kind")
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.times < 1:
        parser.error("--mb must be > 0 and --times >= 1")
    return args


def _cpu(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def _measure(
    label: str, coordinator: psutil.Process, times: int, one: Callable[[int], Awaitable[None]]
) -> tuple[float, float]:
    """CPU ms a transfer (coordinator, client); prints them with the wall time."""
    me = psutil.Process()
    own, theirs, started = _cpu(me), _cpu(coordinator), time.perf_counter()
    for index in range(times):
        await one(index)
    wall = (time.perf_counter() - started) / times
    client_ms = (_cpu(me) - own) / times * 1000
    coordinator_ms = (_cpu(coordinator) - theirs) / times * 1000
    print(
        f"{label}: wall {wall * 1000:.1f} ms, CPU coordinator {coordinator_ms:.1f} ms, "
        f"client {client_ms:.1f} ms a blob"
    )
    return coordinator_ms, client_ms


async def run(url: str, token: str, coordinator: psutil.Process, args: argparse.Namespace) -> str:
    size = int(args.mb * 1_000_000)
    blob = os.urandom(size)
    blob_hash = hashlib.sha256(blob).hexdigest()
    # Made before timing: hashing them is the worker's cost, not the transfer's.
    outputs = [os.urandom(size // 4) for _ in range(args.times)]
    names = [hashlib.sha256(output).hexdigest() for output in outputs]
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60
    ) as http:
        (await http.put(f"/v1/blobs/{blob_hash}", content=blob)).raise_for_status()
        (await http.get(f"/v1/blobs/{blob_hash}")).raise_for_status()  # warm

        async def download(_: int) -> None:
            response = await http.get(f"/v1/blobs/{blob_hash}")
            response.raise_for_status()
            assert len(response.content) == size

        async def upload(index: int) -> None:
            response = await http.put(f"/v1/blobs/{names[index]}", content=outputs[index])
            response.raise_for_status()

        print(f"{args.mb:g} MB down, {args.mb / 4:g} MB up, {args.times} times each")
        down = await _measure("download", coordinator, args.times, download)
        up = await _measure("upload", coordinator, args.times, upload)
    return (
        f"download_ms: coordinator {down[0]:.1f} client {down[1]:.1f} "
        f"upload_ms: coordinator {up[0]:.1f} client {up[1]:.1f}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with (
        tempfile.TemporaryDirectory(prefix="idlegrid-bench-") as tmp,
        LocalGrid(Path(tmp)) as grid,
    ):
        assert grid.coordinator is not None
        coordinator = psutil.Process(grid.coordinator.pid)
        token = str(grid.create_token()["token"])
        print(asyncio.run(run(grid.url, token, coordinator, args)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
