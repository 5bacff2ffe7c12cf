"""The node WebSocket: one connection per worker, hello first, then a message loop.

Nothing a node sends can crash this handler: every frame is parsed into a versioned
message or answered with an `error`, and an exception while handling one message is
logged and answered without ending the connection.

Before its hello is accepted a socket costs little: its frames are limited to the
hello's size (`hello_max_bytes`), its hello must come within `hello_timeout_s` of
opening, and such sockets are capped in all and per address (`guard.PendingSockets`).
A frame over the limit ends the connection (close code 1009).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import UTC, datetime

from fastapi import WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from idlegrid import protocol
from idlegrid.coordinator.auth import hash_token
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.guard import Guard, RateLimited
from idlegrid.coordinator.hub import NodeSession, node_view
from idlegrid.devtools import faults
from idlegrid.kinds import CAPABILITIES, KINDS
from idlegrid.policy.sybil import network_of
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import NodeRecord, RegistrationRefused, ResultReceipt

log = logging.getLogger(__name__)

CLOSE_UNAUTHORIZED = 4401
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
# A hello of another major version of the protocol (as HTTP's 426 Upgrade Required).
CLOSE_VERSION = 4426
# Result messages of one node being stored at once; reading its next frames waits beyond.
RESULTS_IN_FLIGHT = 32
# The ASGI scope extension through which the server (coordinator/serving.py) lets this
# handler raise a socket's frame limit once its hello is accepted; under another server
# the limit is checked here, after the frame was read.
FRAME_LIMIT_EXTENSION = "idlegrid.frame_limit"


class FrameTooBig(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"frame over the {limit}-byte limit")
        self.limit = limit


async def node_socket(websocket: WebSocket, grid: Grid, guard: Guard) -> None:
    """Serve one node connection until it closes."""
    address = websocket.client.host if websocket.client else ""
    refusal = _refusal(guard, address)
    if refusal is not None:
        await _deny(websocket, refusal)
        return
    session = None
    try:
        try:
            await websocket.accept()
            hello = await _await_hello(websocket, grid.settings)
            if hello is not None:
                session = await _register(websocket, grid, guard, hello, address)
        finally:
            guard.pending.release(address)  # past its hello (or gone): no longer pending
        if session is not None:
            await grid.push_node_settings(session.node_id)  # what was set while it was away
            await _serve(websocket, grid, session)
    except WebSocketDisconnect:
        pass
    except FrameTooBig as exc:
        with contextlib.suppress(Exception):  # the node may be gone already
            await _error(websocket, "malformed", str(exc))
            await websocket.close(code=CLOSE_TOO_BIG)
    finally:
        if session is not None and await grid.detach(session):
            log.info("node %s disconnected", session.node_id)


def _refusal(guard: Guard, address: str) -> str | None:
    """Why a new socket from `address` is refused before it is accepted; None: accept.
    Admitted, it counts as pending until `guard.pending.release`.

    An address past its failed-authentication limit is still accepted: its hello's token
    decides (`Guard.authenticate`), so a valid node behind it is not locked out."""
    return guard.pending.admit(address)


async def _deny(websocket: WebSocket, reason: str) -> None:
    """Refuse the upgrade with 429 and a JSON reason (a plain 403 where the server
    cannot send a response to a WebSocket request)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        body = {"error": "rate_limited", "message": reason}
        await websocket.send_denial_response(JSONResponse(body, status_code=429))
    else:
        await websocket.close(code=CLOSE_POLICY, reason=reason[:120])


async def _receive(websocket: WebSocket, limit: int) -> str | None:
    """Next frame as text; None (after an error reply) for frames that can't be text.

    A frame over `limit` bytes raises FrameTooBig: the connection ends. Served by
    `idlegrid serve`, such a frame never gets here (the server refuses it on its header)."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        data = message.get("bytes") or b""
        if len(data) > limit:
            raise FrameTooBig(limit)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            await _error(websocket, "malformed", "binary frame is not UTF-8 JSON")
            return None
    # Characters are at most 4 bytes: only a long text needs its bytes counted.
    if len(text) > limit // 4 and len(text.encode()) > limit:
        raise FrameTooBig(limit)
    return text


async def _error(websocket: WebSocket, code: str, message: str, task_id: int | None = None) -> None:
    error = protocol.Error(code=code, message=message, task_id=task_id)  # type: ignore[arg-type]
    await websocket.send_text(error.model_dump_json())


async def _await_hello(
    websocket: WebSocket, settings: CoordinatorSettings
) -> protocol.Hello | None:
    """The node's hello; anything else before it is answered with an error. The deadline
    counts from the socket's opening, whatever it sends meanwhile."""
    deadline = asyncio.get_running_loop().time() + settings.hello_timeout_s
    try:
        while True:
            async with asyncio.timeout_at(deadline):
                text = await _receive(websocket, settings.hello_max_bytes)
            if text is None:
                continue
            try:
                msg = protocol.parse_node_message(text)
            except protocol.ProtocolError as exc:
                await _error(websocket, exc.code, exc.message)
                if exc.code == "version" and exc.message_type == "hello":
                    # A worker of another major version: nothing it says can be read.
                    await websocket.close(code=CLOSE_VERSION)
                    return None
                continue
            if isinstance(msg, protocol.Hello):
                return msg
            await _error(websocket, "out_of_order", f"send hello before {msg.type}")
    except TimeoutError:
        message = f"no hello within {settings.hello_timeout_s:g} s of connecting"
        await _error(websocket, "out_of_order", message)
        await websocket.close(code=CLOSE_POLICY)
        return None


