"""Streaming DiLoCo's fragments: the model cut into P blocks of layers, synced in turn.

Streaming DiLoCo (Douillard et al., 2025) does not sync the whole model at the end of
every round. The parameters are partitioned into P fragments of contiguous layers, and
round t syncs only fragment t mod P: workers upload the pseudo-gradient of that
fragment alone, the coordinator takes the outer step on it alone, and publishes an
update of it alone. Every other fragment keeps training locally on each worker, across
rounds, until its own turn comes. A fragment is thus synced every P rounds; with rounds
of H/P steps it is synced every H steps, as plain DiLoCo with rounds of H is, but each
sync moves about 1/P of the bytes (the traffic is spread over time instead of coming in
one burst per H steps).

Pieces:

- `partition` cuts an architecture's flat weight vector into P contiguous `Span`s along
  its layers (a transformer's blocks; the token and position embeddings go with the
  first fragment, the final norm and the head with the last). Every parameter is in
  exactly one fragment. More fragments than layers is refused.
- The worker keeps its local weights per training run and shard (`WorkerState`); a task
  starts from them, except the fragment synced when the last round closed, which is
  mixed with the new global weights: ``A * local + (1 - A) * global`` (A = `mix`, 0 takes
  the global fragment as it is). The task's pseudo-gradient is the global value of the
  fragment synced this round minus the worker's local value of it: the global value has
  not moved since that fragment's last sync, so this is the fragment's drift over its
  last P rounds of local training.
- `closing.close_round(fragment=...)` steps only that span (its slice of the outer
  momentum and of the download residual), and the published message covers the span
  alone. A chain link of round r applies to `spans[r % P]`.

Pure numpy, no torch, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from idlegrid.training import models


class StreamingSettings(BaseModel):
    """How a streaming DiLoCo job cuts and syncs its model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    fragments: int = Field(default=1, ge=1, le=1000, description="P: round t syncs t mod P")
    mix: float = Field(
        default=0.0,
        ge=0.0,
        lt=1.0,
        description="the synced fragment restarts from mix * local + (1 - mix) * global",
    )


@dataclass(frozen=True)
class Span:
    """Values [start, stop) of the flat weight vector."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def slice(self) -> slice:
        return slice(self.start, self.stop)


@dataclass(frozen=True)
class Streaming:
    """What a streaming task needs: the fragments' spans, in order, and the mixing."""

    spans: tuple[Span, ...]
    mix: float = 0.0

    def __post_init__(self) -> None:
        if not self.spans:
            raise ValueError("streaming needs at least one fragment")
        if self.spans[0].start != 0 or any(
            a.stop != b.start for a, b in zip(self.spans, self.spans[1:], strict=False)
        ):
            raise ValueError("fragments must tile the weights from 0 without gaps")
        if any(span.size <= 0 for span in self.spans):
            raise ValueError("every fragment must hold at least one value")
        if not 0.0 <= self.mix < 1.0:
            raise ValueError(f"mix must be in [0, 1), got {self.mix}")

    @property
    def fragments(self) -> int:
        return len(self.spans)

    @property
    def size(self) -> int:
        return self.spans[-1].stop

    def synced(self, round_number: int) -> Span:
        """The fragment round `round_number` syncs when it closes."""
        return self.spans[round_number % len(self.spans)]

    def to_json(self) -> dict[str, Any]:
        return {"spans": [[s.start, s.stop] for s in self.spans], "mix": self.mix}

    @classmethod
    def from_json(cls, raw: Any) -> Streaming:
        spans = tuple(Span(int(start), int(stop)) for start, stop in raw["spans"])
        return cls(spans, float(raw["mix"]))


