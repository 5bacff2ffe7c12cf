"""Paused and throttled nodes, with their workers' reasons: on the job's `waiting_for`,
under "My nodes" and on the owner's node page."""

from __future__ import annotations

import re

import pytest
from conftest import Api, bearer
from fastapi.testclient import TestClient
from helpers import NODE_WS as WS
from helpers import SocketNode as Node
from test_dashboard import Browser

from idlegrid.kinds.sleep import _digest
from idlegrid.policy.availability import NodeState, held_back

CPU = "paused: other programs use 28% CPU (limit 25%)"
IN_USE = "running: user active 2 s ago, within the limits while in use"


@pytest.mark.parametrize(
    ("states", "expected"),
    [
        ([], []),
        ([NodeState(1, "a", False, False, "running: idle for 4 min")], []),
        (
            [NodeState(1, "a", True, False, CPU)],
            [f"1 of 2 connected node(s) that run sleep are paused by their owners' settings: "
             f"#1 a ({CPU}); they take tasks again when their machines are free"],
        ),
        (
            [NodeState(2, "b", False, True, IN_USE)],
            [f"1 of 2 connected node(s) that run sleep run throttled while their owners use "
             f"them: #2 b ({IN_USE})"],
        ),
        (
            [NodeState(i, f"n{i}", True, False, "") for i in range(7)],
            ["7 of 2 connected node(s) that run sleep are paused by their owners' settings: "
             + "; ".join(f"#{i} n{i} (no reason given)" for i in range(5))
             + "; and 2 more; they take tasks again when their machines are free"],
        ),
    ],
)  # fmt: skip
def test_held_back(states: list[NodeState], expected: list[str]) -> None:
    assert held_back("sleep", 2, states) == expected


def _status(node: Node, state: str, reason: str, *, throttled: bool = False) -> None:
    node.send(type="status", state=state, reason=reason, throttled=throttled)
    node.sync()


def test_a_paused_node_and_its_reason_reach_the_job_and_my_nodes(api: Api) -> None:
    browser = Browser(api.client)
    browser.sign_up("paula")
    added = browser.post("/my/nodes/add", {"name": "paula-pc"})
    token = re.search(r'<code id="node-token">([^<]+)</code>', added.text)
    assert token is not None
    researcher = api.token(account="lab")
    job = api.submit(researcher, kind="sleep", params={"tasks": 1})
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, token.group(1))
        node_id = node.join(key="paula-pc", kinds=("sleep",))["node_id"]
        _status(node, "paused", CPU)
        waits = api.job(researcher, job["id"])["waiting_for"]
        assert any(f"#{node_id} paula-pc ({CPU})" in w and "paused" in w for w in waits), waits
        mine = browser.get("/my/nodes")
        assert 'state-paused">paused</span>' in mine.text and CPU in mine.text
        page = browser.get(f"/nodes/{node_id}")
        assert "state-paused" in page.text and CPU in page.text
        assert CPU not in TestClient(api.client.app).get(f"/nodes/{node_id}").text  # owner only
        listed = api.client.get("/v1/nodes", headers=api.admin).json()
        assert [n["activity"] for n in listed if n["id"] == node_id] == [CPU]

        _status(node, "running", IN_USE, throttled=True)
        waits = api.job(researcher, job["id"])["waiting_for"]
        assert any("run throttled" in w and IN_USE in w for w in waits), waits
        assert not any("paused" in w for w in waits), waits
        assert 'state-throttled">throttled</span>' in browser.get("/my/nodes").text

        _status(node, "running", "running: idle for 4 min")
        assert api.job(researcher, job["id"])["waiting_for"] == []
        mine = browser.get("/my/nodes").text
        assert "running: idle for 4 min" in mine and "state-paused" not in mine


def test_a_node_reads_its_credit_as_the_dashboard_counts_it(api: Api) -> None:
    """What the worker's local page shows: GET /v1/nodes/{id}/credit with its node token."""
    token = api.token(account="cara", kind="node")
    researcher = api.token(account="lab")
    job = api.submit(researcher, kind="sleep", params={"tasks": 2})
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, token)
        node_id = node.join(key="cara-pc-key", kinds=("sleep",), slots=2)["node_id"]
        node.ready(free_slots=2)
        for assign in [node.expect("assign") for _ in range(2)]:
            node.result(assign["task_id"], _digest(assign["shard_index"]))
            node.expect("result_ack", status="accepted")
    assert api.job(researcher, job["id"])["state"] == "completed"
    read = api.client.get(f"/v1/nodes/{node_id}/credit", headers=bearer(token))
    assert read.status_code == 200
    (listed,) = [
        n for n in api.client.get("/v1/nodes", headers=api.admin).json() if n["id"] == node_id
    ]
    assert read.json()["credit_total"] == listed["credit_total"] > 0
    other = api.token(account="dan", kind="node")
    refused = api.client.get(f"/v1/nodes/{node_id}/credit", headers=bearer(other))
    assert refused.status_code == 404 and "no node" in refused.json()["message"]
