"""The round driver: a job of a kind that runs in rounds (`TaskKind.rounds`, e.g.
`diloco-train`) as a sequence of rounds through the grid.

The driver knows rounds, not training: the kind's `RoundHooks` say what a round's
weights, shards, close and evaluation are; the driver stores rounds, schedules their
shards and decides when each closes.

Round t is a row in the store (weights digest, checkpoint and optimizer blobs, the update
that produced it) plus its shards: one training task per worker-shard and, every
`eval_every` rounds, one evaluation task of round t's weights on the held-out split. When
`min_updates` training shards have a canonical update (verified like any shard, with the
job's replication), or the round's timer ran out with at least one, the driver closes the
round through the kind (`RoundJob.close`: numpy; the coordinator never imports torch),
stores the new weights and optimizer state as blobs, cancels the round's unfinished
tasks (their late updates would be dropped), and opens round t+1, whose payloads name
the published update and the checkpoint as a keyframe.

In asynchronous mode (`asynchronous`) a closing round leaves its running tasks
running: an update of round r that is decided while round t is open counts in round t's
close, weighted by its staleness t - r (the kind's close), if t - r <=
`max_staleness`; older ones are dropped, and tasks that can only arrive too late are
cancelled. The quorum counts round t's own updates only (a round never closes on stale
updates alone), and a closing round's tasks no node started yet are cancelled: a node
always starts from the newest weights.
Each round's metrics list the shards it aggregated (`applied`) and count the stale
updates it applied and dropped; the job's metrics sum them.

After the last round one evaluation task measures the final weights; the job's result is
their checkpoint.

Eval loss comes from evaluation tasks on the nodes (a forward pass over the fixed
held-out batches), not from the coordinator, which has no torch.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from idlegrid.coordinator.context import Context, FanOut
from idlegrid.coordinator.matching import Matcher
from idlegrid.coordinator.plans import Plans
from idlegrid.coordinator.round_records import (
    done_shard,
    finite,
    hopeless,
    is_open,
    late_updates,
    published_chain,
    round_indexes,
    round_row,
    train_indexes,
    unapplied,
)
from idlegrid.kinds.base import (
    RoundClose,
    RoundJob,
    RoundWeights,
    ShardSpec,
    Swarm,
    TaskKind,
)
from idlegrid.states import TERMINAL_JOB_STATES, TrainingRoundState
from idlegrid.store.base import JobRecord, NewRound, NewShard, RoundRecord, ShardRecord
from idlegrid.training.schedule import Close, close_decision, finish_decision

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Stored:
    """A round's weights once stored: the blobs that hold its checkpoint and optimizer."""

    weights: RoundWeights
    checkpoint_hash: str
    optimizer_hash: str


