"""DiLoCo against synchronous data-parallel training, in one process, bytes counted.

Both train the character transformer on the built-in corpus with K workers, each owning
one contiguous shard of the training text, for the same number of inner steps per worker:

- DiLoCo: every round each simulated worker gets a real task payload (round 0's carries
  the weights; later ones only the previous round's compressed outer update, which the
  worker applies to its cached weights), runs `runner.run_task` as a node would, and
  sends back a real result blob; the coordinator closes the round with
  `closing.close_round`. Bytes are the lengths of those blobs, per worker.
- Synchronous: one AdamW step per step on the K workers' batches together (the same
  gradient as averaging K per-worker gradients). A ring all-reduce moves 2(K-1)/K of the
  fp32 gradient bytes per worker per step; that is what is counted (a lower bound: a
  worker also receives about as much as it sends).

Both follow one inner lr schedule over the run's steps (`inner.run_lr`: linear warmup,
then cosine decay); a DiLoCo task of round r picks it up at run step r * H
(`inner.for_round`). Each run may have its own peak lr (`--lr` for DiLoCo's inner AdamW,
`--sync-lr` for the baseline), so each is tuned, not one handicapped by the other's.

Run: ``python -m idlegrid.training.simulate --total-steps 1000 --inner-steps 50 100``
(several H share one synchronous run a seed; ``--seeds 0 1`` averages seeds, ``--jobs 3``
runs three trainings at once). docs/benchmarks.md has the figures and their commands.
Data is on every machine (the corpus ships with idlegrid), so neither run counts it.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from idlegrid.training import closing, corpus, models, tasks
from idlegrid.training.aggregate import Aggregation
from idlegrid.training.compression import Compression, decode
from idlegrid.training.data import TokenData
from idlegrid.training.flat import digest
from idlegrid.training.inner import InnerSettings, run_lr
from idlegrid.training.outer import OuterSettings
from idlegrid.training.runner import TrainSpec, run_task
from idlegrid.training.worker_state import WorkerState

ARCHITECTURE = "transformer-lm"


@dataclass(frozen=True)
class Setup:
    """One comparison: model, workers, rounds, and DiLoCo's settings."""

    # The defaults are the settings tuned in docs/benchmarks-history.md ("DiLoCo simulation"):
    # 60 rounds of H = 100 (6,000 steps), inner AdamW peak lr 3e-3 with 5% warmup and
    # cosine decay over the run, AdamW moments kept per shard between rounds, outer
    # Nesterov lr 1.0, int4 both ways with error feedback; baseline peak lr 1e-2.
    workers: int = 4
    rounds: int = 60
    model: models.LMConfig = field(default_factory=models.LMConfig)
    inner: InnerSettings = field(
        default_factory=lambda: InnerSettings(
            steps=100, lr=3e-3, run_warmup_steps=300, decay_steps=6000, keep_state=True
        )
    )
    outer: OuterSettings = field(default_factory=lambda: OuterSettings(lr=1.0))
    upload: Compression = field(
        default_factory=lambda: Compression(method="int4", error_feedback=True)
    )
    download: Compression = field(default_factory=lambda: Compression(method="int4"))
    aggregation: Aggregation = field(default_factory=Aggregation)
    seed: int = 0
    eval_batches: int = 16
    sync_lr: float | None = 1e-2  # the baseline's peak lr, tuned apart; None: inner.lr
    # Nodes build round 0's weights from the seed (as the baseline's workers would) and
    # round 0's payload leaves them out; otherwise it carries them inline (fp32).
    seeded_start: bool = False

    @property
    def steps(self) -> int:
        """Inner steps per worker over the whole run (both runs take this many)."""
        return self.inner.total_steps(self.rounds)

    def spec(self) -> TrainSpec:
        """What every task runs with (`run_task` finds a round's H and place in the run)."""
        return TrainSpec(ARCHITECTURE, self.model, self.inner, self.upload, self.eval_batches)

    def round_ends(self) -> list[int]:
        """The inner step (per worker) at which each round ends."""
        return [self.inner.round_start(r + 1) for r in range(self.rounds)]


