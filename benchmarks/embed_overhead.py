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
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from idlegrid.client import Client
from idlegrid.corpus import stdlib_paragraphs
from idlegrid.kinds.embed_text import COSINE_AGREE, EmbedTextParams, load_model, row_cosines
from idlegrid.localgrid import LocalGrid

# 512 had the best ratio of 128/256/512 on 2,000 texts (docs/benchmarks.md): a shard
# pays a fixed round trip and sorts only its own texts by length, so fewer, larger shards
# cost less. Past ~4 shards a job no longer spreads over several workers, which is what
# the grid is for, so larger is not better in general.
DEFAULT_SHARD_SIZE = 512
WARMUP_TEXTS = 64


@dataclass(frozen=True)
class Round:
    """One direct run and one grid run over the same texts."""

    direct_s: float
    grid_s: float
    min_cosine: float
    direct_cpu_s: float
    grid_cpu_s: dict[str, float]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    defaults = EmbedTextParams()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=2000,
                        help="paragraphs of stdlib_paragraphs to embed (default 2000)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="direct/grid pairs, interleaved; medians are reported (default 2)")
    parser.add_argument("--shard-size", type=int, default=DEFAULT_SHARD_SIZE,
                        help=f"texts per grid shard (default {DEFAULT_SHARD_SIZE})")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size,
                        help=f"texts per forward pass, both sides (default {defaults.batch_size})")
    parser.add_argument("--poll-s", type=float, default=0.5,
                        help="seconds between the SDK's job polls (default 0.5, the SDK's)")
    parser.add_argument("--grid-dir", type=Path, default=None,
                        help="run the grid here and keep its logs (default: a temp dir)")
    args = parser.parse_args(argv)
    if args.texts < 1 or args.rounds < 1 or args.shard_size < 1 or args.batch_size < 1:
        parser.error("--texts, --rounds, --shard-size and --batch-size must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    corpus = stdlib_paragraphs(args.texts)
    print(f"corpus: {len(corpus)} stdlib paragraphs, "
          f"{sum(map(len, corpus)) / len(corpus):.0f} characters on average")
    print(f"shard size {args.shard_size}, batch size {args.batch_size}, {args.rounds} rounds, "
          f"{psutil.cpu_count()} cores")
    model = load_model()
    model.encode(corpus[:WARMUP_TEXTS], batch_size=args.batch_size, show_progress_bar=False)
    with _grid_root(args.grid_dir) as root, LocalGrid(root) as grid:
        grid.start_worker("worker", kinds="embed-text")
        grid.wait_for_nodes(1, timeout=600)
        with grid.client() as client:
            _run_grid(client, list(reversed(corpus[:WARMUP_TEXTS])), args)  # first-call costs
            processes = {"coordinator": _process(grid.coordinator),
                         "worker": _process(grid.workers[0])}
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
    model: Any, client: Client, processes: dict[str, psutil.Process], texts: list[str],
    args: argparse.Namespace,
) -> Round:
    cpu_before = time.process_time()
    started = time.perf_counter()
    direct = model.encode(texts, batch_size=args.batch_size, normalize_embeddings=True,
                          convert_to_numpy=True, show_progress_bar=False)
    direct_s = time.perf_counter() - started
    direct_cpu_s = time.process_time() - cpu_before

    before = _cpu_seconds(processes)
    started = time.perf_counter()
    vectors = _run_grid(client, texts, args)
    grid_s = time.perf_counter() - started
    after = _cpu_seconds(processes)
    grid_cpu_s = {name: after[name] - before[name] for name in after}

    if vectors.shape != direct.shape:
        raise SystemExit(f"grid result has shape {vectors.shape}, direct {direct.shape}")
    min_cosine = float(row_cosines(vectors, direct).min())
    print(f"round: direct {len(texts) / direct_s:6.1f} texts/s ({direct_s:.1f} s), "
          f"grid {len(texts) / grid_s:6.1f} texts/s ({grid_s:.1f} s), "
          f"ratio {direct_s / grid_s:.2f}, min cosine {min_cosine:.6f}")
    print(f"  cpu s: direct {direct_cpu_s:.1f}; grid "
          + ", ".join(f"{name} {seconds:.1f}" for name, seconds in grid_cpu_s.items()))
    return Round(direct_s, grid_s, min_cosine, direct_cpu_s, grid_cpu_s)


def _run_grid(client: Client, texts: list[str], args: argparse.Namespace) -> np.ndarray:
    """Submit, wait, download: what a researcher's script does."""
    job = client.submit_embeddings(texts, shard_size=args.shard_size, batch_size=args.batch_size)
    job.wait(poll_s=args.poll_s, timeout=3600)
    return np.asarray(job.result())


def _cpu_seconds(processes: dict[str, psutil.Process]) -> dict[str, float]:
    """User plus system CPU seconds of each grid process and of this one (the client)."""
    seconds = {name: _busy(proc.cpu_times()) for name, proc in processes.items()}
    seconds["client"] = time.process_time()
    return seconds


def _busy(times: Any) -> float:
    return float(times.user + times.system)


def _report(rounds: list[Round], texts: int) -> int:
    direct_s = statistics.median(r.direct_s for r in rounds)
    grid_s = statistics.median(r.grid_s for r in rounds)
    min_cosine = min(r.min_cosine for r in rounds)
    agree = min_cosine >= COSINE_AGREE
    print(f"direct: {texts / direct_s:.1f} texts/s (median of {len(rounds)})")
    print(f"grid:   {texts / grid_s:.1f} texts/s (median of {len(rounds)})")
    print(f"check: min row cosine grid vs direct {min_cosine:.6f} "
          f"({'OK' if agree else 'FAILED'}, floor {COSINE_AGREE})")
    print(f"ratio: {direct_s / grid_s:.2f}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
