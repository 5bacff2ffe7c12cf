"""The coordinator's core, as one facade: jobs in, tasks out, results verified, jobs assembled.

`Grid` wires the parts around one `Context` (settings, store, broker, blobs, hub, clock,
counters) and one fan-out, and is what the REST API, the WebSocket handler, the monitor,
the dashboard and the tests call. They ask it for the grid's work and never do it
themselves through its store, broker, hub or parts; they may read records for a response
through a store role (docs/architecture.md, "Callers of Grid"). Each concept lives in its
own module:

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
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, suppress
from random import Random
from typing import Any

from idlegrid import protocol
from idlegrid.blobs.files import BlobStore
from idlegrid.broker.base import Broker
from idlegrid.coordinator import metrics, peers
from idlegrid.coordinator.context import CHANNEL, Context, Counters, PresencePause
from idlegrid.coordinator.dispatch import Dispatcher
from idlegrid.coordinator.fanout import GridFanOut
from idlegrid.coordinator.fleet import Fleet
from idlegrid.coordinator.hub import Hub, NodeSession
from idlegrid.coordinator.intake import Intake, JobInputError
from idlegrid.coordinator.leader import Leadership
from idlegrid.coordinator.leases import Leases
from idlegrid.coordinator.matching import Matcher, Shares
from idlegrid.coordinator.node_control import NodeControl, NodeNotFound, SettingRefused
from idlegrid.coordinator.plans import JobPlan, Plans
from idlegrid.coordinator.result_path import ResultPath
from idlegrid.coordinator.round_driver import RoundDriver
from idlegrid.coordinator.stalemate import Stalemates
from idlegrid.coordinator.verifier import Verifier
from idlegrid.kinds import get_kind
from idlegrid.policy import sizing
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import Store
from idlegrid.store.base import (
    JobRecord,
    NodeRecord,
    NodeTask,
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
        self.context = _context(
            settings=settings, store=store, broker=broker, blobs=blobs, clock=clock
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
        self._registration_limits = _registration_limits(settings)

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
        """Draws of adaptive replication; a test may replace them."""
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

    async def wait_for_job(self, job_id: int, seconds: float) -> bool:
        """Wait until a commit or a job end in this process may have changed the job, or
        `seconds` passed; whether it was woken."""
        return await self.context.job_watch.wait(job_id, seconds)

    async def training_metrics(self, job: JobRecord) -> dict[str, Any] | None:
        """Per-round metrics of a training job; None: its kind does not run in rounds."""
        if not self.rounds.drives(get_kind(job.kind)):
            return None
        return await self.rounds.metrics(job)

    def set_swarm_peers(self, peers: tuple[str, ...], key: bytes = b"") -> None:
        """The bootstrap DHT peer is up (or given): its addresses and round key go into new
        rounds."""
        self.rounds.set_swarm_peers(peers, key)

    def task_progress(self) -> dict[int, float]:
        """Per shard, the progress its node here reported last (0 to 1)."""
        progress: dict[int, float] = {}
        for session in self.hub.sessions():
            progress.update(session.progress)
        return progress

    # -- dispatch and leases -------------------------------------------------------------

    async def fill(self, session: NodeSession) -> int:
        """Give a node as many tasks as it wants and can run; return how many it got."""
        return await self.dispatcher.fill(session)

    async def fill_waiting(self) -> None:
        """Offer queued work to every connected node that asked for some."""
        await self.dispatcher.fill_waiting()

    async def replenish(self) -> None:
        await self.leases.replenish()

    async def expire(self, expired: Sequence[NodeTask], *, why: str) -> None:
        """Requeue the shards of expired tasks; tell connected holders."""
        await self.leases.expire(expired, why=why)

    def offer_work(self) -> None:
        """Wake the dispatcher if a node here waits for work (a lost "work" message)."""
        self.dispatcher.offer_work()

    async def expire_overdue(self) -> int:
        """Overdue tasks lose their lease; their shards get new tasks. How many expired."""
        return await self.leases.expire_overdue()

    async def mark_silent_nodes_offline(self, *, leader: bool = True) -> int:
        """Close this process's connections to nodes not heard from within the timeout;
        the `leader` also records them offline and expires their tasks. How many."""
        now = self.clock()
        silent = await peers.silent_nodes(self.context, now=now)
        for node_id in silent:
            await peers.close_here(self.context, node_id)
            if leader:
                await self.leases.node_went_silent(node_id, now=now)
        return len(silent)

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

    async def judge_known_answers(self, *, limit: int = 100) -> int:
        return await self.verification.judge_known_answers(limit=limit)

    async def judge_late(self, *, limit: int = 100, task_ids: Sequence[int] | None = None) -> int:
        return await self.verification.judge_late(limit=limit, task_ids=task_ids)

    async def assemble(self, job_id: int) -> None:
        await self.verification.assemble(job_id)

    async def finish_pending(self) -> None:
        """Verify and assemble what a crash left between two steps; judge known answers
        and late results."""
        await self.verification.finish_pending()

    async def settle_stalled(self) -> int:
        return await self.stalemates.settle()

    async def close_due_rounds(self) -> int:
        """Training rounds whose timer ran out close with the updates that arrived."""
        return await self.rounds.close_due()

    # -- a node's connection ------------------------------------------------------------

    async def register_node(
        self,
        account_id: int,
        hello: protocol.Hello,
        *,
        kinds: Sequence[str],
        address: str,
        network: str,
    ) -> NodeRecord:
        """Register the node of a hello (or update it); RegistrationRefused past the
        Sybil limits (`policy.sybil`)."""
        node = await self.store.nodes.register_node(
            account_id,
            hello.node_key,
            name=hello.name,
            worker_version=hello.worker_version,
            hardware=hello.hardware.model_dump(),
            benchmark=hello.benchmark.model_dump(),
            kinds=list(kinds),
            slots=hello.slots,
            address=address,
            network=network,
            limits=self._registration_limits,
            now=self.clock(),
        )
        self.fleet.saw(node)
        return node

    async def reconcile(self, session: NodeSession, claimed: set[int]) -> set[int]:
        """Match the tasks a reconnecting node holds with the store's; those it must drop."""
        return await self.leases.reconcile(session, claimed)

    async def attach(self, session: NodeSession) -> None:
        """A node connected here: replace its older session, here or in another process."""
        await peers.attach(self.context, session)

    async def detach(self, session: NodeSession) -> bool:
        """A node's connection ended; False when a newer session had replaced it."""
        return await peers.detach(self.context, session)

    async def heard_from(self, session: NodeSession) -> None:
        """A message came from the node: it is present, connected to this process."""
        await peers.heard_from(self.context, session)

    def node_fetched(self, node_id: int, blob_hash: str, *, account_id: int) -> None:
        """A node of `account_id` connected here downloaded a blob: it holds it now (the
        scheduler's locality)."""
        session = self.hub.get(node_id)
        if session is not None and session.account_id == account_id:
            session.hold(blob_hash)

    def task_heard(self, node_id: int, task_id: int) -> tuple[float, str] | None:
        """A task's progress (0 to 1) and device as its node, connected here, reported
        them last; None when the node is not connected here or holds no such task."""
        session = self.hub.get(node_id)
        if session is None or task_id not in session.shard_of:
            return None
        progress = session.progress.get(session.shard_of[task_id], 0.0)
        return progress, session.device_of.get(task_id, "")

    def connected_here(self) -> int:
        """How many nodes are connected to this process."""
        return len(self.hub)

    async def close_connections(self) -> None:
        """Close every node's connection to this process (at shutdown; errors ignored)."""
        for session in self.hub.sessions():
            with suppress(Exception):
                await session.close()

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

    async def push_node_settings(self, node_id: int) -> None:
        """Send a node that just connected the settings set while it was away."""
        await self.node_control.push(node_id)

    async def node_status(self, session: NodeSession, status: protocol.Status) -> None:
        """Keep what a node said of its idle policy's turn, for every process."""
        await self.node_control.status(session, status)

    async def settings_reported(
        self, session: NodeSession, report: protocol.SettingsReport
    ) -> None:
        """Keep the settings a node reports it runs with (and its error)."""
        await self.node_control.reported(session, report)

    # -- this process among the others -------------------------------------------------

    async def recover(self) -> float:
        """Rebuild in-memory state from the store after a (re)start: the broker's ready
        queue, this start on record (results it makes late are paid), a timeout's grace
        for the nodes the store thinks online. Returns when it started."""
        # With a shared broker, another running process may have built the queue already;
        # refilling it anyway only re-adds what is there.
        await peers.rebuild_queue(self.context)
        now = self.clock()
        await self.verification.record_start(now=now)
        await peers.grace_online(self.context, now)
        return now

    async def check_broker(self) -> bool:
        """Rebuild the broker's contents from the store if it lost them (Redis restarted)."""
        return await peers.check_broker(self.context)

    async def sync_queue(self, *, limit: int) -> None:
        """Put the oldest ready tasks of the store into the broker's queue again."""
        await peers.sync_queue(self.context, limit=limit)

    async def record_presence(self) -> None:
        """Persist last-seen times (and uptime) of the nodes heard from."""
        await peers.record_presence(self.context)

    async def ready_count(self) -> int:
        """Tasks in the broker's ready queue."""
        return await self.broker.ready_count()

    async def metrics_text(self) -> str:
        """This process's Prometheus metrics, in the text exposition format."""
        return await metrics.render(self.context)

    def leadership(self) -> Leadership:
        """This process's claim on the monitor lease (`leader`)."""
        return Leadership(self.broker, self.process_id, lease_s=self.settings.leader_lease_s)

    def peer_messages(self) -> AbstractAsyncContextManager[AsyncIterator[dict[str, Any]]]:
        """Subscribed once entered: what the other coordinator processes publish."""
        return self.broker.subscribe(CHANNEL)

    async def on_peer_message(self, message: dict[str, Any]) -> None:
        """Handle what another coordinator process published on the grid channel."""
        await peers.on_message(self.context, self.plans, message)


def _context(
    *,
    settings: CoordinatorSettings,
    store: Store,
    broker: Broker,
    blobs: BlobStore,
    clock: Callable[[], float],
) -> Context:
    """The resources the parts share, one set per coordinator process."""
    return Context(
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


def _registration_limits(settings: CoordinatorSettings) -> RegistrationLimits:
    """The Sybil limits on new nodes (`policy.sybil`) the settings set."""
    return RegistrationLimits(
        max_nodes_per_account=settings.max_nodes_per_account,
        per_account_per_hour=settings.node_registrations_per_account_per_hour,
        per_address_per_hour=settings.node_registrations_per_address_per_hour,
    )
