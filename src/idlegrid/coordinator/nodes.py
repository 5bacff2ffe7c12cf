"""The node WebSocket: one connection per worker, hello first, then a message loop.

Nothing a node sends can crash this handler: every frame is parsed into a versioned
message or answered with an `error`, and an exception while handling one message is
logged and answered without ending the connection.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime

from fastapi import WebSocket, WebSocketDisconnect

from idlegrid import protocol
from idlegrid.coordinator import peers
from idlegrid.coordinator.auth import hash_token
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.hub import NodeSession, node_view
from idlegrid.kinds import KINDS
from idlegrid.policy.sybil import network_of
from idlegrid.store.base import RegistrationRefused, ResultReceipt

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 30.0
MAX_FRAME_CHARS = 1_000_000
CLOSE_UNAUTHORIZED = 4401
CLOSE_POLICY = 1008
# Result messages of one node being stored at once; reading its next frames waits beyond.
RESULTS_IN_FLIGHT = 32


async def node_socket(websocket: WebSocket, grid: Grid) -> None:
    """Serve one node connection until it closes."""
    await websocket.accept()
    session = None
    try:
        session = await _handshake(websocket, grid)
        if session is not None:
            await _serve(websocket, grid, session)
    except WebSocketDisconnect:
        pass
    except TimeoutError:
        await _error(websocket, "out_of_order", f"no hello within {HELLO_TIMEOUT_S:.0f} s")
        await websocket.close(code=CLOSE_POLICY)
    finally:
        if session is not None and await peers.detach(grid.context, session):
            log.info("node %s disconnected", session.node_id)


async def _receive(websocket: WebSocket) -> str | None:
    """Next frame as text; None (after an error reply) for frames that can't be text."""
    message = await websocket.receive()
    if message["type"] == "websocket.disconnect":
        raise WebSocketDisconnect(message.get("code", 1000))
    text = message.get("text")
    if text is None:
        data = message.get("bytes") or b""
        try:
            text = data.decode()
        except UnicodeDecodeError:
            await _error(websocket, "malformed", "binary frame is not UTF-8 JSON")
            return None
    if len(text) > MAX_FRAME_CHARS:
        await _error(websocket, "malformed", f"frame over {MAX_FRAME_CHARS} characters")
        return None
    return text


async def _error(websocket: WebSocket, code: str, message: str, task_id: int | None = None) -> None:
    error = protocol.Error(code=code, message=message, task_id=task_id)  # type: ignore[arg-type]
    await websocket.send_text(error.model_dump_json())


async def _handshake(websocket: WebSocket, grid: Grid) -> NodeSession | None:
    """Wait for a valid hello; answer anything else with an error."""
    while True:
        text = await asyncio.wait_for(_receive(websocket), HELLO_TIMEOUT_S)
        if text is None:
            continue
        try:
            msg = protocol.parse_node_message(text)
        except protocol.ProtocolError as exc:
            await _error(websocket, exc.code, exc.message)
            continue
        if not isinstance(msg, protocol.Hello):
            await _error(websocket, "out_of_order", f"send hello before {msg.type}")
            continue
        return await _register(websocket, grid, msg)


