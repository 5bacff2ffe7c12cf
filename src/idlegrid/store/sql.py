"""`SqlStore`: the store interface on SQLAlchemy 2 (async): SQLite or PostgreSQL.

State changes are conditional updates (`UPDATE ... WHERE state = ...`) checked by their
row count: a claim, a decision or an expiry that lost a race changes nothing, in one
process or across several sharing a PostgreSQL database (a conditional update re-checks
its condition after waiting for a concurrent writer, also under READ COMMITTED). What a
single update cannot decide alone (how many tasks a shard still needs) takes row locks
on PostgreSQL. SQLite allows one writer at a time, so on SQLite this process serializes
its write transactions with an asyncio lock instead of spinning on "database is locked".
SQLite URLs normally name the store's own driver, `sqlite+idlegrid` (`sqlite_driver.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy import (
    Float,
    and_,
    bindparam,
    case,
    event,
    exists,
    func,
    insert,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from idlegrid.policy import trust as trust_policy
from idlegrid.policy.trust import Trust, TrustSettings
from idlegrid.states import (
    LIVE_TASK_STATES,
    JobState,
    NodeState,
    ShardState,
    TaskState,
    check_transition,
    sources_of,
)
from idlegrid.store import ledger, scheduling
from idlegrid.store import sqlite_driver as _sqlite_driver  # noqa: F401  registers sqlite+idlegrid
from idlegrid.store.base import (
    AccountExists,
    AccountRecord,
    Assignment,
    Claimer,
    ClaimMiss,
    DecisionOutcome,
    Distinct,
    JobRecord,
    LateResult,
    NewJob,
    NewResult,
    NodeRecord,
    NodeTask,
    NodeTrust,
    ReadyTask,
    RegistrationLimits,
    RegistrationRefused,
    ResultReceipt,
    RunningTask,
    ShardDecision,
    ShardForVerify,
    ShardRecord,
    ShardResult,
    TaskInput,
    TokenInfo,
)
from idlegrid.store.rounds import TrainingRoundsSql
from idlegrid.store.schema import accounts, jobs, node_trust, nodes, shards, tasks, tokens
from idlegrid.store.web import DashboardSql
from idlegrid.store.writelock import WriteLock, urgent

_LIVE = tuple(state.value for state in LIVE_TASK_STATES)
_HELD = (TaskState.ASSIGNED.value, TaskState.EXPIRED.value)
# PostgreSQL aborts one side of a deadlock (40P01) or a serialization conflict (40001);
# the transaction it rolled back is safe to run again.
_RETRY_SQLSTATES = frozenset({"40P01", "40001"})
_RETRIES = 4
# Any fixed number: the key of the advisory lock that serializes migrations.
_MIGRATION_LOCK = 0x1D1E
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_TOUCH_CHUNK = 500  # nodes per presence statement
# Another task of the same shard. Made once: an alias copies the table's columns and
# foreign keys into reference cycles, garbage the collector would walk after every query.
_OTHER = tasks.alias("other")


@dataclass
class _Batch:
    """The running `SqlStore.batch`: its transaction, opened by the first call inside."""

    stack: contextlib.AsyncExitStack
    conn: AsyncConnection | None = None
    # What the caller does once the batch committed (`SqlStore.after_commit`).
    after_commit: list[Callable[[], Awaitable[None]]] = field(default_factory=list)


_BATCH: ContextVar[_Batch | None] = ContextVar("idlegrid_store_batch", default=None)

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


def _states(*states: Any) -> list[str]:
    return [s.value for s in states]


def _retry_conflicts(
    method: Callable[Concatenate[SqlStore, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[SqlStore, P], Coroutine[Any, Any, R]]:
    """Run a one-transaction method again when PostgreSQL aborted it for a deadlock."""

    @functools.wraps(method)
    async def wrapper(self: SqlStore, *args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(_RETRIES):
            try:
                return await method(self, *args, **kwargs)
            except DBAPIError as exc:
                sqlstate = getattr(exc.orig, "sqlstate", None)
                if sqlstate not in _RETRY_SQLSTATES or attempt == _RETRIES - 1:
                    raise
                await asyncio.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    return wrapper


class SqlStore(TrainingRoundsSql, DashboardSql):
    """Durable state in one SQL database (SQLite file or PostgreSQL)."""

    def __init__(
        self,
        url: str,
        *,
        schema: str = "",
        echo: bool = False,
        trust: TrustSettings | None = None,
    ) -> None:
        """`schema`: PostgreSQL schema to use (made on `open`); empty: the default.

        `trust`: the policy the store applies to trust rows when it records verdicts.
        """
        self.url = url
        self.trust = trust or TrustSettings()
        self.schema = schema
        is_postgres = make_url(url).get_backend_name() == "postgresql"
        connect_args: dict[str, Any] = {}
        if schema:
            if not is_postgres or not _SCHEMA_NAME.fullmatch(schema):
                raise ValueError(f"schema {schema!r}: a lower-case SQL name, PostgreSQL only")
            connect_args["server_settings"] = {"search_path": schema}
        # A coordinator runs many short transactions at once: a pool big enough that they
        # seldom open (and close) overflow connections, which costs more than the query.
        pool = {"pool_size": 10, "max_overflow": 20} if is_postgres else {}
        self.engine: AsyncEngine = create_async_engine(
            url, echo=echo, connect_args=connect_args, **pool
        )
        self.is_sqlite = self.engine.dialect.name == "sqlite"
        self.serial_commits = self.is_sqlite
        self._write_lock = WriteLock() if self.is_sqlite else None
        if self.is_sqlite:
            event.listen(self.engine.sync_engine, "connect", _sqlite_pragmas)

    async def open(self) -> None:
        """Bring the schema to the newest migration (one process at a time on PostgreSQL)."""
        from idlegrid.store.migrate import upgrade

        async with self.engine.begin() as conn:
            if not self.is_sqlite:
                # Coordinators starting together would otherwise race to create tables.
                await conn.execute(text(f"SELECT pg_advisory_xact_lock({_MIGRATION_LOCK})"))
                if self.schema:
                    await conn.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{self.schema}"'))
            await conn.run_sync(upgrade)

    async def close(self) -> None:
        await self.engine.dispose()

    @contextlib.asynccontextmanager
    async def batch(self) -> AsyncIterator[None]:
        """Run the store calls made inside in one transaction, committed once at the end.

        On SQLite every commit waits for an fsync, one at a time behind the write lock: a
        batch of claims or results pays it once. All or nothing: if anything inside
        raises, every write of the batch is rolled back. The transaction (and the write
        lock) starts with the first call inside; reads after it see the batch's writes.
        On PostgreSQL, whose commits run side by side, calls keep their own transactions.
        """
        if self._write_lock is None or _BATCH.get() is not None:
            yield
            return
        batch = _Batch(contextlib.AsyncExitStack())
        async with batch.stack:
            token = _BATCH.set(batch)
            try:
                yield
            finally:
                _BATCH.reset(token)
        for action in batch.after_commit:
            try:
                await action()
            except Exception:  # committed: one failed follow-up must not undo the rest
                log.exception("after-commit action of a store batch failed")

    async def after_commit(self, action: Callable[[], Awaitable[None]]) -> None:
        """Run `action` once what the caller wrote is committed: at the end of the running
        `batch` (dropped if the batch rolls back), or now outside one."""
        batch = _BATCH.get()
        if batch is not None:
            batch.after_commit.append(action)
        else:
            await action()

    @contextlib.asynccontextmanager
    async def _tx(self) -> AsyncIterator[AsyncConnection]:
        batch = _BATCH.get()
        if batch is not None:
            if batch.conn is None:
                assert self._write_lock is not None
                await batch.stack.enter_async_context(self._write_lock)
                batch.conn = await batch.stack.enter_async_context(self.engine.begin())
            yield batch.conn
            return
        if self._write_lock is None:
            async with self.engine.begin() as conn:
                yield conn
            return
        async with self._write_lock, self.engine.begin() as conn:
            yield conn

    @contextlib.asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        batch = _BATCH.get()
        if batch is not None and batch.conn is not None:
            yield batch.conn
            return
        async with self.engine.connect() as conn:
            yield conn

    # -- accounts and tokens ------------------------------------------------------------

    async def create_account(self, name: str, *, is_admin: bool, now: float) -> AccountRecord:
        try:
            async with self._tx() as conn:
                result = await conn.execute(
                    insert(accounts).values(name=name, is_admin=is_admin, created_at=now)
                )
                return AccountRecord(id=_pk(result), name=name, is_admin=is_admin)
        except IntegrityError as exc:
            raise AccountExists(f"an account named {name!r} exists") from exc

    async def get_account(self, name: str) -> AccountRecord | None:
        async with self._read() as conn:
            row = (await conn.execute(select(accounts).where(accounts.c.name == name))).first()
        return _account(row) if row else None

    async def account_by_id(self, account_id: int) -> AccountRecord | None:
        async with self._read() as conn:
            row = (await conn.execute(select(accounts).where(accounts.c.id == account_id))).first()
        return _account(row) if row else None

    async def count_accounts(self) -> int:
        async with self._read() as conn:
            return int(
                (await conn.execute(select(func.count()).select_from(accounts))).scalar_one()
            )

    async def add_token(
        self, account_id: int, *, kind: str, token_hash: str, prefix: str, label: str, now: float
    ) -> int:
        async with self._tx() as conn:
            result = await conn.execute(
                insert(tokens).values(
                    account_id=account_id,
                    kind=kind,
                    token_hash=token_hash,
                    prefix=prefix,
                    label=label,
                    created_at=now,
                )
            )
            return _pk(result)

    async def find_token(self, token_hash: str) -> TokenInfo | None:
        query = (
            select(
                tokens.c.id,
                tokens.c.kind,
                accounts.c.id.label("account_id"),
                accounts.c.name,
                accounts.c.is_admin,
            )
            .join(accounts, accounts.c.id == tokens.c.account_id)
            .where(tokens.c.token_hash == token_hash, tokens.c.revoked_at.is_(None))
        )
        async with self._read() as conn:
            row = (await conn.execute(query)).first()
        if row is None:
            return None
        return TokenInfo(
            token_id=row.id,
            account_id=row.account_id,
            account_name=row.name,
            kind=row.kind,
            is_admin=row.is_admin,
        )

    # -- nodes ----------------------------------------------------------------------------

    async def register_node(
        self,
        account_id: int,
        node_key: str,
        *,
        name: str,
        worker_version: str,
        hardware: dict[str, Any],
        benchmark: dict[str, Any],
        kinds: list[str],
        slots: int,
        address: str,
        now: float,
        network: str = "",
        limits: RegistrationLimits | None = None,
    ) -> NodeRecord:
        values = dict(
            name=name,
            worker_version=worker_version,
            hardware=hardware,
            benchmark=benchmark,
            kinds=kinds,
            slots=slots,
            address=address,
            network=network,
            last_seen_at=now,
            state=NodeState.ONLINE.value,
        )
        upsert = postgresql.insert if not self.is_sqlite else sqlite.insert
        async with self._tx() as conn:
            known = (
                await conn.execute(select(nodes.c.id).where(nodes.c.node_key == node_key))
            ).first()
            if known is None and limits is not None:
                await self._check_new_node(conn, account_id, address, limits, now=now)
            # INSERT .. ON CONFLICT: two processes registering one new node both succeed.
            inserted = await conn.execute(
                upsert(nodes)
                .values(
                    account_id=account_id,
                    node_key=node_key,
                    created_at=now,
                    connected_seconds=0.0,
                    **values,
                )
                .on_conflict_do_nothing(index_elements=[nodes.c.node_key])
            )
            if inserted.rowcount != 1:
                updated = await conn.execute(
                    update(nodes)
                    .where(nodes.c.node_key == node_key, nodes.c.account_id == account_id)
                    .values(**values)
                )
                if updated.rowcount != 1:
                    raise RegistrationRefused("this node key belongs to another account")
            row = (await conn.execute(select(nodes).where(nodes.c.node_key == node_key))).one()
        return _node(row)

    @staticmethod
    async def _check_new_node(
        conn: AsyncConnection,
        account_id: int,
        address: str,
        limits: RegistrationLimits,
        *,
        now: float,
    ) -> None:
        """Sybil limits on a new node (checked, not locked: two racing registrations
        may both pass the last free place, which bounds the excess to the races)."""
        flagged = (
            await conn.execute(
                select(accounts.c.flag_reason).where(
                    accounts.c.id == account_id, accounts.c.flagged_at.is_not(None)
                )
            )
        ).first()
        if flagged is not None:
            raise RegistrationRefused(
                f"this account is flagged ({flagged.flag_reason}); it cannot add nodes"
            )

        async def count(*where: Any) -> int:
            query = select(func.count()).select_from(nodes).where(*where)
            return int((await conn.execute(query)).scalar_one())

        hour_ago = now - 3600.0
        if await count(nodes.c.account_id == account_id) >= limits.max_nodes_per_account:
            raise RegistrationRefused(
                f"this account has {limits.max_nodes_per_account} nodes, the most allowed"
            )
        recent = await count(nodes.c.account_id == account_id, nodes.c.created_at > hour_ago)
        if recent >= limits.per_account_per_hour:
            raise RegistrationRefused(
                f"this account registered {recent} nodes in the last hour "
                f"(limit {limits.per_account_per_hour}); try again later"
            )
        if address:
            recent = await count(nodes.c.address == address, nodes.c.created_at > hour_ago)
            if recent >= limits.per_address_per_hour:
                raise RegistrationRefused(
                    f"{recent} nodes registered from {address} in the last hour "
                    f"(limit {limits.per_address_per_hour}); try again later"
                )

    async def set_node_offline(self, node_id: int, *, now: float) -> None:
        async with self._tx() as conn:
            await conn.execute(
                update(nodes)
                .where(nodes.c.id == node_id, nodes.c.state == NodeState.ONLINE.value)
                .values(state=NodeState.OFFLINE.value, last_seen_at=now)
            )

    async def touch_nodes(self, seen: dict[int, float]) -> None:
        """Record last-seen times and add the time since the previous touch to uptime."""
        if not seen:
            return
        # One statement executed for many rows: a fleet's presence in one round trip.
        at = bindparam("at", type_=Float)
        touch = (
            update(nodes)
            .where(nodes.c.id == bindparam("node"), nodes.c.last_seen_at < at)
            .values(
                # Gaps longer than a minute were time away, not uptime.
                connected_seconds=nodes.c.connected_seconds
                + case((at - nodes.c.last_seen_at > 60.0, 0.0), else_=at - nodes.c.last_seen_at),
                last_seen_at=at,
            )
        )
        rows = [{"node": node, "at": t} for node, t in seen.items()]
        async with self._tx() as conn:
            # In chunks: binding a whole fleet's rows at once would hold the event loop.
            for start in range(0, len(rows), _TOUCH_CHUNK):
                await conn.execute(touch, rows[start : start + _TOUCH_CHUNK])

    async def list_nodes(self, account_id: int | None = None) -> list[NodeRecord]:
        query = select(nodes).order_by(nodes.c.id)
        if account_id is not None:
            query = query.where(nodes.c.account_id == account_id)
        async with self._read() as conn:
            return [_node(row) for row in await conn.execute(query)]

    async def node_tasks(self, node_id: int) -> list[NodeTask]:
        query = select(tasks.c.id, tasks.c.state).where(
            tasks.c.node_id == node_id, tasks.c.state.in_(_HELD)
        )
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        return [NodeTask(task_id=r.id, node_id=node_id, state=TaskState(r.state)) for r in rows]

    async def state_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        async with self._read() as conn:
            by_state = [
                {
                    state: count
                    for state, count in (
                        await conn.execute(
                            select(table.c.state, func.count()).group_by(table.c.state)
                        )
                    ).all()
                }
                for table in (tasks, jobs)
            ]
        return by_state[0], by_state[1]

    # -- jobs -----------------------------------------------------------------------------

    async def create_job(self, job: NewJob, *, now: float) -> tuple[JobRecord, list[ReadyTask]]:
        async with self._tx() as conn:
            job_id = _pk(
                await conn.execute(
                    insert(jobs).values(
                        account_id=job.account_id,
                        kind=job.kind,
                        params=job.params,
                        inputs=job.inputs,
                        state=JobState.QUEUED.value,
                        replication=job.replication,
                        min_quorum=job.min_quorum,
                        max_attempts=job.max_attempts,
                        priority=job.priority,
                        shards_total=len(job.shards),
                        items_total=sum(s.items for s in job.shards),
                        created_at=now,
                    )
                )
            )
            await conn.execute(
                insert(shards),
                [
                    dict(
                        job_id=job_id,
                        idx=s.index,
                        state=ShardState.OPEN.value,
                        input_hash=s.input_hash,
                        input_size=s.input_size,
                        item_count=s.items,
                        cost_flops=s.cost_flops,
                        attempts=0,
                        target=job.replication,
                        quorum=job.min_quorum,
                    )
                    for s in job.shards
                ],
            )
            ready = await self._replenish_in(conn, now=now, job_id=job_id)
            record = await self._job(conn, job_id)
        assert record is not None
        return record, ready[0]

    async def get_job(self, job_id: int) -> JobRecord | None:
        async with self._read() as conn:
            return await self._job(conn, job_id)

    async def list_jobs(
        self, account_id: int | None, *, limit: int, offset: int
    ) -> list[JobRecord]:
        query = select(jobs.c.id).order_by(jobs.c.id.desc()).limit(limit).offset(offset)
        if account_id is not None:
            query = query.where(jobs.c.account_id == account_id)
        async with self._read() as conn:
            ids = (await conn.execute(query)).scalars().all()
            return [job for i in ids if (job := await self._job(conn, i)) is not None]

    async def list_shards(self, job_id: int) -> list[ShardRecord]:
        live = (
            select(func.count())
            .where(tasks.c.shard_id == shards.c.id, tasks.c.state.in_(_LIVE))
            .scalar_subquery()
        )
        query = select(shards, live.label("live")).where(shards.c.job_id == job_id)
        async with self._read() as conn:
            rows = (await conn.execute(query.order_by(shards.c.idx))).all()
        return [_shard(row, live=row.live) for row in rows]

    async def cancel_job(self, job_id: int, *, now: float) -> list[NodeTask]:
        return await self._end_job(job_id, JobState.CANCELLED, error=None, now=now)

    async def fail_job(self, job_id: int, *, error: str, now: float) -> list[NodeTask]:
        return await self._end_job(job_id, JobState.FAILED, error=error, now=now)

    @_retry_conflicts
    async def _end_job(
        self, job_id: int, target: JobState, *, error: str | None, now: float
    ) -> list[NodeTask]:
        async with self._tx() as conn:
            changed = await conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.state.in_(_states(*sources_of(target))))
                .values(state=target.value, error=error, finished_at=now)
            )
            if changed.rowcount != 1:
                return []
            shard_target = (
                ShardState.CANCELLED if target == JobState.CANCELLED else ShardState.FAILED
            )
            await conn.execute(
                update(shards)
                .where(shards.c.job_id == job_id, shards.c.state == ShardState.OPEN.value)
                .values(state=shard_target.value, finished_at=now)
            )
            return await self._cancel_live(conn, tasks.c.job_id == job_id, now=now)

    async def canonical_outputs(self, job_id: int) -> list[str]:
        query = select(shards.c.output_hash, shards.c.state).where(shards.c.job_id == job_id)
        async with self._read() as conn:
            rows = (await conn.execute(query.order_by(shards.c.idx))).all()
        if any(row.state != ShardState.DONE.value or row.output_hash is None for row in rows):
            raise RuntimeError(f"job {job_id} has shards without a canonical result")
        return [row.output_hash for row in rows]

    async def complete_job(
        self, job_id: int, *, result_hash: str, result_size: int, now: float
    ) -> bool:
        async with self._tx() as conn:
            changed = await conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == job_id, jobs.c.state.in_(_states(*sources_of(JobState.COMPLETED)))
                )
                .values(
                    state=JobState.COMPLETED.value,
                    result_hash=result_hash,
                    result_size=result_size,
                    finished_at=now,
                )
            )
            return changed.rowcount == 1

    async def jobs_to_assemble(self) -> list[int]:
        not_done = (
            select(shards.c.id)
            .where(shards.c.job_id == jobs.c.id, shards.c.state != ShardState.DONE.value)
            .exists()
        )
        query = select(jobs.c.id).where(
            jobs.c.state.in_(_states(JobState.QUEUED, JobState.RUNNING)), ~not_done
        )
        async with self._read() as conn:
            return list((await conn.execute(query)).scalars().all())

    # -- tasks ----------------------------------------------------------------------------

    async def ready_tasks(self, *, limit: int) -> list[ReadyTask]:
        query = (
            select(
                tasks.c.id,
                tasks.c.shard_id,
                tasks.c.job_id,
                tasks.c.created_at,
                jobs.c.kind,
                jobs.c.priority,
                shards.c.item_count,
                shards.c.cost_flops,
            )
            .join(jobs, jobs.c.id == tasks.c.job_id)
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(tasks.c.state == TaskState.READY.value)
            .order_by(tasks.c.id)
            .limit(limit)
        )
        async with self._read() as conn:
            return [_ready(row) for row in await conn.execute(query)]

    @_retry_conflicts
    async def claim_task(
        self,
        task_id: int,
        claimer: Claimer,
        *,
        kind: str,
        lease_deadline: float,
        now: float,
        distinct: Distinct | None,
    ) -> Assignment | ClaimMiss:
        async with self._tx() as conn:
            standing = await self._standing(conn, claimer, kind, now=now)
            if isinstance(standing, ClaimMiss):
                return standing
            if distinct is not None and not self.is_sqlite:
                # The "no replica on this node yet" check reads other rows: lock the shard
                # so two claims of its replicas for one node cannot both pass it.
                shard_of_task = select(tasks.c.shard_id).where(tasks.c.id == task_id)
                await conn.execute(
                    select(shards.c.id)
                    .where(shards.c.id == shard_of_task.scalar_subquery())
                    .with_for_update()
                )
            where = [tasks.c.id == task_id, tasks.c.state == TaskState.READY.value]
            where += _distinct_from(claimer, distinct)
            if not trust_policy.is_trusted(standing.trust, self.trust):
                where.append(tasks.c.trusted_only.is_(False))
            claimed = await conn.execute(
                update(tasks)
                .where(*where)
                .values(**_held_by(claimer, now), lease_deadline=lease_deadline)
            )
            if claimed.rowcount != 1:
                state = (
                    await conn.execute(select(tasks.c.state).where(tasks.c.id == task_id))
                ).scalar_one_or_none()
                ready = state == TaskState.READY.value
                return ClaimMiss.CONFLICT if ready else ClaimMiss.GONE
            await ledger.use_quota(
                conn, claimer.node_id, kind, claimer.backend,
                used=standing.quota_used_today, now=now,
            )  # fmt: skip
            [row] = await _assigned(conn, [task_id], now=now)
            other = _OTHER
            others_out = (
                await conn.execute(
                    select(func.count()).where(
                        other.c.shard_id == row.shard_id,
                        other.c.id != task_id,
                        other.c.node_id.is_not(None),
                    )
                )
            ).scalar_one()
        return _assignment(
            row, lease_deadline, standing.trust, first_replica=others_out == 0 and row.mode is None
        )

    async def _standing(
        self, conn: AsyncConnection, claimer: Claimer, kind: str, *, now: float
    ) -> NodeTrust | ClaimMiss:
        """The claimer's trust on `kind`, or why it may claim nothing now."""
        suspended = (
            await conn.execute(select(nodes.c.suspended_at).where(nodes.c.id == claimer.node_id))
        ).scalar_one_or_none()
        standing = await ledger.load_trust(
            conn, claimer.node_id, kind, claimer.backend, settings=self.trust, now=now
        )
        if suspended is not None or standing.trust.suspended:
            return ClaimMiss.SUSPENDED
        if standing.quota_used_today >= standing.trust.daily_quota:
            return ClaimMiss.QUOTA
        return standing

    @_retry_conflicts
    async def run_alone(self, shard_id: int, task_id: int, *, spot_check: bool) -> list[int]:
        async with self._tx() as conn:
            other = _OTHER
            changed = await conn.execute(
                update(shards)
                .where(
                    shards.c.id == shard_id,
                    shards.c.state == ShardState.OPEN.value,
                    shards.c.mode.is_(None),
                    ~exists().where(
                        other.c.shard_id == shard_id,
                        other.c.id != task_id,
                        other.c.node_id.is_not(None),
                    ),
                )
                .values(
                    target=2 if spot_check else 1,
                    quorum=2 if spot_check else 1,
                    mode="spot" if spot_check else "alone",
                )
            )
            if changed.rowcount != 1:
                return []
            ready = list(
                (
                    await conn.execute(
                        select(tasks.c.id)
                        .where(
                            tasks.c.shard_id == shard_id,
                            tasks.c.state == TaskState.READY.value,
                        )
                        .order_by(tasks.c.id)
                    )
                )
                .scalars()
                .all()
            )
            keep, drop = (ready[:1], ready[1:]) if spot_check else ([], ready)
            if keep:
                await conn.execute(
                    update(tasks).where(tasks.c.id == keep[0]).values(trusted_only=True)
                )
            if drop:
                await conn.execute(
                    update(tasks)
                    .where(tasks.c.id.in_(drop), tasks.c.state == TaskState.READY.value)
                    .values(state=TaskState.CANCELLED.value)
                )
                # Not attempts of the shard after all: its budget stays for real retries.
                await conn.execute(
                    update(shards)
                    .where(shards.c.id == shard_id)
                    .values(attempts=shards.c.attempts - len(drop))
                )
        return drop

    async def escalate(self, shard_id: int, *, target: int, quorum: int) -> bool:
        async with self._tx() as conn:
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
            return changed.rowcount == 1

    async def raise_target(self, shard_id: int, *, results_seen: int) -> bool:
        async with self._tx() as conn:
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

    async def node_trust(self, node_id: int) -> list[NodeTrust]:
        async with self._read() as conn:
            rows = (
                await conn.execute(
                    select(node_trust)
                    .where(node_trust.c.node_id == node_id)
                    .order_by(node_trust.c.kind, node_trust.c.backend)
                )
            ).all()
        return [
            NodeTrust(
                row.node_id,
                row.kind,
                row.backend,
                ledger.trust_of(row),
                ledger.used_today(row, time.time()),
            )
            for row in rows
        ]

    @_retry_conflicts
    async def claim_tasks(
        self, lease_deadlines: dict[int, float], claimer: Claimer, *, kind: str, now: float
    ) -> list[Assignment] | ClaimMiss:
        if not lease_deadlines:
            return []
        # A node waits for this commit with free slots: ahead of background commits.
        with urgent():
            return await self._claim_tasks(lease_deadlines, claimer, kind=kind, now=now)

    async def _claim_tasks(
        self, lease_deadlines: dict[int, float], claimer: Claimer, *, kind: str, now: float
    ) -> list[Assignment] | ClaimMiss:
        async with self._tx() as conn:
            standing = await self._standing(conn, claimer, kind, now=now)
            if isinstance(standing, ClaimMiss):
                return standing
            room = standing.trust.daily_quota - standing.quota_used_today
            wanted = sorted(lease_deadlines)[:room]
            claimed = (
                (
                    await conn.execute(
                        update(tasks)
                        .where(
                            tasks.c.id.in_(wanted),
                            tasks.c.state == TaskState.READY.value,
                        )
                        .values(
                            **_held_by(claimer, now),
                            lease_deadline=case(
                                {t: lease_deadlines[t] for t in wanted}, value=tasks.c.id
                            ),
                        )
                        .returning(tasks.c.id)
                    )
                )
                .scalars()
                .all()
            )
            if not claimed:
                return []
            await ledger.use_quota(
                conn,
                claimer.node_id,
                kind,
                claimer.backend,
                used=standing.quota_used_today,
                count=len(claimed),
                now=now,
            )
            rows = await _assigned(conn, claimed, now=now)
        return [_assignment(row, lease_deadlines[row.id], standing.trust) for row in rows]

    async def accept_result(
        self,
        task_id: int,
        node_id: int,
        *,
        output_hash: str,
        output_size: int,
        elapsed_s: float,
        now: float,
    ) -> ResultReceipt:
        result = NewResult(task_id, output_hash, output_size, elapsed_s)
        return (await self.accept_results(node_id, [result], now=now))[0]

    async def accept_results(
        self, node_id: int, results: Sequence[NewResult], *, now: float
    ) -> list[ResultReceipt]:
        if not results:
            return []
        # One read and one write for the batch. The rows are locked on PostgreSQL (in id
        # order, so two batches cannot deadlock); SQLite holds its write lock meanwhile.
        query = (
            select(
                tasks.c.id,
                tasks.c.node_id,
                tasks.c.state,
                tasks.c.output_hash,
                tasks.c.shard_id,
                tasks.c.job_id,
                shards.c.state.label("shard_state"),
            )
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(tasks.c.id.in_(sorted({r.task_id for r in results})))
            .order_by(tasks.c.id)
        )
        if not self.is_sqlite:
            query = query.with_for_update(of=tasks)
        async with self._tx() as conn:
            rows = {row.id: row for row in (await conn.execute(query)).all()}
            receipts: list[ResultReceipt] = []
            changes: list[dict[str, Any]] = []
            taken: dict[int, str] = {}  # task id -> output hash, taken in this batch
            for result in results:
                if result.task_id in taken:  # the same task twice in one batch
                    same = taken[result.task_id] == result.output_hash
                    receipts.append(
                        ResultReceipt("duplicate")
                        if same
                        else ResultReceipt(
                            "rejected", f"task {result.task_id} already reported another output"
                        )
                    )
                    continue
                row = rows.get(result.task_id)
                receipt = _judge_result(row, result.task_id, node_id, result.output_hash)
                if receipt is not None:
                    receipts.append(receipt)
                    continue
                assert row is not None
                shard_open = row.shard_state == ShardState.OPEN.value
                check_transition(TaskState(row.state), TaskState.COMPLETED)
                taken[result.task_id] = result.output_hash
                changes.append(
                    {
                        "b_task": result.task_id,
                        "b_output_hash": result.output_hash,
                        "b_output_size": result.output_size,
                        "b_elapsed_s": result.elapsed_s,
                        "b_outcome": None if shard_open else "late",
                    }
                )
                receipts.append(
                    ResultReceipt(
                        "accepted" if shard_open else "late",
                        shard_id=row.shard_id,
                        job_id=row.job_id,
                    )
                )
            if changes:
                await conn.execute(
                    update(tasks)
                    .where(tasks.c.id == bindparam("b_task"))
                    .values(
                        state=TaskState.COMPLETED.value,
                        output_hash=bindparam("b_output_hash"),
                        output_size=bindparam("b_output_size"),
                        elapsed_s=bindparam("b_elapsed_s"),
                        finished_at=now,
                        outcome=bindparam("b_outcome"),
                    ),
                    changes,
                )
        return receipts

    async def task_inputs(self, task_ids: Sequence[int], node_id: int) -> dict[int, TaskInput]:
        if not task_ids:
            return {}
        query = (
            select(tasks.c.id, tasks.c.job_id, tasks.c.shard_id, shards.c.input_hash)
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(tasks.c.id.in_(list(set(task_ids))), tasks.c.node_id == node_id)
        )
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        return {
            r.id: TaskInput(job_id=r.job_id, shard_id=r.shard_id, input_hash=r.input_hash)
            for r in rows
        }

    async def record_failure(self, task_id: int, node_id: int, *, reason: str, now: float) -> bool:
        async with self._tx() as conn:
            changed = await conn.execute(
                update(tasks)
                .where(tasks.c.id == task_id, tasks.c.node_id == node_id, tasks.c.state.in_(_HELD))
                .values(state=TaskState.FAILED.value, failure_reason=reason[:2000], finished_at=now)
            )
            if changed.rowcount == 1:
                await self._verdicts(conn, [(task_id, "error")], now=now)
            return changed.rowcount == 1

    async def expire_overdue(self, *, now: float) -> list[NodeTask]:
        where = and_(tasks.c.state == TaskState.ASSIGNED.value, tasks.c.lease_deadline < now)
        return await self._expire(where, now=now)

    async def expire_node_tasks(self, node_id: int, *, now: float) -> list[NodeTask]:
        where = and_(tasks.c.state == TaskState.ASSIGNED.value, tasks.c.node_id == node_id)
        return await self._expire(where, now=now)

    async def expire_task(self, task_id: int, *, now: float) -> list[NodeTask]:
        where = and_(tasks.c.state == TaskState.ASSIGNED.value, tasks.c.id == task_id)
        return await self._expire(where, now=now)

    @_retry_conflicts
    async def _expire(self, where: Any, *, now: float) -> list[NodeTask]:
        async with self._tx() as conn:
            rows = (await conn.execute(select(tasks.c.id, tasks.c.node_id).where(where))).all()
            if not rows:
                return []
            ids = [r.id for r in rows]
            await conn.execute(
                update(tasks)
                .where(tasks.c.id.in_(ids), tasks.c.state == TaskState.ASSIGNED.value)
                .values(state=TaskState.EXPIRED.value)
            )
            # A missed deadline is an error of the node (BOINC counts it so too).
            await self._verdicts(conn, [(task_id, "error") for task_id in ids], now=now)
        return [NodeTask(task_id=r.id, node_id=r.node_id, state=TaskState.EXPIRED) for r in rows]

    async def shards_to_verify(self, *, limit: int) -> list[int]:
        query = (
            select(tasks.c.shard_id)
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(
                shards.c.state == ShardState.OPEN.value,
                tasks.c.state == TaskState.COMPLETED.value,
                tasks.c.outcome.is_(None),
            )
            .distinct()
            .limit(limit)
        )
        async with self._read() as conn:
            return list((await conn.execute(query)).scalars().all())

    async def shard_for_verify(self, shard_id: int) -> ShardForVerify | None:
        return (await self.shards_for_verify([shard_id])).get(shard_id)

    async def shards_for_verify(self, shard_ids: Sequence[int]) -> dict[int, ShardForVerify]:
        ids = sorted(set(shard_ids))
        if not ids:
            return {}
        async with self._read() as conn:
            shard_rows = (await conn.execute(select(shards).where(shards.c.id.in_(ids)))).all()
            if not shard_rows:
                return {}
            job_of: dict[int, JobRecord] = {}
            for job_id in sorted({row.job_id for row in shard_rows}):
                job = await self._job(conn, job_id, with_counts=False)
                assert job is not None
                job_of[job_id] = job
            results = (
                await conn.execute(
                    select(
                        tasks.c.id,
                        tasks.c.shard_id,
                        tasks.c.node_id,
                        tasks.c.output_hash,
                        tasks.c.output_size,
                        tasks.c.outcome,
                        node_trust.c.consecutive_valid,
                        node_trust.c.valid_total,
                        node_trust.c.invalid_total,
                        node_trust.c.error_total,
                        node_trust.c.recent_invalid,
                        node_trust.c.daily_quota,
                        node_trust.c.suspended,
                    )
                    .join(jobs, jobs.c.id == tasks.c.job_id)
                    .outerjoin(
                        node_trust,
                        and_(
                            node_trust.c.node_id == tasks.c.node_id,
                            node_trust.c.kind == jobs.c.kind,
                            node_trust.c.backend == func.coalesce(tasks.c.backend, "cpu"),
                        ),
                    )
                    .where(
                        tasks.c.shard_id.in_(ids),
                        tasks.c.state == TaskState.COMPLETED.value,
                        (tasks.c.outcome.is_(None)) | (tasks.c.outcome == "valid"),
                    )
                    .order_by(tasks.c.shard_id, tasks.c.finished_at, tasks.c.id)
                )
            ).all()
        by_shard: dict[int, list[ShardResult]] = {row.id: [] for row in shard_rows}
        for r in results:
            by_shard[r.shard_id].append(
                ShardResult(
                    task_id=r.id,
                    node_id=r.node_id,
                    output_hash=r.output_hash,
                    output_size=r.output_size,
                    outcome=r.outcome,
                    trust=(
                        ledger.trust_of(r)
                        if r.valid_total is not None
                        else trust_policy.new_trust(self.trust)
                    ),
                )
            )
        return {
            row.id: ShardForVerify(
                shard=_shard(row), job=job_of[row.job_id], results=by_shard[row.id]
            )
            for row in shard_rows
        }

    async def decide_shard(
        self,
        shard_id: int,
        *,
        canonical_task_id: int | None,
        valid: Sequence[int],
        invalid: Sequence[int],
        fail_reason: str | None,
        now: float,
    ) -> DecisionOutcome:
        decision = ShardDecision(shard_id, canonical_task_id, valid, invalid, fail_reason)
        return (await self.decide_shards([decision], now=now))[0]

    @_retry_conflicts
    async def decide_shards(
        self, decisions: Sequence[ShardDecision], *, now: float
    ) -> list[DecisionOutcome]:
        if not decisions:
            return []
        final = [
            d for d in decisions if d.canonical_task_id is not None or d.fail_reason is not None
        ]
        won: set[int] = set()
        job_of: dict[int, int] = {}
        to_cancel: dict[int, list[NodeTask]] = {}
        async with self._tx() as conn:
            # Undecided shards: only their invalid results are marked.
            pending_invalid = [
                t
                for d in decisions
                if d.canonical_task_id is None and d.fail_reason is None
                for t in d.invalid
            ]
            await self._mark(conn, pending_invalid, "invalid")
            verdicts: list[tuple[int, ledger.Verdict]] = [(t, "invalid") for t in pending_invalid]
            if final:
                # Shards still open take their decision (locked on PostgreSQL, in id order):
                # a decision that lost a race to another process changes nothing.
                query = (
                    select(shards.c.id, shards.c.job_id)
                    .where(
                        shards.c.id.in_(sorted({d.shard_id for d in final})),
                        shards.c.state == ShardState.OPEN.value,
                    )
                    .order_by(shards.c.id)
                )
                if not self.is_sqlite:
                    query = query.with_for_update()
                job_of = {row.id: row.job_id for row in (await conn.execute(query)).all()}
                taking = [d for d in final if d.shard_id in job_of]
                taking = list({d.shard_id: d for d in taking}.values())  # one per shard
                won = {d.shard_id for d in taking}
                canonical = [d.canonical_task_id for d in taking if d.canonical_task_id]
                outputs = (
                    {
                        row.id: row
                        for row in (
                            await conn.execute(
                                select(tasks.c.id, tasks.c.output_hash, tasks.c.output_size).where(
                                    tasks.c.id.in_(canonical)
                                )
                            )
                        ).all()
                    }
                    if canonical
                    else {}
                )
                if taking:
                    await conn.execute(
                        update(shards)
                        .where(shards.c.id == bindparam("b_shard"))
                        .values(
                            state=bindparam("b_state"),
                            canonical_task_id=bindparam("b_canonical"),
                            output_hash=bindparam("b_output_hash"),
                            output_size=bindparam("b_output_size"),
                            error=bindparam("b_error"),
                            finished_at=now,
                        ),
                        [_decided_shard(d, outputs.get(d.canonical_task_id or -1)) for d in taking],
                    )
                # Only the decision that won marks results: a lost race leaves them to it.
                valid = [t for d in taking for t in d.valid]
                invalid = [t for d in taking for t in d.invalid]
                await self._mark(conn, valid, "valid")
                await self._mark(conn, invalid, "invalid")
                for d in taking:
                    # A result that agreed with another node's passed a check; a lone
                    # one did not.
                    checked: ledger.Verdict = "valid" if len(d.valid) > 1 else "unchecked"
                    verdicts += [(t, checked) for t in d.valid]
                verdicts += [(t, "invalid") for t in invalid]
                if won:
                    where = tasks.c.shard_id.in_(sorted(won))
                    for shard_id, task in await self._cancel_live_by_shard(conn, where, now=now):
                        to_cancel.setdefault(shard_id, []).append(task)
            await self._verdicts(conn, verdicts, now=now)
        # Counted after the commit: when two processes decide a job's last two shards at
        # once, the later commit then sees both (inside the transactions neither would).
        open_left: dict[int, int] = {}
        if won:
            job_ids = sorted({job_of[shard_id] for shard_id in won})
            async with self._read() as conn:
                open_left = {
                    row.job_id: row.n
                    for row in (
                        await conn.execute(
                            select(shards.c.job_id, func.count().label("n"))
                            .where(
                                shards.c.job_id.in_(job_ids),
                                shards.c.state != ShardState.DONE.value,
                            )
                            .group_by(shards.c.job_id)
                        )
                    ).all()
                }
        outcomes = []
        reported: set[int] = set()
        for d in decisions:
            if d.shard_id not in won or d.shard_id in reported:
                outcomes.append(DecisionOutcome(decided=False, to_cancel=[], job_done=False))
                continue
            reported.add(d.shard_id)
            outcomes.append(
                DecisionOutcome(
                    decided=True,
                    to_cancel=to_cancel.get(d.shard_id, []),
                    job_done=open_left.get(job_of[d.shard_id], 0) == 0,
                )
            )
        return outcomes

    async def _verdicts(
        self, conn: AsyncConnection, verdicts: list[tuple[int, ledger.Verdict]], *, now: float
    ) -> None:
        await ledger.apply_verdicts(conn, verdicts, settings=self.trust, now=now)

    async def late_results(self, *, limit: int) -> list[LateResult]:
        query = (
            select(
                tasks.c.id,
                tasks.c.node_id,
                tasks.c.output_hash,
                tasks.c.job_id,
                shards.c.output_hash.label("canonical_hash"),
            )
            .join(shards, shards.c.id == tasks.c.shard_id)
            .where(
                # Late, or taken while open by a verification that lost the race to decide.
                tasks.c.outcome.is_(None) | (tasks.c.outcome == "late"),
                tasks.c.state == TaskState.COMPLETED.value,
                shards.c.state == ShardState.DONE.value,
            )
            .order_by(tasks.c.id)
            .limit(limit)
        )
        async with self._read() as conn:
            rows = (await conn.execute(query)).all()
        return [
            LateResult(r.id, r.node_id, r.output_hash, r.canonical_hash, r.job_id) for r in rows
        ]

    @_retry_conflicts
    async def judge_late(self, task_id: int, *, agrees: bool, now: float) -> None:
        async with self._tx() as conn:
            changed = await conn.execute(
                update(tasks)
                .where(
                    tasks.c.id == task_id,
                    tasks.c.outcome.is_(None) | (tasks.c.outcome == "late"),
                    tasks.c.state == TaskState.COMPLETED.value,
                )
                .values(outcome="valid" if agrees else "invalid")
            )
            if changed.rowcount == 1:
                await self._verdicts(conn, [(task_id, "valid" if agrees else "invalid")], now=now)

    @staticmethod
    async def _mark(conn: AsyncConnection, task_ids: Sequence[int], outcome: str) -> None:
        if task_ids:
            await conn.execute(
                update(tasks).where(tasks.c.id.in_(list(task_ids))).values(outcome=outcome)
            )

    @_retry_conflicts
    async def replenish(self, *, now: float) -> tuple[list[ReadyTask], list[int], list[NodeTask]]:
        """Create tasks for open shards short of replicas; fail shards out of attempts."""
        async with self._tx() as conn:
            return await self._replenish_in(conn, now=now, job_id=None)

    async def _replenish_in(
        self, conn: AsyncConnection, *, now: float, job_id: int | None
    ) -> tuple[list[ReadyTask], list[int], list[NodeTask]]:
        live = (
            select(func.count())
            .where(tasks.c.shard_id == shards.c.id, tasks.c.state.in_(_LIVE))
            .scalar_subquery()
        )
        results = (
            select(func.count())
            .where(
                tasks.c.shard_id == shards.c.id,
                tasks.c.state == TaskState.COMPLETED.value,
                tasks.c.outcome.is_(None) | (tasks.c.outcome == "valid"),
            )
            .scalar_subquery()
        )
        pending = live + results
        # An open shard with all the results it asked for and nothing live is undecided:
        # they disagree, or agree without enough credibility. It needs one more (BOINC
        # raises such a workunit's target), or it would wait forever.
        # (Quorum 1: any result is verified at once, so this would race the verifier;
        # the grid raises such a shard's target itself when its result is not enough.)
        no_quorum = (
            (shards.c.quorum > 1)
            & (results >= shards.c.quorum)
            & (results >= shards.c.target)
            & (live == 0)
        )
        query = (
            select(
                shards.c.id,
                shards.c.job_id,
                shards.c.attempts,
                pending.label("pending"),
                no_quorum.label("no_quorum"),
                shards.c.item_count,
                shards.c.cost_flops,
                shards.c.target,
                jobs.c.max_attempts,
                jobs.c.kind,
                jobs.c.priority,
            )
            .join(jobs, jobs.c.id == shards.c.job_id)
            .where(
                shards.c.state == ShardState.OPEN.value,
                jobs.c.state.in_(_states(JobState.QUEUED, JobState.RUNNING)),
                (pending < shards.c.target) | no_quorum,
            )
        )
        if job_id is not None:
            query = query.where(shards.c.job_id == job_id)
        rows = (await conn.execute(query)).all()
        if rows and not self.is_sqlite:
            rows = await self._lock_and_recount(conn, query, [row.id for row in rows])
        new_tasks: list[dict[str, Any]] = []
        attempts: list[dict[str, Any]] = []
        exhausted: list[Any] = []
        for row in rows:
            short = max(row.target - row.pending, 1 if row.no_quorum else 0)
            wanted = min(short, row.max_attempts - row.attempts)
            if wanted <= 0:
                if row.pending == 0 or row.no_quorum:
                    exhausted.append(row)
                continue
            new_tasks += [
                dict(
                    shard_id=row.id,
                    job_id=row.job_id,
                    state=TaskState.READY.value,
                    created_at=now,
                    trusted_only=False,
                )
            ] * wanted
            attempts.append({"b_shard": row.id, "b_more": wanted})
        if attempts:  # one statement for all the shards (a new job's are thousands)
            await conn.execute(
                update(shards)
                .where(shards.c.id == bindparam("b_shard"))
                .values(attempts=shards.c.attempts + bindparam("b_more")),
                attempts,
            )
        failed_jobs, to_cancel = await self._fail_exhausted(conn, exhausted, now=now)
        if not new_tasks:
            return [], failed_jobs, to_cancel
        meta = {row.id: row for row in rows}
        # One multi-row insert; ids come back in the order of the rows.
        created = (
            await conn.execute(
                insert(tasks).returning(tasks.c.id, sort_by_parameter_order=True), new_tasks
            )
        ).all()
        ready = []
        for values, (task_id,) in zip(new_tasks, created, strict=True):
            row = meta[values["shard_id"]]
            ready.append(
                ReadyTask(
                    task_id=task_id,
                    shard_id=row.id,
                    job_id=row.job_id,
                    kind=row.kind,
                    priority=row.priority,
                    created_at=now,
                    items=row.item_count,
                    cost_flops=row.cost_flops,
                )
            )
        return ready, failed_jobs, to_cancel

    @staticmethod
    async def _lock_and_recount(
        conn: AsyncConnection, query: Any, shard_ids: list[int]
    ) -> list[Any]:
        """Lock the shards short of tasks and count again (PostgreSQL).

        Another process may be topping up the same shards: SKIP LOCKED leaves those to it,
        and the second count, a new statement under READ COMMITTED, sees every task a
        transaction that held a lock before us committed, so no shard gets tasks twice.
        """
        locked = (
            (
                await conn.execute(
                    select(shards.c.id)
                    .where(shards.c.id.in_(shard_ids))
                    .order_by(shards.c.id)
                    .with_for_update(skip_locked=True)
                )
            )
            .scalars()
            .all()
        )
        if not locked:
            return []
        return list((await conn.execute(query.where(shards.c.id.in_(locked)))).all())

    async def _fail_exhausted(
        self, conn: AsyncConnection, rows: list[Any], *, now: float
    ) -> tuple[list[int], list[NodeTask]]:
        """Fail shards out of attempts and their jobs; return the jobs and tasks to cancel."""
        failed_jobs: list[int] = []
        to_cancel: list[NodeTask] = []
        for row in rows:
            reason = (
                f"shard {row.id} got no usable result in {row.attempts} attempts "
                f"(max_attempts={row.max_attempts})"
            )
            await conn.execute(
                update(shards)
                .where(shards.c.id == row.id, shards.c.state == ShardState.OPEN.value)
                .values(state=ShardState.FAILED.value, error=reason, finished_at=now)
            )
            changed = await conn.execute(
                update(jobs)
                .where(
                    jobs.c.id == row.job_id,
                    jobs.c.state.in_(_states(JobState.QUEUED, JobState.RUNNING)),
                )
                .values(state=JobState.FAILED.value, error=reason, finished_at=now)
            )
            if changed.rowcount == 1:
                failed_jobs.append(row.job_id)
                # Its other shards end with it, as in `fail_job`.
                await conn.execute(
                    update(shards)
                    .where(shards.c.job_id == row.job_id, shards.c.state == ShardState.OPEN.value)
                    .values(state=ShardState.FAILED.value, finished_at=now)
                )
                to_cancel += await self._cancel_live(conn, tasks.c.job_id == row.job_id, now=now)
        return failed_jobs, to_cancel

    async def _cancel_live(
        self, conn: AsyncConnection, where: Any, *, now: float
    ) -> list[NodeTask]:
        """Cancel ready and held tasks matching `where`; return those a node holds."""
        return [task for _, task in await self._cancel_live_by_shard(conn, where, now=now)]

    @staticmethod
    async def _cancel_live_by_shard(
        conn: AsyncConnection, where: Any, *, now: float
    ) -> list[tuple[int, NodeTask]]:
        """`_cancel_live`, each held task with its shard id."""
        live = _states(TaskState.READY, TaskState.ASSIGNED, TaskState.EXPIRED)
        rows = (
            await conn.execute(
                select(tasks.c.id, tasks.c.node_id, tasks.c.state, tasks.c.shard_id).where(
                    where, tasks.c.state.in_(live)
                )
            )
        ).all()
        if not rows:
            return []
        # Still conditional: a result committed meanwhile by another process stays.
        await conn.execute(
            update(tasks)
            .where(tasks.c.id.in_([r.id for r in rows]), tasks.c.state.in_(live))
            .values(state=TaskState.CANCELLED.value, finished_at=now)
        )
        return [
            (r.shard_id, NodeTask(task_id=r.id, node_id=r.node_id, state=TaskState(r.state)))
            for r in rows
            if r.node_id is not None
        ]

    async def _job(
        self, conn: AsyncConnection, job_id: int, *, with_counts: bool = True
    ) -> JobRecord | None:
        row = (await conn.execute(select(jobs).where(jobs.c.id == job_id))).first()
        if row is None:
            return None
        counts: dict[str, int] = {}
        tasks_run = 0
        if with_counts:
            counts = {
                state: n
                for state, n in (
                    await conn.execute(
                        select(shards.c.state, func.count())
                        .where(shards.c.job_id == job_id)
                        .group_by(shards.c.state)
                    )
                ).all()
            }
            tasks_run = (
                await conn.execute(
                    select(func.count()).where(
                        tasks.c.job_id == job_id, tasks.c.state == TaskState.COMPLETED.value
                    )
                )
            ).scalar_one()
        return JobRecord(
            id=row.id,
            account_id=row.account_id,
            kind=row.kind,
            params=row.params,
            inputs=row.inputs,
            state=JobState(row.state),
            replication=row.replication,
            min_quorum=row.min_quorum,
            max_attempts=row.max_attempts,
            priority=row.priority,
            shards_total=row.shards_total,
            items_total=row.items_total,
            result_hash=row.result_hash,
            result_size=row.result_size,
            error=row.error,
            created_at=row.created_at,
            started_at=row.started_at,
            finished_at=row.finished_at,
            shard_counts=counts,
            tasks_run=tasks_run,
        )

    # -- scheduling (issue 4; see store/scheduling.py) ------------------------------------

    async def ready_heads(self, *, per_job: int) -> list[ReadyTask]:
        async with self._read() as conn:
            return await scheduling.ready_heads(conn, per_job=per_job)

    async def running_shards(self, *, limit: int) -> list[RunningTask]:
        async with self._read() as conn:
            return await scheduling.running_shards(conn, limit=limit)

    @_retry_conflicts
    async def add_backup_task(
        self, shard_id: int, node_id: int, *, lease_deadline: float, now: float
    ) -> Assignment | None:
        async with self._tx() as conn:
            return await scheduling.add_backup_task(
                conn,
                shard_id,
                node_id,
                lease_deadline=lease_deadline,
                now=now,
                lock=not self.is_sqlite,
            )


