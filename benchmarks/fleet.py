"""Heartbeat monitor at fleet scale: N simulated nodes against coordinator processes.

    .venv/bin/python benchmarks/fleet.py [--nodes 10000] [--window 60] [--interval 15]
        [--connect-rate 250] [--coordinator-env IDLEGRID_X=Y ...]
        [--coordinators 3 [--database postgresql://...] [--redis redis://...]]

One process simulates the fleet: N WebSocket connections on loopback to one `idlegrid
serve` subprocess (SQLite store, in-process broker: the embedded default), or with
`--coordinators K` to K of them in production mode (PostgreSQL and Redis: one fresh
schema and one fresh key prefix, both removed afterwards), the nodes spread round-robin
over them, as a load balancer spreads a real fleet. Each node does what a worker does: a
real `hello` with a node token (hardware, benchmark, slots, kinds), waits for `welcome`,
says `ready` (an idle worker asks for work), then sends a `heartbeat` every interval,
with the worker's WebSocket ping settings. Each node starts at a random phase of the
interval and every period is jittered by +-5%, as connection times spread real workers'
heartbeats. The coordinator answers each heartbeat with a `heartbeat_ack` echoing its
`sent_at`; the node's round trip is now - sent_at.

The open-files limit is raised to the hard limit first, so the coordinator subprocesses
inherit it, as a deployment raises it for its service. Nodes connect gradually
(`--connect-rate` per second, at most `--pending` awaiting their welcome; each hello is a
store write), then after `--settle` seconds the script measures over `--window` seconds:
each coordinator process's CPU time (user + system, psutil) over wall time, in percent of
one core, and the p50/p99 of the heartbeat round trips acknowledged in the window. The
last line is `nodes: N cpu: X% p99_ms: Y`, where X is the busiest coordinator's share of
a core; the line before it gives each coordinator's, the simulator's own, and with
several coordinators PostgreSQL's and Redis's (all their processes on this machine,
whoever they serve).

The nodes belong to a dedicated account `fleet` (a node token the admin makes for it);
`--coordinator-env` passes settings to the coordinator, e.g. a per-account node cap.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import resource
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import websockets
from production import cpu_seconds, cpu_spent, drop_run, service_pids
from websockets.asyncio.client import ClientConnection, connect

from idlegrid import __version__, protocol
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.worker.daemon import WS_OPTIONS, ws_url

JITTER = 0.05  # each heartbeat period is interval x (1 +- JITTER)


def raise_open_files_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def hello_frame(token: str, index: int, run: str) -> str:
    """What `Worker._hello` sends, for a plausible mid-range CPU machine."""
    return protocol.Hello(
        token=token,
        node_key=f"fleet-{run}-{index:06d}",
        name=f"fleet-{index}",
        worker_version=__version__,
        hardware=protocol.HardwareProfile(
            os="Linux-6.8-x86_64",
            cpu_model="AMD Ryzen 7 5800X",
            cpu_cores=8,
            memory_mb=32_000,
        ),
        benchmark=protocol.Benchmark(backend="cpu", matmul_gflops=120.0),
        slots=1,
        kinds=["sleep"],
    ).model_dump_json()


@dataclass
class Fleet:
    """What the simulated nodes saw; round trips are (time acked, seconds)."""

    interval: float
    connected: int = 0
    failed: int = 0
    dropped: int = 0
    heartbeats_sent: int = 0
    errors: int = 0
    rtts: list[tuple[float, float]] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)


async def run_node(fleet: Fleet, url: str, hello: str, admitted: asyncio.Event) -> None:
    """One simulated worker, until the fleet stops."""
    try:
        # The worker's own connection settings, with more patience to open.
        async with connect(url, **{**WS_OPTIONS, "open_timeout": 60}) as ws:
            await ws.send(hello)
            welcome = protocol.parse_server_message(await asyncio.wait_for(ws.recv(), 60))
            if not isinstance(welcome, protocol.Welcome):
                raise OSError(f"expected welcome, got {welcome.type}")
            fleet.connected += 1
            admitted.set()
            await ws.send(protocol.Ready(free_slots=1).model_dump_json())
            beats = asyncio.create_task(heartbeats(fleet, ws, welcome.heartbeat_interval_s))
            try:
                async for frame in ws:
                    on_frame(fleet, frame)
            finally:
                beats.cancel()
            if not fleet.stop.is_set():
                fleet.dropped += 1
    except (OSError, TimeoutError, websockets.WebSocketException) as exc:
        if not fleet.stop.is_set():
            if not admitted.is_set():
                fleet.failed += 1
                if fleet.failed <= 5:
                    print(f"node failed to connect: {exc!r}", flush=True)
            else:
                fleet.dropped += 1
    finally:
        admitted.set()


def on_frame(fleet: Fleet, frame: str | bytes) -> None:
    message = json.loads(frame)
    kind = message.get("type")
    if kind == "heartbeat_ack":
        now = time.monotonic()
        fleet.rtts.append((now, now - float(message["sent_at"])))
    elif kind == "error":
        fleet.errors += 1
        if fleet.errors <= 5:
            print(f"coordinator error: {message}", flush=True)


async def heartbeats(fleet: Fleet, ws: ClientConnection, interval: float) -> None:
    await asyncio.sleep(random.uniform(0, interval))  # connection times spread the phases
    seq = 0
    while True:
        seq += 1
        beat = protocol.Heartbeat(load=0.3, seq=seq, sent_at=time.monotonic())
        await ws.send(beat.model_dump_json())
        fleet.heartbeats_sent += 1
        await asyncio.sleep(interval * random.uniform(1 - JITTER, 1 + JITTER))


async def watch_loop_lag(lags: list[float], tick: float = 0.05) -> None:
    """Milliseconds each tick of this process's loop came late."""
    while True:
        before = time.monotonic()
        await asyncio.sleep(tick)
        lags.append((time.monotonic() - before - tick) * 1000)


