"""Claims: a node takes ready tasks, atomically, within its trust and quota.

The `store.claims` role; each method is one transaction (store/database.py). A claim is a
conditional update (`WHERE state = 'ready'`) checked by its row count, so two claims of
one task, in one process or in several, cannot both win. Every claim goes through `claim`
(its standing, the claim, its count in the daily quota, in one transaction): one task
(`claim_task`), a batch of a replication-1 job's tasks (`claim_tasks`) and a backup copy
(`store.scheduling.add_backup_task`). How a shard's replication changes after its first
claim is store/replication.py's, part of this role.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from sqlalchemy import case, exists, func, or_, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.devtools import faults
from idlegrid.states import JobState, TaskState
from idlegrid.store import check_routing, dialect, rows
from idlegrid.store import trust as trust_rows
from idlegrid.store.base import Assignment, Claimer, ClaimMiss, Distinct, NodeTrust, ReadyTask
from idlegrid.store.database import read, retry_conflicts, write
from idlegrid.store.lifecycle import in_state, move
from idlegrid.store.replenish import replenish as top_up
from idlegrid.store.replication import Replication, give_back_attempts
from idlegrid.store.schema import jobs, nodes, shards, tasks
from idlegrid.store.writelock import urgent
from idlegrid.verification import trust as trust_policy
from idlegrid.verification.trust import TrustSettings

# Another task of the same shard. Made once: an alias copies the table's columns and
# foreign keys into reference cycles, garbage the collector would walk after every query.
OTHER = tasks.alias("other")
_RAN = rows.states(TaskState.ASSIGNED, TaskState.EXPIRED, TaskState.COMPLETED)
_CLAIMABLE = (TaskState.READY,)
# The failure reason of a claim given back before its node heard of it: it counts
# neither as an attempt of its shard nor in the node's daily quota.
RELEASED = "released: the node never heard of it"


async def standing(
    conn: AsyncConnection, claimer: Claimer, kind: str, *, trust: TrustSettings, now: float
) -> NodeTrust | ClaimMiss:
    """The claimer's trust on `kind`, or why it may claim nothing now."""
    suspended = (
        await conn.execute(select(nodes.c.suspended_at).where(nodes.c.id == claimer.node_id))
    ).scalar_one_or_none()
    found = await trust_rows.load_trust(
        conn, claimer.node_id, kind, claimer.backend, settings=trust, now=now
    )
    refused = trust_policy.claim_refused(
        found.trust, node_suspended=suspended is not None, used_today=found.quota_used_today
    )
    if refused is not None:
        return ClaimMiss(refused)
    return found


def held_by(claimer: Claimer, now: float) -> dict[str, Any]:
    """The values of a task claimed by `claimer`, besides its state and lease deadline."""
    return dict(
        node_id=claimer.node_id,
        account_id=claimer.account_id,
        network=claimer.network,
        backend=claimer.backend,
        build=claimer.build or None,
        assigned_at=now,
    )


async def claim(
    conn: AsyncConnection,
    claimer: Claimer,
    kind: str,
    take: Callable[[NodeTrust], Awaitable[Sequence[int]]],
    *,
    trust: TrustSettings,
    now: float,
) -> tuple[NodeTrust, list[int]] | ClaimMiss:
    """The one way a node claims tasks, inside the caller's transaction: its standing (a
    suspended node or one past its daily quota of `kind` claims nothing), the claim that
    `take` makes (it gets the node's trust and returns the ids of the tasks it claimed),
    and those claims counted in the node's daily quota. The count commits with the
    claims, or neither does: a coordinator killed between the two leaves no claim the
    quota misses (`claim-before-quota`, a fault point for the tests that prove it).
    """
    found = await standing(conn, claimer, kind, trust=trust, now=now)
    if isinstance(found, ClaimMiss):
        return found
    claimed = list(await take(found))
    if claimed:
        faults.point("claim-before-quota")
        await trust_rows.use_quota(
            conn, claimer.node_id, kind, claimer.backend, count=len(claimed), now=now
        )
    return found, claimed


