"""The store interface: the durable truth of accounts, nodes, jobs, shards and tasks.

Records, errors, and the store's roles (small protocols) that `Store` combines. Callers
see plain frozen records, never rows or sessions. Every method is one transaction; the
ones that change task or shard state are conditional updates, so they stay correct when
several coordinator processes share one database.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

from idlegrid.states import JobState, NodeState, ShardState, TaskState, TrainingRoundState
from idlegrid.store.blob_owners import BlobAccessStore
from idlegrid.store.usage import UsageStore
from idlegrid.verification.credit import CreditTotals
from idlegrid.verification.trust import Trust

T = TypeVar("T")


class AccountExists(ValueError):
    """`create_account` with a name that is taken (perhaps a moment ago, by another process)."""


class StoreConflict(RuntimeError):
    """The database aborted a batch to resolve a conflict with another transaction (a
    deadlock): nothing of it was written, and running it again may succeed."""


class RegistrationRefused(PermissionError):
    """A node may not register: its key is another account's, or a Sybil limit is hit."""


@dataclass(frozen=True)
class RegistrationLimits:
    """Sybil limits on new nodes (a reconnecting node is not a new one)."""

    max_nodes_per_account: int
    per_account_per_hour: int
    per_address_per_hour: int


@dataclass(frozen=True)
class TokenInfo:
    token_id: int
    account_id: int
    account_name: str
    kind: Literal["api", "node"]
    is_admin: bool


@dataclass(frozen=True)
class TokenRecord:
    """A token as listed: never its secret or hash, only the prefix it is shown by."""

    id: int
    account: str
    kind: str
    prefix: str
    label: str
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class AccountRecord:
    id: int
    name: str
    is_admin: bool
    flagged_at: float | None = None
    flag_reason: str | None = None
    credit: CreditTotals = CreditTotals()


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
    network: str = ""
    suspended_at: float | None = None
    credit: CreditTotals = CreditTotals()


@dataclass(frozen=True)
class NodeTrust:
    """A node's trust on one kind and backend, with its quota use today."""

    node_id: int
    kind: str
    backend: str
    trust: Trust
    quota_used_today: int


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
    target: int = 1
    quorum: int = 1
    mode: str | None = None
    cost_flops: float = 0.0


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
    # A replica of a shard sent back to full replication (a node was caught lying):
    # ahead of everything else in the queue, so the check comes before more work.
    urgent: bool = False


@dataclass(frozen=True)
class Claimer:
    """Who asks for a task: what "distinct replicas" and quotas are checked against."""

    node_id: int
    account_id: int
    network: str
    backend: str


@dataclass(frozen=True)
class Distinct:
    """Which replicas of one shard must differ: never two on one node; by account and by
    network when set (off for a grid of one machine's workers)."""

    accounts: bool = True
    networks: bool = True


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
    # The claimer's trust on this kind and backend, and whether this is the first
    # replica of its shard to be handed out (then it may run alone, see `run_alone`).
    trust: Trust = Trust()
    first_replica: bool = False


class ClaimMiss(enum.Enum):
    GONE = "gone"  # no longer ready: claimed elsewhere, cancelled
    # Still ready, but this node may not take it: it (or its account or network) already
    # ran a replica of the shard, or it is a spot check and the node is not trusted.
    CONFLICT = "conflict"
    QUOTA = "quota"  # the node used its daily quota of this kind
    SUSPENDED = "suspended"  # the node is suspended for invalid results


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
class NewResult:
    """A node's report that it finished a task, as `Store.accept_results` takes it."""

    task_id: int
    output_hash: str
    output_size: int
    elapsed_s: float


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
    trust: Trust = Trust()


@dataclass(frozen=True)
class LateResult:
    """A result that arrived after its shard was decided, with what to check it against."""

    task_id: int
    node_id: int
    output_hash: str
    canonical_hash: str | None
    job_id: int


@dataclass(frozen=True)
class ShardForVerify:
    shard: ShardRecord
    job: JobRecord
    results: list[ShardResult]


@dataclass(frozen=True)
class ShardDecision:
    """What the verifier decided for a shard (`Store.decide_shards` records it)."""

    shard_id: int
    canonical_task_id: int | None
    valid: Sequence[int]
    invalid: Sequence[int]
    fail_reason: str | None


@dataclass(frozen=True)
class DecisionOutcome:
    decided: bool
    to_cancel: list[NodeTask]
    job_done: bool


