"""The DiLoCo benchmark's sweeps: every run of docs/benchmarks.md's DiLoCo tables, at once.

    PYTHONPATH=src .venv/bin/python benchmarks/diloco_sweep.py --out results/ \\
        [--cpu-slots 8 --cuda-slots 8] [--plan full|horizon|streaming|tiny] [--deadline 520]

Each run is one `diloco_simulate.py` (or `diloco_timeline.py`) process with its own
flags, given a free slot: a CPU core (one torch thread) or a share of a GPU. Runs start in
the plan's order (the headline comparison first, then the tuning sweeps, then the levers,
then the asynchronous mode), so a deadline cuts the least needed. Each run's report is
appended to `results.jsonl` as it ends; `benchmarks/diloco_report.py` turns that file
into the tables. All runs use the `cpython-stdlib` corpus and 3,000 steps per worker.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEEDS = (0, 1, 2)
BASE_LR, SYNC_LR = "3e-3", "1e-2"


def full_plan() -> list[tuple[str, list[str]]]:
    """(name, flags) of every run, most needed first."""
    plan: list[tuple[str, list[str]]] = []
    for seed in SEEDS:  # the headline: fp32 baseline, DiLoCo, int4 baseline
        plan.append((f"sync-fp32 lr={SYNC_LR} seed={seed}", _sync(SYNC_LR, seed)))
        plan.append((f"diloco H=100 lr={BASE_LR} seed={seed}", _diloco(seed)))
        plan.append((f"sync-int4 lr={SYNC_LR} seed={seed}",
                     _sync(SYNC_LR, seed, "--sync-gradients", "int4")))  # fmt: skip
    for lr in ("5e-3", "2e-2"):  # the baseline's peak lr at the compared horizon
        plan.append((f"sync-fp32 lr={lr} seed=0", _sync(lr, 0)))
    for lr in ("1.5e-3", "6e-3"):  # DiLoCo's inner peak lr, swept the same way
        plan.append((f"diloco H=100 lr={lr} seed=0", _diloco(0, "--lr", lr)))
    plan.append((f"sync-fp32 lr={SYNC_LR} decay=2000 seed=0",
                 _sync(SYNC_LR, 0, "--decay-steps", "2000")))  # fmt: skip
    levers = {
        "H=200": ["--inner-steps", "200"],
        "outer-lr=0.7": ["--outer-lr", "0.7"],
        "int8": ["--upload", "int8", "--download", "int8"],
        "workers=8": ["--workers", "8"],
    }
    for lever, flags in levers.items():
        plan.append((f"diloco {lever} seed=0", _diloco(0, *flags)))
    plan.append((f"sync-fp32 workers=8 lr={SYNC_LR} seed=0", _sync(SYNC_LR, 0, "--workers", "8")))
    timeline = ["--rounds", "20", "--inner-steps", "50", "--seeds", "0"]
    for case, flags in {"slow": ["--slowdown", "3"],
                        "churn": ["--slowdown", "1", "--churn-every", "3"]}.items():  # fmt: skip
        for mode in ("synchronous", "asynchronous"):
            plan.append((f"timeline {case} {mode}",
                         ["timeline", *timeline, *flags, "--modes", mode]))  # fmt: skip
    more = {
        "H=50": ["--inner-steps", "50"],
        "sign-upload": ["--upload", "sign"],
        "task-warmup=20": ["--warmup", "20"],
        "outer-momentum=0.8": ["--outer-momentum", "0.8"],
        "outer-lr=1.4": ["--outer-lr", "1.4"],
    }
    for lever, flags in more.items():
        plan.append((f"diloco {lever} seed=0", _diloco(0, *flags)))
    plan.append(("sync-fp32 lr=3e-2 seed=0", _sync("3e-2", 0)))
    return plan


def horizon_plan() -> list[tuple[str, list[str]]]:
    """The second pass: both runs at 6,000 steps, and the levers that helped, on 3 seeds."""
    long = ["--total-steps", "6000"]
    plan: list[tuple[str, list[str]]] = []
    for seed in SEEDS:
        plan.append((f"sync-fp32 steps=6000 seed={seed}", _sync(SYNC_LR, seed, *long)))
    plan.append(("diloco H=100 steps=6000 seed=0", _diloco(0, *long)))
    for seed in (1, 2):
        plan.append((f"diloco H=200 steps=6000 seed={seed}",
                     _diloco(seed, *long, "--inner-steps", "200")))  # fmt: skip
    plan.append(("diloco H=200 outer-momentum=0.8 steps=6000 seed=0",
                 _diloco(0, *long, "--inner-steps", "200", "--outer-momentum", "0.8")))  # fmt: skip
    plan.append(("diloco H=100 outer-momentum=0.8 steps=6000 seed=0",
                 _diloco(0, *long, "--outer-momentum", "0.8")))  # fmt: skip
    for seed in SEEDS:
        plan.append((f"diloco outer-momentum=0.8 lr=6e-3 seed={seed}",
                     _diloco(seed, "--outer-momentum", "0.8", "--lr", "6e-3")))  # fmt: skip
    for seed in (1, 2):
        plan.append((f"diloco outer-momentum=0.8 seed={seed}",
                     _diloco(seed, "--outer-momentum", "0.8")))  # fmt: skip
    plan.append(("diloco outer-momentum=0.6 seed=0", _diloco(0, "--outer-momentum", "0.6")))
    plan.append(("diloco outer-lr=0.8 outer-momentum=0.8 seed=0",
                 _diloco(0, "--outer-lr", "0.8", "--outer-momentum", "0.8")))  # fmt: skip
    plan.append(("diloco H=50 steps=3000 seed=0",
                 _diloco(0, "--total-steps", "3000", "--inner-steps", "50")))  # fmt: skip
    return plan


def streaming_plan() -> list[tuple[str, list[str]]]:
    """Streaming DiLoCo's fragments as a lever: seed 0, 3,000 steps, one change each.

    With P fragments and rounds of H = 100 / P, each fragment is synced every 100 steps
    as plain DiLoCo's H = 100 syncs the whole model, with 1/P of the bytes a round; with
    rounds of H = 100 each fragment waits P * 100 steps and the run moves 1/P the bytes
    (as plain DiLoCo with H = 200 does, the last run).
    """
    half = ["--total-steps", "3000", "--inner-steps", "50"]  # 60 rounds of H = 50
    return [
        (f"sync-fp32 lr={SYNC_LR} seed=0", _sync(SYNC_LR, 0)),
        (f"diloco H=100 lr={BASE_LR} seed=0", _diloco(0)),
        ("diloco fragments=2 H=50 seed=0", _diloco(0, *half, "--fragments", "2")),
        ("diloco fragments=2 H=100 seed=0", _diloco(0, "--fragments", "2")),
        ("diloco fragments=2 H=50 mix=0.5 seed=0",
         _diloco(0, *half, "--fragments", "2", "--mix", "0.5")),
        # Mixing without fragments: the whole model, each round A * local + (1 - A) * global.
        ("diloco mix=0.5 seed=0", _diloco(0, "--mix", "0.5")),
        # The bytes of fragments=2 H=100 without fragments: the whole model every 200 steps.
        ("diloco H=200 steps=3000 seed=0",
         _diloco(0, "--total-steps", "3000", "--inner-steps", "200")),
    ]  # fmt: skip


def tiny_plan() -> list[tuple[str, list[str]]]:
    """A few seconds of each kind of run: the script's own check."""
    small = ["--total-steps", "4", "--inner-steps", "2", "--batch-size", "2", "--seq-len", "16",
             "--width", "16", "--layers", "1"]  # fmt: skip
    return [
        ("sync-fp32 tiny", ["simulate", *small, "--runs", "sync"]),
        ("sync-int4 tiny", ["simulate", *small, "--runs", "sync", "--sync-gradients", "int4"]),
        ("diloco tiny", ["simulate", *small, "--runs", "diloco"]),
        (
            "diloco fragments tiny",
            ["simulate", *small, "--layers", "2", "--runs", "diloco", "--fragments", "2"],
        ),
        ("timeline tiny", ["timeline", *small, "--modes", "asynchronous"]),
    ]


