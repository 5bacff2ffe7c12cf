"""The web dashboard under TestClient: accounts, CSRF, access rules, escaping, pages."""

from __future__ import annotations

import functools
import gzip
import re
from pathlib import Path
from typing import Any

import pytest
from conftest import Api, bearer, off_loop
from fastapi.testclient import TestClient
from helpers import NODE_WS as WS
from helpers import SocketNode as Node

from idlegrid.app import create_app
from idlegrid.dashboard import exports
from idlegrid.dashboard.accounts import FAILED, set_login
from idlegrid.kinds.sleep import _digest
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import stats

PASSWORD = "a long enough passphrase"
XSS = "<script>alert(1)</script>"


class Browser:
    """A TestClient used as a person would: read forms, post them with their CSRF token.

    Several browsers share one client (and so one running app), each with its own cookies.
    """

    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.cookies_type = type(client.cookies)
        self.jar = self.cookies_type()

    def request(self, method: str, path: str, **kwargs: Any) -> Any:
        self.client.cookies = self.jar
        try:
            return self.client.request(method, path, **kwargs)
        finally:
            self.jar = self.cookies_type(self.client.cookies)
            self.client.cookies = self.cookies_type()

    def get(self, path: str, **kwargs: Any) -> Any:
        return self.request("GET", path, **kwargs)

    def raw_post(self, path: str, **kwargs: Any) -> Any:
        return self.request("POST", path, **kwargs)

    def put(self, path: str, **kwargs: Any) -> Any:
        return self.request("PUT", path, **kwargs)

    def csrf(self, path: str) -> str:
        page = self.get(path)
        assert page.status_code == 200, page.text
        found = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert found, f"no CSRF field on {path}"
        return found.group(1)

    def post(self, path: str, data: dict[str, Any], *, form: str | None = None) -> Any:
        token = self.csrf(form or path)
        return self.raw_post(path, data={"csrf": token, **data}, follow_redirects=False)

    def sign_up(self, name: str, email: str | None = None, password: str = PASSWORD) -> Any:
        email = email or f"{abs(hash(name)) % 10**8}@example.org"
        return self.post("/signup", {"username": name, "email": email, "password": password})

    def sign_in(self, login: str, password: str = PASSWORD) -> Any:
        return self.post("/signin", {"login": login, "password": password})

    def sign_out(self) -> Any:
        return self.post("/signout", {}, form="/account")


@pytest.fixture
def browser(api: Api) -> Browser:
    return Browser(api.client)


def _researcher(api: Api, name: str) -> Browser:
    """A second browser signed in as a researcher made by the operator's command."""
    off_loop(_set_login(api, name, "researcher"))
    other = Browser(api.client)
    assert other.sign_in(name).status_code == 303
    return other


async def _set_login(api: Api, name: str, role: str) -> None:
    from idlegrid.store import open_store

    store = open_store(api.settings.database)
    try:
        await store.open()
        await set_login(store, name, email=None, password=PASSWORD, role=role)  # type: ignore[arg-type]
    finally:
        await store.close()


# -- accounts ----------------------------------------------------------------------------


def test_sign_up_sign_in_and_out(browser: Browser) -> None:
    made = browser.sign_up("alice", "alice@example.org")
    assert made.status_code == 303 and made.headers["location"] == "/my/nodes"
    cookie = made.headers["set-cookie"]
    assert "ig_session=" in cookie and "HttpOnly" in cookie and "SameSite=lax" in cookie
    page = browser.get("/my/nodes")
    assert page.status_code == 200 and "alice" in page.text and "No nodes yet" in page.text

    assert browser.sign_out().status_code == 303
    assert browser.get("/my/nodes", follow_redirects=False).status_code == 303
    # By email too, in any case of the username.
    assert browser.sign_in("ALICE@example.org").status_code == 303
    assert browser.get("/account").status_code == 200


def test_wrong_password_and_unknown_user_read_the_same(browser: Browser) -> None:
    browser.sign_up("bob")
    browser.sign_out()
    wrong = browser.sign_in("bob", "not the password at all")
    unknown = browser.sign_in("nobody-here", "not the password at all")
    assert wrong.status_code == unknown.status_code == 401
    assert FAILED.replace("(", "") in wrong.text.replace("(", "")
    assert _message(wrong.text) == _message(unknown.text)


