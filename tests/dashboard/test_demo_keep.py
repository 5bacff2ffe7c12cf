"""`idlegrid demo --keep`: the grid stays up with a dashboard sign-in until Ctrl-C."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest


def test_demo_keep_serves_the_dashboard_until_ctrl_c() -> None:
    pytest.importorskip("onnxruntime")
    demo = subprocess.Popen(
        [sys.executable, "-m", "idlegrid", "demo", "--kind", "onnx-infer", "--keep"]
        + ["--images", "24", "--replication", "1", "--workers", "1", "--shard-size", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "COLUMNS": "200", "NO_COLOR": "1"},
    )
    assert demo.stdout is not None
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 240
        found = None
        while found is None and time.monotonic() < deadline:
            line = demo.stdout.readline()
            if not line:
                break
            lines.append(line)
            found = re.search(r"dashboard: (\S+)/\s+sign in as (\S+) / (\S+)", line)
        assert found, "".join(lines)
        assert any("check logits" in line and "OK" in line for line in lines), lines
        url, login, password = found.groups()
        with httpx.Client(base_url=url, follow_redirects=False) as client:
            page = client.get("/signin").text
            token = re.search(r'name="csrf" value="([^"]+)"', page)
            assert token is not None
            signed_in = client.post(
                "/signin", data={"csrf": token.group(1), "login": login, "password": password}
            )
            assert signed_in.status_code == 303, signed_in.text
            jobs = client.get("/research/jobs")
            assert jobs.status_code == 200 and "onnx-infer" in jobs.text
            assert "completed" in jobs.text
        demo.send_signal(signal.SIGINT)
        # Each process gets 15 s from SIGTERM before SIGKILL (LocalGrid.stop); on a loaded
        # machine a worker and the coordinator may both use it, besides the demo's own exit.
        rest, _ = demo.communicate(timeout=150)
        assert demo.returncode == 0, "".join(lines) + rest
        assert "all processes stopped" in rest
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/healthz", timeout=2)
    finally:
        if demo.poll() is None:
            demo.kill()
            demo.communicate()