@dataclass(frozen=True)
class NewRound:
    """A training round about to be opened (its blobs already in the blob store)."""

    round: int
    final: bool
    weights_digest: str
    checkpoint_hash: str
    momentum_hash: str
    update_hash: str | None
    first_shard: int
    train_shards: int
    eval_shard: int | None
    deadline: float


@dataclass(frozen=True)
class RoundRecord:
    job_id: int
    round: int
    state: TrainingRoundState
    final: bool
    weights_digest: str
    checkpoint_hash: str
    momentum_hash: str
    update_hash: str | None
    first_shard: int
    train_shards: int
    eval_shard: int | None
    opened_at: float
    deadline: float
    closed_at: float | None
    metrics: dict[str, Any]

    def holds(self, shard_index: int) -> bool:
        """Whether a shard of the job belongs to this round (training or evaluation)."""
        training = self.first_shard <= shard_index < self.first_shard + self.train_shards
        return training or shard_index == self.eval_shard


@dataclass(frozen=True)
class RoundTraffic:
    """What crossed the network for a round's tasks, as the coordinator saw it."""

    payload_bytes: int  # task payloads fetched by the nodes they were assigned to
    output_bytes: int  # result blobs uploaded
    nodes: tuple[int, ...]  # nodes that returned a result


@dataclass(frozen=True)
class RoundAdvance:
    won: bool  # False: the round was closed already (another pass or process did it)
    ready: list[ReadyTask]
    to_cancel: list[NodeTask]


class StateCounts(NamedTuple):
    """How many tasks and how many jobs are in each state (for metrics)."""

    tasks: dict[str, int]
    jobs: dict[str, int]


class CreatedJob(NamedTuple):
    job: JobRecord
    ready: list[ReadyTask]  # its first tasks, for the ready queue


class HeldTask(NamedTuple):
    """A task a node holds, with its shard."""

    shard_id: int
    task: NodeTask


class Replenished(NamedTuple):
    """What a top-up pass did."""

    ready: list[ReadyTask]  # tasks it made, for the ready queue
    failed_jobs: list[int]  # jobs it failed: a shard ran out of attempts
    to_cancel: list[NodeTask]  # held tasks of those jobs, to tell their nodes


class TrainingFinish(NamedTuple):
    won: bool  # False: the job had ended already (another pass or process did it)
    to_cancel: list[NodeTask]


class DueRound(NamedTuple):
    job_id: int
    round_number: int


@dataclass(frozen=True)
class RunningTask:
    """A live task of a shard that might straggle (see `DispatchStore.running_shards`)."""

    task_id: int
    shard_id: int
    job_id: int
    node_id: int
    kind: str
    items: int
    cost_flops: float
    assigned_at: float
    # The holder's benchmark as it sent it (protocol.Benchmark fields).
    node_benchmark: dict[str, Any]


# -- the store's roles: each part of the coordinator needs only some of them -------------


class AccountStore(Protocol):
    """Accounts and their API and node tokens."""

    async def create_account(
        self, name: str, *, is_admin: bool, now: float, role: str = "researcher"
    ) -> AccountRecord:
        """A new account; `AccountExists` when the name is taken. `role`: its dashboard
        role (a volunteer's account, made for a node token, uploads and submits nothing)."""
        ...

    async def get_account(self, name: str) -> AccountRecord | None: ...
    async def account_by_id(self, account_id: int) -> AccountRecord | None: ...
    async def count_accounts(self) -> int: ...
    async def add_token(
        self, account_id: int, *, kind: str, token_hash: str, prefix: str, label: str, now: float
    ) -> int: ...
    async def find_token(self, token_hash: str) -> TokenInfo | None: ...
    async def list_tokens(
        self, account_id: int | None, *, include_revoked: bool = False
    ) -> list[TokenRecord]:
        """Tokens of one account (None: every account), oldest first."""
        ...

    async def revoke_token(
        self, token_id: int, *, account_id: int | None, now: float
    ) -> TokenRecord | None:
        """Revoke a live token of `account_id` (None: of any account); None if no such."""
        ...


class NodeStore(Protocol):
    """Nodes: registration, presence, what they hold, their trust."""

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
        """Register or refresh a node; `RegistrationRefused` says why a new one may not."""
        ...

    async def set_node_offline(self, node_id: int, *, now: float) -> None: ...
    async def touch_nodes(self, seen: dict[int, float]) -> None: ...
    async def list_nodes(self, account_id: int | None = None) -> list[NodeRecord]: ...
    async def node_tasks(self, node_id: int) -> list[NodeTask]: ...
    async def node_trust(self, node_id: int) -> list[NodeTrust]: ...
    async def measured_speeds(self, node_id: int, *, last: int = 50) -> dict[str, float]:
        """FLOP/s per kind of the node's last validated tasks, as the coordinator timed
        them (assignment to result) against their shards' nominal cost; kinds it has
        no validated task of are absent."""
        ...

    async def state_counts(self) -> StateCounts:
        """How many tasks and how many jobs are in each state (for metrics)."""
        ...


