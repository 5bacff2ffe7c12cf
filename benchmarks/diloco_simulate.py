"""DiLoCo against synchronous data-parallel training, in one process, bytes counted.

Both train the character transformer on a shipped corpus (`--corpus`: the CPython
standard-library source by default, large enough that neither run overfits; or the
pydoc text) with K workers, each owning one contiguous shard of the training split, for
the same number of inner steps per worker:

- DiLoCo: every round each simulated worker gets a real task payload (round 0's carries
  the weights; later ones only the previous round's compressed outer update, which the
  worker applies to its cached weights), runs `runner.run_task` as a node would, and
  sends back a real result blob; the coordinator closes the round with
  `closing.close_round`. Bytes are the lengths of those blobs, per worker.
- Synchronous: one AdamW step per step on the K workers' batches together (the same
  gradient as averaging K per-worker gradients). A ring all-reduce moves 2(K-1)/K of the
  gradient bytes per worker per step; that is what is counted (a lower bound: a worker
  also receives about as much as it sends). With `--sync-gradients int8` (or int4) each
  worker's gradient is quantized with error feedback before averaging, and the
  all-reduce counts the quantized bytes: the compression's share of DiLoCo's ratio.

Both follow one inner lr schedule over the run's steps (`inner.run_lr`: linear warmup,
then cosine decay); a DiLoCo task of round r picks it up at run step r * H
(`inner.for_round`). Each run has its own peak lr (`--lr` for DiLoCo's inner AdamW,
`--sync-lr` for the baseline), tuned at the horizon it is compared at.

Every round end both runs are evaluated on the validation split and on the test split
(`corpus.tokens`). A run's compared checkpoint is the one with the lowest validation
loss; its test loss is reported, and the bytes counted are those moved up to it. The
final weights are reported too, with all the run's bytes.

Run: ``PYTHONPATH=src python benchmarks/diloco_simulate.py --total-steps 1000 --inner-steps 50 100``
(several H share one synchronous run a seed; ``--seeds 0 1 2`` averages seeds and prints
their spread, ``--jobs 3`` runs three trainings at once, ``--device cuda`` trains on a
GPU). docs/benchmarks.md has the figures and their commands. Data is on every machine
(the corpora ship with idlegrid), so neither run counts it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.data import TokenData
from idlegrid.kinds.diloco.inner import InnerSettings, run_lr
from idlegrid.kinds.diloco.run import TrainSpec, run_task
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.training import closing, fragments, models
from idlegrid.training.aggregate import Aggregation
from idlegrid.training.compression import Compression, Message, compress, decode
from idlegrid.training.flat import digest
from idlegrid.training.fragments import Streaming, StreamingSettings
from idlegrid.training.outer import OuterSettings

ARCHITECTURE = "transformer-lm"
DEFAULT_CORPUS = corpus.STDLIB.name


def default_model(corpus_name: str = DEFAULT_CORPUS) -> models.LMConfig:
    """The benchmark's transformer (width 64, 2 layers) over a corpus's vocabulary."""
    return models.LMConfig(vocab=len(corpus.vocabulary(corpus_name)))


@dataclass(frozen=True)
class Setup:
    """One comparison: corpus, model, workers, rounds, and both runs' settings."""

    # Defaults: 30 rounds of H = 100 (3,000 steps), inner AdamW peak lr 3e-3 with 5% warmup
    # and cosine decay over the run, AdamW moments kept per shard between rounds, outer
    # Nesterov lr 1.0, int4 both ways with error feedback; baseline peak lr 1e-2. The
    # sweeps that chose them are in docs/benchmarks.md.
    workers: int = 4
    rounds: int = 30
    corpus: str = DEFAULT_CORPUS
    model: models.LMConfig = field(default_factory=default_model)
    inner: InnerSettings = field(
        default_factory=lambda: InnerSettings(
            steps=100, lr=3e-3, run_warmup_steps=150, decay_steps=3000, keep_state=True
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
    # The baseline's gradients on the wire: None is fp32; int8/int4 quantize them per
    # worker with error feedback.
    sync_gradients: Compression | None = None
    # Nodes build round 0's weights from the seed (as the baseline's workers would) and
    # round 0's payload leaves them out; otherwise it carries them inline (fp32).
    seeded_start: bool = False
    # Streaming DiLoCo: round t syncs fragment t mod P alone (`training.fragments`).
    streaming: StreamingSettings | None = None
    device: str = "cpu"

    @property
    def steps(self) -> int:
        """Inner steps per worker over the whole run (both runs take this many)."""
        return self.inner.total_steps(self.rounds)

    def spec(self) -> TrainSpec:
        """What every task runs with (`run_task` finds a round's H and place in the run)."""
        return TrainSpec(ARCHITECTURE, self.model, self.inner, self.upload, self.eval_batches)

    def streaming_spans(self) -> Streaming | None:
        """The spans and mixing of streaming DiLoCo, or None (every round syncs all)."""
        if self.streaming is None:
            return None
        return fragments.streaming(ARCHITECTURE, self.model, self.streaming)

    def round_ends(self) -> list[int]:
        """The inner step (per worker) at which each round ends."""
        return [self.inner.round_start(r + 1) for r in range(self.rounds)]


@dataclass(frozen=True)
class Checkpoint:
    """A run's weights at one evaluation: losses on both held-out splits, traffic so far."""

    step: int  # inner steps per worker so far
    validation: float
    test: float
    bytes: int = 0  # per worker, sent plus received, up to here (as the run ran)


@dataclass
class Report:
    """One run's evaluation curve and its traffic per worker."""

    name: str
    curve: list[Checkpoint]
    bytes_sent: int  # per worker, the whole run
    bytes_received: int  # per worker, the whole run
    seconds: float = 0.0
    # Bytes inline weights add to round 0's payload (per worker): in bytes_received unless
    # the nodes started from the seed.
    initial_weights: int = 0
    seeded: bool = False

    @property
    def final(self) -> Checkpoint:
        return self.curve[-1]

    @property
    def final_loss(self) -> float:
        """The final weights' test loss."""
        return self.curve[-1].test

    @property
    def selected(self) -> Checkpoint:
        """The checkpoint with the lowest validation loss: what a researcher keeps."""
        return min(self.curve, key=lambda point: point.validation)

    @property
    def bytes_per_worker(self) -> int:
        return self.bytes_sent + self.bytes_received

    def bytes_until(self, point: Checkpoint, inline: bool | None = None) -> int:
        """Traffic per worker up to a checkpoint, round 0's weights inline (True), not
        (False), or as the run ran (None)."""
        if inline is None:
            return point.bytes
        counted = 0 if self.seeded else self.initial_weights
        return point.bytes - counted + (self.initial_weights if inline else 0)

    def bytes_with_initial_weights(self, inline: bool) -> int:
        """Traffic per worker over the whole run, round 0's weights inline or not."""
        return self.bytes_until(self.final, inline)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Report:
        fields = dict(raw)
        fields["curve"] = [Checkpoint(**point) for point in raw["curve"]]
        return cls(**fields)


Progress = Callable[[str], None]


def evaluate(setup: Setup, weights: np.ndarray, split: corpus.Split) -> float:
    """Loss of weights on the fixed evaluation batches of one held-out split."""
    from idlegrid.kinds.diloco import inner

    return inner.evaluate(
        ARCHITECTURE, setup.model, weights, TokenData(corpus.tokens(split, setup.corpus)),
        batches=setup.eval_batches, batch_size=setup.inner.batch_size,
        seq_len=setup.inner.seq_len, device=setup.device,
    )  # fmt: skip


def checkpoint(setup: Setup, step: int, weights: np.ndarray, moved: int) -> Checkpoint:
    """Evaluate weights on validation and test."""
    return Checkpoint(
        step, evaluate(setup, weights, "validation"), evaluate(setup, weights, "test"), moved
    )


def run_diloco(setup: Setup, progress: Progress = print) -> Report:
    """DiLoCo rounds through real payload and result blobs; bytes per worker counted."""
    started = time.perf_counter()
    state = closing.initial_state(models.init_weights(ARCHITECTURE, setup.model, setup.seed))
    nodes = [WorkerState() for _ in range(setup.workers)]
    train = tasks.CorpusSlice("train", 0, len(corpus.train_tokens(setup.corpus)), setup.corpus)
    sent, received = np.zeros(setup.workers, np.int64), np.zeros(setup.workers, np.int64)
    curve = [checkpoint(setup, 0, state.weights, 0)]
    chain: tuple[tasks.Link, ...] = ()
    initial = np.zeros(setup.workers, np.int64)
    streaming = setup.streaming_spans()
    for round_number in range(setup.rounds):
        updates = []
        for shard, node in enumerate(nodes):
            task = _task(setup, state, train, shard, chain, streaming)
            payload = tasks.encode_task(task)
            if task.weights is not None:
                lean = tasks.encode_task(dataclasses.replace(task, weights=None))
                initial[shard] = len(payload) - len(lean)
                if setup.seeded_start:
                    seeded = models.init_weights(ARCHITECTURE, setup.model, setup.seed)
                    node.remember_weights(digest(seeded), seeded)
                    payload = lean
            received[shard] += len(payload)
            result = run_task(tasks.decode_task(payload), setup.spec(), node, device=setup.device)
            output = tasks.encode_result(result)
            sent[shard] += len(output)
            updates.append(_update(output))
        closed = closing.close_round(
            state, updates, rule=setup.aggregation, outer=setup.outer, download=setup.download,
            fragment=None if streaming is None else streaming.synced(state.round),
        )  # fmt: skip
        chain = (tasks.Link(tasks.WeightsRef(state.round, state.digest), closed.message),)
        state = closed.state
        moved = int(sent.mean() + received.mean())
        curve.append(checkpoint(setup, setup.inner.round_start(round_number + 1),
                                state.weights, moved))  # fmt: skip
        progress(f"diloco round {round_number + 1}/{setup.rounds}: train "
                 f"{closed.train_loss:.4f} validation {curve[-1].validation:.4f}")  # fmt: skip
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
    streaming: Streaming | None = None,
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
        streaming=streaming,
    )


def _update(output: bytes) -> closing.Update:
    result = tasks.decode_result(output)
    assert result.update is not None
    return closing.Update(decode(result.update), result.round, result.loss_mean)


def run_sync(setup: Setup, progress: Progress = print) -> Report:
    """Synchronous data-parallel AdamW: every step averages all workers' gradients."""
    from idlegrid.kinds.diloco import inner

    started = time.perf_counter()
    weights = models.init_weights(ARCHITECTURE, setup.model, setup.seed)
    module = inner.load_module(ARCHITECTURE, setup.model, weights, setup.device)
    step_once = _sync_stepper(setup, module)
    per_step = allreduce_bytes(gradient_bytes(setup, weights.size), setup.workers)
    curve = [checkpoint(setup, 0, weights, 0)]
    checkpoints = set(setup.round_ends())
    for step in range(setup.steps):
        step_once(step)
        if step + 1 in checkpoints:
            moved = 2 * (step + 1) * per_step
            curve.append(checkpoint(setup, step + 1, inner.flat_weights(module), moved))
            progress(f"sync step {step + 1}/{setup.steps}: "
                     f"validation {curve[-1].validation:.4f}")  # fmt: skip
    # Ring all-reduce: each worker sends 2(K-1)/K of the gradient a step, and receives as much.
    moved = setup.steps * per_step
    name = "sync" if setup.sync_gradients is None else f"sync-{setup.sync_gradients.method}"
    return Report(name, curve, moved, moved, time.perf_counter() - started)


def gradient_bytes(setup: Setup, size: int) -> int:
    """Bytes of one worker's gradient on the wire: fp32, or the quantized codes and scales."""
    if setup.sync_gradients is None:
        return 4 * size
    message, _ = compress(np.zeros(size, np.float32), setup.sync_gradients)
    return _payload_bytes(message)


def _payload_bytes(message: Message) -> int:
    arrays = [value for value in vars(message).values() if isinstance(value, np.ndarray)]
    return sum(int(array.nbytes) for array in arrays)


def _sync_stepper(setup: Setup, module: Any) -> Callable[[int], None]:
    import torch

    settings = setup.inner
    if setup.sync_lr is not None:
        settings = settings.model_copy(update={"lr": setup.sync_lr})
    optimizer = torch.optim.AdamW(
        module.parameters(), lr=settings.lr, betas=(settings.beta1, settings.beta2),
        weight_decay=settings.weight_decay,
    )  # fmt: skip
    shards = [TokenData(tokens) for tokens in _shard_tokens(setup.corpus, setup.workers)]
    generators = [np.random.default_rng([setup.seed, k]) for k in range(setup.workers)]
    backward = _plain_backward(setup, module)
    if setup.sync_gradients is not None:
        backward = _quantized_backward(setup, module, setup.sync_gradients)

    def step_once(step: int) -> None:
        parts = [
            data.batch(rng, settings.batch_size, settings.seq_len)
            for data, rng in zip(shards, generators, strict=True)
        ]
        for group in optimizer.param_groups:
            group["lr"] = run_lr(settings, step)  # the run's schedule, no per-task warmup
        optimizer.zero_grad(set_to_none=True)
        backward(parts)
        if settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), settings.grad_clip)
        optimizer.step()

    return step_once