def _held_by(claimer: Claimer, now: float) -> dict[str, Any]:
    """The values of a task claimed by `claimer` (its lease deadline aside)."""
    return dict(
        state=TaskState.ASSIGNED.value,
        node_id=claimer.node_id,
        account_id=claimer.account_id,
        network=claimer.network,
        backend=claimer.backend,
        assigned_at=now,
    )


async def _assigned(conn: AsyncConnection, task_ids: Sequence[int], *, now: float) -> list[Any]:
    """What the nodes need to hear of tasks just claimed; their jobs start running."""
    rows = (
        await conn.execute(
            select(
                tasks.c.id,
                tasks.c.shard_id,
                tasks.c.job_id,
                shards.c.idx,
                shards.c.input_hash,
                shards.c.input_size,
                shards.c.mode,
                jobs.c.kind,
                jobs.c.params,
            )
            .join(shards, shards.c.id == tasks.c.shard_id)
            .join(jobs, jobs.c.id == tasks.c.job_id)
            .where(tasks.c.id.in_(list(task_ids)))
            .order_by(tasks.c.id)
        )
    ).all()
    await conn.execute(
        update(jobs)
        .where(
            jobs.c.id.in_({row.job_id for row in rows}),
            jobs.c.state == JobState.QUEUED.value,
        )
        .values(state=JobState.RUNNING.value, started_at=now)
    )
    return list(rows)


