"""A round's averaging group as the coordinator names it in each member's task.

Pure values: the group's DHT key (one per job and round), the members (the round's
training shards), how many must meet, how long to wait, and where the DHT is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Hivemind keys its groups by a prefix without dots.
_KEY = re.compile(r"^[A-Za-z0-9_-]{1,200}$")
_SECRET = re.compile(r"^([0-9a-f]{64})?$")


class GroupError(ValueError):
    """A group description that cannot be used; the message says why."""


@dataclass(frozen=True)
class Group:
    """Who averages together in one round, and on which DHT."""

    key: str
    # The round's training shards: one member each.
    members: tuple[int, ...]
    # A first attempt waits for every member; a retry (after a member failed) for this many.
    min_size: int
    # Seconds each attempt may wait for its group and run its all-reduce.
    timeout_s: float
    # Multiaddresses of the coordinator's bootstrap DHT peer.
    peers: tuple[str, ...]
    # The round's secret (hex), which seals its records in the DHT (`seal`): only the
    # coordinator and the round's members hold it. "": records are not sealed.
    secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if not _KEY.match(self.key):
            raise GroupError(f"group key {self.key!r}: letters, digits, '-' and '_' only")
        if not self.members or len(set(self.members)) != len(self.members):
            raise GroupError("a group needs distinct members")
        if not 1 <= self.min_size <= len(self.members):
            raise GroupError(f"min_size {self.min_size} of {len(self.members)} members")
        if not self.timeout_s > 0:
            raise GroupError("timeout_s must be positive")
        if not self.peers:
            raise GroupError("a group needs the DHT's addresses")
        if not _SECRET.match(self.secret):
            raise GroupError("a group's secret is 64 hex digits")

    @property
    def size(self) -> int:
        return len(self.members)

    def to_json(self) -> dict[str, Any]:
        raw = {"key": self.key, "members": list(self.members), "min_size": self.min_size,
               "timeout_s": self.timeout_s, "peers": list(self.peers)}  # fmt: skip
        return {**raw, "secret": self.secret} if self.secret else raw

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Group:
        try:
            return cls(
                key=str(raw["key"]),
                members=tuple(int(m) for m in raw["members"]),
                min_size=int(raw["min_size"]),
                timeout_s=float(raw["timeout_s"]),
                peers=tuple(str(p) for p in raw["peers"]),
                secret=str(raw.get("secret", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, GroupError):
                raise
            raise GroupError(f"malformed group: {exc!r}") from None


def group_key(job_id: int, round_number: int, stream: str) -> str:
    """The DHT key of one job's round: no two rounds (or jobs) ever share a group."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", stream)[:80]
    return f"idlegrid-{safe}-job{job_id}-round{round_number}"


def reporter(members: Mapping[int, bool]) -> int | None:
    """The member that uploads the round's published update: the lowest shard among those
    that hold the outer optimizer's state (`members`: shard -> holds it); None if none."""
    holders = sorted(shard for shard, full in members.items() if full)
    return holders[0] if holders else None


def missing(group: Group, met: Sequence[int]) -> list[int]:
    """The members that did not average with this one."""
    return [shard for shard in group.members if shard not in set(met)]
