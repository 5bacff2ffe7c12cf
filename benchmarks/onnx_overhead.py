"""onnx-infer throughput through the grid versus raw ONNX Runtime in one process.

    PYTHONPATH=src python benchmarks/onnx_overhead.py [--model minilm|mlp] [--rounds 2]

The same model and the same rows go through (a) one `InferenceSession.run` per batch in
this process, with as many threads as the worker uses, and (b) a `LocalGrid`: a
coordinator on SQLite in a temporary directory and one worker process on every core,
reached through the SDK (`submit_onnx`, `wait`, `result`). A grid round is timed from
submit (upload included) to the result downloaded and parsed; the worker's start-up
happens before the first round, and a warm-up job loads the model into its session
cache. Rounds alternate (raw, grid, raw, grid, ...) so that noise from other tenants of
the machine hits both sides alike; figures are medians. The last line is `ratio: X.XX`,
grid throughput over raw throughput (1.00: the grid costs nothing).

Two models (`--model`):
- `minilm` (the default): what a researcher brings, a sentence encoder. The packaged
  all-MiniLM-L6-v2 weights exported to ONNX (the worker's own export, made once and
  cached: about ten seconds the first time) with mean pooling added to the graph:
  `input_ids`, `attention_mask`, `token_type_ids` (int64, 128 tokens a row) to
  `embedding` (384 floats a row). Rows are stdlib docstring paragraphs, tokenized with the
  model's own tokenizer; about 3 kB of input for some 3 GFLOP a row.
- `mlp`: a dense network built in code (`onnx_examples.mlp`) over random float32 rows, 256
  features (1 kB) a row for about 5 MFLOP at the default width: data-heavy, the grid's
  worst case, since its costs grow with the bytes it moves and the shards it handles.
  `--hidden` and `--layers` set its arithmetic per byte.

The worker runs its tasks at low priority (nice 10: a volunteer's own programs come
first), so the raw side runs at the same priority by default (`--raw-nice`): on a
machine shared with other busy processes a nice-0 raw side would get several times the
CPU share of the worker's task, and the ratio would measure the scheduler, not the grid.
On an idle machine the priority makes no difference.

Each grid round also prints the CPU seconds each of the grid's processes spent on it
(coordinator, worker daemon, task process, and this process's SDK calls): on a machine
whose cores the task already fills, that CPU is what the grid costs. The `cpu:` line
divides the raw side's CPU seconds by the grid's, on the worker's side (task process and
daemon) and in all; CPU seconds move less than wall time when other tenants of a shared
machine come and go.

`--split-cores` (Linux) measures the deployment's shape instead of everything on one
machine's shared cores: the coordinator and the SDK (the researcher's side) get the
first core, the worker daemon with its task process and the raw side the others, and
both ONNX Runtime sides use as many threads as those cores. The grid's cost left on the
volunteer's cores is then the daemon's own, plus whatever of the submission and the
result's trip is not overlapped with computing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import psutil

from idlegrid.client import Client
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.onnx.compare import Tolerance, arrays_agree
from idlegrid.kinds.onnx.examples import mean_pooled, mlp
from idlegrid.worker.runner import NICE

FEATURES = 256
TOKENS = 128
# Per model: rows a round, rows a shard, rows a model run.
DEFAULTS = {"minilm": (512, 64, 32), "mlp": (20_000, 2000, 256)}


@dataclass
class Workload:
    """A model, how to make a round's rows for it, and the output compared."""

    description: str
    model: bytes
    make_rows: Callable[[np.random.Generator, int], dict[str, np.ndarray]]
    output: str


def mlp_workload(args: argparse.Namespace) -> Workload:
    hidden, layers = args.hidden, args.layers
    flops = 2 * args.rows * (FEATURES * hidden + (layers - 2) * hidden**2 + hidden * 64)
    model = mlp(features=FEATURES, hidden=hidden, outputs=64, layers=layers, seed=1)
    return Workload(
        f"mlp {FEATURES}-{hidden}x{layers - 1}-64, {len(model) / 2**20:.1f} MiB; "
        f"{args.rows} rows ({flops / 1e9:.0f} GFLOP)",
        model,
        lambda rng, rows: {"x": rng.standard_normal((rows, FEATURES), np.float32)},
        "y",
    )


