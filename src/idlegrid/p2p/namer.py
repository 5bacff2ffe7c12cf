"""The coordinator names a round's retry group, as it named the first.

A round's first group is the one the coordinator wrote into each member's task. When
that attempt fails (a member died before or during the all-reduce, never came, or sent a
part that does not decode), the members left meet again under the round's retry key
(`roster.gather`): each writes what it brings and whom it blames, and asks for a group
under `REQUESTS`. The coordinator's bootstrap DHT peer (`bootstrap`) runs a `Namer`: it
reads each meeting it was asked about and names its group once, under the meeting's
`-named` key, with the entries it read. Every member all-reduces with that one decision,
never with a group derived from what only some of the members saw.

`decide` is the rule, pure: the group is every member left (named, not blamed by anyone)
once all of them came, or, with at least the job's minimum, those present once
`QUIET_S` passed without a newcomer. With every member left present and fewer than the
minimum, the namer names an empty group and says why: the members fall back to the
coordinator at once instead of waiting out their timeout.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from idlegrid.p2p import seal

# The DHT key under which members ask for a retry group (subkey: the meeting's key).
REQUESTS = "idlegrid-retry-requests"
# Seconds a meeting must see no new member before those present are named.
QUIET_S = 3.0
# Seconds between the namer's passes over the requests.
POLL_S = 0.25
MAX_MEMBERS = 64
_KEY = re.compile(r"^[A-Za-z0-9_-]{1,240}$")


@dataclass(frozen=True)
class Decision:
    """A retry group as the coordinator named it: its members in shard order (empty: no
    group, `reason` says why) and what each of them brought to the meeting."""

    members: tuple[int, ...]
    reason: str = ""
    entries: tuple[dict[str, Any], ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"members": list(self.members), "reason": self.reason,
                "entries": list(self.entries)}  # fmt: skip

    @classmethod
    def from_json(cls, raw: Any) -> Decision | None:
        """The decision as read from the DHT; None if it is not one."""
        if not isinstance(raw, Mapping):
            return None
        try:
            members = tuple(int(m) for m in raw["members"])
            entries = tuple(dict(e) for e in raw.get("entries", ()))
        except (KeyError, TypeError, ValueError):
            return None
        if [e.get("shard") for e in entries] != list(members):
            return None
        return cls(members, str(raw.get("reason", "")), entries)

    def met(self) -> dict[int, dict[str, Any]]:
        """Each member's entry by shard."""
        return dict(zip(self.members, self.entries, strict=True))


def blamed_in(entries: Mapping[int, Mapping[str, Any]]) -> set[int]:
    """Every member some entry blames."""
    blamed: set[int] = set()
    for entry in entries.values():
        for shard in entry.get("blamed", ()) or ():
            if isinstance(shard, int):
                blamed.add(shard)
    return blamed


def decide(
    entries: Mapping[int, Mapping[str, Any]], candidates: Sequence[int], min_size: int,
    quiet_for_s: float,
) -> tuple[int, ...] | str | None:  # fmt: skip
    """The retry group from the meeting's `entries` (shard -> what it brought): its members,
    or why there is none, or None while it is too early to say. `candidates`: the named
    members no one blamed for the first attempt; `quiet_for_s`: seconds since the set of
    members present last changed."""
    present = {shard: entry for shard, entry in entries.items() if shard in candidates}
    left_out = blamed_in(present)
    live = tuple(sorted(shard for shard in present if shard not in left_out))
    if set(live) == set(candidates) - left_out:
        if len(live) >= min_size:
            return live
        return f"{len(live)} member(s) left {list(live)}, fewer than the job's minimum {min_size}"
    if len(live) >= min_size and quiet_for_s >= QUIET_S:
        return live
    return None


@dataclass(frozen=True)
class Request:
    """A member's ask for a retry group: the meeting's candidates and minimum, and the
    round's group key (the namer derives the round's secret from it)."""

    candidates: tuple[int, ...]
    min_size: int
    timeout_s: float
    group: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"candidates": list(self.candidates), "min_size": self.min_size,
                "timeout_s": self.timeout_s, "group": self.group}  # fmt: skip

    @classmethod
    def from_json(cls, raw: Any) -> Request | None:
        """The request as read from the DHT; None if it is malformed."""
        if not isinstance(raw, Mapping):
            return None
        try:
            candidates = tuple(int(m) for m in raw["candidates"])
            min_size, timeout_s = int(raw["min_size"]), float(raw["timeout_s"])
            group = str(raw.get("group", ""))
        except (KeyError, TypeError, ValueError):
            return None
        if not 1 <= len(candidates) <= MAX_MEMBERS or not 1 <= min_size <= len(candidates):
            return None
        if not 0 < timeout_s <= 3600 or (group and not _KEY.match(group)):
            return None
        return cls(candidates, min_size, timeout_s, group)


