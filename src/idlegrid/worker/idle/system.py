"""What else the machine is doing: other programs' CPU use, exclusive programs, battery,
temperature (psutil). Together with the idle time these make the policy's Readings.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from datetime import datetime
from typing import TYPE_CHECKING

import psutil

from idlegrid.worker.idle.base import IdleSource, ProbeReading
from idlegrid.worker.idle.policy import Readings

if TYPE_CHECKING:
    from idlegrid.worker.gpus import UseReader

log = logging.getLogger(__name__)

# Other programs' CPU use is averaged over this long: a compiler's burst pauses the
# worker, a one-second spike of a browser tab does not (BOINC's suspend_cpu_usage).
LOAD_WINDOW_S = 10.0
SLOW_EVERY_S = 5.0  # process list, temperature: costly to read every tick
CPU_SENSORS = ("coretemp", "k10temp", "zenpower", "cpu_thermal", "cpu-thermal", "acpitz")


class OtherLoad:
    """CPU use of everything but idlegrid, in percent of the whole machine.

    From the machine's busy CPU time minus that of idlegrid's own processes (the daemon
    and its task processes, named by `own_pids`), over a sliding window.
    """

    def __init__(self, own_pids: Callable[[], Iterable[int]], window_s: float = LOAD_WINDOW_S):
        self.own_pids = own_pids
        self.window_s = window_s
        self.cores = psutil.cpu_count() or 1
        self._samples: deque[tuple[float, float, float]] = deque()
        self._procs: dict[int, psutil.Process] = {}

    def sample(self) -> float | None:
        """Take one sample; the average over the window, or None before two samples."""
        now = time.monotonic()
        times = psutil.cpu_times()
        busy = sum(times) - times.idle - getattr(times, "iowait", 0.0)
        self._samples.append((now, busy, self._own_cpu()))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        if len(self._samples) < 2:
            return None
        (t0, busy0, own0), (t1, busy1, own1) = self._samples[0], self._samples[-1]
        if t1 <= t0:
            return None
        other = max(0.0, (busy1 - busy0) - max(0.0, own1 - own0))
        return min(100.0, 100.0 * other / ((t1 - t0) * self.cores))

    def _own_cpu(self) -> float:
        total = 0.0
        pids = set(self.own_pids())
        for pid in list(self._procs):
            if pid not in pids:
                del self._procs[pid]
        for pid in pids:
            try:
                proc = self._procs.get(pid) or self._procs.setdefault(pid, psutil.Process(pid))
                cpu = proc.cpu_times()
                total += cpu.user + cpu.system
            except psutil.Error:
                self._procs.pop(pid, None)
        return total


def running_programs(names: Iterable[str]) -> tuple[str, ...]:
    """Which of `names` (process names, case-insensitive, ".exe" optional) run now."""
    wanted = {name.lower().removesuffix(".exe") for name in names}
    if not wanted:
        return ()
    found: set[str] = set()
    for proc in psutil.process_iter(["name"]):
        name = (proc.info.get("name") or "").lower().removesuffix(".exe")
        if name in wanted:
            found.add(name)
    return tuple(sorted(found))


def cpu_temperature() -> float | None:
    """The hottest CPU sensor psutil reads, or None where it reads none."""
    reader = getattr(psutil, "sensors_temperatures", None)
    if reader is None:
        return None
    try:
        sensors = reader()
    except (OSError, RuntimeError):
        return None
    readings = [t.current for name in CPU_SENSORS for t in sensors.get(name, [])]
    return max(readings) if readings else None


def battery() -> tuple[bool | None, float | None]:
    """(on battery?, charge percent); (None, None) on a machine without one."""
    try:
        state = psutil.sensors_battery()
    except (OSError, RuntimeError, NotImplementedError):
        return None, None
    if state is None:
        return None, None
    return (not state.power_plugged) if state.power_plugged is not None else None, state.percent


class Sensors:
    """One `Readings` per tick: the idle time every tick, slow readings every few seconds."""

    def __init__(
        self,
        idle: IdleSource,
        own_pids: Callable[[], Iterable[int]],
        *,
        exclusive_apps: tuple[str, ...] = (),
        want_temperature: bool = False,
    ) -> None:
        self.idle = idle
        self.load = OtherLoad(own_pids)
        self.exclusive_apps = exclusive_apps
        self.want_temperature = want_temperature
        self.last_idle = ProbeReading("none", None)
        self._slow_at = -SLOW_EVERY_S
        self._exclusive: tuple[str, ...] = ()
        self._temperature: float | None = None
        self._battery: tuple[bool | None, float | None] = (None, None)
        # Set once the worker knows its device (worker/gpus.py): the GPUs it computes on
        # and a reader of other programs' use of them.
        self.gpu_devices: tuple[int, ...] = ()
        self.gpu_reader: UseReader | None = None
        self._gpu_use: tuple[tuple[int, float], ...] = ()

    def read(self, now: datetime | None = None) -> Readings:
        self.last_idle = self.idle.read()
        other = self.load.sample()
        tick = time.monotonic()
        if tick - self._slow_at >= SLOW_EVERY_S:
            self._slow_at = tick
            self._exclusive = running_programs(self.exclusive_apps)
            self._battery = battery()
            if self.want_temperature:
                self._temperature = cpu_temperature()
            self._gpu_use = self._read_gpus()
        return Readings(
            now=now or datetime.now(),
            user_idle_s=self.last_idle.idle_s,
            other_cpu_percent=other,
            exclusive_running=self._exclusive,
            on_battery=self._battery[0],
            battery_percent=self._battery[1],
            cpu_temp_c=self._temperature,
            gpu_other_use=self._gpu_use,
        )

    def _read_gpus(self) -> tuple[tuple[int, float], ...]:
        if self.gpu_reader is None or not self.gpu_devices:
            return ()
        try:
            use = self.gpu_reader(set(self.load.own_pids()))
        except Exception:  # a driver that stops answering must not stop the worker
            log.warning("reading the GPUs' use failed; not judging it", exc_info=True)
            self.gpu_reader = None
            return ()
        return tuple((index, use[index]) for index in self.gpu_devices if index in use)
