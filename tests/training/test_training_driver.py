"""The round driver through the grid in one process: real store, dispatch, kind and blobs.

Nodes here are `NodeSession`s whose sent messages are captured; each runs the
`diloco-train` kind's `run` on what it was assigned with its own worker cache, the way
a worker daemon does, and hands the result to `Grid.accept_result`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Api, assert_error, bearer
from helpers import FakeNode, fake_node
from pydantic import ValidationError

from idlegrid import protocol
from idlegrid.coordinator.grid import Grid
from idlegrid.kinds import RunContext, get_kind
from idlegrid.kinds.diloco import kind as diloco
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.data import ExampleData
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob, dataset_blob, stream_id
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import JobRecord, ResultReceipt
from idlegrid.store.sql import SqlStore
from idlegrid.training import models
from idlegrid.training.flat import digest, read_metadata, weights_from_safetensors
from idlegrid.training.schedule import Close, close_decision, finish_decision

KIND = get_kind("diloco-train")
T0 = 1_000_000.0
MLP: dict[str, Any] = {
    "architecture": "mlp",
    "model": {"inputs": 8, "hidden": [16], "classes": 3},
    "inner": {"steps": 10, "batch_size": 16, "lr": 0.01},
    "workers": 2,
    "rounds": 3,
    "eval_batches": 4,
    "round_timeout_s": 100.0,
}


@pytest.mark.parametrize(
    ("updates", "late", "min_updates", "expired", "decision"),
    [
        (0, 0, 2, False, Close.WAIT),
        (1, 0, 2, False, Close.WAIT),
        (2, 0, 2, False, Close.QUORUM),
        (3, 0, 2, True, Close.QUORUM),
        (1, 0, 2, True, Close.TIMER),
        (0, 0, 2, True, Close.EXTEND),
        # Late updates (asynchronous) never make a quorum, but the timer closes on them.
        (0, 2, 2, False, Close.WAIT),
        (1, 3, 2, False, Close.WAIT),
        (1, 1, 2, False, Close.WAIT),
        (2, 1, 2, False, Close.QUORUM),
        (0, 1, 2, True, Close.TIMER),
    ],
)
def test_close_decision(
    updates: int, late: int, min_updates: int, expired: bool, decision: Close
) -> None:
    found = close_decision(
        updates=updates, late=late, min_updates=min_updates, timer_expired=expired
    )
    assert found == decision


@pytest.mark.parametrize(
    ("evaluated", "expired", "finish"),
    [(False, False, False), (True, False, True), (False, True, True), (True, True, True)],
)
def test_finish_decision(evaluated: bool, expired: bool, finish: bool) -> None:
    assert finish_decision(evaluated=evaluated, timer_expired=expired) is finish


def _dataset() -> bytes:
    """A learnable 3-class problem: the label is the argmax of a fixed linear map."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((800, 8)).astype(np.float32)
    y = np.argmax(x @ rng.standard_normal((8, 3)), axis=1).astype(np.int64)
    return dataset_blob(ExampleData(x[:640], y[:640]), ExampleData(x[640:], y[640:]))


@dataclass
class Node(FakeNode):
    """A node with its own worker cache (its optimizer state between rounds)."""

    cache: WorkerState = field(default_factory=WorkerState)


@dataclass
class Harness:
    grid: Grid
    now: list[float]
    account_id: int
    done: set[int] = field(default_factory=set)

    async def node(self, key: str) -> Node:
        node = await fake_node(
            self.grid.store, self.account_id, key, now=self.now[0], kinds=["diloco-train"],
            address="10.0.0.1", node_type=Node,
        )  # fmt: skip
        self.grid.hub.add(node.session)
        return node

    async def submit(self, **changes: Any) -> JobRecord:
        dataset = self.grid.blobs.put(_dataset())
        return await self.grid.submit_job(
            account_id=self.account_id, kind_name="diloco-train", inputs={"dataset": dataset},
            params={**MLP, **changes}, replication=None, priority=0,
        )  # fmt: skip

    async def take(self, node: Node) -> dict[str, Any] | None:
        """Ask for one task, as a node's `ready` does; its assign message, if any."""
        before = len(node.assigned())
        node.session.requested = 1
        await self.grid.fill(node.session)
        assigned = node.assigned()
        return assigned[-1] if len(assigned) > before else None

    def compute(self, node: Node, assign: dict[str, Any], monkeypatch: Any) -> bytes:
        """Run the kind on the node's cache, fetching blobs from the coordinator."""
        monkeypatch.setattr(diloco, "WORKER_STATE", node.cache)
        params = KIND.parse_params(assign["params"])
        payload = self.grid.blobs.read(assign["input"]["hash"])
        return KIND.run(payload, params, RunContext(fetch=self.grid.blobs.read))

    async def deliver(self, node: Node, assign: dict[str, Any], output: bytes) -> ResultReceipt:
        output_hash = self.grid.blobs.put(output)
        message = protocol.Result(task_id=assign["task_id"], output=output_hash,
                                  output_size=len(output), elapsed_s=0.1)  # fmt: skip
        return await self.grid.accept_result(node.session, message)

    async def work(self, node: Node, monkeypatch: Any) -> ResultReceipt | None:
        assign = await self.take(node)
        if assign is None:
            return None
        return await self.deliver(node, assign, self.compute(node, assign, monkeypatch))

    async def metrics(self, job_id: int) -> dict[str, Any]:
        job = await self.grid.store.jobs.get_job(job_id)
        assert job is not None
        return await self.grid.rounds.metrics(job)


