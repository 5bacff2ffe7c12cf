"""The coordinator's core, as one facade: jobs in, tasks out, results verified, jobs assembled.

`Grid` wires the parts around one `Context` (settings, store, broker, blobs, hub, clock,
counters) and one fan-out, and is what the REST API, the WebSocket handler, the monitor
and the tests call; none of them touch SQL. Each concept lives in its own module:

- `plans`: what this process keeps of each job; `intake`: submit, split, cancel;
- `dispatch`: fill a node's slots (`matching` feeds the scheduler); `leases`: lease
  lengths, expiry and replenishment;
- `result_path`: the result path and its group commit; `verifier`: decide shards,
  judge late results, assemble jobs; `stalemate`: shards no node can add a result to;
  `round_driver`: training jobs' rounds; `node_control`: a volunteer's node settings;
- `fanout` and `peers`: what concerns the other parts, the nodes and the other
  coordinator processes that share the store and broker.

Parts receive the context and the fan-out, never the `Grid`, so they form a graph with
no cycle: the facade is the only module that knows them all.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from random import Random
from typing import Any

from idlegrid import protocol
from idlegrid.blobs.files import BlobStore
from idlegrid.broker.base import Broker
from idlegrid.coordinator import peers
from idlegrid.coordinator.context import CHANNEL, Context, Counters, PresencePause
from idlegrid.coordinator.dispatch import Dispatcher
from idlegrid.coordinator.fanout import GridFanOut
from idlegrid.coordinator.fleet import Fleet
from idlegrid.coordinator.hub import Hub, NodeSession
from idlegrid.coordinator.intake import Intake, JobInputError
from idlegrid.coordinator.leases import Leases, lease_seconds
from idlegrid.coordinator.matching import Matcher, Shares
from idlegrid.coordinator.node_control import NodeControl, NodeNotFound, SettingRefused
from idlegrid.coordinator.plans import JobPlan, Plans
from idlegrid.coordinator.result_path import ResultPath
from idlegrid.coordinator.round_driver import RoundDriver
from idlegrid.coordinator.stalemate import Stalemates
from idlegrid.coordinator.verifier import Verifier
from idlegrid.policy import sizing
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import Store
from idlegrid.store.base import (
    JobRecord,
    NodeRecord,
    NodeTask,
    ReadyTask,
    RegistrationLimits,
    ResultReceipt,
)
from idlegrid.verification import checking
from idlegrid.verification.trust import TrustSettings

__all__ = ["CHANNEL", "Grid", "JobInputError", "JobPlan", "NodeNotFound", "SettingRefused"]


class Grid:
    def __init__(
        self,
        *,
        settings: CoordinatorSettings,
        store: Store,
        broker: Broker,
        blobs: BlobStore,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.context = Context(
            settings=settings,
            store=store,
            broker=broker,
            blobs=blobs,
            hub=Hub(),
            clock=clock,
            counters=Counters(),
            process_id=f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}",
            work_available=asyncio.Event(),
            random=Random(),
            presence_pause=PresencePause(),
        )
        ctx = self.context
        shares = Shares(store, settings.shares)
        self.plans = Plans(store, on_new_plan=shares.resolve)
        self.matcher = Matcher(ctx, plans=self.plans, shares=shares)
        self.fanout = GridFanOut(ctx, plans=self.plans, matcher=self.matcher)
        self.rounds = RoundDriver(  # training jobs: one round after another
            ctx, fanout=self.fanout, plans=self.plans, matcher=self.matcher
        )
        self.leases = Leases(ctx, self.fanout)
        # The registered nodes as a job's status reads them (a snapshot, not per request).
        self.fleet = Fleet(store, clock=clock)
        self.intake = Intake(
            ctx, fanout=self.fanout, matcher=self.matcher, rounds=self.rounds, fleet=self.fleet
        )
        self.dispatcher = Dispatcher(
            ctx, plans=self.plans, matcher=self.matcher, leases=self.leases
        )
        self.verification = Verifier(
            ctx, fanout=self.fanout, plans=self.plans, rounds=self.rounds, leases=self.leases
        )
        self.stalemates = Stalemates(
            ctx, fleet=self.fleet, plans=self.plans, verifier=self.verification
        )
        self.results = ResultPath(
            ctx, plans=self.plans, verification=self.verification, leases=self.leases
        )
        # The volunteer's settings of each node, from the dashboard to its socket.
        self.node_control = NodeControl(ctx)
        self.registration_limits = RegistrationLimits(
            max_nodes_per_account=settings.max_nodes_per_account,
            per_account_per_hour=settings.node_registrations_per_account_per_hour,
            per_address_per_hour=settings.node_registrations_per_address_per_hour,
        )

    async def aclose(self) -> None:
        """Drain what this grid owns in the background (the group commit of results, a
        refresh of the fleet snapshot)."""
        await self.results.aclose()
        await self.fleet.aclose()

    # -- the context, for callers of the facade ------------------------------------------

    @property
    def settings(self) -> CoordinatorSettings:
        return self.context.settings

    @property
    def store(self) -> Store:
        return self.context.store

    @property
    def broker(self) -> Broker:
        return self.context.broker

    @property
    def blobs(self) -> BlobStore:
        return self.context.blobs

    @property
    def hub(self) -> Hub:
        return self.context.hub

    async def connected(self) -> set[int]:
        """The nodes connected to this process or, with a shared broker, to any."""
        return await self.context.connected()

    @property
    def clock(self) -> Callable[[], float]:
        return self.context.clock

    @property
    def counters(self) -> Counters:
        return self.context.counters

    @property
    def process_id(self) -> str:
        return self.context.process_id

    @property
    def work_available(self) -> asyncio.Event:
        return self.context.work_available

    @property
    def random(self) -> Random:
        return self.context.random

    @property
    def trust(self) -> TrustSettings:
        return self.context.settings.trust

    # -- jobs ----------------------------------------------------------------------------

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
        return await self.intake.submit_job(
            account_id=account_id,
            kind_name=kind_name,
            inputs=inputs,
            params=params,
            replication=replication,
            priority=priority,
            max_total_results=max_total_results,
        )

    async def resubmit_job(self, job: JobRecord) -> JobRecord:
        return await self.intake.resubmit(job)

    async def plan(self, job_id: int) -> JobPlan | None:
        return await self.plans.get(job_id)

    async def waiting_for(self, job: JobRecord) -> list[str]:
        """What a live job waits for that the fleet cannot give, in words ([] if nothing)."""
        return (
            await self.intake.waiting_for(job)
            + await self.stalemates.waiting_for(job)
            + await self.stalemates.build_waits(job)
        )

    async def estimate(self, job: JobRecord) -> sizing.Estimate | None:
        """How long a live job's remaining work takes on the nodes connected now."""
        return await self.intake.estimate(job)

    def submission_notes(self, job_id: int) -> list[str]:
        """What sizing told of a job just submitted here: shards cut, a long estimate."""
        return self.intake.submission_notes(job_id)

    async def doubts(self, job: JobRecord) -> list[str]:
        """An ended job's shards that rested on the word of a checker caught lying since,
        in words (an open job has them checked again instead: `store.recheck`)."""
        if job.state.value in ("queued", "running"):
            return []
        found = await self.store.verification.rested_on_liars(job.id)
        return [checking.doubt_reason(index, node_id) for index, node_id in found]

    async def cancel_job(self, job_id: int) -> None:
        await self.intake.cancel_job(job_id)

    # -- dispatch and leases -------------------------------------------------------------

    async def fill(self, session: NodeSession) -> int:
        """Give a node as many tasks as it wants and can run; return how many it got."""
        return await self.dispatcher.fill(session)

    async def fill_waiting(self) -> None:
        """Offer queued work to every connected node that asked for some."""
        await self.dispatcher.fill_waiting()

    def lease_seconds(self, session: NodeSession, entry: ReadyTask) -> float:
        return lease_seconds(self.settings, session, entry)

    async def replenish(self) -> None:
        await self.leases.replenish()

    async def expire(self, expired: Sequence[NodeTask], *, why: str) -> None:
        """Requeue the shards of expired tasks; tell connected holders."""
        await self.leases.expire(expired, why=why)

    async def rebuild_queue(self) -> None:
        """Refill the broker's ready queue from the store (startup, broker loss)."""
        await peers.rebuild_queue(self.context)

    # -- results and verification --------------------------------------------------------

    async def accept_result(self, session: NodeSession, msg: protocol.Result) -> ResultReceipt:
        return await self.results.accept_result(session, msg)

    async def accept_results(
        self, session: NodeSession, msgs: Sequence[protocol.Result]
    ) -> list[ResultReceipt]:
        """Take several results of a node in one transaction; receipts after the commit."""
        return await self.results.accept_results(session, msgs)

    async def record_failure(self, session: NodeSession, msg: protocol.Failure) -> bool:
        return await self.results.record_failure(session, msg)

    async def verify_shard(self, shard_id: int) -> None:
        await self.verification.verify_shards([shard_id])

    async def verify_shards(self, shard_ids: Sequence[int]) -> None:
        await self.verification.verify_shards(shard_ids)

    async def judge_known_answers(self, *, limit: int = 100) -> int:
        return await self.verification.judge_known_answers(limit=limit)

    async def judge_late(self, *, limit: int = 100, task_ids: Sequence[int] | None = None) -> int:
        return await self.verification.judge_late(limit=limit, task_ids=task_ids)

    async def assemble(self, job_id: int) -> None:
        await self.verification.assemble(job_id)

    async def settle_stalled(self) -> int:
        return await self.stalemates.settle()

    # -- the volunteer's nodes -----------------------------------------------------------

    async def node_for(self, node_id: int, *, account_id: int, admin: bool) -> NodeRecord:
        """The node if `account_id` owns it or `admin`; NodeNotFound otherwise."""
        return await self.node_control.node_for(node_id, account_id=account_id, admin=admin)

    async def change_node_settings(
        self, node: NodeRecord, values: dict[str, Any], *, by: str
    ) -> list[str]:
        """Store settings set on the web and send them to the node (SettingRefused: none
        is stored); the names that changed."""
        return await self.node_control.change(node, values, by=by)

    # -- fan-out -------------------------------------------------------------------------

    async def enqueue(self, ready: Sequence[ReadyTask]) -> None:
        await self.fanout.enqueue(ready)

    async def send_cancels(self, held: Sequence[NodeTask], *, reason: str) -> None:
        await self.fanout.send_cancels(held, reason=reason)

    async def job_ended(self, job_id: int) -> None:
        await self.fanout.job_ended(job_id)

    async def publish(self, message: dict[str, Any]) -> None:
        """Tell the other coordinator processes (see `peers`)."""
        await self.fanout.publish(message)

    async def on_peer_message(self, message: dict[str, Any]) -> None:
        """Handle what another coordinator process published on the grid channel."""
        await peers.on_message(self.context, self.plans, message)
