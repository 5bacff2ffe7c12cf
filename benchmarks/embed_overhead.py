"""Embedding throughput through the grid versus sentence-transformers in one process.

    .venv/bin/python benchmarks/embed_overhead.py [--texts 2000] [--rounds 2]

The same texts go through (a) `SentenceTransformer.encode` in this process and (b) a
`LocalGrid`: a coordinator on SQLite in a temporary directory and one worker process that
uses every core, reached through the SDK (`submit_embeddings`, `wait`, `result`). A grid
round is timed from submit to the result downloaded and parsed; the worker's start-up,
benchmark and model load happen before the first round. Rounds alternate (direct, grid,
direct, grid, ...) so that noise from other tenants of the machine hits both sides alike,
and the figures are medians. The last line printed is `ratio: X.XX`, grid throughput over
direct throughput; 1.00 would mean the grid costs nothing.

Each round also prints the CPU seconds every process spent during each phase: worker CPU
over direct CPU is the compute the grid adds; the coordinator's and the client's CPU is
what they take from the worker's cores; "others" is everything else on the machine. A
phase in which other processes kept more than 5% of the cores busy is flagged as
disturbed: its wall time (and, with torch threads spinning while they wait for a core,
its CPU time) says more about the neighbours than about the grid.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import psutil

from idlegrid.client import Client
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.embed_text.kind import COSINE_AGREE, EmbedTextParams, load_model, row_cosines
from idlegrid.kinds.embed_text.samples import stdlib_paragraphs

# The SDK's default shard size: what a researcher gets without tuning. Since split sorts
# the whole job's texts by length, shards pad no more than one global encode does and
# the shard size mostly sets the number of ~30 ms hand-overs (docs/benchmarks.md).
DEFAULT_SHARD_SIZE = EmbedTextParams().shard_size
WARMUP_TEXTS = 64
CORES = psutil.cpu_count() or 1
# Above this share of the cores busy with other processes, a phase's time says more
# about the neighbours than about what it measures.
DISTURBED_SHARE = 0.05

T = TypeVar("T")


@dataclass(frozen=True)
class Phase:
    """One timed run: wall seconds and CPU seconds of every process meanwhile."""

    seconds: float
    cpu: dict[str, float]


@dataclass(frozen=True)
class Round:
    """A direct run and a grid run over the same texts, and how well their results agree."""

    direct: Phase
    grid: Phase
    min_cosine: float


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = EmbedTextParams()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--texts",
        type=int,
        default=2000,
        help="paragraphs of stdlib_paragraphs to embed (default 2000)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="direct/grid pairs, interleaved; medians are reported (default 2)",
    )
    parser.add_argument(
        "--shard-size",
        type=int,
        default=DEFAULT_SHARD_SIZE,
        help=f"texts per grid shard (default {DEFAULT_SHARD_SIZE})",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=defaults.batch_size,
        help=f"texts per forward pass, both sides (default {defaults.batch_size})",
    )
    parser.add_argument(
        "--poll-s",
        type=float,
        default=0.5,
        help="seconds between the SDK's job polls (default 0.5, the SDK's)",
    )
    parser.add_argument(
        "--grid-dir",
        type=Path,
        default=None,
        help="run the grid here and keep its database and logs "
        "(default: a temporary directory, removed)",
    )
    args = parser.parse_args(argv)
    if min(args.texts, args.rounds, args.shard_size, args.batch_size) < 1:
        parser.error("--texts, --rounds, --shard-size and --batch-size must be >= 1")
    if args.poll_s <= 0:
        parser.error("--poll-s must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    corpus = stdlib_paragraphs(args.texts)
    print(
        f"corpus: {len(corpus)} stdlib paragraphs, "
        f"{sum(map(len, corpus)) / len(corpus):.0f} characters on average"
    )
    print(
        f"shard size {args.shard_size}, batch size {args.batch_size}, {args.rounds} rounds, "
        f"{CORES} cores"
    )
    model = load_model()
    model.encode(corpus[:WARMUP_TEXTS], batch_size=args.batch_size, show_progress_bar=False)
    with _grid_root(args.grid_dir) as root, LocalGrid(root, replication=1) as grid:
        grid.start_worker("worker", kinds="embed-text")
        grid.wait_for_nodes(1, timeout=600)
        processes = {"coordinator": _process(grid.coordinator), "worker": _process(grid.workers[0])}
        with grid.client() as client:
            # Texts no round uses, so first-call costs stay out of the rounds and no
            # blob of this job is found again later.
            _embed_on_grid(client, list(reversed(corpus[:WARMUP_TEXTS])), args)
            rounds = [
                _round(model, client, processes, _rotated(corpus, index), args)
                for index in range(args.rounds)
            ]
    return _report(rounds, len(corpus))


@contextmanager
def _grid_root(path: Path | None) -> Iterator[Path]:
    if path is not None:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="idlegrid-bench-") as tmp:
        yield Path(tmp)


def _process(popen: Any) -> psutil.Process:
    return psutil.Process(popen.pid)


def _rotated(corpus: list[str], index: int) -> list[str]:
    # Every round gets byte-different inputs and outputs: the grid stores blobs by hash,
    # and a round that found the last round's blobs would skip uploads and downloads.
    shift = index % len(corpus)
    return corpus[shift:] + corpus[:shift]


def _round(
    model: Any,
    client: Client,
    processes: dict[str, psutil.Process],
    texts: list[str],
    args: argparse.Namespace,
) -> Round:
    direct_phase, direct = _timed(processes, lambda: _embed_directly(model, texts, args))
    grid_phase, vectors = _timed(processes, lambda: _embed_on_grid(client, texts, args))
    if vectors.shape != direct.shape:
        raise SystemExit(f"grid result has shape {vectors.shape}, direct {direct.shape}")
    min_cosine = float(row_cosines(vectors, direct).min())
    print(
        f"round: direct {len(texts) / direct_phase.seconds:6.1f} texts/s "
        f"({direct_phase.seconds:.1f} s), grid {len(texts) / grid_phase.seconds:6.1f} texts/s "
        f"({grid_phase.seconds:.1f} s), ratio {direct_phase.seconds / grid_phase.seconds:.2f}, "
        f"min cosine {min_cosine:.9f}"
    )
    print(f"  cpu s during direct: {_cpu_line(direct_phase.cpu)}")
    print(f"  cpu s during grid:   {_cpu_line(grid_phase.cpu)}")
    for name, phase in (("direct", direct_phase), ("grid", grid_phase)):
        if _others_share(phase) > DISTURBED_SHARE:
            print(
                f"  disturbed: other processes kept {_others_share(phase):.0%} of the cores "
                f"busy during {name}"
            )
    return Round(direct_phase, grid_phase, min_cosine)


def _embed_directly(model: Any, texts: list[str], args: argparse.Namespace) -> np.ndarray:
    """One `encode` call over every text, as a researcher without the grid would."""
    return np.asarray(
        model.encode(
            texts,
            batch_size=args.batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=False,
        )
    )


def _embed_on_grid(client: Client, texts: list[str], args: argparse.Namespace) -> np.ndarray:
    """Submit, wait, download: what a researcher's script does."""
    job = client.submit_embeddings(texts, shard_size=args.shard_size, batch_size=args.batch_size)
    job.wait(poll_s=args.poll_s, timeout=3600)
    return np.asarray(job.result())


