"""Where a round's members meet in the DHT before they all-reduce: each writes what it
brings (its shard, peer id and addresses, its mode, whether it holds the outer state,
its vector's length) under the attempt's meeting key, and reads the others'.

The first attempt's group is the one the coordinator named: it meets once every named
member wrote (`meet`), so every member holds the same entries. A retry's group is the
named members no one blamed for the first attempt's failure, as the coordinator's
bootstrap DHT peer names it (`gather`, `namer`). Members dial
each other at the addresses they wrote (`dial`): libp2p's own routing often does not yet
find a peer that joined seconds before.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import Any

from idlegrid.p2p import namer, seal

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
    timeout_s: float, secret: str = "",
) -> tuple[list[dict[str, Any]] | None, str, list[int]]:  # fmt: skip
    """A first attempt's meeting, without an all-reduce: each named member writes what it
    brings (`gathered`: its shard, whether it holds the outer state, its peak) under the
    step's meeting key, and all of them read the same entries once every member has
    written (its own, as written, among them). Returns what each member brings, in
    `members`' order, "" and []; or None, why not and the members that never came.
    Entries are sealed with the round's `secret` (`seal`); others are not read."""
    meeting = f"{key}-meet"
    sealed = seal.seal(gathered, secret, f"{meeting}/{shard}")
    deadline = time.monotonic() + timeout_s
    stored_at: float | None = None
    seen: set[int] = set()
    while time.monotonic() < deadline:
        due = stored_at is None or time.monotonic() - stored_at > REWRITE_S
        if due and dht.store(meeting, sealed, time.time() + timeout_s + 60, subkey=shard):
            stored_at = time.monotonic()
        entries = namer.member_entries(dht.get(meeting, latest=True), secret, meeting)
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


def gather(
    dht: Any, key: str, candidates: tuple[int, ...], shard: int, gathered: dict[str, Any],
    min_size: int, timeout_s: float, secret: str = "", group_key: str = "",
) -> tuple[dict[int, dict[str, Any]] | None, str]:  # fmt: skip
    """A retry's meeting: the members left (`candidates`: the named ones no member blamed
    for the first attempt's failure) write what they bring, with whom they blame
    (`gathered["blamed"]`), ask the coordinator for a group (`namer.REQUESTS`) and wait
    for the one it names (`namer.decide`: everyone left, or at least `min_size` once no
    newcomer came for a while). Returns each named member's entry by shard and "", or
    None and why not (this member left out, too few left, no group named in time).
    Every record is sealed with the round's `secret` (whose group key is `group_key`:
    the namer derives the secret from it); a decision whose seal does not hold is not
    read."""
    meeting, answer = f"{key}-meet", f"{key}-named"
    entry = seal.seal(gathered, secret, f"{meeting}/{shard}")
    asked = namer.Request(candidates, min_size, timeout_s, group_key or key).to_json()
    request = seal.seal(asked, secret, f"{namer.REQUESTS}/{key}")
    deadline = time.monotonic() + timeout_s
    stored_at: float | None = None
    while time.monotonic() < deadline:
        if stored_at is None or time.monotonic() - stored_at > REWRITE_S:
            expiration = time.time() + timeout_s + 60
            if dht.store(meeting, entry, expiration, subkey=shard) and dht.store(
                namer.REQUESTS, request, expiration, subkey=key
            ):
                stored_at = time.monotonic()
        found = dht.get(answer, latest=True)
        decision = namer.Decision.from_json(
            seal.opened(getattr(found, "value", None), secret, answer)
        )
        if decision is not None:
            if not decision.members:
                return None, f"the coordinator named no retry group under {key}: {decision.reason}"
            if shard not in decision.members:
                return None, f"this member was left out of the retry group named under {key}"
            return decision.met(), ""
        time.sleep(POLL_S)
    return None, (f"the coordinator named no retry group under {key} in {timeout_s:g} s "
                  "(its bootstrap DHT peer names them: is it running?)")  # fmt: skip