def _assignment(
    row: Any, lease_deadline: float, trust: Trust, *, first_replica: bool = False
) -> Assignment:
    return Assignment(
        task_id=row.id,
        shard_id=row.shard_id,
        job_id=row.job_id,
        shard_index=row.idx,
        kind=row.kind,
        params=row.params,
        input_hash=row.input_hash,
        input_size=row.input_size,
        lease_deadline=lease_deadline,
        trust=trust,
        first_replica=first_replica,
    )


def _distinct_from(claimer: Claimer, distinct: Distinct | None) -> list[Any]:
    """Conditions for "no other replica of this shard on this node, account or network".

    A node never runs two replicas of a shard, even after one failed (it may fail the
    same way). Accounts and networks count only replicas that ran or run: a replica that
    failed or expired on one of them does not bar its other nodes.
    """
    if distinct is None:
        return []
    other = _OTHER
    same = [other.c.node_id == claimer.node_id]
    counted = other.c.state.in_(_states(TaskState.ASSIGNED, TaskState.EXPIRED, TaskState.COMPLETED))
    if distinct.accounts:
        same.append(counted & (other.c.account_id == claimer.account_id))
    if distinct.networks and claimer.network:
        same.append(counted & (other.c.network == claimer.network))
    return [
        ~exists().where(other.c.shard_id == tasks.c.shard_id, other.c.id != tasks.c.id, or_(*same))
    ]


