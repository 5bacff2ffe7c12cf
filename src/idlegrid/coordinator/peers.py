"""This coordinator process among the others that share its store and broker.

Each process has its own hub of node WebSockets. The broker records which process holds
each node's connection (with every message the node sends) and carries what the
processes tell each other on the `grid` channel (`publish`): a cancel for a node held
elsewhere, "work" when tasks entered the shared queue, "connected" when a node connected
(an older session of it elsewhere is stale), "job_ended" (drop cached plans), "settings"
(a node's settings changed: the process holding it sends them). Messages are
best effort; the monitor's passes make up for a lost one. With the in-process broker
there is one process and these messages only come back to it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

from idlegrid.coordinator import node_control
from idlegrid.coordinator.context import CHANNEL, Context
from idlegrid.coordinator.hub import NodeSession
from idlegrid.coordinator.plans import Plans

log = logging.getLogger(__name__)

# After the broker failed to record presence, skip it for this long (messages go on).
PRESENCE_PAUSE_S = 2.0


@contextlib.contextmanager
def unless_broker_away(what: str) -> Iterator[None]:
    """Log, not raise, a broker failure where the store already holds the truth."""
    try:
        yield
    except Exception as exc:  # an unreachable Redis raises its client's many error types
        log.warning("%s: the broker is unreachable (%s); carrying on", what, exc)


async def publish(ctx: Context, message: dict[str, Any]) -> None:
    """Tell the other coordinator processes; `origin` lets this one skip its own."""
    await ctx.broker.publish(CHANNEL, {**message, "origin": ctx.process_id})


async def attach(ctx: Context, session: NodeSession) -> None:
    """A node connected here: replace its older session, here or in another process."""
    old = ctx.hub.add(session)
    if old is not None:
        # Its socket may be gone already (the node reconnects because it lost it): closing
        # a dead socket raises, and must not refuse the new one.
        with contextlib.suppress(Exception):
            await old.close()
    with unless_broker_away(f"node {session.node_id} connecting"):
        await ctx.broker.node_seen(session.node_id, ctx.clock(), owner=ctx.process_id)
        await publish(ctx, {"type": "connected", "node_id": session.node_id})


async def detach(ctx: Context, session: NodeSession) -> bool:
    """A node's connection ended; False when a newer session had replaced it."""
    if not ctx.hub.remove(session):
        return False
    with unless_broker_away(f"node {session.node_id} disconnecting"):
        await ctx.broker.node_disconnected(session.node_id, ctx.process_id)
    return True


async def heard_from(ctx: Context, session: NodeSession) -> None:
    """A message came from the node: it is present, connected to this process."""
    if time.monotonic() < ctx.presence_pause.until:
        return  # the broker failed a moment ago: don't make every message wait for it
    try:
        await ctx.broker.node_seen(session.node_id, ctx.clock(), owner=ctx.process_id)
    except Exception as exc:  # an unreachable Redis raises its client's many error types
        log.warning("node %s presence: the broker is unreachable (%s)", session.node_id, exc)
        ctx.presence_pause.until = time.monotonic() + PRESENCE_PAUSE_S


async def on_message(ctx: Context, plans: Plans, message: dict[str, Any]) -> None:
    """Handle what another coordinator process published on the grid channel."""
    if message.get("origin") == ctx.process_id:
        return
    match message.get("type"):
        case "work":
            ctx.work_available.set()
        case "cancel":
            await ctx.hub.cancel(
                int(message["node_id"]), int(message["task_id"]), str(message["reason"])
            )
            ctx.work_available.set()
        case "connected":
            stale = ctx.hub.get(int(message["node_id"]))
            # The broker has the last word: the node may have come back here since.
            if stale is not None and ctx.process_id != (await ctx.broker.connections()).get(
                stale.node_id
            ):
                log.info("node %s moved to another coordinator", stale.node_id)
                ctx.hub.remove(stale)
                await stale.close()
        case "settings":  # changed on the dashboard served by another process
            await node_control.send_stored(ctx, int(message["node_id"]))
        case "job_ended":
            plans.forget(int(message["job_id"]))
            ctx.job_watch.changed([int(message["job_id"])])


async def rebuild_queue(ctx: Context) -> None:
    """Refill the broker's ready queue from the store (startup, broker loss)."""
    ready = await ctx.store.claims.ready_tasks(limit=1_000_000)
    await ctx.broker.replace_ready(ready)
    if ready:
        ctx.work_available.set()


async def recover_broker(ctx: Context) -> None:
    """After the broker lost its contents: the queue, this process's nodes, presence."""
    await rebuild_queue(ctx)
    now = ctx.clock()
    for session in ctx.hub.sessions():
        await ctx.broker.node_seen(session.node_id, now, owner=ctx.process_id)
    await grace_online(ctx, now)
    ctx.work_available.set()


async def grace_online(ctx: Context, now: float) -> None:
    """Nodes the store thinks online get one timeout's grace to be heard from again."""
    for node in await ctx.store.nodes.list_nodes():
        if node.state == "online":
            await ctx.broker.node_seen(node.id, now)


async def check_broker(ctx: Context) -> bool:
    """Rebuild the broker's contents from the store if it lost them (Redis restarted)."""
    if not await ctx.broker.needs_rebuild():
        return False
    log.warning("the broker lost its ready queue; rebuilding it from the store")
    await recover_broker(ctx)
    return True


async def sync_queue(ctx: Context, *, limit: int) -> None:
    """Put the oldest ready tasks of the store into the queue again (idempotent)."""
    await ctx.broker.push_ready(await ctx.store.claims.ready_tasks(limit=limit))


async def record_presence(ctx: Context) -> None:
    """Persist last-seen times (and uptime) of the nodes heard from."""
    await ctx.store.nodes.touch_nodes(await ctx.broker.presence())


async def silent_nodes(ctx: Context, *, now: float) -> list[int]:
    """The nodes no process has heard from within the node timeout."""
    return await ctx.broker.silent_nodes(before=now - ctx.settings.node_timeout_s)


async def close_here(ctx: Context, node_id: int) -> None:
    """Close this process's connection to the node, if it holds one."""
    session = ctx.hub.get(node_id)
    if session is not None:
        ctx.hub.remove(session)
        await session.close()
