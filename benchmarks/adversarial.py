"""Honest and malicious workers against the real coordinator and verifier.

    .venv/bin/python benchmarks/adversarial.py [--shards 5000] [--nodes 40] [--scenarios ...]

Each scenario starts a fresh grid (`idlegrid serve` on SQLite, the shipped verification
defaults: three replicas on distinct accounts, quorum of two with credibility voting,
adaptive replication, spot checks, quotas, suspension) and `--nodes` worker daemons in
four processes. Every node is a real `Worker` (its own account and node token, real
WebSocket and blob transfers) that runs the `vectors` kind (cheap float work with
embed-text's shape and fuzzy comparison) and then, according to its strategy, reports
the honest output or a lie:

- honest; random (random unit vectors); zeros; perturbed (honest + noise 1e-3, beyond
  the kind's tolerance); replay (its output for another shard); colluding (all colluders
  return the same wrong answer: the honest one with its components rotated);
  intermittent (random vectors on 10% of its tasks); stops (drops 5% of its tasks
  without a word, so their leases run out);
- pair: two nodes of different accounts with a side channel (they run in one process
  and share what they hold). Each is honest for its first 100 tasks, then lies (the
  same rotated answer) on a shard only when the other holds it too, waiting up to 2 s
  to learn that, and is honest otherwise;
- patient: honest for its first 100 tasks (by then it runs shards alone), then lies
  (random vectors) on every task.

All nodes connect from 127.0.0.1, so "one replica per network" is off (on a real grid it
is one more wall against colluders); everything else is as shipped.

Afterwards the coordinator's database says which results were accepted (credit granted:
in the winning group, or a trusted node's result run alone, even if a recheck later found
it wrong) and which were rejected; each result, and each shard's rows of the job's final
result, is compared with the honest output by the kind's own `compare`. Per scenario it
prints shards, wrong results accepted, wrong shards in the final result, honest results
wrongly rejected, effective replication (tasks run per shard, overall and over the
second half of the job, after the nodes earned trust) and throughput; for the patient
liar also the time from its first disagreement to its last shard run alone, and to the
first extra replica of a shard it decided alone. The last line is
`wrong_accepted_noncolluding: N wrong_accepted_colluding: P% wrong_accepted_intermittent: Q%
honest_rejected: M replication_honest: R wrong_final: F wrong_accepted_patient: W`, P and
Q as shares of the wrong results those nodes returned, R the honest scenario's
replication after warm-up, F the wrong shards in any final result, W the wrong results
of the pair and the patient liar accepted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from idlegrid.blobs.files import BlobStore
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds import Verdict, get_kind
from idlegrid.kinds import vectors as vectors_kind

SHARD_SIZE = 4
PROCESSES = 4
LIE_NOISE = 1e-3
INTERMITTENT_RATE = 0.1
STOP_RATE = 0.05
CHEATS = ("random", "zeros", "perturbed", "replay")
HONEST_FIRST = 100  # tasks a pair member or a patient liar runs honestly first (default)
PAIR_WAIT_S = 2.0
PATIENT = ("pair", "patient")

# name: (strategy per node share): the rest of the nodes are honest.
SCENARIOS: dict[str, list[tuple[str, float]]] = {
    "honest": [],
    "cheating-20%": [(cheat, 0.05) for cheat in CHEATS],
    "colluding-10%": [("colluding", 0.10)],
    "intermittent-20%": [("intermittent", 0.20)],
    "stops-10%": [("stops", 0.10)],
    "zeros-10%": [("zeros", 0.10)],
    "pair": [("pair", 0.0)],
    "patient": [("patient", 0.0)],
}
# Strategies that come as a fixed number of nodes, not a share of the fleet.
FIXED_COUNT = {"pair": 2, "patient": 1}

# The pair's side channel: (job id, shard index) each member holds now, by node name.
HELD: dict[str, set[tuple[int, int]]] = {}


# -- the worker side ------------------------------------------------------------------------


def lie(
    strategy: str, honest: np.ndarray, rng: random.Random, history: list[np.ndarray]
) -> np.ndarray | None:
    """The output a node with `strategy` reports instead of `honest` (None: the truth)."""
    gen = np.random.default_rng(rng.getrandbits(32))
    if strategy == "intermittent":
        strategy = "random" if rng.random() < INTERMITTENT_RATE else "honest"
    match strategy:
        case "honest" | "stops":
            return None
        case "pair":
            out = np.roll(honest, 1, axis=1)
        case "patient":
            out = gen.standard_normal(honest.shape)
        case "random":
            out = gen.standard_normal(honest.shape)
        case "zeros":
            return np.zeros_like(honest)
        case "perturbed":
            out = honest + gen.normal(0.0, LIE_NOISE, honest.shape)
        case "replay":
            same = [h for h in history if h.shape == honest.shape and not np.array_equal(h, honest)]
            out = rng.choice(same) if same else gen.standard_normal(honest.shape)
        case "colluding":
            out = np.roll(honest, 1, axis=1)
        case _:
            raise ValueError(strategy)
    return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)


def make_worker_class() -> type:
    from idlegrid.worker.daemon import RunningTask, Worker

    class Adversary(Worker):  # type: ignore[misc]
        def __init__(self, settings: Any, strategy: str, seed: int, honest_first: int) -> None:
            super().__init__(settings)
            self.honest_first = honest_first
            self.strategy = strategy
            self.done = 0
            self.rng = random.Random(seed)
            self.history: list[np.ndarray] = []

        async def _execute(self, task_id: int) -> None:
            if self.strategy == "stops" and self.rng.random() < STOP_RATE:
                # Gone quiet on this task: no result, no failure; its lease runs out.
                await asyncio.sleep(30)
                self.running.pop(task_id, None)
                await self._send_ready()
                return
            await super()._execute(task_id)

        async def _compute(self, task: RunningTask, data: bytes) -> bytes:
            honest_bytes = await super()._compute(task, data)
            honest = vectors_kind.parse(honest_bytes)
            self.done += 1
            strategy = self.strategy
            if strategy in PATIENT and self.done <= self.honest_first:
                strategy = "honest"
            if strategy == "pair" and not await self._partner_holds(task):
                strategy = "honest"
            wrong = lie(strategy, honest, self.rng, self.history)
            self.history = (self.history + [honest])[-20:]
            return honest_bytes if wrong is None else vectors_kind.to_npy(wrong)

        async def _partner_holds(self, task: RunningTask) -> bool:
            shard = (task.assign.job_id, task.assign.shard_index)
            mine = HELD.setdefault(self.settings.name, set())
            mine.add(shard)
            try:
                deadline = time.monotonic() + PAIR_WAIT_S
                while True:
                    others = [s for name, s in HELD.items() if name != self.settings.name]
                    if any(shard in held for held in others):
                        return True
                    if time.monotonic() > deadline:
                        return False
                    await asyncio.sleep(0.02)
            finally:
                # Held a little longer, so the partner still sees it while it decides.
                asyncio.get_running_loop().call_later(PAIR_WAIT_S * 2, mine.discard, shard)

    return Adversary


async def serve_nodes(spec: dict[str, Any]) -> None:
    from idlegrid.settings import WorkerSettings

    adversary = make_worker_class()
    workers = [
        adversary(
            WorkerSettings(
                servers=(spec["server"],),
                token=node["token"],
                state_dir=Path(node["state_dir"]),
                name=node["name"],
                kinds=("vectors",),
                benchmark=False,
                dedicated=True,
                control_port=-1,
            ),
            node["strategy"],
            node["seed"],
            spec["honest_first"],
        )
        for node in spec["nodes"]
    ]
    await asyncio.gather(*(w.run() for w in workers))


# -- the coordinator's verdicts ---------------------------------------------------------------


@dataclass
class Tally:
    shards: int = 0
    seconds: float = 0.0
    tasks: int = 0
    tasks_late_half: int = 0
    shards_late_half: int = 0
    wrong_shards: int = 0  # canonical result wrong
    returned_wrong: Counter[str] = field(default_factory=Counter)
    accepted_wrong: Counter[str] = field(default_factory=Counter)
    honest_rejected: int = 0
    wrong_final: int = 0  # shards whose rows in the job's final result are wrong
    # The patient liar: seconds from its first disagreement to its last shard claimed
    # alone (0: none after), how many it claimed alone after, and seconds to the first
    # extra replica of a shard it ran alone (None: no disagreement seen).
    suspension_s: float | None = None
    alone_after: int = 0
    first_replica_s: float | None = None
    failed: str = ""

    @property
    def replication(self) -> float:
        return self.tasks / self.shards if self.shards else float("nan")

    @property
    def replication_after_warmup(self) -> float:
        return self.tasks_late_half / self.shards_late_half if self.shards_late_half else 0.0


def tally(data_dir: Path, job_id: int, strategies: dict[str, str], seconds: float) -> Tally:
    kind = get_kind("vectors")
    params = kind.parse_params({"items": 1, "shard_size": SHARD_SIZE})
    blobs = BlobStore(data_dir / "blobs", max_bytes=1 << 30)
    db = sqlite3.connect(data_dir / "idlegrid.db")
    shards = {
        row[0]: row[1:]
        for row in db.execute(
            "SELECT id, idx, item_count, state, canonical_task_id FROM shards WHERE job_id = ?",
            (job_id,),
        )
    }
    out = Tally(shards=sum(1 for s in shards.values() if s[2] == "done"), seconds=seconds)
    half = len(shards) // 2
    honest_cache: dict[int, bytes] = {}

    def honest(idx: int, count: int) -> bytes:
        if idx not in honest_cache:
            honest_cache[idx] = vectors_kind.to_npy(
                vectors_kind.compute(idx * SHARD_SIZE, count, 0)
            )
        return honest_cache[idx]

    for task_id, shard_id, output_hash, outcome, credit, name in db.execute(
        "SELECT tasks.id, shard_id, output_hash, outcome, credit, nodes.name FROM tasks "
        "JOIN nodes ON nodes.id = tasks.node_id WHERE tasks.job_id = ? "
        "AND tasks.state = 'completed'",
        (job_id,),
    ):
        idx, count, _, canonical = shards[shard_id]
        out.tasks += 1
        if idx >= half:
            out.tasks_late_half += 1
        output = blobs.read(output_hash)
        right = kind.compare(honest(idx, count), output, params) == Verdict.AGREE
        strategy = strategies[name]
        if not right:
            out.returned_wrong[strategy] += 1
            # Accepted: valid now, or credited once (a lone result is credited when its
            # node passes a later check; a recheck that finds it wrong takes the credit
            # back but leaves the task's credit at 0, not empty).
            if outcome == "valid" or credit is not None:
                out.accepted_wrong[strategy] += 1
            if canonical == task_id:
                out.wrong_shards += 1
        elif outcome == "invalid":
            out.honest_rejected += 1
    out.shards_late_half = sum(1 for s in shards.values() if s[0] >= half and s[2] == "done")
    out.wrong_final = wrong_in_final(db, blobs, job_id, shards, honest)
    patient_timing(db, job_id, strategies, out)
    db.close()
    return out


def wrong_in_final(
    db: sqlite3.Connection,
    blobs: BlobStore,
    job_id: int,
    shards: dict[int, tuple[Any, ...]],
    honest: Any,
) -> int:
    """Shards whose rows in the job's final result differ from the honest ones."""
    (result_hash,) = db.execute("SELECT result_hash FROM jobs WHERE id = ?", (job_id,)).fetchone()
    if result_hash is None:
        return 0
    kind = get_kind("vectors")
    params = kind.parse_params({"items": 1, "shard_size": SHARD_SIZE})
    rows = vectors_kind.parse(blobs.read(result_hash))
    wrong = 0
    for idx, count, _, _ in shards.values():
        part = vectors_kind.to_npy(rows[idx * SHARD_SIZE : idx * SHARD_SIZE + count])
        wrong += kind.compare(honest(idx, count), part, params) != Verdict.AGREE
    return wrong