@pytest.fixture
async def harness(store: SqlStore, in_process_grid: Callable[..., Grid]) -> Harness:
    now = [T0]
    grid = in_process_grid(clock=lambda: now[0], max_blob_bytes=1 << 30)
    account = await store.accounts.create_account("alice", is_admin=False, now=T0)
    return Harness(grid, now, account.id)


async def test_a_job_trains_round_after_round_and_its_eval_loss_falls(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit()
    nodes = [await harness.node("a"), await harness.node("b")]
    for _ in range(40):
        if not any([await harness.work(node, monkeypatch) for node in nodes]):
            break
    done = await harness.grid.store.jobs.get_job(job.id)
    assert done is not None and done.state == "completed", done
    found = await harness.metrics(job.id)
    rows = found["rounds"]
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[-1]["final"]
    assert found["rounds_done"] == 3 and all(r["state"] == "closed" for r in rows)
    assert [r["updates"] for r in rows[:3]] == [2, 2, 2]
    assert all(r["closed_by"] == "quorum" and r["nodes"] == 2 for r in rows[:3])
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 for r in rows)
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.1
    # Round 0's payloads carry no weights (nodes draw them from the seed); their keyframe
    # fallback is the checkpoint the driver stored.
    first = (await harness.grid.store.jobs.list_shards(job.id))[0]
    payload = tasks.decode_task(harness.grid.blobs.read(first.input_hash))
    assert payload.weights is None and payload.keyframe_blob == rows[0]["checkpoint"]
    assert harness.grid.blobs.exists(rows[0]["checkpoint"])
    # The result is the final round's checkpoint: safetensors of the digested weights.
    result = harness.grid.blobs.read(done.result_hash or "")
    params = KIND.parse_params(MLP)
    assert isinstance(params, DilocoParams)
    spec = models.flat_spec("mlp", params.model_settings())
    assert digest(weights_from_safetensors(result, spec)) == rows[-1]["weights_digest"]
    assert '"round":3' in read_metadata(result)["idlegrid"]


async def test_a_rounds_shards_are_not_buffered_on_one_node(harness: Harness) -> None:
    # A node with one slot and a buffer of four asks for five tasks: it gets one shard of
    # the round, and the round's other shard is left for another node.
    await harness.submit()
    greedy, other = await harness.node("greedy"), await harness.node("other")
    greedy.session.prefetch = 4
    greedy.session.requested = 5
    await harness.grid.fill(greedy.session)
    assert len(greedy.assigned()) == 1
    assert await harness.take(other) is not None


async def test_a_rounds_slow_shard_gets_no_backup_copy(harness: Harness) -> None:
    # Slow holders and a fast idle node: the round's timer and quorum handle stragglers,
    # and a copy would add a second update of one node to the round.
    await harness.submit(round_timeout_s=3600.0)
    slow = [await harness.node("slow-a"), await harness.node("slow-b")]
    held = set()
    for node in slow:
        node.session.view = dataclasses.replace(node.session.view, gflops=0.001)
        assign = await harness.take(node)
        assert assign is not None
        held.add(assign["shard_index"])
    harness.now[0] += 600.0  # the slow holders are far behind
    fast = await harness.node("fast")
    fast.session.view = dataclasses.replace(fast.session.view, gflops=1000.0)
    while (assign := await harness.take(fast)) is not None:  # what is left unheld, if any
        assert assign["shard_index"] not in held, assign
        fast.session.live.discard(assign["task_id"])
    assert harness.grid.counters.backups == 0