Batches = list[tuple[np.ndarray, np.ndarray]]


def _plain_backward(setup: Setup, module: Any) -> Callable[[Batches], None]:
    from idlegrid.kinds.diloco import inner

    def backward(parts: Batches) -> None:
        inputs, targets = (np.concatenate(arrays) for arrays in zip(*parts, strict=True))
        inner.batch_loss(module, "language-model", inputs, targets, setup.device).backward()

    return backward


def _quantized_backward(setup: Setup, module: Any, wire: Compression) -> Callable[[Batches], None]:
    """Each worker's gradient quantized (error feedback per worker), then averaged."""
    import torch

    from idlegrid.kinds.diloco import inner

    params = list(module.parameters())
    residuals: list[np.ndarray | None] = [None] * setup.workers

    def backward(parts: Batches) -> None:
        received = []
        for worker, (inputs, targets) in enumerate(parts):
            grads = torch.autograd.grad(
                inner.batch_loss(module, "language-model", inputs, targets, setup.device), params
            )
            flat = torch.cat([g.reshape(-1) for g in grads]).cpu().numpy()
            message, residuals[worker] = compress(flat, wire, residuals[worker])
            received.append(decode(message))
        averaged = torch.from_numpy(np.mean(received, axis=0, dtype=np.float32))
        offset = 0
        for param in params:
            count = param.numel()
            param.grad = averaged[offset : offset + count].reshape(param.shape).to(param.device)
            offset += count

    return backward


