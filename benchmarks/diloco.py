"""DiLoCo through the real grid against synchronous data-parallel training, bytes counted.

    PYTHONPATH=src .venv/bin/python benchmarks/diloco.py --seeds 0 1 \\
        [--workers 4 --rounds 40 --inner-steps 50 ...: the flags of diloco_simulate.py]
        [--plot docs/img/diloco_loss.png] [--timeout 1800]

Both runs train the character transformer on the corpus that ships with idlegrid (so no
data bytes travel in either), with K workers each owning one contiguous shard of the
training text, for the same number of inner steps per worker. Model, round and optimizer
settings are those of `benchmarks/diloco_simulate.py` (its defaults, or the flags above):

- sync: `simulate.run_sync`, one AdamW step per step on the K workers' batches together;
  a ring all-reduce moves 2(K-1)/K of the fp32 gradient per worker per step, each way.
- diloco: a `diloco-train` job on a real grid (`LocalGrid`: `idlegrid serve` and K
  `idlegrid worker` processes over WebSockets). Bytes are the grid's own per-round
  metrics: every payload a node fetched, every update blob or keyframe a task fetched,
  every result uploaded, for training and evaluation tasks alike; per worker = total / K.
  Round 0's payloads carry no weights (nodes draw them from the seed, as the sync run
  does); later ones name the compressed update, which each node fetches once.

It prints each run's final loss, its selected checkpoint (lowest validation loss; the
grid's evaluation task measures the whole held-out tenth, which stands for validation
and test alike here, while `diloco_simulate.py` keeps them apart) and bytes per
worker, the gap of the final weights, then as its last line `bytes_ratio: X loss_gap: Y%`
(sync bytes over DiLoCo bytes, each counted up to its selected checkpoint, means over
seeds; DiLoCo's selected loss over the baseline's, minus one), and plots both loss
curves per seed. `--corpus pydoc-topics` trains on the small corpus instead.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import diloco_simulate as simulate

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob

PLOT = Path(__file__).resolve().parents[1] / "docs" / "img" / "diloco_loss.png"


def grid_params(setup: simulate.Setup) -> dict[str, Any]:
    """The `diloco-train` settings of the simulation's setup."""
    return {
        "architecture": simulate.ARCHITECTURE,
        "model": setup.model.model_dump(mode="json"),
        "rounds": setup.rounds,
        "workers": setup.workers,
        "inner": setup.inner.model_dump(mode="json"),
        "outer": setup.outer.model_dump(mode="json"),
        "upload": setup.upload.model_dump(mode="json"),
        "download": setup.download.model_dump(mode="json"),
        "aggregation": setup.aggregation.model_dump(mode="json"),
        "seed": setup.seed,
        "eval_batches": setup.eval_batches,
        "eval_every": 1,
        "streaming": None if setup.streaming is None else setup.streaming.model_dump(mode="json"),
    }


def run_grid(local: LocalGrid, setup: simulate.Setup, *, timeout: float) -> simulate.Report:
    """One training job through the grid; its curve and bytes from the job's metrics."""
    started = time.perf_counter()
    with local.client() as client:
        dataset = corpus_dataset_blob(setup.corpus)
        job = client.submit("diloco-train", inputs={"dataset": dataset},
                            params=grid_params(setup))  # fmt: skip
        metrics = _follow(job, timeout)
    if metrics["state"] != "completed":
        raise RuntimeError(f"job {job.id} ended {metrics['state']}")
    # The grid evaluates on the whole held-out tenth (validation and test together): that
    # loss stands for both here; the bytes are those of the rounds up to each evaluation.
    curve, moved = [], 0
    for row in metrics["rounds"]:
        moved += ((row["bytes_up"] or 0) + (row["bytes_down"] or 0)) // setup.workers
        if row["eval_loss"] is not None:
            loss = float(row["eval_loss"])
            step = setup.inner.round_start(row["round"])
            curve.append(simulate.Checkpoint(step, loss, loss, moved))
    sent = metrics["bytes_up"] // setup.workers
    received = metrics["bytes_down"] // setup.workers
    return simulate.Report("diloco", curve, sent, received, time.perf_counter() - started)