@dataclass
class _Meeting:
    request: Request
    secret: str  # the round's (`seal`), "" when the namer holds no key
    present: frozenset[int]
    since: float  # when `present` last changed (monotonic)
    until: float  # when the namer forgets it (monotonic)
    named: bool = False


class Namer:
    """Names the retry groups members ask for in `dht` (the coordinator's DHT peer).

    With the coordinator's round `key`, it reads only requests and entries sealed with
    the round's secret (`seal.round_secret` of the request's group key), and seals its
    decision with it; requests of a meeting outside their group are not read."""

    def __init__(self, dht: Any, key: bytes = b"") -> None:
        self._dht = dht
        self._key = key
        self._meetings: dict[str, _Meeting] = {}

    def step(self) -> list[str]:
        """One pass over the requests; the meetings it named in this pass."""
        now = time.monotonic()
        named: list[str] = []
        for key, raw in subkeyed(self._dht.get(REQUESTS, latest=True)).items():
            meeting = self._meetings.get(key) if isinstance(key, str) else None
            if meeting is None:
                meeting = self._asked(key, raw, now)
                if meeting is None:
                    continue
                self._meetings[key] = meeting
            if not meeting.named and self._name(key, meeting, now):
                named.append(key)
        for key in [k for k, m in self._meetings.items() if m.until < now]:
            del self._meetings[key]
        return named

    def _asked(self, key: Any, raw: Any, now: float) -> _Meeting | None:
        """The meeting a request asks about, if it is one to name (its seal holds)."""
        if not isinstance(key, str) or not _KEY.match(key) or not isinstance(raw, Mapping):
            return None
        group = str(raw.get("group", "")) or key
        secret = seal.round_secret(self._key, group)
        request = Request.from_json(seal.opened(raw, secret, f"{REQUESTS}/{key}"))
        if request is None or not key.startswith(group):
            return None
        return _Meeting(request, secret, frozenset(), now, now + request.timeout_s + 60)

    def _name(self, key: str, meeting: _Meeting, now: float) -> bool:
        request = meeting.request
        entries = member_entries(self._dht.get(f"{key}-meet", latest=True), meeting.secret,
                                 f"{key}-meet")  # fmt: skip
        present = frozenset(shard for shard in entries if shard in request.candidates)
        if present != meeting.present:
            meeting.present, meeting.since = present, now
        decided = decide(entries, request.candidates, request.min_size, now - meeting.since)
        if decided is None:
            return False
        if isinstance(decided, str):
            decision = Decision((), decided)
        else:
            decision = Decision(decided, "", tuple(entries[shard] for shard in decided))
        expiration = time.time() + request.timeout_s + 60
        sealed = seal.seal(decision.to_json(), meeting.secret, f"{key}-named")
        meeting.named = bool(self._dht.store(f"{key}-named", sealed, expiration))
        return meeting.named

    def run(self, stop: Any) -> None:
        """Pass over the requests every `POLL_S` until `stop()` is true."""
        while not stop():
            try:
                self.step()
            except Exception as exc:  # the DHT's many kinds: the next pass tries again
                print(f"retry namer: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            time.sleep(POLL_S)


def subkeyed(found: Any) -> dict[Any, Any]:
    """A DHT read of a subkeyed value as subkey -> value ({} if nothing or not subkeyed)."""
    if found is None or not isinstance(getattr(found, "value", None), dict):
        return {}
    return {sub: getattr(entry, "value", None) for sub, entry in found.value.items()}


def member_entries(found: Any, secret: str = "", meeting: str = "") -> dict[int, dict[str, Any]]:
    """A meeting (the DHT key `meeting`) as read from the DHT: each member's entry by its
    shard, its seal checked and taken off (entries that are not one, or whose seal does
    not hold for the round's `secret` and their shard, left out)."""
    entries = {}
    for shard, raw in subkeyed(found).items():
        if isinstance(shard, int) and isinstance(raw, dict):
            entry = seal.opened(raw, secret, f"{meeting}/{shard}")
            if entry is not None:
                entries[shard] = entry
    return entries
