"""A volunteer's fleet from the web, in a real browser against a real coordinator and a
real worker process (idlegrid.devtools.localgrid): a pause, a resume and a settings change
made on "my nodes" reach the running worker within 2 s, and it steps aside (its task
suspended) or resumes as told. Then every dashboard page is screenshot-tested at desktop
and phone widths: it loads, logs no console error, and nothing is wider than the screen.

Debian's Chromium only (tests/browser.py): without it this skips, except under CI=true.
IDLEGRID_SCREENSHOTS=DIR keeps the screenshots in DIR (else in the test's folder).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from browser import chromium_page

from idlegrid.devtools.localgrid import LocalGrid

PASSWORD = "a long enough passphrase"
DELIVERY_S = 2.0  # a change on the web reaches the running worker within this
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}


@pytest.fixture(scope="module")
def grid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalGrid]:
    root = tmp_path_factory.mktemp("fleet-grid")
    env = {"IDLEGRID_DISTINCT_ACCOUNTS": "false", "IDLEGRID_MONITOR_INTERVAL_S": "0.5"}
    with LocalGrid(root, replication=1, extra_env=env, heartbeat_s=1.0) as local:
        for name, role in (("vera", "volunteer"), ("ada", "admin")):
            subprocess.run(
                [sys.executable, "-m", "idlegrid", "web-account", name, "--role", role,
                 "--password-file", "-", "--data-dir", str(local.data_dir)],
                input=PASSWORD + "\n", text=True, check=True, env=local.env, capture_output=True,
            )  # fmt: skip
        yield local


class Tab:
    """A page that records console errors, signs in, and takes screenshots."""

    def __init__(self, page: Any, base: str, shots: Path) -> None:
        self.page, self.base, self.shots = page, base, shots
        self.errors: list[str] = []
        page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.errors.append(str(e)))

    def go(self, path: str) -> Any:
        response = self.page.goto(self.base + path)
        self.page.wait_for_load_state("load")
        return response

    def sign_in(self, login: str) -> None:
        self.go("/signin")
        self.page.fill("#login", login)
        self.page.fill("#password", PASSWORD)
        self.page.click("main button[type=submit]")
        self.page.wait_for_load_state("load")

    def shot(self, name: str) -> Path:
        self.shots.mkdir(parents=True, exist_ok=True)
        path = self.shots / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


def _shots(tmp_path: Path) -> Path:
    return Path(os.environ.get("IDLEGRID_SCREENSHOTS") or tmp_path / "screenshots")


class LocalPage:
    """The worker's own control page API (what its owner sees on the machine)."""

    def __init__(self, state_dir: Path) -> None:
        deadline = time.monotonic() + 60
        address = state_dir / "control.json"
        while not (address.exists() and address.read_text().endswith("}")):  # written whole
            assert time.monotonic() < deadline, "the worker's control page did not start"
            time.sleep(0.1)
        self.url = json.loads(address.read_text())["url"]
        self.token = (state_dir / "control-token").read_text().strip()
        self.http = httpx.Client(
            base_url=self.url, headers={"Authorization": f"Bearer {self.token}"}
        )

    def close(self) -> None:
        self.http.close()

    def status(self) -> dict[str, Any]:
        return dict(self.http.get("/api/status").json())

    def until(self, check: Any, *, timeout: float) -> tuple[float, dict[str, Any]]:
        """Seconds until `check(status)` holds (polled every 20 ms), and that status."""
        started = time.monotonic()
        while True:
            status = self.status()
            if check(status):
                return time.monotonic() - started, status
            assert time.monotonic() - started < timeout, status
            time.sleep(0.02)


def _tasks_in(status: dict[str, Any], state: str) -> bool:
    return bool(status["tasks"]) and all(t["state"] == state for t in status["tasks"])


def test_a_change_on_the_web_reaches_the_running_worker(grid: LocalGrid, tmp_path: Path) -> None:
    token = grid.create_token(kind="node", account="vera")["token"]
    grid.start_worker("vera-pc", kinds="sleep", benchmark=False, token=token)
    local = LocalPage(grid.root / "vera-pc")
    try:
        _obeys(grid, local, tmp_path)
    finally:
        local.close()


