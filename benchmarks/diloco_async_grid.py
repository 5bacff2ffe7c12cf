"""Asynchronous against synchronous DiLoCo rounds through real worker processes, one slow.

    PYTHONPATH=src .venv/bin/python benchmarks/diloco_async_grid.py [--rounds 16] [--slowdown 3]
    PYTHONPATH=src .venv/bin/python benchmarks/diloco_async_grid.py --churn-every 6

A `LocalGrid` (`idlegrid serve` and three `idlegrid worker` processes over WebSockets)
trains the same `diloco-train` job twice on the `cpython-stdlib` corpus, three shards a
round: synchronous rounds (a round closes when all three updates are in) and
asynchronous ones (a round closes on two of its own updates; the third counts in a later
round, weighted by its staleness, up to `max_staleness` 2). One worker is made
`--slowdown` times slower for real: the benchmark stops its process tree (the worker and
its task processes) with SIGSTOP and resumes it with SIGCONT, running 1 / slowdown of
every 0.3 s. With `--churn-every N` there is no slow worker; instead one worker (in
turn) is killed with its task processes every N s, as a machine that goes off, and
started again `--churn-down` s later on its state dir (it reconnects and resumes its
task from its checkpoint, or the coordinator gives the task to another node).

Per mode it prints the job's wall time, the time to the validation loss both runs reach
(the higher of the two final ones; the grid's evaluation task measures the held-out
tenth), the final loss, and the stale updates applied and dropped; the last line is
`async_speedup: X loss_change: Y%` (synchronous wall time to the target over
asynchronous; asynchronous final loss over synchronous, minus one). Wall times depend
on the machine's load: the slow worker's stopped time frees its core for the others.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import psutil

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob

PERIOD_S = 0.3


def job_params(rounds: int, asynchronous: bool, steps: int = 50) -> dict[str, Any]:
    """A small transformer, three shards a round; quorum 2 and staleness 2 when async."""
    params: dict[str, Any] = {
        "model": {"width": 32, "layers": 1, "heads": 2, "context": 32},
        "inner": {"steps": steps, "batch_size": 8, "seq_len": 32, "lr": 0.003},
        "workers": 3,
        "rounds": rounds,
        "eval_batches": 8,
        "round_timeout_s": 600.0,
        "upload": {"method": "int8"},
        "download": {"method": "int8"},
    }
    if asynchronous:
        params.update({"asynchronous": True, "min_updates": 2, "max_staleness": 2})
    return params


def signal_tree(pid: int, sig: int) -> None:
    """Send `sig` to a process and all its descendants (a worker and its task processes)."""
    try:
        root = psutil.Process(pid)
        for process in [root, *root.children(recursive=True)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, sig)
    except psutil.NoSuchProcess:
        pass


class Background:
    """A loop (`_loop`, until `_stop` is set) on a thread for the length of a `with`."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        raise NotImplementedError


class Throttle(Background):
    """Runs a process tree 1/slowdown of the time: SIGSTOP, then SIGCONT, every period."""

    def __init__(self, pid: int, slowdown: float) -> None:
        super().__init__()
        self.pid, self.running_share = pid, 1.0 / slowdown

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        signal_tree(self.pid, signal.SIGCONT)

    def _loop(self) -> None:
        while not self._stop.is_set():
            signal_tree(self.pid, signal.SIGCONT)
            time.sleep(PERIOD_S * self.running_share)
            if self._stop.is_set():
                break
            signal_tree(self.pid, signal.SIGSTOP)
            time.sleep(PERIOD_S * (1 - self.running_share))


class Churn(Background):
    """Every `every_s`, kill one worker (in turn) with its task processes, as a machine
    that goes off would, and start it again `down_s` later on the same state dir."""

    def __init__(
        self, local: LocalGrid, workers: dict[str, subprocess.Popen[str]], every_s: float,
        down_s: float,
    ) -> None:  # fmt: skip
        super().__init__()
        self._local, self._workers = local, workers
        self._every_s, self._down_s = every_s, down_s
        self.kills = 0

    def _loop(self) -> None:
        names = list(self._workers)
        while not self._stop.wait(self._every_s):
            name = names[self.kills % len(names)]
            signal_tree(self._workers[name].pid, signal.SIGKILL)
            self._workers[name].wait()
            self.kills += 1
            time.sleep(self._down_s)  # back even when the job ended meanwhile
            self._workers[name] = self._local.start_worker(
                name, kinds="diloco-train", threads=1, benchmark=False
            )


