"""A liar in a pool too small to outvote it: every job still ends, and the liar is judged.

Real `idlegrid serve` (SQLite) and one real worker process per node, each on an account
of its own, running the `vectors` kind (embed-text's shape and fuzzy comparison, cheap
to compute) through the node of `benchmarks/adversarial.py`: honest nodes report the
output, a liar reports random unit vectors. With replication 3 every shard's dispute
needs a fourth or fifth node that the pool does not have; the verifier then decides on
the evidence it has (`verification.stalemate`). Each job must end completed, every
shard decided within a lease time of its last result, every canonical result honest,
and the liar's results judged invalid (it is suspended) and paid nothing.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from faults.invariants import assert_exactly_once
from helpers import wait_until

from idlegrid.devtools.localgrid import LocalGrid

pytestmark = pytest.mark.slow

ADVERSARIAL = Path(__file__).resolve().parents[2] / "benchmarks" / "adversarial.py"
SHARDS = 30
SHARD_SIZE = 4
LEASE_S = 30.0


def _adversarial() -> ModuleType:
    """benchmarks/adversarial.py: its lying node, and its tally of wrong results."""
    spec = importlib.util.spec_from_file_location("adversarial", ADVERSARIAL)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["adversarial"] = module
    spec.loader.exec_module(module)
    return module


def _node_process(
    grid: LocalGrid, root: Path, name: str, strategy: str, log: Any, **spec: Any
) -> Any:
    node = {
        "name": name,
        "strategy": strategy,
        "token": grid.volunteer_token(f"volunteer-{name}"),
        "state_dir": str(root / "nodes" / name),
        "seed": len(name),
    }
    body = {"server": grid.url, "nodes": [node], "honest_first": spec.get("honest_first", 0)}
    return subprocess.Popen(
        [sys.executable, str(ADVERSARIAL), "--serve-nodes", json.dumps(body)],
        stdout=subprocess.DEVNULL,
        stderr=log,
        start_new_session=True,
    )


def _run(
    root: Path,
    *,
    honest: int,
    shards: int = SHARDS,
    strategy: str = "random",
    env: dict[str, str] | None = None,
    **liar: Any,
) -> dict[str, Any]:
    """One job of `shards` shards, replication 3, on `honest` honest nodes and one liar."""
    extra = {"IDLEGRID_NODE_REGISTRATIONS_PER_ADDRESS_PER_HOUR": "100", **(env or {})}
    with LocalGrid(
        root, heartbeat_s=1.0, node_timeout_s=6.0, min_lease_s=LEASE_S, extra_env=extra
    ) as grid:
        names = [f"honest-{i}" for i in range(honest)] + ["liar"]
        logs = [open(root / f"{name}.log", "w") for name in names]  # noqa: SIM115
        procs = [
            _node_process(grid, root, name, "honest" if name != "liar" else "random", log, **liar)
            for name, log in zip(names, logs, strict=True)
        ]
        try:
            grid.wait_for_nodes(len(names), timeout=120)
            with grid.client() as client:
                started = time.perf_counter()
                job = client.submit(
                    "vectors",
                    params={"items": shards * SHARD_SIZE, "shard_size": SHARD_SIZE},
                    replication=3,
                )
                info = job.wait(timeout=shards * LEASE_S)
                seconds = time.perf_counter() - started

            def query(sql: str) -> list[dict[str, Any]]:
                with contextlib.closing(sqlite3.connect(grid.data_dir / "idlegrid.db")) as db:
                    db.row_factory = sqlite3.Row
                    return [dict(row) for row in db.execute(sql).fetchall()]

            wait_until(lambda: _all_judged(query), "late results judged", timeout_s=30)
            strategies = {name: "honest" if name != "liar" else strategy for name in names}
            tally = _adversarial().tally(grid.data_dir, job.id, strategies, seconds)
            return {"info": info, "seconds": seconds, "query": query, "tally": tally}
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=30)
            for log in logs:
                log.close()


def _all_judged(query: Any) -> bool:
    rows = query(
        "SELECT COUNT(*) AS n FROM tasks WHERE state = 'completed' "
        "AND (outcome IS NULL OR outcome = 'late')"
    )
    return rows[0]["n"] == 0


def _check(run: dict[str, Any], *, shards: int = SHARDS, canonical_liar: bool = False) -> None:
    query = run["query"]
    assert run["info"]["state"] == "completed", run["info"]
    tally = run["tally"]
    # No wrong result accepted (valid, or paid even for a while), none in the result,
    # no honest result rejected.
    assert sum(tally.returned_wrong.values()) > 0
    assert sum(tally.accepted_wrong.values()) == 0 and tally.wrong_shards == 0, tally
    assert tally.wrong_final == 0 and tally.honest_rejected == 0, tally
    # Every canonical result is an honest node's; every shard decided within a lease
    # time of its last result (no shard waits for a node that cannot come).
    late = query(
        "SELECT s.id, s.finished_at - MAX(t.finished_at) AS waited, n.name "
        "FROM shards s JOIN tasks t ON t.shard_id = s.id AND t.state = 'completed' "
        "JOIN tasks c ON c.id = s.canonical_task_id JOIN nodes n ON n.id = c.node_id "
        "GROUP BY s.id, s.finished_at, n.name"
    )
    assert len(late) == shards
    assert canonical_liar or all(r["name"] != "liar" for r in late), late
    assert max(r["waited"] for r in late) <= LEASE_S, late
    liar = query(
        "SELECT n.suspended_at, n.credit_total, "
        "SUM(CASE WHEN t.outcome = 'invalid' THEN 1 ELSE 0 END) AS invalid, "
        "SUM(CASE WHEN t.outcome = 'valid' THEN 1 ELSE 0 END) AS valid "
        "FROM nodes n JOIN tasks t ON t.node_id = n.id WHERE n.name = 'liar' "
        "GROUP BY n.id, n.suspended_at, n.credit_total"
    )[0]
    if canonical_liar:  # honest at first: judged invalid once it lies
        assert liar["invalid"] >= 1, liar
    else:
        assert liar["invalid"] >= 3 and liar["valid"] == 0, liar
        assert liar["suspended_at"] is not None and liar["credit_total"] == 0.0, liar
    assert_exactly_once(query, shards=shards)


def test_three_honest_nodes_and_a_liar_replication_3(tmp_path: Path) -> None:
    """Three agree against the liar: the dispute margin is met, not the credibility a
    fifth node would bring; the shard is decided without it."""
    run = _run(tmp_path, honest=3)
    _check(run)
    print(f"4 nodes, 1 liar: {run['seconds']:.1f} s")


def test_two_honest_nodes_and_a_liar_replication_3(tmp_path: Path) -> None:
    """Two agree against the liar: a strict majority against one untrusted dissenter;
    once the liar is suspended, the two honest results decide alone."""
    run = _run(tmp_path, honest=2)
    _check(run)
    print(f"3 nodes, 1 liar: {run['seconds']:.1f} s")


def test_a_liar_honest_until_trusted_among_three_honest_nodes(tmp_path: Path) -> None:
    """Honest for 15 tasks (trusted after 10), then lying: its lies run alone are checked,
    escalated, and decided against it by the three honest nodes, with no fifth node;
    none of them is accepted or paid, even while its dispute is open."""
    shards = 60
    run = _run(
        tmp_path,
        honest=3,
        shards=shards,
        strategy="patient",
        honest_first=15,
        env={"IDLEGRID_ADAPTIVE_AFTER": "10"},
    )
    _check(run, shards=shards, canonical_liar=True)
    print(f"4 nodes, 1 liar honest until trusted: {run['seconds']:.1f} s")