async def _claim_batch(
    conn: AsyncConnection,
    lease_deadlines: dict[int, float],
    claimer: Claimer,
    found: NodeTrust,
    *,
    now: float,
) -> Sequence[int]:
    """`claim_tasks`'s one update: the ready ones of these tasks, as many as the node's
    quota leaves, lowest ids first; the ids it claimed."""
    # Its standing was checked: not suspended.
    room = trust_policy.claims_left(
        found.trust, node_suspended=False, used_today=found.quota_used_today
    )
    wanted = sorted(lease_deadlines)[:room]
    ready = [tasks.c.id.in_(wanted)]
    if dialect.row_locks(conn):
        # Tasks another process is claiming right now are skipped, not waited
        # for: its transaction may be a whole batch long, and they will be its
        # tasks anyway.
        free = select(tasks.c.id).where(*ready, in_state(tasks, *_CLAIMABLE))
        free = free.with_for_update(skip_locked=True, key_share=True)
        ready.append(tasks.c.id.in_(free.scalar_subquery()))
    deadlines = case({t: lease_deadlines[t] for t in wanted}, value=tasks.c.id)
    statement = move(
        tasks,
        TaskState.ASSIGNED,
        *ready,
        sources=_CLAIMABLE,
        **held_by(claimer, now),
        lease_deadline=deadlines,
    )
    return (await conn.execute(statement.returning(tasks.c.id))).scalars().all()


async def assigned(conn: AsyncConnection, task_ids: Sequence[int], *, now: float) -> list[Any]:
    """Rows of `rows.ASSIGNED_COLUMNS` for tasks just claimed; their jobs start running."""
    found = (
        await conn.execute(
            select(*rows.ASSIGNED_COLUMNS)
            .join(shards, shards.c.id == tasks.c.shard_id)
            .join(jobs, jobs.c.id == tasks.c.job_id)
            .where(tasks.c.id.in_(list(task_ids)))
            .order_by(tasks.c.id)
        )
    ).all()
    await conn.execute(
        move(
            jobs,
            JobState.RUNNING,
            jobs.c.id.in_({row.job_id for row in found}),
            sources=[JobState.QUEUED],
            started_at=now,
        )
    )
    return list(found)


def distinct_from(claimer: Claimer, distinct: Distinct | None) -> list[Any]:
    """Conditions for "no other replica of this shard on this node, account or network".

    A node never runs two replicas of a shard, even after one failed (it may fail the
    same way). A claim released before the node heard of it (`release_claims`) does not
    count: the node never ran it, and with as many nodes as replicas it would otherwise
    bar the only node left. Accounts and networks count only replicas that ran or run:
    a replica that failed or expired on one of them does not bar its other nodes. A check
    that caught a lie does not bar its node either (`rows.bars_nobody`).
    """
    if distinct is None:
        return []
    same = [(OTHER.c.node_id == claimer.node_id) & (OTHER.c.state != TaskState.CANCELLED.value)]
    counted = OTHER.c.state.in_(_RAN)
    if distinct.accounts:
        same.append(counted & (OTHER.c.account_id == claimer.account_id))
    if distinct.networks and claimer.network:
        same.append(counted & (OTHER.c.network == claimer.network))
    return [
        ~exists().where(
            OTHER.c.shard_id == tasks.c.shard_id,
            OTHER.c.id != tasks.c.id,
            or_(*same),
            ~rows.bars_nobody(OTHER),
        )
    ]


async def _others_out(conn: AsyncConnection, shard_id: int, task_id: int) -> int:
    """How many other tasks of the shard were handed to a node (none: a first replica)."""
    return int(
        (
            await conn.execute(
                select(func.count()).where(
                    OTHER.c.shard_id == shard_id,
                    OTHER.c.id != task_id,
                    OTHER.c.node_id.is_not(None),
                )
            )
        ).scalar_one()
    )