def _raise_frame_limit(websocket: WebSocket, limit: int) -> None:
    """Let the server read frames of up to `limit` bytes on this socket from now on."""
    extension = websocket.scope.get("extensions", {}).get(FRAME_LIMIT_EXTENSION)
    if extension is not None:
        extension["set"](limit)


async def _register(
    websocket: WebSocket, grid: Grid, guard: Guard, hello: protocol.Hello, address: str
) -> NodeSession | None:
    """Authenticate and register the node of a hello, take it into this process and
    welcome it; None (after telling it why) for a node refused."""
    kinds = sorted(set(hello.kinds) & (set(KINDS) | CAPABILITIES))
    network = network_of(
        address,
        v4_prefix=grid.settings.network_prefix_v4,
        v6_prefix=grid.settings.network_prefix_v6,
    )
    node = await _registered(websocket, grid, guard, hello, address, kinds, network)
    if node is None:
        return None
    session = _session_of(websocket, node, hello, kinds, network)
    drop = await grid.reconcile(session, set(hello.running))
    # Before the welcome: the node may send its first big frame as soon as it has it.
    _raise_frame_limit(websocket, grid.settings.max_frame_bytes)
    await grid.attach(session)
    await session.send(
        protocol.Welcome(
            node_id=node.id,
            heartbeat_interval_s=grid.settings.heartbeat_interval_s,
            server_time=datetime.now(UTC),
            drop=sorted(drop),
            credit=node.credit.total,
        )
    )
    log.info(
        "node %s (%s) connected: protocol %d.%d, %d slots, %d sequences, kinds %s",
        node.id, hello.name, hello.v, hello.minor, hello.slots, hello.sequences, kinds,
    )  # fmt: skip
    return session


async def _registered(
    websocket: WebSocket,
    grid: Grid,
    guard: Guard,
    hello: protocol.Hello,
    address: str,
    kinds: list[str],
    network: str,
) -> NodeRecord | None:
    """The hello's node, registered if its token is a valid node token and the Sybil
    limits let it in; None (after telling it why) otherwise."""
    try:
        token = await guard.authenticate(address, hash_token(hello.token), grid.store.accounts)
    except RateLimited as exc:
        await _refuse(websocket, str(exc))
        return None
    if token is None or token.kind != "node":
        await _refuse(websocket, "a valid node token is required")
        return None
    try:
        return await grid.register_node(
            token.account_id,
            hello,
            kinds=kinds,
            address=address,
            network=network,
        )
    except RegistrationRefused as exc:
        await _refuse(websocket, str(exc))
        return None


async def _refuse(websocket: WebSocket, message: str) -> None:
    """Tell the node why, and close its socket as unauthorized."""
    await _error(websocket, "unauthorized", message)
    await websocket.close(code=CLOSE_UNAUTHORIZED)


def _session_of(
    websocket: WebSocket, node: NodeRecord, hello: protocol.Hello, kinds: list[str], network: str
) -> NodeSession:
    """The connected node as this process serves it."""
    return NodeSession(
        node_id=node.id,
        account_id=node.account_id,
        name=node.name,
        slots=hello.slots,
        prefetch=hello.prefetch,
        protocol_minor=hello.minor,
        view=node_view(node.id, kinds, hello.hardware, hello.benchmark, account_id=node.account_id),
        kind_rates=dict(hello.benchmark.kind_rates),
        send_text=websocket.send_text,
        close=websocket.close,
        network=network,
        # Trust is per backend: a node names its own only among those it has.
        backend=(
            hello.benchmark.backend if hello.benchmark.backend in hello.hardware.backends else "cpu"
        ),
        llama_build=hello.hardware.llama.build if hello.hardware.llama else "",
    )


