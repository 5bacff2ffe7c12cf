"""Worker side of a peer-to-peer round: average with the group, take the outer step.

A member has trained and compressed its pseudo-gradient as in coordinator mode. It then

1. finds the outer optimizer's state of the round's weights: its own (it took the last
   round's step), the coordinator's blob (round 0's zeros, or a state a member uploaded),
   or none (it joined late: it averages but does not step this round);
2. averages its accumulator (its pseudo-gradient plus what error feedback owes) with its
   group, each part compressed as its upload would be (`idlegrid.p2p`), and keeps what
   its contributions missed as its residual;
3. if it holds the outer state, applies the same outer step as every other such member
   (`training.closing.close_round` on the group's mean: the coordinator's own function),
   and keeps the new weights and state for the next round;
4. reports the digest of the mean, its own update's norm and the digest of the new
   weights; the group's reporter (the lowest shard holding the outer state) adds the
   published update, which lets the coordinator rebuild the weights bit for bit, and the
   new outer state every N rounds or when the group was not whole.

If no group formed, or no member of it holds the outer state, it reports its own update
instead ("fallback"), and the coordinator closes the round in coordinator mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import numpy as np

from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.p2p import averaging
from idlegrid.p2p.group import reporter
from idlegrid.training import closing, verify
from idlegrid.training.aggregate import Aggregation
from idlegrid.training.compression import Compression, Message, decode
from idlegrid.training.flat import ContainerError, digest, unpack
from idlegrid.training.outer import OuterSettings


def average_round(
    task: tasks.TaskPayload,
    steps: tuple[OuterSettings, Compression],
    state: WorkerState,
    weights: np.ndarray,
    own: Message,
    losses: tuple[float, float, float],
    fetch: Callable[[str], bytes] | None,
    joining: averaging.Joining,
    *,
    accumulator: np.ndarray,
    upload: Compression,
) -> tasks.TaskResult:
    """One member's round after its inner steps (see the module's steps); `steps`: the
    job's outer optimizer and download compression; `own`: its update compressed alone
    (what it sends if no group forms); `accumulator`: what that update compressed;
    `joining`: its handle on the standing averager."""
    assert task.group is not None
    own_delta = decode(own)
    outer, done = _average_with_group(task, state, weights, fetch, joining,
                                      accumulator=accumulator, upload=upload)  # fmt: skip
    base = tasks.TaskResult(
        "train", task.round, task.shard, task.seed, task.target.digest, *losses,
        update_norm=float(np.linalg.norm(own_delta)), reachability=done.reachability,
        wire_bytes=done.wire_bytes, blamed=done.blamed,
    )  # fmt: skip
    lead = reporter(done.members) if done.values is not None else None
    if done.values is None or lead is None:
        reason = done.reason or "no member of the group holds the outer optimizer's state"
        return dataclasses.replace(base, averaging="fallback", reason=reason, update=own,
                                   sketch=verify.sketch(own_delta), outer=outer)  # fmt: skip
    if upload.stateful and done.residual is not None:
        state.set_residual(task.stream, done.residual)  # what the group's codes missed
    result = dataclasses.replace(
        base, averaging="p2p", averaged_digest=digest(done.values),
        members=tuple(sorted(done.members)), reason=_averaged_reason(done),
    )  # fmt: skip
    if outer is None:
        return result  # joined late: the next round's weights come from the coordinator
    closed, kept = _take_outer_step(task, steps, state, weights, outer,
                                    mean=done.values, train_loss=losses[1])  # fmt: skip
    result = dataclasses.replace(result, next_digest=kept.weights_digest)
    if lead != task.shard:
        return result
    whole = _group_was_whole(done.members, task.group.members)
    sent_state = kept if task.report_state or not whole else None
    return dataclasses.replace(result, published=closed.message, outer=sent_state)


def _average_with_group(
    task: tasks.TaskPayload,
    state: WorkerState,
    weights: np.ndarray,
    fetch: Callable[[str], bytes] | None,
    joining: averaging.Joining,
    *,
    accumulator: np.ndarray,
    upload: Compression,
) -> tuple[tasks.OuterState | None, averaging.Averaged]:
    """The outer state this member holds and its group's average; `joining` closed either way."""
    try:
        outer = outer_state(task, state, weights, fetch)
        done = joining.average(accumulator, shard=task.shard, holds_state=outer is not None,
                               settings=upload)  # fmt: skip
    finally:
        joining.close()
    return outer, done


def _averaged_reason(done: averaging.Averaged) -> str:
    """What the attempts met on the way, said in the record even though the round averaged."""
    if done.attempt <= 1:
        return done.reason
    # A first attempt failed (or a standing averager was replaced) before the retry averaged.
    return "; ".join(filter(None, ["averaged on the retry: a member left", done.reason]))


def _take_outer_step(
    task: tasks.TaskPayload,
    steps: tuple[OuterSettings, Compression],
    state: WorkerState,
    weights: np.ndarray,
    outer: tasks.OuterState,
    *,
    mean: np.ndarray,
    train_loss: float,
) -> tuple[closing.ClosedRound, tasks.OuterState]:
    """The coordinator's outer step on the group's mean; the new weights and state kept."""
    closed = closing.close_round(
        closing.RoundState(task.round, weights, outer.momentum, outer.residual),
        [closing.Update(mean, task.round, train_loss)],
        rule=Aggregation(), outer=steps[0], download=steps[1],
    )  # fmt: skip
    after = closed.state
    state.remember_weights(after.digest, after.weights)
    kept = tasks.OuterState(after.digest, after.momentum, after.download_residual)
    state.set_outer_state(task.stream, kept)
    return closed, kept


def _group_was_whole(averaged: Mapping[int, bool], group: tuple[int, ...]) -> bool:
    """Every shard of the group took part, each with the outer state."""
    return set(averaged) == set(group) and all(averaged.values())


def outer_state(
    task: tasks.TaskPayload,
    state: WorkerState,
    weights: np.ndarray,
    fetch: Callable[[str], bytes] | None,
) -> tasks.OuterState | None:
    """The outer optimizer's state of the task's weights, if this member can have it."""
    held = state.outer_state(task.stream, task.target.digest)
    if held is not None:
        return held
    if task.round == 0 and task.init_seed is not None:
        return tasks.OuterState(task.target.digest, np.zeros_like(weights))
    if task.outer_blob is None or fetch is None:
        return None
    arrays, header = unpack(fetch(task.outer_blob))
    if header.get("format") != tasks.MOMENTUM_FORMAT or not header.get("known", True):
        raise ContainerError("the task's outer state blob is not a known momentum blob")
    momentum = arrays["momentum"]
    if momentum.shape != weights.shape:
        raise ContainerError("the task's outer state does not fit its weights")
    return tasks.OuterState(task.target.digest, momentum, arrays.get("download_residual"))
