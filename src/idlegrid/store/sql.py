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
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Concatenate, ParamSpec, TypeVar

from sqlalchemy import event, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from idlegrid.states import JobState
from idlegrid.store import (
    accounts,
    audit,
    claims,
    collusion,
    ledger,
    rows,
    scheduling,
    totals,
    verification,
)
from idlegrid.store import jobs as job_sql
from idlegrid.store import nodes as node_sql
from idlegrid.store import replenish as replenish_sql
from idlegrid.store import results as result_sql
from idlegrid.store import sqlite_driver as _sqlite_driver  # noqa: F401  registers sqlite+idlegrid
from idlegrid.store.base import (
    AccountRecord,
    Assignment,
    Claimer,
    ClaimMiss,
    CreatedJob,
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
    Replenished,
    ResultReceipt,
    RunningTask,
    ShardDecision,
    ShardForVerify,
    ShardRecord,
    StateCounts,
    StoreConflict,
    TaskInput,
    TokenInfo,
    TokenRecord,
)
from idlegrid.store.blob_owners import BlobAccessSql
from idlegrid.store.rounds import TrainingRoundsSql
from idlegrid.store.schema import tasks
from idlegrid.store.usage import UsageSql
from idlegrid.store.web import DashboardSql
from idlegrid.store.writelock import WriteLock, urgent
from idlegrid.verification.trust import TrustSettings

# PostgreSQL aborts one side of a deadlock (40P01) or a serialization conflict (40001);
# the transaction it rolled back is safe to run again.
_RETRY_SQLSTATES = frozenset({"40P01", "40001"})
_RETRIES = 4
# Any fixed number: the key of the advisory lock that serializes migrations.
_MIGRATION_LOCK = 0x1D1E
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


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


def _is_conflict(exc: DBAPIError) -> bool:
    return getattr(exc.orig, "sqlstate", None) in _RETRY_SQLSTATES


def _retry_conflicts(
    method: Callable[Concatenate[SqlStore, P], Coroutine[Any, Any, R]],
) -> Callable[Concatenate[SqlStore, P], Coroutine[Any, Any, R]]:
    """Run a one-transaction method again when PostgreSQL aborted it for a deadlock.

    Inside a `batch` the whole batch was aborted: the batch raises, not the method retries.
    """

    @functools.wraps(method)
    async def wrapper(self: SqlStore, *args: P.args, **kwargs: P.kwargs) -> R:
        if _BATCH.get() is not None:
            return await method(self, *args, **kwargs)
        for attempt in range(_RETRIES):
            try:
                return await method(self, *args, **kwargs)
            except DBAPIError as exc:
                if not _is_conflict(exc) or attempt == _RETRIES - 1:
                    raise
                await asyncio.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

    return wrapper


