"""Blobs in chunks (/v1/uploads): past max_blob_bytes, up to the account's quota,
resumed where they broke off, and stored only once they hash to the blob named."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import MAX_BLOB_BYTES, MAX_REQUEST_BYTES, Api, assert_error, bearer, sha
from fastapi.testclient import TestClient

from idlegrid import client as sdk
from idlegrid.app import create_app
from idlegrid.client import Client, IdlegridError, Unreachable
from idlegrid.settings import CoordinatorSettings

MODEL = os.urandom(3 * MAX_BLOB_BYTES + 123)  # over the one-request limit: chunks only


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


def _start(api: Api, token: str, data: bytes, **extra: Any) -> httpx.Response:
    body = {"hash": sha(data), "size": len(data), "name": "model.safetensors", **extra}
    return api.client.post("/v1/uploads", json=body, headers=bearer(token))


def _chunk(api: Api, token: str, upload_id: int, data: bytes, offset: int, size: int) -> Any:
    return api.client.put(
        f"/v1/uploads/{upload_id}",
        params={"offset": offset},
        content=data[offset : offset + size],
        headers=bearer(token),
    )


def _send_all(api: Api, token: str, state: dict[str, Any], data: bytes) -> dict[str, Any]:
    while not state["done"]:
        response = _chunk(api, token, state["id"], data, state["received"], state["chunk_size"])
        assert response.status_code == 200, response.text
        state = response.json()
    return state


def test_a_blob_over_the_one_request_limit_is_refused_whole_and_stored_in_chunks(
    api: Api,
) -> None:
    alice = api.token(account="alice")
    whole = api.client.put(f"/v1/blobs/{sha(MODEL)}", content=MODEL, headers=bearer(alice))
    message = assert_error(whole, 413, "too_large")
    assert "max_blob_bytes 4096" in message and "POST /v1/uploads" in message
    assert f"IDLEGRID_MAX_BLOB_BYTES={len(MODEL)}" in message  # the value that lets it in
    started = _start(api, alice, MODEL)
    assert started.status_code == 201, started.text
    state = started.json()
    assert state["received"] == 0 and state["chunk_size"] == MAX_REQUEST_BYTES
    done = _send_all(api, alice, state, MODEL)
    assert done == {**done, "done": True, "id": None, "received": len(MODEL)}
    stored = api.client.get(f"/v1/blobs/{sha(MODEL)}", headers=bearer(alice))
    assert stored.status_code == 200 and stored.content == MODEL
    again = _start(api, alice, MODEL)  # the account has it: nothing to send
    assert again.status_code == 200 and again.json()["done"] is True
    assert api.client.get(f"/v1/uploads/{state['id']}", headers=bearer(alice)).status_code == 404


def test_an_interrupted_upload_goes_on_from_the_bytes_it_has(api: Api) -> None:
    alice = api.token(account="alice")
    state = _start(api, alice, MODEL).json()
    for offset in (0, MAX_REQUEST_BYTES):
        assert _chunk(api, alice, state["id"], MODEL, offset, MAX_REQUEST_BYTES).status_code == 200
    resumed = _start(api, alice, MODEL)  # a new run of the client, knowing only the file
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["id"] == state["id"]
    assert resumed.json()["received"] == 2 * MAX_REQUEST_BYTES
    assert _send_all(api, alice, resumed.json(), MODEL)["done"]
    assert api.client.get(f"/v1/blobs/{sha(MODEL)}", headers=bearer(alice)).content == MODEL


def test_a_chunk_at_the_wrong_offset_says_where_to_go_on_from(api: Api) -> None:
    alice = api.token(account="alice")
    state = _start(api, alice, MODEL).json()
    _chunk(api, alice, state["id"], MODEL, 0, 100)
    for offset in (0, 300):  # sent twice, or skipping ahead
        message = assert_error(
            _chunk(api, alice, state["id"], MODEL, offset, 50), 409, "wrong_offset"
        )
        assert f"offset: {offset}" in message and "at offset 100" in message
    too_big = _chunk(api, alice, state["id"], MODEL, 100, MAX_REQUEST_BYTES + 1)
    message = assert_error(too_big, 413, "too_large")
    assert f"chunks of at most {MAX_REQUEST_BYTES} bytes" in message
    small = os.urandom(1000)
    short = _start(api, alice, small).json()
    past = _chunk(api, alice, short["id"], small + b"tail", 0, 1004)
    message = assert_error(past, 422, "invalid_upload")
    assert "past the blob's size 1000: send at most 1000 bytes" in message
    # An empty chunk adds nothing: it is answered with where the upload stands.
    empty = _chunk(api, alice, state["id"], b"", 100, 0)
    assert empty.status_code == 200 and empty.json()["received"] == 100, empty.text
    assert (
        api.client.get(f"/v1/uploads/{state['id']}", headers=bearer(alice)).json()["received"]
        == 100
    )


def test_bytes_that_do_not_hash_to_the_named_blob_are_never_stored(api: Api) -> None:
    alice = api.token(account="alice")
    claimed = sha(b"something else")
    state = _start(api, alice, MODEL, hash=claimed).json()
    last: Any = None
    while True:
        offset = state["received"]
        last = _chunk(api, alice, state["id"], MODEL, offset, state["chunk_size"])
        if last.status_code != 200:
            break
        state = last.json()
    message = assert_error(last, 422, "invalid_upload")
    assert sha(MODEL) in message and claimed in message and "POST /v1/uploads" in message
    for blob in (claimed, sha(MODEL)):
        assert api.client.head(f"/v1/blobs/{blob}", headers=api.admin).status_code == 404
    assert api.client.get(f"/v1/uploads/{state['id']}", headers=bearer(alice)).status_code == 404
    assert not list((api.settings.blob_dir / "tmp").iterdir())  # no partial file left


def test_a_full_disk_at_the_last_chunk_is_the_coordinators_507_and_leaves_nothing(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    alice = api.token(account="alice")
    grid = api.client.app.state.grid  # type: ignore[attr-defined]

    def full_disk(path: Any, **kwargs: Any) -> str:
        path.unlink()  # as put_file leaves it: gone whatever happens
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(grid.blobs, "put_file", full_disk)
    state = _start(api, alice, MODEL).json()
    while state["received"] + state["chunk_size"] < len(MODEL):
        state = _chunk(api, alice, state["id"], MODEL, state["received"], state["chunk_size"])
        state = state.json()
    last = _chunk(api, alice, state["id"], MODEL, state["received"], state["chunk_size"])
    message = assert_error(last, 507, "insufficient_storage")
    assert "No space left on device" in message and "POST /v1/uploads" in message
    assert api.client.get(f"/v1/uploads/{state['id']}", headers=bearer(alice)).status_code == 404
    assert not list((api.settings.blob_dir / "tmp").iterdir())


def test_the_account_quota_bounds_chunked_uploads_with_those_still_arriving(
    limited: Any,
) -> None:
    api = limited(quota_blob_bytes=len(MODEL) + 1000)
    alice = api.token(account="alice")
    assert _start(api, alice, MODEL).status_code == 201  # still arriving: it counts
    other = os.urandom(2000)
    message = assert_error(_start(api, alice, other), 413, "quota_exceeded")
    needed = len(MODEL) + len(other)
    assert f"quota_blob_bytes {len(MODEL) + 1000}" in message
    assert f"IDLEGRID_QUOTA_BLOB_BYTES={needed}" in message
    assert _start(api, api.admin_token, other).status_code == 201  # admins: no quota
    assert _start(api, api.token(account="bob"), other).status_code == 201  # per account


def test_uploads_are_the_uploaders_and_researchers_only(api: Api) -> None:
    alice, bob = api.token(account="alice"), api.token(account="bob")
    state = _start(api, alice, MODEL).json()
    assert_error(_chunk(api, bob, state["id"], MODEL, 0, 100), 404, "not_found")
    assert_error(api.client.get(f"/v1/uploads/{state['id']}", headers=bearer(bob)), 404)
    assert_error(api.client.delete(f"/v1/uploads/{state['id']}", headers=bearer(bob)), 404)
    node = api.token(account="volunteer", kind="node")
    assert_error(_start(api, node, MODEL), 403, "forbidden")
    bad = api.client.post("/v1/uploads", json={"hash": "abc", "size": 0}, headers=bearer(alice))
    message = assert_error(bad, 422, "invalid_request")
    assert "hash" in message and "size" in message


def test_a_given_up_upload_goes_with_its_bytes(api: Api) -> None:
    alice = api.token(account="alice")
    state = _start(api, alice, MODEL).json()
    _chunk(api, alice, state["id"], MODEL, 0, 100)
    assert api.client.delete(f"/v1/uploads/{state['id']}", headers=bearer(alice)).status_code == 204
    assert not list((api.settings.blob_dir / "tmp").iterdir())
    assert _start(api, alice, MODEL).json()["received"] == 0  # a new one, from the start


def test_an_upload_unfinished_for_too_long_is_swept(limited: Any) -> None:
    api = limited(blob_upload_resume_s=0.0)
    alice = api.token(account="alice")
    first = _start(api, alice, MODEL).json()
    _chunk(api, alice, first["id"], MODEL, 0, 100)
    other = _start(api, alice, os.urandom(5000)).json()  # the first is past the window
    partial_files = list((api.settings.blob_dir / "tmp").iterdir())
    assert [path.name for path in partial_files] == [f"upload-{other['id']}"]
    assert partial_files[0].stat().st_size == 0  # the first one's 100 bytes went with it
    assert _start(api, alice, MODEL).json()["received"] == 0  # from the start again


# -- the SDK -------------------------------------------------------------------------------


class FlakyTransport(httpx.BaseTransport):
    """Requests to the app through its TestClient; the chosen chunk PUTs lose their
    connection before they reach it."""

    def __init__(self, app: TestClient, drop: set[int]) -> None:
        self.app, self.drop, self.puts, self.sent = app, drop, 0, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        if request.method == "PUT" and request.url.path.startswith("/v1/uploads/"):
            self.puts += 1
            if self.puts in self.drop:
                raise httpx.ConnectError("connection reset", request=request)
            self.sent += len(body)
        answer = self.app.request(
            request.method,
            str(request.url.copy_with(scheme="http", host="testserver")),
            headers=dict(request.headers),
            content=body,
        )
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)


@pytest.fixture(autouse=True)
def small_chunked_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK's threshold in this coordinator's proportions (test limits are KB, not MB);
    a failed chunk is sent again at once."""
    shipped = CoordinatorSettings().max_blob_bytes
    assert shipped >= sdk.CHUNKED_ABOVE  # a default client sends only what fits whole
    monkeypatch.setattr(sdk, "CHUNKED_ABOVE", MAX_BLOB_BYTES)
    monkeypatch.setattr(sdk.time, "sleep", lambda seconds: None)


