"""One member's averaging step, in a child process of its own (Hivemind imports torch
and starts processes, which a worker's task process may not: it is a daemon).

`join(group)` (the member's side, numpy only) starts `python -m idlegrid.p2p.averaging
GROUP` when the task starts, so the child imports torch and hivemind and joins the DHT at
the coordinator's bootstrap peer while the member trains; `Joining.average` then hands
it the vector (a file named on its stdin) and reads the group's mean back. The child
runs up to two attempts:

1. the whole group (every member named) under the round's key;
2. if that fails (a member died before or during the all-reduce, or never came), a
   retry under the key + "-retry" that starts with at least `min_size` members.

Members average fixed-point integers so that every member of a group reads back the same
bytes of the mean (their digests agree): Hivemind reduces in float32 and hands each member
its own vector plus the difference to the mean, which float rounding leaves slightly
different from member to member. Each attempt is two steps under its key: the members
meet (a one-value average) and learn, through Hivemind's gather, each other's shard,
whether each holds the outer optimizer's state and the largest magnitude in each vector;
then they average their vectors as integers (times a power of two chosen from that
magnitude so that K of them sum below 2^20, where float32 is exact), and K times what they
read back, rounded, is the exact integer sum on every member. The rounding to integers is
2^-18 of the largest value for K = 4: below the int8 upload compression's own.
The child joins as a full peer or in Hivemind's client mode (behind NAT: it connects out
only and reduces no part; `reachability`), and says which in the DHT under the group's
key: a group whose members all run in client mode cannot all-reduce, and each member
gives up before its attempt instead of waiting out the timeout (`serving`).
Exact sums are not enough: a member also keeps its averager up until every member of the
group has read its result back (`settle`), since Hivemind leaves a member its own values
for a part whose reducer went away before answering, and counts the step a success.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from idlegrid import p2p
from idlegrid.p2p import reachability
from idlegrid.p2p.group import Group
from idlegrid.training.flat import ContainerError, pack, unpack

FORMAT_IN = "idlegrid/p2p-average-in"
FORMAT_OUT = "idlegrid/p2p-average-out"
# Seconds the child may take to import torch and hivemind and start its p2p daemon.
STARTUP_S = 60.0
# A retry's meeting all-reduces this many zeros: enough that every member of a group has
# a part to reduce (with one value, all but one member had none, and could finish and
# leave before the one that reduces it had their inputs).
MEET_VALUES = 256
# The averaged integers of K members sum below 2^20: float32 (Hivemind's reducer) holds
# them exactly, and K x its rounding of the mean stays far below 0.5 for K <= 64.
INTEGER_BITS = 20
MAX_MEMBERS = 64
# The reason a group of client-mode members gives: nobody can lead or reduce.
ALL_CLIENTS = "every member of the group runs in client mode (behind NAT): none can serve"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Averaged:
    """What one member's averaging step came to."""

    # The group's mean (float32), or None: no group formed (see `reason`).
    values: np.ndarray | None
    # The members it averaged with (itself included): shard -> holds the outer state.
    members: dict[int, bool] = field(default_factory=dict)
    attempt: int = 0
    reason: str = ""
    # How this member took part: "public" (a full peer) or "client" (Hivemind's client mode).
    reachability: reachability.Mode = "public"