def allreduce_bytes(gradient_bytes: int, workers: int) -> int:
    """Bytes a ring all-reduce moves per worker: 2(K-1)/K of the gradient."""
    return 2 * (workers - 1) * gradient_bytes // workers


def _shard_tokens(corpus_name: str, workers: int) -> list[np.ndarray]:
    train = corpus.train_tokens(corpus_name)
    bounds = np.linspace(0, len(train), workers + 1).astype(np.int64)
    return [train[bounds[k] : bounds[k + 1]] for k in range(workers)]


# -- comparing runs ---------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """One baseline against DiLoCo over seeds: ratios and gaps, per seed and averaged."""

    bytes_ratio: float  # mean baseline bytes over mean DiLoCo bytes, each up to its checkpoint
    loss_gap: float  # %, mean DiLoCo test loss over mean baseline test loss, minus one
    gaps: tuple[float, ...]  # % per seed

    @property
    def spread(self) -> str:
        """The per-seed gaps' range and standard deviation."""
        low, high = min(self.gaps), max(self.gaps)
        deviation = np.std(self.gaps, ddof=min(1, len(self.gaps) - 1))
        return f"{low:.2f}..{high:.2f}% (sd {deviation:.2f})"


def compare(
    sync: Sequence[Report],
    diloco: Sequence[Report],
    *,
    selected: bool = True,
    inline: bool | None = None,
) -> Comparison:
    """Baseline runs against DiLoCo runs (one each a seed, in the same order).

    `selected`: each run at its validation-selected checkpoint, bytes counted up to it;
    else the final weights with the whole run's bytes. Losses are on the test split.
    """

    def point(report: Report) -> Checkpoint:
        return report.selected if selected else report.final

    sync_loss = [point(r).test for r in sync]
    diloco_loss = [point(r).test for r in diloco]
    sync_bytes = np.mean([r.bytes_until(point(r), None) for r in sync])
    diloco_bytes = np.mean([r.bytes_until(point(r), inline) for r in diloco])
    gaps = tuple(100 * (d / s - 1) for s, d in zip(sync_loss, diloco_loss, strict=True))
    gap = 100 * (float(np.mean(diloco_loss)) / float(np.mean(sync_loss)) - 1)
    return Comparison(float(sync_bytes / diloco_bytes), gap, gaps)


