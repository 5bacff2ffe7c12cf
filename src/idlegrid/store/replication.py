"""How a shard's replication changes after its first claim: the store's side of
`verification.replication` and of adaptive replication (`verification.trust`).

Part of the `store.claims` role (`Claims` takes these methods): a trusted node's first
replica may run alone or be spot-checked (`run_alone`), a disputed lone shard goes back
to full replication (`escalate`), an undecided shard asks one more result
(`raise_target`, `set_target`) or a larger quorum (`want_quorum`). Each method is one
transaction (store/database.py).
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlalchemy import exists, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import ShardState, TaskState
from idlegrid.store import dialect, ledger
from idlegrid.store.database import Role, write
from idlegrid.store.lifecycle import move
from idlegrid.store.schema import shards, tasks

# Another task of the same shard (made once: see store/claims.py).
OTHER = tasks.alias("other_replica")


async def give_back_attempts(conn: AsyncConnection, per_shard: Mapping[int, int]) -> None:
    """Tasks that were no attempt of their shards after all (released unheard-of,
    cancelled by adaptive replication, made known-answer checks): their shards' budgets
    (`max_attempts`) keep them for real retries."""
    for shard_id, count in sorted(per_shard.items()):
        if count:
            await conn.execute(
                update(shards)
                .where(shards.c.id == shard_id)
                .values(attempts=shards.c.attempts - count)
            )


async def _keep_checkers(conn: AsyncConnection, shard_id: int, checkers: int) -> list[int]:
    """A shard let run alone keeps `checkers` of its ready replicas, for trusted nodes only
    (spot checks), and cancels the others; returns those cancelled (none gave an attempt)."""
    ready = list(
        (
            await conn.execute(
                select(tasks.c.id)
                .where(tasks.c.shard_id == shard_id, tasks.c.state == TaskState.READY.value)
                .order_by(tasks.c.id)
            )
        )
        .scalars()
        .all()
    )
    keep, drop = ready[:checkers], ready[checkers:]
    if keep:
        await conn.execute(update(tasks).where(tasks.c.id.in_(keep)).values(trusted_only=True))
    if not drop:
        return []
    # Only what this update cancelled: another node may have claimed one of them since.
    cancelled = sorted(
        (
            await conn.execute(
                move(
                    tasks, TaskState.CANCELLED, tasks.c.id.in_(drop), sources=[TaskState.READY]
                ).returning(tasks.c.id)
            )
        )
        .scalars()
        .all()
    )
    await give_back_attempts(conn, {shard_id: len(cancelled)})
    return cancelled


class Replication(Role):
    """Changes of a shard's replication target, quorum and mode (part of `store.claims`)."""

    @write(retry_conflicts=True)
    async def run_alone(
        self,
        conn: AsyncConnection,
        shard_id: int,
        task_id: int,
        *,
        spot_check: bool,
        checkers: int = 1,
    ) -> list[int]:
        """Let the first replica of a shard run unreplicated (adaptive replication).

        With `spot_check`, `checkers` other replicas stay, for trusted nodes only. Returns the
        ready tasks cancelled (to drop from the queue); none if another replica was
        handed out meanwhile (then the shard stays fully replicated).

        Only a trusted node's first replica: a spot check by two `checkers` makes a
        colluding checker meet an honest one. Nothing is cancelled either when the
        shard's mode was already set.
        """
        if dialect.row_locks(conn):
            # A claim of another replica locks the shard (key share) until it commits; this
            # lock waits for it, so the check below sees that replica: the shard then stays
            # replicated, rather than run "alone" on two nodes.
            await conn.execute(select(shards.c.id).where(shards.c.id == shard_id).with_for_update())
        changed = await conn.execute(
            update(shards)
            .where(
                shards.c.id == shard_id,
                shards.c.state == ShardState.OPEN.value,
                shards.c.mode.is_(None),
                ~exists().where(
                    OTHER.c.shard_id == shard_id,
                    OTHER.c.id != task_id,
                    OTHER.c.node_id.is_not(None),
                ),
            )
            .values(
                target=1 + checkers if spot_check else 1,
                quorum=2 if spot_check else 1,
                mode="spot" if spot_check else "alone",
            )
        )
        if changed.rowcount != 1:
            return []
        return await _keep_checkers(conn, shard_id, checkers if spot_check else 0)

    @write
    async def escalate(
        self,
        conn: AsyncConnection,
        shard_id: int,
        *,
        target: int,
        quorum: int,
        now: float,
    ) -> bool:
        """Send a shard run alone back to full replication (a spot check disagreed); its
        lone node runs nothing alone until it passes checks again.
        """
        lone = (
            (
                await conn.execute(
                    select(tasks.c.id).where(
                        tasks.c.shard_id == shard_id,
                        tasks.c.state == TaskState.COMPLETED.value,
                        tasks.c.trusted_only.is_(False),  # the spot check's task is trusted-only
                    )
                )
            )
            .scalars()
            .all()
        )
        changed = await conn.execute(
            update(shards)
            .where(
                shards.c.id == shard_id,
                shards.c.state == ShardState.OPEN.value,
                shards.c.mode.in_(["alone", "spot"]),
            )
            .values(target=target, quorum=quorum, mode="escalated")
        )
        if changed.rowcount == 1:
            # A spot check still waiting for a trusted node may go to anyone now.
            await conn.execute(
                update(tasks)
                .where(tasks.c.shard_id == shard_id, tasks.c.state == TaskState.READY.value)
                .values(trusted_only=False)
            )
            for task_id in lone:
                await ledger.suspect(conn, task_id, settings=self.trust, now=now)
        return changed.rowcount == 1

    @write
    async def raise_target(
        self, conn: AsyncConnection, shard_id: int, *, results_seen: int
    ) -> bool:
        """One more result for an open shard whose results so far did not decide it."""
        changed = await conn.execute(
            update(shards)
            .where(
                shards.c.id == shard_id,
                shards.c.state == ShardState.OPEN.value,
                shards.c.target <= results_seen,
            )
            .values(target=shards.c.target + 1)
        )
        return changed.rowcount == 1

    @write
    async def set_target(self, conn: AsyncConnection, shard_id: int, *, target: int) -> bool:
        """An open shard verified by checks asks for `target` results: those that still
        count and one more task (its next check, or a new output after a lie)."""
        changed = await conn.execute(
            update(shards)
            .where(shards.c.id == shard_id, shards.c.state == ShardState.OPEN.value)
            .values(target=target)
        )
        return changed.rowcount == 1

    @write
    async def want_quorum(self, conn: AsyncConnection, shard_id: int, *, quorum: int) -> bool:
        """Raise an open shard's quorum to `quorum` (a checked shard drawn for a second
        pass: `verification.probes.wants_second_pass`); never lowers it."""
        changed = await conn.execute(
            update(shards)
            .where(
                shards.c.id == shard_id,
                shards.c.state == ShardState.OPEN.value,
                shards.c.quorum < quorum,
            )
            .values(quorum=quorum)
        )
        return changed.rowcount == 1
