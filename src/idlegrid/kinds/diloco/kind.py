"""The `diloco-train` kind: one round of local training that returns a compressed pseudo-gradient.

Input: one blob `dataset`, a safetensors file holding either `tokens` (1-D token ids, for
`transformer-lm`) or `x` (float32, examples first) and `y` (integer labels), optionally
with `eval.tokens` or `eval.x`/`eval.y` as the held-out split (else the last tenth is held
out). A dataset blob with no arrays and the header {"corpus": "pydoc-topics"} (or
"cpython-stdlib", with the corpus's SHA-256) names a character corpus built into
idlegrid, so no data bytes travel (`corpus_dataset_blob`).

A shard is one worker's part of the training data; a task trains on it for H AdamW steps
from the round's global weights (see `training.tasks` for the payload and result bytes).
`split` makes round 0's training shards from the seed; the coordinator's round driver
(`coordinator/round_driver.py`) closes each round with `training.closing.close_round` and
opens the next with `round_shards`: round t's shards have indexes t*(workers+1) + s, and
index t*(workers+1) + workers is the evaluation of round t's weights on the held-out
split (every `eval_every` rounds, and after the last). `assemble` alone (no driver)
closes round 0: its result is round 1's weights as safetensors.

With `inner.keep_state` a node keeps each shard's AdamW moments from round to round (as
DiLoCo's replicas do) and the round driver prefers to give shard s to the node that
trained it last (scheduler affinity); a node without them starts at zero. A task's update
then depends on the node's history, so two replicas of it agree only if both held the
same moments: use it with replication 1 (this kind's default) and a robust aggregation
rule where nodes are not trusted. `inner.ramp` gives the first rounds their own H.

With `asynchronous`, a round still closes on its quorum or timer, but its tasks still
running go on: an update that arrives s rounds later counts in the round then open,
weighted (1 + s)^-alpha (`aggregation.staleness_alpha`), if s <= `max_staleness`; an
older one is dropped and counted in the job's metrics. Late updates are verified and
aggregated (robust rules included) like fresh ones.

With `streaming` ({"fragments": P, "mix": A}, `training.fragments`), the model is cut
into P blocks of layers and round t syncs fragment t mod P alone: tasks upload that
fragment's pseudo-gradient, the round driver steps it alone and publishes its update; the
other fragments go on training from each node's local weights of its shard (kept like
the AdamW moments, with the same affinity). A node without them starts from the global
weights. Bytes per round fall about P-fold. Refused with `asynchronous` (a late update
would be of another fragment) and with more fragments than the model has layers. As
with `keep_state`, an update depends on the node's history: replication 1.

torch is imported only inside `run` (through `training.inner`): the coordinator imports
this module to split, compare and assemble without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from pydantic import Field, model_validator

from idlegrid.kinds.base import (
    Cancelled,
    InputError,
    KindParams,
    Requirements,
    RunContext,
    ShardSpec,
    TaskKind,
    Verdict,
)
from idlegrid.kinds.diloco import char_corpus as corpus
from idlegrid.kinds.diloco import data as datasets
from idlegrid.kinds.diloco import run as runner
from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.inner import InnerSettings, use_threads
from idlegrid.kinds.diloco.task_checkpoint import Checkpointer
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.training import closing, fragments, models, verify
from idlegrid.training.aggregate import Aggregation
from idlegrid.training.compression import Compression, decode, method_of
from idlegrid.training.flat import (
    ContainerError,
    pack,
    unpack,
    weights_from_safetensors,
    weights_to_safetensors,
)
from idlegrid.training.fragments import Span, Streaming, StreamingSettings
from idlegrid.training.outer import OuterSettings

CORPUS_NAME = "pydoc-topics"
# The worker process's weights cache and error-feedback residuals, shared by its tasks.
WORKER_STATE = WorkerState()


class DilocoParams(KindParams):
    architecture: str = Field(default="transformer-lm", description="a built-in architecture")
    model: dict[str, Any] = Field(default_factory=dict, description="the architecture's config")
    rounds: int = Field(default=10, ge=1, le=100_000)
    workers: int = Field(default=4, ge=1, le=10_000, description="shards (tasks) per round")
    inner: InnerSettings = InnerSettings()
    outer: OuterSettings = OuterSettings()
    upload: Compression = Compression(method="int8")
    download: Compression = Compression(method="int8")
    aggregation: Aggregation = Aggregation()
    seed: int = Field(default=0, ge=0, lt=2**63, description="initial weights and batches")
    eval_batches: int = Field(default=16, ge=1, le=10_000)
    # For the round driver: a round closes on `min_updates` or after `round_timeout_s`.
    eval_every: int = Field(default=1, ge=1, description="rounds between held-out evaluations")
    min_updates: int | None = Field(default=None, ge=1, description="default: workers")
    round_timeout_s: float = Field(default=600.0, gt=0.0)
    asynchronous: bool = Field(
        default=False,
        description="a task still running when its round closes goes on; its update counts "
        "in the round open when it arrives, weighted (1+s)^-alpha by its staleness s",
    )
    max_staleness: int = Field(
        default=2, ge=0, le=100, description="asynchronous mode: older updates are dropped"
    )
    streaming: StreamingSettings | None = Field(
        default=None,
        description="streaming DiLoCo: the model in `fragments` blocks of layers, round t "
        "syncs fragment t mod fragments alone; the others go on training on each worker",
    )

    @model_validator(mode="after")
    def _valid_model(self) -> DilocoParams:
        self.model_settings()
        if self.min_updates is not None and self.min_updates > self.workers:
            raise ValueError(f"min_updates {self.min_updates} exceeds workers {self.workers}")
        if len(self.inner.ramp) > self.rounds:
            raise ValueError(f"inner.ramp has {len(self.inner.ramp)} rounds; the job {self.rounds}")
        if self.inner.first_step:
            raise ValueError("inner.first_step is set per task, not per job")
        if self.asynchronous and self.max_staleness < 1:
            raise ValueError("asynchronous mode needs max_staleness >= 1 (with 0 every "
                             "late update is dropped: set asynchronous=false)")  # fmt: skip
        if self.asynchronous and self.max_staleness >= self.rounds:
            raise ValueError(f"max_staleness {self.max_staleness} must be less than rounds "
                             f"{self.rounds}: no update can be that late")  # fmt: skip
        if self.streaming is not None:
            if self.asynchronous:
                raise ValueError("streaming fragments need synchronous rounds: a late update "
                                 "would be of another fragment than the round syncs")  # fmt: skip
            self.fragments()
        return self

    def fragments(self) -> Streaming | None:
        """The spans and mixing of streaming DiLoCo, or None (every round syncs it all)."""
        if self.streaming is None:
            return None
        try:
            return fragments.streaming(self.architecture, self.model_settings(), self.streaming)
        except ValueError as exc:
            raise ValueError(f"streaming: {exc}") from None

    def synced(self, round_number: int) -> Span | None:
        """The fragment round `round_number` syncs, or None (the whole model)."""
        spans = self.fragments()
        return None if spans is None else spans.synced(round_number)

    def train_spec(self) -> runner.TrainSpec:
        """What every task of this job shares, for the worker side."""
        return runner.TrainSpec(
            self.architecture, self.model_settings(), self.inner, self.upload, self.eval_batches
        )

    def model_settings(self) -> Any:
        """The validated config of the chosen architecture."""
        try:
            return models.parse_config(self.architecture, self.model)
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None


class DilocoKind(TaskKind):
    """Train a built-in architecture with DiLoCo: H local steps a task, one update a round."""

    name = "diloco-train"
    # Training updates are combined by a (robust) aggregation, and two replicas of one
    # shard train the same steps twice: replication is the researcher's choice here.
    default_replication = 1
    # A round's shards run side by side on as many nodes: none waits in a node's buffer.
    buffered = False
    # A slow shard is the round's timer's and quorum's to handle: a backup copy would add
    # a second update of one node to the round (robust aggregation counts each once).
    backups = False
    params_model = DilocoParams
    input_names = ("dataset",)
    result_media_type = "application/x-safetensors"

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, DilocoParams)
        if "dataset" not in inputs:
            raise InputError("missing input 'dataset' (safetensors)")
        train, _ = read_dataset(inputs["dataset"])
        state = closing.initial_state(initial_weights(params))
        stream = stream_id(params, inputs["dataset"])
        # Nodes draw round 0's weights from the seed as the coordinator did; the keyframe
        # (stored by the round driver) is the fallback if their numpy draws differently.
        keyframe = hashlib.sha256(checkpoint(params, state)).hexdigest()
        return [
            ShardSpec(
                index=shard,
                payload=tasks.encode_task(
                    round_task(
                        params,
                        state,
                        train,
                        shard,
                        stream=stream,
                        keyframe_blob=keyframe,
                        init_seed=params.seed,
                    )
                ),  # fmt: skip
                items=params.inner.round_steps(0),
                cost_flops=train_flops(params, 0),
            )
            for shard in range(params.workers)
        ]

    def requirements(self, params: KindParams) -> Requirements:
        assert isinstance(params, DilocoParams)
        count = models.parameter_count(params.architecture, params.model_settings())
        # Weights, gradients, two AdamW moments, the global copy and the update: ~6 copies;
        # kept moments (`inner.keep_state`) two more; streaming's local weights one more.
        copies = 6 + (2 if params.inner.keep_state else 0) + (params.streaming is not None)
        return Requirements(min_memory_mb=256 + math.ceil(4 * copies * count / 2**20))

    def run(self, payload: bytes, params: KindParams, ctx: RunContext) -> bytes:
        assert isinstance(params, DilocoParams)
        try:
            task = tasks.decode_task(payload)
        except ContainerError as exc:
            raise InputError(f"task payload: {exc}") from None
        use_threads(ctx.threads)
        fetched: list[int] = []

        def fetch(blob_hash: str) -> bytes:
            assert ctx.fetch is not None
            blob = ctx.fetch(blob_hash)
            fetched.append(len(blob))
            return blob

        try:
            result = runner.run_task(
                task, params.train_spec(), WORKER_STATE,
                device=ctx.device, on_step=_progress(ctx, params.inner.round_steps(task.round)),
                fetch=None if ctx.fetch is None else fetch,
                checkpoint=None if ctx.scratch is None else Checkpointer(
                    ctx.scratch, ctx.checkpoint_every_s
                ),
            )  # fmt: skip
        except (ContainerError, tasks.MissingWeights, ValueError) as exc:
            raise InputError(f"task: {exc}") from None
        return tasks.encode_result(dataclasses.replace(result, fetched_bytes=sum(fetched)))

    def check_output(self, payload: bytes, output: bytes, params: KindParams) -> None:
        assert isinstance(params, DilocoParams)
        try:
            task, result = tasks.decode_task(payload), tasks.decode_result(output)
        except ContainerError as exc:
            raise InputError(str(exc)) from None
        problem = output_problem(task, result, params)
        if problem:
            raise InputError(problem)

    def compare(self, a: bytes, b: bytes, params: KindParams) -> Verdict:
        assert isinstance(params, DilocoParams)
        try:
            first, second = tasks.decode_result(a), tasks.decode_result(b)
        except ContainerError:
            return Verdict.DISAGREE
        return compare_results(first, second, stateless=not params.upload.stateful)

    def assemble(self, outputs: Sequence[bytes], params: KindParams) -> bytes:
        assert isinstance(params, DilocoParams)
        state = closing.initial_state(initial_weights(params))
        updates = [_update_of(output, state) for output in outputs]
        closed = closing.close_round(
            state, updates, rule=params.aggregation, outer=params.outer, download=params.download,
            fragment=params.synced(0),
        )  # fmt: skip
        return checkpoint(params, closed.state, train_loss=closed.train_loss)


# -- coordinator side -------------------------------------------------------------------


def initial_weights(params: DilocoParams) -> np.ndarray:
    """Round 0's weights, from the seed (numpy: the coordinator needs no torch)."""
    return models.init_weights(params.architecture, params.model_settings(), params.seed)


