"""Lifecycles of jobs, shards, tasks, nodes, training rounds and uploads: enums plus one
transition table.

The store makes every state change through `store/lifecycle.py`, which reads this table
and calls `check_transition` on each move before it writes, so an illegal move (a
cancelled job becoming completed, a completed task being reassigned) raises instead of
quietly corrupting state:

- an update names its target and the states it expects to move from (`sources_of` the
  target when it names none); each of those moves is checked when the statement is built,
  so an illegal one is a programming error that raises before any SQL runs;
- the update is conditional in SQL (`WHERE state IN (sources)`), so of two coordinator
  processes racing on one row the loser changes nothing; for most callers no row moved
  is a normal outcome, not an error;
- where a caller needs one row moved (a row it read and judged movable), a row that did
  not move and is found in a state from which the move is illegal raises
  `IllegalTransition` with its table, id and both states, and is logged.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping


class JobState(enum.StrEnum):
    QUEUED = "queued"  # shards wait for nodes
    RUNNING = "running"  # at least one task was assigned
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


class ShardState(enum.StrEnum):
    OPEN = "open"  # needs results
    DONE = "done"  # has a canonical result
    FAILED = "failed"
    CANCELLED = "cancelled"


class TaskState(enum.StrEnum):
    READY = "ready"  # waiting in the ready queue for a node
    ASSIGNED = "assigned"  # leased to a node until its lease deadline
    # Lease lost: an error of its node, for good unless a result still comes (it counts
    # while the shard is open, and is checked against the canonical one after).
    EXPIRED = "expired"
    COMPLETED = "completed"  # result received and stored
    FAILED = "failed"  # the node reported a failure
    CANCELLED = "cancelled"  # no longer needed (shard decided, job cancelled)


class NodeState(enum.StrEnum):
    ONLINE = "online"
    OFFLINE = "offline"


class TrainingRoundState(enum.StrEnum):
    OPEN = "open"  # its tasks train from the round's weights; updates are counted
    CLOSED = "closed"  # aggregated (or, the last one, evaluated); late updates are dropped


class UploadState(enum.StrEnum):
    PARTIAL = "partial"  # chunks still arriving
    DONE = "done"  # every byte arrived and is stored as a blob


TERMINAL_JOB_STATES = frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED})
LIVE_TASK_STATES = frozenset({TaskState.READY, TaskState.ASSIGNED})

_ALLOWED: Mapping[type[enum.Enum], Mapping[enum.Enum, frozenset[enum.Enum]]] = {
    JobState: {
        JobState.QUEUED: frozenset(
            {JobState.RUNNING, JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED}
        ),
        JobState.RUNNING: frozenset({JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED}),
        JobState.COMPLETED: frozenset(),
        JobState.FAILED: frozenset(),
        JobState.CANCELLED: frozenset(),
    },
    ShardState: {
        ShardState.OPEN: frozenset({ShardState.DONE, ShardState.FAILED, ShardState.CANCELLED}),
        # Decided by a node alone that was then caught lying: replicated again.
        ShardState.DONE: frozenset({ShardState.OPEN}),
        ShardState.FAILED: frozenset(),
        ShardState.CANCELLED: frozenset(),
    },
    TaskState: {
        TaskState.READY: frozenset({TaskState.ASSIGNED, TaskState.CANCELLED}),
        TaskState.ASSIGNED: frozenset(
            {TaskState.COMPLETED, TaskState.FAILED, TaskState.EXPIRED, TaskState.CANCELLED}
        ),
        # An expired task may still deliver (late result) or report failure.
        TaskState.EXPIRED: frozenset({TaskState.COMPLETED, TaskState.FAILED, TaskState.CANCELLED}),
        TaskState.COMPLETED: frozenset(),
        TaskState.FAILED: frozenset(),
        # A result that was on its way when its shard was decided is still stored (as
        # late) and checked against the canonical one: it counts for the node's trust.
        TaskState.CANCELLED: frozenset({TaskState.COMPLETED}),
    },
    NodeState: {
        NodeState.ONLINE: frozenset({NodeState.OFFLINE}),
        NodeState.OFFLINE: frozenset({NodeState.ONLINE}),
    },
    TrainingRoundState: {
        TrainingRoundState.OPEN: frozenset({TrainingRoundState.CLOSED}),
        TrainingRoundState.CLOSED: frozenset(),
    },
    UploadState: {
        UploadState.PARTIAL: frozenset({UploadState.DONE}),
        UploadState.DONE: frozenset(),
    },
}


class IllegalTransition(RuntimeError):
    """A state change that the lifecycle does not allow."""


def can_transition(current: enum.Enum, target: enum.Enum) -> bool:
    """Whether `current -> target` is a legal move of the same lifecycle."""
    if type(current) is not type(target):
        return False
    return target in _ALLOWED[type(current)][current]


def check_transition(current: enum.Enum, target: enum.Enum) -> None:
    """Raise IllegalTransition unless `current -> target` is legal."""
    if not can_transition(current, target):
        raise IllegalTransition(f"{type(current).__name__}: {current.value} -> {target.value}")


def sources_of(target: enum.Enum) -> frozenset[enum.Enum]:
    """Every state from which `target` may be reached (for conditional SQL updates)."""
    table = _ALLOWED[type(target)]
    return frozenset(state for state, targets in table.items() if target in targets)
