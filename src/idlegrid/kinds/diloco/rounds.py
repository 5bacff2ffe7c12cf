"""A `diloco-train` job's rounds: their weights, shards and close, for the round driver.

Round t's shards have indexes t*(workers+1) + s; index t*(workers+1) + workers is the
evaluation of round t's weights on the held-out split (every `eval_every` rounds, and
after the last). Payloads carry the published updates by reference and the checkpoint of
the round's weights as a keyframe, never the weights themselves. Numpy only: the
coordinator runs this without torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from idlegrid.kinds.base import (
    Evaluation,
    KindParams,
    Published,
    RoundClose,
    RoundHooks,
    RoundJob,
    RoundPlan,
    RoundWeights,
    ShardSpec,
    Swarm,
)
from idlegrid.kinds.diloco import hf_inputs, p2p_close, tasks
from idlegrid.kinds.diloco.dataset import stream_id
from idlegrid.kinds.diloco.p2p_close import outer_known
from idlegrid.kinds.diloco.params import DilocoParams
from idlegrid.p2p import seal
from idlegrid.p2p.group import Group, group_key
from idlegrid.training import closing, models
from idlegrid.training.compression import decode, encode_message
from idlegrid.training.flat import (
    ContainerError,
    pack,
    unpack,
    weights_from_safetensors,
    weights_to_safetensors,
)

# Published updates a payload names: a node that missed this many rounds gets the keyframe.
CHAIN_LENGTH = 2


class WeightsName(Protocol):
    """What a round's shards need of its weights: which round, and their digest."""

    @property
    def round(self) -> int: ...

    @property
    def digest(self) -> str: ...


def initial_weights(params: DilocoParams, inputs: Mapping[str, bytes] | None = None) -> np.ndarray:
    """Round 0's weights, from the seed or a model input (numpy: the coordinator needs no torch)."""
    return hf_inputs.initial_weights(params, inputs)


def round_task(
    params: DilocoParams,
    state: WeightsName,
    train: tasks.DataRef,
    shard: int,
    *,
    stream: str,
    chain: tuple[tasks.Link, ...] = (),
    keyframe_blob: str | None = None,
    init_seed: int | None = None,
    p2p: P2PRound | None = None,
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
        keyframe_blob=keyframe_blob,
        chain=chain,
        init_seed=init_seed,
        streaming=params.fragments(),
        group=None if p2p is None else p2p.group,
        outer_blob=None if p2p is None else p2p.outer_blob,
        report_state=False if p2p is None else p2p.report_state,
    )


class P2PRound:
    """What a peer-to-peer round's training payloads add: the group, the coordinator's
    outer state blob (None: the members hold it) and whether its reporter uploads it."""

    def __init__(self, group: Group, outer_blob: str | None, report_state: bool) -> None:
        self.group, self.outer_blob, self.report_state = group, outer_blob, report_state


def round_shards(
    params: DilocoParams,
    state: WeightsName,
    data: tuple[tasks.DataRef, tasks.DataRef],
    *,
    stream: str,
    chain: tuple[tasks.Link, ...],
    keyframe_blob: str,
    final: bool,
    p2p: P2PRound | None = None,
    init_seed: int | None = None,
    evaluate: bool = True,
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
                        init_seed=init_seed,
                        p2p=p2p,
                    )
                ),
                items=params.inner.round_steps(state.round),
                cost_flops=train_flops(params, state.round),
            )  # fmt: skip
            for shard in range(params.workers)
        ]
    if evaluate and (final or state.round % params.eval_every == 0):
        specs.append(eval_shard(params, state, held_out, stream=stream, chain=chain,
                                keyframe_blob=keyframe_blob, init_seed=init_seed))  # fmt: skip
    return specs