@dataclass
class Report:
    """One run's evaluation curve and its traffic per worker."""

    name: str
    curve: list[tuple[int, float]]  # (inner steps per worker so far, held-out loss)
    bytes_sent: int  # per worker
    bytes_received: int  # per worker
    seconds: float = 0.0
    # Bytes inline weights add to round 0's payload (per worker): in bytes_received unless
    # the nodes started from the seed.
    initial_weights: int = 0
    seeded: bool = False

    @property
    def final_loss(self) -> float:
        return self.curve[-1][1]

    @property
    def best(self) -> tuple[int, float]:
        """The lowest held-out loss on the curve, and the step it was reached at.

        Long runs on the small corpus overfit (the held-out loss turns up again); what a
        researcher keeps is the best checkpoint, so runs are compared there too.
        """
        return min(self.curve, key=lambda point: point[1])

    @property
    def bytes_per_worker(self) -> int:
        return self.bytes_sent + self.bytes_received

    def bytes_with_initial_weights(self, inline: bool) -> int:
        """Traffic per worker if round 0 carries the weights (inline) or not (seeded)."""
        counted = 0 if self.seeded else self.initial_weights
        return self.bytes_per_worker - counted + (self.initial_weights if inline else 0)


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
    state = closing.initial_state(models.init_weights(ARCHITECTURE, setup.model, setup.seed))
    nodes = [WorkerState() for _ in range(setup.workers)]
    train = tasks.CorpusSlice("train", 0, len(corpus.train_tokens()))
    sent, received = np.zeros(setup.workers, np.int64), np.zeros(setup.workers, np.int64)
    curve = [(0, evaluate(setup, state.weights))]
    chain: tuple[tasks.Link, ...] = ()
    initial = np.zeros(setup.workers, np.int64)
    for round_number in range(setup.rounds):
        updates = []
        for shard, node in enumerate(nodes):
            task = _task(setup, state, train, shard, chain)
            payload = tasks.encode_task(task)
            if task.weights is not None:
                lean = tasks.encode_task(dataclasses.replace(task, weights=None))
                initial[shard] = len(payload) - len(lean)
                if setup.seeded_start:
                    seeded = models.init_weights(ARCHITECTURE, setup.model, setup.seed)
                    node.remember_weights(digest(seeded), seeded)
                    payload = lean
            received[shard] += len(payload)
            result = run_task(tasks.decode_task(payload), setup.spec(), node)
            output = tasks.encode_result(result)
            sent[shard] += len(output)
            updates.append(_update(output))
        closed = closing.close_round(
            state, updates, rule=setup.aggregation, outer=setup.outer, download=setup.download
        )
        chain = (tasks.Link(tasks.WeightsRef(state.round, state.digest), closed.message),)
        state = closed.state
        curve.append((setup.inner.round_start(round_number + 1), evaluate(setup, state.weights)))
        progress(f"diloco round {round_number + 1}/{setup.rounds}: "
                 f"train {closed.train_loss:.4f} eval {curve[-1][1]:.4f}")  # fmt: skip
    elapsed = time.perf_counter() - started
    return Report(
        "diloco", curve, int(sent.mean()), int(received.mean()), elapsed, int(initial.mean()),
        seeded=setup.seeded_start,
    )  # fmt: skip


def _task(
    setup: Setup,
    state: closing.RoundState,
    train: tasks.CorpusSlice,
    shard: int,
    chain: tuple[tasks.Link, ...],
) -> tasks.TaskPayload:
    return tasks.TaskPayload(
        mode="train",
        stream="simulation",
        round=state.round,
        shard=shard,
        seed=closing.task_seed(setup.seed, state.round, shard),
        target=tasks.WeightsRef(state.round, state.digest),
        data=tasks.shard_ref(train, shard, setup.workers),
        weights=state.weights if not chain else None,
        chain=chain,
    )


def _update(output: bytes) -> closing.Update:
    result = tasks.decode_result(output)
    assert result.update is not None
    return closing.Update(decode(result.update), result.round, result.loss_mean)


def run_sync(setup: Setup, progress: Progress = print) -> Report:
    """Synchronous data-parallel AdamW: every step averages all workers' gradients."""
    from idlegrid.training import inner

    started = time.perf_counter()
    weights = models.init_weights(ARCHITECTURE, setup.model, setup.seed)
    module = inner.load_module(ARCHITECTURE, setup.model, weights, "cpu")
    step_once = _sync_stepper(setup, module)
    curve = [(0, evaluate(setup, weights))]
    checkpoints = set(setup.round_ends())
    for step in range(setup.steps):
        step_once(step)
        if step + 1 in checkpoints:
            curve.append((step + 1, evaluate(setup, inner.flat_weights(module))))
            progress(f"sync step {step + 1}/{setup.steps}: eval {curve[-1][1]:.4f}")
    # Ring all-reduce: each worker sends 2(K-1)/K of the gradient a step, and receives as much.
    moved = setup.steps * allreduce_bytes(weights.size * 4, setup.workers)
    return Report("sync", curve, moved, moved, time.perf_counter() - started)


