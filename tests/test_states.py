"""Lifecycles: every legal move passes, every other move of every enum raises."""

from __future__ import annotations

import enum
import itertools

import pytest

from idlegrid.states import (
    LIVE_TASK_STATES,
    TERMINAL_JOB_STATES,
    IllegalTransition,
    JobState,
    NodeState,
    ShardState,
    TaskState,
    can_transition,
    check_transition,
    sources_of,
)

J, S, T, N = JobState, ShardState, TaskState, NodeState

LEGAL: set[tuple[enum.Enum, enum.Enum]] = {
    (J.QUEUED, J.RUNNING),
    (J.QUEUED, J.COMPLETED),
    (J.QUEUED, J.FAILED),
    (J.QUEUED, J.CANCELLED),
    (J.RUNNING, J.COMPLETED),
    (J.RUNNING, J.FAILED),
    (J.RUNNING, J.CANCELLED),
    (S.OPEN, S.DONE),
    (S.OPEN, S.FAILED),
    (S.OPEN, S.CANCELLED),
    (S.DONE, S.OPEN),  # decided alone by a node caught lying since: replicated again
    (T.READY, T.ASSIGNED),
    (T.READY, T.CANCELLED),
    (T.ASSIGNED, T.COMPLETED),
    (T.ASSIGNED, T.FAILED),
    (T.ASSIGNED, T.EXPIRED),
    (T.ASSIGNED, T.CANCELLED),
    (T.EXPIRED, T.COMPLETED),
    (T.EXPIRED, T.FAILED),
    (T.EXPIRED, T.CANCELLED),
    (T.CANCELLED, T.COMPLETED),  # a late result, still checked
    (N.ONLINE, N.OFFLINE),
    (N.OFFLINE, N.ONLINE),
}

ALL_PAIRS = [
    (current, target)
    for lifecycle in (JobState, ShardState, TaskState, NodeState)
    for current, target in itertools.product(lifecycle, lifecycle)
]


def _id(pair: tuple[enum.Enum, enum.Enum]) -> str:
    current, target = pair
    return f"{type(current).__name__}:{current.value}->{target.value}"


@pytest.mark.parametrize("pair", sorted(LEGAL, key=_id), ids=_id)
def test_legal_moves_pass(pair: tuple[enum.Enum, enum.Enum]) -> None:
    current, target = pair
    assert can_transition(current, target)
    check_transition(current, target)


ILLEGAL = [pair for pair in ALL_PAIRS if pair not in LEGAL]


@pytest.mark.parametrize("pair", ILLEGAL, ids=_id)
def test_every_other_move_raises(pair: tuple[enum.Enum, enum.Enum]) -> None:
    current, target = pair
    assert not can_transition(current, target)
    with pytest.raises(IllegalTransition) as raised:
        check_transition(current, target)
    # The message names the lifecycle and both states.
    assert type(current).__name__ in str(raised.value)
    assert f"{current.value} -> {target.value}" in str(raised.value)


def test_the_table_covers_illegal_moves_of_every_lifecycle() -> None:
    # Guards the parametrization itself: no lifecycle was forgotten.
    assert {type(current) for current, _ in ILLEGAL} == {JobState, ShardState, TaskState, NodeState}
    assert len(ALL_PAIRS) == 25 + 16 + 36 + 4


@pytest.mark.parametrize(
    ("current", "target"),
    [(J.QUEUED, S.DONE), (T.READY, J.RUNNING), (S.OPEN, T.CANCELLED), (N.ONLINE, J.QUEUED)],
)
def test_moves_across_lifecycles_are_illegal(current: enum.Enum, target: enum.Enum) -> None:
    assert not can_transition(current, target)
    with pytest.raises(IllegalTransition):
        check_transition(current, target)


@pytest.mark.parametrize(
    "state",
    [J.COMPLETED, J.FAILED, J.CANCELLED, S.FAILED, S.CANCELLED, T.COMPLETED, T.FAILED],
)
def test_terminal_states_go_nowhere(state: enum.Enum) -> None:
    assert not any(can_transition(state, target) for target in type(state))


@pytest.mark.parametrize(
    ("target", "sources"),
    [
        (J.RUNNING, {J.QUEUED}),
        (J.COMPLETED, {J.QUEUED, J.RUNNING}),
        (J.CANCELLED, {J.QUEUED, J.RUNNING}),
        (J.QUEUED, set()),
        (S.DONE, {S.OPEN}),
        (S.OPEN, {S.DONE}),
        (T.ASSIGNED, {T.READY}),
        (T.EXPIRED, {T.ASSIGNED}),
        (T.COMPLETED, {T.ASSIGNED, T.EXPIRED, T.CANCELLED}),
        (T.CANCELLED, {T.READY, T.ASSIGNED, T.EXPIRED}),
        (T.READY, set()),
        (N.ONLINE, {N.OFFLINE}),
        (N.OFFLINE, {N.ONLINE}),
    ],
)
def test_sources_of(target: enum.Enum, sources: set[enum.Enum]) -> None:
    assert sources_of(target) == frozenset(sources)


def test_sources_of_agrees_with_can_transition_everywhere() -> None:
    for current, target in ALL_PAIRS:
        assert (current in sources_of(target)) == can_transition(current, target)


def test_state_groups() -> None:
    assert set(TERMINAL_JOB_STATES) == {J.COMPLETED, J.FAILED, J.CANCELLED}
    assert set(LIVE_TASK_STATES) == {T.READY, T.ASSIGNED}
    # Enum values are what the store writes: plain strings.
    assert TaskState("expired") is T.EXPIRED
    assert JobState.RUNNING == "running"