async def _serve(websocket: WebSocket, grid: Grid, session: NodeSession) -> None:
    """Read and handle the node's messages in order, except that results are stored in
    the background: the reader goes on to the next frame (a heartbeat, more results)
    while a commit is written, so one node's results share commits (Grid.accept_results)
    and its heartbeats are answered meanwhile. When the connection ends, the results
    already read are still stored (not acknowledged: the node sends them again)."""
    storing: set[asyncio.Task[None]] = set()
    try:
        while True:
            text = await _receive(websocket, grid.settings.max_frame_bytes)
            if text is None:
                continue
            try:
                msg = protocol.parse_node_message(text, peer_minor=session.protocol_minor)
            except protocol.ProtocolError as exc:
                await grid.heard_from(session)
                await session.send(protocol.Error(code=exc.code, message=exc.message))  # type: ignore[arg-type]
                continue
            if isinstance(msg, protocol.Heartbeat):
                # Answered first: with a shared broker, recording presence is a round trip,
                # which the node's round trip need not include.
                await _handle_safely(grid, session, msg)
                await grid.heard_from(session)
                continue
            await grid.heard_from(session)
            if not isinstance(msg, protocol.Result | protocol.Results):
                await _handle_safely(grid, session, msg)
                continue
            if len(storing) >= RESULTS_IN_FLIGHT:
                await asyncio.wait(storing, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.create_task(_handle_safely(grid, session, msg))
            storing.add(task)
            task.add_done_callback(storing.discard)
    finally:
        if storing:
            await asyncio.gather(*storing, return_exceptions=True)


async def _handle_safely(grid: Grid, session: NodeSession, msg: protocol.NodeMessage) -> None:
    try:
        await _handle(grid, session, msg)
    except Exception:
        log.exception("node %s: handling %s failed", session.node_id, msg.type)
        await session.send(
            protocol.Error(
                code="internal",
                message=f"the coordinator could not handle this {msg.type}",
                task_id=getattr(msg, "task_id", None),
            )
        )


async def _handle(grid: Grid, session: NodeSession, msg: object) -> None:
    match msg:
        case protocol.Heartbeat(running=running, seq=seq, sent_at=sent_at):
            session.progress = {
                session.shard_of[p.task_id]: p.progress
                for p in running
                if p.task_id in session.shard_of
            }
            session.device_of = {
                p.task_id: p.device for p in running if p.device and p.task_id in session.shard_of
            }
            await session.send(protocol.HeartbeatAck(seq=seq, sent_at=sent_at))
        case protocol.Status(state=state, reason=reason):
            # Stored for every process (waiting_for, the dashboard); kept here for claims.
            session.paused = state == "paused"
            session.requested = 0 if session.paused else session.requested
            log.info("node %s %s: %s", session.node_id, state, reason)
            await grid.node_status(session, msg)
        case protocol.SettingsReport():
            await grid.settings_reported(session, msg)
        case protocol.Ready(free_slots=free, free_gpu_slots=gpu_free):
            session.requested, session.gpu_free = free, gpu_free
            await grid.fill(session)
        case protocol.Result():
            await _take_results(grid, session, [msg])
        case protocol.Results(results=results):
            await _take_results(grid, session, results)
        case protocol.Failure():
            await grid.record_failure(session, msg)
        case protocol.Hello():
            await session.send(
                protocol.Error(
                    code="out_of_order", message="hello was already received on this connection"
                )
            )


async def _take_results(grid: Grid, session: NodeSession, results: list[protocol.Result]) -> None:
    """A batch in one transaction; if that fails, each result on its own."""
    faults.point("coordinator-result-received")  # a crash before the result is stored
    try:
        receipts = await grid.accept_results(session, results)
    except Exception:
        log.exception("node %s: a batch of %d results failed", session.node_id, len(results))
        for msg in results:
            try:
                await _answer_result(session, msg, await grid.accept_result(session, msg))
            except Exception:
                log.exception("node %s: result for task %s failed", session.node_id, msg.task_id)
                await session.send(
                    protocol.Error(
                        code="internal",
                        message="the coordinator could not handle this result",
                        task_id=msg.task_id,
                    )
                )
        return
    for msg, receipt in zip(results, receipts, strict=True):
        await _answer_result(session, msg, receipt)
    if session.wants > 0:  # its slots were freed after it asked for work: fill them
        await grid.fill(session)


async def _answer_result(
    session: NodeSession, msg: protocol.Result, receipt: ResultReceipt
) -> None:
    if receipt.status == "rejected":
        log.warning(
            "node %s: result for task %s rejected: %s", session.node_id, msg.task_id, receipt.reason
        )
        await session.send(
            protocol.Error(code="rejected", message=receipt.reason, task_id=msg.task_id)
        )
    else:
        await session.send(protocol.ResultAck(task_id=msg.task_id, status=receipt.status))
