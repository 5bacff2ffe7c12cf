"""The fleet snapshot a job's status is judged by: reused, refreshed off the request,
and current for nodes that register on this process."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from helpers import eventually, fake_node

from idlegrid import protocol
from idlegrid.coordinator.fleet import Fleet
from idlegrid.kinds.base import Requirements
from idlegrid.store.sql import SqlStore

GPU = Requirements(backends=frozenset({"cuda"}), accelerator=True)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingStore:
    """The store, counting (and optionally holding up) its reads of every node."""

    def __init__(self, store: SqlStore) -> None:
        self._store = store
        self.reads = 0
        self.gate: asyncio.Event | None = None
        self.nodes = self  # the fleet reads `store.nodes.list_nodes`: counted here

    async def list_nodes(self, account_id: int | None = None) -> Any:
        self.reads += 1
        if self.gate is not None:
            await self.gate.wait()
        return await self._store.nodes.list_nodes(account_id)


async def _gpu_node(store: SqlStore, account_id: int, key: str) -> Any:
    hardware = protocol.HardwareProfile(
        memory_mb=8000, gpus=[protocol.Gpu(backend="cuda", name="gpu", memory_mb=8000)]
    )  # type: ignore[arg-type]
    node = await fake_node(store, account_id, key, now=1000.0, hardware=hardware)
    return next(n for n in await store.nodes.list_nodes(account_id) if n.id == node.session.node_id)


async def test_the_snapshot_is_read_once_per_ttl_and_answers_are_reused(store: SqlStore) -> None:
    account = (await store.accounts.create_account("alice", is_admin=False, now=1000.0)).id
    await fake_node(store, account, "cpu-node", now=1000.0)
    counting, clock = CountingStore(store), Clock()
    fleet = Fleet(counting, clock=clock, ttl_s=10.0)  # type: ignore[arg-type]
    reason = await fleet.unmet(GPU, "sleep")
    assert reason is not None and "1 has no GPU" in reason
    for _ in range(20):  # a job page polled: no more reads within the TTL
        assert await fleet.unmet(GPU, "sleep") == reason
    assert counting.reads == 1
    assert [n.record.name for n in await fleet.nodes()] == ["cpu-node"]
    await fleet.aclose()


async def test_a_stale_snapshot_is_served_while_one_refresh_runs(store: SqlStore) -> None:
    account = (await store.accounts.create_account("alice", is_admin=False, now=1000.0)).id
    await fake_node(store, account, "cpu-node", now=1000.0)
    counting, clock = CountingStore(store), Clock()
    fleet = Fleet(counting, clock=clock, ttl_s=10.0)  # type: ignore[arg-type]
    assert await fleet.unmet(GPU, "sleep") is not None
    # Another coordinator registers a GPU node; the snapshot is past its age.
    await _gpu_node(store, account, "gpu-node")
    clock.now += 11
    counting.gate = asyncio.Event()
    for _ in range(5):  # answered at once from the old copy, one refresh started
        assert await asyncio.wait_for(fleet.unmet(GPU, "sleep"), 1.0) is not None
    assert counting.reads == 2
    counting.gate.set()

    async def gpu_node_seen() -> bool:
        return await fleet.unmet(GPU, "sleep") is None

    await eventually(gpu_node_seen, "the refreshed copy", poll_s=0.01)
    assert await fleet.unmet(GPU, "sleep") is None
    assert sorted(n.record.name for n in await fleet.nodes()) == ["cpu-node", "gpu-node"]
    await fleet.aclose()


async def test_a_node_registering_here_counts_at_once(store: SqlStore) -> None:
    account = (await store.accounts.create_account("alice", is_admin=False, now=1000.0)).id
    await fake_node(store, account, "cpu-node", now=1000.0)
    counting = CountingStore(store)
    fleet = Fleet(counting, clock=Clock(), ttl_s=10.0)  # type: ignore[arg-type]
    assert await fleet.unmet(GPU, "sleep") is not None
    assert [a for _, a, _ in await fleet.able("sleep")] == [account]
    assert await fleet.able("sleep", GPU) == []  # it cannot run such a shard
    gpu = await _gpu_node(store, account, "gpu-node")
    fleet.saw(gpu)
    assert await fleet.unmet(GPU, "sleep") is None
    assert len(await fleet.able("sleep")) == 2
    assert [n for n, _, _ in await fleet.able("sleep", GPU)] == [gpu.id]
    assert counting.reads == 1
    await fleet.aclose()


async def test_a_failed_refresh_keeps_the_last_copy(
    store: SqlStore, caplog: pytest.LogCaptureFixture
) -> None:
    account = (await store.accounts.create_account("alice", is_admin=False, now=1000.0)).id
    await fake_node(store, account, "cpu-node", now=1000.0)
    counting, clock = CountingStore(store), Clock()
    fleet = Fleet(counting, clock=clock, ttl_s=10.0)  # type: ignore[arg-type]
    assert len(await fleet.nodes()) == 1

    async def broken(account_id: int | None = None) -> Any:
        raise OSError("database went away")

    counting.list_nodes = broken  # type: ignore[method-assign]
    clock.now += 11
    assert len(await fleet.nodes()) == 1
    # The refresh fails in the background, logged.
    await eventually(lambda: "reading the fleet failed" in caplog.text, "the failure logged")
    assert len(await fleet.nodes()) == 1
    await fleet.aclose()


async def test_a_profile_a_newer_coordinator_stored_is_still_matched(store: SqlStore) -> None:
    """Coordinators of two releases share the database while one is upgraded: fields of a
    newer minor in a stored profile are ignored; a profile this version cannot read is
    matched against nothing."""
    from dataclasses import replace

    from idlegrid.coordinator.fleet import fleet_node

    account = (await store.accounts.create_account("alice", is_admin=False, now=1000.0)).id
    record = await _gpu_node(store, account, "gpu-node")
    newer = {**record.hardware, "npus": [{"name": "x"}]}
    newer["gpus"] = [{**record.hardware["gpus"][0], "pcie_gen": 5}]
    view = fleet_node(replace(record, hardware=newer, benchmark={"matmul_gflops": 9.0, "x": 1}))
    assert view.view is not None and "cuda" in view.view.backends
    broken = fleet_node(replace(record, hardware={**record.hardware, "memory_mb": "lots"}))
    assert broken.view is None
