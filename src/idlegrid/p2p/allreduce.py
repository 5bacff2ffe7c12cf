"""The peer-to-peer all-reduce on the wire: members send their parts to the reducers
and read back each reducer's one answer, over streams of Hivemind's p2p daemon.

Runs in the standing averager's event loop (`averaging`). One stream a call: the
caller writes a header (JSON: the group's id, the exchange, the part, its shard, the
members) and its contribution (`parts`) as two length-prefixed frames; the reducer holds
the call until every member of the group has sent its contribution to that part, reduces
them once (`parts.reduce`), and answers every caller with the same frames: a status and
the answer. A reducer answers with an error when a member's contribution does not
decode (naming it) or when some member sent nothing before the deadline (naming those).
Each side counts the bytes it sent and received, frames included.

Hivemind's own averager is not used: it hands each member its own values plus the
difference to the mean, compressed, so lossy compression would leave members with
different means.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from idlegrid.p2p import parts
from idlegrid.training.compression import Compression

HANDLER = "idlegrid-allreduce"
# Seconds an answer may take past the attempt's deadline before a slot is forgotten.
FORGET_S = 60.0
# Bytes of a frame's length prefix (Hivemind's P2P.HEADER_LEN).
FRAME = 8
# Seconds a member waits for its reducers' answers past the attempt's deadline.
GRACE_S = 2.0
# No attempt lasts longer than this (a group's timeout is capped below it).
MAX_ATTEMPT_S = 3600.0


class AllReduceFailed(RuntimeError):
    """An all-reduce that did not complete; `blamed`: members it could not do without."""

    def __init__(self, reason: str, blamed: Iterable[int] = ()) -> None:
        super().__init__(reason)
        self.blamed = frozenset(blamed)


@dataclass(frozen=True)
class Plan:
    """One attempt's group as every member derives it from the meeting."""

    key: str
    members: tuple[int, ...]  # shards, sorted
    reducers: tuple[int, ...]  # the members that serve (not in client mode), sorted
    peers: dict[int, str]  # shard -> peer id (base58)
    length: int
    settings: Compression

    @property
    def group_id(self) -> str:
        """The same on every member that met the same group (and nowhere else)."""
        raw = json.dumps([self.key, self.members, self.reducers,
                          [self.peers[m] for m in self.members], self.length,
                          self.settings.model_dump()], sort_keys=True)  # fmt: skip
        return hashlib.sha256(raw.encode()).hexdigest()[:32]

    def bounds(self) -> list[tuple[int, int]]:
        return parts.bounds(self.length, self.settings.chunk_size, len(self.reducers))


@dataclass
class _Slot:
    """Contributions to one part at one exchange, at this member as its reducer."""

    step: str = ""
    members: tuple[int, ...] | None = None
    # Each member's peer id, as the sealed meeting named it: a part for a shard is taken
    # from that peer only.
    peers: dict[int, str] = field(default_factory=dict)
    settings: Compression | None = None
    length: int = 0
    # (shard, the peer id that sent it) -> the part.
    contributions: dict[tuple[int, str], bytes] = field(default_factory=dict)
    answer: asyncio.Future[tuple[dict[str, Any], bytes]] | None = None
    # When it is forgotten: its attempt's deadline plus FORGET_S once this member expects
    # it; until then (contributions of a group this member never joined) MAX_ATTEMPT_S.
    forget_at: float = field(default_factory=lambda: time.monotonic() + MAX_ATTEMPT_S)

    def takes(self, shard: int, sender: str) -> bool:
        """Whether `sender` may send shard `shard`'s part: the peer the meeting named for
        it, or anyone while this member has not met the group (checked again then)."""
        return not self.peers or self.peers.get(shard) == sender


