"""Peer-to-peer averaging (standing averagers, compressed all-reduce) against coordinator
mode: what a volunteer pays in bytes and time, and the loss.

    PYTHONPATH=src .venv/bin/python benchmarks/diloco_p2p.py [--workers 4 --rounds 6]
        [--inner-steps 20 --width 64 --layers 2] [--timeout 1800] [--group-timeout 120]

One real grid (`LocalGrid`: `idlegrid serve` with its bootstrap DHT peer, K `idlegrid
worker` processes of one trusted account, over WebSockets and Hivemind's p2p daemon on
this machine) trains the character transformer on the shipped corpus twice, with the
same seed and the same compression (the job's default: int8 up, int8 down): once with
`averaging: "p2p"` and once in coordinator mode, each on K workers started for it (so
each mode's round 0 pays for starting the workers' task processes, and p2p's for their
standing averagers too). Per round and per mode it prints:

- coordinator bytes: what the grid's round metrics count through the coordinator (every
  payload a node fetched, every update or keyframe a task fetched, every result uploaded);
- per-worker bytes: coordinator mode, the coordinator's bytes / K (all of a worker's
  traffic goes through it); p2p, the coordinator's bytes / K plus the mean of what each
  member's all-reduce sent and received, as the members measured it on their streams
  (every frame of every attempt: contributions, answers, headers; not the p2p daemon's
  own framing, encryption or the DHT's meetings);
- wall time (the round's open to close) and the round's train and held-out losses.

Last line: `coordinator_bytes_ratio: X worker_bytes_ratio: Y round_time_ratio: Z
loss_diff: W%`: X, the coordinator's bytes of the whole job, coordinator mode over p2p;
Y, a worker's bytes over the training rounds, p2p over coordinator mode; Z, the mean
training round's time, p2p over coordinator mode; W, the final held-out loss of p2p
against coordinator mode's (relative difference).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob
from idlegrid.training import models


def params(options: argparse.Namespace) -> dict[str, Any]:
    """The job's settings (coordinator mode); p2p adds its averaging and pool."""
    return {
        "model": {"width": options.width, "layers": options.layers, "heads": 2, "context": 64},
        "inner": {"steps": options.inner_steps, "batch_size": 16, "seq_len": 64, "lr": 0.003},
        "workers": options.workers,
        "rounds": options.rounds,
        "eval_batches": 8,
        "seed": options.seed,
    }


def run(local: LocalGrid, settings: dict[str, Any], timeout: float) -> dict[str, Any]:
    started = time.perf_counter()
    with local.client() as client:
        job = client.submit("diloco-train", inputs={"dataset": corpus_dataset_blob()},
                            params=settings)  # fmt: skip
        job.wait(timeout=timeout)
        metrics = job.metrics()
    if metrics["state"] != "completed":
        raise RuntimeError(f"job {job.id} ended {metrics['state']}")
    metrics["wall_s"] = time.perf_counter() - started
    return dict(metrics)


def on_new_workers(local: LocalGrid, mode: str, k: int, job: Callable[[], Any]) -> Any:
    """Run `job` on K workers started for it, then stop them: each mode's round 0 pays
    for starting a worker's task process (and in p2p mode its averager), as a volunteer's
    first job does; neither mode inherits processes the other warmed."""
    names = [f"{mode}-{i}" for i in range(k)]
    workers = [local.start_worker(name, kinds="diloco-train", threads=1, benchmark=False,
                                  account="lab") for name in names]  # fmt: skip
    try:
        local.wait_for_nodes(k, names=names)
        return job()
    finally:
        for worker in workers:
            local.stop_worker(worker)


def through(row: dict[str, Any]) -> int:
    return int((row["bytes_up"] or 0) + (row["bytes_down"] or 0))


def per_worker(row: dict[str, Any], workers: int) -> float:
    """A worker's bytes in one round: its share of the coordinator's, plus its all-reduce's."""
    wire = row.get("wire_bytes") or {}
    p2p = sum(wire.values()) / len(wire) if wire else 0.0
    return through(row) / workers + p2p


