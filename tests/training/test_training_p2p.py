"""Peer-to-peer training rounds through a real grid: `idlegrid serve` with its bootstrap
DHT peer, four `idlegrid worker` processes of one trusted account averaging through
Hivemind, and one stranger's worker that is never let into their groups.

Without the p2p extra (hivemind) these skip with the reason; under CI=true they fail.
"""

from __future__ import annotations

import os
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers import require_p2p, wait_until

from idlegrid.client import IdlegridError
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob
from idlegrid.p2p import launch

pytestmark = pytest.mark.slow

MEMBERS = ("m1", "m2", "m3", "m4")
TINY_LM: dict[str, Any] = {
    "model": {"width": 32, "layers": 1, "heads": 2, "context": 32},
    "inner": {"steps": 20, "batch_size": 8, "seq_len": 32, "lr": 0.003},
    "workers": 4,
    "rounds": 4,
    "eval_batches": 4,
    "seed": 7,
}
P2P: dict[str, Any] = {
    **TINY_LM,
    "averaging": "p2p",
    "pool": {"accounts": ["lab"]},
    # Patient groups: each round's members start Hivemind's daemon, which takes minutes
    # on a loaded 2-core machine; a member later than this falls back (the rule).
    "group_timeout_s": 120.0,
    "round_timeout_s": 400.0,
}


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGrid]:
    require_p2p("peer-to-peer training needs the p2p extra")
    root: Path = tmp_path_factory.mktemp("p2p")
    with LocalGrid(root, heartbeat_s=0.5, node_timeout_s=5.0, min_lease_s=300.0,
                   p2p=True) as local:  # fmt: skip
        for name in MEMBERS:
            local.start_worker(name, kinds="diloco-train", threads=1, benchmark=False,
                               account="lab")  # fmt: skip
        local.start_worker("stranger", kinds="diloco-train", threads=1, benchmark=False,
                           account="stranger")  # fmt: skip
        local.wait_for_nodes(5)
        yield local


def _nodes_of_job(grid: LocalGrid, job_id: int) -> set[str]:
    with sqlite3.connect(grid.data_dir / "idlegrid.db") as db:
        rows = db.execute(
            "SELECT DISTINCT n.name FROM tasks t JOIN nodes n ON n.id = t.node_id"
            " JOIN shards s ON s.id = t.shard_id WHERE s.job_id = ?",
            (job_id,),
        ).fetchall()
    return {name for (name,) in rows}


def _refused(client: Any, params: dict[str, Any]) -> str:
    with pytest.raises(IdlegridError) as refused:
        client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()}, params=params)
    assert refused.value.status == 422, refused.value
    return refused.value.message


def test_bad_p2p_jobs_are_refused_with_the_reason(grid: LocalGrid) -> None:
    with grid.client() as client:
        assert "needs a pool" in _refused(client, {**P2P, "pool": None})
        assert "no account named 'nobody'" in _refused(
            client, {**P2P, "pool": {"accounts": ["nobody"]}}
        )
        # The stranger's account has one node; the job needs four at once.
        many = _refused(client, {**P2P, "pool": {"accounts": ["stranger"]}})
        assert "needs 4 nodes at once" in many and "1 registered node" in many
        assert "coordinator" in _refused(client, {**P2P, "aggregation": {"rule": "trimmed-mean"}})
        assert "round_timeout_s" in _refused(client, {**P2P, "round_timeout_s": 30.0})


def test_p2p_rounds_match_coordinator_mode_and_stay_in_the_pool(grid: LocalGrid) -> None:
    with grid.client() as client:
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()}, params=P2P)
        job.wait(timeout=600)
        p2p_metrics = job.metrics()
        reference = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                                  params=TINY_LM)  # fmt: skip
        reference.wait(timeout=600)
        coordinator_metrics = reference.metrics()
    rounds, expected = p2p_metrics["rounds"], coordinator_metrics["rounds"]
    assert p2p_metrics["state"] == "completed", rounds
    assert p2p_metrics["rounds_done"] == P2P["rounds"], rounds
    training = rounds[:-1]
    # Every round averaged peer to peer, all four agreeing; or, if its group never formed
    # in time (round 0's members start their standing averagers: slow on a loaded
    # machine), fell back to coordinator mode with the reason. Two rounds in a row must be
    # peer to peer.
    how = [(r["averaging"], r["agreeing"], r["fallback_reason"]) for r in training]
    peer = [r["averaging"] == "p2p" and r["agreeing"] == 4 for r in training]
    fell_back = [r["averaging"] == "coordinator" and r["fallback_reason"] for r in training]
    assert all(p or f for p, f in zip(peer, fell_back, strict=True)), how
    assert any(peer[i - 1] and peer[i] for i in range(1, len(peer))), how
    # The same seeds give the same losses, round by round, within 0.1%: both modes send
    # int8 codes, but the group's codes share each chunk's scale (the largest member's)
    # where coordinator mode's uploads each have their own, so their rounding differs
    # (round 0's train loss, before any averaging, is the same to the bit). Compared
    # while every round so far had all four members' updates in both jobs: a round that
    # a slow member missed is decided without it, by the rule, and the weights part.
    summary = [(r["round"], r["averaging"], r["updates"], r["train_loss"]) for r in rounds]
    for mine, theirs in zip(rounds, expected, strict=True):
        if not (mine["updates"] == theirs["updates"] == 4 or mine["final"]):
            break
        for loss in ("train_loss", "eval_loss"):
            if theirs[loss] is not None:
                assert mine[loss] == pytest.approx(theirs[loss], rel=1e-3, abs=1e-6), (
                    loss, summary, [(r["updates"], r["train_loss"]) for r in expected]
                )  # fmt: skip

    # Every member measured its all-reduce's bytes: at int8, about 2 (K-1)/K x (1 + 10/8)
    # bytes a parameter sent and received (codes up, exact 10-bit sums back), each way.
    for row in training:
        if row["averaging"] == "p2p":
            assert len(row["wire_bytes"]) == 4 and all(b > 0 for b in row["wire_bytes"].values())

    # Through the coordinator pass the members' small reports and one published update a
    # round. Coordinator mode moves K updates up and, after round 0, K down (each member
    # fetches the update published): about 2K times the bytes of a p2p round once the
    # members hold the weights; in round 0 (nothing comes down) one update against K, so
    # nearly K times. A round after one that fell back is neither: its members fetch the
    # update the coordinator published, as in coordinator mode.
    k = len(MEMBERS)
    for i, (mine, theirs) in enumerate(zip(training, expected, strict=False)):
        if peer[i] and (i == 0 or peer[i - 1]):
            factor = k if i > 0 else k - 1
            assert _through(mine) * factor <= _through(theirs), (i, mine, theirs)
    # Two rounds in a row averaged peer to peer, so the claim of K times fewer bytes held
    # on at least one round; on the whole job if none fell back.
    if all(peer):
        assert sum(map(_through, rounds)) * k <= sum(map(_through, expected)), (rounds, expected)
    assert _nodes_of_job(grid, job.id) <= set(MEMBERS)
    assert "stranger" not in _nodes_of_job(grid, job.id)


