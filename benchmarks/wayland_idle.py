"""What the Wayland idle probe costs: a reading, the connection while idle, the handshake.

    .venv/bin/python benchmarks/wayland_idle.py [--seconds 10] [--handshakes 50]

Starts a headless sway (as `nobody` when run as root: sway refuses root) in a temporary
runtime directory, then:

1. handshake: connect, list the globals, bind the seat and the idle protocol and ask for
   a notification (`WaylandIdleProbe.handshake_s`), median of `--handshakes` connections;
2. a reading: `idle_seconds()` on a connected probe, mean over 200,000 calls;
3. idle and connected: this process's CPU time over `--seconds` while it reads the probe
   every 0.25 s, as the worker's governor does (the reader thread included), in percent
   of one core.

The last line is `reading_us: X idle_cpu_pct: Y handshake_ms: Z`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from idlegrid.worker.idle.base import ProbeUnavailable
from idlegrid.worker.idle.wayland import WaylandIdleProbe


def start_sway(runtime: Path) -> tuple[subprocess.Popen[bytes], Path]:
    command = ["sway", "-c", "/dev/null"]
    if os.geteuid() == 0:
        os.chown(runtime, 65534, 65534)
        command = ["setpriv", "--reuid", "nobody", "--regid", "nogroup", "--clear-groups",
                   *command]  # fmt: skip
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(runtime),
        "XDG_RUNTIME_DIR": str(runtime), "WLR_BACKENDS": "headless",
        "WLR_LIBINPUT_NO_DEVICES": "1", "WLR_RENDERER": "pixman",
    }  # fmt: skip
    server = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and server.poll() is None:
        sockets = [p for p in runtime.glob("wayland-*") if not p.name.endswith(".lock")]
        if sockets:
            return server, sockets[0]
        time.sleep(0.02)
    server.kill()
    raise SystemExit("sway did not start (Debian package sway; see WLR_* in this script)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--handshakes", type=int, default=50)
    args = parser.parse_args()
    if shutil.which("sway") is None:
        raise SystemExit("needs sway (Debian package sway)")
    runtime = Path(tempfile.mkdtemp(prefix="idlegrid-bench-sway-"))
    server, path = start_sway(runtime)
    try:
        handshakes = []
        for _ in range(args.handshakes):
            probe = WaylandIdleProbe(path)
            try:
                probe.idle_seconds()
            except ProbeUnavailable as exc:
                if "first idle notification" not in str(exc):
                    raise
            assert probe.handshake_s is not None
            handshakes.append(probe.handshake_s)
            probe.close()
        handshake_ms = statistics.median(handshakes) * 1000
        print(f"handshake ({probe.protocol}): median {handshake_ms:.2f} ms, "
              f"max {max(handshakes) * 1000:.2f} ms over {len(handshakes)}")  # fmt: skip

        probe = WaylandIdleProbe(path)
        probe.wait_ready()
        calls = 200_000
        started = time.perf_counter()
        for _ in range(calls):
            probe.idle_seconds()
        reading_us = (time.perf_counter() - started) / calls * 1e6
        print(
            f"a reading: {reading_us:.2f} us (mean of {calls}); idle {probe.idle_seconds():.1f} s"
        )

        cpu, wall = time.process_time(), time.monotonic()
        until = wall + args.seconds
        while time.monotonic() < until:
            probe.idle_seconds()
            time.sleep(0.25)
        idle_cpu_pct = (time.process_time() - cpu) / (time.monotonic() - wall) * 100
        print(f"idle and connected, read every 0.25 s: {idle_cpu_pct:.3f}% of one core "
              f"over {args.seconds:.0f} s")  # fmt: skip
        probe.close()
    finally:
        server.terminate()
        server.wait(10)
        shutil.rmtree(runtime, ignore_errors=True)
    print(
        f"reading_us: {reading_us:.2f} idle_cpu_pct: {idle_cpu_pct:.3f} "
        f"handshake_ms: {handshake_ms:.2f}"
    )


if __name__ == "__main__":
    main()
