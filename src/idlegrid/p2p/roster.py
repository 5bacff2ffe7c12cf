"""A group whose members the coordinator named, formed without electing a leader.

Hivemind's matchmaking finds a group among peers that do not know each other: each
declares itself a potential leader in the DHT and asks the others to follow it, with
short request timeouts that unstick two members that asked each other at once. On a
loaded machine (answers slower than the timeouts) members can ask and time out until the
group's whole timeout has passed, although all of them were there.

A round's first attempt needs no election: the coordinator named every member, and
the attempt runs only if all of them come. So each member writes its peer id and its
gathered data under the step's roster key in the DHT (once its averager serves, so no
part is sent to it before it can take one) and waits until every named member has;
then all of them hold the same roster and derive the same group from it: the same id,
the same order of peers, the same gathered data. A retry (some member missing: who is
in is then a choice) goes through Hivemind's own matchmaking.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping
from typing import Any

# Seconds between reads of the roster while members are missing.
POLL_S = 0.25
# Seconds after which a member writes its entry again.
REWRITE_S = 10.0


def group_order(key: str, peers: Mapping[int, bytes]) -> list[int]:
    """The members (shards) in the group's order: by a hash of the key and each peer id,
    so that no member chooses its place (Hivemind's leader shuffles for the same reason)."""
    return sorted(peers, key=lambda shard: hashlib.sha256(key.encode() + peers[shard]).digest())


def group_id(key: str, peers: Mapping[int, bytes]) -> bytes:
    """The group's id: the same on every member that holds the same roster."""
    digest = hashlib.sha256(key.encode())
    for shard in sorted(peers):
        digest.update(shard.to_bytes(4, "big") + peers[shard])
    return digest.digest()[:20]


def complete(found: Any, members: tuple[int, ...]) -> dict[int, tuple[bytes, bytes]] | None:
    """Every named member's (peer id, gathered data) from a DHT read of the roster, or
    None while one is missing or an entry is malformed."""
    if found is None or not isinstance(found.value, dict):
        return None
    entries: dict[int, tuple[bytes, bytes]] = {}
    for subkey, entry in found.value.items():
        value = entry.value
        if not (isinstance(subkey, int) and isinstance(value, (list, tuple)) and len(value) == 2):
            continue
        peer, gathered = value
        if isinstance(peer, bytes) and isinstance(gathered, bytes):
            entries[subkey] = (peer, gathered)
    if not set(members) <= set(entries):
        return None
    return {shard: entries[shard] for shard in members}


def named_matchmaking(averager: Any, *, members: tuple[int, ...], shard: int) -> Callable[..., Any]:
    """A `look_for_group(step)` for `averager` (run in its process) that forms the group
    of `members` from the roster; `shard`: this member's. It raises Hivemind's
    MatchmakingException naming the members still missing at the step's deadline."""
    from hivemind.averaging.group_info import GroupInfo
    from hivemind.averaging.matchmaking import MatchmakingException
    from hivemind.p2p import PeerID
    from hivemind.utils import get_dht_time

    key = f"{averager.prefix}-roster"

    async def look_for_group(step: Any) -> Any:
        own = (averager.peer_id.to_bytes(), step.data_for_gather)
        started, stored_at, seen = get_dht_time(), None, set[int]()
        while get_dht_time() < step.deadline:
            # Written again now and then: a store can fail or reach few peers while a
            # loaded machine's DHT is slow to answer.
            due = stored_at is None or get_dht_time() - stored_at > REWRITE_S
            if due and await averager.dht.store(key, own, step.deadline + 60, subkey=shard,
                                                return_future=True):  # fmt: skip
                stored_at = get_dht_time()
            found = await averager.dht.get(key, latest=True, return_future=True)
            if found is not None and isinstance(found.value, dict):
                seen |= {sub for sub in found.value if isinstance(sub, int)}
            roster = complete(found, members) if stored_at is not None else None
            if roster is not None:
                peers = {member: peer for member, (peer, _) in roster.items()}
                order = group_order(averager.prefix, peers)
                return GroupInfo(
                    group_id(averager.prefix, peers),
                    tuple(PeerID(peers[member]) for member in order),
                    tuple(roster[member][1] for member in order),
                )
            await asyncio.sleep(POLL_S)
        missing = sorted(set(members) - seen)
        waited = get_dht_time() - started
        raise MatchmakingException(
            f"the named group under {averager.prefix} did not fill in {waited:.0f} s: "
            f"members {missing} never wrote its roster"
            + ("" if stored_at is not None else " (nor could this member)")
        )

    return look_for_group