def _message(page: str) -> str:
    found = re.search(r'<p class="error" role="alert">(.*?)</p>', page)
    assert found, page
    return found.group(1)


def test_failed_sign_ins_are_rate_limited_per_account(tmp_path: Path) -> None:
    settings = CoordinatorSettings(
        data_dir=tmp_path, monitor_interval_s=3600.0, web_signin_failures_per_account=3
    )
    with TestClient(create_app(settings)) as client:
        browser = Browser(client)
        browser.sign_up("carol")
        browser.sign_out()
        for _ in range(3):
            assert browser.sign_in("carol", "wrong password!!").status_code == 401
        # From this address even the right password now waits, and so does an unknown
        # name's fourth try.
        limited = browser.sign_in("carol")
        assert limited.status_code == 429 and "Too many failed sign-ins" in limited.text
        for _ in range(3):
            browser.sign_in("ghost", "wrong password!!")
        assert browser.sign_in("ghost", "wrong password!!").status_code == 429
        # The owner, at another address, is not locked out by a stranger's failures.
        owner = Browser(TestClient(client.app, client=("10.9.8.7", 5000)))
        assert owner.sign_in("carol").status_code == 303


def test_failed_sign_ins_are_rate_limited_per_address(tmp_path: Path) -> None:
    """One address trying many names is stopped, whichever names exist; another address
    is not."""
    settings = CoordinatorSettings(
        data_dir=tmp_path,
        monitor_interval_s=3600.0,
        web_signin_failures_per_account=100,
        web_signin_failures_per_address=4,
    )
    with TestClient(create_app(settings)) as client:
        browser = Browser(client)
        browser.sign_up("dora")
        browser.sign_out()
        for name in ("ann", "bob", "cid", "dora"):
            assert browser.sign_in(name, "wrong password!!").status_code == 401
        limited = browser.sign_in("dora")
        assert limited.status_code == 429 and "Too many failed sign-ins" in limited.text
        # The same name from another address still signs in.
        elsewhere = Browser(TestClient(client.app, client=("10.1.2.3", 5000)))
        assert elsewhere.sign_in("dora").status_code == 303


def test_bad_sign_ups_are_explained(browser: Browser) -> None:
    browser.sign_up("dave", "dave@example.org")
    browser.sign_out()
    taken = browser.sign_up("Dave", "other@example.org")
    assert taken.status_code == 422 and "username is taken" in taken.text
    email = browser.sign_up("dave2", "dave@example.org")
    assert email.status_code == 422 and "email address is taken" in email.text
    weak = browser.sign_up("erin", "erin@example.org", password="short")
    assert weak.status_code == 422 and "at least 10 characters" in weak.text
    bad = browser.sign_up("frank", "not-an-email")
    assert bad.status_code == 422 and "email address like" in bad.text
    # What was typed stays in the form.
    assert 'value="frank"' in bad.text


def test_password_change_needs_the_current_one(browser: Browser) -> None:
    browser.sign_up("gina")
    wrong = browser.post(
        "/account/password", {"current": "nope nope nope", "new": "x" * 12}, form="/account"
    )
    assert wrong.status_code == 422 and "current password" in wrong.text
    done = browser.post(
        "/account/password", {"current": PASSWORD, "new": "another passphrase"}, form="/account"
    )
    assert done.status_code == 303
    browser.sign_out()
    assert browser.sign_in("gina").status_code == 401
    assert browser.sign_in("gina", "another passphrase").status_code == 303


# -- the rules ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    ["/signout", "/account/password", "/account/tokens", "/my/nodes/add", "/teams/new"],
)
def test_a_post_without_csrf_token_is_403(browser: Browser, path: str) -> None:
    browser.sign_up("henry")
    response = browser.raw_post(path, data={"name": "x"}, follow_redirects=False)
    assert response.status_code == 403 and "Form expired" in response.text
    forged = browser.raw_post(path, data={"csrf": "forged", "name": "x"})
    assert forged.status_code == 403


def test_sign_up_without_csrf_token_is_403(browser: Browser) -> None:
    data = {"username": "ivan", "email": "ivan@example.org", "password": PASSWORD}
    assert browser.raw_post("/signup", data=data).status_code == 403