def patient_timing(
    db: sqlite3.Connection, job_id: int, strategies: dict[str, str], out: Tally
) -> None:
    """How fast the patient liar stopped running shards alone once it was first caught.

    Its first disagreement: the earliest moment one of its results that ended invalid
    and another node's result of that shard were both in.
    """
    names = [name for name, strategy in strategies.items() if strategy == "patient"]
    if not names:
        return
    marks = ",".join("?" * len(names))
    caught = db.execute(
        f"SELECT MIN(MAX(mine.finished_at, (SELECT MIN(other.finished_at) FROM tasks other "
        f"WHERE other.shard_id = mine.shard_id AND other.id != mine.id "
        f"AND other.state = 'completed'))) FROM tasks mine JOIN nodes ON nodes.id = "
        f"mine.node_id WHERE mine.job_id = ? AND mine.outcome = 'invalid' "
        f"AND nodes.name IN ({marks})",
        (job_id, *names),
    ).fetchone()[0]
    if caught is None:
        return
    alone = db.execute(
        f"SELECT COUNT(*), MAX(tasks.assigned_at) FROM tasks JOIN shards ON shards.id = "
        f"tasks.shard_id JOIN nodes ON nodes.id = tasks.node_id WHERE tasks.job_id = ? "
        f"AND shards.mode IN ('alone', 'spot') AND tasks.assigned_at > ? "
        f"AND nodes.name IN ({marks})",
        (job_id, caught, *names),
    ).fetchone()
    out.alone_after = alone[0]
    out.suspension_s = max(0.0, (alone[1] or caught) - caught)
    first = db.execute(
        f"SELECT MIN(extra.assigned_at) FROM tasks extra JOIN shards ON shards.id = "
        f"extra.shard_id WHERE extra.job_id = ? AND shards.mode = 'escalated' "
        f"AND extra.created_at >= ? AND EXISTS (SELECT 1 FROM tasks mine JOIN nodes ON "
        f"nodes.id = mine.node_id WHERE mine.shard_id = extra.shard_id "
        f"AND nodes.name IN ({marks}))",
        (job_id, caught, *names),
    ).fetchone()[0]
    out.first_replica_s = None if first is None else first - caught