class Claims(Replication):
    """Ready tasks and their claims; how a shard's replication changes (`store.claims`)."""

    @read
    async def ready_tasks(self, conn: AsyncConnection, *, limit: int) -> list[ReadyTask]:
        query = (
            select(*rows.READY_COLUMNS)
            .join(jobs, jobs.c.id == tasks.c.job_id)
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(tasks.c.state == TaskState.READY.value)
            .order_by(tasks.c.id)
            .limit(limit)
        )
        return [rows.ready(row) for row in await conn.execute(query)]

    @write(retry_conflicts=True)
    async def claim_task(
        self,
        conn: AsyncConnection,
        task_id: int,
        claimer: Claimer,
        *,
        kind: str,
        lease_deadline: float,
        distinct: Distinct | None,
        now: float,
        check_build_wait_s: float | None = None,
    ) -> Assignment | ClaimMiss:
        """Hand a ready task to a node, atomically; `distinct` None: replication 1.

        `check_build_wait_s` (a kind whose checks count only on the output's build): not
        while the shard's check waits for a node of another build (`check_routing`).
        """
        conflict: list[ClaimMiss] = []

        async def take(found: NodeTrust) -> list[int]:
            claimed = await self._claim_one(
                conn,
                task_id,
                claimer,
                found,
                lease_deadline=lease_deadline,
                distinct=distinct,
                check_build_wait_s=check_build_wait_s,
                now=now,
            )
            if claimed:
                return [task_id]
            state = (
                await conn.execute(select(tasks.c.state).where(tasks.c.id == task_id))
            ).scalar_one_or_none()
            conflict.append(
                ClaimMiss.CONFLICT if state == TaskState.READY.value else ClaimMiss.GONE
            )
            return []

        outcome = await claim(conn, claimer, kind, take, trust=self.trust, now=now)
        if isinstance(outcome, ClaimMiss):
            return outcome
        found, claimed = outcome
        if not claimed:
            return conflict[0]
        [row] = await assigned(conn, claimed, now=now)
        first = row.mode is None and not await _others_out(conn, row.shard_id, task_id)
        return rows.assignment(row, lease_deadline, found.trust, first_replica=first)

    async def _claim_one(
        self,
        conn: AsyncConnection,
        task_id: int,
        claimer: Claimer,
        found: NodeTrust,
        *,
        lease_deadline: float,
        distinct: Distinct | None,
        check_build_wait_s: float | None,
        now: float,
    ) -> bool:
        """`claim_task`'s conditional update: whether it claimed the task."""
        if distinct is not None and dialect.row_locks(conn):
            # The "no replica on this node yet" check reads other rows: lock the shard
            # so two claims of its replicas for one node cannot both pass it.
            shard_of_task = select(tasks.c.shard_id).where(tasks.c.id == task_id)
            await conn.execute(
                select(shards.c.id)
                .where(shards.c.id == shard_of_task.scalar_subquery())
                .with_for_update(key_share=True)
            )
        where = [tasks.c.id == task_id]
        if dialect.row_locks(conn):
            # A task another transaction is claiming now is skipped, not waited for (its
            # claim may be a whole batch long, and it will most likely win): the caller
            # tries its next candidate at once, as `claim_tasks` does.
            free = select(tasks.c.id).where(*where, in_state(tasks, *_CLAIMABLE))
            free = free.with_for_update(skip_locked=True, key_share=True)
            where.append(tasks.c.id.in_(free.scalar_subquery()))
        where += distinct_from(claimer, distinct)
        if check_build_wait_s is not None:
            where.append(
                check_routing.waits_for_its_build(claimer.build, wait_s=check_build_wait_s, now=now)
            )
        if not trust_policy.is_trusted(found.trust, self.trust):
            where.append(tasks.c.trusted_only.is_(False))
        claimed = await conn.execute(
            move(
                tasks,
                TaskState.ASSIGNED,
                *where,
                sources=_CLAIMABLE,
                **held_by(claimer, now),
                lease_deadline=lease_deadline,
            )
        )
        return claimed.rowcount == 1

    @retry_conflicts
    async def claim_tasks(
        self,
        lease_deadlines: dict[int, float],
        claimer: Claimer,
        *,
        kind: str,
        now: float,
    ) -> list[Assignment] | ClaimMiss:
        """Claim those of these tasks (of one kind) still ready for one node, at once.

        No distinct-replica rules: for tasks of replication-1 jobs only. The node's daily
        quota of the kind caps how many (the lowest ids are tried first); a suspended node
        gets none.
        """
        if not lease_deadlines:
            return []
        # A node waits for this commit with free slots: ahead of background commits.
        with urgent():
            async with self.db.tx() as conn:

                async def take(found: NodeTrust) -> Sequence[int]:
                    return await _claim_batch(conn, lease_deadlines, claimer, found, now=now)

                outcome = await claim(conn, claimer, kind, take, trust=self.trust, now=now)
                if isinstance(outcome, ClaimMiss):
                    return outcome
                found, claimed = outcome
                if not claimed:
                    return []
                found_rows = await assigned(conn, claimed, now=now)
                return [
                    rows.assignment(row, lease_deadlines[row.id], found.trust) for row in found_rows
                ]

    @retry_conflicts
    async def release_claims(
        self, task_ids: Sequence[int], node_id: int, *, now: float
    ) -> list[int]:
        """Give back tasks claimed for a node that never heard of them (its connection
        closed first): cancelled, not attempts of their shards, not in its daily quota.
        Returns those released (still assigned to it); the shards are then topped up.

        Cancelled rather than made ready again: a backup copy released so is simply gone,
        and a shard short of a task gets a new one from the top-up.
        """
        if not task_ids:
            return []
        async with self.db.tx() as conn:
            released = (
                await conn.execute(
                    move(
                        tasks,
                        TaskState.CANCELLED,
                        tasks.c.id.in_(sorted(set(task_ids))),
                        tasks.c.node_id == node_id,
                        sources=[TaskState.ASSIGNED],
                        finished_at=now,
                        failure_reason=RELEASED,
                    ).returning(tasks.c.id, tasks.c.shard_id, tasks.c.backend, tasks.c.job_id)
                )
            ).all()
            if not released:
                return []
            per_shard: dict[int, int] = {}
            per_job: dict[int, list[Any]] = {}
            for row in released:
                per_shard[row.shard_id] = per_shard.get(row.shard_id, 0) + 1
                per_job.setdefault(row.job_id, []).append(row)
            await give_back_attempts(conn, per_shard)
            kinds = {
                row.id: row.kind
                for row in await conn.execute(
                    select(jobs.c.id, jobs.c.kind).where(jobs.c.id.in_(list(per_job)))
                )
            }
            used: dict[tuple[str, str], int] = {}
            for job_id, found in per_job.items():
                for row in found:
                    key = (kinds[job_id], row.backend or "cpu")
                    used[key] = used.get(key, 0) + 1
            for (kind, backend), count in sorted(used.items()):
                await trust_rows.give_back_quota(conn, node_id, kind, backend, count=count, now=now)
            return sorted(row.id for row in released)

    @write
    async def assign_check(
        self, conn: AsyncConnection, shard_id: int, task_id: int
    ) -> tuple[str, int] | None:
        """Make a task just claimed of a shard verified by checks the check of the shard's
        earliest output not found invalid (its hash and size); None: it has none, so the
        task makes the output."""
        row = (await conn.execute(check_routing.check_target(shard_id, task_id))).first()
        if row is None:
            return None
        await conn.execute(
            update(tasks).where(tasks.c.id == task_id).values(checks_hash=row.output_hash)
        )
        return str(row.output_hash), int(row.output_size or 0)

    @write
    async def make_known_answer(
        self, conn: AsyncConnection, task_id: int, *, planted_hash: str, known: str, now: float
    ) -> list[ReadyTask]:
        """Make a check task just claimed a known-answer check of `planted_hash` (a claim
        whose right verdict, `known`, the coordinator knows: `verification.probes`). It is
        no replica of its shard: not an attempt, and the shard gets its own check anew
        (returned, to queue)."""
        shard_id = (
            await conn.execute(
                update(tasks)
                .where(tasks.c.id == task_id, tasks.c.state == TaskState.ASSIGNED.value)
                .values(checks_hash=planted_hash, known_answer=known)
                .returning(tasks.c.shard_id)
            )
        ).scalar_one_or_none()
        if shard_id is None:
            return []
        await give_back_attempts(conn, {shard_id: 1})
        return (await top_up(conn, now=now, job_id=None, shard_id=shard_id)).ready
