"""Shards no node can add a result to, against the real coordinator (in process).

Nodes speak the protocol by hand (as in test_verification.py), so each test decides who
answers what; the monitor's pass that settles stalled shards is run by the test. A
shard the rule can decide is decided and its dissent judged; one it cannot fails, and
its job with it, saying which shard and why; the job's status names the nodes a stalled
shard waits for; and a researcher resubmits only the shards that did not complete.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from conftest import Api, bearer
from test_verification import FORGED, Fleet, _answer, _api, _grid, _settings

from idlegrid.kinds.sleep import _digest


@contextlib.contextmanager
def _grid_of(tmp_path: Path, replication: int) -> Iterator[tuple[Api, Fleet]]:
    settings = _settings(tmp_path, default_replication=replication)
    with _api(settings) as api, contextlib.ExitStack() as stack:
        yield api, Fleet(api, stack)


def _settle(api: Api, fleet: Fleet, name: str) -> int:
    grid = _grid(api)
    return int(fleet.node(name).ws.portal.call(grid.settle_stalled))


def test_two_against_one_is_decided_when_no_node_is_left(tmp_path: Path) -> None:
    with _grid_of(tmp_path, 3) as (api, fleet):
        researcher = api.token(account="alice")
        job = api.submit(researcher, kind="sleep", params={"tasks": 1})
        _answer(fleet.join("liar"), FORGED)
        for name in ("h1", "h2"):
            _answer(fleet.join(name), _digest(0))
        # Two new nodes against one fall short of the dispute's margin: one more replica
        # is asked for, and no node may run it.
        assert api.job(researcher, job["id"])["state"] == "running"
        assert _settle(api, fleet, "h1") == 1
        done = api.job(researcher, job["id"])
        assert done["state"] == "completed"
        result = api.client.get(f"/v1/jobs/{job['id']}/result", headers=bearer(researcher))
        assert json.loads(result.content) == [json.loads(_digest(0))]
        assert fleet.trust("liar")["invalid"] == 1
        assert fleet.info("liar")["credit_total"] == 0.0
        assert all(fleet.trust(h)["consecutive_valid"] == 1 for h in ("h1", "h2"))


def test_a_stalled_shard_names_the_nodes_it_waits_for(tmp_path: Path) -> None:
    with _grid_of(tmp_path, 3) as (api, fleet):
        researcher = api.token(account="alice")
        job = api.submit(researcher, kind="sleep", params={"tasks": 1})
        _answer(fleet.join("liar"), FORGED)
        for name in ("h1", "h2"):
            _answer(fleet.join(name), _digest(0))
        offline = fleet.join("offline")
        offline_id = fleet.nodes["offline"][1]
        offline.ws.close()
        fleet.node("h1").sync()
        # A registered node could still give the shard its next result: it waits for it.
        assert _settle(api, fleet, "h1") == 0
        status = api.job(researcher, job["id"])
        assert status["state"] == "running"
        assert (
            f"shard 0 waits for one more result, which only nodes {offline_id} can give"
            in " ".join(status["waiting_for"])
        )


def test_an_undecidable_shard_fails_its_job_and_only_it_is_resubmitted(tmp_path: Path) -> None:
    with _grid_of(tmp_path, 2) as (api, fleet):
        researcher = api.token(account="alice")
        job = api.submit(researcher, kind="sleep", params={"tasks": 2})
        liar, honest = fleet.join("liar"), fleet.join("honest")
        liar_id, honest_id = fleet.nodes["liar"][1], fleet.nodes["honest"][1]
        # Shard 0: both agree. Shard 1: one against one.
        for node in (liar, honest):
            for _ in range(2):
                task = node.take()
                out = _digest(task["shard_index"])
                if node is liar and task["shard_index"] == 1:
                    out = FORGED
                node.result(task["task_id"], out)
                node.expect("result_ack", status="accepted")
        assert api.job(researcher, job["id"])["state"] == "running"
        assert _settle(api, fleet, "honest") == 1
        failed = api.job(researcher, job["id"])
        assert failed["state"] == "failed"
        assert failed["error"].startswith("shard 1 failed: undecidable")
        assert "(1 against 1)" in failed["error"]
        assert f"ran it: nodes {liar_id}, {honest_id}" in failed["error"]
        shards = {s["index"]: s for s in failed["shards"]}
        assert shards[0]["state"] == "done" and shards[1]["state"] == "failed"
        assert "undecidable" in shards[1]["error"]
        # Nobody could be judged on shard 1: no trust lost, no credit for it.
        assert fleet.trust("liar")["invalid"] == 0
        # Only shard 1 runs again.
        again = api.client.post(f"/v1/jobs/{job['id']}/resubmit", headers=bearer(researcher)).json()
        assert again["shards_total"] == 1 and again["replication"] == 2
        for name in ("h2", "h3"):
            task = fleet.join(name).take()
            assert task["shard_index"] == 1
            fleet.node(name).result(task["task_id"], _digest(1))
            fleet.node(name).expect("result_ack", status="accepted")
        assert api.job(researcher, again["id"])["state"] == "completed"
        result = api.client.get(f"/v1/jobs/{again['id']}/result", headers=bearer(researcher))
        assert json.loads(result.content) == [json.loads(_digest(1))]


def test_resubmitting_a_job_that_did_not_fail_is_refused(tmp_path: Path) -> None:
    with _grid_of(tmp_path, 1) as (api, _fleet):
        researcher = api.token(account="alice")
        job = api.submit(researcher, kind="sleep", params={"tasks": 1})
        response = api.client.post(f"/v1/jobs/{job['id']}/resubmit", headers=bearer(researcher))
        assert response.status_code == 422
        assert "is queued; only a failed or cancelled job" in response.json()["message"]
        other = api.token(account="mallory")
        response = api.client.post(f"/v1/jobs/{job['id']}/resubmit", headers=bearer(other))
        assert response.status_code == 404