# -- one scenario -----------------------------------------------------------------------------


def strategies_for(scenario: str, nodes: int, rng: random.Random) -> list[str]:
    mix: list[str] = []
    for strategy, share in SCENARIOS[scenario]:
        mix += [strategy] * FIXED_COUNT.get(strategy, max(1, round(share * nodes)))
    mix += ["honest"] * (nodes - len(mix))
    rng.shuffle(mix)
    return mix


def run_scenario(
    scenario: str,
    *,
    shards: int,
    nodes: int,
    seed: int,
    root: Path,
    timeout: float,
    adaptive_after: int | None = None,
    honest_first: int = HONEST_FIRST,
) -> Tally:
    rng = random.Random(seed)
    plan = strategies_for(scenario, nodes, rng)
    env = {
        # Every node connects from 127.0.0.1: lift the per-address registration limit.
        "IDLEGRID_NODE_REGISTRATIONS_PER_ADDRESS_PER_HOUR": str(10 * nodes),
    }
    if adaptive_after is not None:
        env["IDLEGRID_ADAPTIVE_AFTER"] = str(adaptive_after)
    with LocalGrid(
        root, heartbeat_s=2.0, node_timeout_s=8.0, min_lease_s=30.0, extra_env=env
    ) as grid:
        specs: list[dict[str, Any]] = [
            {"server": grid.url, "nodes": [], "honest_first": honest_first}
            for _ in range(PROCESSES)
        ]
        strategies: dict[str, str] = {}
        for i, strategy in enumerate(plan):
            name = f"{strategy}-{i:03d}"
            strategies[name] = strategy
            # The pair shares one process: its side channel is that process's memory.
            specs[0 if strategy == "pair" else i % PROCESSES]["nodes"].append(
                {
                    "name": name,
                    "strategy": strategy,
                    "token": grid.volunteer_token(f"volunteer-{name}"),
                    "state_dir": str(root / "nodes" / name),
                    "seed": rng.getrandbits(32),
                }
            )
        logs = [open(root / f"nodes-{p}.log", "w") for p in range(PROCESSES)]  # noqa: SIM115
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--serve-nodes", json.dumps(spec)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
            )
            for spec, log in zip(specs, logs, strict=True)
        ]
        try:
            # Generous: on a loaded machine 20 workers take minutes to import and connect.
            grid.wait_for_nodes(nodes, timeout=600)
            with grid.client() as client:
                started = time.perf_counter()
                job = client.submit(
                    "vectors", params={"items": shards * SHARD_SIZE, "shard_size": SHARD_SIZE}
                )
                failed = ""
                try:
                    job.wait(timeout=timeout)
                except Exception as exc:  # noqa: BLE001 - reported, not hidden
                    failed = f"{type(exc).__name__}: {exc}"
                seconds = time.perf_counter() - started
                job_id = job.id
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
            for log in logs:
                log.close()
        result = tally(grid.data_dir, job_id, strategies, seconds)
        result.failed = failed
        return result