def _timed(processes: dict[str, psutil.Process], run: Callable[[], T]) -> tuple[Phase, T]:
    """Run `run`; its wall time and the CPU seconds each process spent meanwhile.

    "others" is whatever else kept the machine's cores busy: a phase with many seconds
    there was slowed by another tenant, not by what it measures.
    """
    before, machine_before = _cpu_seconds(processes), _machine_busy()
    started = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - started
    after, machine_after = _cpu_seconds(processes), _machine_busy()
    cpu = {name: after[name] - before[name] for name in after}
    cpu["others"] = max(0.0, machine_after - machine_before - sum(cpu.values()))
    return Phase(seconds, cpu), result


def _cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    """User plus system CPU seconds so far of each grid process and of this one.

    This process ("bench") encodes in a direct run and is the SDK client in a grid run;
    the grid's processes still wake for heartbeats and monitor passes during a direct run.
    """
    seconds = {name: _busy(proc.cpu_times()) for name, proc in processes.items()}
    seconds["bench"] = time.process_time()
    return seconds


def _machine_busy() -> float:
    """CPU seconds all cores of the machine have spent busy (or stolen) since boot."""
    times = psutil.cpu_times()._asdict()
    # Linux counts guest time inside user time too.
    idle = ("idle", "iowait", "guest", "guest_nice")
    return sum(seconds for name, seconds in times.items() if name not in idle)


def _busy(times: Any) -> float:
    return float(times.user + times.system)


def _cpu_line(seconds: dict[str, float]) -> str:
    return ", ".join(f"{name} {value:.1f}" for name, value in seconds.items())


def _others_share(phase: Phase) -> float:
    return phase.cpu["others"] / (phase.seconds * CORES)


def _own_cpu(phase: Phase) -> float:
    return sum(seconds for name, seconds in phase.cpu.items() if name != "others")


def _report(rounds: list[Round], texts: int) -> int:
    direct_s = statistics.median(r.direct.seconds for r in rounds)
    grid_s = statistics.median(r.grid.seconds for r in rounds)
    direct_cpu = statistics.median(_own_cpu(r.direct) for r in rounds)
    grid_cpu = statistics.median(_own_cpu(r.grid) for r in rounds)
    min_cosine = min(r.min_cosine for r in rounds)
    agree = min_cosine >= COSINE_AGREE
    print(
        f"direct: {texts / direct_s:.1f} texts/s, {direct_cpu:.1f} cpu s (medians of {len(rounds)})"
    )
    print(f"grid:   {texts / grid_s:.1f} texts/s, {grid_cpu:.1f} cpu s (medians of {len(rounds)})")
    print(
        f"check: min row cosine grid vs direct {min_cosine:.9f} "
        f"({'OK' if agree else 'FAILED'}, floor {COSINE_AGREE})"
    )
    disturbed = sum(
        1 for r in rounds if max(_others_share(r.direct), _others_share(r.grid)) > DISTURBED_SHARE
    )
    if disturbed:
        print(f"warning: {disturbed} of {len(rounds)} rounds disturbed by other processes")
    print(f"ratio: {direct_s / grid_s:.2f}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
