"""Leases the coordinator decides: from what it measured of a node, clamped to settings.

A node's benchmark figures are bounded and finite on the wire, and never set a lease; a
node's lease follows the time its validated tasks actually took, or the kind's default
before it has any; heartbeats do not extend a lease; a claim that cannot be sent is
released in the same pass.
"""

from __future__ import annotations

import contextlib
import math
import sqlite3
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from conftest import Api
from helpers import NODE_WS, FakeNode, SocketNode, fake_node
from pydantic import ValidationError

from idlegrid import protocol
from idlegrid.coordinator.grid import Grid
from idlegrid.coordinator.leases import lease_for
from idlegrid.kinds.sleep import _digest
from idlegrid.settings import CoordinatorSettings

T0 = 1_000_000.0
SETTINGS = CoordinatorSettings(min_lease_s=10.0, max_lease_s=1000.0, lease_slack=4.0)


@pytest.mark.parametrize(
    ("cost_flops", "measured_flops", "lease"),
    [
        (1e9, None, 10.0),  # unmeasured: the kind's default (1 GFLOPS) x 4, at least 10
        (40e9, None, 160.0),
        (400e9, None, 1000.0),  # clamped to max_lease_s
        (40e9, 10e9, 16.0),  # measured at 10 GFLOPS: 4 s x 4
        (40e9, 1e-300, 1000.0),  # measured absurdly slow: still max_lease_s
        (40e9, 1e300, 10.0),  # absurdly fast: min_lease_s
        (0.0, None, 10.0),
        (math.inf, None, 1000.0),
        (40e9, 0.0, 160.0),  # no measure: the default
    ],
)
def test_lease_table(cost_flops: float, measured_flops: float | None, lease: float) -> None:
    got = lease_for(SETTINGS, "sleep", cost_flops=cost_flops, measured_flops=measured_flops)
    assert got == pytest.approx(lease)