class JobStore(Protocol):
    """Jobs and their shards: create, read, end."""

    async def create_job(self, job: NewJob, *, now: float) -> CreatedJob: ...
    async def get_job(self, job_id: int) -> JobRecord | None: ...
    async def list_jobs(
        self, account_id: int | None, *, limit: int, offset: int
    ) -> list[JobRecord]: ...
    async def list_shards(self, job_id: int) -> list[ShardRecord]: ...
    async def count_open_jobs(self, account_id: int) -> int:
        """The account's jobs that are queued or running."""
        ...

    async def cancel_job(self, job_id: int, *, now: float) -> list[NodeTask]: ...
    async def canonical_outputs(self, job_id: int) -> list[str]: ...
    async def complete_job(
        self, job_id: int, *, result_hash: str, result_size: int, now: float
    ) -> bool: ...
    async def fail_job(self, job_id: int, *, error: str, now: float) -> list[NodeTask]: ...
    async def jobs_to_assemble(self) -> list[int]: ...


class DispatchStore(Protocol):
    """Ready tasks and their claims, how a shard's replication changes, top-up."""

    async def ready_tasks(self, *, limit: int) -> list[ReadyTask]: ...
    async def claim_tasks(
        self, lease_deadlines: dict[int, float], claimer: Claimer, *, kind: str, now: float
    ) -> list[Assignment] | ClaimMiss:
        """Claim those of these tasks (of one kind) still ready for one node, at once.

        No distinct-replica rules: for tasks of replication-1 jobs only. The node's daily
        quota of the kind caps how many (the lowest ids are tried first); a suspended node
        gets none.
        """
        ...

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
        """Hand a ready task to a node, atomically; `distinct` None: replication 1."""
        ...

    async def release_claims(
        self, task_ids: Sequence[int], node_id: int, *, now: float
    ) -> list[int]:
        """Give back tasks claimed for a node that never heard of them (its connection
        closed first): cancelled, not attempts of their shards, not in its daily quota.
        Returns those released (still assigned to it); the shards are then topped up."""
        ...

    async def run_alone(
        self, shard_id: int, task_id: int, *, spot_check: bool, checkers: int = 1
    ) -> list[int]:
        """Let the first replica of a shard run unreplicated (adaptive replication).

        With `spot_check`, `checkers` other replicas stay, for trusted nodes only. Returns the
        ready tasks cancelled (to drop from the queue); none if another replica was
        handed out meanwhile (then the shard stays fully replicated).
        """
        ...

    async def escalate(self, shard_id: int, *, target: int, quorum: int, now: float) -> bool:
        """Send a shard run alone back to full replication (a spot check disagreed); its
        lone node runs nothing alone until it passes checks again."""
        ...

    async def suspect(self, task_ids: Sequence[int], *, now: float) -> None:
        """These results are outnumbered in a dispute, or failed a spot check: their
        nodes run nothing alone for now, and what they run or decided alone is
        replicated again (`ledger.suspect`)."""
        ...

    async def flag_colluders(self, groups: Sequence[Sequence[int]], *, now: float) -> list[int]:
        """Groups of wrong results that agreed: flag the accounts that were wrong together
        often enough (`store.collusion`); the accounts flagged now."""
        ...

    async def unvouched_alone(self, job_id: int) -> list[int]:
        """Per node that decided shards of the job alone, its latest one, if the node
        passed no check since (`store.recheck.unvouched_alone`)."""
        ...

    async def audit(self, shard_ids: Sequence[int], *, now: float) -> list[ReadyTask]:
        """Open decided lone shards again for a spot check each; the new ready tasks."""
        ...

    async def raise_target(self, shard_id: int, *, results_seen: int) -> bool:
        """One more replica for a shard whose `results_seen` results did not decide it."""
        ...

    async def replenish(self, *, now: float) -> Replenished:
        """Create tasks for open shards short of replicas; fail shards out of attempts."""
        ...

    async def ready_heads(self, *, per_job: int) -> list[ReadyTask]:
        """The oldest `per_job` ready tasks of every job, so no job hides behind another."""
        ...

    async def running_shards(self, *, limit: int) -> list[RunningTask]:
        """Held tasks of open shards in jobs with no ready task left and no backup yet."""
        ...

    async def add_backup_task(
        self, shard_id: int, node_id: int, *, lease_deadline: float, now: float
    ) -> Assignment | None:
        """Give `node_id` one extra (speculative) task of an open shard, already claimed.

        None when the shard is decided, already has a backup or a ready task, is out of
        attempts (`max_attempts`), or the node already holds or held a task of it.
        """
        ...