async def _register(websocket: WebSocket, grid: Grid, hello: protocol.Hello) -> NodeSession | None:
    token = await grid.store.find_token(hash_token(hello.token))
    if token is None or token.kind != "node":
        await _error(websocket, "unauthorized", "a valid node token is required")
        await websocket.close(code=CLOSE_UNAUTHORIZED)
        return None
    now = grid.clock()
    kinds = sorted(set(hello.kinds) & set(KINDS))
    address = websocket.client.host if websocket.client else ""
    network = network_of(
        address,
        v4_prefix=grid.settings.network_prefix_v4,
        v6_prefix=grid.settings.network_prefix_v6,
    )
    try:
        node = await grid.store.register_node(
            token.account_id,
            hello.node_key,
            name=hello.name,
            worker_version=hello.worker_version,
            hardware=hello.hardware.model_dump(),
            benchmark=hello.benchmark.model_dump(),
            kinds=kinds,
            slots=hello.slots,
            address=address,
            network=network,
            limits=grid.registration_limits,
            now=now,
        )
    except RegistrationRefused as exc:
        await _error(websocket, "unauthorized", str(exc))
        await websocket.close(code=CLOSE_UNAUTHORIZED)
        return None
    session = NodeSession(
        node_id=node.id,
        account_id=node.account_id,
        name=node.name,
        slots=hello.slots,
        prefetch=hello.prefetch,
        view=node_view(node.id, kinds, hello.hardware, hello.benchmark),
        kind_rates=dict(hello.benchmark.kind_rates),
        send_text=websocket.send_text,
        close=websocket.close,
        network=network,
        # Trust is per backend: a node names its own only among those it has.
        backend=(
            hello.benchmark.backend if hello.benchmark.backend in hello.hardware.backends else "cpu"
        ),
    )
    drop = await _reconcile(grid, session, set(hello.running))
    await peers.attach(grid.context, session)
    await session.send(
        protocol.Welcome(
            node_id=node.id,
            heartbeat_interval_s=grid.settings.heartbeat_interval_s,
            server_time=datetime.now(UTC),
            drop=sorted(drop),
            credit=node.credit.total,
        )
    )
    log.info("node %s (%s) connected: %d slots, kinds %s", node.id, hello.name, hello.slots, kinds)
    return session


async def _reconcile(grid: Grid, session: NodeSession, claimed: set[int]) -> set[int]:
    """Match what a reconnecting node holds with what the store says it holds.

    Tasks it still runs (or has results of) stay its own; tasks it claims but does not
    hold are dropped. Tasks the store leased to it that it does not have are released at
    once, not left to their leases: most often a coordinator that died claimed them and
    never sent them, and the node is not charged for that.
    """
    held = {task.task_id: task for task in await grid.store.node_tasks(session.node_id)}
    lost = sorted(held.keys() - claimed)
    if lost and await grid.store.release_claims(lost, session.node_id, now=grid.clock()):
        log.info("node %s reconnected without %d task(s): released", session.node_id, len(lost))
        await grid.replenish()
    session.live = set(held.keys() & claimed)
    return claimed - held.keys()


async def _serve(websocket: WebSocket, grid: Grid, session: NodeSession) -> None:
    """Read and handle the node's messages in order, except that results are stored in
    the background: the reader goes on to the next frame (a heartbeat, more results)
    while a commit is written, so one node's results share commits (Grid.accept_results)
    and its heartbeats are answered meanwhile. When the connection ends, the results
    already read are still stored (not acknowledged: the node sends them again)."""
    storing: set[asyncio.Task[None]] = set()
    try:
        while True:
            text = await _receive(websocket)
            if text is None:
                continue
            try:
                msg = protocol.parse_node_message(text)
            except protocol.ProtocolError as exc:
                await peers.heard_from(grid.context, session)
                await session.send(protocol.Error(code=exc.code, message=exc.message))  # type: ignore[arg-type]
                continue
            if isinstance(msg, protocol.Heartbeat):
                # Answered first: with a shared broker, recording presence is a round trip,
                # which the node's round trip need not include.
                await _handle_safely(grid, session, msg)
                await peers.heard_from(grid.context, session)
                continue
            await peers.heard_from(grid.context, session)
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
            await session.send(protocol.HeartbeatAck(seq=seq, sent_at=sent_at))
        case protocol.Status(state=state, reason=reason):
            session.paused, session.status_reason = state == "paused", reason
            session.requested = 0 if session.paused else session.requested
            log.info("node %s %s: %s", session.node_id, state, reason)
        case protocol.Ready(free_slots=free):
            session.requested = free
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