class SqlStore(TrainingRoundsSql, DashboardSql, BlobAccessSql, UsageSql):
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

        All or nothing: if anything inside raises, every write of the batch is rolled
        back. On SQLite every commit waits for an fsync, one at a time behind the write
        lock: a batch of claims or results pays it once. The transaction (and the write
        lock) starts with the first write inside; reads after it see the batch's writes.
        On PostgreSQL a batch saves the round trips and the pool checkouts of a
        transaction a call; it starts with the first call inside. There a deadlock or a
        serialization failure aborts the whole batch: it raises `StoreConflict`, and the
        caller may run it again (`run_batch` does).
        """
        if _BATCH.get() is not None:
            yield
            return
        batch = _Batch(contextlib.AsyncExitStack())
        try:
            async with batch.stack, totals.deferred() as pending:
                token = _BATCH.set(batch)
                try:
                    yield
                finally:
                    _BATCH.reset(token)
                if pending:  # the shared rows last, just before the commit
                    await totals.write(await self._batch_connection(batch), pending)
        except DBAPIError as exc:
            if _is_conflict(exc):
                raise StoreConflict(f"the database aborted a batch: {exc.orig}") from exc
            raise
        for action in batch.after_commit:
            try:
                await action()
            except Exception:  # committed: one failed follow-up must not undo the rest
                log.exception("after-commit action of a store batch failed")

    async def run_batch(self, work: Callable[[], Awaitable[R]]) -> R:
        """`work()` in one `batch`, run again (a few times) when a conflict aborted it."""
        for attempt in range(_RETRIES):
            try:
                async with self.batch():
                    return await work()
            except StoreConflict:
                if attempt == _RETRIES - 1:
                    raise
                await asyncio.sleep(0.01 * 2**attempt)
        raise AssertionError("unreachable")

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
            yield await self._batch_connection(batch)
            return
        if self._write_lock is None:
            async with self.engine.begin() as conn, totals.deferred() as pending:
                yield conn
                await totals.write(conn, pending)
            return
        async with self._write_lock, self.engine.begin() as conn, totals.deferred() as pending:
            yield conn
            await totals.write(conn, pending)

    @contextlib.asynccontextmanager
    async def _read(self) -> AsyncIterator[AsyncConnection]:
        batch = _BATCH.get()
        # SQLite: a read does not take the write lock; PostgreSQL: one connection a batch.
        if batch is not None and (batch.conn is not None or self._write_lock is None):
            yield await self._batch_connection(batch)
            return
        async with self.engine.connect() as conn:
            yield conn

    async def _batch_connection(self, batch: _Batch) -> AsyncConnection:
        if batch.conn is None:
            if self._write_lock is not None:
                await batch.stack.enter_async_context(self._write_lock)
            batch.conn = await batch.stack.enter_async_context(self.engine.begin())
        return batch.conn

    # -- accounts and tokens (store/accounts.py) -----------------------------------------

    async def create_account(
        self, name: str, *, is_admin: bool, now: float, role: str = "researcher"
    ) -> AccountRecord:
        async with self._tx() as conn:
            return await accounts.create_account(conn, name, is_admin=is_admin, now=now, role=role)

    async def get_account(self, name: str) -> AccountRecord | None:
        async with self._read() as conn:
            return await accounts.get_account(conn, name)

    async def account_by_id(self, account_id: int) -> AccountRecord | None:
        async with self._read() as conn:
            return await accounts.account_by_id(conn, account_id)

    async def count_accounts(self) -> int:
        async with self._read() as conn:
            return await accounts.count_accounts(conn)

    async def add_token(
        self, account_id: int, *, kind: str, token_hash: str, prefix: str, label: str, now: float
    ) -> int:
        async with self._tx() as conn:
            return await accounts.add_token(
                conn, account_id, kind=kind, token_hash=token_hash, prefix=prefix, label=label,
                now=now,
            )  # fmt: skip

    async def find_token(self, token_hash: str) -> TokenInfo | None:
        async with self._read() as conn:
            return await accounts.find_token(conn, token_hash)

    async def list_tokens(
        self, account_id: int | None, *, include_revoked: bool = False
    ) -> list[TokenRecord]:
        async with self._read() as conn:
            return await accounts.list_tokens(conn, account_id, include_revoked=include_revoked)

    async def revoke_token(
        self, token_id: int, *, account_id: int | None, now: float
    ) -> TokenRecord | None:
        async with self._tx() as conn:
            return await accounts.revoke_token(conn, token_id, account_id=account_id, now=now)

    # -- nodes (store/nodes.py) ------------------------------------------------------------

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
        )
        async with self._tx() as conn:
            return await node_sql.register_node(
                conn, account_id, node_key, values=values, now=now, limits=limits
            )

    async def set_node_offline(self, node_id: int, *, now: float) -> None:
        async with self._tx() as conn:
            await node_sql.set_node_offline(conn, node_id, now=now)

    @_retry_conflicts
    async def touch_nodes(self, seen: dict[int, float]) -> None:
        """Record last-seen times and add the time since the previous touch to uptime."""
        if not seen:
            return
        async with self._tx() as conn:
            await node_sql.touch_nodes(conn, seen)

    async def list_nodes(self, account_id: int | None = None) -> list[NodeRecord]:
        async with self._read() as conn:
            return await node_sql.list_nodes(conn, account_id)

    async def node_tasks(self, node_id: int) -> list[NodeTask]:
        async with self._read() as conn:
            return await node_sql.node_tasks(conn, node_id)

    async def node_trust(self, node_id: int) -> list[NodeTrust]:
        async with self._read() as conn:
            return await node_sql.list_trust(conn, node_id)

    async def measured_speeds(self, node_id: int, *, last: int = 50) -> dict[str, float]:
        async with self._read() as conn:
            return await node_sql.measured_speeds(conn, node_id, last=last)

    async def state_counts(self) -> StateCounts:
        async with self._read() as conn:
            return await node_sql.state_counts(conn)

    # -- jobs (store/jobs.py) --------------------------------------------------------------

    async def create_job(self, job: NewJob, *, now: float) -> CreatedJob:
        async with self._tx() as conn:
            job_id = await job_sql.insert_job(conn, job, now=now)
            first = await replenish_sql.replenish(conn, now=now, job_id=job_id)
            record = await rows.job(conn, job_id)
        assert record is not None
        return CreatedJob(record, first.ready)

    async def get_job(self, job_id: int) -> JobRecord | None:
        async with self._read() as conn:
            return await rows.job(conn, job_id)

    async def list_jobs(
        self, account_id: int | None, *, limit: int, offset: int
    ) -> list[JobRecord]:
        async with self._read() as conn:
            return await job_sql.list_jobs(conn, account_id, limit=limit, offset=offset)

    async def list_shards(self, job_id: int) -> list[ShardRecord]:
        async with self._read() as conn:
            return await job_sql.list_shards(conn, job_id)

    async def count_open_jobs(self, account_id: int) -> int:
        async with self._read() as conn:
            return await job_sql.count_open_jobs(conn, account_id)

    async def cancel_job(self, job_id: int, *, now: float) -> list[NodeTask]:
        return await self._end_job(job_id, JobState.CANCELLED, error=None, now=now)

    async def fail_job(self, job_id: int, *, error: str, now: float) -> list[NodeTask]:
        return await self._end_job(job_id, JobState.FAILED, error=error, now=now)

    @_retry_conflicts
    async def _end_job(
        self, job_id: int, target: JobState, *, error: str | None, now: float
    ) -> list[NodeTask]:
        async with self._tx() as conn:
            return await job_sql.end_job(conn, job_id, target, error=error, now=now)

    async def canonical_outputs(self, job_id: int) -> list[str]:
        async with self._read() as conn:
            return await job_sql.canonical_outputs(conn, job_id)

    async def complete_job(
        self, job_id: int, *, result_hash: str, result_size: int, now: float
    ) -> bool:
        async with self._tx() as conn:
            return await job_sql.complete_job(
                conn, job_id, result_hash=result_hash, result_size=result_size, now=now
            )

    async def jobs_to_assemble(self) -> list[int]:
        async with self._read() as conn:
            return await job_sql.jobs_to_assemble(conn)

    # -- claims (store/claims.py) ----------------------------------------------------------

    async def ready_tasks(self, *, limit: int) -> list[ReadyTask]:
        async with self._read() as conn:
            return await claims.ready_tasks(conn, limit=limit)

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
            return await claims.claim_task(
                conn, task_id, claimer, kind=kind, lease_deadline=lease_deadline,
                distinct=distinct, trust=self.trust, now=now,
            )  # fmt: skip

    @_retry_conflicts
    async def claim_tasks(
        self, lease_deadlines: dict[int, float], claimer: Claimer, *, kind: str, now: float
    ) -> list[Assignment] | ClaimMiss:
        if not lease_deadlines:
            return []
        # A node waits for this commit with free slots: ahead of background commits.
        with urgent():
            async with self._tx() as conn:
                return await claims.claim_tasks(
                    conn, lease_deadlines, claimer, kind=kind, trust=self.trust, now=now
                )

    @_retry_conflicts
    async def release_claims(
        self, task_ids: Sequence[int], node_id: int, *, now: float
    ) -> list[int]:
        if not task_ids:
            return []
        async with self._tx() as conn:
            return await claims.release_claims(conn, task_ids, node_id, now=now)

    @_retry_conflicts
    async def run_alone(
        self, shard_id: int, task_id: int, *, spot_check: bool, checkers: int = 1
    ) -> list[int]:
        async with self._tx() as conn:
            return await claims.run_alone(
                conn, shard_id, task_id, spot_check=spot_check, checkers=checkers
            )

    async def escalate(self, shard_id: int, *, target: int, quorum: int, now: float) -> bool:
        async with self._tx() as conn:
            return await claims.escalate(
                conn, shard_id, target=target, quorum=quorum, trust=self.trust, now=now
            )

    @_retry_conflicts
    async def suspect(self, task_ids: Sequence[int], *, now: float) -> None:
        async with self._tx() as conn:
            for task_id in sorted(set(task_ids)):  # one lock order (by task, not node)
                await ledger.suspect(conn, task_id, settings=self.trust, now=now)

    @_retry_conflicts
    async def flag_colluders(self, groups: Sequence[Sequence[int]], *, now: float) -> list[int]:
        async with self._tx() as conn:
            return await collusion.flag_colluders(
                conn, groups, flag_after=self.trust.collusion_flag_after, now=now
            )

    async def unvouched_alone(self, job_id: int) -> list[int]:
        async with self._read() as conn:
            return await audit.unvouched_alone(conn, job_id)

    @_retry_conflicts
    async def audit(self, shard_ids: Sequence[int], *, now: float) -> list[ReadyTask]:
        async with self._tx() as conn:
            return await audit.audit(conn, shard_ids, now=now)

    async def raise_target(self, shard_id: int, *, results_seen: int) -> bool:
        async with self._tx() as conn:
            return await claims.raise_target(conn, shard_id, results_seen=results_seen)

    # -- results (store/results.py) --------------------------------------------------------

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
        async with self._tx() as conn:
            return await result_sql.accept_results(
                conn, node_id, results, trust=self.trust, now=now
            )

    async def task_inputs(self, task_ids: Sequence[int], node_id: int) -> dict[int, TaskInput]:
        async with self._read() as conn:
            return await result_sql.task_inputs(conn, task_ids, node_id)

    async def record_failure(self, task_id: int, node_id: int, *, reason: str, now: float) -> bool:
        async with self._tx() as conn:
            return await result_sql.record_failure(
                conn, task_id, node_id, reason=reason, trust=self.trust, now=now
            )

    async def expire_overdue(self, *, now: float) -> list[NodeTask]:
        return await self._expire(tasks.c.lease_deadline < now, now=now)

    async def expire_node_tasks(self, node_id: int, *, now: float) -> list[NodeTask]:
        return await self._expire(tasks.c.node_id == node_id, now=now)

    async def expire_task(self, task_id: int, *, now: float) -> list[NodeTask]:
        return await self._expire(tasks.c.id == task_id, now=now)

    @_retry_conflicts
    async def _expire(self, where: Any, *, now: float) -> list[NodeTask]:
        """Expire the assigned tasks matching `where` (`result_sql.expire`)."""
        async with self._tx() as conn:
            return await result_sql.expire(conn, where, trust=self.trust, now=now)

    # -- verification (store/verification.py) ----------------------------------------------

    async def shards_to_verify(self, *, limit: int) -> list[int]:
        async with self._read() as conn:
            return await verification.shards_to_verify(conn, limit=limit)

    async def shard_for_verify(self, shard_id: int) -> ShardForVerify | None:
        return (await self.shards_for_verify([shard_id])).get(shard_id)

    async def shards_for_verify(self, shard_ids: Sequence[int]) -> dict[int, ShardForVerify]:
        async with self._read() as conn:
            return await verification.shards_for_verify(conn, shard_ids, trust=self.trust)

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
        async with self._tx() as conn:
            decided = await verification.decide(conn, decisions, trust=self.trust, now=now)
        # Counted after the commit: when two processes decide a job's last two shards at
        # once, the later commit then sees both (inside the transactions neither would).
        open_left: dict[int, int] = {}
        if decided.won:
            async with self._read() as conn:
                job_ids = [decided.job_of[shard_id] for shard_id in decided.won]
                open_left = await verification.open_shards_left(conn, job_ids)
        return verification.outcomes(decisions, decided, open_left)

    async def late_results(
        self, *, limit: int, task_ids: Sequence[int] | None = None
    ) -> list[LateResult]:
        async with self._read() as conn:
            return await verification.late_results(conn, limit=limit, task_ids=task_ids)

    @_retry_conflicts
    async def judge_late(self, task_id: int, *, agrees: bool, now: float) -> None:
        async with self._tx() as conn:
            await verification.judge_late(conn, task_id, agrees=agrees, trust=self.trust, now=now)

    # -- top-up (store/replenish.py) and scheduling (store/scheduling.py) ------------------

    @_retry_conflicts
    async def replenish(self, *, now: float) -> Replenished:
        async with self._tx() as conn:
            return await replenish_sql.replenish(conn, now=now, job_id=None)

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


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    # WAL lets readers run beside the writer; synchronous=FULL makes a commit durable
    # before the coordinator acknowledges a result to its node.
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()