class ResultStore(Protocol):
    """What comes back from nodes: results, failures, missed leases."""

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
    async def accept_results(
        self, node_id: int, results: Sequence[NewResult], *, now: float
    ) -> list[ResultReceipt]:
        """Record several results of one node in one transaction; a receipt for each."""
        ...

    async def task_inputs(self, task_ids: Sequence[int], node_id: int) -> dict[int, TaskInput]:
        """The inputs of those of `task_ids` that `node_id` holds or held."""
        ...

    async def record_failure(
        self, task_id: int, node_id: int, *, reason: str, now: float
    ) -> bool: ...
    async def expire_overdue(self, *, now: float) -> list[NodeTask]: ...
    async def expire_task(self, task_id: int, *, now: float) -> list[NodeTask]: ...
    async def expire_node_tasks(self, node_id: int, *, now: float) -> list[NodeTask]: ...


class VerificationStore(Protocol):
    """Shards with results to judge, the verifier's decisions, late results."""

    async def shards_to_verify(self, *, limit: int) -> list[int]: ...
    async def shard_for_verify(self, shard_id: int) -> ShardForVerify | None: ...
    async def shards_for_verify(self, shard_ids: Sequence[int]) -> dict[int, ShardForVerify]:
        """`shard_for_verify` of several shards in one read; unknown ids are left out."""
        ...

    async def decide_shards(
        self, decisions: Sequence[ShardDecision], *, now: float
    ) -> list[DecisionOutcome]:
        """`decide_shard` of several shards in one transaction; outcomes in their order."""
        ...

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
    async def late_results(
        self, *, limit: int, task_ids: Sequence[int] | None = None
    ) -> list[LateResult]:
        """Results stored after their shard was decided and not judged yet, oldest first
        (only those of `task_ids`, if given)."""
        ...

    async def judge_late(self, task_id: int, *, agrees: bool, now: float) -> None:
        """Record whether a late result agreed with its shard's canonical one (or, with
        `agrees=False`, that any unjudged result is wrong)."""
        ...


class TrainingRoundStore(Protocol):
    """The training rounds of `diloco-train` jobs."""

    async def start_training(
        self, job_id: int, first: NewRound, extra_shards: Sequence[NewShard], *, now: float
    ) -> list[ReadyTask]: ...
    async def training_rounds(self, job_id: int) -> list[RoundRecord]: ...
    async def advance_round(
        self,
        job_id: int,
        closing: int,
        *,
        metrics: dict[str, Any],
        cancel_shards: Sequence[int],
        next_round: NewRound,
        shards: Sequence[NewShard],
        now: float,
    ) -> RoundAdvance: ...
    async def finish_training(
        self,
        job_id: int,
        final: int,
        *,
        metrics: dict[str, Any],
        result_hash: str,
        result_size: int,
        now: float,
    ) -> TrainingFinish: ...
    async def update_round_metrics(
        self, job_id: int, round_number: int, values: dict[str, Any]
    ) -> None: ...
    async def extend_round(self, job_id: int, round_number: int, *, deadline: float) -> None: ...
    async def due_rounds(self, *, now: float) -> list[DueRound]: ...
    async def round_traffic(self, job_id: int, shard_indexes: Sequence[int]) -> RoundTraffic: ...


class Store(
    AccountStore,
    NodeStore,
    JobStore,
    DispatchStore,
    ResultStore,
    VerificationStore,
    TrainingRoundStore,
    BlobAccessStore,
    UsageStore,
    Protocol,
):
    """Durable state. Implemented by `SqlStore` over SQLite (default) or PostgreSQL."""

    # Whether commits run one at a time (SQLite), so that fewer, bigger ones pay.
    serial_commits: bool

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    def batch(self) -> AbstractAsyncContextManager[None]:
        """The calls made inside share one transaction (committed once, all or nothing)."""
        ...

    async def after_commit(self, action: Callable[[], Awaitable[None]]) -> None:
        """Run `action` once the caller's writes are committed (at the end of a running
        `batch`, never if it rolls back; at once outside one)."""
        ...

    async def run_batch(self, work: Callable[[], Awaitable[T]]) -> T:
        """`work()` in one `batch`, run again (a few times) when it met `StoreConflict`."""
        ...