@pytest.mark.parametrize(
    "path", ["/my/nodes", "/my/nodes/add", "/account", "/research/jobs", "/teams/new", "/admin"]
)
def test_pages_behind_sign_in_redirect_to_it(browser: Browser, path: str) -> None:
    response = browser.get(path, follow_redirects=False)
    assert response.status_code == 303
    assert response.headers["location"].startswith("/signin?next=")
    signin = browser.get(response.headers["location"])
    assert signin.status_code == 200 and f'name="next" value="{path}"' in signin.text


def test_a_volunteer_gets_no_researcher_or_admin_page(browser: Browser) -> None:
    browser.sign_up("judy")
    for path in ("/research/jobs", "/research/files", "/research/jobs/new"):
        response = browser.get(path)
        assert response.status_code == 403 and "researcher" in response.text
    assert browser.get("/admin").status_code == 404
    api_token = browser.post("/account/tokens", {"kind": "api"}, form="/account")
    assert api_token.status_code == 403


def test_another_accounts_job_is_404(api: Api) -> None:
    alice = _researcher(api, "alice-r")
    bob = _researcher(api, "bob-r")
    job = api.submit(api.token(account="alice-r"), kind="sleep", params={"tasks": 1})
    assert alice.get(f"/research/jobs/{job['id']}").status_code == 200
    for path in ("", "/progress", "/result"):
        assert bob.get(f"/research/jobs/{job['id']}{path}").status_code == 404
    cancel = bob.post(f"/research/jobs/{job['id']}/cancel", {}, form="/research/jobs")
    assert cancel.status_code == 404


def test_a_job_that_ends_reloads_its_page_without_cancel(api: Api) -> None:
    alice = _researcher(api, "alice-end")
    job = api.submit(api.token(account="alice-end"), kind="sleep", params={"tasks": 1})
    page = alice.get(f"/research/jobs/{job['id']}")
    assert "Cancel job" in page.text
    poll = alice.get(f"/research/jobs/{job['id']}/progress", headers={"HX-Request": "true"})
    assert "HX-Refresh" not in poll.headers  # still live: the page stays
    cancelled = alice.post(f"/research/jobs/{job['id']}/cancel", {}, form="/research/jobs")
    assert cancelled.status_code == 303
    poll = alice.get(f"/research/jobs/{job['id']}/progress", headers={"HX-Request": "true"})
    assert poll.headers.get("HX-Refresh") == "true"  # ended: the whole page reloads
    alice.get(f"/research/jobs/{job['id']}")  # the banner's one showing
    page = alice.get(f"/research/jobs/{job['id']}")
    assert "Cancel job" not in page.text and "is cancelled." not in page.text


def test_user_supplied_names_are_escaped(api: Api, browser: Browser) -> None:
    assert browser.sign_up(XSS, "xss@example.org").status_code == 303
    made = browser.post("/teams/new", {"name": XSS, "description": XSS})
    assert made.status_code == 303
    team_page = browser.get(made.headers["location"])
    token = browser.post("/my/nodes/add", {"name": XSS})
    secret = re.search(r'<code id="node-token">([^<]+)</code>', token.text)
    assert secret is not None and "&lt;script&gt;" in token.text
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, secret.group(1))
        node.send(
            type="hello",
            token=node.token,
            node_key="xss-node",
            name=XSS,
            worker_version="0.1.0",
            hardware={"cpu_cores": 2, "memory_mb": 4096, "cpu_model": XSS},
            benchmark={"matmul_gflops": 1.0},
            slots=1,
            kinds=["sleep"],
            running=[],
        )
        node_id = node.expect("welcome")["node_id"]
        pages = [
            team_page,
            browser.get("/my/nodes"),
            browser.get(f"/nodes/{node_id}"),
            browser.get("/teams"),
            browser.get("/account"),
        ]
    for page in pages:
        assert page.status_code == 200
        assert XSS not in page.text, page.url
        assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page.text, page.url
        assert page.headers["content-security-policy"].startswith("default-src 'self'")


@pytest.mark.parametrize(
    "query", ["page=0", "page=100001", "per_page=0", "per_page=101", "page=x", "sort=oldest"]
)
def test_pagination_parameters_are_bounded(browser: Browser, query: str) -> None:
    response = browser.get(f"/leaderboard/accounts?{query}")
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("text/html")
    assert browser.get("/leaderboard/planets").status_code == 422