def eval_shard(
    params: DilocoParams,
    state: WeightsName,
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
    count = models.compute_parameters(params.architecture, params.model_settings())
    per_example = params.inner.seq_len if models.is_language_model(params.architecture) else 1
    flops = 2.0 * count * per_example * params.inner.batch_size * params.eval_batches
    return ShardSpec(
        index=state.round * (params.workers + 1) + params.workers,
        payload=tasks.encode_task(payload),
        items=params.eval_batches,
        cost_flops=flops,
    )


MOMENTUM_FORMAT = tasks.MOMENTUM_FORMAT


def momentum_blob(state: closing.RoundState, *, from_round: int | None = None) -> bytes:
    """The outer optimizer's state of a round (momentum, download residual): safetensors.

    `from_round` (peer-to-peer rounds): the members hold the round's state and did not
    upload it; the blob holds the last one uploaded, of that round, which a
    coordinator-mode close uses only if no member sends the round's own.
    """
    arrays = {"momentum": np.asarray(state.momentum, dtype=np.float32)}
    if state.download_residual is not None:
        arrays["download_residual"] = np.asarray(state.download_residual, dtype=np.float32)
    made = state.round if from_round is None else from_round
    header = {"format": MOMENTUM_FORMAT, "round": state.round, "known": from_round is None,
              "from_round": made}  # fmt: skip
    return pack(arrays, header)


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
    count = models.compute_parameters(params.architecture, params.model_settings())
    per_example = params.inner.seq_len if models.is_language_model(params.architecture) else 1
    steps = params.inner.round_steps(round_number)
    return float(6 * count * per_example * params.inner.batch_size * steps)


def checkpoint(params: DilocoParams, state: closing.RoundState, **metrics: float) -> bytes:
    """Safetensors of a round's global weights, with round, digest and metrics as metadata."""
    spec = models.flat_spec(params.architecture, params.model_settings())
    metadata = {"architecture": params.architecture, "round": state.round,
                "digest": state.digest, **metrics}  # fmt: skip
    return weights_to_safetensors(state.weights, spec, metadata)


# -- the round driver's hooks ----------------------------------------------------------


class DilocoRounds(RoundHooks):
    """The round driver's view of `diloco-train`."""

    def job(
        self, params: KindParams, inputs: Mapping[str, bytes], *, swarm: Swarm | None = None
    ) -> DilocoRoundJob:
        assert isinstance(params, DilocoParams)
        dataset = inputs["dataset"]
        data = hf_inputs.training_data(params, inputs)
        return DilocoRoundJob(
            params, data, stream_id(params, dataset), inputs=inputs, swarm=swarm or Swarm(0)
        )


class DilocoRoundJob(RoundJob):
    """One training job: its settings, its data and the name workers cache it under."""

    def __init__(
        self,
        params: DilocoParams,
        data: tuple[tasks.DataRef, tasks.DataRef],
        stream: str,
        *,
        inputs: Mapping[str, bytes] | None = None,
        swarm: Swarm | None = None,
    ) -> None:
        self.params, self.data, self.stream = params, data, stream
        self.inputs = inputs  # where round 0's weights are a model input
        self.swarm = swarm or Swarm(0)
        self.plan = RoundPlan(
            rounds=params.rounds,
            workers=params.workers,
            min_updates=params.min_updates or params.workers,
            round_timeout_s=params.round_timeout_s,
            eval_every=params.eval_every,
            asynchronous=params.asynchronous,
            max_staleness=params.max_staleness,
            # Nodes keep a shard's AdamW moments or its local weights between rounds.
            affinity=params.inner.keep_state or params.streaming is not None,
        )

    def initial(self) -> RoundWeights:
        return self._stored(closing.initial_state(initial_weights(self.params, self.inputs)))

    def first_shards(self, start: RoundWeights, *, keyframe: str) -> list[ShardSpec]:
        if self.p2p:
            # Peer to peer, round 0's training shards name their group: they come from
            # here (the job's id is known), not from `split`.
            return round_shards(
                self.params, start, self.data, stream=self.stream, chain=(),
                keyframe_blob=keyframe, final=False, p2p=self._p2p(start),
                init_seed=self._init_seed(), evaluate=False,  # `split` made the evaluation
            )  # fmt: skip
        if not (self.params.eval_every and self.params.rounds):
            return []
        # Round 0's evaluation draws the weights from the seed too (no keyframe fetch).
        return [eval_shard(self.params, start, self.data[1], stream=self.stream,
                           keyframe_blob=keyframe, init_seed=self._init_seed())]  # fmt: skip

    def _init_seed(self) -> int | None:
        seeded = models.seeded(self.params.architecture, self.params.model_settings())
        return self.params.seed if seeded else None

    @property
    def p2p(self) -> bool:
        return self.params.averaging == "p2p"

    def _p2p(self, weights: RoundWeights) -> P2PRound | None:
        """A peer-to-peer round's group and outer state; None in coordinator mode, or when
        no bootstrap DHT peer runs (the round then runs in coordinator mode)."""
        if not self.p2p or not self.swarm.peers:
            return None
        workers = self.params.workers
        key = group_key(self.swarm.job_id, weights.round, self.stream)
        group = Group(
            key=key,
            members=tuple(range(workers)),
            # A retry goes on with the job's minimum (`min_updates`), or a majority.
            min_size=self.params.min_updates or max(2, workers // 2 + 1),
            timeout_s=self.params.group_timeout_s,
            peers=self.swarm.peers,
            # Seals the round's records in the DHT: only the coordinator and the members
            # hold it (p2p/seal.py).
            secret=seal.round_secret(self.swarm.key, key),
        )
        outer_blob = None
        if weights.round > 0 and outer_known(weights.optimizer):
            outer_blob = hashlib.sha256(weights.optimizer).hexdigest()
        after = weights.round + 1
        # Every N rounds (not after the last: the result is the weights) the reporter
        # uploads the outer state, so a coordinator-mode fallback never starts from an
        # outer momentum more than N rounds old.
        report = after % self.params.checkpoint_every == 0 and after < self.params.rounds
        return P2PRound(group, outer_blob, report)

    def close(self, checkpoint: bytes, optimizer: bytes, outputs: Sequence[bytes]) -> RoundClose:
        if self.p2p:
            state = read_state(self.params, checkpoint, optimizer)
            return p2p_close.close(self.params, state, optimizer, outputs, self._stored_from)
        params = self.params
        state = read_state(params, checkpoint, optimizer)
        updates, fetched = [], 0
        for output in outputs:
            result = tasks.decode_result(output)
            assert result.update is not None  # check_output accepted it
            updates.append(closing.Update(decode(result.update), result.round, result.loss_mean))
            fetched += result.fetched_bytes
        closed = closing.close_round(
            state, updates, rule=params.aggregation, outer=params.outer, download=params.download,
            asynchronous=params.asynchronous, max_staleness=params.max_staleness,
            fragment=params.synced(state.round),
        )  # fmt: skip
        return RoundClose(
            weights=self._stored(closed.state),
            update=encode_message(closed.message),
            train_loss=closed.train_loss,
            max_suspicion=max(closed.suspicion, default=0.0),
            stale_applied=closed.stale_applied,
            fetched_bytes=fetched,
        )

    def shards(
        self,
        weights: RoundWeights,
        *,
        published: Sequence[Published],
        keyframe: str,
        final: bool,
    ) -> list[ShardSpec]:
        chain = tuple(
            tasks.Link(tasks.WeightsRef(update.round, update.digest), blob=update.blob)
            for update in published[-CHAIN_LENGTH:]
        )
        return round_shards(self.params, weights, self.data, stream=self.stream, chain=chain,
                            keyframe_blob=keyframe, final=final,
                            p2p=self._p2p(weights))  # fmt: skip

    def evaluation(self, output: bytes) -> Evaluation:
        result = tasks.decode_result(output)
        return Evaluation(loss=result.loss_mean, fetched_bytes=result.fetched_bytes)

    def _stored_from(self, state: closing.RoundState, from_round: int | None) -> RoundWeights:
        return self._stored(state, from_round=from_round)

    def _stored(self, state: closing.RoundState, *, from_round: int | None = None) -> RoundWeights:
        return RoundWeights(
            round=state.round,
            digest=state.digest,
            checkpoint=checkpoint(self.params, state),
            optimizer=momentum_blob(state, from_round=from_round),
        )
