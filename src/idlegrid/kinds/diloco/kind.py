"""The `diloco-train` kind: one round of local training that returns a compressed pseudo-gradient.

Input: one blob `dataset`, a safetensors file holding either `tokens` (1-D token ids, for
`transformer-lm`) or `x` (float32, examples first) and `y` (integer labels), optionally
with `eval.tokens` or `eval.x`/`eval.y` as the held-out split (else the last tenth is held
out), or naming a character corpus built into idlegrid (`dataset`).

A shard is one worker's part of the training data; a task trains on it for H AdamW steps
from the round's global weights (see `tasks` for the payload and result bytes).
`split` makes round 0's training shards from the seed; the coordinator's round driver
(`coordinator/round_driver.py`) runs the rounds through the kind's `rounds` hooks
(`rounds.py`), which close each round with `training.closing.close_round` and open the
next. `assemble` alone (no driver) closes round 0: its result is round 1's weights as
safetensors.

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

torch is imported only inside `run` (through `inner`): the coordinator imports
this module to split, compare and assemble without it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from idlegrid import p2p
from idlegrid.kinds.base import (
    Cancelled,
    InputError,
    KindParams,
    Pool,
    Requirements,
    RoundHooks,
    RunContext,
    ShardSpec,
    TaskKind,
    Verdict,
)
from idlegrid.kinds.diloco import hf_inputs, tasks
from idlegrid.kinds.diloco import run as runner
from idlegrid.kinds.diloco.dataset import corpus_dataset_blob, stream_id
from idlegrid.kinds.diloco.inner import use_threads
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.kinds.diloco.rounds import (
    DilocoRounds,
    checkpoint,
    eval_shard,
    initial_weights,
    round_task,
    train_flops,
)
from idlegrid.kinds.diloco.task_checkpoint import Checkpointer
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.training import closing, models, verify
from idlegrid.training.compression import decode, method_of
from idlegrid.training.flat import ContainerError

# The worker process's weights cache and error-feedback residuals, shared by its tasks.
WORKER_STATE = WorkerState()
# What a node lists among its kinds when it can average peer to peer (`idlegrid[p2p]`).
P2P_CAPABILITY = p2p.CAPABILITY


class DilocoKind(TaskKind):
    """Train a built-in architecture with DiLoCo: H local steps a task, one update a round."""

    name = "diloco-train"
    uses_gpu = True
    # Training updates are combined by a (robust) aggregation, and two replicas of one
    # shard train the same steps twice: replication is the researcher's choice here.
    default_replication = 1
    holds_state = True  # WORKER_STATE: moments and local weights kept per shard
    # A round's shards run side by side on as many nodes: none waits in a node's buffer.
    buffered = False
    # A slow shard is the round's timer's and quorum's to handle: a backup copy would add
    # a second update of one node to the round (robust aggregation counts each once).
    backups = False
    params_model = DilocoParams
    input_names = ("dataset",)
    # `hf-causal-lm`: the researcher's model (training/hf_folder.py).
    optional_inputs = ("model",)
    result_media_type = "application/x-safetensors"
    rounds: ClassVar[RoundHooks | None] = DilocoRounds()

    def derive_params(self, inputs: Mapping[str, bytes], params: KindParams) -> KindParams:
        assert isinstance(params, DilocoParams)
        return hf_inputs.derive(params, inputs)

    def split(self, inputs: Mapping[str, bytes], params: KindParams) -> list[ShardSpec]:
        assert isinstance(params, DilocoParams)
        train, held_out = hf_inputs.training_data(params, inputs)
        state = closing.initial_state(initial_weights(params, inputs))
        seeded = models.seeded(params.architecture, params.model_settings())
        stream = stream_id(params, inputs["dataset"])
        # Nodes draw round 0's weights from the seed as the coordinator did; the keyframe
        # (stored by the round driver) is the fallback if their numpy draws differently.
        keyframe = hashlib.sha256(checkpoint(params, state)).hexdigest()
        if params.averaging == "p2p":
            # Round 0's training shards name their group (the job's id is in its key): the
            # round driver makes them. Here: round 0's evaluation.
            return [eval_shard(params, state, held_out, stream=stream, keyframe_blob=keyframe,
                               init_seed=params.seed if seeded else None)]  # fmt: skip
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
                        init_seed=params.seed if seeded else None,
                    )
                ),  # fmt: skip
                items=params.inner.round_steps(0),
                cost_flops=train_flops(params, 0),
            )
            for shard in range(params.workers)
        ]

    def builtin_inputs(self, items: int | None = None) -> dict[str, bytes]:
        """A `dataset` naming the built-in character corpus (`items` does not apply)."""
        return {"dataset": corpus_dataset_blob()}

    def requirements(self, params: KindParams) -> Requirements:
        assert isinstance(params, DilocoParams)
        settings = params.model_settings()
        if isinstance(settings, models.HFConfig) and settings.config:
            return Requirements(min_memory_mb=hf_inputs.memory_need_mb(params))
        count = models.parameter_count(params.architecture, params.model_settings())
        # Weights, gradients, two AdamW moments, the global copy and the update: ~6 copies;
        # kept moments (`inner.keep_state`) two more; streaming's local weights one more.
        copies = 6 + (2 if params.inner.keep_state else 0) + (params.streaming is not None)
        if params.averaging == "p2p":
            # The outer state (momentum, residual), the mean in float64, the next weights;
            # only nodes of the pool that can average peer to peer.
            copies += 5
            pool = params.pool
            return Requirements(
                min_memory_mb=256 + math.ceil(4 * copies * count / 2**20),
                offers=frozenset({P2P_CAPABILITY}),
                accounts=frozenset(pool.account_ids if pool is not None else ()),
            )
        return Requirements(min_memory_mb=256 + math.ceil(4 * copies * count / 2**20))

    def work_stages(
        self, params: KindParams, shard_costs: Sequence[float], replication: int
    ) -> list[list[float]]:
        """Its rounds one after another, each `workers` training tasks (times replication)."""
        assert isinstance(params, DilocoParams)
        copies = params.workers * max(1, replication)
        return [[train_flops(params, r)] * copies for r in range(params.rounds)]

    def describe_shard(self, spec: ShardSpec, params: KindParams) -> tuple[str, str]:
        assert isinstance(params, DilocoParams)
        return (f"a round's training task ({spec.items:,} inner steps of "
                f"{params.inner.batch_size} windows of {params.inner.seq_len} tokens)",
                "lower inner.steps (more rounds of fewer steps) or inner.batch_size")  # fmt: skip

    def pool(self, params: KindParams) -> Pool | None:
        assert isinstance(params, DilocoParams)
        if params.averaging != "p2p" or params.pool is None:
            return None
        return Pool(
            accounts=tuple(params.pool.accounts),
            team=params.pool.team,
            members=params.workers,
            capability=P2P_CAPABILITY,
        )

    def with_pool(self, params: KindParams, account_ids: frozenset[int]) -> KindParams:
        assert isinstance(params, DilocoParams)
        if params.pool is None:
            return params
        pool = params.pool.model_copy(update={"account_ids": sorted(account_ids)})
        return params.model_copy(update={"pool": pool})

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
                p2p_reachability=ctx.p2p_reachability,
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
    if result.averaging == "p2p":
        return _p2p_problem(result, size)
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


def _p2p_problem(result: tasks.TaskResult, size: int) -> str | None:
    """Why a peer-to-peer member's report cannot be one, or None."""
    if not result.averaged_digest or not np.isfinite(result.update_norm):
        return "a p2p report needs the digest of the group's mean and a finite update norm"
    if result.published is not None:
        values = decode(result.published)
        if values.shape != (size,) or not np.all(np.isfinite(values)):
            return f"the published update must have {size} finite values"
    if result.outer is not None and result.outer.momentum.shape != (size,):
        return f"the outer state must have {size} values"
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
