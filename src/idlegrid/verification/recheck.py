"""Rechecks: what a node caught lying ran or decided alone goes back to full replication.

A checker caught lying (kinds verified by checks) is treated alike for what rested on its
word: a shard whose output its pass alone made canonical (`rested`) is opened again for
another check while its job is open, and reported as released once its job ended; an
ended job names it as a doubt (`rested_on_liars`: the store reads the checks of the job's
outputs and their nodes' latest lies).

A node that runs shards alone was trusted on its record; one wrong result shows the
record was no guarantee. Every shard of that kind and backend it runs alone now goes
back to full replication (escalated), and every shard it decided alone within
`TrustSettings.recheck_window_s` is opened again with its result back in the vote
(reopened), unless its job already ended (released: too late, and logged; the audit
before a job completes is what keeps them few). Pure: the store reads the shards
(`LoneShard`), writes what `recheck` returns.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

# Modes of a shard whose result no full set of replicas checked.
UNREPLICATED = ("alone", "spot")


@dataclass(frozen=True, kw_only=True)
class LoneShard:
    """A shard run without full replication, where the caught node has a task."""

    shard_id: int
    open: bool  # still open; else decided
    task_id: int  # the caught node's task in it
    canonical_task_id: int | None
    finished_at: float | None  # when it was decided
    job_open: bool  # its job queued or running (its result not yet released)


@dataclass
class Rechecked:
    """Shards sent back to full replication by a caught node."""

    escalated: list[int] = field(default_factory=list)  # were still open
    reopened: list[int] = field(default_factory=list)  # were decided, job still open
    released: list[int] = field(default_factory=list)  # decided, job ended: too late

    @property
    def to_replicate(self) -> list[int]:
        """The shards that go back to full replication now."""
        return self.escalated + self.reopened


def recheck(shards: Iterable[LoneShard], *, now: float, window_s: float) -> Rechecked:
    """Which of a caught node's lone shards are replicated again (in the order given,
    each shard once, as its last row says): open ones at once; decided ones its result
    decided within the window, if their job is still open; the others of them are
    reported as released."""
    out = Rechecked()
    for shard in {shard.shard_id: shard for shard in shards}.values():
        if shard.open:
            out.escalated.append(shard.shard_id)
        elif shard.canonical_task_id != shard.task_id or _before(shard, now - window_s):
            continue  # another node's result, or long ago
        elif shard.job_open:
            out.reopened.append(shard.shard_id)
        else:
            out.released.append(shard.shard_id)
    return out


def _before(shard: LoneShard, since: float) -> bool:
    return shard.finished_at is None or shard.finished_at < since


def rested(shards: Iterable[LoneShard], *, now: float, window_s: float) -> Rechecked:
    """Which shards that a caught checker's lone pass decided are checked again: those
    decided within the window whose job is still open (reopened); of the others, those
    whose job ended are released (each shard once, as its last row says)."""
    out = Rechecked()
    for shard in {shard.shard_id: shard for shard in shards}.values():
        if shard.open or _before(shard, now - window_s):
            continue  # still open: its next check comes anyway; or long ago
        if shard.job_open:
            out.reopened.append(shard.shard_id)
        else:
            out.released.append(shard.shard_id)
    return out


@dataclass(frozen=True, kw_only=True)
class OutputCheck:
    """A check of a decided shard's canonical output (its `checks_hash` that output's), as
    the rule of what rested on a liar's word reads it."""

    shard_index: int
    task_id: int
    node_id: int | None
    finished_at: float | None
    outcome: str | None  # its verdict as stored: "valid" passed the output
    known_answer: bool  # a known-answer probe: its pass counts, but is no one's word


def rested_alone(checks: Iterable[OutputCheck]) -> list[OutputCheck]:
    """The passes a decided output rested on alone, in the order given: a check that
    passed it (not a known-answer probe) where no other check of it passed."""
    passes: dict[int, list[OutputCheck]] = {}
    for check in checks:
        if check.outcome == "valid":
            passes.setdefault(check.shard_index, []).append(check)
    return [
        found[0]
        for found in passes.values()
        if len(found) == 1 and not found[0].known_answer and found[0].node_id is not None
    ]


def lied_since(check: OutputCheck, last_lie: Mapping[int, tuple[float, int]]) -> bool:
    """Whether the check's node was found lying after it (`last_lie`: node -> when its
    latest invalid result finished, and its task; a lie finished at the same time counts
    as later when its task is)."""
    lie = last_lie.get(check.node_id) if check.node_id is not None else None
    if lie is None or check.finished_at is None:
        return False
    return lie > (check.finished_at, check.task_id)


def rested_on_liars(
    checks: Iterable[OutputCheck], last_lie: Mapping[int, tuple[float, int]]
) -> list[tuple[int, int]]:
    """(shard index, node) of the decided outputs that one check alone passed
    (`rested_alone`), by a node caught lying since (`lied_since`), in shard order."""
    return sorted(
        (check.shard_index, check.node_id)
        for check in rested_alone(checks)
        if check.node_id is not None and lied_since(check, last_lie)
    )
