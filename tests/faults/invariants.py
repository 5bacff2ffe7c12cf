"""What the fault tests check after each fault, read from the tables themselves.

Every shard has exactly one canonical result, which is a valid, credited result of that
shard; no task is credited twice, and no shard beyond its replicas besides the late
results the late rule pays (a node's and an account's credit are the sum of their
tasks' credit, and a replication-1 shard has one credited task); and the trust counters
equal what the tasks' final states imply: a node's valid and invalid results are its
tasks judged so, its errors are its tasks that failed or expired for good; its streak
(`consecutive_valid`) is the number of its results that passed a check since its last
invalid one; and its daily quota's count is the number of tasks it claimed today, less
the claims given back unheard-of (`store.claims.release_claims`).
"""

from __future__ import annotations

import math

from grids import Query, query_of

from idlegrid.store.claims import RELEASED

__all__ = [
    "Query",
    "all_judged",
    "assert_exactly_once",
    "errors",
    "query_of",
    "shards_done",
]

# Results stored but not judged yet: the monitor judges them within a pass or two.
UNJUDGED = (
    "SELECT COUNT(*) AS n FROM tasks WHERE state = 'completed' "
    "AND (outcome IS NULL OR outcome = 'late')"
)


def shards_done(query: Query) -> int:
    return int(query("SELECT COUNT(*) AS n FROM shards WHERE state = 'done'")[0]["n"])


def all_judged(query: Query) -> bool:
    return int(query(UNJUDGED)[0]["n"]) == 0


def assert_exactly_once(query: Query, *, shards: int) -> None:
    """The invariants of the module docstring, over every job in the store."""
    _assert_one_canonical_result(query, shards)
    _assert_credited_once(query)
    _assert_trust_follows_outcomes(query)
    _assert_streaks_follow_checks(query)
    _assert_quota_follows_claims(query)


def _assert_one_canonical_result(query: Query, shards: int) -> None:
    rows = query(
        "SELECT s.id, s.state, s.output_hash, t.id AS task, t.shard_id AS task_shard, "
        "t.state AS task_state, t.outcome, t.output_hash AS task_output, t.credit "
        "FROM shards s LEFT JOIN tasks t ON t.id = s.canonical_task_id"
    )
    assert len(rows) == shards
    wrong = [
        r
        for r in rows
        if not (
            r["state"] == "done"
            and r["task"] is not None
            and r["task_shard"] == r["id"]
            and r["task_state"] == "completed"
            and r["outcome"] == "valid"
            and r["task_output"] == r["output_hash"]
            and (r["credit"] or 0) > 0
        )
    ]
    assert not wrong, (
        f"{len(wrong)} shards without one valid, credited canonical result: {wrong[:3]}"
    )


# A result stored after its shard was decided, paid by the late rule: a coordinator
# started while it was leased, and it came within its lease plus that start's grace
# (`verification.credit.late_result_paid`).
_PAID_LATE = (
    "t.finished_at > s.finished_at AND EXISTS (SELECT 1 FROM coordinator_starts c "
    "WHERE c.started_at > t.assigned_at AND c.started_at <= t.finished_at "
    "AND t.finished_at <= t.lease_deadline + c.grace_s)"
)


def _assert_credited_once(query: Query) -> None:
    """Credit only for valid results; per shard at most its replicas' worth, besides the
    late results the late rule pays; per node and account, the sum of their tasks'."""
    credited = query(
        "SELECT t.shard_id, j.replication, "
        f"SUM(CASE WHEN {_PAID_LATE} THEN 0 ELSE 1 END) AS n, "
        "SUM(CASE WHEN t.outcome = 'valid' THEN 1 ELSE 0 END) AS valid, COUNT(*) AS paid "
        "FROM tasks t JOIN jobs j ON j.id = t.job_id JOIN shards s ON s.id = t.shard_id "
        "WHERE t.credit IS NOT NULL GROUP BY t.shard_id, j.replication"
    )
    unearned = [r for r in credited if r["paid"] != r["valid"]]
    assert not unearned, f"credit for results not valid: {unearned[:3]}"
    twice = [
        r for r in credited if r["n"] > r["replication"] or (r["replication"] == 1 and r["n"] != 1)
    ]
    assert not twice, f"shards whose work was credited more than once: {twice[:3]}"
    for table, key in (("nodes", "node_id"), ("accounts", "account_id")):
        sums = query(
            f"SELECT x.id, x.credit_total, COALESCE(SUM(t.credit), 0) AS earned "
            f"FROM {table} x LEFT JOIN tasks t ON t.{key} = x.id GROUP BY x.id, x.credit_total"
        )
        off = [
            r
            for r in sums
            if not math.isclose(r["credit_total"], float(r["earned"]), rel_tol=1e-9, abs_tol=1e-6)
        ]
        assert not off, f"{table} credited other than their tasks' credit: {off[:3]}"


