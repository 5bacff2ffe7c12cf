"""Untrusted nodes against the real coordinator: replicas, quorum, trust, credit, Sybil limits.

The coordinator runs with the shipped verification defaults (three replicas on distinct
accounts, a quorum of two with credibility voting); nodes speak the protocol by hand over
the app's WebSocket, so each test decides exactly who answers what.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Api, bearer
from helpers import NODE_WS, SocketNode
from starlette.testclient import TestClient

from idlegrid.app import create_app
from idlegrid.coordinator.grid import Grid
from idlegrid.kinds import vectors
from idlegrid.kinds.sleep import _digest
from idlegrid.settings import CoordinatorSettings
from idlegrid.verification import credit

FORGED = json.dumps({"index": 0, "digest": "forged"}).encode()


def _settings(tmp_path: Path, **overrides: Any) -> CoordinatorSettings:
    values: dict[str, Any] = dict(
        data_dir=tmp_path / "coordinator",
        monitor_interval_s=3600.0,
        # The test client has no IP address: every node is on one "network".
        distinct_networks=False,
    )
    return CoordinatorSettings(**(values | overrides))


@contextlib.contextmanager
def _api(settings: CoordinatorSettings) -> Iterator[Api]:
    with TestClient(create_app(settings)) as client:
        admin_token = settings.admin_token_file.read_text().strip()
        yield Api(client=client, settings=settings, admin_token=admin_token)


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    assert CoordinatorSettings().default_replication == 3
    with _api(_settings(tmp_path)) as api:
        yield api


class Fleet:
    """Volunteers, each with an account of their own, connecting nodes by hand."""

    def __init__(self, api: Api, stack: contextlib.ExitStack) -> None:
        self.api, self.stack = api, stack
        self.nodes: dict[str, tuple[SocketNode, int]] = {}

    def join(
        self, name: str, *, account: str | None = None, kinds: tuple[str, ...] = ("sleep",)
    ) -> SocketNode:
        token = self.api.token(account=account or f"volunteer-{name}", kind="node")
        node = SocketNode(
            self.api, self.stack.enter_context(self.api.client.websocket_connect(NODE_WS)), token
        )
        welcome = node.join(key=f"node-key-{name}", kinds=kinds)
        self.nodes[name] = (node, welcome["node_id"])
        return node

    def node(self, name: str) -> SocketNode:
        return self.nodes[name][0]

    def info(self, name: str) -> dict[str, Any]:
        node_id = self.nodes[name][1]
        [found] = [
            n
            for n in self.api.client.get("/v1/nodes", headers=self.api.admin).json()
            if n["id"] == node_id
        ]
        return dict(found)

    def trust(self, name: str) -> dict[str, Any]:
        node_id = self.nodes[name][1]
        rows = self.api.client.get(f"/v1/nodes/{node_id}/trust", headers=self.api.admin).json()
        [row] = rows
        return dict(row)


@pytest.fixture
def fleet(api: Api) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        yield Fleet(api, stack)


def _grid(api: Api) -> Grid:
    grid = api.client.app.state.grid  # type: ignore[attr-defined]
    assert isinstance(grid, Grid)
    return grid


def _answer(node: SocketNode, output: bytes) -> dict[str, Any]:
    task = node.take()
    node.result(task["task_id"], output)
    node.expect("result_ack", status="accepted")
    return task


def test_replicas_go_to_distinct_accounts_and_the_job_says_when_it_cannot(
    api: Api, fleet: Fleet
) -> None:
    researcher = api.token(account="alice")
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    assert job["replication"] == 3
    first = fleet.join("a1", account="bob")
    second = fleet.join("a2", account="bob")
    first.take()
    second.ready()
    second.sync()  # bob already runs a replica of the only shard: nothing for his other node
    status = api.job(researcher, job["id"])
    assert status["waiting_for"] and "distinct accounts" in status["waiting_for"][0]
    assert "2 such node(s) on 1 account(s)" in status["waiting_for"][0]
    for name in ("carol", "dave"):
        fleet.join(name).take()
    assert api.job(researcher, job["id"])["waiting_for"] == []


def test_a_lying_node_is_outvoted_earns_no_credit_and_loses_trust(api: Api, fleet: Fleet) -> None:
    researcher = api.token(account="alice")
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    liar = fleet.join("liar")
    _answer(liar, FORGED)
    # New nodes count 0.8 each: three honest against one liar (0.93) are not yet a
    # quorum of credibility 0.95; a fourth honest node decides it (0.98).
    for name in ("h1", "h2", "h3"):
        _answer(fleet.join(name), _digest(0))
    assert api.job(researcher, job["id"])["state"] == "running"
    _answer(fleet.join("h4"), _digest(0))
    done = api.job(researcher, job["id"])
    assert done["state"] == "completed"
    assert done["tasks_completed"] == 5 and done["effective_replication"] == 5.0
    result = api.client.get(f"/v1/jobs/{job['id']}/result", headers=bearer(researcher))
    assert json.loads(result.content) == [json.loads(_digest(0))]

    shard_credit = credit.credit_for(1e6)  # sleep prices a 0-second shard at 1 MFLOP
    assert fleet.info("liar")["credit_total"] == 0.0
    for name in ("h1", "h2", "h3", "h4"):
        assert fleet.info(name)["credit_total"] == pytest.approx(shard_credit)
        assert fleet.trust(name)["consecutive_valid"] == 1
    liar_trust = fleet.trust("liar")
    assert (liar_trust["invalid"], liar_trust["consecutive_valid"]) == (1, 0)
    assert liar_trust["daily_quota"] == api.settings.initial_daily_quota // 2
    # A caught node counts for less than a new one.
    assert liar_trust["credibility"] < fleet.trust("h1")["credibility"]
    liar_account = api.token(account="volunteer-liar")
    me = api.client.get("/v1/me", headers=bearer(liar_account)).json()
    assert me["credit_total"] == 0.0 and not me["flagged"]
    honest = api.client.get("/v1/me", headers=bearer(api.token(account="volunteer-h1"))).json()
    assert honest["credit_total"] == pytest.approx(shard_credit)
    assert honest["recent_average_credit"] > 0


def test_repeated_invalid_results_suspend_the_node_and_flag_its_account(
    tmp_path: Path,
) -> None:
    with (
        _api(_settings(tmp_path, default_replication=2, suspend_after_invalids=2)) as api,
        contextlib.ExitStack() as stack,
    ):
        fleet = Fleet(api, stack)
        researcher = api.token(account="alice")
        liar = fleet.join("liar")
        honest = [fleet.join(f"h{i}") for i in range(4)]
        # Round 0, all new: two honest nodes against the liar give 0.76, three 0.93,
        # four 0.98 (replication 2 needs 0.94). Round 1: the honest nodes have passed a
        # check, but a dispute counts each as a new node (0.8) and the liar was caught
        # (0.4): two honest nodes give 0.91, three 0.975 and a lead of 2.
        for helpers in (honest, honest[:3]):
            job = api.submit(researcher, kind="sleep", params={"tasks": 1})
            _answer(liar, FORGED)
            for node in helpers:
                _answer(node, _digest(0))
            assert api.job(researcher, job["id"])["state"] == "completed"
        assert fleet.info("liar")["suspended"]
        me = api.client.get("/v1/me", headers=bearer(api.token(account="volunteer-liar")))
        assert me.json()["flagged"] and "suspended" in me.json()["flag_reason"]
        # A suspended node gets no work; its flagged account cannot add nodes.
        api.submit(researcher, kind="sleep", params={"tasks": 1})
        liar.ready()
        liar.sync()
        sybil = SocketNode(
            api,
            stack.enter_context(api.client.websocket_connect(NODE_WS)),
            api.token(account="volunteer-liar", kind="node"),
        )
        sybil.hello(key="node-key-sybil")
        assert "flagged" in sybil.expect_error("unauthorized")


def _warm_up(nodes: list[SocketNode]) -> None:
    """Two shards, each waiting for all three replicas; after them each node has passed
    two checks."""
    for node in (*nodes, *nodes):
        node.ready()
        task = node.expect("assign")
        node.result(task["task_id"], _digest(task["shard_index"]))
        node.expect("result_ack", status="accepted")


def test_trusted_nodes_run_shards_alone(tmp_path: Path) -> None:
    settings = _settings(tmp_path, adaptive_after=2, spot_check_rate=0.0)
    with _api(settings) as api, contextlib.ExitStack() as stack:
        fleet = Fleet(api, stack)
        _grid(api).random.random = lambda: 0.0  # type: ignore[method-assign]
        researcher = api.token(account="alice")
        nodes = [fleet.join(name) for name in ("a", "b", "c")]
        warmup = api.submit(researcher, kind="sleep", params={"tasks": 2})
        _warm_up(nodes)
        assert api.job(researcher, warmup["id"])["effective_replication"] == 3.0
        assert fleet.trust("a")["runs_alone"]

        job = api.submit(researcher, kind="sleep", params={"tasks": 1})
        alone = nodes[0].take()  # a trusted node's first replica: alone
        nodes[1].ready()
        nodes[1].sync()  # the other replicas were withdrawn
        nodes[0].result(alone["task_id"], _digest(0))
        nodes[0].expect("result_ack", status="accepted")
        # An unchecked result does not lengthen the streak (it was no check), and its
        # credit is pending until the node passes a check after it.
        assert fleet.trust("a")["consecutive_valid"] == 2
        assert fleet.trust("a")["valid"] == 3
        shard_credit = credit.credit_for(1e6)
        assert fleet.info("a")["credit_total"] == pytest.approx(2 * shard_credit)
        # "a" passed no check since its lone result: before the job is released, a
        # second trusted node checks it (the waiting node gets that spot check).
        assert api.job(researcher, job["id"])["state"] == "running"
        audit = nodes[1].expect("assign")
        assert audit["shard_index"] == 0
        nodes[1].result(audit["task_id"], _digest(0))
        nodes[1].expect("result_ack", status="accepted")
        done = api.job(researcher, job["id"])
        assert done["state"] == "completed" and done["effective_replication"] == 2.0
        assert _grid(api).counters.alone["audited"] == 1
        assert fleet.info("a")["credit_total"] == pytest.approx(3 * shard_credit)


def test_a_spot_check_that_disagrees_sends_the_shard_back_to_full_replication(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path, adaptive_after=2, spot_check_rate=1.0, double_check_rate=0.0)
    with _api(settings) as api, contextlib.ExitStack() as stack:
        fleet = Fleet(api, stack)
        _grid(api).random.random = lambda: 0.0  # type: ignore[method-assign]
        researcher = api.token(account="alice")
        nodes = [fleet.join(name) for name in ("a", "b", "c")]
        api.submit(researcher, kind="sleep", params={"tasks": 2})
        _warm_up(nodes)
        newcomer = fleet.join("newcomer")

        job = api.submit(researcher, kind="sleep", params={"tasks": 1})
        _answer(nodes[0], FORGED)  # the trusted node cheats while it runs alone
        newcomer.ready()
        newcomer.sync()  # the spot check is for a trusted node only
        _answer(nodes[1], _digest(0))  # the spot check disagrees: full replication again
        assert _grid(api).counters.alone["escalated"] == 1
        # The newcomer asked before: it gets the replica the escalation added. In a
        # dispute every node counts as a new one (0.8): two against the cheat are not
        # enough, nor three (0.93); a fourth decides it (0.98, a lead of 3).
        task = newcomer.expect("assign")
        newcomer.result(task["task_id"], _digest(0))
        newcomer.expect("result_ack", status="accepted")
        _answer(nodes[2], _digest(0))
        assert api.job(researcher, job["id"])["state"] == "running"
        _answer(fleet.join("fourth"), _digest(0))
        done = api.job(researcher, job["id"])
        assert done["state"] == "completed"
        trust = fleet.trust("a")
        assert (trust["consecutive_valid"], trust["invalid"]) == (0, 1)


def test_a_late_result_is_checked_against_the_canonical_one(api: Api, fleet: Fleet) -> None:
    researcher = api.token(account="alice")
    job = api.submit(researcher, kind="sleep", params={"tasks": 2})
    slow = fleet.join("slow")
    held = slow.take()
    grid = _grid(api)
    portal = slow.ws.portal

    async def expire() -> None:
        await grid.expire(
            await grid.store.results.expire_task(held["task_id"], now=grid.clock()),
            why="test: the lease ran out",
        )

    portal.call(expire)
    for name in ("x", "y", "z"):
        node = fleet.join(name)
        for _ in range(2):
            node.ready()
            task = node.expect("assign")
            node.result(task["task_id"], _digest(task["shard_index"]))
            node.expect("result_ack", status="accepted")
    assert api.job(researcher, job["id"])["state"] == "completed"
    slow.expect("cancel", task_id=held["task_id"])  # its shard was decided meanwhile
    slow.result(held["task_id"], _digest(held["shard_index"]))
    slow.expect("result_ack", status="late")
    # It delivered after all: not an error (the expiry's charge is withdrawn), and a
    # check passed. The shard's work was credited with its decision: not paid twice.
    trust = fleet.trust("slow")
    assert trust["valid"] == 1 and trust["errors"] == 0
    assert fleet.info("slow")["credit_total"] == 0


def _offer(node: SocketNode) -> dict[str, Any] | None:
    """Ask for one task; the assignment, or None once the coordinator had none for it."""
    node.ready()
    node.ws.send_text("sync")
    got = None
    while True:
        message = node.recv()
        if message["type"] == "assign":
            got = message
        elif message["type"] == "error":
            return got


def test_zeros_are_a_lie_not_an_error(api: Api, fleet: Fleet) -> None:
    researcher = api.token(account="alice")
    job = api.submit(researcher, kind="vectors", params={"items": 2, "shard_size": 2})
    liar = fleet.join("liar", kinds=("vectors",))
    task = liar.take()
    liar.result(task["task_id"], vectors.to_npy(np.zeros((2, vectors.DIM), np.float32)))
    liar.expect("result_ack", status="accepted")  # told as little as any outvoted node
    trust = fleet.trust("liar")
    assert (trust["invalid"], trust["errors"], trust["consecutive_valid"]) == (1, 0, 0)
    honest = vectors.to_npy(vectors.compute(0, 2, 0))
    for name in ("h1", "h2", "h3"):  # the shard still gets its three replicas
        node = fleet.join(name, kinds=("vectors",))
        node.result(node.take()["task_id"], honest)
        node.expect("result_ack", status="accepted")
    assert api.job(researcher, job["id"])["state"] == "completed"
    result = api.client.get(f"/v1/jobs/{job['id']}/result", headers=bearer(researcher))
    assert result.content == honest
    assert fleet.info("liar")["credit_total"] == 0.0


def test_a_caught_node_loses_alone_running_at_once_and_its_lone_shards_are_redone(
    tmp_path: Path,
) -> None:
    settings = _settings(tmp_path, adaptive_after=2, spot_check_rate=0.0)
    with _api(settings) as api, contextlib.ExitStack() as stack:
        fleet = Fleet(api, stack)
        _grid(api).random.random = lambda: 0.0  # type: ignore[method-assign]
        researcher = api.token(account="alice")
        nodes = [fleet.join(name) for name in ("a", "b", "c")]
        api.submit(researcher, kind="sleep", params={"tasks": 2})
        _warm_up(nodes)
        assert fleet.trust("a")["runs_alone"]
        honest = [*nodes[1:], fleet.join("d"), fleet.join("e")]

        job = api.submit(researcher, kind="sleep", params={"tasks": 2})
        for _ in range(2):  # "a" runs both shards alone, and lies on both
            task = nodes[0].take()
            nodes[0].result(
                task["task_id"], json.dumps({"digest": f"forged-{task['shard_index']}"}).encode()
            )
            nodes[0].expect("result_ack", status="accepted")
        assert fleet.trust("a")["runs_alone"]  # nothing checked it yet
        # The job is held: "a" passed no check since, so its latest lone shard is
        # spot-checked by a trusted node first.
        audit = _offer(honest[0])
        assert audit is not None and audit["shard_index"] == 1
        honest[0].result(audit["task_id"], _digest(1))
        honest[0].expect("result_ack", status="accepted")
        # The check disagreed: in that same pass "a" stopped running alone, and the other
        # shard it decided alone was opened again.
        assert not fleet.trust("a")["runs_alone"]
        shards = api.job(researcher, job["id"])["shards"]
        assert [shard["state"] for shard in shards] == ["open", "open"]
        assert api.job(researcher, job["id"])["state"] == "running"
        for _ in range(4):  # honest replicas settle both shards
            for node in honest:
                task = _offer(node)
                if task is not None:
                    node.result(task["task_id"], _digest(task["shard_index"]))
                    node.expect("result_ack", status="accepted")
        done = api.job(researcher, job["id"])
        assert done["state"] == "completed"
        result = api.client.get(f"/v1/jobs/{job['id']}/result", headers=bearer(researcher))
        assert json.loads(result.content) == [json.loads(_digest(i)) for i in range(2)]
        trust = fleet.trust("a")
        assert trust["invalid"] == 2 and not trust["runs_alone"]
        # The credit its lies earned while accepted alone was taken back: what is left
        # is the warm-up's two checked results.
        assert fleet.info("a")["credit_total"] == pytest.approx(2 * credit.credit_for(1e6))


def test_accounts_wrong_together_the_same_way_are_flagged(api: Api, fleet: Fleet) -> None:
    researcher = api.token(account="alice")
    pair = [fleet.join("c1"), fleet.join("c2")]
    honest = [fleet.join(f"h{i}") for i in range(5)]
    for _ in range(2):  # two jobs: the pair returns the same wrong answer for each
        job = api.submit(researcher, kind="sleep", params={"tasks": 1})
        index = None
        for node in pair:
            task = node.take()
            index = task["shard_index"]
            node.result(task["task_id"], json.dumps({"digest": f"ours-{index}"}).encode())
            node.expect("result_ack", status="accepted")
        # Two against one: a dispute; every node counts as new and the winner needs a
        # lead of 2: five honest nodes against the new pair decide it (0.98), four
        # against the pair once it was caught (0.4 each).
        for node in honest:
            if api.job(researcher, job["id"])["state"] == "completed":
                break
            task = _offer(node)
            assert task is not None and task["shard_index"] == index
            node.result(task["task_id"], _digest(index))
            node.expect("result_ack", status="accepted")
        assert api.job(researcher, job["id"])["state"] == "completed"
    for name in ("volunteer-c1", "volunteer-c2"):
        me = api.client.get("/v1/me", headers=bearer(api.token(account=name))).json()
        assert me["flagged"] and "collusion" in me["flag_reason"]
    honest_me = api.client.get("/v1/me", headers=bearer(api.token(account="volunteer-h0")))
    assert not honest_me.json()["flagged"]
