"""How the coordinator closes a peer-to-peer round from its members' reports: pure rules.

Each member reports how its averaging went (`Report`). The rule:

1. Members that averaged together report the same digest of the group's mean. Among
   them, those that took the outer step report the digest of the weights it gave; one
   that differs from the group's reporter (the member that uploaded the published
   update) dissents and is left out. A group counts only if its reporter delivered.
2. The largest such group (ties: the one with the lowest shard) is the round's, unless
   more members fell back (no group formed for them: they sent their own pseudo-gradient,
   as in coordinator mode): then the round closes in coordinator mode on theirs.
3. Every member not taken is dropped from the round: its update is never applied, in
   this round or a later one (the round closes once, in one transaction).
4. A round with neither closes empty: the weights stay, the reason is in its metrics.

A round has one retry group at most (the coordinator names it once, `p2p.namer`), so a
round sees the first group, its retry group, and members that fell back: rule 2 decides
between them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Mode = Literal["p2p", "coordinator", "empty"]


@dataclass(frozen=True)
class Report:
    """What one member said of its round (from its result)."""

    shard: int
    # "p2p": averaged; "fallback" or "" (a coordinator-mode result): its own update.
    averaging: str
    averaged_digest: str = ""
    next_digest: str = ""
    published: bool = False


@dataclass(frozen=True)
class Decision:
    """How the round closes: which reports count (positions in the list given)."""

    mode: Mode
    taken: tuple[int, ...] = ()
    # p2p: the position of the report whose published update is applied.
    reporter: int | None = None
    dropped: tuple[int, ...] = ()
    reason: str = ""


def _groups(reports: Sequence[Report]) -> list[tuple[int, list[int]]]:
    """Agreeing groups as (reporter position, member positions), best first."""
    by_digest: defaultdict[str, list[int]] = defaultdict(list)
    for i, report in enumerate(reports):
        if report.averaging == "p2p" and report.averaged_digest:
            by_digest[report.averaged_digest].append(i)
    groups = []
    for positions in by_digest.values():
        reporters = [i for i in positions if reports[i].published]
        if not reporters:
            continue
        reporter = min(reporters, key=lambda i: reports[i].shard)
        after = reports[reporter].next_digest
        agreeing = [i for i in positions
                    if reports[i].next_digest in ("", after)]  # fmt: skip
        groups.append((reporter, agreeing))
    groups.sort(key=lambda g: (-len(g[1]), min(reports[i].shard for i in g[1])))
    return groups


def decide(reports: Sequence[Report]) -> Decision:
    """The round's close from its members' reports (see the module's rule)."""
    everyone = range(len(reports))
    fallback = [i for i in everyone if reports[i].averaging in ("", "fallback")]
    groups = _groups(reports)
    if groups and len(groups[0][1]) >= len(fallback):
        reporter, taken = groups[0]
        dropped = tuple(i for i in everyone if i not in taken)
        why = f"{len(dropped)} member(s) outside the agreeing group left out" if dropped else ""
        return Decision("p2p", tuple(taken), reporter, dropped, why)
    if fallback:
        dropped = tuple(i for i in everyone if i not in fallback)
        return Decision("coordinator", tuple(fallback), None, dropped,
                        "no agreeing group: members' own updates, in coordinator mode")  # fmt: skip
    why = "no group agreed and delivered its update, and no member fell back"
    return Decision("empty", (), None, tuple(everyone), why)