def minilm_workload(args: argparse.Namespace) -> Workload:
    from idlegrid.kinds.embed_text import onnx as embed_onnx
    from idlegrid.kinds.embed_text.samples import stdlib_paragraphs

    model = mean_pooled(embed_onnx.exported_model().read_bytes())
    encoded = embed_onnx.tokenizer(TOKENS, length=TOKENS).encode_batch(stdlib_paragraphs())
    ids = np.array([row.ids for row in encoded], np.int64)
    mask = np.array([row.attention_mask for row in encoded], np.int64)

    def make_rows(rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
        # Paragraphs drawn afresh (with repeats past the 2,000 tokenized): a new blob.
        pick = rng.choice(len(ids), rows, replace=rows > len(ids))
        return {
            "input_ids": ids[pick],
            "attention_mask": mask[pick],
            "token_type_ids": np.zeros((rows, TOKENS), np.int64),
        }

    return Workload(
        f"all-MiniLM-L6-v2 with mean pooling, {len(model) / 2**20:.0f} MiB; {args.rows} "
        f"rows of {TOKENS} tokens ({int(mask.sum(axis=1).mean())} real on average)",
        model,
        make_rows,
        "embedding",
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", choices=sorted(DEFAULTS), default="minilm", help="the model (default minilm)"
    )
    parser.add_argument("--rows", type=int, help="rows a round (minilm 512, mlp 20000)")
    parser.add_argument("--rounds", type=int, default=2, help="raw/grid pairs (default 2)")
    parser.add_argument("--shard-size", type=int, help="rows per shard (minilm 64, mlp 2000)")
    parser.add_argument("--batch-size", type=int, help="rows per model run (minilm 32, mlp 256)")
    parser.add_argument("--hidden", type=int, default=1024, help="mlp: hidden layers' width")
    parser.add_argument("--layers", type=int, default=4, help="mlp: dense layers")
    parser.add_argument(
        "--raw-nice",
        type=int,
        default=NICE,
        help=f"niceness of the raw side (default {NICE}, the worker's tasks'; 0: normal)",
    )
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="coordinator and SDK on the first core; worker, task and raw side on the rest",
    )
    args = parser.parse_args(argv)
    rows, shard_size, batch_size = DEFAULTS[args.model]
    args.rows = rows if args.rows is None else args.rows
    args.shard_size = shard_size if args.shard_size is None else args.shard_size
    args.batch_size = batch_size if args.batch_size is None else args.batch_size
    if args.split_cores and len(_usable_cores()) < 2:
        parser.error("--split-cores needs CPU affinity (Linux) and at least 2 cores")
    if min(args.rows, args.rounds, args.shard_size, args.batch_size, args.hidden) < 1:
        parser.error("--rows, --rounds, --shard-size, --batch-size, --hidden must be >= 1")
    if args.layers < 2:
        parser.error("--layers must be >= 2")
    return args


def _usable_cores() -> list[int]:
    if not hasattr(os, "sched_getaffinity"):
        return []
    return sorted(os.sched_getaffinity(0))


class CpuMeter:
    """CPU seconds (user + system) of the grid's processes, by role, between two reads:
    the coordinator, the worker daemon, its task processes, and this process (the SDK:
    read only around grid rounds, so the raw side is not in it)."""

    def __init__(self, grid: LocalGrid) -> None:
        self._grid = grid

    def read(self) -> dict[str, float]:
        totals = {"coordinator": 0.0, "daemon": 0.0, "task": 0.0, "sdk": _cpu(psutil.Process())}
        if self._grid.coordinator is not None:
            totals["coordinator"] = _cpu(psutil.Process(self._grid.coordinator.pid))
        for worker in self._grid.workers:
            daemon = psutil.Process(worker.pid)
            totals["daemon"] += _cpu(daemon)
            for child in daemon.children(recursive=True):
                totals["task"] += _cpu(child)
        return totals


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
    except psutil.Error:
        return 0.0
    return float(times.user + times.system)


def _pin(grid: LocalGrid, worker_cores: set[int], grid_cores: set[int]) -> None:
    """Every thread of the grid's processes onto its side's cores (threads made later
    inherit it from the thread that makes them)."""
    assert grid.coordinator is not None
    sides = [(psutil.Process(grid.coordinator.pid), grid_cores)]
    for worker in grid.workers:
        daemon = psutil.Process(worker.pid)
        sides += [(daemon, worker_cores)]
        sides += [(child, worker_cores) for child in daemon.children(recursive=True)]
    for process, cores in sides:
        for thread in process.threads():
            os.sched_setaffinity(thread.id, cores)


def raw_run(
    session: ort.InferenceSession, rows: dict[str, np.ndarray], output: str, batch_size: int
) -> np.ndarray:
    """What a researcher without the grid would do: batches through one session."""
    count = len(next(iter(rows.values())))
    return np.concatenate(
        [
            session.run(
                [output], {name: array[start : start + batch_size] for name, array in rows.items()}
            )[0]
            for start in range(0, count, batch_size)
        ]
    )


def grid_run(
    client: Client, work: Workload, rows: dict[str, np.ndarray], args: argparse.Namespace
) -> tuple[Any, list[float]]:
    """The grid's result, and the seconds of its three legs: submit (upload and split),
    run (until the job is done), fetch (download and parse the result)."""
    marks = [time.perf_counter()]
    job = client.submit_onnx(
        work.model,
        rows,
        outputs=[work.output],
        batch_size=args.batch_size,
        shard_size=args.shard_size,
        replication=1,
    )
    marks.append(time.perf_counter())
    job.wait()
    marks.append(time.perf_counter())
    result = job.result()[work.output]
    marks.append(time.perf_counter())
    return result, [later - earlier for earlier, later in zip(marks, marks[1:], strict=False)]


