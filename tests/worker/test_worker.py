"""Worker pieces that need no coordinator: backoff, identity, URLs, the blob cache."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path

import httpx
import pytest

from idlegrid import protocol
from idlegrid.settings import WorkerSettings
from idlegrid.worker import daemon
from idlegrid.worker.cache import BlobCache, BlobMismatch
from idlegrid.worker.daemon import Worker, available_kinds, backoff_delay, node_key, ws_url


@pytest.mark.parametrize("attempt", [0, 1, 2, 5, 10, 100])
def test_backoff_is_jittered_and_capped(attempt: int) -> None:
    delays = [backoff_delay(attempt, base=0.5, cap=30.0) for _ in range(200)]
    ceiling = min(30.0, 0.5 * 2**attempt)
    assert all(0 <= d <= ceiling for d in delays)
    assert len(set(delays)) > 150  # jitter: reconnecting nodes do not stampede together


def test_backoff_grows_with_attempts() -> None:
    early = sum(backoff_delay(0, base=0.5, cap=30) for _ in range(500)) / 500
    late = sum(backoff_delay(6, base=0.5, cap=30) for _ in range(500)) / 500
    assert late > 10 * early


@pytest.mark.parametrize(
    ("server", "url"),
    [
        ("http://127.0.0.1:8000", "ws://127.0.0.1:8000/v1/nodes/ws"),
        ("http://host:1/", "ws://host:1/v1/nodes/ws"),
        ("https://grid.example", "wss://grid.example/v1/nodes/ws"),
    ],
)
def test_ws_url(server: str, url: str) -> None:
    assert ws_url(server) == url


def test_node_key_is_stable_per_state_dir(tmp_path: Path) -> None:
    first = node_key(tmp_path / "a")
    assert node_key(tmp_path / "a") == first
    assert node_key(tmp_path / "b") != first


def test_worker_refuses_unknown_kinds_and_missing_token(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="token"):
        Worker(WorkerSettings(state_dir=tmp_path))
    with pytest.raises(ValueError, match="unknown kinds"):
        Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("mine-bitcoin",)))


def test_available_kinds_include_embed_text_here() -> None:
    assert {"sleep", "embed-text"} <= set(available_kinds())


async def test_blob_cache_fetches_checks_and_reuses(tmp_path: Path) -> None:
    blob = b"shard payload"
    digest = hashlib.sha256(blob).hexdigest()
    calls = []

    def serve(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if request.url.path.endswith(digest):
            return httpx.Response(200, content=blob)
        return httpx.Response(200, content=b"tampered")

    cache = BlobCache(tmp_path)
    async with httpx.AsyncClient(
        transport=httpx.MockTransport(serve), base_url="http://coordinator"
    ) as http:
        assert await cache.get(http, digest) == blob
        assert await cache.get(http, digest) == blob
        assert calls == [f"/v1/blobs/{digest}"]  # second read came from the cache
        assert (cache.hits, cache.misses) == (1, 1)
        with pytest.raises(BlobMismatch):
            await cache.get(http, "0" * 64)
    assert cache.holds() == [digest]


async def test_blob_cache_refetches_a_corrupted_file(tmp_path: Path) -> None:
    blob = b"good bytes"
    digest = hashlib.sha256(blob).hexdigest()
    cache = BlobCache(tmp_path)
    cache.path(digest).write_bytes(b"bit rot")
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=blob))
    async with httpx.AsyncClient(transport=transport, base_url="http://c") as http:
        assert await cache.get(http, digest) == blob
    assert cache.path(digest).read_bytes() == blob


async def test_blob_cache_evicts_least_recently_used(tmp_path: Path) -> None:
    blobs = [bytes([i]) * 100 for i in range(5)]
    transport = httpx.MockTransport(
        lambda request: httpx.Response(
            200,
            content=next(
                b
                for b in blobs
                if hashlib.sha256(b).hexdigest() == request.url.path.rsplit("/")[-1]
            ),
        )
    )
    digests = [hashlib.sha256(b).hexdigest() for b in blobs]
    cache = BlobCache(tmp_path, max_bytes=250)
    async with httpx.AsyncClient(transport=transport, base_url="http://c") as http:
        for digest in digests[:3]:
            await cache.get(http, digest)
        assert cache.holds() == digests[1:3]
        await cache.get(http, digests[1])  # used again: now the most recent
        await cache.get(http, digests[3])
        assert cache.holds() == [digests[1], digests[3]]
    assert sorted(os.listdir(tmp_path)) == sorted(cache.holds())
    # A restarted daemon finds the same blobs in the same order of use.
    os.utime(cache.path(digests[1]), (1, 1))
    assert BlobCache(tmp_path, max_bytes=250).holds() == [digests[1], digests[3]]


async def _let_it_block() -> None:
    """Run the loop until every task started so far is waiting on something: these calls
    take no time of their own before they wait."""
    for _ in range(10):
        await asyncio.sleep(0)  # turns of the loop: what blocks shows no state to wait on


async def test_blob_calls_wait_for_the_next_session_not_a_backoff_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A transfer that met a disconnect runs as soon as the worker is connected again."""
    worker = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",)))
    # A backoff step would outlast the test: only waiting for the session itself can pass.
    monkeypatch.setattr(daemon, "backoff_delay", lambda *args, **kwargs: 3600.0)
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=b"blob"))

    async def fetch(http: httpx.AsyncClient) -> bytes:
        return (await http.get("/v1/blobs/x")).content

    pending = asyncio.create_task(worker._with_connection(fetch))
    await _let_it_block()
    assert not pending.done()  # offline: it waits
    async with httpx.AsyncClient(transport=transport, base_url="http://coordinator") as http:
        worker._http = http
        worker._online.set()
        assert await asyncio.wait_for(pending, 30.0) == b"blob"


