"""The worker steps aside: a real daemon, a real coordinator, real task processes.

The owner's input comes from a fake probe here (a number the test sets) and from a real
X server under Xvfb, moved by xdotool, in the second test. "Stepped aside" is measured
as the task process's CPU time no longer growing.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from grids import serving
from helpers import eventually, wait_until

from idlegrid.kinds.sleep import hash_chain
from idlegrid.protocol import HardwareProfile
from idlegrid.settings import CoordinatorSettings, WorkerSettings
from idlegrid.worker.daemon import Worker
from idlegrid.worker.idle import IdleProbe
from idlegrid.worker.idle.linux import XScreenSaverProbe
from idlegrid.worker.runner import TaskHost

HASHES = 1_500_000  # about 1-3 s of one core
STEP_ASIDE_S = 1.0


class FakeProbe:
    name = "fake"

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s

    def idle_seconds(self) -> float:
        return self.idle_s


@pytest.fixture
async def grid(tmp_path: Path) -> AsyncIterator[tuple[str, httpx.AsyncClient]]:
    settings = CoordinatorSettings(data_dir=tmp_path / "coordinator", heartbeat_interval_s=0.5)
    async with serving(settings) as url:
        admin = settings.admin_token_file.read_text().strip()
        async with httpx.AsyncClient(
            base_url=url, headers={"Authorization": f"Bearer {admin}"}, timeout=30
        ) as http:
            yield url, http


async def _worker(
    url: str, http: httpx.AsyncClient, state_dir: Path, probe: IdleProbe, idle_after: float
) -> Worker:
    token = (await http.post("/v1/tokens", json={"kind": "node"})).json()["token"]
    worker = Worker(
        WorkerSettings(
            servers=(url,),
            token=token,
            state_dir=state_dir,
            kinds=("sleep",),
            benchmark=False,
            idle_after_s=idle_after,
            suspend_cpu_usage=0,  # a shared test machine is never quiet
            pause_on_battery=False,
            control_port=-1,
        )
    )
    worker.hardware = HardwareProfile()
    worker.sensors.idle.probes = [probe]
    return worker


async def _time_to_stop(host: TaskHost, started: float) -> float:
    """Seconds from `started` until the process is suspended and its CPU time stops
    growing (two readings 0.1 s apart; the time of the second is not counted). Both: on a
    loaded machine a running process can go 0.1 s without a turn on a core."""
    before = host.cpu_seconds()
    while True:
        await asyncio.sleep(0.1)  # the sampling interval: CPU time is measured across it
        now = host.cpu_seconds()
        if now - before < 0.005 and host.suspended:
            return time.monotonic() - started - 0.1
        before = now
        assert time.monotonic() - started < 10, "the task never stopped computing"


async def _finish_and_verify(http: httpx.AsyncClient, job_id: int) -> None:
    async def ended() -> dict[str, Any] | None:
        info: dict[str, Any] = (await http.get(f"/v1/jobs/{job_id}")).json()
        return info if info["state"] not in ("queued", "running") else None

    info = await eventually(ended, f"job {job_id} to end", timeout_s=30, poll_s=0.05)
    assert info["state"] == "completed", info
    (result,) = (await http.get(f"/v1/jobs/{job_id}/result")).json()
    assert result["chain"] == hash_chain(result["index"], HASHES)


async def _steps_aside_and_resumes(
    url: str, http: httpx.AsyncClient, worker: Worker, make_active: Callable[[], Awaitable[None]],
    idle_after: float,
) -> float:  # fmt: skip
    sent: list[Any] = []
    send = worker._send

    async def recording_send(message: Any) -> bool:
        sent.append(message)
        return await send(message)

    worker._send = recording_send  # type: ignore[method-assign]
    running = asyncio.create_task(worker.run())
    try:
        job = (
            await http.post(
                "/v1/jobs",
                json={"kind": "sleep", "params": {"tasks": 1, "hashes": HASHES}, "replication": 1},
            )
        ).json()
        host = worker.hosts[0]
        task = await eventually(
            lambda: next(iter(worker.running.values()), None), "a task", timeout_s=30
        )
        await eventually(
            lambda: task.progress > 0.02 and host.cpu_seconds() > 0.05, "computing", timeout_s=30
        )
        started = time.monotonic()
        await make_active()
        elapsed = await _time_to_stop(host, started)
        assert host.suspended
        assert elapsed < STEP_ASIDE_S, f"stepped aside after {elapsed:.2f} s"
        paused = [m for m in sent if getattr(m, "type", "") == "status" and m.state == "paused"]
        assert paused and "user active" in paused[-1].reason

        # The coordinator shows the node's reason beside its other figures.
        async def paused_node() -> dict[str, Any] | None:
            (node,) = (await http.get("/v1/nodes")).json()
            return dict(node) if node["activity"].startswith("paused") else None

        node = await eventually(paused_node, "the node shown paused", poll_s=0.05)
        assert "user active" in node["activity"], node
        # The task is suspended, not lost: after the threshold it resumes and completes.
        await _finish_and_verify(http, job["id"])
        after = sent[sent.index(paused[-1]) :]
        assert any(getattr(m, "type", "") == "status" and m.state == "running" for m in after)
    finally:
        worker.stop()
        await running
    return elapsed


async def test_the_worker_steps_aside_within_a_second_and_resumes(
    grid: tuple[str, httpx.AsyncClient], tmp_path: Path
) -> None:
    url, http = grid
    probe = FakeProbe(idle_s=1000.0)
    worker = await _worker(url, http, tmp_path / "worker", probe, idle_after=1.0)

    async def owner_returns() -> None:
        probe.idle_s = 0.0
        asyncio.get_running_loop().call_later(1.0, setattr, probe, "idle_s", 1000.0)

    await _steps_aside_and_resumes(url, http, worker, owner_returns, 1.0)


# -- a real X session ------------------------------------------------------------------------


@pytest.fixture
def xvfb() -> Any:
    """A display under Xvfb; skipped where Xvfb and xdotool are not installed (not on CI)."""
    missing = [tool for tool in ("Xvfb", "xdotool") if shutil.which(tool) is None]
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must install the Debian packages xvfb and xdotool ({missing})")
        pytest.skip(f"needs {missing} (Debian packages xvfb, xdotool)")
    number = 90 + os.getpid() % 500
    display = f":{number}"
    server = subprocess.Popen(
        ["Xvfb", display, "-nolisten", "tcp", "-screen", "0", "640x480x24"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        # Connecting before the server listens leaks xlib's sockets: wait until it does.
        socket_file = Path(f"/tmp/.X11-unix/X{number}")
        wait_until(lambda: _accepts(socket_file), "Xvfb to listen", timeout_s=10, poll_s=0.05)
        yield display
    finally:
        server.terminate()
        server.wait(10)


def _accepts(path: Path) -> bool:
    """Whether a server listens on the Unix socket `path`."""
    with socket.socket(socket.AF_UNIX) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            return False
    return True


def _xdotool(display: str, *args: str) -> None:
    subprocess.run(["xdotool", *args], env={**os.environ, "DISPLAY": display}, check=True)


def test_xscreensaver_reads_the_idle_time_and_input_resets_it(xvfb: str) -> None:
    probe = XScreenSaverProbe(xvfb)
    try:
        # The server's idle clock starts when it is ready, which a loaded machine delays
        # past the socket's appearance: count from an input of our own.
        _xdotool(xvfb, "mousemove", "10", "10")
        time.sleep(1.2)  # idle time passing is what the probe must read
        assert probe.idle_seconds() >= 1.0
        _xdotool(xvfb, "mousemove", "100", "100")
        assert probe.idle_seconds() < 0.5
        time.sleep(0.6)  # idle again for a while, so that the key's reset shows
        _xdotool(xvfb, "key", "a")
        assert probe.idle_seconds() < 0.5
    finally:
        probe.close()


async def test_under_x11_the_worker_suspends_within_a_second_then_completes(
    xvfb: str, grid: tuple[str, httpx.AsyncClient], tmp_path: Path
) -> None:
    url, http = grid
    probe = XScreenSaverProbe(xvfb)
    try:
        worker = await _worker(url, http, tmp_path / "worker", probe, idle_after=2.0)
        elapsed = await _steps_aside_and_resumes(
            url, http, worker,
            lambda: asyncio.to_thread(_xdotool, xvfb, "mousemove", "200", "200"), 2.0,
        )  # fmt: skip
    finally:
        probe.close()
    print(json.dumps({"step_aside_s": round(elapsed, 3)}))
