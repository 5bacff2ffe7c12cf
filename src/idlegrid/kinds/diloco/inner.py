"""Worker side: H inner AdamW steps from the global weights, giving a pseudo-gradient.

torch is imported inside functions only. Given the same weights, data, settings and seed,
`train_inner` is deterministic on one CPU with a fixed thread count: batches come from
numpy's seeded generator and no module draws random numbers (no dropout). Other thread
counts and other hardware round differently; `verify` holds the tolerance for that.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from idlegrid.kinds.diloco.data import Dataset, TokenData, batches, eval_batches
from idlegrid.kinds.diloco.task_checkpoint import Checkpointer, InnerProgress
from idlegrid.kinds.diloco.worker_state import OptimizerState
from idlegrid.training import hf_torch, models

if TYPE_CHECKING:
    import torch


class InnerSettings(BaseModel):
    """One task's local training: H AdamW steps on batches of its shard."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(default=100, ge=1, le=100_000, description="H: inner steps per round")
    batch_size: int = Field(default=16, ge=1, le=4096)
    micro_batch_size: int | None = Field(
        default=None, ge=1, le=4096,
        description="examples per forward pass; gradients accumulate over the batch",
    )  # fmt: skip
    seq_len: int = Field(default=64, ge=1, le=4096, description="tokens per window (LMs)")
    lr: float = Field(default=1e-3, gt=0.0, le=1.0)
    weight_decay: float = Field(default=0.01, ge=0.0, le=1.0)
    beta1: float = Field(default=0.9, ge=0.0, lt=1.0)
    beta2: float = Field(default=0.95, ge=0.0, lt=1.0)
    grad_clip: float | None = Field(default=1.0, gt=0.0, description="max gradient norm")
    warmup_steps: int = Field(
        default=0, ge=0, description="linear lr warmup at the start of every task"
    )
    # The run's schedule (shared with a synchronous baseline): linear warmup over the run's
    # first `run_warmup_steps`, then cosine decay to `min_lr_ratio * lr` at `decay_steps`.
    run_warmup_steps: int = Field(default=0, ge=0, description="linear lr warmup of the run")
    decay_steps: int | None = Field(
        default=None, ge=1, description="cosine decay over the run's inner steps; None: none"
    )
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0, description="lr at decay end")
    first_step: int = Field(
        default=0, ge=0, description="the run's inner step this task starts at (see for_round)"
    )
    # DiLoCo lags most in its first rounds: shorter ones there (a few more, small messages)
    # catch up early; `steps` holds from round len(ramp) on.
    ramp: tuple[int, ...] = Field(
        default=(), max_length=10_000, description="H of the first rounds, then steps"
    )
    # DiLoCo keeps each replica's AdamW moments from round to round (Douillard et al.,
    # 2023); a task that finds none (a new node, another shard) starts them at zero.
    keep_state: bool = Field(
        default=False, description="carry AdamW moments between a node's tasks of one shard"
    )

    @model_validator(mode="after")
    def _micro_batches_divide(self) -> InnerSettings:
        if self.micro_batch_size is not None and self.batch_size % self.micro_batch_size:
            raise ValueError(f"batch_size {self.batch_size} is not a multiple of "
                             f"micro_batch_size {self.micro_batch_size}")  # fmt: skip
        return self

    @property
    def micro_batch(self) -> int:
        """Examples per forward pass."""
        return self.micro_batch_size or self.batch_size

    @field_validator("ramp")
    @classmethod
    def _positive_ramp(cls, ramp: tuple[int, ...]) -> tuple[int, ...]:
        if any(not 1 <= h <= 100_000 for h in ramp):
            raise ValueError("every ramp entry must be 1..100000 inner steps")
        return ramp

    def round_steps(self, round_number: int) -> int:
        """H of round `round_number`: its ramp entry, else `steps`."""
        return self.ramp[round_number] if round_number < len(self.ramp) else self.steps

    def round_start(self, round_number: int) -> int:
        """The run's inner step that round `round_number` starts at."""
        ramped = min(round_number, len(self.ramp))
        return sum(self.ramp[:ramped]) + (round_number - ramped) * self.steps

    def total_steps(self, rounds: int) -> int:
        """Inner steps per worker of a run of `rounds` rounds."""
        return self.round_start(rounds)


