"""Dispatch throughput of production mode with 1, 2 and 3 coordinator processes.

    .venv/bin/python benchmarks/scale_out.py [--tasks 1500] [--workers 4] [--slots 4]
        [--database postgresql://postgres@127.0.0.1:5432/test] [--redis redis://127.0.0.1:6379/0]
        [--max-coordinators 3] [--no-sqlite]

The dispatch workload: one job of `sleep` tasks with seconds=0, so every second goes to
the grid itself (claim, assign, blob download, result upload, result check, verification,
in PostgreSQL and Redis), none to computing. For each coordinator count the script starts
that many `idlegrid serve` processes on one fresh PostgreSQL schema and one fresh Redis
key prefix (both removed afterwards), and `--workers` worker processes spread round-robin
over them (each lists every coordinator, its own first). After a warm-up job it times one
job from submission to completion (the coordinator's own timestamps) and prints tasks/s
and the CPU seconds each group of processes spent meanwhile, with the coordinators' CPU
milliseconds a task. In the same run the same workload runs on the embedded default (one
coordinator on SQLite, in-process broker) for its coordinator's CPU a task. The last line
is `coordinators_1: A coordinators_2: B coordinators_3: C cpu_ms_ratio: R` (tasks per
second; R: one PostgreSQL + Redis coordinator's CPU a task over the SQLite one's).
The job is followed through the job list, not `GET /v1/jobs/{id}`, whose per-shard
rows (thousands here) would load the coordinators being measured.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from production import cpu_seconds, cpu_spent, drop_run, service_pids

from idlegrid.devtools.localgrid import LocalGrid

WARMUP_TASKS = 100


@dataclass(frozen=True)
class Run:
    store: str  # "postgres" or "sqlite"
    coordinators: int
    tasks: int
    seconds: float
    cpu: dict[str, float]

    @property
    def rate(self) -> float:
        return self.tasks / self.seconds

    @property
    def coordinator_cpu_ms(self) -> float:
        """The coordinators' CPU milliseconds a task, all of them together."""
        return 1000 * self.cpu["coordinators"] / self.tasks

    def line(self) -> str:
        cpu = ", ".join(f"{group} {seconds:.1f}" for group, seconds in self.cpu.items())
        return (
            f"{self.store} coordinators={self.coordinators}: {self.tasks} tasks in "
            f"{self.seconds:.2f} s = {self.rate:.1f} tasks/s, coordinator CPU "
            f"{self.coordinator_cpu_ms:.2f} ms a task (CPU s: {cpu})"
        )


def measure(args: argparse.Namespace, coordinators: int, root: Path, *, sqlite: bool) -> Run:
    """One timed job on `coordinators` processes (PostgreSQL + Redis), or on SQLite."""
    schema = f"bench_{uuid.uuid4().hex[:12]}"
    prefix = f"idlegrid-bench:{schema}:"
    production: dict[str, Any] = {}
    if not sqlite:
        production = dict(
            database=args.database,
            database_schema=schema,
            redis=args.redis,
            redis_prefix=prefix,
        )
    try:
        with LocalGrid(
            root,
            heartbeat_s=5.0,
            node_timeout_s=30.0,
            replication=1,  # dispatch capacity, not verification: one task per shard
            **production,
        ) as grid:
            for _ in range(coordinators - 1):
                grid.add_coordinator()
            _start_workers(grid, args)
            with grid.client() as client:
                client.submit("sleep", params={"tasks": WARMUP_TASKS}).wait(timeout=600)
                pids = {
                    "coordinators": [
                        p.pid for p in [grid.coordinator, *grid.others.values()] if p is not None
                    ],
                    "workers": [p.pid for p in grid.workers],
                }
                if not sqlite:
                    pids["postgres"] = service_pids("postgres")
                    pids["redis"] = service_pids("redis-server")
                before = cpu_seconds(pids)
                job = client.submit("sleep", params={"tasks": args.tasks, "seconds": 0})
                info = _wait_light(client, job.id)
                if not sqlite:  # backends started meanwhile count too
                    pids["postgres"] = service_pids("postgres")
                    pids["redis"] = service_pids("redis-server")
                after = cpu_seconds(pids)
        if info["state"] != "completed":
            raise SystemExit(f"job ended {info['state']}: {info.get('error')}")
        seconds = float(info["finished_at"]) - float(info["created_at"])
        cpu = cpu_spent(before, after)
        store = "sqlite" if sqlite else "postgres"
        return Run(store, coordinators=coordinators, tasks=args.tasks, seconds=seconds, cpu=cpu)
    finally:
        if not sqlite:
            asyncio.run(drop_run(args.database, schema, args.redis, prefix))


def _start_workers(grid: LocalGrid, args: argparse.Namespace) -> None:
    urls = grid.urls
    for i in range(args.workers):
        first = i % len(urls)
        grid.start_worker(
            f"worker-{i}",
            kinds="sleep",
            slots=args.slots,
            benchmark=False,
            servers=urls[first:] + urls[:first],
        )
    grid.wait_for_nodes(args.workers)


def _wait_light(client: Any, job_id: int) -> dict[str, Any]:
    """The job's final state, polled through the job list (no per-shard rows)."""
    deadline = time.monotonic() + 3600
    while time.monotonic() < deadline:
        info = next(j for j in client.jobs(limit=10) if j["id"] == job_id)
        if info["state"] not in ("queued", "running"):
            return dict(info)
        time.sleep(0.5)
    raise SystemExit(f"job {job_id} did not finish within an hour")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=1500, help="tasks in the timed job")
    parser.add_argument("--workers", type=int, default=4, help="worker processes")
    parser.add_argument("--slots", type=int, default=4, help="task slots per worker")
    parser.add_argument("--database", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--max-coordinators", type=int, default=3)
    parser.add_argument(
        "--no-sqlite", action="store_true", help="skip the embedded default's run (no ratio)"
    )
    args = parser.parse_args()
    plan = [(count, False) for count in range(1, args.max_coordinators + 1)]
    if not args.no_sqlite:
        plan.insert(1, (1, True))  # beside the single PostgreSQL coordinator
    runs = []
    for count, sqlite in plan:
        with tempfile.TemporaryDirectory(prefix="idlegrid-scale-") as tmp:
            run = measure(args, count, Path(tmp), sqlite=sqlite)
        print(run.line(), flush=True)
        runs.append(run)
    production = [run for run in runs if run.store == "postgres"]
    line = " ".join(f"coordinators_{run.coordinators}: {run.rate:.1f}" for run in production)
    embedded = [run for run in runs if run.store == "sqlite"]
    if embedded:
        ratio = production[0].coordinator_cpu_ms / embedded[0].coordinator_cpu_ms
        line += f" cpu_ms_ratio: {ratio:.2f}"
    print(line)


if __name__ == "__main__":
    main()
