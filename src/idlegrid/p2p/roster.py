"""Where a round's members meet in the DHT before they all-reduce: each writes what it
brings (its shard, peer id and addresses, its mode, whether it holds the outer state,
its vector's length) under the attempt's meeting key, and reads the others'.

The first attempt's group is the one the coordinator named: it meets once every named
member wrote (`meet`), so every member holds the same entries. A retry's group is the
named members no one blamed for the first attempt's failure (`gather`). Members dial
each other at the addresses they wrote (`dial`): libp2p's own routing often does not yet
find a peer that joined seconds before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

# Seconds between reads of the roster while members are missing.
POLL_S = 0.25
# Seconds after which a member writes its entry again.
REWRITE_S = 10.0
# (Entries expire at wall-clock times: Hivemind's DHT time is time.time().)
# Seconds a member waits to connect to another at the addresses that one wrote.
DIAL_S = 10.0


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


def meet(
    dht: Any, key: str, members: tuple[int, ...], shard: int, gathered: dict[str, Any],
    timeout_s: float,
) -> tuple[list[dict[str, Any]] | None, str, list[int]]:  # fmt: skip
    """A first attempt's meeting, without an all-reduce: each named member writes what it
    brings (`gathered`: its shard, whether it holds the outer state, its peak) under the
    step's meeting key, and all of them read the same entries once every member has
    written (its own, as written, among them). Returns what each member brings, in
    `members`' order, "" and []; or None, why not and the members that never came."""
    meeting = f"{key}-meet"
    deadline = time.monotonic() + timeout_s
    stored_at: float | None = None
    seen: set[int] = set()
    while time.monotonic() < deadline:
        due = stored_at is None or time.monotonic() - stored_at > REWRITE_S
        if due and dht.store(meeting, gathered, time.time() + timeout_s + 60, subkey=shard):
            stored_at = time.monotonic()
        found = dht.get(meeting, latest=True)
        entries: dict[int, dict[str, Any]] = {}
        if found is not None and isinstance(found.value, dict):
            entries = {sub: entry.value for sub, entry in found.value.items()
                       if isinstance(sub, int) and isinstance(entry.value, dict)}  # fmt: skip
        seen |= set(entries)
        if set(members) <= set(entries) and entries[shard] == gathered:
            return [entries[member] for member in members], "", []
        time.sleep(POLL_S)
    missing = sorted(set(members) - seen)
    return (
        None,
        (
            f"the named group under {key} did not meet in {timeout_s:g} s: members {missing} "
            "never came"
            + ("" if stored_at is not None or shard in seen else " (nor could this one)")
        ),
        missing,
    )


# Seconds a retry's meeting must see no new member before those present form the group.
QUIET_S = 3.0


def _entries(found: Any) -> dict[int, dict[str, Any]]:
    if found is None or not isinstance(found.value, dict):
        return {}
    return {sub: entry.value for sub, entry in found.value.items()
            if isinstance(sub, int) and isinstance(entry.value, dict)}  # fmt: skip


def gather(
    dht: Any, key: str, candidates: tuple[int, ...], shard: int, gathered: dict[str, Any],
    min_size: int, timeout_s: float,
) -> tuple[dict[int, dict[str, Any]] | None, str]:  # fmt: skip
    """A retry's meeting: the members left (`candidates`: the named ones no member blamed
    for the first attempt's failure) write what they bring, with whom they blame
    (`gathered["blamed"]`); a member blamed in any entry is left out. The group is every
    candidate not left out once all of them wrote, or, with at least `min_size`, those
    present once `QUIET_S` passed without a newcomer. Members that read different
    entries derive different groups (their all-reduce then fails for both, and they fall
    back): the group is never formed from what only some of them saw."""
    meeting = f"{key}-meet"
    deadline = time.monotonic() + timeout_s
    stored_at: float | None = None
    last: frozenset[int] = frozenset()
    since = time.monotonic()
    while time.monotonic() < deadline:
        due = stored_at is None or time.monotonic() - stored_at > REWRITE_S
        if due and dht.store(meeting, gathered, time.time() + timeout_s + 60, subkey=shard):
            stored_at = time.monotonic()
        entries = {s: e for s, e in _entries(dht.get(meeting, latest=True)).items()
                   if s in candidates}  # fmt: skip
        left_out = {int(b) for e in entries.values() for b in e.get("blamed", ())}
        if shard in left_out:
            return None, f"this member was left out of the retry under {key}"
        live = frozenset(s for s in entries if s not in left_out)
        if live != last:
            last, since = live, time.monotonic()
        everyone = live == set(candidates) - left_out
        quiet = len(live) >= min_size and time.monotonic() - since >= QUIET_S
        if entries.get(shard) == gathered and (everyone or quiet):
            return {s: entries[s] for s in sorted(live)}, ""
        time.sleep(POLL_S)
    return None, (f"no retry group of {min_size}+ formed under {key} in {timeout_s:g} s "
                  f"(seen: {sorted(last)})")  # fmt: skip
