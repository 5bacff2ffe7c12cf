"""Lying worker daemons against the real coordinator: caught, redone, paid nothing.

Runs a small scenario of `benchmarks/adversarial.py` (real `idlegrid serve`, real worker
daemons in their own processes, each on its own account): every wrong result is
rejected, every shard is decided by honest nodes, and liars earn no credit.
"""

from __future__ import annotations

import importlib.util
import sqlite3
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "adversarial.py"


def _adversarial() -> ModuleType:
    spec = importlib.util.spec_from_file_location("adversarial", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["adversarial"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_lying_workers_are_caught_their_work_redone_and_unpaid(tmp_path: Path) -> None:
    adversarial = _adversarial()
    tally = adversarial.run_scenario(
        "cheating-20%", shards=40, nodes=8, seed=1, root=tmp_path, timeout=300
    )
    assert tally.failed == ""
    assert tally.shards == 40
    assert sum(tally.returned_wrong.values()) > 0  # they did lie
    assert sum(tally.accepted_wrong.values()) == 0 and tally.wrong_shards == 0
    assert tally.honest_rejected == 0
    db = sqlite3.connect(tmp_path / "coordinator" / "idlegrid.db")
    credit = dict(db.execute("SELECT name, credit_total FROM nodes").fetchall())
    liars = {name: c for name, c in credit.items() if not name.startswith("honest")}
    assert liars and all(c == 0.0 for c in liars.values()), liars
    assert all(c > 0 for name, c in credit.items() if name.startswith("honest"))
    # Their accounts too: credit only for validated work.
    accounts = dict(
        db.execute(
            "SELECT name, credit_total FROM accounts WHERE name LIKE 'volunteer-%'"
        ).fetchall()
    )
    assert all(accounts[f"volunteer-{name}"] == 0.0 for name in liars)


@pytest.mark.slow
def test_a_liar_honest_until_trusted_gets_no_wrong_result_into_a_job(tmp_path: Path) -> None:
    adversarial = _adversarial()
    tally = adversarial.run_scenario(
        "patient",
        shards=150,
        nodes=8,
        seed=0,
        root=tmp_path,
        timeout=600,
        adaptive_after=5,
        honest_first=15,
    )
    assert tally.failed == ""
    assert tally.returned_wrong["patient"] > 0  # it did lie, once trusted
    assert tally.wrong_final == 0 and tally.honest_rejected == 0
    assert tally.accepted_wrong["patient"] <= 1
    # Caught once, it ran nothing alone again.
    assert tally.suspension_s is not None and tally.alone_after == 0