def _rounds(
    client: Client,
    session: ort.InferenceSession,
    work: Workload,
    rng: np.random.Generator,
    args: argparse.Namespace,
    meter: CpuMeter,
    raw_cores: set[int] | None,
    grid_cores: set[int] | None,
) -> tuple[list[float], list[float], dict[str, float]]:
    raw_s, grid_s = [], []
    spent: dict[str, float] = {}
    for index in range(args.rounds):
        # New rows every round: blobs are stored by hash and would be found again.
        rows = work.make_rows(rng, args.rows)
        if raw_cores:
            os.sched_setaffinity(0, raw_cores)  # this thread, where the raw side computes
        started, cpu_before = time.perf_counter(), _cpu(psutil.Process())
        reference = raw_run(session, rows, work.output, args.batch_size)
        raw_s.append(time.perf_counter() - started)
        # This process does nothing else meanwhile: its CPU is the raw side's.
        spent["raw"] = spent.get("raw", 0.0) + _cpu(psutil.Process()) - cpu_before
        if grid_cores:
            os.sched_setaffinity(0, grid_cores)
        before = meter.read()
        started = time.perf_counter()
        result, legs = grid_run(client, work, rows, args)
        grid_s.append(time.perf_counter() - started)
        after = meter.read()
        for role, seconds in after.items():
            spent[role] = spent.get(role, 0.0) + seconds - before.get(role, 0.0)
        if not arrays_agree(result, reference, Tolerance()):
            raise SystemExit("the grid's result does not match raw ONNX Runtime")
        cpu = ", ".join(f"{role} {after[role] - before[role]:.2f}" for role in after)
        print(
            f"round {index + 1}: raw {args.rows / raw_s[-1]:8.0f} rows/s "
            f"({raw_s[-1]:.2f} s), grid {args.rows / grid_s[-1]:8.0f} rows/s "
            f"({grid_s[-1]:.2f} s: submit {legs[0]:.2f}, run {legs[1]:.2f}, fetch {legs[2]:.2f}), "
            f"ratio {raw_s[-1] / grid_s[-1]:.2f}; CPU s: {cpu}"
        )
    return raw_s, grid_s, {role: seconds / args.rounds for role, seconds in spent.items()}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    usable = _usable_cores()
    cores = len(usable) or os.cpu_count() or 1
    grid_cores = raw_cores = None
    if args.split_cores:
        grid_cores, raw_cores = set(usable[:1]), set(usable[1:])
        cores = len(raw_cores)
    work = minilm_workload(args) if args.model == "minilm" else mlp_workload(args)
    rng = np.random.default_rng(0)
    print(
        f"model: {work.description}, shards of {args.shard_size}, "
        f"batches of {args.batch_size}, raw side at nice {args.raw_nice}, "
        + (
            f"coordinator and SDK on core {sorted(grid_cores)}, worker and raw side on "
            f"cores {sorted(raw_cores)} ({cores} threads)"
            if grid_cores and raw_cores
            else f"everything on {cores} cores"
        )
    )
    with (
        tempfile.TemporaryDirectory(prefix="idlegrid-bench-") as tmp,
        LocalGrid(Path(tmp), replication=1) as grid,
    ):
        # --threads as the raw side's: the daemon would count the machine's cores.
        grid.start_worker("worker", kinds="onnx-infer", benchmark=False, threads=cores)
        # The grid's processes started at normal priority; from here this thread, and the
        # session's threads made below, run at the raw side's (Linux: per thread).
        os.nice(max(0, args.raw_nice - os.nice(0)))
        if raw_cores:
            os.sched_setaffinity(0, raw_cores)  # ONNX Runtime's threads inherit it
        options = ort.SessionOptions()
        options.intra_op_num_threads = cores  # the worker's default: every core for one slot
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(
            work.model, sess_options=options, providers=["CPUExecutionProvider"]
        )
        if grid_cores:
            os.sched_setaffinity(0, grid_cores)
        grid.wait_for_nodes(1, timeout=600)
        with grid.client() as client:
            grid_run(client, work, work.make_rows(rng, args.batch_size), args)
            if grid_cores and raw_cores:  # after the warm-up: its task process exists now
                _pin(grid, raw_cores, grid_cores)
            raw_s, grid_s, spent = _rounds(
                client, session, work, rng, args, CpuMeter(grid), raw_cores, grid_cores
            )
    raw, on_grid = statistics.median(raw_s), statistics.median(grid_s)
    raw_cpu = spent.pop("raw")
    print(
        f"CPU s a round (means): raw {raw_cpu:.2f}; grid "
        + ", ".join(f"{role} {seconds:.2f}" for role, seconds in spent.items())
    )
    # Less noisy than wall time on a shared machine: the grid's CPU against raw's. On
    # the worker's side (task and daemon) it is what a volunteer's machine pays.
    worker_side = spent["task"] + spent["daemon"]
    print(
        f"cpu: raw over the grid's worker side {raw_cpu / worker_side:.2f}, "
        f"over all of the grid {raw_cpu / sum(spent.values()):.2f}"
    )
    print(f"raw: {args.rows / raw:.0f} rows/s, grid: {args.rows / on_grid:.0f} rows/s (medians)")
    print(f"ratio: {raw / on_grid:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
