"""Helpers shared by the tests: waits on state, fake nodes, a fresh interpreter.

- `wait_until` (blocking) and `eventually` (in an event loop) poll a condition until a
  deadline and fail with what they waited for. A test waits on the state it needs, never
  a fixed sleep standing in for it: a sleep is too short on a loaded machine and too long
  on an idle one.
- `FakeNode` is a node connected in process: a `NodeSession` whose sent messages are
  kept, for tests that drive a `Grid` directly.
- `SocketNode` speaks the protocol by hand over the app's WebSocket under TestClient.
- `run_python` runs a script in a fresh interpreter (what a module imports, from scratch).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import anyio
from conftest import Api, sha
from starlette.testclient import WebSocketTestSession

from idlegrid import protocol
from idlegrid.coordinator.hub import NodeSession, node_view
from idlegrid.store.sql import SqlStore

T = TypeVar("T")

NODE_WS = "/v1/nodes/ws"
SRC = Path(__file__).resolve().parents[1] / "src"

# -- waits on state -------------------------------------------------------------------------


def wait_until(
    predicate: Callable[[], T], what: str, *, timeout_s: float = 30.0, poll_s: float = 0.1
) -> T:
    """Poll `predicate` until it returns something true, and return that.

    Fails after `timeout_s` seconds with `what` (what the test waited for) and the last
    value seen, so a failure says which state never came.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} ({value!r})")
        time.sleep(poll_s)


async def eventually(
    check: Callable[[], T | Awaitable[T]],
    what: str,
    *,
    timeout_s: float = 10.0,
    poll_s: float = 0.02,
) -> T:
    """`wait_until` for a test in an event loop: `check` may be a coroutine function, and
    the loop keeps running between polls."""
    clock = asyncio.get_running_loop().time
    deadline = clock() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if clock() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what} ({value!r})")
        await asyncio.sleep(poll_s)


# -- a node in process ----------------------------------------------------------------------


@dataclass
class FakeNode:
    """What one node's connection received, and whether the coordinator closed it."""

    session: NodeSession
    sent: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False

    def of_type(self, type_: str) -> list[dict[str, Any]]:
        return [m for m in self.sent if m["type"] == type_]

    def assigned(self) -> list[dict[str, Any]]:
        return self.of_type("assign")

    def cancelled(self) -> set[int]:
        return {m["task_id"] for m in self.of_type("cancel")}


N = TypeVar("N", bound=FakeNode)


async def fake_node(
    store: SqlStore,
    account_id: int,
    key: str,
    *,
    now: float,
    kinds: Iterable[str] = ("sleep",),
    slots: int = 1,
    address: str = "",
    hardware: protocol.HardwareProfile | None = None,
    benchmark: protocol.Benchmark | None = None,
    node_type: type[N] = FakeNode,  # type: ignore[assignment]
) -> N:
    """Register a node and make its session, not yet attached to a grid.

    The default node has 8 GiB, no GPU and 10 GFLOPS: enough for any test kind.
    """
    kinds = list(kinds)
    hardware = hardware or protocol.HardwareProfile(memory_mb=8192)
    benchmark = benchmark or protocol.Benchmark(matmul_gflops=10.0)
    record = await store.nodes.register_node(
        account_id,
        key,
        name=key,
        worker_version="test",
        hardware=hardware.model_dump(),
        benchmark=benchmark.model_dump(),
        kinds=kinds,
        slots=slots,
        address=address,
        now=now,
    )
    node: N

    async def send_text(text: str) -> None:
        node.sent.append(json.loads(text))

    async def close() -> None:
        node.closed = True

    session = NodeSession(
        node_id=record.id,
        account_id=account_id,
        name=key,
        slots=slots,
        view=node_view(record.id, kinds, hardware, benchmark),
        kind_rates={},
        send_text=send_text,
        close=close,
    )
    node = node_type(session)
    return node


# -- a node over the app's WebSocket --------------------------------------------------------


