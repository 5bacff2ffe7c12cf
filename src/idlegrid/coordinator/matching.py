"""The scheduler's I/O side: what the pure policy is fed, and what its decisions do.

`Matcher` turns ready-queue entries into scheduler candidates (with the job's
requirements, the account's fair-share factor and the job's inputs for locality), keeps
the fair-share usage ledger, finds speculative backup copies for idle nodes, and says why
a job is waiting (`waiting_for`). `Shares` maps the configured shares of accounts to ids.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence

from idlegrid import protocol
from idlegrid.coordinator.context import Context
from idlegrid.coordinator.fleet import Fleet, fleet_node
from idlegrid.coordinator.hub import NodeSession, node_view
from idlegrid.coordinator.leases import lease_for
from idlegrid.coordinator.plans import JobPlan, Plans
from idlegrid.policy import fairshare, scheduler
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import Store
from idlegrid.store.base import (
    Assignment,
    JobRecord,
    ReadyTask,
    RunningTask,
)

log = logging.getLogger(__name__)

# Oldest ready tasks of each job read from the store when the broker's window of
# candidates is full (a big job's tasks would otherwise hide every later job's).
HEADS_PER_JOB = 4
# How long a store read of job heads or of running shards is reused (seconds).
SCAN_TTL_S = 1.0
RUNNING_SCAN_LIMIT = 256


def weights_from(settings: CoordinatorSettings) -> scheduler.Weights:
    """The score's weights from `IDLEGRID_SCHED_*` settings."""
    return scheduler.Weights(
        priority=settings.sched_priority_weight,
        age=settings.sched_age_weight,
        age_scale_s=settings.sched_age_scale_s,
        fair_share=settings.sched_fair_share_weight,
        speed=settings.sched_speed_weight,
        speed_scale_s=settings.sched_speed_scale_s,
        locality=settings.sched_locality_weight,
        affinity=settings.sched_affinity_weight,
        reliability=settings.sched_reliability_weight,
        on_time=settings.sched_on_time_weight,
    )


def holder_view(benchmark: dict[str, object]) -> scheduler.NodeView:
    """Enough of a node, from its stored benchmark, to estimate its run times."""
    try:
        parsed = protocol.read_stored(protocol.Benchmark, benchmark)
    except ValueError:
        parsed = protocol.Benchmark()
    return node_view(0, (), protocol.HardwareProfile(), parsed)


def node_reliability(session: NodeSession) -> float:
    """How far the scheduler trusts this node's results, 0..1 (0.5: nothing known).

    Its credibility (verification.trust) on the kind of its last claim, as of that claim;
    unknown until its first claim.
    """
    return session.reliability if session.reliability is not None else 0.5


class Shares:
    """Fair shares of accounts by id, from the configured shares by account name."""

    def __init__(self, store: Store, configured: Mapping[str, float]) -> None:
        self._store = store
        self.share_of: dict[int, float] = {}  # account id -> share, as names resolve
        self._unresolved = dict(configured)

    async def resolve(self) -> None:
        """Map configured account names to ids (accounts may be created later)."""
        for name, share in list(self._unresolved.items()):
            account = await self._store.accounts.get_account(name)
            if account is not None:
                self.share_of[account.id] = share
                del self._unresolved[name]


