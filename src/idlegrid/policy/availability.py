"""Which connected nodes their owners hold back from a job, in words. Pure.

A worker computes only when its owner's settings allow (docs/worker.md): it says so in
its `status` message, paused (it takes no task) or throttled (it runs below full speed
while its owner uses the machine), with the idle policy's reason. A job whose nodes are
held back waits for their owners, and its page says so, naming them.
"""

from __future__ import annotations

from dataclasses import dataclass

NAMED = 5  # nodes named in one sentence; the rest are counted


@dataclass(frozen=True)
class NodeState:
    """A connected node as its worker last described itself."""

    node_id: int
    name: str
    paused: bool
    throttled: bool
    reason: str


def held_back(kind: str, able: int, states: list[NodeState]) -> list[str]:
    """Sentences on the paused and throttled nodes among the `able` connected nodes that
    run `kind` (`states`: theirs); [] when every one runs at full speed."""
    out = []
    paused = [s for s in states if s.paused]
    throttled = [s for s in states if s.throttled and not s.paused]
    if paused:
        out.append(
            f"{len(paused)} of {able} connected node(s) that run {kind} are paused by their "
            f"owners' settings: {_named(paused)}; they take tasks again when their "
            "machines are free"
        )
    if throttled:
        out.append(
            f"{len(throttled)} of {able} connected node(s) that run {kind} run throttled "
            f"while their owners use them: {_named(throttled)}"
        )
    return out


def _named(states: list[NodeState]) -> str:
    named = "; ".join(
        f"#{s.node_id} {s.name} ({s.reason or 'no reason given'})" for s in states[:NAMED]
    )
    rest = len(states) - NAMED
    return named + (f"; and {rest} more" if rest > 0 else "")
