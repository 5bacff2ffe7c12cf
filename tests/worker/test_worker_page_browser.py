"""The worker's local control page in a real browser (Debian's Chromium driven by
Playwright, as the dashboard's tests do), against a real worker process: the owner
enters with the address `idlegrid worker status` prints, reads the state and its reason,
and uses every control. Without Chromium this skips, except under CI=true."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from idlegrid.devtools.localgrid import LocalGrid

pytestmark = pytest.mark.slow

CHROMIUM = os.environ.get("IDLEGRID_CHROMIUM", "/usr/bin/chromium")
ARGS = [
    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
    "--disable-background-networking", "--disable-component-update", "--no-first-run",
]  # fmt: skip


@pytest.fixture
def page() -> Iterator[Any]:
    missing = None
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        missing = f"no Chromium at {CHROMIUM}"
    else:
        try:
            from playwright.sync_api import sync_playwright
        except ImportError:
            missing = "the playwright package is not installed"
    if missing:
        if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
            pytest.fail(f"{missing}; CI=true requires it (apt-get install chromium)")
        pytest.skip(f"{missing}: apt-get install chromium, pip install playwright")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser.new_page()
        finally:
            browser.close()


def _status(state_dir: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "idlegrid", "worker", "--state-dir", str(state_dir), "status",
         "--json"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return dict(json.loads(done.stdout))


def test_the_control_page_in_a_browser(page: Any, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    with LocalGrid(tmp_path) as grid:
        grid.start_worker("w", kinds="sleep", benchmark=False)
        grid.wait_for_nodes(1)
        state_dir = tmp_path / "w"
        printed = subprocess.run(
            [sys.executable, "-m", "idlegrid", "worker", "--state-dir", str(state_dir), "status"],
            capture_output=True, text=True, timeout=60, check=True,
        ).stdout  # fmt: skip
        address = printed.split("control page: ", 1)[1].strip()
        base = address.split("?", 1)[0]
        # Without the token the API answers nothing but the refusal, and the page asks
        # for the token.
        assert httpx.get(base + "api/status").status_code == 401
        page.goto(base)
        page.fill("#token", "not the token")
        page.click("button[type=submit]")
        expect(page.locator(".error")).to_contain_text("not this worker's control token")
        token = (state_dir / "control-token").read_text().strip()
        page.fill("#token", token)
        page.click("button[type=submit]")
        expect(page.locator("#state")).to_have_text("running")
        page.context.clear_cookies()
        page.goto(address)
        assert "token=" not in page.url  # moved into a cookie, out of the history
        expect(page.locator("#state")).to_have_text("running")
        expect(page.locator("#hardware")).to_contain_text("cores")
        expect(page.locator("#tasks")).to_contain_text("no tasks")

        page.click("#pause")
        expect(page.locator("#state")).to_have_text("paused")
        expect(page.locator("#reason")).to_have_text("paused by the owner")
        page.click("#resume")
        expect(page.locator("#state")).to_have_text("running")
        page.click("#snooze")
        expect(page.locator("#reason")).to_contain_text("snoozed until")
        page.click("#resume")
        page.click("#finish")
        expect(page.locator("#reason")).to_contain_text("finishing the current tasks")
        page.click("#resume")
        expect(page.locator("#state")).to_have_text("running")

        # A running task shows in the table with its kind, state and progress.
        with grid.client() as client:
            job = client.submit("sleep", params={"tasks": 1, "seconds": 2.0}, replication=1)
            expect(page.locator("#tasks")).to_contain_text("sleep")
            expect(page.locator("#tasks")).to_contain_text("running")
            job.wait(timeout=60)
        expect(page.locator("#tasks")).to_contain_text("no tasks")
        expect(page.locator("#completed")).to_have_text("1")
        # The credit is the coordinator's figure, as the dashboard shows it.
        with grid.client() as client:
            (node,) = client.nodes()
        expect(page.locator("#credit")).to_have_text(f"{node['credit_total']:.2f}")
        # Each reason once: the badge says the state, the line beside it only why.
        assert not page.inner_text("#reason").startswith(("running", "paused"))

        # Settings: a bad value names itself and changes nothing; good ones are kept.
        windows = page.locator("input[name=windows]")
        assert windows.input_value() == "" and "any time" in (
            windows.get_attribute("placeholder") or ""
        )
        page.fill("input[name=windows]", "25:00-08:00")
        page.click("form#settings button[type=submit]")
        expect(page.locator("#error")).to_contain_text("windows:")
        assert _status(state_dir)["settings"]["windows"] == ""
        page.fill("input[name=windows]", "18:00-08:00; sat,sun 00:00-24:00")
        page.fill("input[name=cpu_percent]", "40")
        page.select_option("select[name=gpu_mode]", "never")
        page.click("form#settings button[type=submit]")
        expect(page.locator("#error")).to_have_text("")
        expect(page.locator("#saved")).to_contain_text("Saved at")
        settings = _status(state_dir)["settings"]
        assert settings["cpu_percent"] == 40
        assert settings["gpu_mode"] == "never"
        assert settings["windows"] == "18:00-08:00; sat,sun 00:00-24:00"
