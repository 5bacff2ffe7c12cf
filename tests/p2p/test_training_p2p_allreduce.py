"""The all-reduce's protocol (p2p/allreduce.py) over an in-memory transport: every member
reads back the same bytes of the mean, and a member whose part does not decode, a member
that sends nothing, or a reducer that cannot be reached, is named. Real streams of
Hivemind's p2p daemon: tests/p2p/test_training_p2p_roster.py and
tests/training/test_training_p2p.py."""

from __future__ import annotations

import asyncio
import hashlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from helpers import require_p2p

from idlegrid.p2p import allreduce, parts
from idlegrid.training.compression import Compression

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch, by hivemind


class Pipe:
    """One direction of a stream: what the writer writes, the reader reads."""

    def __init__(self) -> None:
        self.reader = asyncio.StreamReader()

    def write(self, data: bytes) -> None:
        self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self.reader.at_eof():
            self.reader.feed_eof()


@dataclass(frozen=True)
class Peer:
    """A peer id as a stream's info names the caller (libp2p authenticates it)."""

    name: str

    def to_base58(self) -> str:
        return self.name


@dataclass(frozen=True)
class StreamInfo:
    peer_id: Peer


class Network:
    """Members' reducers by peer id; a call opens a stream to one (unless it is down)."""

    def __init__(self) -> None:
        self.reducers: dict[str, allreduce.Reducer] = {}
        self.down: set[str] = set()
        self.tasks: list[asyncio.Task[None]] = []

    def p2p(self, caller: str) -> Any:
        """The daemon of the peer `caller`: its calls reach reducers as from `caller`."""
        network = self

        class FakeP2P:
            async def call_binary_stream_handler(self, peer: Any, name: str) -> Any:
                assert name == allreduce.HANDLER
                target = peer.to_base58()
                if target in network.down:
                    raise ConnectionError(f"routing: not found ({target})")
                up, down = Pipe(), Pipe()
                serve = network.reducers[target].serve(StreamInfo(Peer(caller)), up.reader, down)
                network.tasks.append(asyncio.ensure_future(serve))
                return None, down.reader, up

        return FakeP2P()


PEERS = {0: "peerA", 1: "peerB", 2: "peerC", 3: "peerD"}


def plan(members: tuple[int, ...], length: int, settings: Compression) -> allreduce.Plan:
    return allreduce.Plan("k", members, members, {m: PEERS[m] for m in members}, length,
                          settings)  # fmt: skip


async def group(
    vectors: dict[int, np.ndarray], settings: Compression, *, silent: int = -1,
    garble: int = -1, down: int = -1, wait_s: float = 5.0, stranger: list[Any] | None = None,
) -> dict[int, Any]:  # fmt: skip
    """Every member's all-reduce at once: its mean and bytes, or the AllReduceFailed.
    With `stranger` (a list), a peer the meeting did not name sends every reducer first
    a part of its own as each member; the answers it read go into the list."""
    network = Network()
    shared = plan(tuple(sorted(vectors)), next(iter(vectors.values())).size, settings)
    for member in vectors:
        network.reducers[PEERS[member]] = allreduce.Reducer()
    if down >= 0:
        network.down.add(PEERS[down])
    deadline = time.monotonic() + wait_s

    async def member(shard: int) -> Any:
        reduction = parts.Reduction(vectors[shard], settings, len(vectors), shared.bounds())
        if shard == garble:
            honest = reduction.contribution

            def garbled(step: str, index: int) -> bytes:
                return honest(step, index)[:-1]

            reduction.contribution = garbled  # type: ignore[method-assign]
        try:
            moved = await allreduce.run(network.p2p(PEERS[shard]), network.reducers[PEERS[shard]],
                                        shared, shard, reduction, deadline)  # fmt: skip
        except allreduce.AllReduceFailed as exc:
            return exc
        return reduction.mean(), moved

    calls = []
    if stranger is not None:
        calls = await _impersonate(network, "peerX", shared, settings, vectors, deadline)
    members = [m for m in vectors if m != silent]
    outcomes = await asyncio.gather(*(member(m) for m in members))
    if stranger is not None:
        stranger.extend(await asyncio.gather(*calls))
    for task in network.tasks:
        task.cancel()
    return dict(zip(members, outcomes, strict=True))


