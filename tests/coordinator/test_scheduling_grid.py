"""Scheduling through a real Grid (SqlStore, MemoryBroker, BlobStore), nodes in process.

Fair share, the hardware filter, speculative backups and the `waiting_for` status, with the
grid's own claim path; the nodes are sessions whose sent messages the test reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from conftest import Api, bearer
from helpers import NODE_WS, FakeNode, SocketNode, fake_node

from idlegrid import protocol
from idlegrid.coordinator.grid import Grid
from idlegrid.kinds.sleep import _digest
from idlegrid.settings import CoordinatorSettings


@pytest.fixture
def grid(in_process_grid: Callable[..., Grid], tmp_path: Path) -> Grid:
    # Scheduling one replica at a time; test_verification.py covers replicas and accounts.
    settings = CoordinatorSettings(
        data_dir=tmp_path,
        min_lease_s=1.0,
        backup_min_gain_s=1.0,
        default_replication=1,
        distinct_accounts=False,
        distinct_networks=False,
    )
    return in_process_grid(settings)


async def _account(grid: Grid, name: str) -> int:
    return (await grid.store.accounts.create_account(name, is_admin=False, now=grid.clock())).id


async def _node(
    grid: Grid, account_id: int, key: str, *, gpus: tuple[str, ...] = (), gflops: float = 10.0
) -> FakeNode:
    hardware = protocol.HardwareProfile(
        memory_mb=8000, gpus=[protocol.Gpu(backend=b, name=b, memory_mb=8000) for b in gpus]
    )  # type: ignore[arg-type]
    node = await fake_node(
        grid.store,
        account_id,
        key,
        now=grid.clock(),
        hardware=hardware,
        benchmark=protocol.Benchmark(matmul_gflops=gflops),
    )
    grid.hub.add(node.session)
    return node


async def _take(grid: Grid, node: FakeNode) -> dict[str, Any] | None:
    """Ask for one task as a free node does; forget it at once (the slot frees again)."""
    before = len(node.sent)
    node.session.requested = 1
    await grid.fill(node.session)
    assigns = [m for m in node.sent[before:] if m["type"] == "assign"]
    for message in assigns:
        node.session.live.discard(message["task_id"])
    return assigns[0] if assigns else None


async def _submit(grid: Grid, account_id: int, **params: Any) -> int:
    job = await grid.submit_job(
        account_id=account_id,
        kind_name="sleep",
        inputs={},
        params=params,
        replication=None,
        priority=0,
    )
    return job.id


async def test_a_small_job_after_a_big_one_gets_tasks_before_the_big_one_is_done(
    grid: Grid,
) -> None:
    alice, bob = await _account(grid, "alice"), await _account(grid, "bob")
    node = await _node(grid, alice, "node-one")
    big = await _submit(grid, alice, tasks=100)  # more than one broker window of candidates
    got = [await _take(grid, node) for _ in range(5)]
    assert all(m is not None and m["job_id"] == big for m in got)
    small = await _submit(grid, bob, tasks=3)
    after = [await _take(grid, node) for _ in range(4)]
    assert [m["job_id"] for m in after if m] == [small, small, small, big]
    job = await grid.store.jobs.get_job(big)
    assert job is not None and job.shard_counts.get("open") == 100


async def test_configured_shares_weigh_accounts(grid: Grid) -> None:
    # As IDLEGRID_ACCOUNT_SHARES=alice=3 sets it; bob has the default share of 1.
    grid = Grid(
        settings=replace(grid.settings, account_shares=("alice=3",)),
        store=grid.store,
        broker=grid.broker,
        blobs=grid.blobs,
    )
    alice, bob = await _account(grid, "alice"), await _account(grid, "bob")
    node = await _node(grid, alice, "node-one")
    jobs = {await _submit(grid, alice, tasks=40): "alice"}
    jobs[await _submit(grid, bob, tasks=40)] = "bob"
    owners = [jobs[m["job_id"]] for m in [await _take(grid, node) for _ in range(20)] if m]
    # Usage follows the shares 3:1 (each share's factor stays near 2^-1 as they balance).
    assert owners.count("alice") == 15 and owners.count("bob") == 5
    assert grid.matcher.share_of == {alice: 3.0}


async def test_a_node_without_a_gpu_never_receives_a_gpu_task(grid: Grid) -> None:
    alice = await _account(grid, "alice")
    cpu = await _node(grid, alice, "cpu-node", gflops=500.0)
    gpu_job = await _submit(grid, alice, tasks=6, backend="cuda")
    cpu_job = await _submit(grid, alice, tasks=3)
    taken = [await _take(grid, cpu) for _ in range(10)]
    assert [m["job_id"] for m in taken if m] == [cpu_job] * 3
    job = await grid.store.jobs.get_job(gpu_job)
    assert job is not None
    assert (await grid.matcher.waiting_for(job)) == [
        "no registered node can run it: of 1 node(s), 1 has no GPU; 1 has no backend of cuda"
    ]
    gpu = await _node(grid, alice, "gpu-node", gpus=("cuda",))
    assert (await grid.matcher.waiting_for(job)) == []
    got = [await _take(grid, gpu) for _ in range(6)]
    assert [m["job_id"] for m in got if m] == [gpu_job] * 6


async def _straggler(grid: Grid) -> tuple[int, int, FakeNode, dict[str, Any]]:
    """A one-task job whose task runs on a slow node; the account, job, node and assign."""
    alice = await _account(grid, "alice")
    slow = await _node(grid, alice, "slow-node", gflops=1.0)
    job_id = await _submit(grid, alice, tasks=1, seconds=30.0)  # 30 s on the slow node
    original = await _take(grid, slow)
    assert original is not None
    slow.session.live.add(original["task_id"])  # it keeps running there
    return alice, job_id, slow, original


async def test_a_fast_idle_node_gets_a_backup_of_a_straggler_and_wins(grid: Grid) -> None:
    alice, job_id, slow, original = await _straggler(grid)
    fast = await _node(grid, alice, "fast-node", gflops=100.0)  # 0.3 s here
    backup = await _take(grid, fast)
    assert backup is not None and backup["task_id"] != original["task_id"]
    assert backup["shard_index"] == original["shard_index"] == 0
    assert grid.counters.backups == 1
    # One backup per shard: another idle node gets none.
    assert await _take(grid, await _node(grid, alice, "third-node", gflops=100.0)) is None

    output = _digest(0)
    receipt = await grid.accept_result(
        fast.session,
        protocol.Result(
            task_id=backup["task_id"],
            output=grid.blobs.put(output),
            output_size=len(output),
            elapsed_s=0.3,
        ),
    )
    assert receipt.status == "accepted"
    job = await grid.store.jobs.get_job(job_id)
    assert job is not None and job.state.value == "completed"
    assert [m["task_id"] for m in slow.of_type("cancel")] == [original["task_id"]]
    states = {
        t.task_id: t.state.value for t in await grid.store.nodes.node_tasks(slow.session.node_id)
    }
    assert original["task_id"] not in states  # no longer held: cancelled


async def test_no_backup_for_a_node_whose_slots_are_busy(grid: Grid) -> None:
    # A backup is worth its cost only if it starts now: one that waited in the fast
    # node's buffer behind its running task would gain nothing.
    alice, _, _, _ = await _straggler(grid)
    fast = await _node(grid, alice, "fast-node", gflops=100.0)
    fast.session.prefetch = 1
    fast.session.live.add(10**9)  # its one slot computes something else
    assert await _take(grid, fast) is None
    assert grid.counters.backups == 0


async def test_no_backup_when_the_holder_is_about_as_fast(grid: Grid) -> None:
    alice = await _account(grid, "alice")
    holder = await _node(grid, alice, "holder", gflops=40.0)
    await _submit(grid, alice, tasks=1, seconds=30.0)
    assert await _take(grid, holder) is not None
    assert await _take(grid, await _node(grid, alice, "idle", gflops=50.0)) is None
    assert grid.counters.backups == 0


async def test_backups_respect_max_attempts_and_distinct_nodes(grid: Grid) -> None:
    alice = await _account(grid, "alice")
    slow = await _node(grid, alice, "slow-node", gflops=1.0)
    await _submit(grid, alice, tasks=1, seconds=30.0)
    original = await _take(grid, slow)
    assert original is not None
    shard_id = slow.session.shard_of[original["task_id"]]
    now = grid.clock()
    # The holder itself never gets a copy of its own shard.
    assert (
        await grid.store.scheduling.add_backup_task(
            shard_id, slow.session.node_id, lease_deadline=now + 9, now=now
        )
        is None
    )
    other = await _node(grid, alice, "other", gflops=1.0)
    first = await grid.store.scheduling.add_backup_task(
        shard_id, other.session.node_id, lease_deadline=now + 9, now=now
    )
    assert first is not None
    third = await _node(grid, alice, "third", gflops=1.0)
    assert (
        await grid.store.scheduling.add_backup_task(
            shard_id, third.session.node_id, lease_deadline=now + 9, now=now
        )
        is None
    )
    shards = await grid.store.jobs.list_shards(original["job_id"])
    assert (shards[0].attempts, shards[0].live_tasks) == (2, 2)


def test_job_status_says_why_it_waits(api: Api) -> None:
    token = api.token(account="alice")
    job = api.submit(token, kind="sleep", params={"tasks": 2, "backend": "cuda"})
    assert api.job(token, job["id"])["waiting_for"] == ["no node is registered yet"]
    node_token = api.token(account="alice", kind="node")
    with api.client.websocket_connect(NODE_WS) as ws:
        node = SocketNode(api, ws, node_token)
        node.hello(
            key="laptop-key", name="laptop", hardware={"memory_mb": 4096, "disk_free_mb": 900}
        )
        node.expect("welcome")
        info = api.job(token, job["id"])
    assert info["waiting_for"] == [
        "no registered node can run it: of 1 node(s), 1 has no GPU; 1 has no backend of cuda"
    ]
    cpu_job = api.submit(token, kind="sleep", params={"tasks": 1})
    assert api.job(token, cpu_job["id"])["waiting_for"] == []
    listed = api.client.get("/v1/jobs", headers=bearer(token)).json()
    assert all(j["waiting_for"] == [] for j in listed)  # only the single-job view computes it


def test_a_node_downloading_a_blob_holds_it_for_locality(api: Api) -> None:
    texts = api.upload(b'"a text shared by every shard"\n')
    node_token = api.token(account="volunteer", kind="node")
    other_token = api.token(account="someone-else", kind="node")
    with api.client.websocket_connect(NODE_WS) as ws:
        node = SocketNode(api, ws, node_token)
        node.hello(
            key="gamer-key", name="gamer", kinds=("embed-text",), hardware={"memory_mb": 4096}
        )
        node_id = node.expect("welcome")["node_id"]
        session = api.client.app.state.grid.hub.get(node_id)  # type: ignore[attr-defined]
        api.submit(api.admin_token, kind="embed-text", inputs={"texts": texts}, replication=1)
        node.take()  # a task of the job: the node may read the job's input
        # Another account's token cannot claim the node's cache (nor read the blob).
        response = api.client.get(
            f"/v1/blobs/{texts}", headers={**bearer(other_token), "X-Idlegrid-Node": str(node_id)}
        )
        assert response.status_code == 404
        assert texts not in session.held_blobs
        response = api.client.get(
            f"/v1/blobs/{texts}", headers={**bearer(node_token), "X-Idlegrid-Node": str(node_id)}
        )
        assert response.status_code == 200
        assert texts in session.held_blobs
        assert texts in session.view_now(reliability=0.5).held_blobs


async def test_running_shards_are_only_those_of_jobs_near_their_end(grid: Grid) -> None:
    alice = await _account(grid, "alice")
    first, second = await _node(grid, alice, "first"), await _node(grid, alice, "second")
    job_id = await _submit(grid, alice, tasks=2, seconds=30.0)
    await _take(grid, first)
    assert (
        await grid.store.scheduling.running_shards(limit=10) == []
    )  # a shard still waits: not the end
    await _take(grid, second)
    running = await grid.store.scheduling.running_shards(limit=10)
    assert sorted(r.node_id for r in running) == [first.session.node_id, second.session.node_id]
    assert {r.job_id for r in running} == {job_id}
    assert all(r.node_benchmark["matmul_gflops"] == 10.0 for r in running)
