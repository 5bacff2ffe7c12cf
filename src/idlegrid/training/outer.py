"""The outer optimizer (Nesterov SGD) and the update both sides apply to global weights.

Pure numpy on flat float32 vectors, no I/O. The coordinator owns the momentum; workers
never see it. What a worker needs to follow the global weights is only the published
update message: `apply_update` turns (weights of round t, message) into the weights of
round t+1 with the same float32 element-wise operations on every machine, so the
coordinator and every worker hold bit-identical weights (checked by `flat.digest`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from idlegrid.training.compression import Compression, Message, Sparse, compress, decode


class OuterSettings(BaseModel):
    """Nesterov SGD on the aggregated pseudo-gradient (DiLoCo's defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(default=0.7, gt=0.0, le=10.0)
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    nesterov: bool = True


def nesterov_step(
    outer_gradient: np.ndarray, momentum_buffer: np.ndarray, settings: OuterSettings
) -> tuple[np.ndarray, np.ndarray]:
    """The update to add to the weights, and the new momentum buffer.

    torch.optim.SGD's rule (which DiLoCo uses): buf = mu * buf + g; the step is
    g + mu * buf with Nesterov, buf without; the update is -lr * step. A zero buffer on the
    first round gives buf = g, as torch does.
    """
    gradient = np.asarray(outer_gradient, dtype=np.float32)
    mu, lr = np.float32(settings.momentum), np.float32(settings.lr)
    buffer = mu * momentum_buffer + gradient
    step = gradient + mu * buffer if settings.nesterov else buffer
    return (-lr * step).astype(np.float32), buffer.astype(np.float32)


def apply_update(weights: np.ndarray, message: Message, at: slice | None = None) -> np.ndarray:
    """New global weights from the old ones and a published update (both sides run this).

    Only float32 element-wise adds: correctly rounded by IEEE 754, so identical on every
    machine and numpy build. A new array is returned; `weights` is left as it was. `at`:
    the update covers only these values (one streaming fragment, `training.fragments`).
    """
    if weights.dtype != np.float32:
        raise TypeError(f"weights must be float32, got {weights.dtype}")
    if at is not None:
        updated = weights.copy()
        updated[at] = apply_update(weights[at], message)
        return updated
    if isinstance(message, Sparse):
        updated = weights.copy()
        updated[message.indices] += message.values
        return updated
    update = decode(message)
    if update.shape != weights.shape:
        raise ValueError(f"update of shape {update.shape} for weights of {weights.shape}")
    return weights + update


@dataclass(frozen=True)
class Published:
    """What the coordinator publishes for a round, and what it keeps."""

    message: Message  # sent to every worker
    weights: np.ndarray  # the new global weights: apply_update(old weights, message)
    residual: np.ndarray | None  # the part of the update not sent yet (error feedback)


def publish_update(
    weights: np.ndarray,
    update: np.ndarray,
    residual: np.ndarray | None,
    settings: Compression,
) -> Published:
    """Compress an outer update for download and move the global weights by what was sent.

    The coordinator's weights become exactly what workers compute from the message, so
    both sides stay identical; the compression error is not lost but carried in the
    residual into the next round's update (error feedback on the coordinator).
    """
    feedback = residual if residual is not None else np.zeros_like(update)
    message, new_residual = compress(update, settings, feedback)
    return Published(message, apply_update(weights, message), new_residual)