class Joining:
    """A member's averaging child, started when its task starts: importing torch and
    hivemind, starting the p2p daemon and joining the DHT take seconds, which then pass
    while the member trains, not after (members that finish training together then
    meet in their group together)."""

    def __init__(self, group: Group, *, shard: int, reachability_setting: str = "auto") -> None:
        self.group = group
        self.mode, why = reachability.choose(
            reachability_setting, group.peers, reachability.local_addresses()
        )
        log.info("peer-to-peer averaging of %s as a %s peer: %s", group.key, self.mode, why)
        self._scratch = tempfile.TemporaryDirectory(prefix="idlegrid-p2p-")
        self._started = time.monotonic()
        env = {**os.environ, "HIVEMIND_LOGLEVEL": os.environ.get("HIVEMIND_LOGLEVEL", "ERROR")}
        # Its log goes to a file: a pipe nobody reads while the member trains would fill.
        # IDLEGRID_P2P_LOG_DIR keeps each member's log (Hivemind's, at HIVEMIND_LOGLEVEL)
        # there, named by the round and shard, for an operator looking into a failed group.
        self._log_path = Path(self._scratch.name, "averaging.log")
        kept = os.environ.get("IDLEGRID_P2P_LOG_DIR")
        if kept:
            Path(kept).mkdir(parents=True, exist_ok=True)
            self._log_path = Path(kept, f"{group.key}-{shard}.log")
        self._log = self._log_path.open("w")  # noqa: SIM115
        self._process = subprocess.Popen(
            [sys.executable, "-m", "idlegrid.p2p.averaging", json.dumps(group.to_json()),
             str(shard), self.mode],
            stdin=subprocess.PIPE, stderr=self._log, stdout=subprocess.DEVNULL,
            text=True, env=env,
        )  # fmt: skip

    def average(self, values: np.ndarray, *, shard: int, holds_state: bool) -> Averaged:
        """Average `values` with the group's other members; never raises for a failed
        group (a daemon that did not start, a group that did not form): `reason` says why."""
        given = Path(self._scratch.name, "in.safetensors")
        taken = Path(self._scratch.name, "out.safetensors")
        header = {"format": FORMAT_IN, "shard": shard, "holds_state": holds_state}
        given.write_bytes(pack({"values": np.asarray(values, np.float32)}, header))
        limit = max(0.0, STARTUP_S - (time.monotonic() - self._started))
        limit += 2 * self.group.timeout_s + 10.0
        try:
            self._process.communicate(f"{given}\t{taken}\n", timeout=limit)
        except subprocess.TimeoutExpired:
            self.close()
            why = f"the averaging process ran past {limit:.0f} s"
            return Averaged(None, reason=why, reachability=self.mode)
        except OSError as exc:
            self.close()
            why = f"the averaging process is gone: {exc}"
            return Averaged(None, reason=why, reachability=self.mode)
        try:
            if self._process.returncode != 0 or not taken.exists():
                self._log.flush()
                errors = self._log_path.read_text(errors="replace")
                tail = errors.strip().splitlines()[-3:]
                reason = f"the averaging process failed ({self._process.returncode}): "
                why = reason + " | ".join(tail)[:500]
                return Averaged(None, reason=why, reachability=self.mode)
            return _read_out(taken.read_bytes(), self.mode)
        finally:
            self.close()

    def close(self) -> None:
        """End the child (if it still runs) and remove its files."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._log.close()
        self._scratch.cleanup()


def join(group: Group, *, shard: int, reachability_setting: str = "auto") -> Joining:
    """Start shard `shard`'s averaging child for `group` (see `Joining`), as a full peer
    or in client mode (`reachability.choose`)."""
    return Joining(group, shard=shard, reachability_setting=reachability_setting)


def _read_out(blob: bytes, asked: reachability.Mode) -> Averaged:
    """The child's answer; `asked`: the mode it was started in (what it ran in, as its
    DHT said, comes in the answer when it joined the DHT)."""
    try:
        arrays, header = unpack(blob)
        if header.get("format") != FORMAT_OUT:
            raise ContainerError(f"not a {FORMAT_OUT} container")
        members = {int(shard): bool(full) for shard, full in header["members"]}
        ran: reachability.Mode = (
            "client" if header.get("reachability", asked) == "client" else "public"
        )
        return Averaged(arrays.get("values"), members, int(header["attempt"]),
                        str(header["reason"]), ran)  # fmt: skip
    except (ContainerError, KeyError, TypeError, ValueError) as exc:
        return Averaged(None, reason=f"unreadable averaging output: {exc}", reachability=asked)


# -- the child process ----------------------------------------------------------------------


def _attempts(group: Group) -> list[tuple[str, int]]:
    """(key, smallest group) of each attempt: the whole group, then the retry."""
    first = [(group.key, group.size)]
    return first + [(group.key + "-retry", group.min_size)]


def _allreduce(
    dht: Any,
    vector: np.ndarray,
    key: str,
    sizes: tuple[int, int],
    group: Group,
    gather: dict[str, Any],
    *,
    named: tuple[int, ...] | None = None,
    wait: bool = False,
) -> tuple[np.ndarray | None, list[Any], str]:
    """One Hivemind averaging step: (the vector it left, what each member gathered, why not).

    `named`: the members (shards), all of whom must come: they form the group from their
    roster (`roster`); None: Hivemind's matchmaking finds a group of `sizes`.
    `wait`: the step's vector is the data (not a meeting): see `settle`."""
    import torch

    target, min_size = sizes
    averager = _averager_class()(
        [torch.from_numpy(np.array(vector, np.float32))], dht, start=True, prefix=key,
        named=named, shard=int(gather["shard"]),
        target_group_size=target, min_group_size=min_size,
        # Matchmaking (Hivemind's defaults, shorter for short groups). A request to a
        # potential leader that goes unanswered this long is dropped and the member looks
        # again: that is how two members that asked each other at once get unstuck, so it
        # stays below min_matchmaking_time, as Hivemind advises. It plays no part in the
        # all-reduce (a long one let such crossed requests eat a group's whole timeout).
        min_matchmaking_time=min(5.0, group.timeout_s / 4),
        request_timeout=min(3.0, group.timeout_s / 8), allreduce_timeout=group.timeout_s,
        # No sender or reducer timeouts: Hivemind would then average a slow member's parts
        # without it and hand members different means. All or nothing: a member that dies
        # fails the step for all (after allreduce_timeout), and the retry goes on without it.
        sender_timeout=None, reducer_timeout=None,
        allow_state_sharing=False,
    )  # fmt: skip
    try:
        found = averager.step(gather=gather, timeout=group.timeout_s, allow_retries=False)
        if not found:
            return None, [], f"no group of {min_size}+ formed under {key} in {group.timeout_s:g} s"
        with averager.get_tensors() as tensors:
            values = tensors[0].numpy().copy()
        if wait:
            settle(dht, key, [g["shard"] for g in found.values()], gather["shard"], values,
                   group.timeout_s / 2)  # fmt: skip
        return values, list(found.values()), ""
    except Exception as exc:  # hivemind raises many kinds (all-reduce, matchmaking, p2p)
        return None, [], f"{type(exc).__name__}: {exc}"[:300]
    finally:
        averager.shutdown()


