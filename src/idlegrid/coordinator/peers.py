"""This coordinator process among the others that share its store and broker.

Each process has its own hub of node WebSockets. The broker records which process holds
each node's connection (with every message the node sends) and carries what the
processes tell each other on the `grid` channel (`Grid.publish`): a cancel for a node held
elsewhere, "work" when tasks entered the shared queue, "connected" when a node connected
(an older session of it elsewhere is stale), "job_ended" (drop cached plans). Messages are
best effort; the monitor's passes make up for a lost one. With the in-process broker
there is one process and these messages only come back to it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from idlegrid.coordinator.hub import NodeSession

if TYPE_CHECKING:
    from idlegrid.coordinator.grid import Grid

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


async def attach(grid: Grid, session: NodeSession) -> None:
    """A node connected here: replace its older session, here or in another process."""
    old = grid.hub.add(session)
    if old is not None:
        await old.close()
    with unless_broker_away(f"node {session.node_id} connecting"):
        await grid.broker.node_seen(session.node_id, grid.clock(), owner=grid.process_id)
        await grid.publish({"type": "connected", "node_id": session.node_id})


async def detach(grid: Grid, session: NodeSession) -> bool:
    """A node's connection ended; False when a newer session had replaced it."""
    if not grid.hub.remove(session):
        return False
    with unless_broker_away(f"node {session.node_id} disconnecting"):
        await grid.broker.node_disconnected(session.node_id, grid.process_id)
    return True


async def heard_from(grid: Grid, session: NodeSession) -> None:
    """A message came from the node: it is present, connected to this process."""
    if time.monotonic() < grid.presence_paused_until:
        return  # the broker failed a moment ago: don't make every message wait for it
    try:
        await grid.broker.node_seen(session.node_id, grid.clock(), owner=grid.process_id)
    except Exception as exc:  # an unreachable Redis raises its client's many error types
        log.warning("node %s presence: the broker is unreachable (%s)", session.node_id, exc)
        grid.presence_paused_until = time.monotonic() + PRESENCE_PAUSE_S


async def on_message(grid: Grid, message: dict[str, Any]) -> None:
    """Handle what another coordinator process published on the grid channel."""
    if message.get("origin") == grid.process_id:
        return
    match message.get("type"):
        case "work":
            grid.work_available.set()
        case "cancel":
            await grid.cancel_locally(
                int(message["node_id"]), int(message["task_id"]), str(message["reason"])
            )
            grid.work_available.set()
        case "connected":
            stale = grid.hub.get(int(message["node_id"]))
            # The broker has the last word: the node may have come back here since.
            if stale is not None and grid.process_id != (await grid.broker.connections()).get(
                stale.node_id
            ):
                log.info("node %s moved to another coordinator", stale.node_id)
                grid.hub.remove(stale)
                await stale.close()
        case "job_ended":
            grid.forget_plan(int(message["job_id"]))


async def recover_broker(grid: Grid) -> None:
    """After the broker lost its contents: the queue, this process's nodes, presence."""
    await grid.rebuild_queue()
    now = grid.clock()
    for session in grid.hub.sessions():
        await grid.broker.node_seen(session.node_id, now, owner=grid.process_id)
    # Nodes the store thinks online get one timeout's grace to be heard from again.
    for node in await grid.store.list_nodes():
        if node.state == "online":
            await grid.broker.node_seen(node.id, now)
    grid.work_available.set()