def _judge_result(
    row: Any | None, task_id: int, node_id: int, output_hash: str
) -> ResultReceipt | None:
    """Why a result cannot be taken as new, or None when it can."""
    if row is None:
        return ResultReceipt("rejected", f"unknown task {task_id}")
    if row.node_id != node_id:
        return ResultReceipt("rejected", f"task {task_id} is not held by this node")
    state = TaskState(row.state)
    if state == TaskState.COMPLETED:
        if row.output_hash == output_hash:
            return ResultReceipt("duplicate", shard_id=row.shard_id, job_id=row.job_id)
        return ResultReceipt("rejected", f"task {task_id} already reported another output")
    if state not in (TaskState.ASSIGNED, TaskState.EXPIRED, TaskState.CANCELLED):
        return ResultReceipt("rejected", f"task {task_id} is {state.value}")
    return None


def _decided_shard(decision: ShardDecision, output: Any | None) -> dict[str, Any]:
    """The bound values of one shard's decision in `decide_shards`' update."""
    done = decision.canonical_task_id is not None
    return {
        "b_shard": decision.shard_id,
        "b_state": (ShardState.DONE if done else ShardState.FAILED).value,
        "b_canonical": decision.canonical_task_id,
        "b_output_hash": output.output_hash if done and output is not None else None,
        "b_output_size": output.output_size if done and output is not None else None,
        "b_error": decision.fail_reason,
    }