def test_a_failing_dashboard_query_shows_an_error_page(
    api: Api, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the database went away")

    monkeypatch.setattr(stats, "grid_status", broken)
    # As uvicorn does: the error page is the answer (TestClient would re-raise the error).
    monkeypatch.setattr(api.client._transport, "raise_server_exceptions", False)
    page = api.client.get("/")
    assert page.status_code == 500 and "could not be made" in page.text
    assert api.client.get("/healthz").json()["ok"] is True
    assert api.client.get("/leaderboard/accounts").status_code == 200


# -- volunteers and the public pages -----------------------------------------------------


def test_validated_work_reaches_every_page(api: Api, browser: Browser) -> None:
    browser.sign_up("vera")
    browser.post("/teams/new", {"name": "Team Vera"})
    added = browser.post("/my/nodes/add", {"name": "vera-pc"})
    secret = re.search(r'<code id="node-token">([^<]+)</code>', added.text)
    assert secret is not None and "idlegrid worker --server" in added.text
    researcher = api.token(account="lab")
    job = api.submit(researcher, kind="sleep", params={"tasks": 3})
    with api.client.websocket_connect(WS) as ws:
        node = Node(api, ws, secret.group(1))
        node_id = node.join(key="vera-pc-key", kinds=("sleep",), slots=3)["node_id"]
        mine = browser.get("/my/nodes")
        assert "vera-pc-key" in mine.text and "online" in mine.text
        node.ready(free_slots=3)
        for assign in [node.expect("assign") for _ in range(3)]:
            node.result(assign["task_id"], _digest(assign["shard_index"]))
            node.expect("result_ack", status="accepted")
    assert api.job(researcher, job["id"])["state"] == "completed"

    board = browser.get("/leaderboard/accounts")
    assert "vera" in board.text and "Team Vera" in board.text
    for name in ("teams", "nodes"):
        for sort in ("total", "recent"):
            page = browser.get(f"/leaderboard/{name}?sort={sort}")
            assert ("Team Vera" if name == "teams" else "vera-pc-key") in page.text
    node_page = browser.get(f"/nodes/{node_id}")
    assert "Credit per day" in node_page.text and '"validated": [3]' in node_page.text
    mine = browser.get("/my/nodes")
    assert re.search(r'data-label="Validated" class="num">3</td>', mine.text)
    status = browser.get("/")
    assert re.search(r"Results validated, 24 h</span><span class=\"value\">3<", status.text)
    assert '"validated": [3]' in status.text  # the daily chart's data
    # vera has a node; the admin and the researcher "lab" do not: one volunteer.
    assert "1 volunteers (accounts with a node)" in status.text
    assert re.search(r'<span class="label">[MGTP]FLOPS, last 24 h</span>', status.text)


def test_team_join_and_leave(browser: Browser, api: Api) -> None:
    browser.sign_up("kim")
    team = browser.post("/teams/new", {"name": "Crunchers"}).headers["location"]
    other = Browser(api.client)
    other.sign_up("lee")
    assert other.post(f"{team}/join", {}, form=team).status_code == 303
    member = re.compile(r'/users/\d+">lee</a>')
    assert member.search(other.get(team).text)
    assert other.post("/teams/leave", {}, form=team).status_code == 303
    assert not member.search(other.get(team).text)
    duplicate = other.post("/teams/new", {"name": "crunchers"})
    assert duplicate.status_code == 422 and "exists" in duplicate.text
    assert other.post("/teams/999/join", {}, form=team).status_code == 404


def test_tokens_are_shown_once_and_revoked_on_the_page(api: Api) -> None:
    researcher = _researcher(api, "mia")
    made = researcher.post("/account/tokens", {"kind": "api", "label": "laptop"}, form="/account")
    secret = re.search(r'<code id="new-token">(\S+)</code>', made.text)
    assert secret is not None
    assert api.client.get("/v1/me", headers=bearer(secret.group(1))).status_code == 200
    page = researcher.get("/account")
    assert secret.group(1) not in page.text and secret.group(1)[:10] in page.text
    token_id = re.search(r"/account/tokens/(\d+)/revoke", page.text)
    assert token_id is not None
    revoked = researcher.post(f"/account/tokens/{token_id.group(1)}/revoke", {}, form="/account")
    assert revoked.status_code == 303
    assert api.client.get("/v1/me", headers=bearer(secret.group(1))).status_code == 401


# -- researchers -------------------------------------------------------------------------


def _upload(browser: Browser, data: bytes, *, purpose: str = "texts") -> Any:
    token = browser.csrf("/research/files")
    headers = {"X-CSRF-Token": token}
    started = browser.raw_post(
        "/research/uploads",
        json={"name": "texts.jsonl", "purpose": purpose, "size": len(data)},
        headers=headers,
    )
    if started.status_code != 201:
        return started
    upload_id, chunk = started.json()["id"], started.json()["chunk_size"]
    for offset in range(0, len(data), chunk):
        put = browser.put(
            f"/research/uploads/{upload_id}?offset={offset}",
            content=data[offset : offset + chunk],
            headers=headers,
        )
        assert put.status_code == 200, put.text
    return browser.raw_post(f"/research/uploads/{upload_id}/finish", headers=headers)


def test_chunked_upload_then_an_embed_job_from_it(api: Api) -> None:
    researcher = _researcher(api, "nina")
    texts = b"\n".join(b'"text number %d"' % i for i in range(150))  # over one 2 KiB chunk
    done = _upload(researcher, texts)
    assert done.status_code == 200, done.text
    assert api.client.get(f"/v1/blobs/{done.json()['hash']}", headers=api.admin).content == texts
    files = researcher.get("/research/files")
    assert "texts.jsonl" in files.text
    upload_id = re.search(r"kind=embed-text&amp;file=(\d+)", files.text)
    assert upload_id is not None
    submitted = researcher.post(
        "/research/jobs/new/embed-text",
        {"texts": upload_id.group(1), "shard_size": 50},
        form="/research/jobs/new",
    )
    assert submitted.status_code == 303, submitted.text
    job_page = researcher.get(submitted.headers["location"])
    assert job_page.status_code == 200 and "0 / 3" in job_page.text
    assert 'hx-trigger="every 2s"' in job_page.text


def _file_id(browser: Browser, purpose: str) -> str:
    files = browser.get("/research/files").text
    rows = [row for row in files.split("<tr>") if f"<td>{purpose}</td>" in row]
    found = [re.search(r"kind=onnx-infer&amp;file=(\d+)", row) for row in rows]
    assert found and found[0], files
    return found[0].group(1)  # the newest file first


def test_an_onnx_job_from_the_form_and_its_errors_on_the_page(api: Api) -> None:
    from idlegrid.kinds.onnx.examples import conv_net, images, mlp, zip_images

    researcher = _researcher(api, "oona")
    assert (
        _upload(
            researcher, conv_net(size=16, channels=4, embedding=8), purpose="onnx-model"
        ).status_code
        == 200
    )
    model = _file_id(researcher, "onnx-model")
    assert (
        _upload(researcher, zip_images(images(3, size=16)), purpose="model-inputs").status_code
        == 200
    )
    archive = _file_id(researcher, "model-inputs")
    page = researcher.get("/research/jobs/new?kind=onnx-infer")
    assert 'action="/research/jobs/new/onnx-infer"' in page.text and 'for="crop"' in page.text

    def submit(**fields: Any) -> Any:
        form = {"model": model, "data": archive, "shard_size": 2, **fields}
        return researcher.post(
            "/research/jobs/new/onnx-infer", form, form="/research/jobs/new?kind=onnx-infer"
        )

    no_preprocess = submit()
    assert no_preprocess.status_code == 422 and "preprocess" in no_preprocess.text
    bad_crop = submit(crop="big")
    assert bad_crop.status_code == 422 and "crop &#39;big&#39; is not a size" in bad_crop.text
    bad_mean = submit(crop="16x16", resize="18", mean="0.5, 0.5")
    assert bad_mean.status_code == 422 and "mean needs 1 or 3 values" in bad_mean.text
    assert "<option selected>RGB</option>" in bad_mean.text  # the form keeps what was typed
    done = submit(crop="16", resize="18", mean="0.485 0.456 0.406", std="0.229,0.224,0.225")
    assert done.status_code == 303, done.text
    job_page = researcher.get(done.headers["location"])
    assert (
        job_page.status_code == 200 and "onnx-infer" in job_page.text and "0 / 2" in job_page.text
    )

    # A model whose input does not match the data is refused, named, before any node.
    assert (
        _upload(
            researcher, mlp(features=8, hidden=16, outputs=4, layers=2), purpose="onnx-model"
        ).status_code
        == 200
    )
    wrong = researcher.post(
        "/research/jobs/new/onnx-infer",
        {"model": _file_id(researcher, "onnx-model"), "data": archive, "crop": "16"},
        form="/research/jobs/new?kind=onnx-infer",
    )
    assert wrong.status_code == 422 and "x" in wrong.text and "image" in wrong.text, wrong.text
    not_onnx = researcher.post(
        "/research/jobs/new/onnx-infer",
        {"model": archive, "data": archive, "crop": "16"},
        form="/research/jobs/new?kind=onnx-infer",
    )
    assert not_onnx.status_code == 422 and "ONNX" in not_onnx.text, not_onnx.text


def test_uploads_out_of_order_over_quota_or_abandoned_leave_nothing(tmp_path: Path) -> None:
    settings = CoordinatorSettings(
        data_dir=tmp_path,
        monitor_interval_s=3600.0,
        max_request_bytes=2048,
        max_blob_bytes=8192,
        web_upload_quota_bytes=6000,
    )
    with TestClient(create_app(settings)) as client:
        off_loop(_set_login(Api(client, settings, ""), "olga", "researcher"))
        browser = Browser(client)
        browser.sign_in("olga")
        assert _upload(browser, b"x" * 5000).status_code == 200
        over = _upload(browser, b"y" * 2000)
        assert over.status_code == 413 and "over your limit" in over.json()["message"]
        too_big = _upload(browser, b"z" * 9000)
        assert too_big.status_code == 413
        token = browser.csrf("/research/files")
        started = browser.raw_post(
            "/research/uploads",
            json={"name": "a.bin", "purpose": "weights", "size": 900},
            headers={"X-CSRF-Token": token},
        ).json()
        skipped = browser.put(
            f"/research/uploads/{started['id']}?offset=100",
            content=b"q" * 100,
            headers={"X-CSRF-Token": token},
        )
        assert skipped.status_code == 409
        unfinished = browser.raw_post(
            f"/research/uploads/{started['id']}/finish", headers={"X-CSRF-Token": token}
        )
        assert unfinished.status_code == 409
        assert (settings.blob_dir / "tmp" / f"upload-{started['id']}").exists()
        browser.raw_post(
            f"/research/uploads/{started['id']}/abort", headers={"X-CSRF-Token": token}
        )
        assert list((settings.blob_dir / "tmp").iterdir()) == []
        no_csrf = browser.raw_post(
            "/research/uploads", json={"name": "a", "purpose": "texts", "size": 1}
        )
        assert no_csrf.status_code == 403


# -- admins and exports ------------------------------------------------------------------


def test_admin_grants_researcher_and_disables(api: Api, browser: Browser) -> None:
    off_loop(_set_login(api, "root", "admin"))
    admin = Browser(api.client)
    admin.sign_in("root")
    browser.sign_up("pat")
    page = admin.get("/admin?q=pat")
    account_id = re.search(r"/admin/accounts/(\d+)/role", page.text)
    assert account_id is not None
    path = f"/admin/accounts/{account_id.group(1)}"
    assert admin.post(f"{path}/role", {"role": "researcher"}, form="/admin").status_code == 303
    assert "pat is now a researcher." in admin.get("/admin").text  # named, not numbered
    assert browser.get("/research/jobs").status_code == 200
    assert admin.post(f"{path}/disable", {"disabled": "true"}, form="/admin").status_code == 303
    assert browser.get("/research/jobs", follow_redirects=False).status_code == 303
    assert browser.sign_in("pat").status_code == 401
    assert admin.get("/admin/metrics").status_code == 200
    assert "idlegrid_connected_nodes" in admin.get("/admin/metrics").text


def test_statistics_exports(api: Api, browser: Browser) -> None:
    browser.sign_up("quinn")
    store = api.client.app.state.grid.store  # type: ignore[attr-defined]
    write = functools.partial(exports.write_exports, store, api.settings.data_dir, now=0.0)
    written = api.client.portal.call(write)  # type: ignore[union-attr]
    assert [p.name for p in written] == list(exports.FILES)
    users = gzip.decompress((api.settings.data_dir / "stats" / "users.csv.gz").read_bytes())
    assert users.decode().splitlines()[0].startswith("id,name,team_id")
    assert "quinn" in users.decode()
    listing = browser.get("/stats")
    assert "users.csv.gz" in listing.text
    download = browser.get("/stats/users.csv.gz")
    assert download.status_code == 200 and gzip.decompress(download.content) == users
    assert browser.get("/stats/passwords.csv.gz").status_code == 404


def test_the_static_scripts_are_vendored() -> None:
    static = Path(exports.__file__).parent / "static"
    for name in ("htmx.min.js", "uPlot.iife.min.js", "dashboard.js"):
        assert (static / name).stat().st_size > 1000
    assert (static / "licenses" / "uPlot-1.6.32-LICENSE.txt").is_file()


def test_an_account_made_for_a_node_token_is_a_volunteer(api: Api) -> None:
    for kind, name in (("node", "quinn"), ("api", "rosa")):
        made = api.client.post(
            "/v1/tokens", json={"kind": kind, "account": name}, headers=api.admin
        )
        assert made.status_code == 201, made.text
    assert off_loop(_role_of(api, "quinn")) == "volunteer"  # it runs a node, submits nothing
    assert off_loop(_role_of(api, "rosa")) == "researcher"


async def _role_of(api: Api, name: str) -> str:
    from idlegrid.store import open_store, web

    store = open_store(api.settings.database)
    try:
        await store.open()
        account = await store.web.web_read(web.account_by_name, name)
        assert account is not None
        return account.role
    finally:
        await store.close()


@pytest.mark.parametrize(
    ("largest", "unit"),
    [
        (0.0, "MFLOPS"),
        (5e5, "MFLOPS"),
        (2e6, "MFLOPS"),
        (3.2e9, "GFLOPS"),
        (1e12, "TFLOPS"),
        (7e16, "PFLOPS"),
    ],
)
def test_compute_is_shown_in_a_unit_that_shows_the_work(largest: float, unit: str) -> None:
    from idlegrid.dashboard.public import flops_unit

    assert flops_unit(largest)[0] == unit


def _tiny_gguf(path: Path) -> bytes:
    """A GGUF header llama.cpp's architecture list accepts, with a chat template."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(["a", "b", "c"])
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    writer.add_tensor("token_embd.weight", np.zeros((3, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def test_a_generation_job_from_the_form_and_its_errors_on_the_page(
    api: Api, tmp_path: Path
) -> None:
    researcher = _researcher(api, "gina")
    assert (
        _upload(researcher, _tiny_gguf(tmp_path / "m.gguf"), purpose="gguf-model").status_code
        == 200
    )
    assert (
        _upload(researcher, b'{"prompt": "ab"}\n{"prompt": ', purpose="prompts").status_code == 200
    )
    files = researcher.get("/research/files").text
    ids = re.findall(r"kind=llm-generate&amp;file=(\d+)", files)
    assert len(ids) == 2, files
    prompts, model = ids  # the newest first
    page = researcher.get("/research/jobs/new?kind=llm-generate")
    assert 'action="/research/jobs/new/llm-generate"' in page.text and 'for="stop"' in page.text

    def submit(**fields: Any) -> Any:
        form = {"model": model, "prompts": prompts, "max_tokens": 4, **fields}
        return researcher.post(
            "/research/jobs/new/llm-generate", form, form="/research/jobs/new?kind=llm-generate"
        )

    bad_line = submit()
    assert bad_line.status_code == 422 and "prompts line 2: not JSON" in bad_line.text
    swapped = submit(model=prompts, prompts=model)
    assert swapped.status_code == 422 and "not a GGUF file" in swapped.text
    assert _upload(researcher, b'{"messages": [{"role": "user", "content": "ab"}]}\n',
                   purpose="prompts").status_code == 200  # fmt: skip
    good = re.findall(r"kind=llm-generate&amp;file=(\d+)", researcher.get("/research/files").text)
    done = submit(prompts=good[0], stop="\\n")
    assert done.status_code == 303, done.text
    job_page = researcher.get(done.headers["location"])
    assert job_page.status_code == 200 and "Generation" in job_page.text
    assert "checked" in job_page.text and "up to 4 tokens" in job_page.text