def training(metrics: dict[str, Any]) -> list[dict[str, Any]]:
    return [row for row in metrics["rounds"] if not row["final"]]


def report(mode: str, metrics: dict[str, Any], workers: int) -> None:
    print(f"{mode}: {metrics['wall_s']:.1f} s for the job")
    print("  round  coordinator_B  per_worker_B  wall_s  train_loss  eval_loss  averaging")
    for row in metrics["rounds"]:
        train = "-" if row["train_loss"] is None else f"{row['train_loss']:.5f}"
        held = "-" if row["eval_loss"] is None else f"{row['eval_loss']:.5f}"
        how = "final" if row["final"] else row.get("averaging") or "coordinator"
        if row.get("agreeing") is not None and how == "p2p":
            how += f" ({row['agreeing']} agreeing)"
        if row.get("fallback_reason"):
            how += f": {row['fallback_reason'][:100]}"
        print(f"  {row['round']:5d}  {through(row):13d}  {per_worker(row, workers):12.0f}  "
              f"{row['round_time_s'] or 0:6.1f}  {train:>10}  {held:>9}  {how}")  # fmt: skip
    rows = training(metrics)
    bytes_ = sum(per_worker(row, workers) for row in rows) / len(rows)
    times = [row["round_time_s"] or 0.0 for row in rows]
    print(
        f"  a training round, per worker: {bytes_:.0f} bytes sent and received, "
        f"{sum(times) / len(times):.2f} s (min {min(times):.2f}, max {max(times):.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--group-timeout", type=float, default=120.0,
                        help="p2p: seconds each averaging attempt waits for its group")  # fmt: skip
    parser.add_argument("--root", type=Path, default=None, help="keep the grid's files here")
    options = parser.parse_args()
    base = params(options)
    p2p = {**base, "averaging": "p2p", "pool": {"accounts": ["lab"]},
           "group_timeout_s": options.group_timeout, "round_timeout_s": 600.0}  # fmt: skip
    config = models.parse_config("transformer-lm", base["model"])
    size = models.parameter_count("transformer-lm", config)
    k = options.workers
    with tempfile.TemporaryDirectory() as scratch, LocalGrid(
        options.root or Path(scratch), heartbeat_s=0.5, node_timeout_s=10.0, min_lease_s=600.0,
        p2p=True,
    ) as local:  # fmt: skip
        peer = on_new_workers(local, "p2p", k, lambda: run(local, p2p, options.timeout))
        coordinated = on_new_workers(local, "coordinator", k,
                                     lambda: run(local, base, options.timeout))  # fmt: skip
    print(f"{k} workers, {options.rounds} rounds of {options.inner_steps} inner steps, "
          f"{size} parameters")  # fmt: skip
    report("p2p", peer, k)
    report("coordinator", coordinated, k)
    ratio = sum(map(through, coordinated["rounds"])) / sum(map(through, peer["rounds"]))
    worker = sum(per_worker(r, k) for r in training(peer)) / sum(
        per_worker(r, k) for r in training(coordinated)
    )
    time_ratio = _mean_time(peer) / _mean_time(coordinated)
    # Round 0 starts each worker's task process, and in p2p mode its standing averager (a
    # worker that held p2p work before has it running): the later rounds are what a round
    # costs once they stand.
    later = _mean_time(peer, skip=1) / _mean_time(coordinated, skip=1)
    print(f"after round 0: round_time_ratio: {later:.2f}")
    mine, theirs = peer["rounds"][-1]["eval_loss"], coordinated["rounds"][-1]["eval_loss"]
    print(
        f"coordinator_bytes_ratio: {ratio:.2f} worker_bytes_ratio: {worker:.2f} "
        f"round_time_ratio: {time_ratio:.2f} loss_diff: {100 * (mine - theirs) / theirs:.4f}%"
    )


def _mean_time(metrics: dict[str, Any], *, skip: int = 0) -> float:
    times = [row["round_time_s"] or 0.0 for row in training(metrics)[skip:]]
    return sum(times) / len(times)


if __name__ == "__main__":
    main()