def run_mode(
    local: LocalGrid, rounds: int, asynchronous: bool, timeout: float, steps: int = 50
) -> dict[str, Any]:
    """One job; its rounds' (start time, eval loss), wall time and stale counts."""
    started = time.monotonic()
    with local.client() as client:
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob(
            "cpython-stdlib")}, params=job_params(rounds, asynchronous, steps))  # fmt: skip
        job.wait(timeout=timeout)
        metrics = job.metrics()
    wall = time.monotonic() - started
    curve, clock = [], 0.0
    for row in metrics["rounds"]:
        if row["eval_loss"] is not None:
            curve.append((clock, float(row["eval_loss"])))
        clock += float(row["round_time_s"] or 0.0)
    return {
        "mode": "asynchronous" if asynchronous else "synchronous",
        "wall_s": wall,
        "curve": curve,
        "final": curve[-1][1],
        "stale_applied": metrics.get("stale_applied", 0),
        "stale_dropped": metrics.get("stale_dropped", 0),
    }


def time_to(curve: Sequence[tuple[float, float]], target: float) -> float | None:
    return next((t for t, loss in curve if loss <= target), None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--slowdown", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=900.0, help="s a job may take")
    parser.add_argument(
        "--churn-every", type=float, default=0.0,
        help="instead of a slow worker: kill one worker (in turn) every N s, and start it "
        "again --churn-down s later",
    )  # fmt: skip
    parser.add_argument("--churn-down", type=float, default=2.0)
    args = parser.parse_args(argv)
    results = []
    with (
        tempfile.TemporaryDirectory() as root,
        LocalGrid(Path(root), heartbeat_s=1.0, node_timeout_s=10.0) as local,
    ):
        workers = {f"w{k}": local.start_worker(f"w{k}", kinds="diloco-train", threads=1,
                                               benchmark=False) for k in range(3)}  # fmt: skip
        local.wait_for_nodes(3)
        # Every worker's task process imports torch once: a short job first, not timed.
        run_mode(local, 2, False, args.timeout, steps=2)
        kills = []
        for asynchronous in (False, True):
            if args.churn_every > 0:
                with Churn(local, workers, args.churn_every, args.churn_down) as churn:
                    results.append(run_mode(local, args.rounds, asynchronous, args.timeout))
                kills.append(churn.kills)
                local.wait_for_nodes(3)
            else:
                with Throttle(workers["w2"].pid, args.slowdown):
                    results.append(run_mode(local, args.rounds, asynchronous, args.timeout))
    target = max(result["final"] for result in results)
    case = (
        f"a worker killed every {args.churn_every:g} s and back {args.churn_down:g} s later "
        f"(kills: synchronous {kills[0]}, asynchronous {kills[1]})"
        if args.churn_every > 0
        else f"one {args.slowdown:g}x slower"
    )
    print(f"{args.rounds} rounds, 3 workers, {case}; validation loss target {target:.4f}")
    print("| mode | wall time, s | time to target, s | final validation loss "
          "| stale applied | stale dropped |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|")
    reached = {}
    for result in results:
        reached[result["mode"]] = time_to(result["curve"], target)
        shown = (
            "not reached" if reached[result["mode"]] is None else f"{reached[result['mode']]:.1f}"
        )
        print(f"| {result['mode']} | {result['wall_s']:.1f} | {shown} | {result['final']:.4f} "
              f"| {result['stale_applied']} | {result['stale_dropped']} |")  # fmt: skip
    for result in results:
        points = " ".join(f"{t:.0f}s:{loss:.3f}" for t, loss in result["curve"])
        print(f"{result['mode']} curve (round start, validation loss): {points}")
    sync, fast = reached["synchronous"], reached["asynchronous"]
    speedup = sync / fast if sync and fast else float("nan")
    change = 100 * (results[1]["final"] / results[0]["final"] - 1)
    print(f"async_speedup: {speedup:.2f} loss_change: {change:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
