"""The REST API under TestClient: auth, ownership, blobs, limits, jobs; every error is JSON."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import pytest
from conftest import MAX_BLOB_BYTES, MAX_REQUEST_BYTES, Api, assert_error, bearer, sha
from fastapi.testclient import TestClient

from idlegrid.app import create_app
from idlegrid.kinds.embed_text.kind import texts_to_jsonl
from idlegrid.settings import CoordinatorSettings

# -- meta ---------------------------------------------------------------------------------

NO_CREDIT = {
    "credit_total": 0.0,
    "recent_average_credit": 0.0,
    "flagged": False,
    "flag_reason": None,
}


def test_health_docs_and_openapi(api: Api) -> None:
    health = api.client.get("/healthz")
    assert health.status_code == 200 and health.json()["ok"] is True
    docs = api.client.get("/docs")
    assert docs.status_code == 200 and "text/html" in docs.headers["content-type"]
    schema = api.client.get("/openapi.json")
    assert schema.status_code == 200
    paths = schema.json()["paths"]
    assert {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/blobs/{blob_hash}", "/v1/tokens"} <= set(paths)


def test_admin_token_file_is_private(api: Api) -> None:
    assert api.settings.admin_token_file.stat().st_mode & 0o077 == 0
    me = api.client.get("/v1/me", headers=api.admin)
    assert me.json() == {"account": "admin", "kind": "api", "admin": True, **NO_CREDIT}


def test_unknown_route_and_method_are_json(api: Api) -> None:
    assert_error(api.client.get("/v1/nothing-here", headers=api.admin), 404, "not_found")
    assert_error(api.client.delete("/v1/jobs", headers=api.admin), 405, "method_not_allowed")


# -- auth ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer igr_not-a-real-token"},
        {"Authorization": "Basic abc"},
        {"Authorization": "Bearer "},
        {"Authorization": "igr_no-scheme"},
    ],
    ids=["missing", "wrong", "basic", "empty", "no-scheme"],
)
def test_bad_tokens_are_401(api: Api, headers: dict[str, str]) -> None:
    for response in (
        api.client.get("/v1/jobs", headers=headers),
        api.client.get("/v1/me", headers=headers),
        api.client.post("/v1/jobs", json={"kind": "sleep"}, headers=headers),
        api.client.put(f"/v1/blobs/{sha(b'x')}", content=b"x", headers=headers),
        api.client.get(f"/v1/blobs/{sha(b'x')}", headers=headers),
    ):
        assert_error(response, 401, "unauthorized")


def test_node_tokens_cannot_call_researcher_endpoints(api: Api) -> None:
    node = bearer(api.token(kind="node"))
    assert api.client.get("/v1/me", headers=node).json()["kind"] == "node"
    for response in (
        api.client.get("/v1/jobs", headers=node),
        api.client.post("/v1/jobs", json={"kind": "sleep"}, headers=node),
        api.client.get("/v1/jobs/1", headers=node),
        api.client.post("/v1/tokens", json={"kind": "node"}, headers=node),
        api.client.get("/v1/nodes", headers=node),
    ):
        assert_error(response, 403, "forbidden")
    assert api.client.get("/v1/jobs", headers=api.admin).json() == []


def test_admin_makes_tokens_for_accounts(api: Api) -> None:
    made = api.client.post(
        "/v1/tokens", json={"account": "alice", "label": "laptop"}, headers=api.admin
    )
    assert made.status_code == 201
    body = made.json()
    assert body["account"] == "alice" and body["kind"] == "api"
    assert body["token"].startswith("igr_") and body["token"].startswith(body["prefix"])
    alice = bearer(body["token"])
    assert api.client.get("/v1/me", headers=alice).json() == {
        "account": "alice",
        "kind": "api",
        "admin": False,
        **NO_CREDIT,
    }
    # A second token for the same account reuses it; a node token is ign_.
    node = api.token(account="alice", kind="node")
    assert node.startswith("ign_")
    assert api.client.get("/v1/me", headers=bearer(node)).json()["account"] == "alice"
    # Alice may make tokens for herself, not for others.
    own = api.client.post("/v1/tokens", json={"kind": "node"}, headers=alice)
    assert own.status_code == 201 and own.json()["account"] == "alice"
    assert_error(
        api.client.post("/v1/tokens", json={"account": "bob"}, headers=alice), 403, "forbidden"
    )
    assert_error(
        api.client.post("/v1/tokens", json={"account": "no spaces"}, headers=api.admin),
        422,
        "invalid_request",
    )
    assert_error(api.client.post("/v1/tokens", json={"kind": "root"}, headers=api.admin), 422)


# -- ownership ------------------------------------------------------------------------------


def test_researchers_see_only_their_own_jobs(api: Api) -> None:
    alice, bob = api.token(account="alice"), api.token(account="bob")
    job = api.submit(alice, kind="sleep", params={"tasks": 2})
    job_id = job["id"]
    assert api.job(alice, job_id)["id"] == job_id
    for response in (
        api.client.get(f"/v1/jobs/{job_id}", headers=bearer(bob)),
        api.client.get(f"/v1/jobs/{job_id}/result", headers=bearer(bob)),
        api.client.post(f"/v1/jobs/{job_id}/cancel", headers=bearer(bob)),
    ):
        message = assert_error(response, 404, "not_found")
        assert str(job_id) in message
    assert api.client.get("/v1/jobs", headers=bearer(bob)).json() == []
    assert [j["id"] for j in api.client.get("/v1/jobs", headers=bearer(alice)).json()] == [job_id]
    # Bob's failed cancel changed nothing; the admin sees every job.
    assert api.job(alice, job_id)["state"] == "queued"
    assert api.job(api.admin_token, job_id)["id"] == job_id


@pytest.mark.parametrize("path", ["/v1/jobs/999", "/v1/jobs/999/result"])
def test_unknown_job_is_404(api: Api, path: str) -> None:
    assert_error(api.client.get(path, headers=api.admin), 404, "not_found")


def test_unknown_job_cancel_is_404(api: Api) -> None:
    assert_error(api.client.post("/v1/jobs/999/cancel", headers=api.admin), 404, "not_found")


def test_non_integer_job_id_is_422(api: Api) -> None:
    assert_error(api.client.get("/v1/jobs/abc", headers=api.admin), 422, "invalid_request")


# -- blobs ----------------------------------------------------------------------------------


def _blob_files(api: Api) -> list[str]:
    root = api.settings.blob_dir
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_blob_upload_and_download(api: Api) -> None:
    data = b"some input bytes"
    blob_hash = sha(data)
    assert api.client.head(f"/v1/blobs/{blob_hash}", headers=api.admin).status_code == 404
    put = api.client.put(f"/v1/blobs/{blob_hash}", content=data, headers=api.admin)
    assert put.status_code == 201 and put.json() == {"hash": blob_hash, "size": len(data)}
    assert api.client.head(f"/v1/blobs/{blob_hash}", headers=api.admin).status_code == 200
    got = api.client.get(f"/v1/blobs/{blob_hash}", headers=api.admin)
    assert got.status_code == 200 and got.content == data
    # Uploading it again is fine; node tokens may upload and download blobs too.
    node = bearer(api.token(kind="node"))
    assert api.client.put(f"/v1/blobs/{blob_hash}", content=data, headers=node).status_code == 201
    assert api.client.get(f"/v1/blobs/{blob_hash}", headers=node).content == data


def test_a_blob_of_several_chunks_downloads_whole_and_by_range(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("idlegrid.coordinator.api.common.StreamedFile.chunk_size", 1000)
    data = bytes(range(256)) * 14  # 3,584 bytes: three full chunks and a partial one
    blob_hash = api.upload(data)
    got = api.client.get(f"/v1/blobs/{blob_hash}", headers=api.admin)
    assert got.status_code == 200 and got.content == data
    start, end = 900, 2100  # across two chunk boundaries
    part = api.client.get(
        f"/v1/blobs/{blob_hash}", headers={**api.admin, "Range": f"bytes={start}-{end}"}
    )
    assert part.status_code == 206 and part.content == data[start : end + 1]


def test_blob_hash_mismatch_is_422_and_stores_nothing(api: Api) -> None:
    claimed = sha(b"what I said")
    message = assert_error(
        api.client.put(f"/v1/blobs/{claimed}", content=b"what I sent", headers=api.admin),
        422,
        "invalid_blob",
    )
    assert claimed in message
    assert api.client.head(f"/v1/blobs/{claimed}", headers=api.admin).status_code == 404
    assert _blob_files(api) == []


@pytest.mark.parametrize("bad", ["abc", "AB" * 32, "z" * 64])
def test_bad_blob_hash_is_422(api: Api, bad: str) -> None:
    message = assert_error(api.client.put(f"/v1/blobs/{bad}", content=b"x", headers=api.admin), 422)
    assert "blob_hash" in message
    assert_error(api.client.get(f"/v1/blobs/{bad}", headers=api.admin), 422)
    assert api.client.head(f"/v1/blobs/{bad}", headers=api.admin).status_code == 422


def test_missing_blob_is_404(api: Api) -> None:
    assert_error(api.client.get(f"/v1/blobs/{sha(b'nope')}", headers=api.admin), 404, "not_found")


def test_blob_at_the_limit_is_fine(api: Api) -> None:
    data = b"z" * MAX_BLOB_BYTES
    put = api.client.put(f"/v1/blobs/{sha(data)}", content=data, headers=api.admin)
    assert put.status_code == 201, put.text


def test_blob_over_the_limit_with_content_length_is_413(api: Api) -> None:
    data = b"z" * (MAX_BLOB_BYTES + 1)
    response = api.client.put(f"/v1/blobs/{sha(data)}", content=data, headers=api.admin)
    assert_error(response, 413, "too_large")
    assert _blob_files(api) == []


def test_blob_over_the_limit_chunked_is_413(api: Api) -> None:
    chunk = b"c" * 1000
    chunks = (MAX_BLOB_BYTES // len(chunk)) + 2
    data = chunk * chunks

    def body() -> Iterator[bytes]:
        for _ in range(chunks):
            yield chunk

    response = api.client.put(f"/v1/blobs/{sha(data)}", content=body(), headers=api.admin)
    assert response.request.headers.get("transfer-encoding") == "chunked"
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "too_large")
    # Nothing under the real name and no half-written temporary file.
    assert _blob_files(api) == []


def test_chunked_blob_within_the_limit_is_stored(api: Api) -> None:
    parts = [b"part one, ", b"part two"]

    def body() -> Iterator[bytes]:
        yield from parts

    data = b"".join(parts)
    response = api.client.put(f"/v1/blobs/{sha(data)}", content=body(), headers=api.admin)
    assert response.status_code == 201 and response.json()["size"] == len(data)
    assert api.client.get(f"/v1/blobs/{sha(data)}", headers=api.admin).content == data


# -- request limits and validation ----------------------------------------------------------


def test_json_body_over_the_request_limit_is_413(api: Api) -> None:
    body = json.dumps({"kind": "sleep", "params": {"pad": "x" * MAX_REQUEST_BYTES}}).encode()
    response = api.client.post(
        "/v1/jobs", content=body, headers={**api.admin, "Content-Type": "application/json"}
    )
    assert_error(response, 413, "too_large")

    def chunked() -> Iterator[bytes]:
        for start in range(0, len(body), 500):
            yield body[start : start + 500]

    response = api.client.post(
        "/v1/jobs", content=chunked(), headers={**api.admin, "Content-Type": "application/json"}
    )
    assert_error(response, 413, "too_large")
    assert api.client.get("/v1/jobs", headers=api.admin).json() == []


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", ""),
        (b"[]", ""),
        (b"{}", "kind"),
        (json.dumps({"kind": "sleep", "surprise": 1}).encode(), "surprise"),
        (json.dumps({"kind": "sleep", "replication": 0}).encode(), "replication"),
        (json.dumps({"kind": "sleep", "priority": 1000}).encode(), "priority"),
    ],
    ids=["not-json", "array", "no-kind", "extra-field", "replication-0", "priority"],
)
def test_invalid_job_requests_are_422(api: Api, body: bytes, fragment: str) -> None:
    response = api.client.post(
        "/v1/jobs", content=body, headers={**api.admin, "Content-Type": "application/json"}
    )
    message = assert_error(response, 422, "invalid_request")
    assert fragment in message


# -- jobs -----------------------------------------------------------------------------------


def test_sleep_job_lifecycle_view(api: Api) -> None:
    alice = api.token(account="alice")
    created = api.submit(alice, kind="sleep", params={"tasks": 3, "seconds": 0}, priority=5)
    assert created["state"] == "queued" and created["kind"] == "sleep"
    assert (created["shards_total"], created["items_total"], created["priority"]) == (3, 3, 5)
    assert created["params"] == {"tasks": 3, "seconds": 0.0, "backend": "", "hashes": 0}
    assert created["progress"] == 0.0 and created["result"] is None
    job = api.job(alice, created["id"])
    assert [s["index"] for s in job["shards"]] == [0, 1, 2]
    assert all(
        s["state"] == "open"
        and s["progress"] == 0.0
        and s["live_tasks"] == 1
        and s["attempts"] == 1
        for s in job["shards"]
    )
    assert job["shard_counts"] == {"open": 3} and job["shards_done"] == 0
    listed = api.client.get("/v1/jobs", headers=bearer(alice)).json()
    assert [j["id"] for j in listed] == [created["id"]] and listed[0]["shards"] is None


def test_replication_defaults_and_can_be_set(api: Api) -> None:
    assert api.submit(api.admin_token, kind="sleep")["replication"] == 1
    job = api.submit(api.admin_token, kind="sleep", params={"tasks": 2}, replication=3)
    assert job["replication"] == 3
    shards = api.job(api.admin_token, job["id"])["shards"]
    assert [s["live_tasks"] for s in shards] == [3, 3]


def test_result_before_completion_is_409(api: Api) -> None:
    job = api.submit(api.admin_token, kind="sleep")
    message = assert_error(
        api.client.get(f"/v1/jobs/{job['id']}/result", headers=api.admin), 409, "not_ready"
    )
    assert "queued" in message


def test_cancel(api: Api) -> None:
    alice = api.token(account="alice")
    job = api.submit(alice, kind="sleep", params={"tasks": 2})
    cancelled = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(alice))
    assert cancelled.status_code == 200
    assert cancelled.json()["state"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    after = api.job(alice, job["id"])
    assert after["state"] == "cancelled"
    assert all(s["state"] == "cancelled" and s["live_tasks"] == 0 for s in after["shards"])
    # Cancelling again is harmless; there is no result.
    again = api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=bearer(alice))
    assert again.status_code == 200 and again.json()["state"] == "cancelled"
    assert_error(
        api.client.get(f"/v1/jobs/{job['id']}/result", headers=bearer(alice)), 409, "not_ready"
    )


@pytest.mark.parametrize("wait_s", ["-1", "61", "nan", "inf", "soon"])
def test_bad_long_poll_waits_are_422(api: Api, wait_s: str) -> None:
    job = api.submit(api.admin_token, kind="sleep")
    response = api.client.get(f"/v1/jobs/{job['id']}?wait_s={wait_s}", headers=api.admin)
    assert "wait_s" in assert_error(response, 422)


def test_long_poll_of_an_unchanged_job_answers_after_wait_s(api: Api) -> None:
    job = api.submit(api.admin_token, kind="sleep", params={"tasks": 2})
    started = time.monotonic()
    response = api.client.get(
        f"/v1/jobs/{job['id']}", params={"wait_s": 0.3, "shards": "false"}, headers=api.admin
    )
    assert response.status_code == 200
    assert time.monotonic() - started >= 0.3
    assert response.json()["state"] == "queued" and response.json()["shards"] is None


def test_long_poll_of_an_ended_job_answers_at_once(api: Api) -> None:
    job = api.submit(api.admin_token, kind="sleep")
    api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.admin)
    started = time.monotonic()
    response = api.client.get(f"/v1/jobs/{job['id']}?wait_s=30", headers=api.admin)
    assert response.json()["state"] == "cancelled" and time.monotonic() - started < 10


def test_long_poll_wakes_when_the_job_ends(api: Api, monkeypatch: pytest.MonkeyPatch) -> None:
    # No re-reads on a timer during this test: only the job's end can answer the poll.
    monkeypatch.setattr("idlegrid.coordinator.api.jobs.RECHECK_S", 60.0)
    job = api.submit(api.admin_token, kind="sleep", params={"tasks": 2})
    cancel = threading.Timer(
        0.3, lambda: api.client.post(f"/v1/jobs/{job['id']}/cancel", headers=api.admin)
    )
    started = time.monotonic()
    cancel.start()
    try:
        response = api.client.get(f"/v1/jobs/{job['id']}?wait_s=50", headers=api.admin)
    finally:
        cancel.join()
    assert response.json()["state"] == "cancelled"
    assert 0.3 <= time.monotonic() - started < 30


def test_unknown_kind_is_422(api: Api) -> None:
    response = api.client.post("/v1/jobs", json={"kind": "mine-bitcoin"}, headers=api.admin)
    message = assert_error(response, 422, "unknown_kind")
    assert "mine-bitcoin" in message and "sleep" in message


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"tasks": 0}, "tasks"),
        ({"tasks": "many"}, "tasks"),
        ({"seconds": -1}, "seconds"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_params_are_422(api: Api, params: dict[str, object], fragment: str) -> None:
    response = api.client.post(
        "/v1/jobs", json={"kind": "sleep", "params": params}, headers=api.admin
    )
    assert fragment in assert_error(response, 422, "invalid_params")


def test_embed_text_job_is_split_into_shards(api: Api) -> None:
    texts = [f"text number {i}" for i in range(5)]
    blob = api.upload(texts_to_jsonl(texts))
    job = api.submit(
        api.admin_token, kind="embed-text", inputs={"texts": blob}, params={"shard_size": 2}
    )
    assert (job["shards_total"], job["items_total"]) == (3, 5)
    assert job["inputs"] == {"texts": blob}
    assert [s["items"] for s in api.job(api.admin_token, job["id"])["shards"]] == [2, 2, 1]


def test_embed_text_broken_line_names_the_line(api: Api) -> None:
    lines = [json.dumps(f"text {i}") for i in range(1, 7)] + ['{"text": broken', '"fine"']
    blob = api.upload(("\n".join(lines) + "\n").encode())
    response = api.client.post(
        "/v1/jobs", json={"kind": "embed-text", "inputs": {"texts": blob}}, headers=api.admin
    )
    message = assert_error(response, 422, "invalid_input")
    assert "line 7" in message
    assert api.client.get("/v1/jobs", headers=api.admin).json() == []


@pytest.mark.parametrize("data", [b"", b"\n  \n\n"], ids=["empty", "blank-lines"])
def test_embed_text_empty_input_is_422(api: Api, data: bytes) -> None:
    blob = api.upload(data)
    response = api.client.post(
        "/v1/jobs", json={"kind": "embed-text", "inputs": {"texts": blob}}, headers=api.admin
    )
    assert "no texts" in assert_error(response, 422, "invalid_input")


def test_unknown_input_blob_is_422(api: Api) -> None:
    missing = sha(b"never uploaded")
    response = api.client.post(
        "/v1/jobs", json={"kind": "embed-text", "inputs": {"texts": missing}}, headers=api.admin
    )
    message = assert_error(response, 422, "invalid_input")
    assert missing in message


@pytest.mark.parametrize(
    "inputs",
    [{}, {"text": "x"}, {"texts": "not-a-hash"}],
    ids=["missing", "misnamed", "bad-hash"],
)
def test_wrong_inputs_are_422(api: Api, inputs: dict[str, str]) -> None:
    if inputs.get("text"):
        inputs = {"text": api.upload(b'"a"\n')}
    response = api.client.post(
        "/v1/jobs", json={"kind": "embed-text", "inputs": inputs}, headers=api.admin
    )
    assert_error(response, 422)


def test_sleep_takes_no_inputs(api: Api) -> None:
    blob = api.upload(b"unused")
    response = api.client.post(
        "/v1/jobs", json={"kind": "sleep", "inputs": {"extra": blob}}, headers=api.admin
    )
    assert "extra" in assert_error(response, 422, "invalid_input")


def test_embed_text_bad_params_are_422(api: Api) -> None:
    blob = api.upload(b'"a"\n')
    response = api.client.post(
        "/v1/jobs",
        json={"kind": "embed-text", "inputs": {"texts": blob}, "params": {"shard_size": 0}},
        headers=api.admin,
    )
    assert "shard_size" in assert_error(response, 422, "invalid_params")


def test_nodes_listing_starts_empty(api: Api) -> None:
    assert api.client.get("/v1/nodes", headers=api.admin).json() == []


def test_the_admin_account_is_made_once(settings: CoordinatorSettings) -> None:
    with TestClient(create_app(settings)) as first_run:
        first = settings.admin_token_file.read_text().strip()
        assert first_run.get("/v1/me", headers=bearer(first)).status_code == 200
    with TestClient(create_app(settings)) as second_run:
        # The restart kept the account and did not write a new token.
        assert settings.admin_token_file.read_text().strip() == first
        assert second_run.get("/v1/me", headers=bearer(first)).json()["admin"] is True
