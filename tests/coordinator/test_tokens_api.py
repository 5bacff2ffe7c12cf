"""Tokens through the API: list without secrets, revoke, who may see and revoke whose.
Also what a newcomer meets first: the offline API docs and the warnings at submission."""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from idlegrid.app import create_app
from idlegrid.settings import CoordinatorSettings
from tests.conftest import Api, assert_error, bearer


def _made(api: Api, **body: object) -> dict[str, object]:
    response = api.client.post("/v1/tokens", json=body, headers=api.admin)
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_a_node_token_for_a_volunteer_account_is_listed_without_its_secret(api: Api) -> None:
    made = _made(api, kind="node", account="alice", label="alice's laptop")
    assert made["account"] == "alice" and made["kind"] == "node"
    listed = api.client.get("/v1/tokens", params={"account": "alice"}, headers=api.admin).json()
    assert [(t["id"], t["kind"], t["label"]) for t in listed] == [
        (made["id"], "node", "alice's laptop")
    ]
    assert listed[0]["prefix"] == made["prefix"] and listed[0]["revoked_at"] is None
    assert str(made["token"]) not in str(listed)
    everyone = api.client.get("/v1/tokens", params={"all": True}, headers=api.admin).json()
    assert {t["account"] for t in everyone} == {"admin", "alice"}


def test_a_revoked_token_is_refused_and_listed_only_on_request(api: Api) -> None:
    made = _made(api, kind="api", account="bob")
    secret = str(made["token"])
    assert api.client.get("/v1/jobs", headers=bearer(secret)).status_code == 200
    revoked = api.client.delete(f"/v1/tokens/{made['id']}", headers=bearer(secret))
    assert revoked.status_code == 200, revoked.text
    assert revoked.json()["revoked_at"] is not None
    assert_error(api.client.get("/v1/jobs", headers=bearer(secret)), 401, "unauthorized")
    assert_error(api.client.delete(f"/v1/tokens/{made['id']}", headers=api.admin), 404)
    scope = {"account": "bob"}
    assert api.client.get("/v1/tokens", params=scope, headers=api.admin).json() == []
    shown = api.client.get("/v1/tokens", params={**scope, "revoked": True}, headers=api.admin)
    assert [t["id"] for t in shown.json()] == [made["id"]]


def test_a_researcher_sees_and_revokes_only_their_own_tokens(api: Api) -> None:
    carol = api.token(account="carol")
    dave = _made(api, kind="node", account="dave")
    mine = api.client.get("/v1/tokens", headers=bearer(carol)).json()
    assert {t["account"] for t in mine} == {"carol"}
    assert_error(api.client.get("/v1/tokens", params={"all": True}, headers=bearer(carol)), 403)
    assert_error(
        api.client.get("/v1/tokens", params={"account": "dave"}, headers=bearer(carol)), 403
    )
    # Another account's token is as missing as one that never existed.
    assert_error(api.client.delete(f"/v1/tokens/{dave['id']}", headers=bearer(carol)), 404)
    assert_error(api.client.get("/v1/tokens", params={"account": "nobody"}, headers=api.admin), 404)


def test_node_tokens_cannot_manage_tokens(api: Api) -> None:
    node = api.token(kind="node")
    assert_error(api.client.get("/v1/tokens", headers=bearer(node)), 403, "forbidden")


def test_the_api_docs_load_without_a_cdn(tmp_path: Path) -> None:
    settings = CoordinatorSettings(data_dir=tmp_path / "c")
    with TestClient(create_app(settings)) as client:
        page = client.get("/docs")
        assert page.status_code == 200
        sources = re.findall(r'(?:src|href)="([^"]+)"', page.text)
        assert sources and all(s.startswith("/docs/assets/") for s in sources), sources
        for source in sources:
            asset = client.get(source)
            assert asset.status_code == 200 and len(asset.content) > 100, source
        assert "https://" not in page.text.replace("https://swagger.io", "")
        assert client.get("/openapi.json").json()["paths"]["/v1/tokens"]


def test_a_job_the_fleet_cannot_hold_warns_at_submission_with_the_fix(api: Api) -> None:
    job = api.submit(api.admin_token, kind="sleep", params={"tasks": 1}, replication=3)
    assert len(job["warnings"]) == len(job["waiting_for"]) == 2, job
    no_node, too_few = job["warnings"]
    assert no_node.startswith(job["waiting_for"][0]) and "until such a node connects" in no_node
    assert too_few.startswith("replication 3 needs 3 connected nodes")
    assert "can hold 0 replica(s) of a shard" in too_few
    assert "connect 3 more node(s)" in too_few
    assert "account of their own" not in too_few  # no node at all: accounts are not the fix
    listed = api.client.get(f"/v1/jobs/{job['id']}", headers=api.admin).json()
    assert listed["waiting_for"] == job["waiting_for"] and listed["warnings"] == []


def test_a_cancelled_job_says_it_will_have_no_result(api: Api) -> None:
    job = api.submit(api.admin_token, kind="sleep", params={"tasks": 1})
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.admin)
    message = assert_error(api.client.get(f"/v1/jobs/{job['id']}/result", headers=api.admin), 409)
    assert message == f"job {job['id']} is cancelled; it has no result and will not get one"