async def _impersonate(network: Network, impostor: str, shared: allreduce.Plan,
                       settings: Compression, vectors: dict[int, np.ndarray],
                       deadline: float) -> list[Any]:  # fmt: skip
    """A stranger's parts, ten times the honest ones, as every member to every reducer at
    the first exchange; the calls' answers once they come."""
    calls = []
    for shard in vectors:
        loud = parts.Reduction(vectors[shard] * 10, settings, len(vectors), shared.bounds())
        step = loud.steps[0]
        for index, reducer in enumerate(shared.reducers):
            ident = (shared.group_id, step, index)
            data = loud.contribution(step, index)
            call = allreduce._call(network.p2p(impostor), Peer(PEERS[reducer]), ident, shard,
                                   data, deadline)  # fmt: skip
            calls.append(call)
    pending = [asyncio.ensure_future(call) for call in calls]
    await asyncio.sleep(0.05)  # they arrive before any honest part
    return pending


@pytest.fixture(autouse=True)
def _hivemind() -> None:
    require_p2p("the all-reduce's frames are Hivemind's P2P helpers")
    # Imported now, not inside the first exchange, whose deadline it would eat (seconds).
    import hivemind.p2p  # noqa: F401


def vectors(count: int, length: int = 1000) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(count)
    return {m: rng.normal(size=length).astype(np.float32) for m in range(count)}


@pytest.mark.parametrize("method", ["int8", "int4", "sign", "topk", "none"])
def test_every_member_reads_back_the_same_bytes(method: str) -> None:
    given = vectors(4)
    settings = Compression(method=method, chunk_size=64, topk_fraction=0.05)
    done = asyncio.run(group(given, settings))
    digests = {hashlib.sha256(mean.tobytes()).hexdigest() for mean, _ in done.values()}
    assert len(digests) == 1
    assert all(moved > 0 for _, moved in done.values())
    if method == "none":
        np.testing.assert_allclose(done[0][0], np.mean(list(given.values()), axis=0), atol=1e-6)


def test_int8_moves_what_the_parts_say_and_no_float32() -> None:
    given = vectors(4, length=64 * 256)
    done = asyncio.run(group(given, Compression(method="int8")))
    # As a caller, a member sends 3 of its 4 parts (a byte a value) and reads 3 answers
    # (10 bits a value), plus the scales exchange and headers: far below float32's 6 bytes.
    per_value = np.mean([moved for _, moved in done.values()]) / given[0].size
    assert 0.75 * (1 + 10 / 8) <= per_value <= 0.75 * (1 + 10 / 8) + 0.1


def test_a_stranger_sending_parts_as_the_members_changes_nothing_and_gets_no_answer() -> None:
    """The reducers take a shard's part only from the peer the sealed meeting named for
    it: a stranger's parts, sent first, are never reduced, and it reads no answer."""
    given = vectors(4)
    settings = Compression(method="int8", chunk_size=64)
    honest = asyncio.run(group(given, settings))
    stranger: list[Any] = []
    done = asyncio.run(group(given, settings, stranger=stranger))
    assert {hashlib.sha256(mean.tobytes()).hexdigest() for mean, _ in done.values()} == {
        hashlib.sha256(honest[0][0].tobytes()).hexdigest()
    }
    assert len(stranger) == 16
    for status, answer, _ in stranger:
        assert status["ok"] is False and answer == b""
        assert "a peer the group's meeting did not name" in status["error"]


def test_a_member_whose_part_does_not_decode_is_named_by_every_member() -> None:
    done = asyncio.run(group(vectors(4), Compression(method="int8", chunk_size=64), garble=2))
    assert all(isinstance(o, allreduce.AllReduceFailed) for o in done.values()), done
    assert all(o.blamed == {2} for o in done.values())
    assert "member 2's part does not decode" in str(done[0])


def test_a_member_that_sends_nothing_is_named_once_the_deadline_passes() -> None:
    done = asyncio.run(group(vectors(4), Compression(method="int4", chunk_size=64), silent=3,
                             wait_s=1.0))  # fmt: skip
    assert set(done) == {0, 1, 2}
    assert all(isinstance(o, allreduce.AllReduceFailed) and 3 in o.blamed
               for o in done.values()), done  # fmt: skip


def test_a_reducer_that_cannot_be_reached_is_named_at_once() -> None:
    started = time.monotonic()
    done = asyncio.run(group(vectors(3), Compression(method="int8", chunk_size=64), down=1,
                             wait_s=30.0, silent=1))  # fmt: skip
    for outcome in done.values():
        assert isinstance(outcome, allreduce.AllReduceFailed) and 1 in outcome.blamed
        assert "unreachable" in str(outcome)
    assert time.monotonic() - started < 30.0  # a caller does not wait for the deadline