def stream_id(params: DilocoParams, dataset: bytes) -> str:
    """A name for one training run in workers' caches, when no job id is at hand."""
    text = params.model_dump_json().encode() + hashlib.sha256(dataset).digest()
    return "run-" + hashlib.sha256(text).hexdigest()[:16]


def corpus_dataset_blob(name: str = CORPUS_NAME) -> bytes:
    """A `dataset` input that names a built-in character corpus (no data inside)."""
    return pack({}, {"corpus": name, "sha256": corpus.get(name).sha256})


def dataset_blob(train: datasets.Dataset, held_out: datasets.Dataset | None = None) -> bytes:
    """A `dataset` input of arrays, optionally with its held-out split."""
    arrays = datasets.to_arrays(train, "")
    if held_out is not None:
        arrays.update(datasets.to_arrays(held_out, "eval."))
    return pack(arrays, {})


def read_dataset(blob: bytes) -> tuple[tasks.DataRef, tasks.DataRef]:
    """The training and held-out data of a `dataset` input; InputError if unusable."""
    try:
        arrays, header = unpack(blob)
        if header.get("corpus") is not None:
            return _corpus_dataset(header)
        train = datasets.from_arrays(arrays, "")
        if any(name.startswith("eval.") for name in arrays):
            return train, datasets.from_arrays(arrays, "eval.")
    except ContainerError as exc:
        raise InputError(f"dataset: {exc}") from None
    cut = len(train) - max(1, len(train) // 10)
    if cut <= 0:
        raise InputError("dataset: too small to hold a tenth out for evaluation")
    return _split_off(train, cut)


def _corpus_dataset(header: Mapping[str, Any]) -> tuple[tasks.DataRef, tasks.DataRef]:
    known = corpus.CORPORA.get(str(header["corpus"]))
    if known is None or header.get("sha256") != known.sha256:
        raise InputError(f"dataset: unknown corpus {header['corpus']!r}; "
                         f"known: {', '.join(corpus.CORPORA)}")  # fmt: skip
    train, held_out = len(corpus.train_tokens(known.name)), len(corpus.eval_tokens(known.name))
    return (tasks.CorpusSlice("train", 0, train, known.name),
            tasks.CorpusSlice("eval", 0, held_out, known.name))  # fmt: skip


def _split_off(data: datasets.Dataset, cut: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    if isinstance(data, datasets.TokenData):
        return datasets.TokenData(data.tokens[:cut]), datasets.TokenData(data.tokens[cut:])
    return (
        datasets.ExampleData(data.x[:cut], data.y[:cut]),
        datasets.ExampleData(data.x[cut:], data.y[cut:]),
    )


def round_task(
    params: DilocoParams,
    state: closing.RoundState,
    train: tasks.DataRef,
    shard: int,
    *,
    stream: str,
    inline: bool = False,
    chain: tuple[tasks.Link, ...] = (),
    keyframe_blob: str | None = None,
    init_seed: int | None = None,
) -> tasks.TaskPayload:
    """The payload of one shard's task in the round `state` starts."""
    return tasks.TaskPayload(
        mode="train",
        stream=stream,
        round=state.round,
        shard=shard,
        seed=closing.task_seed(params.seed, state.round, shard),
        target=tasks.WeightsRef(state.round, state.digest),
        data=tasks.shard_ref(train, shard, params.workers),
        weights=state.weights if inline else None,
        keyframe_blob=keyframe_blob,
        chain=chain,
        init_seed=init_seed,
        streaming=params.fragments(),
    )


def round_shards(
    params: DilocoParams,
    state: closing.RoundState,
    data: tuple[tasks.DataRef, tasks.DataRef],
    *,
    stream: str,
    chain: tuple[tasks.Link, ...],
    keyframe_blob: str,
    final: bool,
) -> list[ShardSpec]:
    """The shards of the round `state` starts: training (unless final) and evaluation.

    Payloads carry the published updates by reference (`chain`) and the checkpoint of
    the round's weights (`keyframe_blob`), never the weights themselves: a node holding
    an earlier round's weights fetches the small updates, a node holding none the
    checkpoint.
    """
    train, held_out = data
    first = state.round * (params.workers + 1)
    specs = []
    if not final:
        specs = [
            ShardSpec(
                index=first + shard,
                payload=tasks.encode_task(
                    round_task(
                        params,
                        state,
                        train,
                        shard,
                        stream=stream,
                        chain=chain,
                        keyframe_blob=keyframe_blob,
                    )
                ),
                items=params.inner.round_steps(state.round),
                cost_flops=train_flops(params, state.round),
            )  # fmt: skip
            for shard in range(params.workers)
        ]
    if final or state.round % params.eval_every == 0:
        specs.append(eval_shard(params, state, held_out, stream=stream, chain=chain,
                                keyframe_blob=keyframe_blob))  # fmt: skip
    return specs


def eval_shard(
    params: DilocoParams,
    state: closing.RoundState,
    held_out: tasks.DataRef,
    *,
    stream: str,
    chain: tuple[tasks.Link, ...] = (),
    keyframe_blob: str | None = None,
    init_seed: int | None = None,
) -> ShardSpec:
    """The shard that measures the held-out loss of the round's weights.

    `init_seed`: round 0's weights are the initialization from this seed (a node draws
    them instead of fetching the keyframe, as round 0's training tasks do).
    """
    payload = tasks.TaskPayload(
        mode="eval",
        stream=stream,
        round=state.round,
        shard=params.workers,
        seed=closing.task_seed(params.seed, state.round, params.workers),
        target=tasks.WeightsRef(state.round, state.digest),
        data=held_out,
        keyframe_blob=keyframe_blob,
        chain=chain,
        init_seed=init_seed,
        streaming=params.fragments(),
    )
    count = models.parameter_count(params.architecture, params.model_settings())
    per_example = params.inner.seq_len if params.architecture == "transformer-lm" else 1
    flops = 2.0 * count * per_example * params.inner.batch_size * params.eval_batches
    return ShardSpec(
        index=state.round * (params.workers + 1) + params.workers,
        payload=tasks.encode_task(payload),
        items=params.eval_batches,
        cost_flops=flops,
    )


MOMENTUM_FORMAT = "idlegrid/diloco-momentum"


def momentum_blob(state: closing.RoundState) -> bytes:
    """The outer optimizer's state of a round (momentum, download residual): safetensors."""
    arrays = {"momentum": np.asarray(state.momentum, dtype=np.float32)}
    if state.download_residual is not None:
        arrays["download_residual"] = np.asarray(state.download_residual, dtype=np.float32)
    return pack(arrays, {"format": MOMENTUM_FORMAT, "round": state.round})


def read_state(params: DilocoParams, checkpoint_blob: bytes, momentum: bytes) -> closing.RoundState:
    """A round's state back from its checkpoint and momentum blobs."""
    spec = models.flat_spec(params.architecture, params.model_settings())
    weights = weights_from_safetensors(checkpoint_blob, spec).astype(np.float32)
    arrays, header = unpack(momentum)
    if header.get("format") != MOMENTUM_FORMAT:
        raise ContainerError(f"not a {MOMENTUM_FORMAT} container")
    return closing.RoundState(
        int(header["round"]), weights, arrays["momentum"], arrays.get("download_residual")
    )


def train_flops(params: DilocoParams, round_number: int) -> float:
    """Cost of one task of a round: 6 FLOPs per parameter per example-token, its H steps."""
    count = models.parameter_count(params.architecture, params.model_settings())
    per_example = params.inner.seq_len if params.architecture == "transformer-lm" else 1
    steps = params.inner.round_steps(round_number)
    return float(6 * count * per_example * params.inner.batch_size * steps)


def checkpoint(params: DilocoParams, state: closing.RoundState, **metrics: float) -> bytes:
    """Safetensors of a round's global weights, with round, digest and metrics as metadata."""
    spec = models.flat_spec(params.architecture, params.model_settings())
    metadata = {"architecture": params.architecture, "round": state.round,
                "digest": state.digest, **metrics}  # fmt: skip
    return weights_to_safetensors(state.weights, spec, metadata)


def _update_of(output: bytes, state: closing.RoundState) -> closing.Update:
    try:
        result = tasks.decode_result(output)
    except ContainerError as exc:
        raise InputError(f"output: {exc}") from None
    if result.update is None or result.weights_digest != state.digest:
        raise InputError("assemble closes round 0 only: an output is not a round-0 update")
    return closing.Update(decode(result.update), result.round, result.loss_mean)


def output_problem(
    task: tasks.TaskPayload, result: tasks.TaskResult, params: DilocoParams
) -> str | None:
    """Why a result cannot be the output of a task, or None if it fits."""
    expected = (task.mode, task.round, task.shard, task.seed, task.target.digest)
    got = (result.mode, result.round, result.shard, result.seed, result.weights_digest)
    if got != expected:
        return f"result is for {got}, the task was {expected}"
    if not all(np.isfinite([result.loss_first, result.loss_mean, result.loss_last])):
        return "losses must be finite"
    if task.mode == "eval":
        return None
    size = models.parameter_count(params.architecture, params.model_settings())
    synced = params.synced(task.round)
    if synced is not None:
        size = synced.size  # a streaming task sends its round's fragment alone
    if result.update is None or result.sketch is None:
        return "a training result needs an update and a sketch"
    if method_of(result.update) != params.upload.method:
        return f"update is {method_of(result.update)}, the job uploads {params.upload.method}"
    if decode(result.update).shape != (size,) or result.sketch.shape != (verify.SKETCH_SIZE,):
        return f"update must have {size} values and the sketch {verify.SKETCH_SIZE}"
    if not np.all(np.isfinite(decode(result.update))):
        return "update contains NaN or infinite values"
    return None


def compare_results(
    first: tasks.TaskResult, second: tasks.TaskResult, *, stateless: bool
) -> Verdict:
    """Replicas agree if they started alike and their losses and pseudo-gradients agree."""
    same_task = (first.mode, first.round, first.shard, first.seed, first.weights_digest) == (
        second.mode, second.round, second.shard, second.seed, second.weights_digest,
    )  # fmt: skip
    if not same_task or not verify.losses_agree(first.loss_mean, second.loss_mean):
        return Verdict.DISAGREE
    if first.mode == "eval":
        return Verdict.AGREE
    if first.sketch is None or second.sketch is None:
        return Verdict.DISAGREE
    agree = verify.deltas_agree(first.sketch, second.sketch)
    # A stateless update is a function of the pseudo-gradient alone: compare it too.
    if agree and stateless and first.update is not None and second.update is not None:
        agree = verify.deltas_agree(decode(first.update), decode(second.update))
    return Verdict.AGREE if agree else Verdict.DISAGREE


# -- worker side ------------------------------------------------------------------------


def _progress(ctx: RunContext, steps: int) -> Any:
    def on_step(done: int) -> None:
        if ctx.is_cancelled():
            raise Cancelled()
        ctx.report_progress(done / steps)

    return on_step