def _sync_stepper(setup: Setup, module: Any) -> Callable[[int], None]:
    import torch

    from idlegrid.training import inner

    settings = setup.inner
    if setup.sync_lr is not None:
        settings = settings.model_copy(update={"lr": setup.sync_lr})
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
            group["lr"] = run_lr(settings, step)  # the run's schedule, no per-task warmup
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
    parser.add_argument("--rounds", type=int, default=60, help="ignored with --total-steps")
    parser.add_argument("--inner-steps", type=int, nargs="+", default=[100],
                        help="H; several values need --total-steps")  # fmt: skip
    parser.add_argument("--total-steps", type=int, default=None,
                        help="inner steps per worker of the run; rounds = this / H")  # fmt: skip
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3, help="DiLoCo's inner AdamW peak lr")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    methods = ["none", "int8", "int4", "sign", "topk"]
    parser.add_argument("--upload", default="int4", choices=methods)
    parser.add_argument("--download", default="int4", choices=methods)
    parser.add_argument("--topk-fraction", type=float, default=0.01)
    parser.add_argument("--outer-lr", type=float, default=1.0)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    parser.add_argument("--warmup", type=int, default=0, help="inner lr warmup steps a task")
    parser.add_argument("--ramp", type=int, nargs="*", default=[],
                        help="H of the first rounds (then --inner-steps)")  # fmt: skip
    parser.add_argument("--keep-state", action=argparse.BooleanOptionalAction, default=True,
                        help="each worker keeps its AdamW moments between rounds")  # fmt: skip
    parser.add_argument(
        "--run-warmup",
        type=int,
        default=None,
        help="lr warmup steps of the run (default: 5%% of its steps)",
    )
    parser.add_argument("--schedule", default="cosine", choices=["constant", "cosine"],
                        help="cosine: decay over the run's inner steps (both runs)")  # fmt: skip
    parser.add_argument("--min-lr-ratio", type=float, default=0.1, help="lr at the decay's end")
    parser.add_argument("--sync-lr", type=float, default=1e-2, help="the baseline's peak lr")
    parser.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=True,
                        help="quantized upload keeps its rounding error on the worker")  # fmt: skip
    parser.add_argument("--chunk-size", type=int, default=256, help="values per scale")
    parser.add_argument(
        "--seeded-start",
        action="store_true",
        help="nodes build round 0's weights from the seed, not the payload",
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="averaged")
    parser.add_argument("--runs", default="both", choices=["both", "sync", "diloco"],
                        help="one run alone (tuning); the ratio line needs both")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads a run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one process each")
    args = parser.parse_args(argv)
    if args.total_steps is None:
        if len(args.inner_steps) > 1:
            parser.error("several --inner-steps need --total-steps (the same run length)")
        args.total_steps = args.rounds * args.inner_steps[0]
    rest = args.total_steps - sum(args.ramp)
    for h in args.inner_steps:
        if rest <= 0 or rest % h:
            parser.error(f"--total-steps {args.total_steps} less the ramp's {sum(args.ramp)} "
                         f"is not a positive multiple of H={h}")  # fmt: skip
    return args


def setup_from(args: argparse.Namespace, seed: int, inner_steps: int | None = None) -> Setup:
    """The setup the command line describes, for one seed and one H (default: the first)."""
    steps = args.inner_steps[0] if inner_steps is None else inner_steps
    inner = InnerSettings(
        steps=steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup,
        run_warmup_steps=args.total_steps // 20 if args.run_warmup is None else args.run_warmup,
        decay_steps=args.total_steps if args.schedule == "cosine" else None,
        min_lr_ratio=args.min_lr_ratio,
        keep_state=args.keep_state,
        ramp=tuple(args.ramp),
    )
    return Setup(
        workers=args.workers,
        rounds=len(args.ramp) + (args.total_steps - sum(args.ramp)) // steps,
        model=models.LMConfig(
            vocab=len(corpus.vocabulary()),
            context=args.seq_len,
            width=args.width,
            layers=args.layers,
        ),  # fmt: skip
        inner=inner,
        outer=OuterSettings(lr=args.outer_lr, momentum=args.outer_momentum),
        upload=Compression(
            method=args.upload,
            topk_fraction=args.topk_fraction,
            chunk_size=args.chunk_size,
            error_feedback=args.error_feedback,
        ),  # fmt: skip
        download=Compression(
            method=args.download, topk_fraction=args.topk_fraction, chunk_size=args.chunk_size
        ),
        seed=seed,
        sync_lr=args.sync_lr,
        seeded_start=args.seeded_start,
    )


def _print_report(seed: int, report: Report, label: str = "") -> None:
    step, best = report.best
    print(f"seed {seed} {report.name}{label}: eval loss {report.final_loss:.4f} "
          f"(best {best:.4f} at step {step}), "
          f"sent {report.bytes_sent:,} B, received {report.bytes_received:,} B "
          f"per worker, {report.seconds:.0f} s")  # fmt: skip


