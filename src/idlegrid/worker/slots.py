"""Free slots and which task takes which: the placement of tasks on devices.

A task that needs a GPU (the coordinator says so in its `assign`) waits for a free GPU
slot; one whose kind can use a GPU takes a free GPU slot before a CPU slot; any other
takes a CPU slot before a GPU slot, so a GPU is not held by work a CPU does as well. A
slot whose device the idle policy pauses (the owner paused that GPU, a game uses it, the
CPU's mode is never) takes no task until it may run again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from idlegrid.worker.runner import TaskHost

# Whether a slot's device may take a task now (from the governor's decision).
MayRun = Callable[[TaskHost], bool]


class Slots:
    """The task processes not running a task, and a wait for one that fits."""

    def __init__(self, hosts: Iterable[TaskHost] = ()) -> None:
        self._free: list[TaskHost] = list(hosts)
        self._changed = asyncio.Event()

    def free(self) -> list[TaskHost]:
        """The free slots, in slot order."""
        return list(self._free)

    def hold(self, host: TaskHost) -> bool:
        """Take this slot if it is free (to end its idle process); False if it is not."""
        if host not in self._free:
            return False
        self._free.remove(host)
        return True

    def put(self, host: TaskHost) -> None:
        """A slot is free (again)."""
        if host not in self._free:
            self._free.append(host)
        self.poke()

    def poke(self) -> None:
        """Wake the waiting tasks: a slot freed, or a device may run again."""
        self._changed.set()

    def replace(self, hosts: Iterable[TaskHost]) -> None:
        """A new set of free slots (the devices were listed after the hardware probe)."""
        self._free = list(hosts)
        self.poke()

    def pick(self, *, needs_gpu: bool, wants_gpu: bool, may_run: MayRun) -> TaskHost | None:
        """Take the best free slot for a task, or None when none fits now."""
        fit = [h for h in self._free if may_run(h) and (h.device.gpu or not needs_gpu)]
        if not fit:
            return None
        prefer_gpu = needs_gpu or wants_gpu
        host = min(fit, key=lambda h: h.device.gpu != prefer_gpu)
        self._free.remove(host)
        return host

    async def take(self, *, needs_gpu: bool, wants_gpu: bool, may_run: MayRun) -> TaskHost:
        """Wait for a free slot that fits (`pick`) and take it."""
        while True:
            host = self.pick(needs_gpu=needs_gpu, wants_gpu=wants_gpu, may_run=may_run)
            if host is not None:
                self._changed.set()  # another waiter may fit what is left
                return host
            self._changed.clear()
            await self._changed.wait()