async def test_later_rounds_send_the_update_not_the_weights_and_a_new_node_gets_a_keyframe(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(eval_every=100)
    a, b = await harness.node("a"), await harness.node("b")
    for _ in range(3):  # node a does both shards of round 0 and round 0's evaluation
        await harness.work(a, monkeypatch)
    assign = await harness.take(a)
    assert assign is not None
    payload = tasks.decode_task(harness.grid.blobs.read(assign["input"]["hash"]))
    assert payload.round == 1 and payload.weights is None and len(payload.chain) == 1
    assert payload.keyframe_blob is not None and payload.chain[0].blob is not None
    held = tasks.decode_result(harness.compute(a, assign, monkeypatch))
    update_size = harness.grid.blobs.size(payload.chain[0].blob)
    assert held.fetched_bytes == update_size  # it held round 0's weights: the update only
    joiner = await harness.take(b)
    assert joiner is not None
    fresh = tasks.decode_result(harness.compute(b, joiner, monkeypatch))
    keyframe = harness.grid.blobs.size(payload.keyframe_blob)
    assert fresh.fetched_bytes == keyframe > 2 * update_size  # full weights, once
    assert fresh.weights_digest == held.weights_digest
    rounds = await harness.grid.store.rounds.training_rounds(job.id)
    assert rounds[-1].round == 1


async def test_a_round_closes_on_quorum_and_a_late_update_is_dropped(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(workers=3, min_updates=2, eval_every=100)
    a, b, c = [await harness.node(key) for key in "abc"]
    slow = await harness.take(c)
    assert slow is not None
    if slow["shard_index"] == 3:  # the round's evaluation came first (the cheaper task)
        await harness.deliver(c, slow, harness.compute(c, slow, monkeypatch))
        slow = await harness.take(c)
        assert slow is not None and slow["shard_index"] < 3
    assert (await harness.work(a, monkeypatch) or ResultReceipt("rejected")).status == "accepted"
    assert (await harness.work(b, monkeypatch) or ResultReceipt("rejected")).status == "accepted"
    found = await harness.metrics(job.id)
    assert found["rounds"][0]["state"] == "closed" and found["rounds"][0]["updates"] == 2
    assert found["rounds"][0]["closed_by"] == "quorum"
    assert found["rounds"][1]["state"] == "open"
    assert slow["task_id"] in c.cancelled()  # told to stop
    late = await harness.deliver(c, slow, harness.compute(c, slow, monkeypatch))
    assert late.status == "late"  # stored, never aggregated: its shard closed with the round
    shards = {s.index: s for s in await harness.grid.store.jobs.list_shards(job.id)}
    assert shards[slow["shard_index"]].state == "cancelled"
    again = await harness.metrics(job.id)
    assert again["rounds"][0]["updates"] == 2 and len(again["rounds"]) == 2
    assert again["rounds"][1]["weights_digest"] == found["rounds"][1]["weights_digest"]


async def test_the_timer_closes_a_round_with_what_arrived_and_waits_when_nothing_did(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(eval_every=100)
    a, vanished = await harness.node("a"), await harness.node("b")
    assert await harness.take(vanished) is not None  # and never answers
    harness.now[0] += 50
    assert await harness.grid.rounds.close_due() == 0  # not due yet
    await harness.work(a, monkeypatch)
    harness.now[0] += 51
    assert await harness.grid.rounds.close_due() == 1
    first = (await harness.metrics(job.id))["rounds"][0]
    assert first["state"] == "closed" and first["closed_by"] == "timer" and first["updates"] == 1
    assert first["nodes"] == 1
    # Round 1: nothing arrives before its timer; it stays open with a later deadline.
    harness.now[0] += 101
    assert await harness.grid.rounds.close_due() == 1
    records = await harness.grid.store.rounds.training_rounds(job.id)
    assert records[-1].round == 1 and records[-1].state == "open"
    assert records[-1].deadline == harness.now[0] + 100
    assert await harness.grid.rounds.close_due() == 0  # idempotent


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"max_staleness": 3}, "max_staleness 3 must be less than rounds 3"),
        ({"max_staleness": 0}, "needs max_staleness >= 1"),
    ],
)
async def test_asynchronous_settings_that_cannot_work_are_refused(
    harness: Harness, changes: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValidationError, match=reason):
        await harness.submit(asynchronous=True, **changes)
    assert await harness.grid.store.jobs.list_jobs(harness.account_id, limit=10, offset=0) == []


