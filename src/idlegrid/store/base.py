"""The store's records and errors: what its roles (`store.jobs`, `store.claims`, ...) take
and return.

Callers see plain frozen records, never rows or sessions. Every operation is one
transaction; the ones that change task or shard state are conditional updates, so they
stay correct when several coordinator processes share one database.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from idlegrid.states import JobState, NodeState, ShardState, TaskState, TrainingRoundState
from idlegrid.verification.credit import CreditTotals
from idlegrid.verification.trust import Trust


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
    # Results each shard asks for at first, if not `replication` (a kind verified by
    # checks asks for its output first; the verifier asks for its check after).
    first_target: int | None = None


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
    # Ahead of everything else in the queue (`rows.is_urgent`): a replica of a shard sent
    # back to full replication (a node was caught lying), or any task of a shard that has
    # a result already (a dispute's next replica, a check): checks come before more work,
    # and a begun shard is finished before another is started.
    urgent: bool = False


@dataclass(frozen=True)
class Claimer:
    """Who asks for a task: what "distinct replicas" and quotas are checked against."""

    node_id: int
    account_id: int
    network: str
    backend: str
    # Its llama.cpp build as it reported it ("": none): recorded on the task it claims.
    build: str = ""


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
    # A check task (kinds verified by checks): the output it checks, and its size.
    check_hash: str | None = None
    check_size: int = 0


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
    """A node's report that it finished a task, as `store.results.accept_results` takes it."""

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
    # A check task's result: the output it checked (kinds verified by checks).
    checks_hash: str | None = None
    # The build its node reported when it claimed the task (kinds that name builds).
    build: str | None = None
    finished_at: float | None = None


@dataclass(frozen=True)
class KnownAnswer:
    """A known-answer check's result: the planted claim it was given, the verdict the
    coordinator knows is right (`verification.probes`), and its verdict's blob."""

    task_id: int
    node_id: int
    output_hash: str
    planted_hash: str
    known: str
    job_id: int


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
class ShardReplica:
    """A task of a shard that bars others from its node (and, if it ran, from its
    account and network): `verification.stalemate.Replica` as the store reads it."""

    node_id: int
    account_id: int | None
    network: str | None
    ran: bool
    # An expired replica whose node may still send its result late: until when it is
    # waited for (`verification.stalemate.late_until`); None for any other.
    late_until: float | None = None
    # False: a check that bars nobody (`rows.bars_nobody`).
    bars: bool = True


@dataclass(frozen=True)
class StalledShard:
    """An open shard with results, a ready replica and none held: perhaps no node can
    run that replica (`verification.stalemate`)."""

    shard_id: int
    job_id: int
    index: int
    kind: str
    replicas: list[ShardReplica]
    # Its ready replicas are all spot checks, for trusted nodes only.
    checks_only: bool = False


@dataclass(frozen=True)
class BuildWait:
    """An output that waits for a check on the build it names (`store.check_routing`):
    its shard's index, the node that made it, the build, and when its shard's latest
    result came (the wait runs from then)."""

    shard_index: int
    node_id: int
    build: str
    since: float


@dataclass(frozen=True)
class ShardDecision:
    """What the verifier decided for a shard (`SqlStore.decide_shards` records it)."""

    shard_id: int
    canonical_task_id: int | None
    valid: Sequence[int]
    invalid: Sequence[int]
    fail_reason: str | None
    # Of `valid`: checks that passed the output, paid once their node's word is confirmed.
    held: Sequence[int] = ()
    # Undecided: results set aside, judged neither way (outcome "moot").
    moot: Sequence[int] = ()


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
    """A live task of a shard that might straggle (see `store.scheduling.running_shards`)."""

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
