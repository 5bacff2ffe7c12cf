"""How often the "other programs" CPU limit turns a worker off and on, per hour.

    .venv/bin/python benchmarks/cpu_flaps.py [--minutes 10] [--limits 25,50,90] [--load CMD]

Reads other programs' CPU use as the worker does (`OtherLoad`: the machine's busy CPU
time less this process's, over the worker's window, every governor tick) and feeds each
reading to the idle policy twice, on the same readings: without hysteresis (each
decision alone: pause above the limit, resume at or under it, as the worker did before
the lower mark) and with it (`decide(..., previous)`: resume only under the lower mark).
A flap is a turn from running to paused (the first reading's state is none).
`--load CMD` runs CMD again and again in the background meanwhile (a test suite), so the
load is the one a worker meets beside it.

Each limit of `--limits` (percent of the machine; the default 25 first) is played on the
same readings, so a machine whose load hovers near another level shows its flaps too.
One line per limit: `limit L%: flaps_per_hour without X with Y; paused without A% with B%`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from datetime import datetime

from idlegrid.worker.governor import TICK_S
from idlegrid.worker.idle.policy import Action, Controls, Decision, IdleSettings, Readings, decide
from idlegrid.worker.idle.system import OtherLoad


class Tally:
    """Turns of one policy variant into pause, and its time paused."""

    def __init__(self) -> None:
        self.previous: Decision | None = None
        self.flaps = 0
        self.paused_ticks = 0

    def feed(self, decision: Decision) -> None:
        paused = decision.cpu is Action.PAUSE
        if paused and self.previous is not None and self.previous.cpu is not Action.PAUSE:
            self.flaps += 1
        self.paused_ticks += paused
        self.previous = decision


def _loop(command: str) -> subprocess.Popen[bytes]:
    """Run `command` again and again, in its own process group, until killed."""
    return subprocess.Popen(
        ["bash", "-c", f"while true; do {command} >/dev/null 2>&1; done"],
        start_new_session=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--limits", default="25,50,75,90", help="suspend_cpu_usage values, %%")
    parser.add_argument("--load", default="", help="a command run in a loop meanwhile")
    args = parser.parse_args()
    limits = [float(v) for v in args.limits.split(",")]
    variants = {
        limit: (IdleSettings(suspend_cpu_usage=limit), Tally(), Tally()) for limit in limits
    }
    load = OtherLoad(lambda: [os.getpid()])
    background = _loop(args.load) if args.load else None
    readings: list[float] = []
    deadline = time.monotonic() + args.minutes * 60
    try:
        while time.monotonic() < deadline:
            other = load.sample()
            if other is not None:
                reading = Readings(now=datetime.now(), user_idle_s=3600.0, other_cpu_percent=other)
                for settings, without, with_ in variants.values():
                    without.feed(decide(settings, reading, Controls()))
                    with_.feed(decide(settings, reading, Controls(), with_.previous))
                readings.append(other)
            time.sleep(TICK_S)
    finally:
        if background is not None:
            os.killpg(background.pid, 15)
            background.wait()
    ticks = max(len(readings), 1)
    hours = ticks * TICK_S / 3600
    ordered = sorted(readings) or [0.0]
    print(
        f"{len(readings)} readings over {args.minutes:g} min; other programs' CPU: mean "
        f"{sum(readings) / ticks:.1f}%, median {ordered[len(ordered) // 2]:.1f}%, "
        f"10th-90th percentile {ordered[len(ordered) // 10]:.1f}-"
        f"{ordered[len(ordered) * 9 // 10]:.1f}%"
    )
    for limit, (settings, without, with_) in variants.items():
        print(
            f"limit {limit:g}% (resumes under {settings.resume_cpu_usage:g}%): flaps_per_hour "
            f"without {without.flaps / hours:.0f} with {with_.flaps / hours:.0f}; paused "
            f"without {without.paused_ticks / ticks:.0%} with {with_.paused_ticks / ticks:.0%}"
        )


if __name__ == "__main__":
    main()
