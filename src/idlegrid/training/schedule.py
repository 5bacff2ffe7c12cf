"""When a training round closes: a pure decision of the round driver, tested by table.

A round closes on quorum (`min_updates` training shards of the round itself have a
canonical update) or, once its timer ran out, with whatever arrived; a timer that runs out
with no update at all extends the round instead of closing it empty (an empty round would
only burn a round of the schedule: nothing can move the weights).

In asynchronous mode, late updates (of older rounds, counted in the open one) do not count
toward the quorum: a round never closes on stale updates alone, so every outer step has at
least `min_updates` pseudo-gradients of the weights it moves (benchmarks/diloco_timeline.py
plays rounds on a virtual clock by this rule). They do count for the timer: one late update
is enough to close on it.
"""

from __future__ import annotations

import enum


class Close(enum.StrEnum):
    WAIT = "wait"  # not enough updates, timer still running
    QUORUM = "quorum"  # enough updates arrived
    TIMER = "timer"  # the timer ran out: close with what arrived
    EXTEND = "extend"  # the timer ran out with nothing to aggregate: wait another period


def close_decision(*, updates: int, min_updates: int, timer_expired: bool, late: int = 0) -> Close:
    """What to do with an open training round that has `updates` canonical updates of its
    own and `late` ones of older rounds (asynchronous mode) waiting to count in it."""
    if updates >= min_updates:
        return Close.QUORUM
    if not timer_expired:
        return Close.WAIT
    return Close.TIMER if updates + late > 0 else Close.EXTEND


def finish_decision(*, evaluated: bool, timer_expired: bool) -> bool:
    """Whether the last (evaluation-only) round ends: its evaluation is in, or it timed out."""
    return evaluated or timer_expired
