"""A volunteer's nodes controlled from the dashboard: settings stored, sent, and reported.

The dashboard changes a node's settings through `NodeControl.change`: each value is
checked (`protocol.check_setting`, then against the node's hardware), stored in SQL as
set on the web (who, when), and sent to the node over its WebSocket, from whichever
coordinator process holds it. A node that is offline gets its stored settings after its
next welcome. The node answers with a `settings_report` (what it runs, each setting's
source, and why it could not apply them, if it could not); the report's newer local
edits are stored too, so the dashboard shows the truth. The later edit wins, setting by
setting (worker/remote_settings.py).
"""

from __future__ import annotations

import logging
from typing import Any

from idlegrid import protocol
from idlegrid.coordinator.context import CHANNEL, Context
from idlegrid.coordinator.hub import NodeSession
from idlegrid.store.base import NodeRecord
from idlegrid.store.node_control import SettingRow

log = logging.getLogger(__name__)


class NodeNotFound(LookupError):
    """No such node, or not one the asker may change (the same answer: 404)."""


class SettingRefused(ValueError):
    """A setting the node could not apply; the message names it and says why."""


def check_for_node(node: NodeRecord, name: str, value: Any) -> Any:
    """`value` as stored, or SettingRefused: valid in itself and on this node's hardware."""
    try:
        checked = protocol.check_setting(name, value)
    except ValueError as exc:
        raise SettingRefused(str(exc).replace("Value error, ", "")) from None
    cores = int(node.hardware.get("cpu_cores") or 0)
    if name == "cpu_cores" and cores and isinstance(checked, int) and checked > cores:
        raise SettingRefused(f"cpu_cores: {checked} is more than this node's {cores} cores")
    if name == "paused_gpus" and isinstance(checked, list):
        _check_gpus(node, checked)
    return checked


def gpu_indices(node: NodeRecord) -> list[int]:
    """The indices of the GPUs the node listed in its hardware profile."""
    gpus = node.hardware.get("gpus") or []
    return sorted({int(g.get("index", 0)) for g in gpus if isinstance(g, dict)})


def _check_gpus(node: NodeRecord, indices: list[Any]) -> None:
    has = gpu_indices(node)
    for index in indices:
        if index not in has:
            listed = ", ".join(str(i) for i in has) or "none"
            raise SettingRefused(f"paused_gpus: this node has no GPU {index} (its GPUs: {listed})")


def to_wire(rows: dict[str, SettingRow]) -> dict[str, protocol.Stamped]:
    return {
        name: protocol.Stamped(value=row.value, source=row.source, by=row.by, at=row.at)  # type: ignore[arg-type]
        for name, row in rows.items()
    }


class NodeControl:
    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx

    async def node_for(self, node_id: int, *, account_id: int, admin: bool) -> NodeRecord:
        """The node if the asker owns it (or is an admin), else NodeNotFound."""
        node = await self.ctx.store.node_control.node(node_id)
        if node is None or (node.account_id != account_id and not admin):
            raise NodeNotFound(f"there is no node {node_id}")
        return node

    async def change(self, node: NodeRecord, values: dict[str, Any], *, by: str) -> list[str]:
        """Check, store and send settings set on the web; SettingRefused changes nothing."""
        now = self.ctx.clock()
        rows = [
            SettingRow(
                name=name, value=check_for_node(node, name, value), source="web", by=by, at=now
            )
            for name, value in values.items()
        ]
        written = await self.ctx.store.node_control.put_settings(node.id, rows)
        if written:
            await self.push(node.id)
        return written

    async def push(self, node_id: int) -> None:
        """Send the node its stored settings, from the process that holds its socket."""
        if not await send_stored(self.ctx, node_id):
            message = {"type": "settings", "node_id": node_id, "origin": self.ctx.process_id}
            await self.ctx.broker.publish(CHANNEL, message)

    async def reported(self, session: NodeSession, report: protocol.SettingsReport) -> None:
        """Keep the node's newer local edits and why it could not apply the last ones."""
        rows = [
            SettingRow(name=name, value=s.value, source=s.source, by=s.by, at=s.at)
            for name, s in report.settings.items()
            if name in protocol.SETTING_NAMES  # at 0: its own configuration
        ]
        await self.ctx.store.node_control.put_settings(session.node_id, rows)
        await self.ctx.store.node_control.record_activity(
            session.node_id, now=self.ctx.clock(), settings_error=report.error
        )

    async def status(self, session: NodeSession, status: protocol.Status) -> None:
        """Keep what the node is doing (for the dashboard, read by any process)."""
        await self.ctx.store.node_control.record_activity(
            session.node_id,
            now=self.ctx.clock(),
            state="throttled" if status.throttled and status.state == "running" else status.state,
            reason=status.reason,
            device=status.device,
            **({"devices": [d.model_dump() for d in status.devices]} if status.devices else {}),
        )


async def send_stored(ctx: Context, node_id: int) -> bool:
    """Send a node connected here its stored settings; False if it is not here."""
    session = ctx.hub.get(node_id)
    if session is None:
        return False
    rows = (await ctx.store.node_control.settings_of([node_id]))[node_id]
    web = {name: row for name, row in rows.items() if row.source == "web"}
    if web:
        await session.send(protocol.Settings(settings=to_wire(web)))
    return True