class RoundDriver:
    def __init__(self, ctx: Context, *, fanout: FanOut, plans: Plans, matcher: Matcher) -> None:
        self._ctx = ctx
        self._fanout = fanout
        self._plans = plans
        self._matcher = matcher
        self._jobs: dict[int, RoundJob] = {}
        self._locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)
        # The bootstrap DHT peer's addresses (`idlegrid serve` with the p2p extra): where
        # members of peer-to-peer rounds meet. Empty: no peer-to-peer rounds here.
        self.swarm_peers: tuple[str, ...] = ()
        self.swarm_key = b""  # seals p2p rounds' records (p2p/seal.py)

    def set_swarm_peers(self, peers: tuple[str, ...], key: bytes = b"") -> None:
        """The bootstrap DHT peer is up (or given): its addresses and the coordinator's
        round key go into new rounds."""
        self.swarm_peers, self.swarm_key = peers, key
        self._jobs.clear()  # set up again with them on next use

    @staticmethod
    def drives(kind: TaskKind) -> bool:
        """Whether `kind`'s jobs run in rounds (this driver's), not as one set of shards."""
        return kind.rounds is not None

    # -- entry points ------------------------------------------------------------------------

    async def start(self, job: JobRecord) -> None:
        """Open round 0 of a job just created (its training shards came from `split`)."""
        training = await self._training(job.id)
        start = await asyncio.to_thread(self._save, training.initial())
        specs = training.first_shards(start.weights, keyframe=start.checkpoint_hash)
        first = self._new_round(training, start, None)
        now = self._ctx.clock()
        ready = await self._ctx.store.rounds.start_training(
            job.id, first, await self._put(specs), now=now
        )
        await self._fanout.enqueue(ready)

    async def progress(self, job_id: int) -> None:
        """A shard of the job was decided: record evaluations, close the round if due."""
        async with self._locks[job_id]:
            await self._step(job_id, timer=False)

    async def close_due(self) -> int:
        """Monitor pass: close (or extend) every open round whose timer ran out."""
        due = await self._ctx.store.rounds.due_rounds(now=self._ctx.clock())
        for job_id, _ in due:
            async with self._locks[job_id]:
                await self._step(job_id, timer=True)
        return len(due)

    async def metrics(self, job: JobRecord) -> dict[str, Any]:
        """Per-round metrics of a training job (the body of GET /v1/jobs/{id}/metrics)."""
        training = await self._training(job.id)
        records = await self._ctx.store.rounds.training_rounds(job.id)
        shards = {s.index: s for s in await self._ctx.store.jobs.list_shards(job.id)}
        rows = [round_row(r, shards, training) for r in records]
        return {
            "job_id": job.id,
            "state": job.state.value,
            "rounds_total": training.plan.rounds,
            "rounds_done": sum(1 for r in records if r.state == "closed" and not r.final),
            "workers": training.plan.workers,
            "bytes_up": sum(r.get("bytes_up") or 0 for r in rows),
            "bytes_down": sum(r.get("bytes_down") or 0 for r in rows),
            "asynchronous": training.plan.asynchronous,
            "stale_applied": sum(r.get("stale_applied") or 0 for r in rows),
            "stale_dropped": sum(r.get("stale_dropped") or 0 for r in rows),
            "eval_loss": next(
                (r["eval_loss"] for r in reversed(rows) if r.get("eval_loss") is not None), None
            ),  # fmt: skip
            "rounds": rows,
        }

    def forget(self, job_id: int) -> None:
        self._jobs.pop(job_id, None)
        self._locks.pop(job_id, None)
        self._matcher.forget_preferences(job_id)

    # -- one step ----------------------------------------------------------------------------

    async def _step(self, job_id: int, *, timer: bool) -> None:
        job = await self._ctx.store.jobs.get_job(job_id)
        if job is None or job.state in TERMINAL_JOB_STATES:
            return
        training = await self._training(job_id)
        records = await self._ctx.store.rounds.training_rounds(job_id)
        shards = {s.index: s for s in await self._ctx.store.jobs.list_shards(job_id)}
        await self._record_evaluations(job_id, records, shards)
        if not records or records[-1].state != TrainingRoundState.OPEN:
            return
        current = records[-1]
        expired = timer and self._ctx.clock() >= current.deadline
        if current.final:
            # Earlier rounds' evaluations still running are waited for (or the timer).
            pending = [r.eval_shard for r in records if r.eval_shard is not None
                       and is_open(shards, r.eval_shard)]  # fmt: skip
            evaluated = not pending
            if finish_decision(evaluated=evaluated, timer_expired=expired):
                await self._finish(job_id, current, shards)
            return
        done = [s for i in train_indexes(current) if (s := done_shard(shards, i)) is not None]
        late: list[ShardRecord] = []
        too_stale: list[ShardRecord] = []
        if training.plan.asynchronous:
            late, too_stale = late_updates(records, shards, training.plan.max_staleness)
        decision = close_decision(
            updates=len(done), late=len(late), min_updates=training.plan.min_updates,
            timer_expired=expired,
        )  # fmt: skip
        if decision == Close.EXTEND:
            log.info("job %s round %s: no update before the timer; waiting", job_id, current.round)
            deadline = self._ctx.clock() + training.plan.round_timeout_s
            await self._ctx.store.rounds.extend_round(job_id, current.round, deadline=deadline)
        elif decision != Close.WAIT:
            await self._close(job_id, training, records, shards, [*done, *late], decision,
                              too_stale=too_stale)  # fmt: skip

    async def _close(
        self,
        job_id: int,
        training: RoundJob,
        records: Sequence[RoundRecord],
        shards: dict[int, ShardRecord],
        done: Sequence[ShardRecord],
        why: Close,
        *,
        too_stale: Sequence[ShardRecord] = (),
    ) -> None:
        current = records[-1]
        closed = await asyncio.to_thread(self._aggregate, training, current, done)
        final = closed.weights.round >= training.plan.rounds
        stored = await asyncio.to_thread(self._save, closed.weights)
        update_hash = await asyncio.to_thread(self._ctx.blobs.keep, closed.update)
        specs = await asyncio.to_thread(
            training.shards, closed.weights, published=published_chain(records, update_hash),
            keyframe=stored.checkpoint_hash, final=final,
        )  # fmt: skip
        now = self._ctx.clock()
        metrics = await self._close_metrics(job_id, training, current, shards, done, closed,
                                            why, now=now)  # fmt: skip
        open_left = [i for i in train_indexes(current) if is_open(shards, i)]
        if training.plan.asynchronous:
            open_left, dropped = await self._left_behind(
                job_id, training, records, shards, closed.weights.round, open_left, too_stale
            )
            metrics.update({"stale_dropped": len(dropped), "dropped": dropped})
        advance = await self._ctx.store.rounds.advance_round(
            job_id, current.round, metrics=metrics, cancel_shards=open_left,
            next_round=self._new_round(training, stored, update_hash, final=final),
            shards=await self._put(specs), now=now,
        )  # fmt: skip
        if not advance.won:
            return
        log.info("job %s round %s closed (%s, %d updates, train loss %.4f)",
                 job_id, current.round, why.value, len(done), closed.train_loss)  # fmt: skip
        await self._fanout.send_cancels(advance.to_cancel, reason=f"round {current.round} closed")
        if training.plan.affinity and not final:
            await self._prefer_holders(job_id, training, done)
        await self._fanout.enqueue(advance.ready)

    async def _close_metrics(
        self,
        job_id: int,
        training: RoundJob,
        current: RoundRecord,
        shards: dict[int, ShardRecord],
        done: Sequence[ShardRecord],
        closed: RoundClose,
        why: Close,
        *,
        now: float,
    ) -> dict[str, Any]:
        """What a closing round's row records of it: its loss, its updates and what closed
        it, its traffic (with its evaluation's fetches, if that finished already), its
        time and nodes, and the close's own notes."""
        fetched = closed.fetched_bytes
        traffic = await self._ctx.store.rounds.round_traffic(job_id, round_indexes(current))
        evaluation = await asyncio.to_thread(
            self._evaluation, training, done_shard(shards, current.eval_shard)
        )
        if evaluation is not None:  # finished already: its fetches count here
            fetched += evaluation[1]
        return {
            "train_loss": finite(closed.train_loss),
            "updates": len(done),
            "closed_by": why.value,
            "bytes_up": traffic.output_bytes,
            "bytes_down": traffic.payload_bytes + fetched,
            "nodes": list(traffic.nodes),
            "round_time_s": now - current.opened_at,
            "max_suspicion": closed.max_suspicion,
            "applied": [shard.index for shard in done],
            "stale_applied": closed.stale_applied,
            **closed.notes,
        }

    async def _left_behind(
        self,
        job_id: int,
        training: RoundJob,
        records: Sequence[RoundRecord],
        shards: dict[int, ShardRecord],
        next_round: int,
        open_left: Sequence[int],
        too_stale: Sequence[ShardRecord],
    ) -> tuple[list[int], list[int]]:
        """An asynchronous round's close: the shards to cancel, and those dropped as stale.

        The closed round's tasks no node started are cancelled: started now, they would
        train from weights already a round old. Those running go on (their updates count
        later, weighted), unless they could only arrive past max_staleness: those are
        dropped now, counted."""
        unstarted = await self._unstarted(job_id, open_left)
        doomed = hopeless(records, shards, next_round, training.plan.max_staleness)
        running = await self._started(job_id, doomed)
        return sorted({*unstarted, *doomed}), [shard.index for shard in too_stale] + running

    async def _prefer_holders(
        self, job_id: int, training: RoundJob, done: Sequence[ShardRecord]
    ) -> None:
        """Affinity: shard s of the next round prefers the node whose update for shard s
        was just taken, which holds what the kind keeps of s between rounds (DiLoCo: its
        AdamW moments with `inner.keep_state`, its local weights when streaming)."""
        holders = {}
        for shard in done:
            found = await self._ctx.store.verification.shard_for_verify(shard.id)
            results = found.results if found is not None else []
            taken = [r.node_id for r in results if r.output_hash == shard.output_hash]
            if taken:
                holders[shard.index + training.plan.stride] = taken[0]
        shards = await self._ctx.store.jobs.list_shards(job_id)
        self._matcher.prefer(job_id, {s.id: holders[s.index] for s in shards if s.index in holders})

    async def _finish(
        self, job_id: int, final: RoundRecord, shards: dict[int, ShardRecord]
    ) -> None:
        now = self._ctx.clock()
        traffic = await self._ctx.store.rounds.round_traffic(job_id, round_indexes(final))
        training = await self._training(job_id)
        evaluation = await asyncio.to_thread(
            self._evaluation, training, done_shard(shards, final.eval_shard)
        )
        records = await self._ctx.store.rounds.training_rounds(job_id)
        metrics = {
            # Asynchronous: updates decided after the last training round, or still running.
            "stale_dropped": len(await self._started(job_id, unapplied(records, shards))),
            "bytes_up": traffic.output_bytes,
            "bytes_down": traffic.payload_bytes + (evaluation[1] if evaluation else 0),
            "nodes": list(traffic.nodes),
            "round_time_s": now - final.opened_at,
            "eval_loss": evaluation[0] if evaluation else None,
        }
        size = self._ctx.blobs.size(final.checkpoint_hash)
        completed, to_cancel = await self._ctx.store.rounds.finish_training(
            job_id, final.round, metrics=metrics, result_hash=final.checkpoint_hash,
            result_size=size, now=now,
        )  # fmt: skip
        await self._fanout.send_cancels(to_cancel, reason=f"job {job_id} finished training")
        if completed:
            log.info("job %s trained %s rounds; eval loss %s", job_id, final.round,
                     metrics["eval_loss"])  # fmt: skip
            await self._fanout.job_ended(job_id)
        self.forget(job_id)

    async def _record_evaluations(
        self, job_id: int, records: Sequence[RoundRecord], shards: dict[int, ShardRecord]
    ) -> None:
        """Store the held-out loss of every round whose evaluation came in (even late)."""
        training = await self._training(job_id)
        for record in records:
            shard = done_shard(shards, record.eval_shard)
            if record.final or shard is None or "eval_loss" in record.metrics:
                continue
            evaluation = await asyncio.to_thread(self._evaluation, training, shard)
            if evaluation is not None:
                values: dict[str, Any] = {"eval_loss": evaluation[0]}
                if record.state == TrainingRoundState.CLOSED:
                    # Arrived after the round's traffic was counted: add its own.
                    values["bytes_down"] = (record.metrics.get("bytes_down", 0)
                                            + evaluation[1] + evaluation[2])  # fmt: skip
                    values["bytes_up"] = record.metrics.get("bytes_up", 0) + evaluation[3]
                await self._ctx.store.rounds.update_round_metrics(job_id, record.round, values)

    # -- blocking helpers (run in a thread) --------------------------------------------------

    def _aggregate(
        self, training: RoundJob, current: RoundRecord, done: Sequence[ShardRecord]
    ) -> RoundClose:
        outputs = []
        for shard in done:
            assert shard.output_hash is not None
            outputs.append(self._ctx.blobs.read(shard.output_hash))
        return training.close(
            self._ctx.blobs.read(current.checkpoint_hash),
            self._ctx.blobs.read(current.momentum_hash),
            outputs,
        )

    def _save(self, weights: RoundWeights) -> Stored:
        blobs = self._ctx.blobs
        return Stored(weights, blobs.keep(weights.checkpoint), blobs.keep(weights.optimizer))

    def _evaluation(
        self, training: RoundJob, shard: ShardRecord | None
    ) -> tuple[float, int, int, int] | None:
        """(held-out loss, bytes fetched, payload bytes, result bytes) of an eval shard."""
        if shard is None or shard.output_hash is None:
            return None
        output = self._ctx.blobs.read(shard.output_hash)
        evaluation = training.evaluation(output)
        payload = self._ctx.blobs.size(shard.input_hash)
        return evaluation.loss, evaluation.fetched_bytes, payload, len(output)

    async def _put(self, specs: Sequence[ShardSpec]) -> list[NewShard]:
        def put() -> list[NewShard]:
            return [
                NewShard(
                    index=spec.index,
                    input_hash=self._ctx.blobs.put(spec.payload),
                    input_size=len(spec.payload),
                    items=spec.items,
                    cost_flops=spec.cost_flops,
                )
                for spec in specs
            ]

        return await asyncio.to_thread(put)

    async def _started(self, job_id: int, indexes: Sequence[int]) -> list[int]:
        """The shards among `indexes` some node was given (an update may come from it)."""
        started = []
        for index in indexes:
            traffic = await self._ctx.store.rounds.round_traffic(job_id, [index])
            if traffic.payload_bytes > 0:
                started.append(index)
        return started

    async def _unstarted(self, job_id: int, indexes: Sequence[int]) -> list[int]:
        """The shards among `indexes` no node was given yet."""
        started = set(await self._started(job_id, indexes))
        return [index for index in indexes if index not in started]

    def _new_round(
        self,
        training: RoundJob,
        stored: Stored,
        update_hash: str | None,
        *,
        final: bool = False,
    ) -> NewRound:
        plan, number = training.plan, stored.weights.round
        with_eval = final or number % plan.eval_every == 0
        return NewRound(
            round=number,
            final=final,
            weights_digest=stored.weights.digest,
            checkpoint_hash=stored.checkpoint_hash,
            momentum_hash=stored.optimizer_hash,
            update_hash=update_hash,
            first_shard=number * plan.stride,
            train_shards=0 if final else plan.workers,
            eval_shard=number * plan.stride + plan.workers if with_eval else None,
            deadline=self._ctx.clock() + plan.round_timeout_s,
        )

    async def _training(self, job_id: int) -> RoundJob:
        """The kind's view of the job's rounds, set up once per process."""
        found = self._jobs.get(job_id)
        if found is None:
            plan = await self._plans.get(job_id)
            job = await self._ctx.store.jobs.get_job(job_id)
            assert plan is not None and job is not None and plan.kind.rounds is not None
            inputs = await asyncio.to_thread(self._read_inputs, job.inputs)
            swarm = Swarm(job_id, self.swarm_peers, self.swarm_key)
            found = plan.kind.rounds.job(plan.params, inputs, swarm=swarm)
            self._jobs[job_id] = found
        return found

    def _read_inputs(self, blobs: dict[str, str]) -> dict[str, bytes]:
        return {name: self._ctx.blobs.read(blob_hash) for name, blob_hash in blobs.items()}
