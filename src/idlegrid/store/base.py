"""The store interface: the durable truth of accounts, nodes, jobs, shards and tasks.

Callers see plain frozen records, never rows or sessions. Every method is one
transaction; the ones that change task or shard state are conditional updates, so they
stay correct when several coordinator processes share one database.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from idlegrid.states import JobState, NodeState, ShardState, TaskState


class AccountExists(ValueError):
    """`create_account` with a name that is taken (perhaps a moment ago, by another process)."""


@dataclass(frozen=True)
class TokenInfo:
    token_id: int
    account_id: int
    account_name: str
    kind: Literal["api", "node"]
    is_admin: bool


@dataclass(frozen=True)
class AccountRecord:
    id: int
    name: str
    is_admin: bool


@dataclass(frozen=True)
class NodeRecord:
    id: int
    account_id: int
    node_key: str
    name: str
    state: NodeState
    hardware: dict[str, Any]
    benchmark: dict[str, Any]
    kinds: list[str]
    slots: int
    worker_version: str
    created_at: float
    last_seen_at: float
    connected_seconds: float


@dataclass(frozen=True)
class NewShard:
    """A shard about to be stored: its input blob must already be in the blob store."""

    index: int
    input_hash: str
    input_size: int
    items: int
    cost_flops: float


@dataclass(frozen=True)
class NewJob:
    account_id: int
    kind: str
    params: dict[str, Any]
    inputs: dict[str, str]
    replication: int
    min_quorum: int
    max_attempts: int
    priority: int
    shards: Sequence[NewShard]


@dataclass(frozen=True)
class JobRecord:
    id: int
    account_id: int
    kind: str
    params: dict[str, Any]
    inputs: dict[str, str]
    state: JobState
    replication: int
    min_quorum: int
    max_attempts: int
    priority: int
    shards_total: int
    items_total: int
    result_hash: str | None
    result_size: int | None
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    shard_counts: dict[str, int] = field(default_factory=dict)
    tasks_run: int = 0


@dataclass(frozen=True)
class ShardRecord:
    id: int
    job_id: int
    index: int
    state: ShardState
    items: int
    attempts: int
    input_hash: str
    output_hash: str | None
    error: str | None
    live_tasks: int = 0


@dataclass(frozen=True)
class ReadyTask:
    """An entry of the ready queue: enough to filter and rank without a database read."""

    task_id: int
    shard_id: int
    job_id: int
    kind: str
    priority: int
    created_at: float
    items: int
    cost_flops: float


@dataclass(frozen=True)
class Assignment:
    task_id: int
    shard_id: int
    job_id: int
    shard_index: int
    kind: str
    params: dict[str, Any]
    input_hash: str
    input_size: int
    lease_deadline: float


class ClaimMiss(enum.Enum):
    GONE = "gone"  # no longer ready: claimed elsewhere, cancelled
    CONFLICT = "conflict"  # still ready, but this node already ran a replica of its shard


@dataclass(frozen=True)
class NodeTask:
    """A task a node holds (for cancels and reconnects)."""

    task_id: int
    node_id: int
    state: TaskState


ReceiptStatus = Literal["accepted", "late", "duplicate", "rejected"]


@dataclass(frozen=True)
class ResultReceipt:
    status: ReceiptStatus
    reason: str = ""
    shard_id: int | None = None
    job_id: int | None = None


@dataclass(frozen=True)
class TaskInput:
    job_id: int
    shard_id: int
    input_hash: str


@dataclass(frozen=True)
class ShardResult:
    """A completed, not-yet-rejected result of a shard, for the verifier."""

    task_id: int
    node_id: int
    output_hash: str
    output_size: int
    outcome: str | None


@dataclass(frozen=True)
class ShardForVerify:
    shard: ShardRecord
    job: JobRecord
    results: list[ShardResult]


@dataclass(frozen=True)
class DecisionOutcome:
    decided: bool
    to_cancel: list[NodeTask]
    job_done: bool


class Store(Protocol):
    """Durable state. Implemented by `SqlStore` over SQLite (default) or PostgreSQL."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    def batch(self) -> AbstractAsyncContextManager[None]:
        """The calls made inside share one transaction (committed once, all or nothing)."""
        ...

    # accounts and tokens
    async def create_account(self, name: str, *, is_admin: bool, now: float) -> AccountRecord: ...
    async def get_account(self, name: str) -> AccountRecord | None: ...
    async def count_accounts(self) -> int: ...
    async def add_token(
        self, account_id: int, *, kind: str, token_hash: str, prefix: str, label: str, now: float
    ) -> int: ...
    async def find_token(self, token_hash: str) -> TokenInfo | None: ...

    # nodes
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
    ) -> NodeRecord: ...
    async def set_node_offline(self, node_id: int, *, now: float) -> None: ...
    async def touch_nodes(self, seen: dict[int, float]) -> None: ...
    async def list_nodes(self, account_id: int | None = None) -> list[NodeRecord]: ...
    async def node_tasks(self, node_id: int) -> list[NodeTask]: ...
    async def state_counts(self) -> tuple[dict[str, int], dict[str, int]]:
        """How many tasks and how many jobs are in each state (for metrics)."""
        ...

    # jobs
    async def create_job(self, job: NewJob, *, now: float) -> tuple[JobRecord, list[ReadyTask]]: ...
    async def get_job(self, job_id: int) -> JobRecord | None: ...
    async def list_jobs(
        self, account_id: int | None, *, limit: int, offset: int
    ) -> list[JobRecord]: ...
    async def list_shards(self, job_id: int) -> list[ShardRecord]: ...
    async def cancel_job(self, job_id: int, *, now: float) -> list[NodeTask]: ...
    async def canonical_outputs(self, job_id: int) -> list[str]: ...
    async def complete_job(
        self, job_id: int, *, result_hash: str, result_size: int, now: float
    ) -> bool: ...
    async def fail_job(self, job_id: int, *, error: str, now: float) -> list[NodeTask]: ...
    async def jobs_to_assemble(self) -> list[int]: ...

    # tasks
    async def ready_tasks(self, *, limit: int) -> list[ReadyTask]: ...
    async def claim_tasks(
        self, lease_deadlines: dict[int, float], node_id: int, *, now: float
    ) -> list[Assignment]:
        """Claim those of these tasks still ready for one node, in one statement.

        No one-replica-per-node rule: for tasks of replication-1 jobs only.
        """
        ...

    async def claim_task(
        self,
        task_id: int,
        node_id: int,
        *,
        lease_deadline: float,
        now: float,
        distinct_nodes: bool,
    ) -> Assignment | ClaimMiss: ...
    async def accept_result(
        self,
        task_id: int,
        node_id: int,
        *,
        output_hash: str,
        output_size: int,
        elapsed_s: float,
        now: float,
    ) -> ResultReceipt: ...
    async def task_input(self, task_id: int, node_id: int) -> TaskInput | None: ...
    async def record_failure(
        self, task_id: int, node_id: int, *, reason: str, now: float
    ) -> bool: ...
    async def expire_overdue(self, *, now: float) -> list[NodeTask]: ...
    async def expire_task(self, task_id: int, *, now: float) -> list[NodeTask]: ...
    async def expire_node_tasks(self, node_id: int, *, now: float) -> list[NodeTask]: ...
    async def shards_to_verify(self, *, limit: int) -> list[int]: ...
    async def shard_for_verify(self, shard_id: int) -> ShardForVerify | None: ...
    async def decide_shard(
        self,
        shard_id: int,
        *,
        canonical_task_id: int | None,
        valid: Sequence[int],
        invalid: Sequence[int],
        fail_reason: str | None,
        now: float,
    ) -> DecisionOutcome: ...
    async def replenish(
        self, *, now: float
    ) -> tuple[list[ReadyTask], list[int], list[NodeTask]]: ...