def ratio_line(
    sync: Sequence[Report], diloco: Sequence[Report], *, inline: bool | None = None
) -> tuple[float, float]:
    """bytes_ratio and loss_gap (%) of validation-selected checkpoints, tested, over seeds."""
    comparison = compare(sync, diloco, selected=True, inline=inline)
    return comparison.bytes_ratio, comparison.loss_gap


def mean_loss(reports: Sequence[Report], *, selected: bool) -> float:
    """The test loss over seeds: of each run's validation-selected checkpoint, or its end."""
    return float(np.mean([(r.selected if selected else r.final).test for r in reports]))


# -- command line -----------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--corpus", default=DEFAULT_CORPUS, choices=list(corpus.CORPORA))
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=30, help="ignored with --total-steps")
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
    parser.add_argument("--decay-steps", type=int, default=None,
                        help="schedule length: cosine decay over this many steps, then the "
                             "floor (default: the run's steps)")  # fmt: skip
    parser.add_argument("--sync-lr", type=float, default=1e-2, help="the baseline's peak lr")
    parser.add_argument("--sync-gradients", nargs="+", default=["none"],
                        choices=["none", "int8", "int4"],
                        help="baselines: fp32 (none) and/or quantized gradients")  # fmt: skip
    parser.add_argument("--error-feedback", action=argparse.BooleanOptionalAction, default=True,
                        help="quantized upload keeps its rounding error on the worker")  # fmt: skip
    parser.add_argument("--chunk-size", type=int, default=256, help="values per scale")
    parser.add_argument(
        "--seeded-start",
        action="store_true",
        help="nodes build round 0's weights from the seed, not the payload",
    )
    parser.add_argument(
        "--fragments",
        type=int,
        default=1,
        help="streaming DiLoCo: P fragments of layers, round t syncs t mod P",
    )
    parser.add_argument("--mix", type=float, default=0.0,
                        help="streaming: the synced fragment restarts from "
                             "mix * local + (1 - mix) * global")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0], help="averaged")
    parser.add_argument("--runs", default="both", choices=["both", "sync", "diloco"],
                        help="one run alone (tuning); the ratio line needs both")  # fmt: skip
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads a run")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, one process each")
    parser.add_argument("--device", default="cpu", help="torch device of the training (cuda)")
    parser.add_argument("--json", default=None, help="also write every run's report here")
    args = parser.parse_args(argv)
    if args.total_steps is None:
        if len(args.inner_steps) > 1:
            parser.error("several --inner-steps need --total-steps (the same run length)")
        args.total_steps = args.rounds * args.inner_steps[0]
    if args.fragments < 1 or args.fragments > args.layers:
        parser.error(f"--fragments {args.fragments}: between 1 and --layers ({args.layers})")
    if not 0.0 <= args.mix < 1.0:
        parser.error(f"--mix {args.mix}: in [0, 1)")
    rest = args.total_steps - sum(args.ramp)
    for h in args.inner_steps:
        if rest <= 0 or rest % h:
            parser.error(f"--total-steps {args.total_steps} less the ramp's {sum(args.ramp)} "
                         f"is not a positive multiple of H={h}")  # fmt: skip
    return args