def _pk(result: Any) -> int:
    return int(result.inserted_primary_key[0])


def _node(row: Any) -> NodeRecord:
    return NodeRecord(
        id=row.id,
        account_id=row.account_id,
        node_key=row.node_key,
        name=row.name,
        state=NodeState(row.state),
        hardware=row.hardware,
        benchmark=row.benchmark,
        kinds=row.kinds,
        slots=row.slots,
        worker_version=row.worker_version,
        created_at=row.created_at,
        last_seen_at=row.last_seen_at,
        connected_seconds=row.connected_seconds,
        network=row.network,
        suspended_at=row.suspended_at,
        credit=ledger.credit_of(row),
    )


def _account(row: Any) -> AccountRecord:
    return AccountRecord(
        id=row.id,
        name=row.name,
        is_admin=row.is_admin,
        flagged_at=row.flagged_at,
        flag_reason=row.flag_reason,
        credit=ledger.credit_of(row),
    )


def _shard(row: Any, *, live: int = 0) -> ShardRecord:
    return ShardRecord(
        id=row.id,
        job_id=row.job_id,
        index=row.idx,
        state=ShardState(row.state),
        items=row.item_count,
        attempts=row.attempts,
        input_hash=row.input_hash,
        output_hash=row.output_hash,
        error=row.error,
        live_tasks=live,
        target=row.target,
        quorum=row.quorum,
        mode=row.mode,
        cost_flops=row.cost_flops,
    )


def _ready(row: Any) -> ReadyTask:
    return ReadyTask(
        task_id=row.id,
        shard_id=row.shard_id,
        job_id=row.job_id,
        kind=row.kind,
        priority=row.priority,
        created_at=row.created_at,
        items=row.item_count,
        cost_flops=row.cost_flops,
    )


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the writer; synchronous=FULL makes a commit durable
    # before the coordinator acknowledges a result to its node.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