class Reducer:
    """This member's side as a reducer: the slots of the parts it reduces, and the bytes
    it moved for each group."""

    def __init__(self) -> None:
        self._slots: dict[tuple[str, str, int], _Slot] = {}
        self.moved: defaultdict[str, int] = defaultdict(int)

    def _slot(self, ident: tuple[str, str, int]) -> _Slot:
        self._forget_old()
        slot = self._slots.get(ident)
        if slot is None:
            slot = self._slots[ident] = _Slot(step=ident[1])
            slot.answer = asyncio.get_running_loop().create_future()
        return slot

    def _forget_old(self) -> None:
        now = time.monotonic()
        for ident, slot in list(self._slots.items()):
            if now > slot.forget_at:
                self._slots.pop(ident)

    def expect(self, plan: Plan, step: str, index: int, deadline: float) -> None:
        """Say which members this member's part `index` waits for at `step` (the caller
        learned them at the meeting): remote contributions may arrive before this."""
        start, end = plan.bounds()[index]
        slot = self._slot((plan.group_id, step, index))
        slot.members, slot.settings, slot.length = plan.members, plan.settings, end - start
        slot.peers = {m: plan.peers[m] for m in plan.members}
        slot.forget_at = deadline + FORGET_S
        self._maybe_reduce(slot)
        loop = asyncio.get_running_loop()
        loop.call_later(max(0.0, deadline - time.monotonic()), self._expire, slot)

    def add(self, ident: tuple[str, str, int], shard: int, data: bytes, sender: str) -> _Slot:
        """Shard `shard`'s part, sent by the peer `sender` (its base58 id)."""
        slot = self._slot(ident)
        if not slot.takes(shard, sender):
            return slot  # not from the member the meeting named: never reduced
        slot.contributions.setdefault((shard, sender), data)
        self._maybe_reduce(slot)
        return slot

    def _maybe_reduce(self, slot: _Slot) -> None:
        assert slot.answer is not None
        if slot.answer.done() or slot.members is None or slot.settings is None:
            return
        named = {m: (m, slot.peers[m]) for m in slot.members}
        if not all(key in slot.contributions for key in named.values()):
            return
        given = {m: slot.contributions[key] for m, key in named.items()}
        slot.contributions = dict.fromkeys(slot.contributions, b"")  # reduced: no copies
        try:
            answer = parts.reduce(slot.step, slot.settings, slot.length, given)
            slot.answer.set_result(({"ok": True}, answer))
        except parts.BadPart as exc:
            slot.answer.set_result(({"ok": False, "error": str(exc), "blamed": [exc.shard]}, b""))

    def _expire(self, slot: _Slot) -> None:
        assert slot.answer is not None
        if slot.answer.done():
            return
        missing = sorted(m for m in slot.members or ()
                         if (m, slot.peers.get(m)) not in slot.contributions)  # fmt: skip
        error = f"members {missing} sent nothing before the deadline"
        slot.answer.set_result(({"ok": False, "error": error, "blamed": missing}, b""))

    async def serve(self, info: Any, reader: asyncio.StreamReader,
                    writer: asyncio.StreamWriter) -> None:  # fmt: skip
        """The stream handler: one member's contribution in, the part's answer out. The
        caller is the peer libp2p authenticated (`info.peer_id`); one that is not the
        member the meeting named for the shard it claims gets an error, never the answer."""
        from hivemind.p2p import P2P

        try:
            raw_header = await P2P.receive_raw_data(reader)
            data = await P2P.receive_raw_data(reader)
            header = json.loads(raw_header)
            group = str(header["group"])
            ident, shard = (group, str(header["step"]), int(header["part"])), int(header["shard"])
            sender = info.peer_id.to_base58()
            self.moved[group] += len(raw_header) + len(data) + 2 * FRAME
            slot = self.add(ident, shard, data, sender)
            if slot.members is None:  # a group this member has not joined (yet)
                wait_s = float(header["wait_s"])
                slot.forget_at = min(slot.forget_at, time.monotonic() + wait_s + FORGET_S)
            assert slot.answer is not None
            if slot.takes(shard, sender):
                status, answer = await asyncio.wait_for(asyncio.shield(slot.answer),
                                                        float(header["wait_s"]))  # fmt: skip
            if slot.peers.get(shard) != sender:  # the group is met by now, or never was
                error = f"member {shard}'s part from a peer the group's meeting did not name"
                status, answer = {"ok": False, "error": error}, b""
        except (TimeoutError, asyncio.IncompleteReadError, ValueError, KeyError,
                TypeError) as exc:  # fmt: skip
            status, answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}, b""
            group = ""
        encoded = json.dumps(status).encode()
        with contextlib.suppress(ConnectionError, OSError):
            await P2P.send_raw_data(encoded, writer)
            await P2P.send_raw_data(answer, writer)
            if group:
                self.moved[group] += len(encoded) + len(answer) + 2 * FRAME
        writer.close()