def setup_from(
    args: argparse.Namespace,
    seed: int,
    inner_steps: int | None = None,
    sync_gradients: str = "none",
) -> Setup:
    """The setup the command line describes, for one seed, one H (default: the first) and
    one baseline's gradients."""
    steps = args.inner_steps[0] if inner_steps is None else inner_steps
    inner = InnerSettings(
        steps=steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=args.lr,
        warmup_steps=args.warmup,
        run_warmup_steps=args.total_steps // 20 if args.run_warmup is None else args.run_warmup,
        decay_steps=(args.decay_steps or args.total_steps) if args.schedule == "cosine" else None,
        min_lr_ratio=args.min_lr_ratio,
        keep_state=args.keep_state,
        ramp=tuple(args.ramp),
    )
    wire = None
    if sync_gradients != "none":
        wire = Compression.model_validate(
            {"method": sync_gradients, "chunk_size": args.chunk_size, "error_feedback": True}
        )
    return Setup(
        workers=args.workers,
        rounds=len(args.ramp) + (args.total_steps - sum(args.ramp)) // steps,
        corpus=args.corpus,
        model=models.LMConfig(
            vocab=len(corpus.vocabulary(args.corpus)),
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
        sync_gradients=wire,
        seeded_start=args.seeded_start,
        streaming=None
        if args.fragments == 1 and args.mix == 0.0
        else StreamingSettings(fragments=args.fragments, mix=args.mix),
        device=args.device,
    )


def _print_report(seed: int, report: Report, label: str = "") -> None:
    chosen = report.selected
    print(f"seed {seed} {report.name}{label}: final test {report.final_loss:.4f}, "
          f"selected step {chosen.step} (validation {chosen.validation:.4f}, "
          f"test {chosen.test:.4f}, {chosen.bytes:,} B), "
          f"{report.bytes_per_worker:,} B per worker in all, {report.seconds:.0f} s")  # fmt: skip


Work = tuple[str, int, int]  # (run: "sync-none", "sync-int8", ... or "diloco", seed, H)


def _run_one(args: argparse.Namespace, item: Work) -> Report:
    from idlegrid.kinds.diloco.inner import use_threads

    use_threads(args.threads)
    name, seed, h = item
    label = f"seed {seed} {name}" + (f" H={h}" if name == "diloco" else "")
    progress: Progress = lambda line: print(f"{label}: {line}", flush=True)  # noqa: E731
    if name == "diloco":
        return run_diloco(setup_from(args, seed, h), progress)
    return run_sync(setup_from(args, seed, h, name.removeprefix("sync-")), progress)


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
    """Every baseline and DiLoCo (every H) for every seed; a table, the ratio line last.

    A synchronous run does not depend on H (the same steps, batches and schedule), so it
    runs once per seed and baseline; with several H it is evaluated every min(H) steps.
    """
    from idlegrid.kinds.diloco.inner import use_threads

    args = parse_args(argv)
    use_threads(args.threads)
    h0 = min(args.inner_steps)
    baselines = [f"sync-{g}" for g in args.sync_gradients]
    work = [(b, seed, h0) for b in baselines for seed in args.seeds]
    work += [("diloco", seed, h) for seed in args.seeds for h in args.inner_steps]
    work = [item for item in work if args.runs == "both" or item[0].startswith(args.runs)]
    reports = dict(zip(work, _run_all(args, work), strict=True))
    for (name, seed, h), report in reports.items():
        _print_report(seed, report, f" H={h}" if name == "diloco" else "")
    if args.json:
        with open(args.json, "w") as out:
            json.dump([{"run": name, "seed": seed, "h": h, "report": report.to_json()}
                       for (name, seed, h), report in reports.items()], out)  # fmt: skip
    if args.runs != "both":
        return 0
    syncs = {b: [reports[(b, seed, h0)] for seed in args.seeds] for b in baselines}
    dilocos = {h: [reports[("diloco", seed, h)] for seed in args.seeds] for h in args.inner_steps}
    print_table(syncs, dilocos, args.seeds)
    ratio, gap = ratio_line(syncs[baselines[0]], dilocos[args.inner_steps[-1]])
    print(f"bytes_ratio: {ratio:.1f} loss_gap: {gap:.2f}%")
    return 0


def print_table(
    syncs: dict[str, list[Report]], dilocos: dict[int, list[Report]], seeds: Sequence[int]
) -> None:
    """Test losses and ratios of DiLoCo (each H) against each baseline, means over seeds."""
    print(f"seeds {' '.join(map(str, seeds))}; test loss, means over seeds; "
          "selected: the checkpoint of lowest validation loss, bytes up to it")  # fmt: skip
    print("| baseline | H | baseline loss, final / selected | DiLoCo loss, final / selected "
          "| loss_gap, final | loss_gap, selected (per-seed spread) "
          "| bytes_ratio, final | bytes_ratio, selected |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, sync in syncs.items():
        for h, diloco in dilocos.items():
            final = compare(sync, diloco, selected=False)
            chosen = compare(sync, diloco, selected=True)
            print(f"| {name} | {h} | {mean_loss(sync, selected=False):.4f} / "
                  f"{mean_loss(sync, selected=True):.4f} | "
                  f"{mean_loss(diloco, selected=False):.4f} / "
                  f"{mean_loss(diloco, selected=True):.4f} | {final.loss_gap:.2f}% | "
                  f"{chosen.loss_gap:.2f}% ({chosen.spread}) | {final.bytes_ratio:.1f} | "
                  f"{chosen.bytes_ratio:.1f} |")  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