async def connect_fleet(
    fleet: Fleet, urls: list[str], token: str, nodes: int, rate: float, pending_max: int
) -> None:
    """Open `nodes` connections at about `rate` per second, at most `pending_max` awaiting
    welcome; node i goes to coordinator i mod len(urls)."""
    run = os.urandom(3).hex()
    pending = asyncio.Semaphore(max(1, pending_max))
    pending_welcomes: list[asyncio.Task[None]] = []
    started = time.monotonic()
    for index in range(nodes):
        await pending.acquire()
        admitted = asyncio.Event()
        url = urls[index % len(urls)]
        task = asyncio.create_task(run_node(fleet, url, hello_frame(token, index, run), admitted))
        fleet.tasks.add(task)
        task.add_done_callback(fleet.tasks.discard)
        pending_welcomes.append(asyncio.create_task(_release_on(admitted, pending)))
        lag = started + (index + 1) / rate - time.monotonic()
        if lag > 0:
            await asyncio.sleep(lag)
        if (index + 1) % 1000 == 0:
            print(
                f"  {index + 1} nodes started, {fleet.connected} welcomed, "
                f"{time.monotonic() - started:.0f} s",
                flush=True,
            )
    await asyncio.gather(*pending_welcomes)


async def _release_on(admitted: asyncio.Event, pending: asyncio.Semaphore) -> None:
    await admitted.wait()
    pending.release()


def percentile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1]


