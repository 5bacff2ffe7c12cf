"""A job sized against its fleet: the pure rules (policy/sizing.py) by table, and a
generation job through the API on a connected node: shards cut to fit their leases, a
job no node can finish in its lease refused with the reason, the estimate at submission
and in the job's view, and `idlegrid job N` showing it with the progress in tokens."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import Api, bearer
from fastapi.testclient import TestClient
from helpers import SocketNode
from llm_model import model_path

from idlegrid.app import create_app
from idlegrid.cli.summary import job_lines
from idlegrid.coordinator.leases import lease_for
from idlegrid.kinds import get_kind
from idlegrid.policy import sizing
from idlegrid.settings import CoordinatorSettings

RULE = sizing.LeaseRule(slack=4.0, min_s=120.0, max_s=6 * 3600.0)
G = 1e9


def _node(flops: float, lease_flops: float = 20 * G, slots: int = 1, node_id: int = 1) -> Any:
    return sizing.NodeSpeed(node_id, flops, lease_flops, slots)


@pytest.mark.parametrize(
    ("measured", "gflops", "share", "expected"),
    [(None, 100.0, 0.05, 5 * G), (3 * G, 100.0, 0.05, 3 * G), (0.0, 40.0, 0.25, 10 * G),
     (None, -1.0, 0.5, 0.0)],
)  # fmt: skip
def test_a_nodes_speed_is_measured_else_its_benchmarks_share(
    measured: float | None, gflops: float, share: float, expected: float
) -> None:
    assert sizing.node_flops(measured, gflops, share) == expected


@pytest.mark.parametrize(
    ("cost", "measured", "kind"),
    [(1e9, None, "llm-generate"), (1e13, None, "llm-generate"), (1e13, 5e9, "llm-generate"),
     (1e18, 1e9, "sleep"), (0.0, None, "sleep")],
)  # fmt: skip
def test_the_lease_rule_is_the_one_the_coordinator_leases_by(
    cost: float, measured: float | None, kind: str
) -> None:
    settings = CoordinatorSettings(data_dir=Path("/nonexistent"))
    speed = measured or get_kind(kind).default_gflops * G
    assert sizing.lease_seconds(cost, speed, RULE) == lease_for(
        settings, kind, cost_flops=cost, measured_flops=measured
    )


@pytest.mark.parametrize(
    ("node", "fits"),
    [
        # As fast as its leases assume (x slack): any task up to the longest lease.
        (_node(5 * G), 6 * 3600.0 * 5 * G),
        (_node(50 * G), 6 * 3600.0 * 50 * G),
        # Slower: only tasks within the shortest lease (its floor outlasts them).
        (_node(4 * G), 120.0 * 4 * G),
        (_node(0.0), 0.0),
    ],
)
def test_a_task_fits_a_node_that_finishes_it_within_the_lease_it_would_get(
    node: sizing.NodeSpeed, fits: float
) -> None:
    assert sizing.fitting_cost(node, RULE) == pytest.approx(fits)
    if fits:
        cost = fits * 0.999
        assert cost / node.flops <= sizing.lease_seconds(cost, node.lease_flops, RULE)
        over = fits * 1.01
        assert over / node.flops > sizing.lease_seconds(over, node.lease_flops, RULE)


def test_tasks_go_to_the_slot_free_first_and_stages_add_up() -> None:
    fast, slow = _node(2 * G, node_id=1), _node(1 * G, slots=2, node_id=2)
    # Three slots: 4 s of work on the fast one's, 4 s on each of the slow one's.
    assert sizing.makespan([8 * G, 4 * G, 4 * G], [fast, slow]) == pytest.approx(4.0)
    assert sizing.makespan([8 * G, 4 * G, 4 * G, 2 * G], [fast, slow]) == pytest.approx(5.0)
    assert sizing.makespan([], [fast]) == 0.0
    assert math.isinf(sizing.makespan([1.0], []))
    found = sizing.estimate([[2 * G], [2 * G, 2 * G]], [fast, slow])
    assert found is not None and found.seconds == pytest.approx(1.0 + 2.0)
    assert (found.nodes, found.slots) == (2, 3)
    assert sizing.estimate([[1.0]], [_node(0.0)]) is None
    # Both slower than their leases assume: 120 s of work each.
    assert sizing.shard_limit([fast, _node(4 * G, node_id=3)], RULE) == pytest.approx(240 * G)
    assert sizing.best_fit([fast, _node(4 * G, node_id=3)], RULE) == pytest.approx(480 * G)


@pytest.mark.parametrize(
    ("seconds", "words"),
    [(12.4, "12 s"), (89, "89 s"), (600, "10 min"), (3600, "1 h"), (7900, "2 h 12 min"),
     (math.inf, "forever")],
)  # fmt: skip
def test_durations_read_as_words(seconds: float, words: str) -> None:
    assert sizing.duration(seconds) == words


def test_a_training_jobs_rounds_are_stages_of_its_workers_tasks() -> None:
    kind = get_kind("diloco-train")
    params = kind.parse_params({"rounds": 3, "workers": 4, "inner": {"steps": 10}})
    stages = kind.work_stages(params, [], replication=1)
    assert len(stages) == 3 and all(len(stage) == 4 for stage in stages)
    assert len(set(stages[0])) == 1 and stages[0][0] > 0


# -- through the API ------------------------------------------------------------------------


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    settings = CoordinatorSettings(
        data_dir=tmp_path / "coordinator",
        max_blob_bytes=256 << 20,
        monitor_interval_s=3600.0,
        default_replication=1,
        distinct_accounts=False,
        distinct_networks=False,
        estimate_warning_s=60.0,
    )
    with TestClient(create_app(settings)) as client:
        admin_token = settings.admin_token_file.read_text().strip()
        yield Api(client=client, settings=settings, admin_token=admin_token)


@pytest.fixture
def node(api: Api) -> Iterator[SocketNode]:
    """A connected node offering llm-generate; its benchmark says 10 matmul GFLOPS: 2
    GFLOP/s of SmolLM2's tokens (about seven tokens a second), slower than a new node's
    leases assume (20 / 4), so a shard fits only within the shortest lease (120 s): about
    890 tokens."""
    token = api.token(account="volunteer", kind="node")
    with contextlib.ExitStack() as stack:
        ws = stack.enter_context(api.client.websocket_connect("/v1/nodes/ws"))
        connected = SocketNode(api, ws, token)
        connected.join(
            kinds=("llm-generate",),
            hardware={"cpu_cores": 2, "memory_mb": 8192, "disk_free_mb": 10_000},
        )
        yield connected


def _prompts(count: int) -> bytes:
    lines = [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(count)]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def _submit(api: Api, token: str, max_tokens: int, count: int = 6) -> Any:
    model = api.upload(model_path().read_bytes(), token=token)
    prompts = api.upload(_prompts(count), token=token)
    body = {"kind": "llm-generate", "inputs": {"model": model, "prompts": prompts},
            "params": {"max_tokens": max_tokens}, "replication": 1}  # fmt: skip
    return api.client.post("/v1/jobs", json=body, headers=bearer(token))


def test_shards_are_cut_to_fit_the_lease_and_the_estimate_is_told(
    api: Api, node: SocketNode
) -> None:
    researcher = api.token(account="alice")
    answer = _submit(api, researcher, max_tokens=300)
    assert answer.status_code == 201, answer.text
    job = answer.json()
    # Six prompts of about 315 tokens each: one shard by the default budget (8192); the
    # node does 240 GFLOP in its 120 s lease: about 890 tokens of SmolLM2, two prompts.
    budget = job["params"]["token_budget"]
    assert 850 < budget < 950, budget
    assert job["shards_total"] == 3
    cut, estimated = job["warnings"][0], job["warnings"][1]
    assert cut.startswith("shards cut to fit their leases: 1 became") and "lease" in cut
    assert estimated.startswith("estimated time: about ") and "1 connected node(s)" in estimated
    assert job["estimate"]["nodes"] == 1 and job["estimate"]["seconds"] > 60
    # The single view (with shards) says how long is left; `idlegrid job N` prints it,
    # with the progress in tokens.
    view = api.job(researcher, job["id"])
    assert view["estimate"]["seconds"] == pytest.approx(job["estimate"]["seconds"], rel=0.01)
    lines = "\n".join(job_lines(view))
    assert f"0/{view['items_total']:,} tokens" in lines
    assert "estimate     about " in lines and "left on 1 connected node" in lines
    # Without the shard list (a progress bar's long poll) it is not computed.
    polled = api.client.get(f"/v1/jobs/{job['id']}?shards=false", headers=bearer(researcher))
    assert polled.json()["estimate"] is None


def test_a_prompt_no_node_finishes_within_its_lease_is_refused_with_the_reason(
    api: Api, node: SocketNode
) -> None:
    researcher = api.token(account="alice")
    # A prompt and 2,000 tokens: 540 GFLOP, over what the node does in 120 s (240) by
    # more than an estimate's error.
    answer = _submit(api, researcher, max_tokens=2000, count=2)
    assert answer.status_code == 422, answer.text
    message = answer.json()["message"]
    assert message.startswith("prompts line 1 (2,0"), message
    assert " tokens with max_tokens) needs about " in message
    assert (
        "on the fastest connected node that can run it, and the lease that node would "
        "get is 2 min: it would be handed to another node before it ends; lower "
        "max_tokens, or shorten the prompt (or an operator raises min_lease_s)"
    ) in message
    assert not api.client.get("/v1/jobs", headers=bearer(researcher)).json()


def test_without_a_connected_node_nothing_is_estimated_or_cut(api: Api) -> None:
    researcher = api.token(account="alice")
    answer = _submit(api, researcher, max_tokens=2000, count=2)
    assert answer.status_code == 201, answer.text
    job = answer.json()
    assert job["estimate"] is None and job["params"]["token_budget"] == 8192
    assert not any(w.startswith(("shards cut", "estimated time")) for w in job["warnings"])