async def test_a_stopping_worker_stops_waiting_for_a_session(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",)))

    async def never(http: httpx.AsyncClient) -> None:
        raise AssertionError("no session: never called")

    pending = asyncio.create_task(worker._with_connection(never))
    await _let_it_block()
    worker._stop.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(pending, 30.0)


class _CapturingSocket:
    def __init__(self) -> None:
        self.sent: list[dict[str, object]] = []
        self.got_one = asyncio.Event()

    async def send(self, text: str) -> None:
        self.sent.append(json.loads(text))
        self.got_one.set()


async def test_a_result_the_coordinator_could_not_store_goes_again_and_a_refused_one_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from idlegrid.worker import execution

    monkeypatch.setattr(execution, "REDELIVER_S", 0.05)
    worker = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",)))
    socket = _CapturingSocket()
    worker._ws = socket  # type: ignore[assignment]
    for task_id in (1, 2):
        worker.outbox[task_id] = protocol.Result(
            task_id=task_id, output="ab" * 32, output_size=2, elapsed_s=0.1
        )
    busy = protocol.Error(code="internal", message="could not handle", task_id=1)
    refused = protocol.Error(code="rejected", message="not yours", task_id=2)
    await worker._on_frame(busy.model_dump_json())
    await worker._on_frame(refused.model_dump_json())
    assert 2 not in worker.outbox  # refused: dropped
    await asyncio.wait_for(socket.got_one.wait(), 5)
    assert [m["task_id"] for m in socket.sent] == [1]  # sent again, kept until acknowledged
    assert 1 in worker.outbox
    await worker._on_frame(protocol.ResultAck(task_id=1, status="accepted").model_dump_json())
    assert 1 not in worker.outbox


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs CPU affinity (Linux)")
def test_task_threads_follow_the_cores_the_daemon_may_use(tmp_path: Path) -> None:
    """Under `taskset` or a container's CPU set, one slot gets the cores it may use, not
    the machine's count (two threads on one core wait for each other at every step)."""
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        worker = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",)))
        assert [host.threads for host in worker.hosts] == [1]
    finally:
        os.sched_setaffinity(0, allowed)
    two = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",), slots=2))
    assert [host.threads for host in two.hosts] == [max(1, len(allowed) // 2)] * 2


def test_two_workers_on_one_host_get_different_default_names(tmp_path: Path) -> None:
    import socket

    from idlegrid.worker.commands import DEFAULT_STATE_DIR, default_name

    host = socket.gethostname()
    assert default_name(None) == default_name(DEFAULT_STATE_DIR) == host
    first, second = default_name(tmp_path / "w1"), default_name(tmp_path / "w2")
    assert first == f"{host}-w1" and second == f"{host}-w2"


class _OneReply:
    """A WebSocket stand-in for the hello: it keeps what it is sent and answers once."""

    def __init__(self, reply: dict[str, object]) -> None:
        self.reply = reply
        self.sent: list[dict[str, object]] = []

    async def send(self, frame: str) -> None:
        self.sent.append(json.loads(frame))

    async def recv(self) -> str:
        return json.dumps(self.reply)


WELCOME = {"type": "welcome", "v": 1, "node_id": 3, "heartbeat_interval_s": 15.0,
           "server_time": "2026-01-02T03:04:05Z"}  # fmt: skip


@pytest.mark.parametrize(
    ("reply", "minor"),
    [(WELCOME, 0),  # a 1.0 coordinator, which says no minor
     ({**WELCOME, "minor": protocol.PROTOCOL_MINOR}, protocol.PROTOCOL_MINOR),
     ({**WELCOME, "minor": protocol.PROTOCOL_MINOR + 1, "motd": "hi"},
      protocol.PROTOCOL_MINOR + 1)],
)  # fmt: skip
async def test_the_hello_says_this_minor_and_reads_the_coordinators(
    tmp_path: Path, reply: dict[str, object], minor: int
) -> None:
    worker = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",)))
    worker.hardware = protocol.HardwareProfile()
    socket = _OneReply(reply)
    welcome = await worker._hello(socket, "http://grid")  # type: ignore[arg-type]
    assert welcome.node_id == 3 and worker._server_minor == minor
    [hello] = socket.sent
    assert (hello["v"], hello["minor"]) == (protocol.PROTOCOL_VERSION, protocol.PROTOCOL_MINOR)


SPOKEN = f"{protocol.PROTOCOL_VERSION} ({protocol.PROTOCOL_VERSION}.{protocol.PROTOCOL_MINOR})"


@pytest.mark.parametrize(
    ("reply", "versions"),
    [({**WELCOME, "v": 2, "minor": 0}, ("protocol version 2", f"this worker speaks {SPOKEN}")),
     ({"type": "error", "v": 1, "code": "version",
       "message": "this hello is of protocol version 1, and this coordinator speaks 2 (2.0)"},
      ("protocol version 1", "speaks 2 (2.0)"))],
)  # fmt: skip
async def test_a_coordinator_of_another_major_stops_the_worker_with_both_versions(
    tmp_path: Path, reply: dict[str, object], versions: tuple[str, str]
) -> None:
    worker = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",)))
    worker.hardware = protocol.HardwareProfile()
    with pytest.raises(daemon.OtherProtocol) as raised:
        await worker._hello(_OneReply(reply), "http://grid")  # type: ignore[arg-type]
    said = str(raised.value)
    assert "http://grid" in said and all(version in said for version in versions), said


async def test_an_unreadable_welcome_is_a_connection_to_retry(tmp_path: Path) -> None:
    worker = Worker(WorkerSettings(token="ign_x", state_dir=tmp_path, kinds=("sleep",)))
    worker.hardware = protocol.HardwareProfile()
    with pytest.raises(OSError, match="heartbeat_interval_s"):
        late = _OneReply({**WELCOME, "heartbeat_interval_s": "soon"})
        await worker._hello(late, "http://g")  # type: ignore[arg-type]