def _through(row: dict[str, Any]) -> int:
    """The bytes of a round through the coordinator, up and down."""
    return int(row["bytes_up"] + row["bytes_down"])


def _averaging(worker: psutil.Process, key: str) -> bool:
    """Whether the worker's standing averager has taken the round whose group key ends
    with `key`: it says so in its log (its stderr) when the member hands it its vector,
    after training."""
    try:
        for child in worker.children(recursive=True):
            if child.name() != launch.NAME:
                continue
            for handle in child.open_files():
                if Path(handle.path).name.startswith("averager-"):
                    return f"{key} as member" in Path(handle.path).read_text(errors="replace")
    except psutil.Error:
        pass
    return False


def _averagers(worker: psutil.Process) -> set[int]:
    """The worker's standing averagers (each names its process `launch.NAME`)."""
    try:
        return {c.pid for c in worker.children(recursive=True) if c.name() == launch.NAME}
    except psutil.Error:
        return set()


def test_standing_averagers_last_across_rounds_and_jobs(grid: LocalGrid) -> None:
    """Each member's averager process is the same through a job's rounds and the next
    job's: a round pays for the all-reduce, not for starting Hivemind. Then m2's (a fork
    of its task process, which has trained since) is killed between jobs: the next job's
    first round starts another, averages peer to peer with it, and says why."""
    alive = grid.workers[: len(MEMBERS)]
    params = {**P2P, "rounds": 2}
    before: dict[int, set[int]] = {}
    with grid.client() as client:
        for attempt in range(2):
            job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                                params=params)  # fmt: skip
            job.wait(timeout=600)
            rounds = job.metrics()["rounds"]
            assert all(r["averaging"] == "p2p" for r in rounds[:-1]), rounds
            now = {w.pid: _averagers(psutil.Process(w.pid)) for w in alive}
            if attempt:
                assert now == before and all(len(pids) == 1 for pids in now.values()), now
            before = now
        victim = alive[MEMBERS.index("m2")].pid
        psutil.Process(next(iter(before[victim]))).kill()
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                            params={**params, "rounds": 1})  # fmt: skip
        job.wait(timeout=600)
        rounds = job.metrics()["rounds"]
    assert rounds[0]["averaging"] == "p2p" and rounds[0]["agreeing"] == 4, rounds
    assert "the standing averager had exited" in (rounds[0].get("fallback_reason") or ""), rounds
    again = _averagers(psutil.Process(victim))
    assert len(again) == 1 and again != before[victim], (before[victim], again)


def test_a_member_killed_mid_round_leaves_the_round_to_the_others(grid: LocalGrid) -> None:
    """m4 is killed (its worker and its averager) once it has handed its averager the
    round's vector: the other three average among themselves on the retry, and the
    round closes peer to peer with them, m4 named."""
    params = {**P2P, "rounds": 2, "min_updates": 3, "group_timeout_s": 30.0}
    victim = grid.workers[MEMBERS.index("m4")]
    with grid.client() as client:
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                            params=params)  # fmt: skip
        key = f"-job{job.id}-round0"
        wait_until(lambda: _averaging(psutil.Process(victim.pid), key), "m4 to average",
                   timeout_s=300, poll_s=0.05)  # fmt: skip
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        job.wait(timeout=600)
        metrics = job.metrics()
    rounds = metrics["rounds"]
    assert metrics["state"] == "completed" and metrics["rounds_done"] == 2, rounds
    first = rounds[0]
    assert first["averaging"] == "p2p" and first["agreeing"] == 3, first
    # m4's shard (whichever it held) is the one the others named.
    assert len(first["blamed"]) == 1, first
    assert "retry" in (first["fallback_reason"] or ""), first
    # The next round's fourth shard finds no node of the pool (m4 is gone): the three
    # average on the retry again.
    assert rounds[1]["averaging"] == "p2p" and rounds[1]["agreeing"] == 3, rounds[1]
    assert rounds[-1]["eval_loss"] is not None
