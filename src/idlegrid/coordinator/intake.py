"""Job intake: a researcher's job validated, split into shards, sized against the
connected fleet (coordinator/estimates.py), stored and queued.

Also what a live job waits for that the fleet cannot give, how long it will take, and
its cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from idlegrid.blobs.files import StoredInputs, is_blob_hash
from idlegrid.coordinator import quota_checks as quotas
from idlegrid.coordinator.context import Context, FanOut
from idlegrid.coordinator.estimates import Estimates, Sized, TooLong
from idlegrid.coordinator.fleet import Fleet
from idlegrid.coordinator.matching import Matcher
from idlegrid.coordinator.round_driver import RoundDriver
from idlegrid.kinds import KindParams, ShardSpec, TaskKind, get_kind
from idlegrid.kinds.base import Pool
from idlegrid.policy import availability, sizing, sybil
from idlegrid.store.base import JobRecord, NewJob, NewShard, ReadyTask

log = logging.getLogger(__name__)

NOTES_KEPT = 256  # jobs whose submission notes wait for the answer that reads them


class JobInputError(ValueError):
    """A job request that cannot be accepted; the message is for the researcher."""


class Intake:
    def __init__(
        self,
        ctx: Context,
        *,
        fanout: FanOut,
        matcher: Matcher,
        rounds: RoundDriver,
        fleet: Fleet,
    ) -> None:
        self._ctx = ctx
        self._fleet = fleet
        self._estimates = Estimates(ctx, fleet)
        self._notes: OrderedDict[int, list[str]] = OrderedDict()
        self._fanout = fanout
        self._matcher = matcher
        self._rounds = rounds

    async def submit_job(
        self,
        *,
        account_id: int,
        kind_name: str,
        inputs: Mapping[str, str],
        params: Mapping[str, Any],
        replication: int | None,
        priority: int,
        max_total_results: int | None = None,
    ) -> JobRecord:
        """Validate, split and store a job; its tasks enter the ready queue."""
        kind = get_kind(kind_name)
        parsed = kind.parse_params(params)
        self._check_inputs(kind, inputs)
        pool = kind.pool(parsed)
        if pool is not None:
            parsed = kind.with_pool(parsed, await self._admit_pool(pool, replication))
        limited = await quotas.check_new_job(self._ctx.store, self._ctx.settings, account_id)
        settings = self._ctx.settings
        replication = replication or kind.default_replication or settings.default_replication
        parsed, cut = await asyncio.to_thread(self._split, kind, parsed, inputs)
        sized = await self._sized(kind, parsed, inputs, cut, replication)
        if limited:
            quotas.check_shards(settings, len(sized.specs))
        shards = await self._stored_shards(sized.specs)
        if max_total_results is not None and max_total_results < replication:
            raise JobInputError(
                f"max_total_results ({max_total_results}) is below replication ({replication})"
            )
        record, ready = await self._ctx.store.jobs.create_job(
            NewJob(
                account_id=account_id,
                kind=kind.name,
                params=sized.params.model_dump(mode="json"),
                inputs=dict(inputs),
                replication=replication,
                min_quorum=1 if replication == 1 else 2,
                max_attempts=max_total_results or max(settings.max_attempts, replication + 2),
                priority=priority,
                shards=shards,
                # Verified by checks: its output first; the check once there is one.
                first_target=1 if kind.checks else None,
            ),
            now=self._ctx.clock(),
        )
        await self._accepted(record, kind, ready, sized.notes)
        return record

    async def _stored_shards(self, specs: list[ShardSpec]) -> list[NewShard]:
        """The shards of these specs, their payloads stored as blobs."""
        hashes = await asyncio.to_thread(self._ctx.blobs.put_many, [s.payload for s in specs])
        return [
            NewShard(
                index=s.index,
                input_hash=h,
                input_size=len(s.payload),
                items=s.items,
                cost_flops=s.cost_flops,
            )
            for s, h in zip(specs, hashes, strict=True)
        ]

    async def _accepted(
        self, record: JobRecord, kind: TaskKind, ready: list[ReadyTask], notes: list[str]
    ) -> None:
        """A job just stored: its tasks queued (a training job's first round started), and
        what sizing told of it kept for the answer that reads it."""
        await self._fanout.enqueue(ready)
        if self._rounds.drives(kind):
            await self._rounds.start(record)
        log.info(
            "job %s: %s, %d shards, %d items", record.id, kind.name, record.shards_total,
            record.items_total,
        )  # fmt: skip
        self._notes[record.id] = notes
        while len(self._notes) > NOTES_KEPT:
            self._notes.popitem(last=False)

    async def _sized(
        self,
        kind: TaskKind,
        params: KindParams,
        inputs: Mapping[str, str],
        specs: list[ShardSpec],
        replication: int,
    ) -> Sized:
        """The job's shards fitted to the leases of the connected nodes that can run it
        (cut smaller, or refused: JobInputError), with the estimate's warning."""
        speeds = await self._estimates.speeds(kind, params)
        data = StoredInputs(self._ctx.blobs, inputs)

        def resplit(cut: KindParams) -> list[ShardSpec]:
            return kind.split(data, cut)

        try:
            sized = await asyncio.to_thread(self._estimates.fit, kind, params, specs, speeds,
                                            resplit)  # fmt: skip
        except TooLong as exc:
            raise JobInputError(str(exc)) from None
        stages = kind.work_stages(sized.params, [s.cost_flops for s in sized.specs], replication)
        estimate = sizing.estimate(stages, speeds)
        return Sized(sized.params, sized.specs, sized.notes + self._estimates.warnings(estimate))

    def submission_notes(self, job_id: int) -> list[str]:
        """What sizing told of a job this process just accepted (shards cut, a long
        estimate), once."""
        return self._notes.pop(job_id, [])

    async def resubmit(self, job: JobRecord) -> JobRecord:
        """A new job of an ended job's shards that did not complete (failed, or ended with
        it), as they were split: same kind, params and replication, nothing run again
        that was done. Training jobs run in rounds and are submitted whole."""
        if job.state.value in ("queued", "running", "completed"):
            raise JobInputError(
                f"job {job.id} is {job.state.value}; only a failed or cancelled job's "
                "shards can be resubmitted"
            )
        kind = get_kind(job.kind)
        if self._rounds.drives(kind):
            raise JobInputError(f"job {job.id} is a training job; submit it again whole")
        limited = await quotas.check_new_job(self._ctx.store, self._ctx.settings, job.account_id)
        shards = [
            NewShard(
                index=s.index,
                input_hash=s.input_hash,
                input_size=self._ctx.blobs.size(s.input_hash),
                items=s.items,
                cost_flops=s.cost_flops,
            )
            for s in await self._ctx.store.jobs.list_shards(job.id)
            if s.state.value != "done"
        ]
        if not shards:
            raise JobInputError(f"job {job.id} has no shard left to run")
        if limited:
            quotas.check_shards(self._ctx.settings, len(shards))
        record, ready = await self._ctx.store.jobs.create_job(
            NewJob(
                account_id=job.account_id,
                kind=job.kind,
                params=job.params,
                inputs=dict(job.inputs),
                replication=job.replication,
                min_quorum=1 if job.replication == 1 else 2,
                max_attempts=job.max_attempts,
                priority=job.priority,
                shards=shards,
            ),
            now=self._ctx.clock(),
        )
        await self._fanout.enqueue(ready)
        log.info("job %s: %d shards of job %s resubmitted", record.id, len(shards), job.id)
        return record

    async def _admit_pool(self, pool: Pool, replication: int | None) -> frozenset[int]:
        """The account ids of a job's pool; JobInputError if the pool cannot hold it."""
        if pool.needs_swarm and not self._rounds.swarm_peers:
            raise JobInputError(
                "this coordinator runs no bootstrap DHT peer (yet), so no peer-to-peer job: "
                "install idlegrid[p2p] where it runs and start `idlegrid serve` with --p2p "
                "auto or on (its log says when the peer is up)"
            )
        if replication is not None and replication > 1:
            raise JobInputError("a pool's members average each shard once: replication must be 1")
        store = self._ctx.store
        ids: set[int] = set()
        unknown = []
        for name in pool.accounts:
            account = await store.accounts.get_account(name)
            if account is None:
                unknown.append(name)
            else:
                ids.add(account.id)
        if unknown:
            raise JobInputError(f"pool: no account named {', '.join(map(repr, unknown))}")
        if pool.team is not None:
            members = await store.accounts.team_account_ids(pool.team)
            if members is None:
                raise JobInputError(f"pool: no team named {pool.team!r}")
            ids.update(members)
        able = [n for n, account, _ in await self._fleet.able(pool.capability) if account in ids]
        if len(able) < pool.members:
            raise JobInputError(
                f"pool: the job needs {pool.members} nodes at once, and its accounts have "
                f"{len(able)} registered node(s) that can average peer to peer "
                f"(offering {pool.capability!r}: idlegrid[p2p] on Linux or macOS)"
            )
        return frozenset(ids)

    def _check_inputs(self, kind: TaskKind, inputs: Mapping[str, str]) -> None:
        missing = set(kind.input_names) - set(inputs)
        extra = set(inputs) - set(kind.input_names) - set(kind.optional_inputs)
        if missing or extra:
            optional = f" (optional: {list(kind.optional_inputs)})" if kind.optional_inputs else ""
            raise JobInputError(
                f"kind {kind.name!r} takes inputs {list(kind.input_names)}{optional}; "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for name, blob_hash in inputs.items():
            if not is_blob_hash(blob_hash) or not self._ctx.blobs.exists(blob_hash):
                raise JobInputError(f"input {name!r}: no blob {blob_hash}; upload it first")

    def _split(
        self, kind: TaskKind, params: KindParams, inputs: Mapping[str, str]
    ) -> tuple[KindParams, list[ShardSpec]]:
        """The job's params with what the kind derives from its inputs, and its shards
        (their payloads stored once sizing has settled them)."""
        data = StoredInputs(self._ctx.blobs, inputs)
        params = kind.derive_params(data, params)
        return params, kind.split(data, params)

    async def estimate(self, job: JobRecord) -> sizing.Estimate | None:
        """How long the job's remaining work takes on the nodes connected now (None: it
        ended, or no connected node can run it)."""
        return await self._estimates.remaining(job)

    async def waiting_for(self, job: JobRecord) -> list[str]:
        """What a live job waits for that the fleet cannot give, in words; [] if nothing:
        no registered node can run it, or too few connected ones to hold its replicas."""
        if job.state.value not in ("queued", "running"):
            return []
        ctx = self._ctx
        reasons = await self._matcher.waiting_for(job, fleet=self._fleet)
        connected = await ctx.connected()
        able_nodes = [row for row in await self._fleet.able(job.kind) if row[0] in connected]
        ids = {row[0] for row in able_nodes}
        reasons += availability.held_back(job.kind, len(ids), await self._held_back(ids))
        if job.replication <= 1:
            return reasons
        able = [(account_id, network) for _, account_id, network in able_nodes]
        shortfall = sybil.replication_shortfall(
            job.replication,
            able,
            distinct_accounts=ctx.settings.distinct_accounts,
            distinct_networks=ctx.settings.distinct_networks,
        )
        return reasons + ([shortfall] if shortfall else [])

    async def _held_back(self, ids: set[int]) -> list[availability.NodeState]:
        """The paused and throttled nodes among `ids`, as their workers last said: read
        from the store, so every coordinator process knows what a node told any one."""
        return [
            availability.NodeState(
                node.node_id, node.name, node.state == "paused", node.state == "throttled",
                node.reason,
            )
            for node in await self._ctx.store.node_control.held_back()
            if node.node_id in ids
        ]  # fmt: skip

    async def cancel_job(self, job_id: int) -> None:
        held = await self._ctx.store.jobs.cancel_job(job_id, now=self._ctx.clock())
        # Its ready tasks stay in the broker until a claim finds them gone.
        await self._fanout.send_cancels(held, reason=f"job {job_id} was cancelled")
        await self._fanout.job_ended(job_id)