class SocketNode:
    """One worker connection under TestClient, speaking the protocol by hand."""

    def __init__(self, api: Api, ws: WebSocketTestSession, token: str) -> None:
        self.api = api
        self.ws = ws
        self.token = token

    def send(self, **message: Any) -> None:
        self.ws.send_text(json.dumps(message))

    def recv(self, timeout: float = 5.0) -> dict[str, Any]:
        """The next message; fails instead of hanging when none comes."""

        async def next_message() -> Any:
            with anyio.fail_after(timeout):
                return await self.ws._send_rx.receive()

        message = self.ws.portal.call(next_message)
        self.ws._raise_on_close(message)
        return dict(json.loads(message["text"]))

    def expect(self, type_: str, **fields: Any) -> dict[str, Any]:
        message = self.recv()
        assert message["type"] == type_, message
        assert message["v"] == 1
        for key, value in fields.items():
            assert message[key] == value, message
        return message

    def expect_error(self, code: str, **fields: Any) -> str:
        message = self.expect("error", code=code, **fields)
        assert message["message"]
        return str(message["message"])

    def sync(self) -> None:
        """Wait until every earlier frame was handled: the reply to a bad frame comes last."""
        self.ws.send_text("sync")
        self.expect_error("malformed")

    def hello(
        self,
        *,
        key: str = "node-key-1",
        name: str | None = None,
        kinds: tuple[str, ...] = ("sleep",),
        slots: int = 1,
        running: tuple[int, ...] = (),
        token: str | None = None,
        hardware: dict[str, Any] | None = None,
    ) -> None:
        self.send(
            type="hello",
            token=token or self.token,
            node_key=key,
            name=name or key,
            worker_version="0.1.0",
            hardware=hardware or {"cpu_cores": 2, "memory_mb": 4096},
            benchmark={"matmul_gflops": 10.0},
            slots=slots,
            kinds=list(kinds),
            running=list(running),
        )

    def join(self, **kwargs: Any) -> dict[str, Any]:
        self.hello(**kwargs)
        welcome = self.expect("welcome")
        assert welcome["node_id"] >= 1 and welcome["heartbeat_interval_s"] > 0
        return welcome

    def ready(self, free_slots: int = 1) -> None:
        self.send(type="ready", free_slots=free_slots)

    def take(self) -> dict[str, Any]:
        self.ready()
        return self.expect("assign")

    def upload(self, data: bytes) -> str:
        return self.api.upload(data, token=self.token)

    def result(self, task_id: int, output: bytes, *, upload: bool = True) -> None:
        blob_hash = self.upload(output) if upload else sha(output)
        self.send(
            type="result",
            task_id=task_id,
            output=blob_hash,
            output_size=len(output),
            elapsed_s=0.01,
        )


# -- a fresh interpreter --------------------------------------------------------------------


def run_python(script: str, *, timeout_s: float = 120.0) -> str:
    """Run `script` in a new interpreter that imports idlegrid from this tree, with
    warnings as errors; its stdout. Fails with its stderr when it exits non-zero."""
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def require_p2p(needs: str) -> None:
    """Skip (fail under CI=true) where this machine cannot average peer to peer;
    `needs`: what the test needs it for, said in the skip."""
    from idlegrid import p2p

    reason = p2p.unavailable()
    if reason is None:
        return
    import pytest

    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{reason}; CI=true requires the p2p extra (pip install 'idlegrid[p2p]')")
    pytest.skip(f"{reason}: {needs}")


def record_failures(worker: Any) -> list[str]:
    """The errors of the tasks `worker` (an in-process `worker.daemon.Worker`) runs from
    now on, as their messages: its compute step is wrapped to note each one and raise it."""
    failures: list[str] = []
    compute = worker._compute

    async def failing_compute(task: Any, data: bytes) -> bytes:
        try:
            return await compute(task, data)
        except Exception as exc:
            failures.append(str(exc))
            raise

    worker._compute = failing_compute
    return failures