_AVERAGER: Any = None


def _averager_class() -> Any:
    """Hivemind's averager, whose first attempts form the named group from the roster
    (`roster`) instead of electing a leader; defined on first use (it imports torch)."""
    global _AVERAGER
    if _AVERAGER is not None:
        return _AVERAGER
    from hivemind.averaging import DecentralizedAverager

    from idlegrid.p2p import roster

    class NamedGroupAverager(DecentralizedAverager):  # type: ignore[misc]
        """`named`: every member of the group, all of whom must come (a first attempt);
        None: Hivemind's matchmaking finds the group (a retry)."""

        def __init__(self, *args: Any, named: tuple[int, ...] | None, shard: int,
                     **kwargs: Any) -> None:  # fmt: skip
            # Set before Hivemind starts the averager's process, which takes a copy.
            self._named, self._shard = named, shard
            super().__init__(*args, **kwargs)

        async def _step(self, **kwargs: Any) -> Any:
            if self._named is not None:  # runs in the averager's process, which made it
                self._matchmaking.look_for_group = roster.named_matchmaking(
                    self, members=self._named, shard=self._shard
                )
            return await super()._step(**kwargs)

    _AVERAGER = NamedGroupAverager
    return _AVERAGER


def settle(dht: Any, key: str, members: list[int], shard: int, values: np.ndarray,
           timeout_s: float) -> None:  # fmt: skip
    """Keep this member's averager up until every member of its group has read back its
    result (each says so in the DHT under the step's key), or `timeout_s` passed.

    A member's result comes from every reducer of the group, and a reducer's averager that
    shuts down while its answer to a slower member is still on the wire leaves that member
    its own values for the part (Hivemind counts its step a success): that member's mean
    would then differ from the others'. Each member also leaves the digest of what it read
    back; a group whose digests differ says so in the averaging log.
    """
    from hivemind.utils import get_dht_time

    done = f"{key}-done"
    mark = hashlib.sha256(np.ascontiguousarray(values).tobytes()).hexdigest()[:16]
    dht.store(done, mark, get_dht_time() + 2 * timeout_s + 60, subkey=shard)
    deadline = time.monotonic() + timeout_s
    marks: dict[Any, str] = {}
    while time.monotonic() < deadline:
        found = dht.get(done, latest=True)
        if found is not None and isinstance(found.value, dict):
            marks = {sub: entry.value for sub, entry in found.value.items()}
        if set(members) <= set(marks):
            break
        time.sleep(0.05)
    if len(set(marks.values())) > 1:
        print(f"{key}: the group's members read back different sums: {marks}", file=sys.stderr)