class Matcher:
    def __init__(self, ctx: Context, *, plans: Plans, shares: Shares) -> None:
        self._ctx = ctx
        self._plans = plans
        self._shares = shares
        self.weights = weights_from(ctx.settings)
        self.usage = fairshare.UsageLedger(half_life_s=ctx.settings.fair_share_half_life_s)
        self._heads: tuple[float, list[ReadyTask]] = (float("-inf"), [])
        self._running: tuple[float, list[RunningTask]] = (float("-inf"), [])
        self._usage_at: tuple[float, dict[int, float]] = (float("-inf"), {})
        # job id -> {shard id: the node that holds state for that shard} (affinity)
        self._preferred: dict[int, dict[int, int]] = {}
        # Task ids a claim of this process is taking now: other nodes' claims rank the
        # rest rather than queue behind that transaction for the same rows.
        self.in_flight: set[int] = set()

    @property
    def share_of(self) -> Mapping[int, float]:
        """Account id -> configured share, for the accounts that exist."""
        return self._shares.share_of

    # -- candidates --------------------------------------------------------------------

    async def entries(self, limit: int) -> list[ReadyTask]:
        """Ready-queue entries to rank: the oldest, plus every job's first few."""
        entries = await self._ctx.broker.ready_candidates(limit=limit)
        if len(entries) < limit:
            return entries
        now = self._ctx.clock()
        if now - self._heads[0] > SCAN_TTL_S:
            self._heads = (now, await self._ctx.store.scheduling.ready_heads(per_job=HEADS_PER_JOB))
        seen = {entry.task_id for entry in entries}
        return entries + [head for head in self._heads[1] if head.task_id not in seen]

    @contextlib.contextmanager
    def claiming(self, task_ids: Sequence[int]) -> Iterator[None]:
        """Mark these tasks as being claimed by this process while the block runs."""
        ids = set(task_ids) - self.in_flight
        self.in_flight |= ids
        try:
            yield
        finally:
            self.in_flight -= ids

    def invalidate(self) -> None:
        """New ready tasks: read the job heads again at the next claim."""
        self._heads = (float("-inf"), [])

    def forget_entry(self, task_id: int) -> None:
        """A cached head was claimed or is gone."""
        at, heads = self._heads
        self._heads = (at, [head for head in heads if head.task_id != task_id])

    def candidate(self, entry: ReadyTask, plan: JobPlan, *, now: float) -> scheduler.Candidate:
        if self._usage_at[0] != now:  # one snapshot per claim, not per candidate
            self._usage_at = (now, self.usage.snapshot(now=now))
        fair = fairshare.factor(self._usage_at[1], self._shares.share_of, plan.account_id)
        return scheduler.Candidate(
            task_id=entry.task_id,
            job_id=entry.job_id,
            kind=entry.kind,
            priority=entry.priority,
            created_at=entry.created_at,
            requirements=plan.requirements,
            account_id=plan.account_id,
            items=entry.items,
            cost_flops=entry.cost_flops,
            replication=plan.replication,
            input_hashes=plan.inputs,
            fair_share=fair,
            preferred_node=self._preferred.get(entry.job_id, {}).get(entry.shard_id),
        )

    def prefer(self, job_id: int, nodes: Mapping[int, int]) -> None:
        """Prefer these nodes for these shards of a job ({shard id: node id}), replacing
        the job's earlier preferences (a training round's shards replace the last's)."""
        self._preferred[job_id] = dict(nodes)

    def forget_preferences(self, job_id: int) -> None:
        self._preferred.pop(job_id, None)

    def claimed(
        self,
        session: NodeSession,
        assignment: Assignment,
        plan: JobPlan,
        cost_flops: float,
        *,
        now: float,
    ) -> None:
        """Book a claim: the account's usage, and the blob the node will fetch."""
        self.usage.add(plan.account_id, cost_flops, now=now)
        self._usage_at = (float("-inf"), {})
        session.hold(assignment.input_hash)
        self.forget_entry(assignment.task_id)

    # -- speculative backups ---------------------------------------------------------------

    async def claim_backup(self, session: NodeSession) -> Assignment | None:
        """Give an idle node a copy of a straggling shard near its job's end, if worth it."""
        now = self._ctx.clock()
        if now - self._running[0] > SCAN_TTL_S:
            found = await self._ctx.store.scheduling.running_shards(limit=RUNNING_SCAN_LIMIT)
            self._running = (now, found)
        running = await self._running_shards(session, self._running[1], now=now)
        view = session.view_now(reliability=node_reliability(session))
        settings = self._ctx.settings
        pick = scheduler.pick_backup(
            view,
            running,
            now=now,
            factor=settings.backup_factor,
            min_gain_s=settings.backup_min_gain_s,
        )
        if pick is None:
            return None
        lease = lease_for(
            settings,
            pick.kind,
            cost_flops=pick.cost_flops,
            measured_flops=session.measured_flops.get(pick.kind),
        )
        assignment = await self._ctx.store.scheduling.add_backup_task(
            pick.shard_id,
            session.node_id,
            lease_deadline=now + lease,
            now=now,
            backend=session.backend,
        )
        at, rows = self._running
        self._running = (at, [row for row in rows if row.shard_id != pick.shard_id])
        if assignment is not None:
            log.info(
                "shard %s: backup task %s on node %s (straggler)",
                pick.shard_id,
                assignment.task_id,
                session.node_id,
            )
            self._ctx.counters.backups += 1
        return assignment

    async def _running_shards(
        self, session: NodeSession, rows: Sequence[RunningTask], *, now: float
    ) -> list[scheduler.RunningShard]:
        out = []
        for row in rows:
            plan = await self._plans.get(row.job_id)
            if plan is None or row.node_id == session.node_id or not plan.kind.backups:
                continue
            holder = self._ctx.hub.get(row.node_id)
            view = holder.view if holder is not None else holder_view(row.node_benchmark)
            expected = scheduler.expected_seconds(
                view, row.kind, items=row.items, cost_flops=row.cost_flops
            )
            progress = holder.progress.get(row.shard_id) if holder is not None else None
            out.append(
                scheduler.RunningShard(
                    shard_id=row.shard_id,
                    job_id=row.job_id,
                    kind=row.kind,
                    items=row.items,
                    cost_flops=row.cost_flops,
                    requirements=plan.requirements,
                    holder_finish_at=scheduler.holder_finish_at(
                        row.assigned_at, expected, now=now, progress=progress
                    ),
                )
            )
        return out

    # -- job status ----------------------------------------------------------------------

    async def waiting_for(self, job: JobRecord, *, fleet: Fleet | None = None) -> list[str]:
        """Why an unfinished job cannot progress (empty when nothing stops it).

        `fleet`: the snapshot of registered nodes to judge by; else every node is read
        from the store.
        """
        if job.state.value not in ("queued", "running"):
            return []
        plan = await self._plans.get(job.id)
        if plan is None:
            return []
        if fleet is not None:
            reason = await fleet.unmet(plan.requirements, job.kind)
        else:
            found = [fleet_node(node) for node in await self._ctx.store.nodes.list_nodes()]
            views = [node.view for node in found if node.view is not None]
            reason = scheduler.unmet(plan.requirements, job.kind, views)
        return [reason] if reason else []
