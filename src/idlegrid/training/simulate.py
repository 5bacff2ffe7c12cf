"""DiLoCo against synchronous data-parallel training, in one process, bytes counted.

Both train the character transformer on the built-in corpus with K workers, each owning
one contiguous shard of the training text, for the same number of inner steps per worker:

- DiLoCo: every round each simulated worker gets a real task payload (round 0's carries
  the weights; later ones only the previous round's compressed outer update, which the
  worker applies to its cached weights), runs `worker.run_task` as a node would, and
  sends back a real result blob; the coordinator closes the round with
  `rounds.close_round`. Bytes are the lengths of those blobs, per worker.
- Synchronous: one AdamW step per step on the K workers' batches together (the same
  gradient as averaging K per-worker gradients). A ring all-reduce moves 2(K-1)/K of the
  fp32 gradient bytes per worker per step; that is what is counted (a lower bound: a
  worker also receives about as much as it sends).

Run: ``python -m idlegrid.training.simulate --workers 4 --inner-steps 50 --rounds 10``.
Data is on every machine (the corpus ships with idlegrid), so neither run counts it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from idlegrid.training import corpus, models, rounds, tasks
from idlegrid.training.aggregate import Aggregation
from idlegrid.training.compression import Compression, decode
from idlegrid.training.data import TokenData
from idlegrid.training.inner import InnerSettings
from idlegrid.training.outer import OuterSettings
from idlegrid.training.worker import TrainSpec, run_task
from idlegrid.training.worker_state import WorkerState

ARCHITECTURE = "transformer-lm"


@dataclass(frozen=True)
class Setup:
    """One comparison: model, workers, rounds, and DiLoCo's settings."""

    workers: int = 4
    rounds: int = 10
    model: models.LMConfig = field(default_factory=models.LMConfig)
    inner: InnerSettings = field(default_factory=lambda: InnerSettings(steps=50))
    outer: OuterSettings = field(default_factory=OuterSettings)
    upload: Compression = field(default_factory=Compression)
    download: Compression = field(default_factory=Compression)
    aggregation: Aggregation = field(default_factory=Aggregation)
    seed: int = 0
    eval_batches: int = 16

    @property
    def steps(self) -> int:
        """Inner steps per worker over the whole run (both runs take this many)."""
        return self.rounds * self.inner.steps

    def spec(self) -> TrainSpec:
        return TrainSpec(ARCHITECTURE, self.model, self.inner, self.upload, self.eval_batches)


@dataclass
class Report:
    """One run's evaluation curve and its traffic per worker."""

    name: str
    curve: list[tuple[int, float]]  # (inner steps per worker so far, held-out loss)
    bytes_sent: int  # per worker
    bytes_received: int  # per worker
    seconds: float = 0.0

    @property
    def final_loss(self) -> float:
        return self.curve[-1][1]

    @property
    def bytes_per_worker(self) -> int:
        return self.bytes_sent + self.bytes_received


Progress = Callable[[str], None]


def evaluate(setup: Setup, weights: np.ndarray) -> float:
    """Held-out loss of weights on the fixed evaluation batches of the corpus."""
    from idlegrid.training import inner

    return inner.evaluate(
        ARCHITECTURE, setup.model, weights, TokenData(corpus.eval_tokens()),
        batches=setup.eval_batches, batch_size=setup.inner.batch_size,
        seq_len=setup.inner.seq_len,
    )  # fmt: skip


def run_diloco(setup: Setup, progress: Progress = print) -> Report:
    """DiLoCo rounds through real payload and result blobs; bytes per worker counted."""
    started = time.perf_counter()
    state = rounds.initial_state(models.init_weights(ARCHITECTURE, setup.model, setup.seed))
    nodes = [WorkerState() for _ in range(setup.workers)]
    train = tasks.CorpusSlice("train", 0, len(corpus.train_tokens()))
    sent, received = np.zeros(setup.workers, np.int64), np.zeros(setup.workers, np.int64)
    curve = [(0, evaluate(setup, state.weights))]
    chain: tuple[tasks.Link, ...] = ()
    for round_number in range(setup.rounds):
        updates = []
        for shard, node in enumerate(nodes):
            payload = tasks.encode_task(_task(setup, state, train, shard, chain))
            received[shard] += len(payload)
            result = run_task(tasks.decode_task(payload), setup.spec(), node)
            output = tasks.encode_result(result)
            sent[shard] += len(output)
            updates.append(_update(output))
        closed = rounds.close_round(
            state, updates, rule=setup.aggregation, outer=setup.outer, download=setup.download
        )
        chain = (tasks.Link(tasks.WeightsRef(state.round, state.digest), closed.message),)
        state = closed.state
        curve.append(((round_number + 1) * setup.inner.steps, evaluate(setup, state.weights)))
        progress(f"diloco round {round_number + 1}/{setup.rounds}: "
                 f"train {closed.train_loss:.4f} eval {curve[-1][1]:.4f}")  # fmt: skip
    elapsed = time.perf_counter() - started
    return Report("diloco", curve, int(sent.mean()), int(received.mean()), elapsed)