def _step(dht: Any, values: np.ndarray, key: str, min_size: int, group: Group,
          gather: dict[str, Any]) -> tuple[np.ndarray | None, dict[int, bool], str]:  # fmt: skip
    """One attempt: meet (and learn each other's peaks), then average as integers.

    The whole group (`min_size` = its size) meets as named, through the DHT alone
    (`roster.meet`); a smaller one is found by Hivemind's matchmaking, with an all-reduce
    of `MEET_VALUES` zeros. Those who met then average as named."""
    from idlegrid.p2p import roster

    peak = float(np.max(np.abs(values))) if values.size else 0.0
    gathered = {**gather, "peak": peak}
    found: list[Any] | None
    if min_size == group.size:
        found, reason = roster.meet(dht, key, group.members, int(gather["shard"]), gathered,
                                    group.timeout_s)  # fmt: skip
    else:
        met, found, reason = _allreduce(dht, np.zeros(MEET_VALUES), key,
                                        (group.size, min_size), group, gathered)  # fmt: skip
        found = found if met is not None else None
    if found is None:
        return None, {}, reason
    members = {int(g["shard"]): bool(g["holds_state"]) for g in found}
    scale = fixed_scale(max(float(g["peak"]) for g in found), len(found))
    size = (len(found), len(found))
    summed, _, reason = _allreduce(dht, to_fixed(values, scale), f"{key}-data", size, group,
                                   {"shard": gather["shard"]}, named=tuple(sorted(members)),
                                   wait=True)  # fmt: skip
    if summed is None:
        return None, {}, reason
    return from_fixed(summed, len(found), scale), members, ""


Outcome = tuple[np.ndarray | None, dict[int, bool], int, str]


def fixed_scale(peak: float, members: int) -> float:
    """The power of two that maps values up to `peak` to integers K of which sum below
    2^20 (the same on every member: all know every member's peak)."""
    bound = 2.0**INTEGER_BITS / members / 2
    if not peak > 0 or not np.isfinite(peak):
        return 1.0
    return float(2.0 ** np.floor(np.log2(bound / peak)))


def to_fixed(values: np.ndarray, scale: float) -> np.ndarray:
    """The vector as integers, carried in float32 (exact: K of them sum below 2^20), so
    the all-reduce sends 4 bytes a value."""
    return np.rint(np.asarray(values, np.float64) * scale).astype(np.float32)


def from_fixed(received: np.ndarray, members: int, scale: float) -> np.ndarray:
    """The group's mean from what Hivemind left in a member's vector: the same on all."""
    total = np.rint(np.asarray(received, np.float64) * members)
    return (total / members / scale).astype(np.float32)


def _attempt_all(dht: Any, values: np.ndarray, group: Group, shard: int, holds: bool) -> Outcome:
    reasons: list[str] = []
    for attempt, (key, min_size) in enumerate(_attempts(group), start=1):
        if not serving(dht, group, wait_s=min(10.0, group.timeout_s / 4)):
            return None, {}, attempt, "; ".join([*reasons, ALL_CLIENTS])
        gather = {"shard": shard, "holds_state": holds}
        mean, members, reason = _step(dht, values, key, min_size, group, gather)
        if mean is not None:
            return mean, members, attempt, ""
        reasons.append(reason)
    if not serving(dht, group, seen_only=True):
        reasons.append("no member that serves was seen: those seen run in client mode")
    return None, {}, 2, "; ".join(reasons)