def _sdk(api: Api, token: str, drop: set[int], **kwargs: Any) -> tuple[Client, FlakyTransport]:
    transport = FlakyTransport(api.client, drop)
    client = Client(str(api.client.base_url), token, transport=transport, **kwargs)
    return client, transport


def test_the_sdk_sends_a_large_blob_in_chunks_and_retries_a_dropped_one(api: Api) -> None:
    seen: list[tuple[str, int, int]] = []
    alice = api.token(account="alice")
    client, transport = _sdk(api, alice, {3}, upload_progress=lambda *a: seen.append(a))
    assert client.upload(MODEL, name="model") == sha(MODEL)
    assert transport.sent == len(MODEL)  # the dropped chunk again, nothing more
    assert seen[0] == ("model", 0, len(MODEL)) and seen[-1] == ("model", len(MODEL), len(MODEL))
    assert [sent for _, sent, _ in seen] == sorted(sent for _, sent, _ in seen)
    assert api.client.get(f"/v1/blobs/{sha(MODEL)}", headers=api.admin).content == MODEL


def test_an_sdk_upload_cut_off_for_good_goes_on_in_the_next_run(api: Api) -> None:
    alice = api.token(account="alice")
    gone, _ = _sdk(api, alice, set(range(3, 100)))  # the network goes after two chunks
    with pytest.raises(Unreachable):
        gone.upload(MODEL)
    again, transport = _sdk(api, alice, set())
    assert again.upload(MODEL) == sha(MODEL)
    assert transport.sent == len(MODEL) - 2 * MAX_REQUEST_BYTES  # from where it broke off
    assert api.client.get(f"/v1/blobs/{sha(MODEL)}", headers=api.admin).content == MODEL


def test_the_sdk_sends_a_small_blob_whole_and_a_refused_one_not_at_all(limited: Any) -> None:
    api = limited(quota_blob_bytes=len(MODEL) - 1)
    client, transport = _sdk(api, api.token(account="alice"), set())
    small = b"a few texts"
    assert client.upload(small) == sha(small) and transport.puts == 0  # one PUT /v1/blobs
    with pytest.raises(IdlegridError) as refused:
        client.upload(MODEL)
    assert refused.value.status == 413
    assert f"IDLEGRID_QUOTA_BLOB_BYTES={len(MODEL) + len(small)}" in refused.value.message
    assert transport.puts == 0  # refused before any chunk