def run_lr(settings: InnerSettings, run_step: int) -> float:
    """The lr of the run's inner step `run_step` (0-based): warmup, then cosine decay.

    A worker's steps over the whole run are counted, not a task's: round r's task covers
    run steps r * steps .. (r + 1) * steps - 1. A synchronous baseline uses the same table.
    """
    warm = min(1.0, (run_step + 1) / (settings.run_warmup_steps + 1))
    if settings.decay_steps is None:
        return settings.lr * warm
    span = max(1, settings.decay_steps - settings.run_warmup_steps)
    progress = min(1.0, max(0.0, (run_step - settings.run_warmup_steps) / span))
    floor = settings.min_lr_ratio
    return settings.lr * warm * (floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def task_lr(settings: InnerSettings, step: int) -> float:
    """The lr of a task's inner step `step`: the run's lr there, times the task's warmup."""
    warm = min(1.0, (step + 1) / (settings.warmup_steps + 1))
    return run_lr(settings, settings.first_step + step) * warm


def for_round(settings: InnerSettings, round_number: int) -> InnerSettings:
    """The settings of a task of round `round_number`: its H and place in the run's schedule.

    Apply it once, to the run's settings: the result has no ramp left.
    """
    return settings.model_copy(
        update={
            "first_step": settings.round_start(round_number),
            "steps": settings.round_steps(round_number),
            "ramp": (),
        }
    )


@dataclass(frozen=True)
class InnerResult:
    """A task's pseudo-gradient (global minus local weights) and its training losses."""

    delta: np.ndarray
    loss_first: float  # the first batch's loss at the global weights
    loss_mean: float
    loss_last: float
    state: OptimizerState | None = None  # AdamW's state after the last step


def train_inner(
    architecture: str,
    config: Any,
    weights: np.ndarray,
    data: Dataset,
    settings: InnerSettings,
    *,
    seed: int,
    device: str = "cpu",
    on_step: Callable[[int], None] | None = None,
    state: OptimizerState | None = None,
    checkpoint: Checkpointer | None = None,
    base: Mapping[str, np.ndarray] | None = None,
) -> InnerResult:
    """Run `settings.steps` AdamW steps from `weights`; return delta = weights - local.

    `on_step(done)` runs after each step (progress, and a place to raise on cancel).
    AdamW starts from `state` (moments of an earlier task) if given, else at zero; the
    result carries its state after the last step when `settings.keep_state`. With a
    `checkpoint`, the loop goes on from the progress saved there, if any, and saves its
    own whenever the checkpointer says it is due. `base`: the frozen weights of a LoRA
    model (`hf-causal-lm`). A batch runs as micro-batches whose gradients accumulate.
    """
    check_fits(architecture, config, data, settings.seq_len)
    resumed = checkpoint.load(weights.size) if checkpoint is not None else None
    if resumed is not None and resumed.step >= settings.steps:
        resumed = None  # of a longer task than this one: not ours to continue
    module, trained = load_trainable(
        architecture, config, weights if resumed is None else resumed.local, device, base
    )
    optimizer = _adamw(trained, settings, _starting_moments(resumed, state, weights.size))
    task = models.get_architecture(architecture).task
    stream = batches(
        data, seed=seed, count=settings.steps, batch_size=settings.batch_size,
        seq_len=settings.seq_len,
    )  # fmt: skip
    losses = _inner_steps(
        module, trained, optimizer, stream, settings,
        task=task, device=device, resumed=resumed, checkpoint=checkpoint, on_step=on_step,
    )  # fmt: skip
    # In place: one copy of a full model's size fewer at the task's peak.
    delta = flat_values(trained)
    np.subtract(weights, delta, out=delta)
    kept = _save_state(optimizer) if settings.keep_state else None
    return InnerResult(delta, losses[0], float(np.mean(losses)), losses[-1], kept)


def _starting_moments(
    resumed: InnerProgress | None, state: OptimizerState | None, size: int
) -> OptimizerState | None:
    """AdamW's moments to start from: the checkpoint's, else an earlier task's that fit."""
    if resumed is not None:
        return resumed.optimizer
    return state if state is not None and state.fits(size) else None


def _adamw(
    trained: list[torch.nn.Parameter], settings: InnerSettings, moments: OptimizerState | None
) -> torch.optim.AdamW:
    """A fresh AdamW of the task's settings, starting from `moments` if given."""
    import torch

    optimizer = torch.optim.AdamW(
        trained,
        lr=settings.lr,
        betas=(settings.beta1, settings.beta2),
        weight_decay=settings.weight_decay,
    )
    if moments is not None:
        _load_state(optimizer, moments)
    return optimizer


def _inner_steps(
    module: torch.nn.Module,
    trained: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    stream: Iterable[tuple[np.ndarray, np.ndarray]],
    settings: InnerSettings,
    *,
    task: str,
    device: str,
    resumed: InnerProgress | None,
    checkpoint: Checkpointer | None,
    on_step: Callable[[int], None] | None,
) -> list[float]:
    """The inner steps, from where `resumed` left off, saving progress when due; the losses."""
    import torch

    losses = list(resumed.losses) if resumed is not None else []
    first = resumed.step if resumed is not None else 0
    for step, (inputs, targets) in enumerate(stream):
        if step < first:
            continue  # drawn again so that the next batches are the unbroken run's
        for group in optimizer.param_groups:
            group["lr"] = task_lr(settings, step)
        optimizer.zero_grad(set_to_none=True)
        loss = accumulate(module, task, inputs, targets, device, settings.micro_batch)
        if settings.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(trained, settings.grad_clip)
        optimizer.step()
        losses.append(loss)
        if checkpoint is not None and step + 1 < settings.steps and checkpoint.due():
            checkpoint.save(
                InnerProgress(step + 1, flat_values(trained), _save_state(optimizer), tuple(losses))
            )
        if on_step is not None:
            on_step(step + 1)
    return losses


def accumulate(
    module: torch.nn.Module,
    task: str,
    inputs: np.ndarray,
    targets: np.ndarray,
    device: str,
    micro_batch: int,
) -> float:
    """Backpropagate one batch as micro-batches of `micro_batch` examples; its mean loss."""
    total = 0.0
    parts = range(0, len(inputs), micro_batch)
    for start in parts:
        end = start + micro_batch
        loss = batch_loss(module, task, inputs[start:end], targets[start:end], device)
        (loss / len(parts)).backward()
        total += float(loss.detach())
    return total / len(parts)


def _load_state(optimizer: torch.optim.Optimizer, state: OptimizerState) -> None:
    """Give a fresh AdamW the moments of an earlier task (before its first step)."""
    import torch

    offset = 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            count = parameter.numel()
            part = slice(offset, offset + count)
            optimizer.state[parameter] = {
                "step": torch.tensor(float(state.step)),
                "exp_avg": torch.from_numpy(state.exp_avg[part].copy())
                .to(parameter.device)
                .view_as(parameter),
                "exp_avg_sq": torch.from_numpy(state.exp_avg_sq[part].copy())
                .to(parameter.device)
                .view_as(parameter),
            }
            offset += count


def _save_state(optimizer: torch.optim.Optimizer) -> OptimizerState:
    """AdamW's moments as flat float32 vectors, in parameter order."""
    averages, squares, step = [], [], 0
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            held = optimizer.state[parameter]
            averages.append(held["exp_avg"].detach().cpu().reshape(-1).numpy())
            squares.append(held["exp_avg_sq"].detach().cpu().reshape(-1).numpy())
            step = int(held["step"])
    return OptimizerState(
        step,
        np.concatenate(averages).astype(np.float32),
        np.concatenate(squares).astype(np.float32),
    )


def evaluate(
    architecture: str,
    config: Any,
    weights: np.ndarray,
    data: Dataset,
    *,
    batches: int,
    batch_size: int,
    seq_len: int,
    device: str = "cpu",
    base: Mapping[str, np.ndarray] | None = None,
) -> float:
    """Mean loss of `weights` over a fixed set of evaluation batches of `data`."""
    import torch

    check_fits(architecture, config, data, seq_len)
    module, _ = load_trainable(architecture, config, weights, device, base)
    module.eval()
    task = models.get_architecture(architecture).task
    fixed = eval_batches(data, count=batches, batch_size=batch_size, seq_len=seq_len)
    with torch.no_grad():
        return mean_loss(module, task, fixed, device)


def mean_loss(
    module: torch.nn.Module,
    task: str,
    batches: Iterable[tuple[np.ndarray, np.ndarray]],
    device: str,
) -> float:
    losses = [float(batch_loss(module, task, x, y, device)) for x, y in batches]
    return float(np.mean(losses))


def batch_loss(
    module: torch.nn.Module, task: str, inputs: np.ndarray, targets: np.ndarray, device: str
) -> torch.Tensor:
    """Cross-entropy of one batch (per token for language models)."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(inputs)).to(device)
    y = torch.from_numpy(np.ascontiguousarray(targets)).to(device)
    logits = hf_torch.logits(module, x) if getattr(module, "config", None) else module(x)
    if task == "language-model":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return F.cross_entropy(logits, y)


def load_trainable(
    architecture: str,
    config: Any,
    weights: np.ndarray,
    device: str,
    base: Mapping[str, np.ndarray] | None = None,
) -> tuple[Any, list[Any]]:
    """The module holding `weights` and its trained parameters, in the flat order."""
    if isinstance(config, models.HFConfig):
        return hf_torch.load(config, weights, device, base)
    module = load_module(architecture, config, weights, device)
    return module, list(module.parameters())


def load_module(architecture: str, config: Any, weights: np.ndarray, device: str) -> Any:
    """The architecture's torch module holding `weights` (a flat float32 vector)."""
    import torch

    spec = models.flat_spec(architecture, config)
    if weights.shape != (spec.size,):
        raise ValueError(f"{architecture} has {spec.size} weights, got {weights.shape}")
    module = models.build_module(architecture, config)
    offset = 0
    with torch.no_grad():
        for parameter in module.parameters():
            count = parameter.numel()
            chunk = torch.from_numpy(weights[offset : offset + count].copy())
            parameter.copy_(chunk.view_as(parameter))
            offset += count
    return module.to(device)


def flat_weights(module: torch.nn.Module) -> np.ndarray:
    """A module's parameters as one float32 vector, in parameter order."""
    return flat_values(list(module.parameters()))


def flat_values(parameters: list[Any]) -> np.ndarray:
    """Parameters as one float32 vector, in the list's order."""
    parts = [p.detach().cpu().reshape(-1).numpy() for p in parameters]
    return np.concatenate(parts).astype(np.float32, copy=False)


def use_threads(threads: int) -> None:
    """Let torch use `threads` CPU threads (process-wide: all tasks share one setting)."""
    import torch

    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def check_fits(architecture: str, config: Any, data: Dataset, seq_len: int) -> None:
    """ValueError if the data cannot feed the architecture (ids out of range, sizes)."""
    if isinstance(config, models.HFConfig):
        if not isinstance(data, TokenData):
            raise ValueError(f"{architecture} trains on tokens, not examples")
        hf_torch.check_tokens(config, int(data.tokens.max()) if len(data) else 0, seq_len)
        return
    if isinstance(data, TokenData):
        if not isinstance(config, models.LMConfig):
            raise ValueError(f"{architecture} trains on examples with labels, not tokens")
        if seq_len > config.context:
            raise ValueError(f"seq_len {seq_len} exceeds the model's context {config.context}")
        if len(data) and int(data.tokens.max()) >= config.vocab:
            raise ValueError(f"token id {int(data.tokens.max())} >= vocab {config.vocab}")
        return
    if isinstance(config, models.LMConfig):
        raise ValueError(f"{architecture} trains on tokens, not examples")
    example = tuple(data.x.shape[1:])
    if isinstance(config, models.MLPConfig) and math.prod(example) != config.inputs:
        raise ValueError(f"examples of shape {example} do not have {config.inputs} inputs")
    if isinstance(config, models.CNNConfig):
        expected = (config.channels, config.image_size, config.image_size)
        if example != expected:
            raise ValueError(f"examples of shape {example}, expected {expected}")
    if len(data) and not 0 <= int(data.y.min()) <= int(data.y.max()) < config.classes:
        raise ValueError(f"labels must lie in 0..{config.classes - 1}")