async def measure(
    args: argparse.Namespace, urls: list[str], token: str, pids: dict[str, list[int]]
) -> str:
    """Connect the fleet, then measure one window; `pids`: the processes whose CPU counts
    (each "coordinator N" one process; other groups are reported for what bounds it)."""
    fleet = Fleet(interval=args.interval)
    began = time.monotonic()
    await connect_fleet(
        fleet, [ws_url(url) for url in urls], token, args.nodes, args.connect_rate, args.pending
    )
    print(
        f"connected {fleet.connected} nodes in {time.monotonic() - began:.0f} s "
        f"({fleet.failed} failed); settling {args.settle:.0f} s",
        flush=True,
    )
    # Ten thousand connections are many long-lived objects, and every heartbeat leaves
    # a few alive until the next: the cyclic GC's passes over them would stall this
    # simulator, and its stalls count in the round trips it measures (a real node is one
    # process each). Freeze what is there and switch the collector off until the window
    # ends: reference counting still frees almost everything, and the run is short.
    gc.collect()
    gc.freeze()
    gc.disable()
    await asyncio.sleep(args.settle)
    # This process's own stalls count in the round trips it measures: watch them.
    lags: list[float] = []
    watcher = asyncio.create_task(watch_loop_lag(lags))
    cpu_before, wall_before = cpu_seconds(pids), time.monotonic()
    sent_before, dropped_before = fleet.heartbeats_sent, fleet.dropped
    load_before = os.getloadavg()[0]
    await asyncio.sleep(args.window)
    cpu_after, wall_after = cpu_seconds(pids), time.monotonic()
    fleet.stop.set()
    watcher.cancel()
    gc.enable()
    wall = wall_after - wall_before
    spent = cpu_spent(cpu_before, cpu_after)
    shares = {group: 100.0 * spent[group] / wall for group in pids}
    window = [rtt * 1000 for at, rtt in fleet.rtts if wall_before <= at <= wall_after]
    sent = fleet.heartbeats_sent - sent_before
    coordinators = [group for group in pids if group.startswith("coordinator")]
    rss = sum(_rss_mib(pid) for group in coordinators for pid in pids[group])
    print(
        f"window {wall:.1f} s: {sent} heartbeats sent, {len(window)} acked "
        f"({sent / wall:.0f}/s); nodes connected {fleet.connected}, "
        f"dropped {fleet.dropped - dropped_before}, errors {fleet.errors}; coordinator RSS "
        f"{rss:.0f} MiB; load average {load_before:.1f} to {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    if not window:
        raise SystemExit("no heartbeat was acknowledged in the window")
    print(
        f"heartbeat rtt ms: p50 {percentile(window, 0.5):.1f} p90 {percentile(window, 0.9):.1f}"
        f" p99 {percentile(window, 0.99):.1f} max {max(window):.1f}",
        flush=True,
    )
    print(
        f"this process's event loop lag ms (simulated nodes): p99 {percentile(lags, 0.99):.1f} "
        f"max {max(lags):.1f}",
        flush=True,
    )
    for task in list(fleet.tasks):
        task.cancel()
    await asyncio.gather(*fleet.tasks, return_exceptions=True)
    print("cpu % of one core: " + ", ".join(f"{g} {v:.1f}" for g, v in shares.items()))
    live = fleet.connected - fleet.dropped
    busiest = max(shares[group] for group in coordinators)
    return f"nodes: {live} cpu: {busiest:.1f}% p99_ms: {percentile(window, 0.99):.1f}"


def _run(coro):  # type: ignore[no-untyped-def]
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _rss_mib(pid: int) -> float:
    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return 0.0


def main() -> None:
    args = _parse_args()
    limit = raise_open_files_limit()
    if limit < args.nodes + 1000:
        raise SystemExit(f"open-files limit {limit} is too low for {args.nodes} nodes")
    # The whole fleet is one account on one address (loopback): lift the Sybil limits
    # and the per-address connection limits for it, as an operator does for a known
    # large contributor (or a proxy's address). `--coordinator-env` can set them back.
    extra_env = {
        "IDLEGRID_MAX_NODES_PER_ACCOUNT": str(args.nodes),
        "IDLEGRID_NODE_REGISTRATIONS_PER_ACCOUNT_PER_HOUR": str(args.nodes),
        "IDLEGRID_NODE_REGISTRATIONS_PER_ADDRESS_PER_HOUR": str(args.nodes),
        "IDLEGRID_MAX_CONNECTIONS_PER_ADDRESS": "0",
        "IDLEGRID_MAX_PENDING_SOCKETS": "0",
        "IDLEGRID_MAX_PENDING_SOCKETS_PER_ADDRESS": "0",
    }
    extra_env.update(item.split("=", 1) for item in args.coordinator_env)
    where = (
        f"{args.coordinators} coordinators (PostgreSQL + Redis)"
        if args.coordinators
        else "one coordinator (SQLite, in-process broker)"
    )
    print(
        f"open-files limit {limit}; {args.nodes} nodes, heartbeat every {args.interval} s; {where}"
    )
    schema = f"fleet_{uuid.uuid4().hex[:12]}"
    prefix = f"idlegrid-fleet:{schema}:"
    production: dict[str, Any] = {}
    if args.coordinators:
        production = dict(
            database=args.database, database_schema=schema, redis=args.redis, redis_prefix=prefix
        )
    try:
        with (
            tempfile.TemporaryDirectory(prefix="idlegrid-fleet-") as tmp,
            LocalGrid(
                args.logs or Path(tmp),
                heartbeat_s=args.interval,
                node_timeout_s=3 * args.interval,
                extra_env=extra_env,
                **production,
            ) as grid,
        ):
            for _ in range(args.coordinators - 1):
                grid.add_coordinator()
            token = grid.create_token(kind="node", account="fleet")["token"]
            # uvloop when installed, as uvicorn uses it in the coordinator.
            line = _run(measure(args, grid.urls, token, _measured_pids(grid, production)))
    finally:
        if production:
            asyncio.run(drop_run(args.database, schema, args.redis, prefix))
    print(line)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--window", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--interval", type=float, default=15.0, help="heartbeat seconds")
    parser.add_argument("--settle", type=float, default=20.0, help="seconds before the window")
    parser.add_argument("--connect-rate", type=float, default=250.0, help="new nodes per second")
    parser.add_argument(
        "--coordinator-env",
        action="append",
        default=[],
        metavar="IDLEGRID_X=Y",
        help="a setting for the coordinators (repeatable)",
    )
    parser.add_argument(
        "--coordinators",
        type=int,
        default=0,
        help="coordinator processes on PostgreSQL + Redis (default: one on SQLite)",
    )
    parser.add_argument(
        "--pending",
        type=int,
        help="hellos awaiting their welcome at once (default: the connect rate on SQLite; "
        "10 a coordinator on PostgreSQL, within each one's pool of 10 connections, as a "
        "PostgreSQL shared with others may refuse more)",
    )
    parser.add_argument(
        "--logs",
        type=Path,
        help="keep the coordinators' logs (and data) in this directory (default: removed)",
    )
    parser.add_argument("--database", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    args = parser.parse_args()
    if args.coordinators < 0:
        parser.error("--coordinators must be 1 or more (or left out: one on SQLite)")
    if args.nodes < 1:
        parser.error("--nodes must be at least 1")
    if args.pending is None:
        args.pending = 10 * args.coordinators if args.coordinators else int(args.connect_rate)
    elif args.pending < 1:
        parser.error("--pending must be at least 1")
    return args


def _measured_pids(grid: LocalGrid, production: dict[str, Any]) -> dict[str, list[int]]:
    """Each coordinator's process, this one (the simulated fleet), and in production mode
    PostgreSQL's and Redis's (all of theirs on this machine, whoever they serve)."""
    processes = [p for p in [grid.coordinator, *grid.others.values()] if p is not None]
    if not production:
        return {"coordinator": [processes[0].pid], "simulator": [os.getpid()]}
    pids = {f"coordinator {i + 1}": [proc.pid] for i, proc in enumerate(processes)}
    pids["simulator"] = [os.getpid()]
    pids["postgres"] = service_pids("postgres")
    pids["redis"] = service_pids("redis-server")
    return pids


if __name__ == "__main__":
    main()
