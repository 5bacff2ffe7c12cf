"""A fresh coordinator builds the wheel /download serves at its first start when it runs
from a source checkout; one that cannot says why to its operator only."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import html
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import off_loop
from fastapi.testclient import TestClient
from test_dashboard import PASSWORD, Browser

from idlegrid import __version__
from idlegrid.app import create_app
from idlegrid.dashboard import wheel_build
from idlegrid.dashboard.accounts import set_login
from idlegrid.dashboard.wheel_build import WHEEL, BuildState, WheelBuilder
from idlegrid.settings import CoordinatorSettings
from idlegrid.store import open_store


@pytest.mark.slow
def test_a_fresh_coordinator_builds_and_serves_its_wheel(settings: CoordinatorSettings) -> None:
    root = wheel_build.source_checkout()
    assert root is not None  # the suite runs from a checkout
    had_build_dir = (root / "build").exists()
    settings = dataclasses.replace(settings, build_downloads=True)
    with TestClient(create_app(settings)) as client:
        builder = client.app.state.dashboard.shelf.builder  # type: ignore[attr-defined]
        assert builder.state is BuildState.BUILDING
        assert "being built" in client.get("/download").text
        assert client.portal.call(builder.wait) is BuildState.BUILT, builder.reason
        wheel = settings.download_dir / WHEEL
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        page = html.unescape(client.get("/download").text)
        assert f"idlegrid[worker] @ http://testserver/download/{WHEEL}#sha256={digest}" in page
        assert client.get(f"/download/{WHEEL}").content == wheel.read_bytes()
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        metadata = archive.read(f"idlegrid-{__version__}.dist-info/METADATA").decode()
    assert "idlegrid/__init__.py" in names and "idlegrid/dashboard/templates/download.html" in names
    assert f"Version: {__version__}" in metadata
    assert not list(settings.download_dir.glob(".*.part"))
    # It was built from a copy: the checkout gained no build/ directory.
    assert (root / "build").exists() == had_build_dir


@pytest.mark.slow
def test_an_install_from_a_wheel_packs_its_files_as_that_wheel_again(tmp_path: Path) -> None:
    root = wheel_build.source_checkout()
    assert root is not None
    first = asyncio.run(wheel_build._pip_wheel(root, tmp_path / "scratch"))
    site, again = tmp_path / "site", tmp_path / "again"
    _pip_install(first, site)
    repacked = tmp_path / WHEEL
    script = (
        "import sys; from pathlib import Path; from idlegrid.dashboard import wheel_build as w; "
        "assert w.source_checkout() is None and w.unbuildable_reason(None) is None; "
        f"w.repack(w.installed_files(), Path({str(repacked)!r}))"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}  # the installed copy comes first
    ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    _pip_install(repacked, again)
    assert _tree(again) == _tree(site)  # what pip installs from it is what runs here
    with zipfile.ZipFile(first) as built, zipfile.ZipFile(repacked) as packed:
        assert set(built.namelist()) == set(packed.namelist())


def _pip_install(wheel: Path, target: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--disable-pip-version-check", "--target", str(target), str(wheel)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


def _tree(site: Path) -> dict[str, str]:
    """Each installed file's hash, but pip's own notes and bytecode."""
    return {
        str(path.relative_to(site)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in site.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
        and path.name not in ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")
    }  # fmt: skip


def test_a_wheel_already_there_is_not_built_again(tmp_path: Path) -> None:
    (tmp_path / WHEEL).write_bytes(b"built by the operator")
    builder = WheelBuilder(tmp_path, enabled=True)
    asyncio.run(builder.start())
    assert builder.state is BuildState.PRESENT
    assert (tmp_path / WHEEL).read_bytes() == b"built by the operator"
    off = WheelBuilder(tmp_path / "elsewhere", enabled=False)
    asyncio.run(off.start())
    assert off.state is BuildState.OFF and not (tmp_path / "elsewhere").exists()


def test_an_install_that_cannot_build_tells_its_operator_only(
    settings: CoordinatorSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(wheel_build, "source_checkout", lambda: None)
    settings = dataclasses.replace(settings, build_downloads=True)
    with TestClient(create_app(settings)) as client:
        builder = client.app.state.dashboard.shelf.builder  # type: ignore[attr-defined]
        assert builder.state is BuildState.UNAVAILABLE
        assert "neither a source checkout nor installed from a wheel" in builder.reason
        anyone = client.get("/download").text
        assert "No worker package is served here yet" in anyone
        assert "source checkout" not in anyone and str(settings.data_dir) not in anyone
        off_loop(_admin_login(settings, "operator"))
        operator = Browser(client)
        assert operator.sign_in("operator").status_code == 303
        page = html.unescape(operator.get("/download").text)
        assert f"scripts/build-downloads.sh --data-dir {settings.data_dir}" in page
        assert "neither a source checkout nor installed from a wheel" in page


async def _admin_login(settings: CoordinatorSettings, name: str) -> None:
    """The operator's `idlegrid web-account NAME --role admin`, on the app's database."""
    store = open_store(settings.database)
    try:
        await store.open()
        await set_login(store, name, email=None, password=PASSWORD, role="admin")
    finally:
        await store.close()