def _assert_trust_follows_outcomes(query: Query) -> None:
    counters = {
        (r["node_id"], r["kind"], r["backend"]): (r["v"], r["i"], r["e"])
        for r in query(
            "SELECT node_id, kind, backend, valid_total AS v, invalid_total AS i, "
            "error_total AS e FROM node_trust"
        )
    }
    implied = {
        (r["node_id"], r["kind"], r["backend"]): (int(r["v"]), int(r["i"]), int(r["e"]))
        for r in query(
            "SELECT t.node_id, j.kind, COALESCE(t.backend, 'cpu') AS backend, "
            "SUM(CASE WHEN t.state = 'completed' AND t.outcome = 'valid' THEN 1 ELSE 0 END) AS v, "
            "SUM(CASE WHEN t.state = 'completed' AND t.outcome = 'invalid' THEN 1 ELSE 0 END) "
            "AS i, SUM(CASE WHEN t.state IN ('failed', 'expired') THEN 1 ELSE 0 END) AS e "
            "FROM tasks t JOIN jobs j ON j.id = t.job_id WHERE t.node_id IS NOT NULL "
            "GROUP BY t.node_id, j.kind, COALESCE(t.backend, 'cpu')"
        )
    }
    none = (0, 0, 0)
    off = {
        k: (counters.get(k, none), implied.get(k, none))
        for k in counters.keys() | implied.keys()
        if counters.get(k, none) != implied.get(k, none)
    }
    assert not off, f"trust counters (valid, invalid, errors) vs the tasks' outcomes: {off}"


# A result that passed a check: valid, and not the lone result that decided a quorum-1
# shard (accepted unchecked: `replication.decision_verdicts`).
_CHECKED = (
    "t.outcome = 'valid' AND NOT (s.quorum = 1 AND s.canonical_task_id = t.id "
    "AND (SELECT COUNT(*) FROM tasks o WHERE o.shard_id = s.id AND o.outcome = 'valid' "
    "AND o.finished_at <= s.finished_at) = 1)"
)


def _assert_streaks_follow_checks(query: Query) -> None:
    """Each node's streak is its checked results since its last invalid one (by finish)."""
    streaks = {
        (r["node_id"], r["kind"], r["backend"]): int(r["c"])
        for r in query("SELECT node_id, kind, backend, consecutive_valid AS c FROM node_trust")
    }
    implied = {
        (r["node_id"], r["kind"], r["backend"]): int(r["n"])
        for r in query(
            "SELECT t.node_id, j.kind, COALESCE(t.backend, 'cpu') AS backend, "
            f"SUM(CASE WHEN {_CHECKED} AND t.finished_at > COALESCE(("
            "SELECT MAX(b.finished_at) FROM tasks b WHERE b.node_id = t.node_id "
            "AND b.outcome = 'invalid'), -1) THEN 1 ELSE 0 END) AS n "
            "FROM tasks t JOIN jobs j ON j.id = t.job_id JOIN shards s ON s.id = t.shard_id "
            "WHERE t.node_id IS NOT NULL AND t.state = 'completed' "
            "GROUP BY t.node_id, j.kind, COALESCE(t.backend, 'cpu')"
        )
    }
    off = {
        k: (streaks.get(k, 0), implied.get(k, 0))
        for k in streaks.keys() | implied.keys()
        if streaks.get(k, 0) != implied.get(k, 0)
    }
    assert not off, f"streaks (consecutive_valid) vs checked results since an invalid: {off}"


def _assert_quota_follows_claims(query: Query) -> None:
    """Each node's count in today's quota is the tasks it claimed today, less those
    given back before it heard of them."""
    today = _today(query)
    counted = {
        (r["node_id"], r["kind"], r["backend"]): int(r["used"])
        for r in query("SELECT node_id, kind, backend, day, used FROM node_quota")
        if r["day"] == today
    }
    claimed: dict[tuple[int, str, str], int] = {}
    for r in query(
        "SELECT t.node_id, j.kind, COALESCE(t.backend, 'cpu') AS backend, t.assigned_at "
        "FROM tasks t JOIN jobs j ON j.id = t.job_id "
        "WHERE t.assigned_at IS NOT NULL AND t.node_id IS NOT NULL "
        f"AND COALESCE(t.failure_reason, '') <> '{RELEASED}'"
    ):
        if int(float(r["assigned_at"]) // 86_400) == today:
            key = (r["node_id"], r["kind"], r["backend"])
            claimed[key] = claimed.get(key, 0) + 1
    off = {
        k: (counted.get(k, 0), claimed.get(k, 0))
        for k in counted.keys() | claimed.keys()
        if counted.get(k, 0) != claimed.get(k, 0)
    }
    assert not off, f"daily quota counts vs the tasks claimed today: {off}"


def _today(query: Query) -> int:
    """The quota's day of the latest claim (the day the scenario ran)."""
    latest = query("SELECT MAX(assigned_at) AS t FROM tasks")[0]["t"]
    return int(float(latest or 0) // 86_400)


def errors(query: Query) -> int:
    return int(query("SELECT COALESCE(SUM(error_total), 0) AS n FROM node_trust")[0]["n"])