def _obeys(grid: LocalGrid, local: LocalPage, tmp_path: Path) -> None:
    with grid.client() as client:
        client.submit("sleep", params={"tasks": 1, "seconds": 120})
    local.until(lambda s: _tasks_in(s, "running"), timeout=60)
    with chromium_page(viewport=DESKTOP) as page:
        tab = Tab(page, grid.url, _shots(tmp_path))
        tab.sign_in("vera")
        tab.go("/my/nodes")
        tab.page.locator("#node-table .state-online").wait_for(timeout=60_000)
        timings = {}
        # Pause: the worker steps aside, its task suspended, and says why.
        started = time.monotonic()
        tab.page.click("#node-table button[data-action=pause]")
        _, status = local.until(lambda s: _tasks_in(s, "suspended"), timeout=10)
        timings["pause"] = time.monotonic() - started
        assert status["state"] == "paused" and status["reason"] == "paused by the owner"
        assert status["sources"]["control"]["source"] == "web"
        assert status["sources"]["control"]["by"] == "vera"
        # The dashboard hears the node's answer: paused, and why.
        tab.page.locator("#node-table .activity", has_text="paused").wait_for(timeout=10_000)
        tab.shot("my-nodes-paused")
        # Resume: the task runs again.
        started = time.monotonic()
        tab.page.click("#node-table button[data-action=run]")
        local.until(lambda s: _tasks_in(s, "running") and s["state"] != "paused", timeout=10)
        timings["resume"] = time.monotonic() - started
        # A policy setting: CPU mode never steps aside too; always brings it back.
        node_id = re.search(
            r"node-(\d+)", tab.page.locator("#node-table tbody tr").first.get_attribute("id") or ""
        )
        assert node_id is not None
        for mode, state in (("never", "suspended"), ("always", "running")):
            tab.go(f"/my/nodes/{node_id.group(1)}/settings")
            tab.page.select_option("#cpu_mode", mode)
            started = time.monotonic()
            tab.page.click("#node-settings button[type=submit]")
            _, status = local.until(lambda s, state=state: _tasks_in(s, state), timeout=10)
            timings[f"cpu_mode {mode}"] = time.monotonic() - started
            assert status["settings"]["cpu_mode"] == mode
            assert status["sources"]["cpu_mode"]["source"] == "web"
        tab.shot("node-settings")
        # A refused change: the reason on the page, the node's settings as they were.
        tab.page.fill("#cpu_percent", "150")
        tab.page.click("#node-settings button[type=submit]")
        refused = tab.page.inner_text("#settings-refused")
        assert "cpu_percent" in refused and "100" in refused
        assert local.status()["settings"]["cpu_percent"] != 150
        tab.shot("node-settings-refused")
        assert [e for e in tab.errors if "status of 422" not in e] == []
        # The worker's own page says where each setting came from (it has no favicon:
        # the browser's request for one is its only 404).
        tab.page.goto(f"{local.url}?token={local.token}")
        tab.page.click("#sources-box summary")
        tab.page.locator("#sources tr", has_text="cpu_mode").wait_for(timeout=10_000)
        row = tab.page.inner_text("#sources tr:has-text('cpu_mode')")
        assert "the dashboard" in row and "vera" in row and "always" in row
        assert "this machine" in tab.page.inner_text("#sources tr:has-text('windows')")
        tab.shot("worker-local-page")
        print("web change -> worker obeyed, seconds:", json.dumps(timings))
        assert all(seconds < DELIVERY_S for seconds in timings.values()), timings


def _pages(grid: LocalGrid, tab: Tab, team_name: str) -> list[str]:
    """Every page of the dashboard an admin (who may see all of them) can open."""
    tab.go("/teams/new")
    tab.page.fill("#name", team_name)
    tab.page.click("main button[type=submit]")
    tab.page.wait_for_url(re.compile(r".*/teams/\d+$"))
    team = tab.page.url.removeprefix(grid.url)
    with grid.client() as client:
        job = client.submit("sleep", params={"tasks": 1, "seconds": 0.01})
        deadline = time.monotonic() + 60
        while not (
            ids := [n["id"] for n in client.nodes() if n["name"] == "ada-pc" and n["online"]]
        ):
            assert time.monotonic() < deadline, "the admin's node did not connect"
            time.sleep(0.2)
        node_id = ids[0]
    return [
        "/", "/leaderboard/accounts", "/leaderboard/teams", "/leaderboard/nodes", "/teams",
        "/teams/new", team, "/users/1", "/stats", "/account", "/my/nodes", "/my/nodes/add",
        f"/nodes/{node_id}", f"/my/nodes/{node_id}/settings", "/research/files",
        "/research/jobs", "/research/jobs/new?kind=embed-text",
        "/research/jobs/new?kind=diloco-train", "/research/jobs/new?kind=onnx-infer",
        f"/research/jobs/{job.id}", "/admin", "/admin/metrics",
    ]  # fmt: skip


@pytest.mark.parametrize(("width", "viewport"), [("desktop", DESKTOP), ("phone", PHONE)])
def test_every_page_at_desktop_and_phone_widths(
    grid: LocalGrid, tmp_path: Path, width: str, viewport: dict[str, int]
) -> None:
    if not (grid.root / "ada-pc").exists():  # a node of the admin's, for "my nodes"
        grid.start_worker("ada-pc", kinds="sleep", benchmark=False, account="ada")
        LocalPage(grid.root / "ada-pc").close()
    phone = width == "phone"
    with chromium_page(viewport=viewport, is_mobile=phone, has_touch=phone) as page:
        tab = Tab(page, grid.url, _shots(tmp_path))
        for path in ("/signin", "/signup"):  # the signed-out pages
            assert tab.go(path).status == 200
            tab.shot(f"{width}-{path.strip('/')}")
        tab.sign_in("ada")
        pages = _pages(grid, tab, f"the {width} walkers")
        for path in [*pages, "/nodes/999999"]:
            response = tab.go(path)
            assert response.status == (404 if path == "/nodes/999999" else 200), path
            wide = tab.page.evaluate("document.documentElement.scrollWidth")
            assert wide <= viewport["width"], f"{path} is {wide}px wide at {width} width"
            name = re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-") or "status"
            shot = tab.shot(f"{width}-{name}")
            assert shot.stat().st_size > 5_000, f"{path}: an empty screenshot?"
    assert [e for e in tab.errors if "status of 404" not in e] == []
