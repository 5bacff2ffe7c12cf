"""One round's averaging in the standing averager: the whole group, then a retry among
the members left.

An attempt is a meeting in the DHT (`roster`) and an all-reduce (`allreduce`). The
first attempt waits for every named member (`roster.meet`). If it fails, each member
knows whom it could not do without (a member that never came, a reducer that did not
answer, a member whose part did not decode, a member a reducer waited for in vain:
`blamed`), and the retry meets among the named members that no one blamed, in the
group the coordinator names for it (`roster.gather`, `namer`), if at least the group's
`min_size` (the job's minimum) of them are left. A round's
attempts together take at most twice the group's timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from idlegrid.p2p import allreduce, parts, roster
from idlegrid.p2p.group import Group
from idlegrid.training.compression import Compression

ALL_CLIENTS = "every member of the group runs in client mode (behind NAT): none can serve"


@dataclass
class Outcome:
    """What a round's attempts came to (see `averaging.Averaged`)."""

    mean: np.ndarray | None
    members: dict[int, bool]
    attempt: int
    reason: str
    residual: np.ndarray | None = None
    wire_bytes: int = 0
    blamed: set[int] = field(default_factory=set)


def attempt_all(server: Any, values: np.ndarray, group: Group, shard: int, holds: bool,
                settings: Compression) -> Outcome:  # fmt: skip
    """The whole group, then (if that fails) a retry among the members left."""
    blamed: set[int] = set()
    reasons: list[str] = []
    wire = 0
    for attempt, retry in ((1, False), (2, True)):
        candidates = tuple(m for m in group.members if m not in blamed)
        if retry and len(candidates) < group.min_size:
            reasons.append(f"no retry: {len(candidates)} member(s) left, fewer than "
                           f"{group.min_size}")  # fmt: skip
            break
        key = group.key + ("-retry" if retry else "")
        outcome = _attempt(server, values, group, key, candidates, retry, shard, holds,
                           settings, blamed)  # fmt: skip
        wire += outcome.wire_bytes
        outcome.wire_bytes, outcome.attempt = wire, attempt
        if outcome.mean is not None:
            outcome.blamed = blamed
            outcome.reason = "; ".join(reasons)  # why the first attempt failed, if it did
            return outcome
        reasons.append(outcome.reason)
        blamed |= outcome.blamed - {shard}
        if outcome.reason == ALL_CLIENTS:
            break
    return Outcome(None, {}, attempt, "; ".join(reasons), wire_bytes=wire, blamed=blamed)


def _attempt(server: Any, values: np.ndarray, group: Group, key: str,
             candidates: tuple[int, ...], retry: bool, shard: int, holds: bool,
             settings: Compression, blamed: set[int]) -> Outcome:  # fmt: skip
    deadline = time.monotonic() + group.timeout_s
    gathered = {
        "shard": shard, "holds_state": holds, "mode": server.mode, "length": int(values.size),
        "peer": server.p2p.peer_id.to_base58(), "blamed": sorted(blamed),
        "addrs": roster.own_addresses(server.run(server.p2p.get_visible_maddrs())),
    }  # fmt: skip
    if retry:
        met, reason = roster.gather(server.dht, key, candidates, shard, gathered,
                                    group.min_size, group.timeout_s, group.secret,
                                    group.key)  # fmt: skip
        if met is None:
            return Outcome(None, {}, 0, reason)
    else:
        found, reason, missing = roster.meet(server.dht, key, candidates, shard, gathered,
                                             group.timeout_s, group.secret)  # fmt: skip
        if found is None:
            return Outcome(None, {}, 0, reason, blamed=set(missing))
        met = dict(zip(candidates, found, strict=True))
    return _all_reduce(server, values, key, met, shard, settings, deadline)


def _all_reduce(server: Any, values: np.ndarray, key: str, met: dict[int, dict[str, Any]],
                shard: int, settings: Compression, deadline: float) -> Outcome:  # fmt: skip
    from hivemind.p2p import PeerID

    reducers = tuple(sorted(s for s, e in met.items() if e.get("mode") != "client"))
    if not reducers:
        return Outcome(None, {}, 0, ALL_CLIENTS)
    lengths = {s: int(e.get("length", -1)) for s, e in met.items()}
    odd = sorted(s for s, n in lengths.items() if n != values.size)
    if odd:
        return Outcome(None, {}, 0, f"members {odd} bring vectors of another length",
                       blamed=set(odd))  # fmt: skip
    peers = {s: str(e["peer"]) for s, e in met.items()}
    as_bytes = {s: PeerID.from_base58(p).to_bytes() for s, p in peers.items()}
    addresses = {s: tuple(str(a) for a in e.get("addrs", ())) for s, e in met.items()}
    server.run(roster.dial(server.p2p, as_bytes, addresses, shard))
    plan = allreduce.Plan(key, tuple(sorted(met)), reducers, peers, int(values.size), settings)
    reduction = parts.Reduction(values, settings, len(met), plan.bounds())
    try:
        moved = server.run(allreduce.run(server.p2p, server.reducer, plan, shard, reduction,
                                         deadline),
                           timeout=max(1.0, deadline - time.monotonic() + 5.0))  # fmt: skip
    except allreduce.AllReduceFailed as exc:
        return Outcome(None, {}, 0, f"{key}: {exc}", wire_bytes=_served(server, plan),
                       blamed=set(exc.blamed))  # fmt: skip
    except Exception as exc:  # the daemon, a timeout of the loop: many kinds
        return Outcome(None, {}, 0, f"{key}: {type(exc).__name__}: {exc}"[:300],
                       wire_bytes=_served(server, plan))  # fmt: skip
    members = {s: bool(e.get("holds_state")) for s, e in met.items()}
    return Outcome(reduction.mean(), members, 0, "", reduction.residual(),
                   moved + _served(server, plan))  # fmt: skip


def _served(server: Any, plan: allreduce.Plan) -> int:
    """Bytes this member moved as a reducer of the plan's group."""
    return int(server.reducer.moved.get(plan.group_id, 0))
