"""Job intake: a researcher's job validated, split into shards, stored and queued.

Also what a live job waits for that the fleet cannot give, and its cancellation.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

from idlegrid.blobs.files import StoredInputs, is_blob_hash
from idlegrid.coordinator import quota_checks as quotas
from idlegrid.coordinator.context import Context, FanOut
from idlegrid.coordinator.fleet import Fleet
from idlegrid.coordinator.matching import Matcher
from idlegrid.coordinator.round_driver import RoundDriver
from idlegrid.kinds import KindParams, ShardSpec, TaskKind, get_kind
from idlegrid.policy import sybil
from idlegrid.store.base import JobRecord, NewJob, NewShard

log = logging.getLogger(__name__)


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
        limited = await quotas.check_new_job(self._ctx.store, self._ctx.settings, account_id)
        parsed, specs = await asyncio.to_thread(self._split, kind, parsed, inputs, limited)
        shards = [
            NewShard(
                index=s.index,
                input_hash=h,
                input_size=len(s.payload),
                items=s.items,
                cost_flops=s.cost_flops,
            )
            for s, h in specs
        ]
        settings = self._ctx.settings
        replication = replication or kind.default_replication or settings.default_replication
        if max_total_results is not None and max_total_results < replication:
            raise JobInputError(
                f"max_total_results ({max_total_results}) is below replication ({replication})"
            )
        record, ready = await self._ctx.store.jobs.create_job(
            NewJob(
                account_id=account_id,
                kind=kind.name,
                params=parsed.model_dump(mode="json"),
                inputs=dict(inputs),
                replication=replication,
                min_quorum=1 if replication == 1 else 2,
                max_attempts=max_total_results or max(settings.max_attempts, replication + 2),
                priority=priority,
                shards=shards,
            ),
            now=self._ctx.clock(),
        )
        await self._fanout.enqueue(ready)
        if self._rounds.drives(kind):
            await self._rounds.start(record)
        log.info(
            "job %s: %s, %d shards, %d items", record.id, kind.name, len(shards), record.items_total
        )
        return record

    def _check_inputs(self, kind: TaskKind, inputs: Mapping[str, str]) -> None:
        missing = set(kind.input_names) - set(inputs)
        extra = set(inputs) - set(kind.input_names)
        if missing or extra:
            raise JobInputError(
                f"kind {kind.name!r} takes inputs {list(kind.input_names)}; "
                f"missing {sorted(missing)}, unexpected {sorted(extra)}"
            )
        for name, blob_hash in inputs.items():
            if not is_blob_hash(blob_hash) or not self._ctx.blobs.exists(blob_hash):
                raise JobInputError(f"input {name!r}: no blob {blob_hash}; upload it first")

    def _split(
        self, kind: TaskKind, params: KindParams, inputs: Mapping[str, str], limited: bool
    ) -> tuple[KindParams, list[tuple[ShardSpec, str]]]:
        """The job's params with what the kind derives from its inputs, and its shards
        with their payloads stored (none stored when they are over the quota)."""
        blobs = self._ctx.blobs
        data = StoredInputs(blobs, inputs)
        params = kind.derive_params(data, params)
        specs = kind.split(data, params)
        if limited:
            quotas.check_shards(self._ctx.settings, len(specs))
        hashes = blobs.put_many([spec.payload for spec in specs])
        return params, list(zip(specs, hashes, strict=True))

    async def waiting_for(self, job: JobRecord) -> list[str]:
        """What a live job waits for that the fleet cannot give, in words; [] if nothing:
        no registered node can run it, or too few connected ones to hold its replicas."""
        if job.state.value not in ("queued", "running"):
            return []
        ctx = self._ctx
        reasons = await self._matcher.waiting_for(job, fleet=self._fleet)
        if job.replication <= 1:
            return reasons
        connected = set(await ctx.broker.connections()) | {s.node_id for s in ctx.hub.sessions()}
        able = [
            (account_id, network)
            for node_id, account_id, network in await self._fleet.able(job.kind)
            if node_id in connected
        ]
        shortfall = sybil.replication_shortfall(
            job.replication,
            able,
            distinct_accounts=ctx.settings.distinct_accounts,
            distinct_networks=ctx.settings.distinct_networks,
        )
        return reasons + ([shortfall] if shortfall else [])

    async def cancel_job(self, job_id: int) -> None:
        held = await self._ctx.store.jobs.cancel_job(job_id, now=self._ctx.clock())
        # Its ready tasks stay in the broker until a claim finds them gone.
        await self._fanout.send_cancels(held, reason=f"job {job_id} was cancelled")
        await self._fanout.job_ended(job_id)