def announce(dht: Any, group: Group, shard: int, mode: str) -> None:
    """Say in the DHT, under the group's key, how this member takes part."""
    from hivemind.utils import get_dht_time

    expires = get_dht_time() + 2 * group.timeout_s + STARTUP_S + 60
    dht.store(f"{group.key}-modes", mode, expires, subkey=shard)


def serving(dht: Any, group: Group, *, wait_s: float = 0.0, seen_only: bool = False) -> bool:
    """False when no member can serve the all-reduce: every member has said it runs in
    client mode (`seen_only`: every member that said anything did). Else True. Waits up
    to `wait_s` for members that have not said yet (a full peer ends the wait at once)."""
    deadline = time.monotonic() + wait_s
    while True:
        found = dht.get(f"{group.key}-modes", latest=True)
        modes: dict[int, str] = {}
        if found is not None and isinstance(found.value, dict):
            modes = {int(sub): str(entry.value) for sub, entry in found.value.items()}
        if any(mode != "client" for mode in modes.values()):
            return True
        if seen_only:
            return not modes
        if set(group.members) <= set(modes):
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.2)


def _exit_with_parent() -> None:
    """A member whose task process died (killed) leaves its group at once."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        _leave(3)

    threading.Thread(target=watch, daemon=True).start()


def _leave(code: int) -> NoReturn:
    """Exit now, with Hivemind's processes (its DHT and averagers are forked children,
    which an exit that skips their shutdown would leave running)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child.kill()
    sys.stdout.flush()
    os._exit(code)


def _join_dht(group: Group, mode: str) -> Any:
    """Join the DHT as a full peer or in client mode (its averagers follow the DHT's mode).
    Either way libp2p's circuit relays are on: a peer that is only reachable through a
    relay (the bootstrap peer relays) can still be dialled."""
    import hivemind

    return hivemind.DHT(initial_peers=list(group.peers), start=True,
                        host_maddrs=["/ip4/0.0.0.0/tcp/0"], client_mode=mode == "client",
                        use_relay=True, use_auto_relay=False,
                        wait_timeout=p2p.DHT_REQUEST_TIMEOUT_S)  # fmt: skip


def main(argv: list[str]) -> int:
    """The child: join the DHT now, then wait for the member's vector (a line on stdin
    naming its file and where to write the mean) and average it."""
    group = Group.from_json(json.loads(argv[0]))
    own, mode = int(argv[1]), reachability.check(argv[2])
    _exit_with_parent()
    dht, failed = None, ""
    try:
        dht = _join_dht(group, mode)
        announce(dht, group, own, "client" if dht.client_mode else "public")
    except Exception as exc:  # the p2p daemon, the DHT bootstrap: many kinds of errors
        failed = f"the p2p daemon did not start: {type(exc).__name__}: {exc}"[:300]
    line = sys.stdin.readline().strip()
    if not line:
        return 0  # the task ended (cancelled, failed) before it had a vector
    given, taken = (Path(part) for part in line.split("\t"))
    arrays, header = unpack(given.read_bytes())
    if header.get("format") != FORMAT_IN:
        raise ContainerError(f"not a {FORMAT_IN} container")
    shard, holds = int(header["shard"]), bool(header["holds_state"])
    outcome: Outcome = (None, {}, 0, failed)
    if dht is not None:
        outcome = _attempt_all(dht, arrays["values"], group, shard, holds)
    mean, members, attempt, reason = outcome
    out = {} if mean is None else {"values": mean}
    meta = {"format": FORMAT_OUT, "members": sorted(members.items()), "attempt": attempt,
            "reason": reason}  # fmt: skip
    if dht is not None:  # the mode Hivemind's DHT (and so its averagers) ran in
        meta["reachability"] = "client" if dht.client_mode else "public"
    taken.write_bytes(pack(out, meta))
    # Hivemind's shutdown waits for its processes; the mean is written: end them and leave.
    _leave(0)


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main(sys.argv[1:]))