async def _slow_start(harness: Harness, node: Node, monkeypatch: Any) -> dict[str, Any]:
    """A training task of round 0 taken by `node` (its evaluation done if it came first)."""
    slow = await harness.take(node)
    assert slow is not None
    if slow["shard_index"] == 3:  # the round's evaluation came first (the cheaper task)
        await harness.deliver(node, slow, harness.compute(node, slow, monkeypatch))
        slow = await harness.take(node)
        assert slow is not None and slow["shard_index"] < 3
    return slow


async def test_asynchronous_a_late_update_counts_in_the_next_round(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(workers=3, min_updates=2, asynchronous=True, max_staleness=1,
                               eval_every=100)  # fmt: skip
    a, b, c = [await harness.node(key) for key in "abc"]
    slow = await _slow_start(harness, c, monkeypatch)
    await harness.work(a, monkeypatch)
    await harness.work(b, monkeypatch)
    found = await harness.metrics(job.id)
    assert found["rounds"][0]["closed_by"] == "quorum" and found["rounds"][1]["state"] == "open"
    assert slow["task_id"] not in c.cancelled()  # it goes on
    late = await harness.deliver(c, slow, harness.compute(c, slow, monkeypatch))
    assert late.status == "accepted"
    # Round 1 has the late update, but its quorum of two counts its own updates only.
    assert (await harness.metrics(job.id))["rounds"][1]["state"] == "open"
    await harness.work(a, monkeypatch)
    assert (await harness.metrics(job.id))["rounds"][1]["state"] == "open"
    await harness.work(b, monkeypatch)
    found = await harness.metrics(job.id)
    first, second = found["rounds"][0], found["rounds"][1]
    assert second["state"] == "closed" and second["updates"] == 3
    assert second["stale_applied"] == 1 and found["stale_applied"] == 1
    assert found["asynchronous"] and found["stale_dropped"] == 0
    assert first["updates"] == 2


async def test_asynchronous_an_update_past_max_staleness_is_dropped_and_counted(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(workers=3, min_updates=2, asynchronous=True, max_staleness=1,
                               eval_every=100)  # fmt: skip
    a, b, c = [await harness.node(key) for key in "abc"]
    slow = await _slow_start(harness, c, monkeypatch)
    for _ in range(4):  # rounds 0 and 1 close on a and b alone
        await harness.work(a, monkeypatch)
        await harness.work(b, monkeypatch)
    found = await harness.metrics(job.id)
    assert [r["state"] for r in found["rounds"][:2]] == ["closed", "closed"]
    # Round 1's close opened round 2: round 0's task could only arrive 2 rounds late.
    assert slow["task_id"] in c.cancelled()
    assert found["rounds"][1]["stale_dropped"] == 1 and found["stale_dropped"] == 1
    late = await harness.deliver(c, slow, harness.compute(c, slow, monkeypatch))
    assert late.status == "late"  # stored, never aggregated


async def test_metrics_are_only_for_training_jobs(harness: Harness) -> None:
    job = await harness.submit()
    found = await harness.metrics(job.id)
    assert found["rounds_total"] == 3 and found["rounds_done"] == 0
    assert found["rounds"][0]["state"] == "open"
    assert found["rounds"][0]["updates"] == 0 and found["rounds"][0]["updates_needed"] == 2


@pytest.fixture
def settings(tmp_path: Path) -> CoordinatorSettings:
    """The API's settings, with room for a small model's payloads and checkpoints."""
    return CoordinatorSettings(data_dir=tmp_path / "coordinator", monitor_interval_s=3600.0)


def test_the_metrics_endpoint(api: Api) -> None:
    alice, bob = api.token(account="alice"), api.token(account="bob")
    dataset = api.upload(corpus_dataset_blob(), alice)
    tiny_lm = {"model": {"width": 16, "layers": 1, "heads": 2, "context": 32}, "rounds": 3,
               "workers": 2, "inner": {"steps": 4, "batch_size": 4, "seq_len": 32}}  # fmt: skip
    job = api.submit(alice, kind="diloco-train", inputs={"dataset": dataset}, params=tiny_lm)
    response = api.client.get(f"/v1/jobs/{job['id']}/metrics", headers=bearer(alice))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["rounds_total"] == 3 and body["workers"] == 2 and body["state"] == "queued"
    assert [r["round"] for r in body["rounds"]] == [0]
    other = api.client.get(f"/v1/jobs/{job['id']}/metrics", headers=bearer(bob))
    assert_error(other, 404, "not_found")
    sleep = api.submit(alice, kind="sleep", params={"tasks": 1})
    not_training = api.client.get(f"/v1/jobs/{sleep['id']}/metrics", headers=bearer(alice))
    assert_error(not_training, 409, "not_training")


async def _train_task(harness: Harness, node: Node, monkeypatch: Any) -> dict[str, Any]:
    """The node's next training task (an evaluation assigned first is done on the way)."""
    while True:
        assign = await harness.take(node)
        assert assign is not None
        if tasks.decode_task(harness.grid.blobs.read(assign["input"]["hash"])).mode == "train":
            return assign
        await harness.deliver(node, assign, harness.compute(node, assign, monkeypatch))


async def test_a_node_keeps_its_shards_moments_and_gets_that_shard_again(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(inner={**MLP["inner"], "keep_state": True})
    a, b = await harness.node("a"), await harness.node("b")
    first = {}
    for node in (a, b):
        assign = await _train_task(harness, node, monkeypatch)
        first[node.session.node_id] = assign["shard_index"]
        await harness.deliver(node, assign, harness.compute(node, assign, monkeypatch))
    stream = stream_id(
        KIND.parse_params({**MLP, "inner": {**MLP["inner"], "keep_state": True}}), _dataset()
    )  # type: ignore[arg-type]
    assert b.cache.optimizer_shards(stream) == [first[b.session.node_id]]
    # Round 1 (stride 3): each node is offered the shard it trained, whoever asks first.
    for node in (b, a):
        assign = await _train_task(harness, node, monkeypatch)
        assert assign["shard_index"] == 3 + first[node.session.node_id]
    rounds = await harness.grid.store.rounds.training_rounds(job.id)
    assert rounds[-1].round == 1


async def test_a_shard_whose_node_is_gone_goes_to_another_that_starts_fresh(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(inner={**MLP["inner"], "keep_state": True}, eval_every=100)
    a, b = await harness.node("a"), await harness.node("b")
    for node in (a, b):
        assign = await _train_task(harness, node, monkeypatch)
        await harness.deliver(node, assign, harness.compute(node, assign, monkeypatch))
    # Node b is gone; node a does both shards of round 1 (one without moments) and more.
    for _ in range(12):
        if await harness.work(a, monkeypatch) is None:
            break
    done = await harness.grid.store.jobs.get_job(job.id)
    assert done is not None and done.state == "completed"


async def test_round_0s_evaluation_draws_the_weights_from_the_seed(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit()
    fresh = await harness.node("fresh")
    evaluation = next(s for s in await harness.grid.store.jobs.list_shards(job.id) if s.index == 2)
    payload = tasks.decode_task(harness.grid.blobs.read(evaluation.input_hash))
    assert payload.mode == "eval" and payload.init_seed == MLP.get("seed", 0)
    while True:  # a node with no weights yet takes round 0's evaluation
        assign = await harness.take(fresh)
        assert assign is not None
        output = harness.compute(fresh, assign, monkeypatch)
        if assign["shard_index"] == 2:
            break
        await harness.deliver(fresh, assign, output)
    assert tasks.decode_result(output).fetched_bytes == 0  # no keyframe fetched


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"asynchronous": True}, "streaming fragments need synchronous rounds"),
        ({"streaming": {"fragments": 3}}, "streaming: 3 fragments for a model of 2 layers"),
        ({"streaming": {"fragments": 2, "mix": 1.0}}, "mix"),
        ({"streaming": {"fragments": 2, "overlap": 1}}, "overlap"),
    ],
)
async def test_streaming_settings_that_cannot_work_are_refused(
    harness: Harness, changes: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValidationError, match=reason):
        await harness.submit(**{"streaming": {"fragments": 2}, **changes})
    assert await harness.grid.store.jobs.list_jobs(harness.account_id, limit=10, offset=0) == []


async def test_a_streaming_job_syncs_one_fragment_a_round_through_the_grid(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = await harness.submit(rounds=4)
    streamed = await harness.submit(rounds=4, streaming={"fragments": 2, "mix": 0.5})
    nodes = [await harness.node("a"), await harness.node("b")]
    for _ in range(80):
        if not any([await harness.work(node, monkeypatch) for node in nodes]):
            break
    found = {}
    for job in (whole, streamed):
        done = await harness.grid.store.jobs.get_job(job.id)
        assert done is not None and done.state == "completed", done
        found[job.id] = (await harness.metrics(job.id))["rounds"]
    rows = found[streamed.id]
    assert [r["updates"] for r in rows[:4]] == [2, 2, 2, 2]
    assert rows[-1]["eval_loss"] < rows[0]["eval_loss"] - 0.1
    # Each round's weights differ from the last in that round's fragment alone.
    params = KIND.parse_params({**MLP, "streaming": {"fragments": 2, "mix": 0.5}})
    assert isinstance(params, DilocoParams)
    spec = models.flat_spec("mlp", params.model_settings())
    spans = params.fragments()
    assert spans is not None
    weights = [weights_from_safetensors(harness.grid.blobs.read(r["checkpoint"]), spec)
               for r in rows]  # fmt: skip
    for r in range(4):
        moved = np.flatnonzero(weights[r + 1] != weights[r])
        synced = spans.synced(r)
        assert moved.size > 0 and synced.start <= moved.min() and moved.max() < synced.stop
    # Each of a round's two int8 updates (a byte a value) covers its fragment alone; the
    # rest of a result (sketch, header) is the whole model's job's.
    plain = found[whole.id]
    for r in range(4):
        saved = plain[r]["bytes_up"] - rows[r]["bytes_up"]
        assert saved == pytest.approx(2 * (spans.size - spans.synced(r).size), abs=16)


async def _train_start(harness: Harness, node: Node, monkeypatch: Any) -> dict[str, Any]:
    """A training task taken by `node`; an evaluation it is given first is done on the way."""
    while True:
        assign = await harness.take(node)
        assert assign is not None
        workers = KIND.parse_params(assign["params"]).workers
        if assign["shard_index"] % (workers + 1) < workers:  # the last of a round's: eval
            return assign
        await harness.deliver(node, assign, harness.compute(node, assign, monkeypatch))


async def test_asynchronous_a_round_does_not_close_on_stale_updates_alone(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(workers=4, min_updates=2, asynchronous=True, max_staleness=2,
                               eval_every=100)  # fmt: skip
    nodes = [await harness.node(key) for key in "abcd"]
    started = [await _train_start(harness, node, monkeypatch) for node in nodes]
    for node, assign in zip(nodes[:2], started[:2], strict=True):
        await harness.deliver(node, assign, harness.compute(node, assign, monkeypatch))
    assert (await harness.metrics(job.id))["rounds"][0]["closed_by"] == "quorum"
    # Round 0's other two updates arrive in round 1: two, as many as its quorum, but stale.
    for node, assign in zip(nodes[2:], started[2:], strict=True):
        receipt = await harness.deliver(node, assign, harness.compute(node, assign, monkeypatch))
        assert receipt.status == "accepted"
    second = (await harness.metrics(job.id))["rounds"][1]
    assert second["state"] == "open" and second["updates"] == 0
    # Two fresh updates close it, and the two stale ones count in it, weighted.
    for node in nodes[:2]:
        await harness.work(node, monkeypatch)
    found = await harness.metrics(job.id)
    second = found["rounds"][1]
    assert second["state"] == "closed" and second["closed_by"] == "quorum"
    assert second["updates"] == 4 and second["stale_applied"] == 2


async def test_asynchronous_a_closed_rounds_task_no_node_started_is_cancelled(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = await harness.submit(workers=3, min_updates=2, asynchronous=True, max_staleness=2,
                               eval_every=100)  # fmt: skip
    a, b, c = [await harness.node(key) for key in "abc"]
    for node in (a, b):
        assign = await _train_start(harness, node, monkeypatch)
        await harness.deliver(node, assign, harness.compute(node, assign, monkeypatch))
    found = await harness.metrics(job.id)
    assert found["rounds"][0]["closed_by"] == "quorum"
    # Round 0's third task was never started: trained now, it would start from round 0's
    # weights and arrive stale. It is cancelled; the next node trains round 1.
    assign = await harness.take(c)
    assert assign is not None and assign["shard_index"] >= 4
    shards = {s.index: s for s in await harness.grid.store.jobs.list_shards(job.id)}
    assert (
        [i for i in range(3) if shards[i].state == "cancelled"]
        == [i for i in range(3) if shards[i].state != "done"]
        != []
    )
    assert found["rounds"][0]["stale_dropped"] == 0
