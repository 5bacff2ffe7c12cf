"""A group whose members the coordinator named, formed without electing a leader.

Hivemind's matchmaking finds a group among peers that do not know each other: each
declares itself a potential leader in the DHT and asks the others to follow it, with
short request timeouts that unstick two members that asked each other at once. On a
loaded machine (answers slower than the timeouts) members can ask and time out until the
group's whole timeout has passed, although all of them were there.

A round's first attempt needs no election: the coordinator named every member, and
the attempt runs only if all of them come. So each member writes its peer id and its
gathered data under the step's roster key in the DHT (once its averager serves, so no
part is sent to it before it can take one) and waits until it reads every named
member's entry, its own as it wrote it among them;
then all of them hold the same roster and derive the same group from it: the same id,
the same order of peers, the same gathered data. A retry (some member missing: who is
in is then a choice) goes through Hivemind's own matchmaking.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Mapping
from typing import Any

# Seconds between reads of the roster while members are missing.
POLL_S = 0.25
# Seconds after which a member writes its entry again.
REWRITE_S = 10.0
# Seconds a member waits to connect to another at the addresses that one wrote.
DIAL_S = 10.0


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
        if not (isinstance(subkey, int) and isinstance(value, (list, tuple))
                and len(value) in (2, 3)):  # fmt: skip
            continue
        peer, gathered = value[0], value[1]
        if isinstance(peer, bytes) and isinstance(gathered, bytes):
            entries[subkey] = (peer, gathered)
    if not set(members) <= set(entries):
        return None
    return {shard: entries[shard] for shard in members}


def addresses(found: Any) -> dict[int, tuple[str, ...]]:
    """The addresses each member wrote beside its entry (the third part; none in an entry
    of two), as multiaddr strings."""
    if found is None or not isinstance(found.value, dict):
        return {}
    known: dict[int, tuple[str, ...]] = {}
    for subkey, entry in found.value.items():
        value = entry.value
        three = isinstance(value, (list, tuple)) and len(value) == 3
        if isinstance(subkey, int) and three and isinstance(value[2], (list, tuple)):
            known[subkey] = tuple(a for a in value[2] if isinstance(a, str))
    return known


async def dial(p2p: Any, peers: Mapping[int, bytes], known: Mapping[int, tuple[str, ...]],
               shard: int) -> None:  # fmt: skip
    """Connect to every other member at the addresses it wrote, so that the all-reduce
    finds them: a member that knows a peer only by its id asks libp2p's own routing,
    which does not find a peer that joined seconds ago ("routing: not found"), and
    Hivemind then averages without that peer's part. A failed dial is left to that
    routing, as before (a member behind NAT is reached through a relay)."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def one(peer: bytes, addrs: tuple[str, ...]) -> None:
        with contextlib.suppress(Exception):  # its multiaddrs, its daemon: many kinds
            await asyncio.wait_for(
                p2p._client.connect(PeerID(peer), [Multiaddr(a) for a in addrs]), DIAL_S
            )

    await asyncio.gather(*(one(peer, known[member]) for member, peer in peers.items()
                           if member != shard and known.get(member)))  # fmt: skip


def own_addresses(maddrs: Any) -> list[str]:
    """This peer's visible multiaddrs as strings, without their `/p2p/ID` part."""
    return [str(a).split("/p2p/")[0] for a in maddrs]


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
        # Hivemind's averager holds its process's replica of the DHT's p2p daemon here.
        p2p = averager._p2p
        own = (averager.peer_id.to_bytes(), step.data_for_gather)
        entry = (*own, own_addresses(await p2p.get_visible_maddrs()))
        started, stored_at, seen = get_dht_time(), None, set[int]()
        while get_dht_time() < step.deadline:
            # Written again now and then: a store can fail or reach few peers while a
            # loaded machine's DHT is slow to answer.
            due = stored_at is None or get_dht_time() - stored_at > REWRITE_S
            if due and await averager.dht.store(key, entry, step.deadline + 60, subkey=shard,
                                                return_future=True):  # fmt: skip
                stored_at = get_dht_time()
            found = await averager.dht.get(key, latest=True, return_future=True)
            if found is not None and isinstance(found.value, dict):
                seen |= {sub for sub in found.value if isinstance(sub, int)}
            roster = complete(found, members)
            # Its own entry as read back, not the store's answer, says it is in: a store
            # can answer False (some of the peers it went to did not take it) while the
            # others read the entry and form the group with this member.
            if roster is not None and roster[shard] == own:
                peers = {member: peer for member, (peer, _) in roster.items()}
                await dial(p2p, peers, addresses(found), shard)
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


def meet(
    dht: Any, key: str, members: tuple[int, ...], shard: int, gathered: dict[str, Any],
    timeout_s: float,
) -> tuple[list[dict[str, Any]] | None, str]:  # fmt: skip
    """A first attempt's meeting, without an all-reduce: each named member writes what it
    brings (`gathered`: its shard, whether it holds the outer state, its peak) under the
    step's meeting key, and all of them read the same entries once every member has
    written (its own, as written, among them). Returns what each member brings, in
    `members`' order, and ""; or None and why not."""
    from hivemind.utils import get_dht_time

    meeting = f"{key}-meet"
    deadline = time.monotonic() + timeout_s
    stored_at: float | None = None
    seen: set[int] = set()
    while time.monotonic() < deadline:
        due = stored_at is None or time.monotonic() - stored_at > REWRITE_S
        if due and dht.store(meeting, gathered, get_dht_time() + timeout_s + 60, subkey=shard):
            stored_at = time.monotonic()
        found = dht.get(meeting, latest=True)
        entries: dict[int, dict[str, Any]] = {}
        if found is not None and isinstance(found.value, dict):
            entries = {sub: entry.value for sub, entry in found.value.items()
                       if isinstance(sub, int) and isinstance(entry.value, dict)}  # fmt: skip
        seen |= set(entries)
        if set(members) <= set(entries) and entries[shard] == gathered:
            return [entries[member] for member in members], ""
        time.sleep(POLL_S)
    missing = sorted(set(members) - seen)
    return None, (
        f"the named group under {key} did not meet in {timeout_s:g} s: members {missing} "
        "never came" + ("" if stored_at is not None or shard in seen else " (nor could this one)")
    )