def partition(architecture: str, config: Any, fragments: int) -> tuple[Span, ...]:
    """P contiguous spans of the flat weights, each a block of whole layers.

    ValueError if `fragments` is below 1 or above the architecture's layer count.
    """
    params = models.param_list(architecture, config)
    layers = _layers(params)
    if fragments < 1:
        raise ValueError(f"fragments must be at least 1, got {fragments}")
    if fragments > len(layers):
        raise ValueError(f"{fragments} fragments for a model of {len(layers)} layers: "
                         f"at most one fragment a layer")  # fmt: skip
    # Layers per fragment as even as can be (the first ones take the remainder).
    groups = np.array_split(np.arange(len(layers)), fragments)
    bounds = [layers[int(group[-1])][1] for group in groups]
    starts = [0, *bounds[:-1]]
    return tuple(Span(start, stop) for start, stop in zip(starts, bounds, strict=True))


def streaming(architecture: str, config: Any, settings: StreamingSettings) -> Streaming:
    """The spans and mixing of a job's streaming settings."""
    return Streaming(partition(architecture, config, settings.fragments), settings.mix)


def _layers(params: Sequence[models.Param]) -> list[tuple[int, int]]:
    """Each layer's [start, stop) in the flat vector, in order.

    A layer is the parameters sharing a name prefix (`blocks.3.`, `layers.1.`, `conv2.`).
    A transformer's layers are its blocks: what comes before the first block (the
    embeddings) joins it, what comes after the last (final norm, head) joins that one.
    """
    offsets, offset = [], 0
    for param in params:
        size = int(np.prod(param.shape, dtype=np.int64))
        offsets.append((_layer_key(param.name), offset, offset + size))
        offset += size
    keys = list(dict.fromkeys(key for key, _, _ in offsets))
    blocks = [key for key in keys if key.startswith("blocks.")]
    if blocks:
        first, last = blocks[0], blocks[-1]
        index = {key: i for i, key in enumerate(keys)}
        keys_of = {}
        for key in keys:
            if key in blocks:
                keys_of[key] = key
            else:
                keys_of[key] = first if index[key] < index[first] else last
        offsets = [(keys_of[key], start, stop) for key, start, stop in offsets]
        keys = blocks
    spans: dict[str, tuple[int, int]] = {}
    for key, start, stop in offsets:
        low, high = spans.get(key, (start, stop))
        spans[key] = (min(low, start), max(high, stop))
    layers = [spans[key] for key in keys]
    for (_, stop), (start, _) in zip(layers, layers[1:], strict=False):
        if stop != start:
            raise ValueError("an architecture's layers must lie contiguously in its weights")
    return layers


def _layer_key(name: str) -> str:
    parts = name.split(".")
    if len(parts) >= 3 and parts[1].isdigit():
        return ".".join(parts[:2])  # blocks.3.qkv.weight -> blocks.3
    return parts[0]  # tokens.weight -> tokens; head.bias -> head


# -- the worker's side ------------------------------------------------------------------


def starting_weights(
    streaming_: Streaming, round_number: int, global_weights: np.ndarray, local: np.ndarray | None
) -> np.ndarray:
    """Where a streaming task of `round_number` starts.

    `local`: the worker's own weights after its task of the round before on this shard,
    or None (it has none: new, restarted, or it trained another shard), in which case
    the task starts from the global weights. Otherwise the local weights, with the
    fragment synced when the previous round closed mixed with its new global value.
    """
    if local is None or local.shape != global_weights.shape or round_number == 0:
        return np.array(global_weights, dtype=np.float32, copy=True)
    start = np.array(local, dtype=np.float32, copy=True)
    merged = streaming_.synced(round_number - 1).slice
    mix = np.float32(streaming_.mix)
    start[merged] = mix * local[merged] + (np.float32(1) - mix) * global_weights[merged]
    return start


def pseudo_gradient(
    streaming_: Streaming, round_number: int, global_weights: np.ndarray, trained: np.ndarray
) -> np.ndarray:
    """The synced fragment's global value minus the worker's local value of it."""
    synced = streaming_.synced(round_number).slice
    return (global_weights[synced] - trained[synced]).astype(np.float32)
