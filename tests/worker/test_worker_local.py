"""The worker's local side: control page, service files, outbox, task processes."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
from pathlib import Path

import httpx
import pytest
from helpers import eventually

from idlegrid import protocol
from idlegrid.settings import WorkerSettings
from idlegrid.worker import service
from idlegrid.worker.control import ControlPage
from idlegrid.worker.daemon import Worker
from idlegrid.worker.idle.policy import Action
from idlegrid.worker.outbox import Outbox
from idlegrid.worker.runner import TaskFailed, TaskHost, TaskSpec

HASH = "a" * 64


def _worker(tmp_path: Path, **values: object) -> Worker:
    settings = WorkerSettings(
        token="ign_x", state_dir=tmp_path / "worker", kinds=("sleep",), benchmark=False,
        **values,  # type: ignore[arg-type]
    )  # fmt: skip
    return Worker(settings)


# -- the control page ------------------------------------------------------------------------


async def test_control_page_needs_its_token_and_loopback(tmp_path: Path) -> None:
    worker = _worker(tmp_path, when_unknown="idle", suspend_cpu_usage=0)
    worker.sensors.idle.probes = []
    await worker.governor.step()
    page = ControlPage(worker, port=0)
    await page.start()
    token_file = tmp_path / "worker" / "control-token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    try:
        async with httpx.AsyncClient(base_url=page.url) as http:
            assert (await http.get("/api/status")).status_code == 401
            wrong = await http.get("/api/status", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 401
            auth = {"Authorization": f"Bearer {page.token}"}
            rebinding = await http.get("/api/status", headers={**auth, "Host": "evil.example"})
            assert rebinding.status_code == 403
            status = (await http.get("/api/status", headers=auth)).json()
            assert status["state"] == "running" and "counted as idle" in status["reason"]
            assert status["reason"] == "running: " + status["why"]  # the state said once
            paused = (await http.post("/api/pause", headers=auth)).json()
            assert paused["state"] == "paused" and paused["controls"]["paused"]
            await worker.governor.step()
            assert worker.governor.action() is Action.PAUSE
            assert worker.governor.decision is not None
            assert worker.governor.decision.reason == "paused by the owner"
            bad = await http.post("/api/settings", headers=auth, json={"windows": "9-5"})
            assert bad.status_code == 400 and bad.json()["error"].startswith("windows: ")
            changed = await http.post(
                "/api/settings", headers=auth, json={"cpu_mode": "always", "cpu_percent": 40}
            )
            assert changed.json()["settings"]["cpu_percent"] == 40
            await http.post("/api/resume", headers=auth)
            await worker.governor.step()
            assert worker.governor.action() is Action.THROTTLE
            # The browser's way in: the token once in the address, then a strict cookie.
            entry = await http.get(f"/?token={page.token}")
            assert entry.status_code == 303 and "SameSite=Strict" in entry.headers["set-cookie"]
        async with httpx.AsyncClient(
            base_url=page.url, cookies={"idlegrid_control": page.token}
        ) as browser:
            html = await browser.get("/")
            assert html.status_code == 200 and "This machine's worker" in html.text
        # A browser without the token gets a sign-in page, which takes only the right one.
        async with httpx.AsyncClient(base_url=page.url) as browser:
            form = await browser.get("/")
            assert form.status_code == 401 and form.headers["content-type"].startswith("text/html")
            assert 'action="/signin"' in form.text and str(tmp_path / "worker") in form.text
            wrong = await browser.post("/signin", data={"token": "nope"})
            assert wrong.status_code == 401 and "not this worker's control token" in wrong.text
            right = await browser.post("/signin", data={"token": page.token})
            assert right.status_code == 303 and "SameSite=Strict" in right.headers["set-cookie"]
            assert (await browser.get("/api/status")).status_code == 200
        # The owner's choices survive a restart.
        again = _worker(tmp_path)
        assert again.governor.settings.idle.cpu_percent == 40
    finally:
        await page.close()


def _outside_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 1))
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


async def test_control_page_refuses_other_addresses(tmp_path: Path) -> None:
    address = _outside_address()
    if address is None:
        pytest.skip("this machine has no address but loopback")
    worker = _worker(tmp_path)
    page = ControlPage(worker, port=0, host="0.0.0.0")  # only to prove the refusal
    await page.start()
    try:
        async with httpx.AsyncClient() as http:
            response = await http.get(
                f"http://{address}:{page.port}/api/status",
                headers={"Authorization": f"Bearer {page.token}", "Host": "127.0.0.1"},
            )
        assert response.status_code == 403
    finally:
        await page.close()


def test_malformed_policy_values_are_refused_at_start_by_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="^windows: "):
        _worker(tmp_path, windows="weekends")
    with pytest.raises(ValueError, match="^cpu_mode: 'sometimes'"):
        _worker(tmp_path, cpu_mode="sometimes")
    with pytest.raises(ValueError, match="^in_use.cpu_percent: "):
        _worker(tmp_path, in_use_cpu_percent=0)


# -- the outbox ------------------------------------------------------------------------------


def test_the_outbox_survives_a_restart(tmp_path: Path) -> None:
    box = Outbox(tmp_path / "outbox")
    box[7] = protocol.Result(task_id=7, output=HASH, output_size=3, elapsed_s=1.0)
    box[8] = protocol.Failure(task_id=8, reason="boom")
    (tmp_path / "outbox" / "9.json").write_text("{not json")
    again = Outbox(tmp_path / "outbox")
    assert sorted(again) == [7, 8]
    assert isinstance(again[7], protocol.Result) and again[7].output == HASH
    del again[7]
    assert sorted(Outbox(tmp_path / "outbox")) == [8]
    worker = _worker(tmp_path.parent / (tmp_path.name + "-w"))
    worker.outbox[5] = protocol.Result(task_id=5, output=HASH, output_size=1, elapsed_s=0.1)
    assert 5 in _worker(tmp_path.parent / (tmp_path.name + "-w")).outbox


# -- task processes --------------------------------------------------------------------------


async def _no_fetch(blob_hash: str) -> bytes:
    raise AssertionError("no blobs here")


def _spec(task_id: int, **params: object) -> TaskSpec:
    import json

    payload = json.dumps({"index": 0, "seconds": 0.0, **params}).encode()
    return TaskSpec(
        task_id=task_id, kind="sleep", params={}, payload=payload, device="cpu",
        threads=1, slowdown=1.0,
    )  # fmt: skip


async def test_a_task_process_that_dies_fails_its_task_and_a_new_one_runs_the_next() -> None:
    host = TaskHost(name="test-task", threads=1)
    try:
        running = asyncio.create_task(
            host.run(_spec(1, hashes=50_000_000), fetch=_no_fetch, progress=lambda f: None)
        )
        await eventually(lambda: host.cpu_seconds() > 0.05, "the task to compute", timeout_s=30)
        assert host.pid is not None
        os.kill(host.pid, 9)  # a kind that crashed the interpreter, or the OOM killer
        with pytest.raises(TaskFailed, match="died"):
            await running
        output = await host.run(_spec(2, hashes=10), fetch=_no_fetch, progress=lambda f: None)
        assert b"chain" in output
        import psutil

        assert psutil.Process(host.pid).nice() >= 10
    finally:
        host.stop()


# -- service files ---------------------------------------------------------------------------

COMMAND = ["/usr/bin/python3", "-m", "idlegrid", "worker", "--server", "https://grid.example"]


@pytest.mark.parametrize("system", [False, True])
def test_the_systemd_unit_verifies(tmp_path: Path, system: bool) -> None:
    unit = service.systemd_unit(COMMAND, system=system, state_dir=tmp_path)
    assert "Nice=10" in unit and "IOSchedulingClass=idle" in unit
    assert "\nPrivateTmp" not in unit and "DynamicUser" not in unit
    assert ("User=idlegrid" in unit) is system
    if shutil.which("systemd-analyze") is None:
        pytest.skip("no systemd-analyze here")
    path = tmp_path / service.UNIT
    path.write_text(unit.replace("/usr/bin/python3", shutil.which("python3") or "/bin/true"))
    done = subprocess.run(
        ["systemd-analyze", "verify", *(["--user"] if not system else []), str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    problems = [
        line for line in (done.stdout + done.stderr).splitlines()
        if path.name in line or "idlegrid" in line
    ]  # fmt: skip
    assert not [p for p in problems if "User=idlegrid" not in p and "idlegrid:" not in p], problems


def test_launchd_and_task_scheduler_files(tmp_path: Path) -> None:
    import plistlib
    import xml.dom.minidom

    plist = plistlib.loads(
        service.launchd_plist(COMMAND, state_dir=tmp_path, log_dir=tmp_path).encode()
    )
    assert plist["Label"] == service.LAUNCHD_LABEL
    assert plist["ProgramArguments"] == [*COMMAND, "--state-dir", str(tmp_path)]
    assert plist["Nice"] == 10 and plist["LowPriorityIO"] is True
    task = service.task_scheduler_xml(
        [r"C:\idlegrid\idlegrid-worker.exe", "--server", "https://grid.example"],
        state_dir=Path(r"C:\Users\ann\idlegrid"), user=r"PC\ann",
    )  # fmt: skip
    document = xml.dom.minidom.parseString(task.replace('encoding="UTF-16"', ""))
    command = document.getElementsByTagName("Command")[0].firstChild
    assert command is not None and command.nodeValue == r"C:\idlegrid\idlegrid-worker.exe"
    assert document.getElementsByTagName("LogonType")[0].firstChild.nodeValue == "InteractiveToken"  # type: ignore[union-attr]


def test_the_windows_logon_task_runs_the_windowless_program(tmp_path: Path) -> None:
    console = tmp_path / "idlegrid-worker.exe"
    console.write_bytes(b"MZ")
    command = service.service_command(platform="win32", executable=str(console), frozen=True)
    assert command == [str(console)]  # no windowless program beside it: the console one
    windowless = tmp_path / f"{service.TRAY_PROGRAM}.exe"
    windowless.write_bytes(b"MZ")
    command = service.service_command(platform="win32", executable=str(console), frozen=True)
    assert command == [str(windowless)]
    # Elsewhere, and from the Python package, the service runs the worker as it is.
    for platform in ("linux", "darwin"):
        found = service.service_command(platform=platform, executable=str(console), frozen=True)
        assert found == [str(console)]
    python = service.service_command(platform="win32", executable="python.exe", frozen=False)
    assert python == ["python.exe", "-m", "idlegrid", "worker"]


def test_install_dry_run_keeps_the_token_off_the_command_line(tmp_path: Path) -> None:
    options = {"token": "ign_secret", "servers": ("https://grid.example",), "cpu_percent": 50.0,
               "state_dir": tmp_path, "exclusive_apps": ("steam",)}  # fmt: skip
    lines = service.install(options, system=False, dry_run=True, platform="linux")
    text = "\n".join(lines)
    assert "ign_secret" not in text
    assert "--cpu-percent 50.0" in text and "--exclusive-app steam" in text
    assert "systemctl --user enable --now idlegrid-worker.service" in text
    assert service.write_token(tmp_path, "ign_secret").stat().st_mode & 0o077 == 0


async def test_a_task_over_the_memory_cap_is_killed_and_fails(tmp_path: Path) -> None:
    from idlegrid.worker.idle.policy import Limits

    worker = _worker(tmp_path)
    host = worker.hosts[0]
    try:
        running = asyncio.create_task(
            host.run(_spec(1, hashes=50_000_000), fetch=_no_fetch, progress=lambda f: None)
        )
        await eventually(lambda: host.cpu_seconds() > 0.05, "the task to compute", timeout_s=30)
        worker.governor.enforce_memory(Limits(memory_percent=100))
        assert host.alive()  # under the cap: left alone
        worker.governor._memory_total = 100 * 2**20  # a 100 MB machine: the cap is 1 MB
        worker.governor.enforce_memory(Limits(memory_percent=1))
        with pytest.raises(TaskFailed, match="memory limit: tasks hold"):
            await running
    finally:
        host.stop()