async def run(p2p: Any, reducer: Reducer, plan: Plan, shard: int,
              reduction: parts.Reduction, deadline: float) -> int:  # fmt: skip
    """This member's whole all-reduce (every exchange of every part); the bytes it moved
    as a caller. Raises AllReduceFailed naming whom it could not do without."""
    from hivemind.p2p import PeerID

    moved = 0
    cut = plan.bounds()
    for step in reduction.steps:
        for index, reducer_shard in enumerate(plan.reducers):
            if reducer_shard == shard:
                reducer.expect(plan, step, index, deadline)

        async def one(index: int, reducer_shard: int, step: str = step) -> tuple[int, bytes]:
            nonlocal moved
            data = reduction.contribution(step, index)
            ident = (plan.group_id, step, index)
            if reducer_shard == shard:
                slot = reducer.add(ident, shard, data, plan.peers[shard])
                assert slot.answer is not None
                status, answer = await slot.answer
            else:
                status, answer, count = await _call(
                    p2p, PeerID.from_base58(plan.peers[reducer_shard]), ident, shard, data,
                    deadline,
                )  # fmt: skip
                moved += count
            if not status.get("ok"):
                blamed = status.get("blamed") or [reducer_shard]
                raise AllReduceFailed(f"part {index} (member {reducer_shard}): "
                                      f"{status.get('error', 'failed')}", blamed)  # fmt: skip
            return index, answer

        calls = [one(index, r) for index, r in enumerate(plan.reducers)
                 if cut[index][1] > cut[index][0]]  # fmt: skip
        try:
            # A little past the deadline: reducers answer at it, naming who sent nothing.
            left = max(0.1, deadline - time.monotonic()) + GRACE_S
            answers = await asyncio.wait_for(asyncio.gather(*calls), left)
        except TimeoutError:
            raise AllReduceFailed(f"the {step} exchange ran past the attempt's deadline") from None
        for index, answer in answers:
            try:
                reduction.take(step, index, answer)
            except parts.PartError as exc:
                raise AllReduceFailed(f"reducer {plan.reducers[index]}'s answer: {exc}",
                                      [plan.reducers[index]]) from None  # fmt: skip
    return moved


async def _call(p2p: Any, peer: Any, ident: tuple[str, str, int], shard: int, data: bytes,
                deadline: float) -> tuple[dict[str, Any], bytes, int]:  # fmt: skip
    """One contribution to a remote reducer: (status, answer, bytes moved)."""
    from hivemind.p2p import P2P

    group, step, index = ident
    wait_s = max(0.1, deadline - time.monotonic()) + GRACE_S
    header = json.dumps({"group": group, "step": step, "part": index, "shard": shard,
                         "wait_s": wait_s}).encode()  # fmt: skip
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, HANDLER)
        try:
            await P2P.send_raw_data(header, writer)
            await P2P.send_raw_data(data, writer)
            raw_status = await P2P.receive_raw_data(reader)
            answer = await P2P.receive_raw_data(reader)
        finally:
            writer.close()
    except Exception as exc:  # the daemon, the stream, the peer gone: many kinds
        return {"ok": False, "error": f"unreachable: {type(exc).__name__}: {exc}"[:300]}, b"", 0
    try:
        status = json.loads(raw_status)
    except ValueError:
        status = {"ok": False, "error": "an unreadable status"}
    moved = len(header) + len(data) + len(raw_status) + len(answer) + 4 * FRAME
    return status, answer, moved
