"""The round driver drives any kind that gives `RoundHooks`, not DiLoCo alone.

A toy kind defined here runs in rounds through the in-process grid: each training shard
of round t returns shard + 1, a round's close adds its updates to a running total (its
"weights"), and the evaluation of round t reports 1 / (1 + total). Nothing of DiLoCo is
involved: the driver asks the kind for everything a round is.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers import FakeNode, fake_node

from idlegrid import protocol
from idlegrid.blobs.files import BlobStore
from idlegrid.broker.memory import MemoryBroker
from idlegrid.coordinator.grid import Grid
from idlegrid.kinds import KINDS, get_kind
from idlegrid.kinds.base import (
    Evaluation,
    KindParams,
    Published,
    RoundClose,
    RoundHooks,
    RoundJob,
    RoundPlan,
    RoundWeights,
    RunContext,
    ShardSpec,
    Swarm,
    TaskKind,
    Verdict,
)
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.sql import SqlStore

T0 = 1_000_000.0
NAME = "count-rounds"


class CountParams(KindParams):
    rounds: int = 3
    workers: int = 2


def _json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True).encode()


def _weights(round_number: int, total: int) -> RoundWeights:
    return RoundWeights(round=round_number, digest=f"total-{total}",
                        checkpoint=_json({"round": round_number, "total": total}),
                        optimizer=_json({"round": round_number}))  # fmt: skip


def _shard(index: int, mode: str, weights: RoundWeights, shard: int) -> ShardSpec:
    payload = _json({"mode": mode, "round": weights.round, "shard": shard,
                     "total": json.loads(weights.checkpoint)["total"]})  # fmt: skip
    return ShardSpec(index=index, payload=payload, items=1, cost_flops=1.0)


class CountJob(RoundJob):
    def __init__(self, params: CountParams) -> None:
        self.plan = RoundPlan(
            rounds=params.rounds, workers=params.workers, min_updates=params.workers,
            round_timeout_s=100.0, eval_every=1,
        )  # fmt: skip
        self.published: list[Sequence[Published]] = []

    def initial(self) -> RoundWeights:
        return _weights(0, 0)

    def first_shards(self, start: RoundWeights, *, keyframe: str) -> list[ShardSpec]:
        return [_shard(self.plan.workers, "eval", start, self.plan.workers)]

    def close(self, checkpoint: bytes, optimizer: bytes, outputs: Sequence[bytes]) -> RoundClose:
        state = json.loads(checkpoint)
        updates = [json.loads(output)["update"] for output in outputs]
        total = state["total"] + sum(updates)
        return RoundClose(weights=_weights(state["round"] + 1, total), update=_json(updates),
                          train_loss=1.0, max_suspicion=0.0, stale_applied=0,
                          fetched_bytes=0)  # fmt: skip

    def shards(
        self, weights: RoundWeights, *, published: Sequence[Published], keyframe: str, final: bool
    ) -> list[ShardSpec]:
        self.published.append(published)
        first = weights.round * self.plan.stride
        training = [] if final else [
            _shard(first + s, "train", weights, s) for s in range(self.plan.workers)
        ]  # fmt: skip
        return [*training, _shard(first + self.plan.workers, "eval", weights, self.plan.workers)]

    def evaluation(self, output: bytes) -> Evaluation:
        return Evaluation(loss=json.loads(output)["loss"], fetched_bytes=0)


class CountRounds(RoundHooks):
    def __init__(self) -> None:
        self.jobs: list[CountJob] = []

    def job(
        self, params: KindParams, inputs: Mapping[str, bytes], *, swarm: Swarm | None = None
    ) -> RoundJob:
        assert isinstance(params, CountParams) and inputs == {"start": b"go"}
        self.jobs.append(CountJob(params))
        return self.jobs[-1]


class CountKind(TaskKind):
    name = NAME
    params_model = CountParams
    input_names = ("start",)
    default_replication = 1
    buffered = False
    backups = False
    rounds = HOOKS = CountRounds()

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, CountParams)
        return [_shard(s, "train", _weights(0, 0), s) for s in range(params.workers)]

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        task = json.loads(payload)
        if task["mode"] == "eval":
            return _json({"loss": 1.0 / (1 + task["total"])})
        return _json({"update": task["shard"] + 1})

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        return Verdict.AGREE if a == b else Verdict.DISAGREE

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        raise AssertionError("a round kind's result is its last checkpoint, not assembled")


@pytest.fixture
async def grid(  # type: ignore[misc]
    store: SqlStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Grid]:
    monkeypatch.setitem(KINDS, NAME, CountKind())
    CountKind.HOOKS.jobs.clear()
    grid = Grid(
        settings=CoordinatorSettings(data_dir=tmp_path / "coordinator"),
        store=store,
        broker=MemoryBroker(),
        blobs=BlobStore(tmp_path / "blobs", max_bytes=1 << 30),
        clock=lambda: T0,
    )
    yield grid
    await grid.aclose()


async def _work(grid: Grid, node: FakeNode) -> bool:
    """Take one task as a node's `ready` does, run the kind, send the result."""
    before = len(node.assigned())
    node.session.requested = 1
    await grid.fill(node.session)
    if len(node.assigned()) == before:
        return False
    assign = node.assigned()[-1]
    kind = get_kind(NAME)
    params = kind.parse_params(assign["params"])
    output = kind.run(grid.blobs.read(assign["input"]["hash"]), params, RunContext())
    message = protocol.Result(task_id=assign["task_id"], output=grid.blobs.put(output),
                              output_size=len(output), elapsed_s=0.1)  # fmt: skip
    await grid.accept_result(node.session, message)
    return True


async def test_the_round_driver_runs_a_kind_it_knows_only_by_its_hooks(
    grid: Grid, store: SqlStore
) -> None:
    kind = get_kind(NAME)
    assert grid.rounds.drives(kind) and not grid.rounds.drives(get_kind("vectors"))
    account = await store.accounts.create_account("alice", is_admin=False, now=T0)
    job = await grid.submit_job(
        account_id=account.id, kind_name=NAME, inputs={"start": grid.blobs.put(b"go")},
        params={"rounds": 3, "workers": 2}, replication=None, priority=0,
    )  # fmt: skip
    nodes = [
        await fake_node(store, account.id, key, now=T0, kinds=[NAME], address="10.0.0.1")
        for key in ("a", "b")
    ]
    for node in nodes:
        grid.hub.add(node.session)
    for _ in range(40):
        if not any([await _work(grid, node) for node in nodes]):
            break
    done = await store.jobs.get_job(job.id)
    assert done is not None and done.state == "completed", done
    # Three rounds of updates 1 + 2: the result is the last round's checkpoint.
    assert json.loads(grid.blobs.read(done.result_hash or "")) == {"round": 3, "total": 9}
    found = await grid.rounds.metrics(done)
    rows = found["rounds"]
    assert [r["round"] for r in rows] == [0, 1, 2, 3] and rows[-1]["final"]
    assert [r["updates"] for r in rows[:3]] == [2, 2, 2]
    assert [r["eval_loss"] for r in rows] == [1.0, 1 / 4, 1 / 7, 1 / 10]
    assert [r["weights_digest"] for r in rows] == ["total-0", "total-3", "total-6", "total-9"]
    # Every close handed the kind the updates published so far, oldest first.
    # (The driver sets a job up once per process while it runs: metrics set it up again.)
    count_job = CountKind.HOOKS.jobs[0]
    assert [[p.round for p in published] for published in count_job.published] == [
        [0], [0, 1], [0, 1, 2]
    ]  # fmt: skip
