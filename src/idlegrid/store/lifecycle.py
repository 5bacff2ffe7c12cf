"""Guarded lifecycle updates: every state change the store makes, checked by `states.py`.

A row is born by INSERT in its first state (a job queued, a shard or round open, a task
ready, or assigned at once for a backup copy, an upload partial); every later change of its
state is a `move`, the UPDATE this module builds. It is checked twice:

- when it is built, against `states.py`'s transition table: each state the caller expects
  to move from must lead legally to the target, or `IllegalTransition` is raised. That is
  a programming error, which tests catch; it never reaches SQL.
- in SQL: the statement matches only rows still in one of those states (`WHERE state IN
  (sources)`), so when coordinator processes race on one row the loser changes nothing.
  For most callers no row moved is a normal outcome of such a race, not an error.

A caller that needs one particular row moved (one it read, locked and judged movable)
says so: `move_row` for one row, `check_moved` after a batch. A row that did not move and
is found in a state from which the move is illegal raises `IllegalMove` (an
`IllegalTransition`) naming its table, id and both states, and is logged on
`idlegrid.store`. The row is read only after it failed to move, so the statements of the
hot path (claims, results) stay what they were.
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from sqlalchemy import ColumnElement, CursorResult, Table, Update, literal, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from idlegrid.states import (
    IllegalTransition,
    JobState,
    NodeState,
    ShardState,
    TaskState,
    TrainingRoundState,
    UploadState,
    can_transition,
    check_transition,
    sources_of,
)
from idlegrid.store.schema import jobs, nodes, shards, tasks, training_rounds, uploads

log = logging.getLogger("idlegrid.store")

# Each table with a `state` column, and the lifecycle its rows follow.
LIFECYCLES: Mapping[Table, type[enum.Enum]] = {
    jobs: JobState,
    shards: ShardState,
    tasks: TaskState,
    nodes: NodeState,
    training_rounds: TrainingRoundState,
    uploads: UploadState,
}


class IllegalMove(IllegalTransition):
    """A row found in a state from which the move its caller needed is illegal."""

    def __init__(self, table: str, row_id: int, current: enum.Enum, target: enum.Enum) -> None:
        super().__init__(
            f"{table} {row_id}: {type(current).__name__} {current.value} -> {target.value}"
        )
        self.table = table
        self.row_id = row_id
        self.current = current
        self.target = target


def move(
    table: Table,
    to: enum.Enum,
    *where: ColumnElement[bool],
    sources: Iterable[enum.Enum] | None = None,
    or_already: bool = False,
    **values: Any,
) -> Update:
    """`UPDATE table SET state = to, **values WHERE *where AND state IN (sources)`.

    `sources`: the states the caller expects to move from, `sources_of(to)` when None;
    `IllegalTransition` unless each of them may move to `to`. `or_already`: rows already
    in `to` match too (their other values are written, their state stays).
    """
    if "state" in values:
        raise TypeError("move sets the state itself: pass it as `to`")
    matching = _checked_sources(table, to, None if sources is None else frozenset(sources))
    if or_already:
        matching = (*matching, to)
    return update(table).where(*where, in_state(table, *matching)).values(state=to.value, **values)


def in_state(table: Table, *states: enum.Enum) -> ColumnElement[bool]:
    """`state = X` for one state, `state IN (...)` for more (the stored values).

    The list is of plain bound values, not one expanding parameter: a batch (executemany)
    cannot expand one.
    """
    return _state_clause(table, tuple(sorted(s.value for s in states)))


@functools.cache
def _state_clause(table: Table, values: tuple[str, ...]) -> ColumnElement[bool]:
    # Made once per table and states: a clause element is immutable, and one that is
    # reused keeps its cache key, which SQLAlchemy would otherwise work out again for
    # every statement (a third of building a guarded update).
    if len(values) == 1:
        return table.c.state == values[0]
    return table.c.state.in_([literal(value) for value in values])


def _checked_sources(
    table: Table, to: enum.Enum, sources: frozenset[enum.Enum] | None
) -> tuple[enum.Enum, ...]:
    """The sources of a move, each checked legal (cached: claims build one a call).

    The cache is keyed by each state's lifecycle as well as its value: the states are
    StrEnums, so `JobState.CANCELLED == TaskState.CANCELLED` (both "cancelled"), and a
    key of the states alone would let a move checked for one lifecycle pass for another.
    """
    typed = None if sources is None else frozenset((type(s), s) for s in sources)
    return _checked_typed(table, type(to), to, typed)


@functools.cache
def _checked_typed(
    table: Table,
    to_type: type[enum.Enum],
    to: enum.Enum,
    sources: frozenset[tuple[type[enum.Enum], enum.Enum]] | None,
) -> tuple[enum.Enum, ...]:
    lifecycle = LIFECYCLES.get(table)
    if lifecycle is None:
        raise IllegalTransition(f"{table.name} has no lifecycle")
    if to_type is not lifecycle:
        raise IllegalTransition(f"{table.name} rows are {lifecycle.__name__}, not {to!r}")
    expected = tuple(sources_of(to)) if sources is None else tuple(s for _, s in sources)
    if not expected:
        raise IllegalTransition(f"{lifecycle.__name__}: no state moves to {to.value}")
    for source in expected:
        check_transition(source, to)
    return tuple(sorted(expected, key=lambda state: state.value))


def check_row(table: Table, row_id: int, current: enum.Enum, to: enum.Enum) -> None:
    """Raise (and log) `IllegalMove` unless a row read in `current` may move to `to`."""
    if not can_transition(current, to):
        raise illegal(table, row_id, current, to)


def illegal(table: Table, row_id: int, current: enum.Enum, to: enum.Enum) -> IllegalMove:
    """The error of a row that cannot make the move its caller needs, logged."""
    error = IllegalMove(table.name, row_id, current, to)
    log.error("illegal state change refused: %s", error)
    return error


async def move_row(
    conn: AsyncConnection,
    table: Table,
    row_id: int,
    to: enum.Enum,
    *where: ColumnElement[bool],
    sources: Iterable[enum.Enum] | None = None,
    settled: Collection[enum.Enum] = (),
    **values: Any,
) -> bool:
    """Move one row the caller needs moved; whether it moved.

    It may stay for a reason the caller accepts: another condition of `where`, already in
    `to`, in a state of `settled` (another process may have put it there), or in a state
    that may still move to `to` later. In any other state it raises `IllegalMove`.
    """
    moved = await conn.execute(
        move(table, to, table.c.id == row_id, *where, sources=sources, **values)
    )
    if moved.rowcount == 1:
        return True
    await _refuse_illegal(conn, table, [row_id], to, settled=settled)
    return False


async def check_moved(
    conn: AsyncConnection,
    result: CursorResult[Any],
    table: Table,
    row_ids: Collection[int],
    to: enum.Enum,
    *,
    settled: Collection[enum.Enum] = (),
) -> None:
    """After a batch `move` (executemany) of rows the caller needs moved: raise
    `IllegalMove` for a row that stayed in a state from which `to` is illegal.

    Reads only when the driver counted fewer rows than were asked. asyncpg counts none
    for a batch (-1): there the row locks the caller took before it judged the rows are
    what keeps them movable.
    """
    if result.rowcount in (-1, len(row_ids)):
        return
    await _refuse_illegal(conn, table, row_ids, to, settled=settled)


async def _refuse_illegal(
    conn: AsyncConnection,
    table: Table,
    row_ids: Collection[int],
    to: enum.Enum,
    *,
    settled: Collection[enum.Enum],
) -> None:
    query = select(table.c.id, table.c.state).where(table.c.id.in_(sorted(row_ids)))
    lifecycle = type(to)
    for row in (await conn.execute(query.order_by(table.c.id))).all():
        current = lifecycle(row.state)
        if current != to and current not in settled and not can_transition(current, to):
            raise illegal(table, row.id, current, to)