def _follow(job: Any, timeout: float) -> dict[str, Any]:
    """Wait for the job; print its rounds (as `idlegrid metrics` has them) when it ends."""
    deadline = time.monotonic() + timeout
    done = 0
    while True:
        metrics = job.metrics()
        if metrics["rounds_done"] > done:
            done = metrics["rounds_done"]
            print(f"grid job {job.id}: {done}/{metrics['rounds_total']} rounds", flush=True)
        if metrics["state"] in ("completed", "failed", "cancelled"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"job {job.id} still {metrics['state']} after {timeout} s")
        time.sleep(1.0)
    for row in metrics["rounds"]:
        train = "-" if row["train_loss"] is None else f"{row['train_loss']:.4f}"
        print(f"grid round {row['round']}: train {train} eval {row['eval_loss']:.4f}, "
              f"{row['bytes_up']:,} B up, {row['bytes_down']:,} B down, "
              f"{row['round_time_s']:.1f} s, {row['nodes']} nodes", flush=True)  # fmt: skip
    return dict(metrics)


def plot(
    pairs: Sequence[tuple[int, simulate.Report, simulate.Report]], path: Path, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # Left the whole run; right its second half, where the runs' gap is a few hundredths.
    figure, (whole, late) = plt.subplots(1, 2, figsize=(12, 4.5))
    for axes in (whole, late):
        for seed, sync, grid in pairs:
            axes.plot([p.step for p in sync.curve], [p.test for p in sync.curve], "o-",
                      color="tab:blue", alpha=0.8, markersize=3,
                      label=f"sync data-parallel, seed {seed}")  # fmt: skip
            axes.plot([p.step for p in grid.curve], [p.test for p in grid.curve], "s--",
                      color="tab:orange", alpha=0.8, markersize=3,
                      label=f"DiLoCo through the grid, seed {seed}")  # fmt: skip
        axes.set_xlabel("inner steps per worker")
        axes.set_ylabel("held-out loss (nats/char)")
        axes.grid(alpha=0.3)
    end = max(p.step for _, sync, _ in pairs for p in sync.curve)
    tail = [p.test for _, sync, grid in pairs for p in sync.curve + grid.curve
            if p.step >= end / 2]  # fmt: skip
    late.set_xlim(end / 2, end * 1.01)
    late.set_ylim(min(tail) - 0.01, max(tail) + 0.01)
    whole.set_title(title)
    late.set_title("second half (zoomed)")
    whole.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--plot", type=Path, default=PLOT)
    parser.add_argument("--timeout", type=float, default=1800.0, help="per grid job")
    own, rest = parser.parse_known_args(argv)
    args = simulate.parse_args(rest)
    from idlegrid.kinds.diloco.inner import use_threads

    use_threads(args.threads)  # the sync run here as in simulate (one thread: the same bits)
    pairs = []
    with (
        tempfile.TemporaryDirectory(prefix="idlegrid-diloco-") as root,
        LocalGrid(Path(root), heartbeat_s=1.0, node_timeout_s=10.0) as local,
    ):
        for k in range(args.workers):
            local.start_worker(f"w{k}", kinds="diloco-train", threads=args.threads,
                               benchmark=False)  # fmt: skip
        local.wait_for_nodes(args.workers)
        for seed in args.seeds:
            setup = simulate.setup_from(args, seed)
            sync = simulate.run_sync(setup)
            grid = run_grid(local, setup, timeout=own.timeout)
            pairs.append((seed, sync, grid))
            for report in (sync, grid):
                chosen = report.selected
                print(f"seed {seed} {report.name}: test loss {report.final_loss:.4f} "
                      f"(selected {chosen.test:.4f} at step {chosen.step}), "
                      f"{report.bytes_per_worker:,} B per worker (sent "
                      f"{report.bytes_sent:,}, received {report.bytes_received:,}), "
                      f"{report.seconds:.0f} s", flush=True)  # fmt: skip
    setup = simulate.setup_from(args, args.seeds[0])
    plot(pairs, own.plot, f"character LM on {args.corpus}: K={args.workers} workers, "
                          f"H={args.inner_steps[0]}, {setup.rounds} rounds")  # fmt: skip
    print(f"loss curves: {own.plot}")
    syncs = [sync for _, sync, _ in pairs]
    grids = [grid for _, _, grid in pairs]
    final = simulate.compare(syncs, grids, selected=False)
    print(f"loss_gap of the final weights: {final.loss_gap:.2f}% (bytes_ratio "
          f"{final.bytes_ratio:.1f})")  # fmt: skip
    ratio, gap = simulate.ratio_line(syncs, grids)
    print(f"bytes_ratio: {ratio:.1f} loss_gap: {gap:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