@pytest.mark.parametrize(
    "benchmark",
    [
        {"matmul_gflops": math.inf},
        {"matmul_gflops": math.nan},
        {"matmul_gflops": -1.0},
        {"matmul_gflops": 1e300},
        {"kind_rates": {"sleep": math.inf}},
        {"kind_rates": {"sleep": math.nan}},
        {"kind_rates": {"sleep": -1.0}},
        {"kind_rates": {"sleep": 1e300}},
        {"kind_rates": {"": 1.0}},
    ],
)
def test_benchmark_figures_are_bounded_and_finite(benchmark: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        protocol.Benchmark.model_validate(benchmark)


def test_a_hello_with_an_infinite_benchmark_is_malformed() -> None:
    frame = (
        '{"type": "hello", "token": "t", "node_key": "node-key-1", "worker_version": "1",'
        ' "hardware": {}, "benchmark": {"matmul_gflops": Infinity}, "slots": 1, "kinds": []}'
    )
    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.parse_node_message(frame)
    assert caught.value.code == "malformed"


@pytest.mark.parametrize(
    "message",
    [
        {"type": "heartbeat", "load": math.nan},
        {"type": "heartbeat", "sent_at": math.inf},
        {"type": "heartbeat", "seq": 2**63},
        {"type": "result", "task_id": 2**63, "output": "0" * 64, "output_size": 1, "elapsed_s": 1},
        {"type": "result", "task_id": 1, "output": "0" * 64, "output_size": 1, "elapsed_s": -1},
        {"type": "failure", "task_id": 2**31, "reason": "x"},
        {"type": "heartbeat", "running": [{"task_id": 1, "progress": math.nan}]},
    ],
)
def test_messages_carry_bounded_integers_and_finite_floats(message: dict[str, Any]) -> None:
    import json

    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.parse_node_message(json.dumps(message))
    assert caught.value.code == "malformed"


# -- through a grid ---------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def grid(in_process_grid: Callable[..., Grid], tmp_path: Path, clock: Clock) -> Grid:
    settings = CoordinatorSettings(
        data_dir=tmp_path,
        min_lease_s=10.0,
        max_lease_s=1000.0,
        default_replication=1,
        distinct_accounts=False,
        distinct_networks=False,
        backups=False,
    )
    return in_process_grid(settings, clock=clock)


async def _node(grid: Grid, *, benchmark: protocol.Benchmark | None = None) -> FakeNode:
    account = await grid.store.accounts.create_account(
        "volunteer", is_admin=False, now=grid.clock()
    )
    node = await fake_node(
        grid.store, account.id, "node-one", now=grid.clock(), benchmark=benchmark
    )
    grid.hub.add(node.session)
    return node


async def _submit(grid: Grid, *, tasks: int, seconds: float) -> int:
    researcher = await grid.store.accounts.create_account(
        "researcher", is_admin=False, now=grid.clock()
    )
    job = await grid.submit_job(
        account_id=researcher.id,
        kind_name="sleep",
        inputs={},
        params={"tasks": tasks, "seconds": seconds},
        replication=1,
        priority=0,
    )
    return job.id


async def _take(grid: Grid, node: FakeNode) -> dict[str, Any]:
    before = len(node.sent)
    node.session.requested = 1
    await grid.fill(node.session)
    (assign,) = [m for m in node.sent[before:] if m["type"] == "assign"]
    return assign


def _lease_s(assign: dict[str, Any], clock: Clock) -> float:
    return datetime.fromisoformat(assign["lease_deadline"]).timestamp() - clock.now


async def test_a_node_claiming_to_be_slow_gets_no_longer_lease(grid: Grid, clock: Clock) -> None:
    slow = protocol.Benchmark(matmul_gflops=1e-300, kind_rates={"sleep": 1e-300})
    # Submitted before the node connects: with it connected, the job is refused (no
    # connected node would finish a shard within its lease, by what it says).
    await _submit(grid, tasks=2, seconds=30.0)
    node = await _node(grid, benchmark=slow)
    assign = await _take(grid, node)
    # 30 GFLOP at the kind's default 1 GFLOPS x slack 4: what the node said counts for nothing.
    assert _lease_s(assign, clock) == pytest.approx(120.0)


async def test_the_lease_follows_what_the_node_was_measured_at(grid: Grid, clock: Clock) -> None:
    node = await _node(grid)
    await _submit(grid, tasks=3, seconds=30.0)
    assign = await _take(grid, node)
    clock.now += 15.0  # it did 30 GFLOP of nominal work in 15 s: 2 GFLOPS
    output = _digest(assign["shard_index"])
    receipt = await grid.accept_result(
        node.session,
        protocol.Result(
            task_id=assign["task_id"],
            output=grid.blobs.put(output),
            output_size=len(output),
            elapsed_s=0.001,  # what the node says it took is not what is measured
        ),
    )
    assert receipt.status == "accepted"
    await grid.verify_shard(receipt.shard_id)  # type: ignore[arg-type]
    assert await grid.store.nodes.measured_speeds(node.session.node_id) == {
        "sleep": pytest.approx(2e9)
    }
    node.session.measured_at = -math.inf  # as if its measure were old: read it again
    assign = await _take(grid, node)
    assert _lease_s(assign, clock) == pytest.approx(60.0)  # 15 s x slack 4


async def test_a_claim_that_cannot_be_sent_is_released_at_once(grid: Grid, clock: Clock) -> None:
    node = await _node(grid)
    job_id = await _submit(grid, tasks=1, seconds=1.0)

    async def broken(text: str) -> None:
        raise ConnectionError("the socket is gone")

    node.session.send_text = broken
    node.session.requested = 1
    assert await grid.fill(node.session) == 0
    assert node.session.live == set()
    (shard,) = await grid.store.jobs.list_shards(job_id)
    assert shard.live_tasks == 1  # a fresh task, ready for another node
    assert await grid.broker.ready_count() == 1


# -- over the socket ----------------------------------------------------------------------


def _lease_deadline(api: Api, task_id: int) -> float:
    with contextlib.closing(sqlite3.connect(api.settings.data_dir / "idlegrid.db")) as db:
        (deadline,) = db.execute("SELECT lease_deadline FROM tasks WHERE id = ?", (task_id,))
    return float(deadline[0])


def test_heartbeats_with_progress_do_not_extend_a_lease(api: Api) -> None:
    with api.client.websocket_connect(NODE_WS) as ws:
        node = SocketNode(api, ws, api.token(account="volunteer", kind="node"))
        node.join()
        api.submit(api.admin_token, kind="sleep", params={"tasks": 1, "seconds": 5.0})
        task_id = node.take()["task_id"]
        deadline = _lease_deadline(api, task_id)
        for seq, progress in enumerate((0.1, 0.5, 0.99, 0.99, 0.99)):
            node.send(
                type="heartbeat", seq=seq, running=[{"task_id": task_id, "progress": progress}]
            )
            node.expect("heartbeat_ack")
        node.send(type="status", state="paused", reason="user active")
        node.sync()
        assert _lease_deadline(api, task_id) == deadline


@pytest.mark.parametrize("task_id", [2**31, 2**63, -1, 0])
def test_task_ids_past_the_store_are_malformed_not_internal(api: Api, task_id: int) -> None:
    with api.client.websocket_connect(NODE_WS) as ws:
        node = SocketNode(api, ws, api.token(account="volunteer", kind="node"))
        node.join()
        output = "0" * 64
        node.send(type="result", task_id=task_id, output=output, output_size=1, elapsed_s=1.0)
        node.expect_error("malformed")
        node.send(type="failure", task_id=task_id, reason="x")
        node.expect_error("malformed")
        node.send(type="heartbeat", running=[{"task_id": task_id, "progress": 0.5}])
        node.expect_error("malformed")
