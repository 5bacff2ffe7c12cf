"""One peer-to-peer round in one process: real training, the members' steps and the
coordinator's close, with the all-reduce's transport replaced by its parts reduced in
process (`p2p.parts`, as each reducer reduces them), handed to every member at once.

The real all-reduce, processes and sockets are tests/training/test_training_p2p.py's.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from idlegrid.kinds.base import Swarm
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.kinds.diloco.rounds import DilocoRounds
from idlegrid.kinds.diloco.run import run_task
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.p2p import averaging, parts
from idlegrid.p2p.averaging import Averaged
from idlegrid.p2p.group import Group
from idlegrid.training.compression import Compression, compress, decode

SETTINGS: dict[str, Any] = {
    "model": {"width": 16, "layers": 1, "heads": 2, "context": 16},
    "inner": {"steps": 3, "batch_size": 4, "seq_len": 16, "lr": 0.003},
    "workers": 3,
    "rounds": 2,
    "eval_batches": 2,
    "seed": 3,
    "round_timeout_s": 200.0,
}
PEERS = ("/ip4/127.0.0.1/tcp/1/p2p/12D3KooWtest",)


class AllReduce:
    """What the all-reduce gives each member: the group's mean, once all came."""

    def __init__(self, members: int) -> None:
        self.barrier = threading.Barrier(members, timeout=60)
        self.given: dict[int, tuple[np.ndarray, bool]] = {}
        self.residuals: dict[int, np.ndarray] = {}

    def join(self, group: Group, *, shard: int, reachability_setting: str) -> AllReduce:
        return self

    def average(self, values: np.ndarray, *, shard: int, holds_state: bool,
                settings: Compression | None = None) -> Averaged:  # fmt: skip
        self.given[shard] = (np.asarray(values, np.float32), holds_state)
        self.barrier.wait()
        settings = settings or Compression(method="none")
        shards = sorted(self.given)
        cut = parts.bounds(values.size, settings.chunk_size, len(shards))
        sides = {s: parts.Reduction(self.given[s][0], settings, len(shards), cut) for s in shards}
        for step in parts.exchanges(settings):
            for index, (start, end) in enumerate(cut):
                sent = {s: side.contribution(step, index) for s, side in sides.items()}
                answer = parts.reduce(step, settings, end - start, sent)
                for side in sides.values():
                    side.take(step, index, answer)
        members = {s: held for s, (_, held) in self.given.items()}
        self.residuals[shard] = sides[shard].residual()
        return Averaged(sides[shard].mean(), members, attempt=1,
                        residual=self.residuals[shard])  # fmt: skip

    def close(self) -> None:
        pass


class NoDaemon(AllReduce):
    def average(self, values: np.ndarray, *, shard: int, holds_state: bool,
                settings: Compression | None = None) -> Averaged:  # fmt: skip
        return Averaged(None, reason="the p2p daemon did not start: test")


def round_zero(mode: str) -> tuple[Any, Any, list[bytes]]:
    params = DilocoParams.model_validate(
        {
            **SETTINGS,
            "averaging": mode,
            **({"pool": {"accounts": ["lab"]}} if mode == "p2p" else {}),
        }
    )
    job = DilocoRounds().job(params, {"dataset": corpus_dataset_blob()}, swarm=Swarm(1, PEERS))
    start = job.initial()
    keyframe = hashlib.sha256(start.checkpoint).hexdigest()
    if mode == "p2p":
        specs = job.first_shards(start, keyframe=keyframe)
    else:
        from idlegrid.kinds.diloco.kind import DilocoKind

        specs = DilocoKind().split({"dataset": corpus_dataset_blob()}, params)
    payloads = [tasks.decode_task(s.payload) for s in specs]
    return job, start, [p for p in payloads if p.mode == "train"]  # type: ignore[misc]


def train(payloads: list[tasks.TaskPayload], params: DilocoParams) -> list[tasks.TaskResult]:
    states = [WorkerState() for _ in payloads]
    with ThreadPoolExecutor(len(payloads)) as pool:
        futures = [
            pool.submit(run_task, p, params.train_spec(), s)
            for p, s in zip(payloads, states, strict=True)
        ]
        return [f.result() for f in futures]


def test_members_and_coordinator_hold_the_same_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    job, start, payloads = round_zero("p2p")
    assert all(p.group is not None and p.group.size == 3 for p in payloads)
    monkeypatch.setattr(averaging, "join", AllReduce(3).join)
    results = train(payloads, job.params)
    assert {r.averaging for r in results} == {"p2p"}
    assert len({r.averaged_digest for r in results}) == 1
    assert len({r.next_digest for r in results}) == 1
    assert [r.published is not None for r in results] == [True, False, False]
    closed = job.close(start.checkpoint, start.optimizer, [tasks.encode_result(r) for r in results])
    assert closed.notes["averaging"] == "p2p" and closed.notes["agreeing"] == 3
    assert closed.weights.digest == results[0].next_digest
    # Coordinator mode, same seeds: the same round, up to the order of float additions.
    reference, ref_start, ref_payloads = round_zero("coordinator")
    ref_results = train(ref_payloads, reference.params)
    ref_closed = reference.close(
        ref_start.checkpoint, ref_start.optimizer, [tasks.encode_result(r) for r in ref_results]
    )
    assert closed.train_loss == pytest.approx(ref_closed.train_loss, rel=1e-6)
    assert [r.update_norm for r in results] == pytest.approx(
        [float(np.linalg.norm(tasks_update(r))) for r in ref_results], rel=1e-6
    )


