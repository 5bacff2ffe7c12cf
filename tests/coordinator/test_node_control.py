"""Settings changed on the dashboard served by one coordinator process reach a node
connected to another (through the broker's grid channel), checked before anything is
stored."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from store_helpers import T0, _account, _node

from idlegrid import protocol
from idlegrid.broker import Broker
from idlegrid.broker.memory import MemoryBroker
from idlegrid.coordinator.grid import CHANNEL, Grid, NodeNotFound, SettingRefused
from idlegrid.coordinator.hub import NodeSession, node_view
from idlegrid.store.sql import SqlStore


def _session(node_id: int, account_id: int, sent: list[dict[str, Any]]) -> NodeSession:
    async def send_text(text: str) -> None:
        sent.append(json.loads(text))

    async def close() -> None:
        return None

    hardware = protocol.HardwareProfile(cpu_cores=4)
    return NodeSession(
        node_id=node_id, account_id=account_id, name="n", slots=1,
        view=node_view(node_id, ["sleep"], hardware, protocol.Benchmark()),
        kind_rates={}, send_text=send_text, close=close,
    )  # fmt: skip


async def test_a_change_on_one_process_reaches_the_node_on_another(
    store: SqlStore, in_process_grid: Callable[..., Grid]
) -> None:
    broker = MemoryBroker()
    web, holder = in_process_grid(broker=broker), in_process_grid(broker=broker)
    alice = await _account(store)
    node = await _node(store, alice)
    sent: list[dict[str, Any]] = []
    holder.hub.add(_session(node.id, alice.id, sent))
    async with broker.subscribe(CHANNEL) as messages:
        written = await web.change_node_settings(node, {"cpu_percent": 30}, by="alice")
        assert written == ["cpu_percent"]
        message = await anext(messages)
        await web.on_peer_message(message)  # its own: ignored
        await holder.on_peer_message(message)
    assert [m["type"] for m in sent] == ["settings"]
    stamp = sent[0]["settings"]["cpu_percent"]
    assert stamp["value"] == 30.0 and stamp["source"] == "web" and stamp["by"] == "alice"


async def test_only_the_owner_or_an_admin_gets_the_node(
    store: SqlStore, in_process_grid: Callable[..., Grid]
) -> None:
    grid = in_process_grid()
    alice, bob = await _account(store), await _account(store, "bob")
    node = await _node(store, alice)
    assert (await grid.node_for(node.id, account_id=alice.id, admin=False)).id == node.id
    assert (await grid.node_for(node.id, account_id=bob.id, admin=True)).id == node.id
    for node_id, account_id in ((node.id, bob.id), (node.id + 99, alice.id)):
        with pytest.raises(NodeNotFound):
            await grid.node_for(node_id, account_id=account_id, admin=False)


async def test_one_bad_value_stores_none(
    store: SqlStore, in_process_grid: Callable[..., Grid]
) -> None:
    grid = in_process_grid()
    alice = await _account(store)
    node = await _node(store, alice)  # 4 cores
    with pytest.raises(SettingRefused, match="cpu_cores: 5 is more than this node's 4 cores"):
        await grid.change_node_settings(node, {"cpu_percent": 30, "cpu_cores": 5}, by="alice")
    with pytest.raises(SettingRefused, match="^windows: '08:00-08:00' ends when it starts"):
        await grid.change_node_settings(node, {"windows": "08:00-08:00"}, by="alice")
    assert (await store.node_control.settings_of([node.id]))[node.id] == {}


async def test_a_node_paused_on_one_process_is_paused_on_every_one(
    store: SqlStore, broker: Broker, in_process_grid: Callable[..., Grid]
) -> None:
    """A worker's `status` reaches the process that holds its socket; a job's
    `waiting_for` on another process names the node, its state and its reason."""
    holder, other = in_process_grid(broker=broker), in_process_grid(broker=broker)
    alice = await _account(store)
    node = await _node(store, alice)
    session = _session(node.id, alice.id, [])
    holder.hub.add(session)
    await broker.node_seen(node.id, T0, owner=holder.process_id)
    job = await other.submit_job(
        account_id=alice.id, kind_name="sleep", inputs={}, params={"tasks": 1},
        replication=1, priority=0,
    )  # fmt: skip
    assert await other.waiting_for(job) == []
    reason = "paused: other programs use 28% CPU (limit 25%)"
    await holder.node_control.status(session, protocol.Status(state="paused", reason=reason))
    (paused,) = await other.waiting_for(job)
    assert "1 of 1 connected node(s) that run sleep are paused" in paused
    assert f"#{node.id} node-key-1 ({reason})" in paused
    in_use = "running: user active 2 s ago, within the limits while in use"
    status = protocol.Status(state="running", reason=in_use, throttled=True)
    await holder.node_control.status(session, status)
    (throttled,) = await other.waiting_for(job)
    assert "run throttled" in throttled and in_use in throttled
    await broker.node_disconnected(node.id, holder.process_id)
    holder.hub.remove(session)
    # Gone: what it said last no longer holds the job back anywhere.
    assert not any(node.name in w for w in await other.waiting_for(job))