def report(scenario: str, t: Tally) -> None:
    wrong = sum(t.returned_wrong.values())
    accepted = sum(t.accepted_wrong.values())
    timing = ""
    if t.suspension_s is not None:
        replica = "none" if t.first_replica_s is None else f"{t.first_replica_s:.2f} s"
        timing = (
            f"  caught -> last alone claim {t.suspension_s:.2f} s ({t.alone_after} after), "
            f"-> first extra replica {replica}"
        )
    print(
        f"{scenario:<17} shards {t.shards:>5}  wrong returned {wrong:>5}  "
        f"wrong accepted {accepted:>4} (final result: {t.wrong_final})  "
        f"honest rejected {t.honest_rejected:>3}  replication {t.replication:.3f} "
        f"(2nd half {t.replication_after_warmup:.3f})  "
        f"{t.shards / t.seconds:.1f} shards/s"
        + timing
        + (f"  FAILED: {t.failed}" if t.failed else ""),
        flush=True,
    )


def pct(numerator: int, denominator: int) -> float:
    return 100.0 * numerator / denominator if denominator else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=int, default=5000)
    parser.add_argument("--nodes", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--scenarios", nargs="*", default=list(SCENARIOS))
    parser.add_argument(
        "--adaptive-after",
        type=int,
        default=None,
        help="the coordinator's streak before a node runs alone (default: its own)",
    )
    parser.add_argument(
        "--honest-first",
        type=int,
        default=HONEST_FIRST,
        help="tasks a pair member or a patient liar runs honestly before it lies",
    )
    parser.add_argument(
        "--keep",
        type=Path,
        default=None,
        help="keep each scenario's grid (database, logs) under this directory",
    )
    parser.add_argument("--serve-nodes", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_nodes:
        asyncio.run(serve_nodes(json.loads(args.serve_nodes)))
        return
    print(
        f"{args.nodes} nodes, {args.shards} shards of {SHARD_SIZE} vectors per scenario, "
        f"seed {args.seed}, adaptive_after {args.adaptive_after or 'default'}, "
        f"honest_first {args.honest_first}; "
        f"{os.cpu_count()} CPUs",
        flush=True,
    )
    results: dict[str, Tally] = {}
    for scenario in args.scenarios:
        with tempfile.TemporaryDirectory(prefix="idlegrid-adversarial-") as tmp:
            root = args.keep / scenario if args.keep else Path(tmp)
            results[scenario] = run_scenario(
                scenario,
                shards=args.shards,
                nodes=args.nodes,
                seed=args.seed,
                root=root,
                timeout=args.timeout,
                adaptive_after=args.adaptive_after,
                honest_first=args.honest_first,
            )
        report(scenario, results[scenario])
    total = Counter[str]()
    accepted = Counter[str]()
    rejected = 0
    for t in results.values():
        total.update(t.returned_wrong)
        accepted.update(t.accepted_wrong)
        rejected += t.honest_rejected
    noncolluding = sum(accepted[s] for s in CHEATS)
    honest = results.get("honest")
    print(
        f"wrong_accepted_noncolluding: {noncolluding} "
        f"wrong_accepted_colluding: {pct(accepted['colluding'], total['colluding']):.2f}% "
        f"wrong_accepted_intermittent: "
        f"{pct(accepted['intermittent'], total['intermittent']):.2f}% "
        f"honest_rejected: {rejected} "
        f"replication_honest: "
        f"{honest.replication_after_warmup if honest else float('nan'):.3f} "
        f"wrong_final: {sum(t.wrong_final for t in results.values())} "
        f"wrong_accepted_patient: {sum(accepted[s] for s in PATIENT)}"
    )


if __name__ == "__main__":
    main()