def ratio_line(
    sync: Sequence[Report], diloco: Sequence[Report], *, inline: bool | None = None
) -> tuple[float, float]:
    """bytes_ratio (sync bytes over DiLoCo bytes) and loss_gap (%), each averaged over seeds.

    The loss_gap compares each run's best checkpoint (`Report.best`: its lowest held-out
    loss, both evaluated at the same steps), so a baseline that overfits by the end is
    not counted against itself; `final_gap` compares the final weights. `inline` counts
    DiLoCo's round 0 with (True) or without (False) its weights inline; None counts it
    as it ran.
    """
    sync_bytes = np.mean([r.bytes_per_worker for r in sync])
    diloco_bytes = np.mean([
        r.bytes_per_worker if inline is None else r.bytes_with_initial_weights(inline)
        for r in diloco
    ])  # fmt: skip
    gap = 100 * (mean_loss(diloco, best=True) / mean_loss(sync, best=True) - 1)
    return float(sync_bytes / diloco_bytes), gap


def final_gap(sync: Sequence[Report], diloco: Sequence[Report]) -> float:
    """loss_gap (%) of the final weights, averaged over seeds."""
    return 100 * (mean_loss(diloco, best=False) / mean_loss(sync, best=False) - 1)


def mean_loss(reports: Sequence[Report], *, best: bool) -> float:
    """The held-out loss over seeds: of each run's best checkpoint, or of its end."""
    return float(np.mean([r.best[1] if best else r.final_loss for r in reports]))


Work = tuple[str, int, int]  # (run, seed, H)


def _run_one(args: argparse.Namespace, item: Work) -> Report:
    from idlegrid.training.inner import use_threads

    use_threads(args.threads)
    name, seed, h = item
    run = run_sync if name == "sync" else run_diloco
    label = f"seed {seed} {name}" + (f" H={h}" if name == "diloco" else "")
    return run(setup_from(args, seed, h), lambda line: print(f"{label}: {line}", flush=True))


def _run_all(args: argparse.Namespace, work: list[Work]) -> list[Report]:
    """Every run, in `--jobs` processes at once (each with `--threads` torch threads)."""
    if args.jobs <= 1:
        return [_run_one(args, item) for item in work]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from functools import partial

    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        return list(pool.map(partial(_run_one, args), work))


def main(argv: Sequence[str] | None = None) -> int:
    """Both trainings for every seed (DiLoCo for every H); a table, the ratio line last.

    The synchronous run does not depend on H (the same steps, batches and schedule), so it
    runs once per seed; with several H it is evaluated every min(H) steps.
    """
    from idlegrid.training.inner import use_threads

    args = parse_args(argv)
    use_threads(args.threads)
    work = [("sync", seed, min(args.inner_steps)) for seed in args.seeds]
    work += [("diloco", seed, h) for seed in args.seeds for h in args.inner_steps]
    work = [item for item in work if args.runs in ("both", item[0])]
    reports = dict(zip(work, _run_all(args, work), strict=True))
    for (name, seed, h), report in reports.items():
        _print_report(seed, report, f" H={h}" if name == "diloco" else "")
    if args.runs != "both":
        return 0
    syncs = [reports[("sync", seed, min(args.inner_steps))] for seed in args.seeds]
    dilocos = {h: [reports[("diloco", seed, h)] for seed in args.seeds] for h in args.inner_steps}
    seeds = " ".join(str(seed) for seed in args.seeds)
    print(f"steps {args.total_steps}, seeds {seeds}, losses averaged over seeds:")
    print(
        "| H | rounds | sync loss, final / best | DiLoCo loss, final / best "
        "| loss_gap, final / best | bytes/worker sync "
        "| bytes/worker DiLoCo | bytes_ratio, seeded start | bytes_ratio, round-0 weights inline |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for h in args.inner_steps:
        ratio, gap = ratio_line(syncs, dilocos[h], inline=False)
        inline_ratio, _ = ratio_line(syncs, dilocos[h], inline=True)
        print(
            f"| {h} | {len(args.ramp) + (args.total_steps - sum(args.ramp)) // h} "
            f"| {mean_loss(syncs, best=False):.4f} / {mean_loss(syncs, best=True):.4f} "
            f"| {mean_loss(dilocos[h], best=False):.4f} "
            f"/ {mean_loss(dilocos[h], best=True):.4f} "
            f"| {final_gap(syncs, dilocos[h]):.2f}% / {gap:.2f}% "
            f"| {np.mean([r.bytes_per_worker for r in syncs]):,.0f} "
            f"| {np.mean([r.bytes_with_initial_weights(False) for r in dilocos[h]]):,.0f} "
            f"| {ratio:.1f} | {inline_ratio:.1f} |"
        )
    ratio, gap = ratio_line(syncs, dilocos[args.inner_steps[-1]])
    print(f"bytes_ratio: {ratio:.1f} loss_gap: {gap:.2f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
