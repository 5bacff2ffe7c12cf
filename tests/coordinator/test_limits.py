"""Limits per client: node socket frames and deadlines, pending sockets, failed
authentications, /metrics, streamed blob downloads. (Over real sockets, with the
server's own limits: tests/coordinator/test_hostile.py.)"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import Api, bearer, sha
from helpers import NODE_WS, SocketNode
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocketDisconnect

from idlegrid import protocol
from idlegrid.app import create_app
from idlegrid.coordinator.guard import AddressList, AuthFailures, PendingSockets, pending_refusal
from idlegrid.settings import CoordinatorSettings

# -- policy tables --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "from_address", "total_limit", "per_address_limit", "refused_for"),
    [
        (0, 0, 10, 2, None),
        (5, 1, 10, 2, None),
        (5, 2, 10, 2, "max_pending_sockets_per_address 2"),
        (10, 0, 10, 2, "max_pending_sockets 10"),
        (10, 2, 10, 2, "max_pending_sockets_per_address 2"),
        (1000, 1000, 0, 0, None),  # 0: no cap
    ],
)
def test_pending_socket_refusals(
    total: int, from_address: int, total_limit: int, per_address_limit: int, refused_for: str | None
) -> None:
    reason = pending_refusal(
        total=total,
        from_address=from_address,
        total_limit=total_limit,
        per_address_limit=per_address_limit,
    )
    if refused_for is None:
        assert reason is None
    else:
        assert reason is not None and refused_for in reason


def test_pending_sockets_are_counted_in_and_out() -> None:
    pending = PendingSockets(total_limit=3, per_address_limit=2)
    assert pending.admit("a") is None and pending.admit("a") is None
    assert pending.admit("a") is not None  # a third from one address
    assert pending.admit("b") is None
    assert pending.admit("c") is not None  # three in all
    pending.release("a")
    assert pending.admit("c") is None
    assert pending.total == 3


def test_auth_failures_slide_out_of_their_window() -> None:
    now = [100.0]
    failures = AuthFailures(limit=3, window_s=60.0, clock=lambda: now[0])
    for _ in range(3):
        assert failures.retry_after_s("x") == 0
        failures.failed("x")
        now[0] += 10
    assert failures.retry_after_s("x") == pytest.approx(30.0)  # the first leaves at 160
    assert failures.retry_after_s("y") == 0  # per address
    now[0] = 160.0
    assert failures.retry_after_s("x") == 0
    assert AuthFailures(limit=0, window_s=60).retry_after_s("x") == 0  # 0: no limit


@pytest.mark.parametrize(
    ("address", "allowed"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("10.1.2.3", True),
        ("11.0.0.1", False),
        ("testclient", False),
        (None, False),
    ],
)
def test_metrics_allow_list(address: str | None, allowed: bool) -> None:
    assert (address in AddressList(["127.0.0.1", "::1", "10.0.0.0/8"])) is allowed


# -- node socket ----------------------------------------------------------------------------


@pytest.fixture
def limited(settings: CoordinatorSettings) -> Iterator[Any]:
    """`limited(**settings)`: an Api on a coordinator with these settings changed."""
    with contextlib.ExitStack() as stack:

        def open_api(**overrides: Any) -> Api:
            changed = dataclasses.replace(settings, **overrides)
            client = stack.enter_context(TestClient(create_app(changed)))
            token = changed.admin_token_file.read_text().strip()
            return Api(client=client, settings=changed, admin_token=token)

        yield open_api


def _node(api: Api, stack: contextlib.ExitStack, token: str = "") -> SocketNode:
    ws = stack.enter_context(api.client.websocket_connect(NODE_WS))
    return SocketNode(api, ws, token or api.token(account="volunteer", kind="node"))


def _closed_with(node: SocketNode) -> int:
    with pytest.raises(WebSocketDisconnect) as closed:
        for _ in range(10):
            node.recv()
    return closed.value.code


def test_a_frame_over_the_hello_limit_before_hello_closes_the_socket(limited: Any) -> None:
    api = limited(hello_max_bytes=4096)
    with contextlib.ExitStack() as stack:
        node = _node(api, stack)
        node.ws.send_text(" " * 4000)  # under the limit: answered, the socket stays
        node.expect_error("malformed")
        node.ws.send_text(json.dumps({"type": "ready", "free_slots": 1, "pad": "x" * 5000}))
        assert "4096-byte limit" in node.expect_error("malformed")
        assert _closed_with(node) == 1009


def test_after_hello_frames_may_be_as_large_as_the_frame_limit(limited: Any) -> None:
    api = limited(hello_max_bytes=4096, max_frame_bytes=64 * 1024)
    with contextlib.ExitStack() as stack:
        node = _node(api, stack)
        node.join()
        padded = json.dumps({"type": "heartbeat", "seq": 7}) + " " * 30_000
        node.ws.send_text(padded)
        node.expect("heartbeat_ack", seq=7)
        node.ws.send_bytes(b" " * (64 * 1024 + 1))
        assert "65536-byte limit" in node.expect_error("malformed")
        assert _closed_with(node) == 1009


def test_a_newer_minors_unknown_fields_count_against_the_frame_limits(limited: Any) -> None:
    """Ignored fields are no way around the limits: a frame over them ends the socket."""
    api = limited(hello_max_bytes=4096, max_frame_bytes=16 * 1024)
    newer = protocol.PROTOCOL_MINOR + 1
    with contextlib.ExitStack() as stack:
        node = _node(api, stack)
        hello = {"type": "hello", "minor": newer, "token": node.token, "node_key": "node-key-1",
                 "worker_version": "9", "hardware": {}, "benchmark": {}, "slots": 1,
                 "kinds": ["sleep"]}  # fmt: skip
        node.ws.send_text(json.dumps({**hello, "pad": "x" * 5000}))
        assert "4096-byte limit" in node.expect_error("malformed")
        assert _closed_with(node) == 1009
        node = _node(api, stack)
        node.ws.send_text(json.dumps({**hello, "pad": "x" * 3000}))  # under it: ignored
        node.expect("welcome")
        node.ws.send_text(json.dumps({"type": "heartbeat", "seq": 2, "pad": "x" * 10_000}))
        node.expect("heartbeat_ack", seq=2)
        node.ws.send_text(json.dumps({"type": "heartbeat", "seq": 3, "pad": "x" * 17_000}))
        assert "16384-byte limit" in node.expect_error("malformed")
        assert _closed_with(node) == 1009


def test_the_hello_deadline_counts_from_the_opening(limited: Any) -> None:
    api = limited(hello_timeout_s=1.0)
    with contextlib.ExitStack() as stack:
        node = _node(api, stack)
        started = time.monotonic()
        errors = []
        with pytest.raises(WebSocketDisconnect) as closed:
            while time.monotonic() - started < 5:
                node.ws.send_text("{}")  # each frame would have restarted a per-frame timer
                errors.append(node.recv()["message"])
                time.sleep(0.2)  # pacing: frames keep coming while the deadline runs
        assert closed.value.code == 1008
        assert time.monotonic() - started < 3
        assert "no hello within 1 s of connecting" in errors[-1]


def test_pending_sockets_are_capped_per_address(limited: Any) -> None:
    api = limited(max_pending_sockets_per_address=2)
    with contextlib.ExitStack() as stack:
        first, _second = _node(api, stack), _node(api, stack)
        with pytest.raises(WebSocketDenialResponse) as denied:
            _node(api, stack)
        assert denied.value.status_code == 429
        assert "max_pending_sockets_per_address 2" in denied.value.json()["message"]
        first.join()  # past its hello, it no longer counts
        _node(api, stack).join(key="node-key-2")


def test_unknown_tokens_are_rate_limited_per_address(limited: Any) -> None:
    api = limited(auth_failures_per_address=3, auth_failure_window_s=600)
    assert api.client.get("/v1/me", headers=api.admin).status_code == 200
    for _ in range(2):
        assert api.client.get("/v1/me", headers=bearer("igr_guess")).status_code == 401
    with contextlib.ExitStack() as stack:  # a hello with an unknown token counts too
        node = _node(api, stack, token="ign_guess")
        node.hello()
        node.expect_error("unauthorized")
    response = api.client.get("/v1/me", headers=bearer("igr_guess"))
    assert response.status_code == 429
    assert response.json()["error"] == "rate_limited"
    assert "auth_failures_per_address 3" in response.json()["message"]
    assert 590 <= int(response.headers["retry-after"]) <= 600
    with contextlib.ExitStack() as stack:  # a node's unknown token: refused at its hello
        node = _node(api, stack, token="ign_guess")
        node.hello()
        assert "auth_failures_per_address 3" in node.expect_error("unauthorized")
    # A token that exists is let in from the same address all the while.
    assert api.client.get("/v1/me", headers=api.admin).status_code == 200
    with contextlib.ExitStack() as stack:
        _node(api, stack).join()


def test_metrics_need_an_admin_token_or_an_allowed_address(api: Api) -> None:
    assert api.client.get("/metrics").status_code == 401
    researcher = api.token(account="alice")
    assert api.client.get("/metrics", headers=bearer(researcher)).status_code == 403
    assert api.client.get("/metrics", headers=api.admin).status_code == 200


# -- blob downloads -------------------------------------------------------------------------


def test_blob_downloads_stream_from_disk_with_ranges(api: Api) -> None:
    data = bytes(range(256)) * 16
    blob_hash = api.upload(data)
    response = api.client.get(f"/v1/blobs/{blob_hash}", headers=api.admin)
    assert response.status_code == 200 and sha(response.content) == blob_hash
    assert response.headers["content-length"] == str(len(data))
    assert response.headers["accept-ranges"] == "bytes"
    ranged = api.client.get(
        f"/v1/blobs/{blob_hash}", headers={**api.admin, "Range": "bytes=1000-1999"}
    )
    assert ranged.status_code == 206 and ranged.content == data[1000:2000]


# -- quotas ---------------------------------------------------------------------------------


def _quota_error(response: Any, status: int, setting: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"] == "quota_exceeded"
    assert setting in response.json()["message"]


def test_tokens_per_account_are_capped(limited: Any) -> None:
    api = limited(quota_tokens=2)
    alice = api.token(account="alice")
    api.token(account="alice", kind="node")
    _quota_error(
        api.client.post("/v1/tokens", json={}, headers=bearer(alice)), 429, "quota_tokens 2"
    )
    made_by_admin = api.client.post("/v1/tokens", json={"account": "alice"}, headers=api.admin)
    _quota_error(made_by_admin, 429, "quota_tokens 2")
    token_id = api.client.get("/v1/tokens", headers=bearer(alice)).json()[1]["id"]
    api.client.delete(f"/v1/tokens/{token_id}", headers=bearer(alice))
    assert api.client.post("/v1/tokens", json={}, headers=bearer(alice)).status_code == 201
    for _ in range(3):  # admins have no quotas
        assert api.client.post("/v1/tokens", json={}, headers=api.admin).status_code == 201


def test_open_jobs_per_account_are_capped(limited: Any) -> None:
    api = limited(quota_open_jobs=1)
    alice = api.token(account="alice")
    body = {"kind": "sleep", "params": {"tasks": 1, "seconds": 0}}
    first = api.submit(alice, **body)
    _quota_error(
        api.client.post("/v1/jobs", json=body, headers=bearer(alice)), 429, "quota_open_jobs 1"
    )
    api.client.post(f"/v1/jobs/{first['id']}/cancel", headers=bearer(alice))
    api.submit(alice, **body)
    api.submit(api.admin_token, **body)
    api.submit(api.admin_token, **body)


def test_shards_per_job_are_capped_before_any_is_stored(limited: Any) -> None:
    api = limited(quota_shards_per_job=5)
    alice = api.token(account="alice")
    blob_dir = api.settings.blob_dir
    stored_before = sum(1 for p in blob_dir.rglob("*") if p.is_file())
    body = {"kind": "sleep", "params": {"tasks": 6, "seconds": 0}}
    response = api.client.post("/v1/jobs", json=body, headers=bearer(alice))
    _quota_error(response, 413, "quota_shards_per_job 5")
    assert sum(1 for p in blob_dir.rglob("*") if p.is_file()) == stored_before
    assert api.submit(alice, kind="sleep", params={"tasks": 5, "seconds": 0})["shards_total"] == 5
    assert api.submit(api.admin_token, **body)["shards_total"] == 6


def _put(api: Api, token: str, data: bytes, *, stream: bool = False) -> Any:
    content: Any = iter([data[:10], data[10:]]) if stream else data  # a stream: no length
    return api.client.put(f"/v1/blobs/{sha(data)}", content=content, headers=bearer(token))


def test_blobs_per_account_are_capped_in_count(limited: Any) -> None:
    api = limited(quota_blobs=2)
    alice = api.token(account="alice")
    for i in range(2):
        assert _put(api, alice, b"blob %d" % i).status_code == 201
    assert _put(api, alice, b"blob 0").status_code == 201  # one it has: no new blob
    _quota_error(_put(api, alice, b"blob 2"), 429, "quota_blobs 2")
    assert _put(api, api.admin_token, b"blob 2").status_code == 201  # admins: no quota
    assert _put(api, api.token(account="bob"), b"blob 3").status_code == 201  # per account


def test_blobs_per_account_are_capped_in_bytes(limited: Any) -> None:
    api = limited(quota_blob_bytes=300)
    alice = api.token(account="alice")
    assert _put(api, alice, b"a" * 200).status_code == 201
    _quota_error(_put(api, alice, b"b" * 200), 413, "quota_blob_bytes 300")
    _quota_error(_put(api, alice, b"c" * 200, stream=True), 413, "quota_blob_bytes 300")
    assert api.client.head(f"/v1/blobs/{sha(b'c' * 200)}", headers=api.admin).status_code == 404
    assert _put(api, alice, b"d" * 100, stream=True).status_code == 201
