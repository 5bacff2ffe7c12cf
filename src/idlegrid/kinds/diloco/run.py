"""Worker side of one training task: starting weights, inner steps, compressed update.

The `diloco-train` kind's `run` and the in-process simulation both call `run_task`, so a
simulated worker does exactly what a real one does. torch is imported (through `inner`)
only when a task runs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from idlegrid.kinds.diloco import tasks
from idlegrid.kinds.diloco.data import Dataset
from idlegrid.kinds.diloco.inner import InnerResult, InnerSettings
from idlegrid.kinds.diloco.task_checkpoint import Checkpointer
from idlegrid.kinds.diloco.worker_state import WorkerState
from idlegrid.training import fragments, models, verify
from idlegrid.training.compression import Compression, Message, compress
from idlegrid.training.flat import weights_from_safetensors
from idlegrid.training.outer import OuterSettings

if TYPE_CHECKING:
    from idlegrid.p2p.averaging import Joining


@dataclass(frozen=True)
class TrainSpec:
    """What every task of one training run shares: model, inner loop, upload compression."""

    architecture: str
    config: Any
    inner: InnerSettings
    upload: Compression
    eval_batches: int = 16
    # Peer-to-peer rounds: each member takes the outer step itself.
    outer: OuterSettings = OuterSettings()
    download: Compression = Compression(method="int8")


def run_task(
    task: tasks.TaskPayload,
    spec: TrainSpec,
    state: WorkerState,
    *,
    device: str = "cpu",
    on_step: Callable[[int], None] | None = None,
    fetch: Callable[[str], bytes] | None = None,
    checkpoint: Checkpointer | None = None,
    p2p_reachability: str = "auto",
) -> tasks.TaskResult:
    """Train (or evaluate) one task; remember its weights, residual and moments in `state`.

    With a `checkpoint`, a training task goes on from the progress saved there and saves
    its own as it goes (kinds/diloco/task_checkpoint.py). `p2p_reachability`: how a
    peer-to-peer round's member joins the network (p2p/reachability.py).

    Raises tasks.MissingWeights if the starting weights cannot be rebuilt, ContainerError
    or ValueError if the task or its data do not fit the model.
    """
    weights = tasks.resolve_weights(
        task, state.weights, fetch, _checkpoint_reader(spec),
        lambda seed: models.init_weights(spec.architecture, spec.config, seed),
    )  # fmt: skip
    state.remember_weights(task.target.digest, weights)
    data = tasks.load_data(task.data)
    if task.mode == "eval":
        return _evaluate(task, spec, weights, data, device, _base(spec, fetch))
    trained, start, joining = _train(
        task, spec, state, weights, data, device=device, on_step=on_step, fetch=fetch,
        checkpoint=checkpoint, p2p_reachability=p2p_reachability,
    )  # fmt: skip
    delta, part = _pseudo_gradient(task, state, weights, start, trained.delta)
    message, owed = _compress_upload(task, spec, state, weights, delta, part)
    if joining is not None:
        from idlegrid.kinds.diloco import member

        losses = (trained.loss_first, trained.loss_mean, trained.loss_last)
        steps = (spec.outer, spec.download)
        accumulator = delta if owed is None else delta + owed
        return member.average_round(
            task, steps, state, weights, message, losses, fetch, joining,
            accumulator=accumulator, upload=spec.upload,
        )  # fmt: skip
    return tasks.TaskResult(
        "train", task.round, task.shard, task.seed, task.target.digest,
        trained.loss_first, trained.loss_mean, trained.loss_last,
        update=message, sketch=verify.sketch(delta),
    )  # fmt: skip


def _train(
    task: tasks.TaskPayload,
    spec: TrainSpec,
    state: WorkerState,
    weights: np.ndarray,
    data: Dataset,
    *,
    device: str,
    on_step: Callable[[int], None] | None,
    fetch: Callable[[str], bytes] | None,
    checkpoint: Checkpointer | None,
    p2p_reachability: str,
) -> tuple[InnerResult, np.ndarray, Joining | None]:
    """The inner steps from the task's starting weights, its p2p group joined meanwhile.

    Returns the training's result, the weights it started from and the group's handle.
    """
    from idlegrid.kinds.diloco import inner

    # The task's place in the run's lr schedule (warmup and decay over all rounds).
    settings = inner.for_round(spec.inner, task.round)
    moments = None
    if settings.keep_state:
        moments = state.optimizer_state(task.stream, task.shard, task.round)
    start = weights
    if task.streaming is not None:
        local = state.local_weights(task.stream, task.shard, task.round)
        start = fragments.starting_weights(task.streaming, task.round, weights, local)
    joining = None
    if task.group is not None:
        from idlegrid.p2p import averaging

        # It joins the DHT while this member trains.
        joining = averaging.join(task.group, shard=task.shard,
                                 reachability_setting=p2p_reachability)  # fmt: skip
    try:
        trained = inner.train_inner(
            spec.architecture, spec.config, start, data, settings,
            seed=task.seed, device=device, on_step=on_step, state=moments, checkpoint=checkpoint,
            base=_base(spec, fetch),
        )  # fmt: skip
    except BaseException:
        if joining is not None:
            joining.close()
        raise
    if trained.state is not None:
        state.set_optimizer_state(task.stream, task.shard, task.round, trained.state)
    return trained, start, joining


def _pseudo_gradient(
    task: tasks.TaskPayload,
    state: WorkerState,
    weights: np.ndarray,
    start: np.ndarray,
    trained_delta: np.ndarray,
) -> tuple[np.ndarray, slice]:
    """The update the task sends and the part of the weights it covers: all, or a fragment."""
    if task.streaming is None:
        return trained_delta, slice(None)
    local_after = start - trained_delta
    state.set_local_weights(task.stream, task.shard, task.round, local_after)
    delta = fragments.pseudo_gradient(task.streaming, task.round, weights, local_after)
    return delta, task.streaming.synced(task.round).slice


def _compress_upload(
    task: tasks.TaskPayload,
    spec: TrainSpec,
    state: WorkerState,
    weights: np.ndarray,
    delta: np.ndarray,
    part: slice,
) -> tuple[Message, np.ndarray | None]:
    """The update compressed with error feedback; returns it and the residual it carried.

    The residual left out of this message is kept in `state` for the stream's next task.
    """
    # The error-feedback residual covers the whole vector; a fragment uses its slice.
    residual = state.residual(task.stream) if spec.upload.stateful else None
    if residual is not None and residual.shape != weights.shape:
        residual = None
    owed = None if residual is None else residual[part]
    message, kept = compress(delta, spec.upload, owed)
    if kept is not None:
        residual = np.zeros_like(weights) if residual is None else residual.copy()
        residual[part] = kept
    state.set_residual(task.stream, None if kept is None else residual)
    return message, owed


def _evaluate(
    task: tasks.TaskPayload,
    spec: TrainSpec,
    weights: np.ndarray,
    data: Dataset,
    device: str,
    base: Mapping[str, np.ndarray] | None,
) -> tasks.TaskResult:
    from idlegrid.kinds.diloco import inner

    loss = inner.evaluate(
        spec.architecture, spec.config, weights, data, batches=spec.eval_batches,
        batch_size=spec.inner.batch_size, seq_len=spec.inner.seq_len, device=device, base=base,
    )  # fmt: skip
    return tasks.TaskResult(
        "eval", task.round, task.shard, task.seed, task.target.digest, loss, loss, loss
    )


def _base(spec: TrainSpec, fetch: Callable[[str], bytes] | None) -> Mapping[str, np.ndarray] | None:
    """The frozen weights a LoRA model trains on (the job's `model` input), else None."""
    config = spec.config
    if not isinstance(config, models.HFConfig) or config.lora is None:
        return None
    from idlegrid.training import hf_torch

    return hf_torch.base_weights(config, fetch)


def _checkpoint_reader(spec: TrainSpec) -> Callable[[bytes], np.ndarray]:
    flat_spec = models.flat_spec(spec.architecture, spec.config)
    return lambda blob: weights_from_safetensors(blob, flat_spec)