def tasks_update(result: tasks.TaskResult) -> np.ndarray:
    from idlegrid.training.compression import decode

    assert result.update is not None
    return decode(result.update)


def test_a_group_that_never_forms_falls_back_to_coordinator_mode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job, start, payloads = round_zero("p2p")
    monkeypatch.setattr(averaging, "join", NoDaemon(3).join)
    results = train(payloads, job.params)
    assert {r.averaging for r in results} == {"fallback"}
    assert all(r.update is not None for r in results)
    closed = job.close(start.checkpoint, start.optimizer, [tasks.encode_result(r) for r in results])
    assert closed.notes["averaging"] == "coordinator"
    assert "the p2p daemon did not start" in closed.notes["fallback_reason"]
    reference, ref_start, ref_payloads = round_zero("coordinator")
    ref_results = train(ref_payloads, reference.params)
    ref_closed = reference.close(
        ref_start.checkpoint, ref_start.optimizer, [tasks.encode_result(r) for r in ref_results]
    )
    assert closed.weights.digest == ref_closed.weights.digest


class ClientsOnly(AllReduce):
    """Every member behind NAT, in client mode: nobody serves the all-reduce."""

    def average(self, values: np.ndarray, *, shard: int, holds_state: bool,
                settings: Compression | None = None) -> Averaged:  # fmt: skip
        return Averaged(None, reason=averaging.ALL_CLIENTS, attempt=1, reachability="client")


def test_a_group_of_client_members_closes_in_coordinator_mode_and_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job, start, payloads = round_zero("p2p")
    monkeypatch.setattr(averaging, "join", ClientsOnly(3).join)
    results = train(payloads, job.params)
    assert {(r.averaging, r.reachability) for r in results} == {("fallback", "client")}
    decoded = [tasks.decode_result(tasks.encode_result(r)) for r in results]
    assert [r.reachability for r in decoded] == ["client"] * 3
    closed = job.close(start.checkpoint, start.optimizer, [tasks.encode_result(r) for r in results])
    assert closed.notes["averaging"] == "coordinator"
    assert closed.notes["client_members"] == [0, 1, 2]
    assert closed.notes["fallback_reason"].count(averaging.ALL_CLIENTS) == 1


class Replaced(AllReduce):
    """A member whose standing averager was replaced before it averaged."""

    def average(self, values: np.ndarray, *, shard: int, holds_state: bool,
                settings: Compression | None = None) -> Averaged:  # fmt: skip
        done = super().average(values, shard=shard, holds_state=holds_state, settings=settings)
        if shard != 1:
            return done
        why = "the standing averager had exited (-9): killed"
        return Averaged(done.values, done.members, done.attempt, why, residual=done.residual)


def test_a_replaced_averager_is_said_in_the_round_record_of_a_round_that_averaged(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    job, start, payloads = round_zero("p2p")
    monkeypatch.setattr(averaging, "join", Replaced(3).join)
    results = train(payloads, job.params)
    assert {r.averaging for r in results} == {"p2p"}
    assert [bool(r.reason) for r in results] == [False, True, False]
    closed = job.close(start.checkpoint, start.optimizer, [tasks.encode_result(r) for r in results])
    assert closed.notes["averaging"] == "p2p" and closed.notes["agreeing"] == 3
    assert "the standing averager had exited (-9)" in closed.notes["fallback_reason"]


def test_error_feedback_keeps_what_the_groups_codes_missed(monkeypatch: pytest.MonkeyPatch) -> None:
    """int4 with error feedback: each member's residual is what its codes under the
    group's shared scales missed (not what its own upload's would have), and its mean is
    the group's."""
    job, _, payloads = round_zero("p2p")
    params = job.params.model_copy(update={"upload": Compression(method="int4",
                                                                 error_feedback=True)})  # fmt: skip
    fake = AllReduce(3)
    monkeypatch.setattr(averaging, "join", fake.join)
    states = [WorkerState() for _ in payloads]
    with ThreadPoolExecutor(len(payloads)) as pool:
        results = list(pool.map(lambda ps: run_task(ps[0], params.train_spec(), ps[1]),
                                zip(payloads, states, strict=True)))  # fmt: skip
    assert {r.averaging for r in results} == {"p2p"}
    assert len({r.averaged_digest for r in results}) == 1
    for result, state in zip(results, states, strict=True):
        kept = state.residual(payloads[0].stream)
        accumulator = fake.given[result.shard][0]
        assert kept is not None and np.array_equal(kept, fake.residuals[result.shard])
        # Not what its own upload's scales would have missed (the shared scale is coarser
        # where another member's chunk peaks higher).
        alone = accumulator - decode(compress(accumulator, params.upload)[0])
        assert not np.array_equal(kept, alone)


@pytest.mark.parametrize(
    ("workers", "min_updates", "retry_size"), [(5, None, 3), (5, 4, 4), (4, 2, 2), (3, None, 2)]
)
def test_a_retry_goes_on_with_the_jobs_minimum(
    workers: int, min_updates: int | None, retry_size: int
) -> None:
    params = DilocoParams.model_validate({
        **SETTINGS, "workers": workers, "min_updates": min_updates, "averaging": "p2p",
        "pool": {"accounts": ["lab"]},
    })  # fmt: skip
    job = DilocoRounds().job(params, {"dataset": corpus_dataset_blob()}, swarm=Swarm(1, PEERS))
    start = job.initial()
    specs = job.first_shards(start, keyframe=hashlib.sha256(start.checkpoint).hexdigest())
    groups = {tasks.decode_task(s.payload).group for s in specs} - {None}
    assert [(g.size, g.min_size) for g in groups] == [(workers, retry_size)]
