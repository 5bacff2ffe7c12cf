"""llm-generate's checked verification end to end, on real processes: `idlegrid serve` on
SQLite and `idlegrid worker` processes over WebSockets (`LocalGrid`), each node a
volunteer of its own, on the real SmolLM2 model, greedy and a few tokens.

- A pool of four with a liar in it (a real worker whose generations carry wrong
  log-probabilities, `llm_adversaries`; its checks are honest) finishes: each shard's
  result is an honest generation, the liar's are judged invalid and earn nothing.
- A job whose assembly fails (the coordinator's fault point `assemble-job-<id>`) fails
  with the reason, while a job beside it completes (on the cheap `sleep` kind: the fault
  is the verifier's, whatever the kind).

Both watch the job to its end, and a job that is running with every shard done must say
what it waits for, or move on.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from grids import Query, query_of
from helpers import wait_until
from llm_adversaries import start_liar
from llm_model import model_path

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds import get_kind
from idlegrid.kinds.base import RunContext
from idlegrid.kinds.llm_generate.samples import chat_prompts, prompts_jsonl
from idlegrid.kinds.sleep import _digest

pytestmark = pytest.mark.slow

KIND = "llm-generate"
MAX_TOKENS = 8
# One chat prompt per shard (each is about 40 tokens with the template, plus MAX_TOKENS).
TOKEN_BUDGET = 64
JOB_END_S = 240.0
# A job running with every shard done and nothing to wait for is assembling its result:
# a long poll this long that sees no change means it is stuck there.
ASSEMBLY_S = 15.0
TERMINAL = ("completed", "failed", "cancelled")
SLEEP_SHARDS = 3


def _params() -> dict[str, Any]:
    return {"max_tokens": MAX_TOKENS, "token_budget": TOKEN_BUDGET}


def _honest_lines(model: Path, records: list[dict[str, object]], tmp: Path) -> list[Any]:
    """The job's result as one honest node makes it: the kind's split, run and assemble
    in this process, on this environment's llama.cpp (the workers' build)."""
    kind = get_kind(KIND)
    data = model.read_bytes()
    inputs = {"model": data, "prompts": prompts_jsonl(records)}
    params = kind.derive_params(inputs, kind.parse_params(_params()))
    blobs = {hashlib.sha256(data).hexdigest(): data}
    context = RunContext(threads=1, fetch=blobs.__getitem__, scratch=tmp / "honest" / "task")
    outputs = [kind.run(s.payload, params, context) for s in kind.split(inputs, params)]
    return [json.loads(line) for line in kind.assemble(outputs, params).splitlines()]


def _same_generation(got: list[Any], honest: list[Any]) -> bool:
    """Same tokens, text and finish; log-probabilities within rounding of the honest ones
    (the liar's are `llm_adversaries.LOGPROB_SHIFT` away)."""
    if len(got) != len(honest):
        return False
    for mine, theirs in zip(got, honest, strict=True):
        if [mine[k] for k in ("index", "tokens", "text", "finish_reason")] != [
            theirs[k] for k in ("index", "tokens", "text", "finish_reason")
        ]:
            return False
        if any(
            abs(a - b) > 1e-3 for a, b in zip(mine["logprobs"], theirs["logprobs"], strict=True)
        ):
            return False
    return True


def _watch_to_end(job: Any, timeout_s: float = JOB_END_S) -> dict[str, Any]:
    """Follow `job` with long polls until it ends; its last info.

    Whenever it is running with every shard done, it must name what it waits for, or
    move on (assemble, reopen a shard) within a long poll of `ASSEMBLY_S`."""

    def ended() -> dict[str, Any] | None:
        info = job.info(wait_s=1.0)
        if _all_done_unexplained(info):
            later = job.info(wait_s=ASSEMBLY_S)
            assert not _same_stall(info, later), (
                f"job {job.id} stays running with all {info['shards_total']} shards done "
                f"and waits for nothing it names: {later}"
            )
            info = later
        return info if info["state"] in TERMINAL else None

    return wait_until(ended, f"job {job.id} to end", timeout_s=timeout_s, poll_s=0.01)


def _all_done_unexplained(info: dict[str, Any]) -> bool:
    return (
        info["state"] == "running"
        and info["shards_done"] == info["shards_total"]
        and not info["waiting_for"]
    )


def _same_stall(before: dict[str, Any], after: dict[str, Any]) -> bool:
    return _all_done_unexplained(after) and after["tasks_completed"] == before["tasks_completed"]


def _wait_for_rows(query: Query, sql: str, what: str, *, timeout_s: float = 120.0) -> list[Any]:
    return wait_until(lambda: query(sql), what, timeout_s=timeout_s, poll_s=0.1)


HONEST = ["honest-0", "honest-1", "honest-2"]


def _start_honest(grid: LocalGrid, names: list[str]) -> list[subprocess.Popen[str]]:
    return [grid.start_worker(name, kinds=KIND, threads=1, benchmark=False) for name in names]


def _online(client: Any) -> set[str]:
    return {node["name"] for node in client.nodes() if node["online"]}


# -- a liar in a pool of four -------------------------------------------------------------


def test_a_pool_of_four_with_a_liar_caught_in_it_finishes(
    embedded_grid: Callable[..., LocalGrid], tmp_path: Path
) -> None:
    """Four nodes register; the three honest ones go offline, so the liar alone makes
    (and lies on) the first outputs while the job says what it waits for; the honest
    ones come back, check its outputs, catch each lie, and make and check the shards
    again. The job completes with the honest generation; every output of the liar is
    invalid and paid nothing.

    The honest nodes are registered before the job: a shard that no registered node can
    add a result to is failed at once (docs/verification.md, "When no node can add a
    result"), which a liar alone on a fresh grid would be."""
    model = model_path()
    records = chat_prompts(3)
    honest = _honest_lines(model, records, tmp_path)
    grid = embedded_grid(tmp_path / "grid")
    query = query_of(grid)
    start_liar(grid, "liar", kinds=KIND)
    first_run = _start_honest(grid, HONEST)
    grid.wait_for_nodes(4, timeout=180)
    with grid.client() as client:
        for proc in first_run:  # the worker's SIGTERM: give back what it holds, and stop
            proc.terminate()
        for proc in first_run:
            proc.wait(timeout=30)
        wait_until(lambda: _online(client) == {"liar"}, "the honest nodes offline")
        job = client.generate(model, records, **_params())
        info = job.info()
        assert (info["replication"], info["shards_total"]) == (2, len(records)), info
        [liar] = query("SELECT id FROM nodes WHERE name = 'liar'")
        _wait_for_rows(
            query,
            f"SELECT id FROM tasks WHERE node_id = {liar['id']} AND checks_hash IS NULL "
            "AND state = 'completed'",
            "the liar's first generation",
        )
        # Said only of a live job: it waits for the nodes that are gone, and says so.
        wait_until(lambda: job.info()["waiting_for"], "the job to say what it waits for")
        _start_honest(grid, HONEST)
        grid.wait_for_nodes(4, timeout=180)
        info = _watch_to_end(job)
        if info["state"] == "failed":  # allowed: when the pool cannot decide, it says why
            assert re.search(r"shard \d+ failed: undecidable: .*no other node", info["error"]), info
        else:
            assert info["state"] == "completed", info
            assert _same_generation(job.result(), honest), (job.result(), honest)
    _assert_liar_judged(query, liar["id"], job.id, info)


def _assert_liar_judged(query: Query, liar: int, job_id: int, info: dict[str, Any]) -> None:
    """Every generation of the liar invalid and unpaid, none of them a shard's result;
    its node's credit no more than its valid checks of this job earned."""
    tasks = query(
        f"SELECT id, checks_hash, state, outcome, credit FROM tasks WHERE node_id = {liar} "
        f"AND job_id = {job_id} AND state = 'completed'"
    )
    lies = [t for t in tasks if t["checks_hash"] is None]
    assert lies, tasks
    assert all(t["outcome"] == "invalid" for t in lies), lies
    assert all(not t["credit"] for t in lies), lies
    canonical = query(
        "SELECT shards.idx, shards.state, tasks.node_id, tasks.checks_hash, tasks.outcome "
        "FROM shards LEFT JOIN tasks ON tasks.id = shards.canonical_task_id "
        f"WHERE shards.job_id = {job_id}"
    )
    assert all(row["node_id"] != liar for row in canonical), canonical
    if info["state"] == "completed":
        assert [(r["state"], r["checks_hash"], r["outcome"]) for r in canonical] == [
            ("done", None, "valid")
        ] * info["shards_total"], canonical
    earned = sum(t["credit"] or 0.0 for t in tasks if t["checks_hash"] and t["outcome"] == "valid")
    [node] = query(f"SELECT credit_total FROM nodes WHERE id = {liar}")
    assert node["credit_total"] <= earned + 1e-9, (node, tasks)


# -- a job whose assembly fails -----------------------------------------------------------


def test_a_job_made_to_fail_assembly_fails_while_a_job_beside_it_completes(
    embedded_grid: Callable[..., LocalGrid],
) -> None:
    """Job 1 (the first of a fresh coordinator) cannot be assembled: it fails, saying so,
    and job 2, submitted beside it on the same node, completes with its result. The fault
    point is the verifier's, whatever the kind: the cheap `sleep` kind keeps this short."""
    grid = embedded_grid(extra_env={"IDLEGRID_FAULTS": "assemble-job-1"})
    grid.start_worker("w0", kinds="sleep", slots=2, benchmark=False)
    grid.wait_for_nodes(1, timeout=120)
    with grid.client() as client:
        broken = client.submit("sleep", params={"tasks": SLEEP_SHARDS})
        beside = client.submit("sleep", params={"tasks": SLEEP_SHARDS})
        assert (broken.id, beside.id) == (1, 2)
        broken_info = _watch_to_end(broken)
        beside_info = _watch_to_end(beside)
        assert broken_info["state"] == "failed", broken_info
        assert broken_info["shards_done"] == SLEEP_SHARDS, broken_info  # only its assembly broke
        assert "its result could not be assembled" in broken_info["error"], broken_info
        assert broken_info["result"] is None, broken_info
        assert beside_info["state"] == "completed", beside_info
        assert beside.result() == [json.loads(_digest(i)) for i in range(SLEEP_SHARDS)]