def _sync(lr: str, seed: int, *flags: str) -> list[str]:
    return ["simulate", "--runs", "sync", "--sync-lr", lr, "--seeds", str(seed), *flags]


def _diloco(seed: int, *flags: str) -> list[str]:
    return ["simulate", "--runs", "diloco", "--seeds", str(seed), *flags]


def run_one(name: str, flags: list[str], device: str, out: Path, lock: threading.Lock) -> bool:
    """One run in its own process; its report (or its failure) appended to results.jsonl."""
    module, rest = flags[0], flags[1:]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        report_path = handle.name
    command = [sys.executable, str(HERE / f"diloco_{module}.py"), *rest,
               "--device", device, "--threads", "1", "--json", report_path]  # fmt: skip
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    row = {"name": name, "flags": flags, "device": device, "rc": done.returncode,
           "seconds": time.monotonic() - started,
           "tail": done.stdout[-1500:] + done.stderr[-1500:]}  # fmt: skip
    if done.returncode == 0:
        row["report"] = json.loads(Path(report_path).read_text())
    os.unlink(report_path)
    with lock, (out / "results.jsonl").open("a") as results:
        results.write(json.dumps(row) + "\n")
    print(f"{row['seconds']:.0f} s {device} rc={done.returncode}: {name}", flush=True)
    return done.returncode == 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--plan", choices=["full", "horizon", "streaming", "tiny"],
                        default="full")  # fmt: skip
    parser.add_argument("--cpu-slots", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--cuda-slots", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=None,
                        help="s: a CPU slot starts nothing after")  # fmt: skip
    parser.add_argument("--cuda-deadline", type=float, default=None,
                        help="s: a GPU slot starts nothing after")  # fmt: skip
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    plans = {"full": full_plan, "horizon": horizon_plan, "streaming": streaming_plan,
             "tiny": tiny_plan}  # fmt: skip
    pending = list(plans[args.plan]())
    slots = ["cuda"] * args.cuda_slots + ["cpu"] * args.cpu_slots
    lock, started = threading.Lock(), time.monotonic()

    def slot_loop(device: str) -> None:
        while True:
            with lock:
                deadline = args.cuda_deadline if device == "cuda" else args.deadline
                late = deadline is not None and time.monotonic() - started > deadline
                if not pending or late:
                    return
                name, flags = pending.pop(0)
            if not run_one(name, flags, device, args.out, lock):
                return  # a slot that fails once (a broken device) takes no more runs

    threads = [threading.Thread(target=slot_loop, args=(device,)) for device in slots]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(f"not started: {[name for name, _ in pending]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
