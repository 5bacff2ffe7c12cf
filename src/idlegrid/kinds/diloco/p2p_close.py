"""How the coordinator closes a `diloco-train` round averaged peer to peer: from its
members' reports (`agreement.decide`), by rebuilding the group's outer step from the one
published update, or, if no group agreed, in coordinator mode on the members' own
updates. Numpy only, like `rounds`, which calls it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from idlegrid.kinds.base import RoundClose, RoundWeights
from idlegrid.kinds.diloco import agreement, tasks
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.p2p.averaging import ALL_CLIENTS
from idlegrid.training import closing
from idlegrid.training.compression import decode, encode_message
from idlegrid.training.flat import unpack
from idlegrid.training.outer import apply_update

# How a close stores the weights it reached: (state, the round whose outer state stands
# in for the state's own, or None when the state's own is known).
Stored = Callable[[closing.RoundState, int | None], RoundWeights]


def close(
    params: DilocoParams,
    state: closing.RoundState,
    optimizer: bytes,
    outputs: Sequence[bytes],
    stored: Stored,
) -> RoundClose:
    """Close a peer-to-peer round of weights `state` by its members' reports
    (`agreement.decide`); `optimizer`: the round's momentum blob, as stored."""
    results = [tasks.decode_result(output) for output in outputs]
    decision = agreement.decide([_report(r) for r in results])
    taken = [results[i] for i in decision.taken]
    notes: dict[str, Any] = {
        "averaging": decision.mode,
        "agreeing": len(taken),
        "left_out": sorted(results[i].shard for i in decision.dropped),
        "update_norms": {str(r.shard): r.update_norm for r in results},
        # Members that took part in Hivemind's client mode (behind NAT: reduced no part).
        "client_members": sorted(r.shard for r in results if r.reachability == "client"),
        # What each member's all-reduce moved on the wire (sent and received, all attempts).
        "wire_bytes": {str(r.shard): r.wire_bytes for r in results if r.averaging},
        # Members some member's attempt could not do without: dead, unreachable, or a part
        # that did not decode (left out of the retry, so of the round's mean).
        "blamed": sorted({b for r in results for b in r.blamed}),
    }
    reasons = sorted({r.reason for r in results if r.reason})
    clients_only = results and all(r.reachability == "client" for r in results)
    if clients_only and decision.mode != "p2p" and not any(ALL_CLIENTS in r for r in reasons):
        reasons.insert(0, ALL_CLIENTS)
    if decision.reason or reasons:
        notes["fallback_reason"] = "; ".join(filter(None, [decision.reason, *reasons]))[:2000]
    fetched = sum(r.fetched_bytes for r in results)
    if decision.mode == "p2p" and decision.reporter is not None:
        closed = _apply_group(stored, state, optimizer, results[decision.reporter], taken, notes)
        if closed is not None:
            return dataclasses.replace(closed, fetched_bytes=fetched)
        taken = [r for r in results if r.averaging in ("", "fallback")]
    notes["averaging"] = "coordinator" if taken else "empty"
    return dataclasses.replace(_close_here(params, stored, state, optimizer, taken, notes),
                               fetched_bytes=fetched)  # fmt: skip


def _apply_group(
    stored: Stored,
    state: closing.RoundState,
    optimizer: bytes,
    reporter: tasks.TaskResult,
    taken: Sequence[tasks.TaskResult],
    notes: dict[str, Any],
) -> RoundClose | None:
    """The group's outer step, rebuilt from its published update; None if the update
    does not give the weights the group reported (then the round falls back)."""
    assert reporter.published is not None
    weights = apply_update(state.weights, reporter.published)
    # Until a member uploads it, the outer state stands in as the last one uploaded.
    after = closing.RoundState(state.round + 1, weights, state.momentum,
                               state.download_residual)  # fmt: skip
    if after.digest != reporter.next_digest:
        notes["fallback_reason"] = (
            "the group's published update does not give the weights its members reported"
        )
        return None
    outer = reporter.outer
    known = outer is not None and outer.weights_digest == after.digest
    if known:
        assert outer is not None
        after = closing.RoundState(after.round, weights, outer.momentum, outer.residual)
    notes["outer_state"] = "uploaded" if known else "held by the members"
    losses = [r.loss_mean for r in taken if np.isfinite(r.loss_mean)]
    return RoundClose(
        weights=stored(after, None if known else outer_round(optimizer)),
        update=encode_message(reporter.published),
        train_loss=float(np.mean(losses)) if losses else float("nan"),
        max_suspicion=0.0,  # the coordinator never sees a member's update
        stale_applied=0,
        fetched_bytes=0,
        notes=notes,
    )


def _close_here(
    params: DilocoParams,
    stored: Stored,
    state: closing.RoundState,
    optimizer: bytes,
    taken: Sequence[tasks.TaskResult],
    notes: dict[str, Any],
) -> RoundClose:
    """A peer-to-peer round closed in coordinator mode on members' own updates."""
    if not outer_known(optimizer):
        held = [r.outer for r in taken
                if r.outer is not None and r.outer.weights_digest == state.digest]  # fmt: skip
        if held:
            state = closing.RoundState(state.round, state.weights, held[0].momentum,
                                       held[0].residual)  # fmt: skip
            notes["outer_state"] = "sent by a member"
        else:
            made = outer_round(optimizer)
            notes["outer_state"] = f"not sent: the last uploaded, of round {made}, stands in"
    updates = [closing.Update(decode(r.update), r.round, r.loss_mean)
               for r in taken if r.update is not None]  # fmt: skip
    closed = closing.close_round(state, updates, rule=params.aggregation,
                                 outer=params.outer, download=params.download)  # fmt: skip
    return RoundClose(
        weights=stored(closed.state, None),
        update=encode_message(closed.message),
        train_loss=closed.train_loss,
        max_suspicion=max(closed.suspicion, default=0.0),
        stale_applied=0,
        fetched_bytes=0,
        notes=notes,
    )


def outer_known(momentum: bytes) -> bool:
    """Whether a momentum blob holds its round's outer state (not an older stand-in)."""
    _, header = unpack(momentum)
    return bool(header.get("known", True))


def outer_round(momentum: bytes) -> int:
    """The round whose outer state a momentum blob holds (older than its own: a stand-in)."""
    _, header = unpack(momentum)
    return int(header.get("from_round", header["round"]))


def _report(result: tasks.TaskResult) -> agreement.Report:
    return agreement.Report(
        shard=result.shard,
        averaging=result.averaging,
        averaged_digest=result.averaged_digest,
        next_digest=result.next_digest,
        published=result.published is not None,
    )