def _task(
    setup: Setup,
    state: rounds.RoundState,
    train: tasks.CorpusSlice,
    shard: int,
    chain: tuple[tasks.Link, ...],
) -> tasks.TaskPayload:
    return tasks.TaskPayload(
        mode="train",
        stream="simulation",
        round=state.round,
        shard=shard,
        seed=rounds.task_seed(setup.seed, state.round, shard),
        target=tasks.WeightsRef(state.round, state.digest),
        data=tasks.shard_ref(train, shard, setup.workers),
        weights=state.weights if not chain else None,
        chain=chain,
    )


def _update(output: bytes) -> rounds.Update:
    result = tasks.decode_result(output)
    assert result.update is not None
    return rounds.Update(decode(result.update), result.round, result.loss_mean)


def run_sync(setup: Setup, progress: Progress = print) -> Report:
    """Synchronous data-parallel AdamW: every step averages all workers' gradients."""
    from idlegrid.training import inner

    started = time.perf_counter()
    weights = models.init_weights(ARCHITECTURE, setup.model, setup.seed)
    module = inner.load_module(ARCHITECTURE, setup.model, weights, "cpu")
    step_once = _sync_stepper(setup, module)
    curve = [(0, evaluate(setup, weights))]
    for step in range(setup.steps):
        step_once(step)
        if (step + 1) % setup.inner.steps == 0:
            curve.append((step + 1, evaluate(setup, inner.flat_weights(module))))
            progress(f"sync step {step + 1}/{setup.steps}: eval {curve[-1][1]:.4f}")
    # Ring all-reduce: each worker sends 2(K-1)/K of the gradient a step, and receives as much.
    moved = setup.steps * allreduce_bytes(weights.size * 4, setup.workers)
    return Report("sync", curve, moved, moved, time.perf_counter() - started)


def _sync_stepper(setup: Setup, module: Any) -> Callable[[int], None]:
    import torch

    from idlegrid.training import inner

    settings = setup.inner
    optimizer = torch.optim.AdamW(
        module.parameters(), lr=settings.lr, betas=(settings.beta1, settings.beta2),
        weight_decay=settings.weight_decay,
    )  # fmt: skip
    shards = [TokenData(tokens) for tokens in _shard_tokens(setup.workers)]
    generators = [np.random.default_rng([setup.seed, k]) for k in range(setup.workers)]

    def step_once(step: int) -> None:
        parts = [
            data.batch(rng, settings.batch_size, settings.seq_len)
            for data, rng in zip(shards, generators, strict=True)
        ]
        inputs, targets = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
        for group in optimizer.param_groups:
            group["lr"] = settings.lr * min(1.0, (step + 1) / (settings.warmup_steps + 1))
        loss = inner.batch_loss(module, "language-model", inputs, targets, "cpu")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), settings.grad_clip)
        optimizer.step()

    return step_once


def allreduce_bytes(gradient_bytes: int, workers: int) -> int:
    """Bytes a ring all-reduce moves per worker: 2(K-1)/K of the gradient."""
    return 2 * (workers - 1) * gradient_bytes // workers


def _shard_tokens(workers: int) -> list[np.ndarray]:
    train = corpus.train_tokens()
    bounds = np.linspace(0, len(train), workers + 1).astype(np.int64)
    return [train[bounds[k] : bounds[k + 1]] for k in range(workers)]


# -- command line -----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--inner-steps", type=int, default=50, help="H")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW lr of both runs")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--upload", default="int8", choices=["none", "int8", "int4", "topk"])
    parser.add_argument("--download", default="int8", choices=["none", "int8", "int4", "topk"])
    parser.add_argument("--topk-fraction", type=float, default=0.01)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--warmup", type=int, default=0, help="inner lr warmup steps a task")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    return parser.parse_args(argv)


def setup_from(args: argparse.Namespace, seed: int) -> Setup:
    inner = InnerSettings(
        steps=args.inner_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup,
    )
    return Setup(
        workers=args.workers,
        rounds=args.rounds,
        model=models.LMConfig(
            vocab=len(corpus.vocabulary()),
            context=args.seq_len,
            width=args.width,
            layers=args.layers,
        ),  # fmt: skip
        inner=inner,
        outer=OuterSettings(lr=args.outer_lr, momentum=args.outer_momentum),
        upload=Compression(method=args.upload, topk_fraction=args.topk_fraction),
        download=Compression(method=args.download, topk_fraction=args.topk_fraction),
        seed=seed,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run both trainings for every seed; print losses, bytes and the ratio line last."""
    from idlegrid.training.inner import use_threads

    args = parse_args(argv)
    use_threads(args.threads)
    pairs = []
    for seed in args.seeds:
        setup = setup_from(args, seed)
        pairs.append((run_sync(setup), run_diloco(setup)))
        for report in pairs[-1]:
            print(f"seed {seed} {report.name}: eval loss {report.final_loss:.4f}, "
                  f"sent {report.bytes_sent:,} B, received {report.bytes_received:,} B "
                  f"per worker, {report.seconds:.0f} s")  # fmt: skip
    sync_bytes = np.mean([sync.bytes_per_worker for sync, _ in pairs])
    diloco_bytes = np.mean([diloco.bytes_per_worker for _, diloco in pairs])
    sync_loss = np.mean([sync.final_loss for sync, _ in pairs])
    diloco_loss = np.mean([diloco.final_loss for _, diloco in pairs])
    print(f"bytes_ratio: {sync_bytes / diloco_bytes:.1f} "
          f"loss_gap: {100 * (diloco_loss / sync_loss - 1):.2f}%")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
