"""Named tensors as one float32 vector, and the safetensors container every training blob uses.

Aggregation, compression and the outer optimizer work on one flat float32 vector; a
`FlatSpec` (names and shapes, in order) turns it back into named tensors. Every training
blob (weights, task payloads, task results) is a safetensors file: an 8-byte length, a
JSON header, raw little-endian arrays. idlegrid's own header travels as one JSON string
under the `__metadata__` key "idlegrid". numpy only: the coordinator reads and writes these
without torch, and nothing is ever unpickled.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load, save

HEADER_KEY = "idlegrid"
# A safetensors header is JSON text of this many bytes at most (the format's own cap).
_MAX_HEADER_BYTES = 100_000_000


class ContainerError(ValueError):
    """Bytes that are not a usable idlegrid safetensors container; the message says why."""


@dataclass(frozen=True)
class FlatSpec:
    """Names and shapes of the tensors packed, in order, into one flat vector."""

    entries: tuple[tuple[str, tuple[int, ...]], ...]

    @property
    def size(self) -> int:
        """Number of float32 values in the flat vector."""
        return sum(math.prod(shape) for _, shape in self.entries)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.entries)

    def to_json(self) -> list[list[Any]]:
        return [[name, list(shape)] for name, shape in self.entries]

    @classmethod
    def from_json(cls, raw: object) -> FlatSpec:
        """The spec written by `to_json`; ContainerError if `raw` is not one."""
        if not isinstance(raw, list):
            raise ContainerError("spec must be a list of [name, shape] pairs")
        try:
            entries = tuple((str(name), tuple(int(d) for d in shape)) for name, shape in raw)
        except (TypeError, ValueError):
            raise ContainerError("spec must be a list of [name, shape] pairs") from None
        if any(d < 0 for _, shape in entries for d in shape):
            raise ContainerError("spec has a negative dimension")
        return cls(entries)


def flatten(named: Mapping[str, np.ndarray]) -> tuple[np.ndarray, FlatSpec]:
    """One float32 vector of all tensors, in the mapping's order, and its spec."""
    spec = FlatSpec(tuple((name, tuple(array.shape)) for name, array in named.items()))
    if not named:
        return np.zeros(0, dtype=np.float32), spec
    vector = np.concatenate([np.asarray(a, dtype=np.float32).ravel() for a in named.values()])
    return vector, spec


def unflatten(vector: np.ndarray, spec: FlatSpec) -> dict[str, np.ndarray]:
    """Named tensors (views into `vector`) laid out by `spec`."""
    if vector.shape != (spec.size,):
        raise ValueError(f"vector of shape {vector.shape} does not fit a spec of {spec.size}")
    named, offset = {}, 0
    for name, shape in spec.entries:
        count = math.prod(shape)
        named[name] = vector[offset : offset + count].reshape(shape)
        offset += count
    return named


def digest(vector: np.ndarray) -> str:
    """SHA-256 of a flat vector's little-endian float32 bytes: weights' identity on the wire."""
    return hashlib.sha256(np.ascontiguousarray(vector, dtype="<f4").tobytes()).hexdigest()


# -- the container ----------------------------------------------------------------------


def pack(arrays: Mapping[str, np.ndarray], header: Mapping[str, Any]) -> bytes:
    """A safetensors file of `arrays` with `header` as JSON metadata."""
    # Not np.ascontiguousarray: it turns a 0-d array into shape (1,).
    contiguous = {name: a if a.flags.c_contiguous else a.copy() for name, a in arrays.items()}
    return save(contiguous, metadata={HEADER_KEY: json.dumps(header, separators=(",", ":"))})


def unpack(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Arrays and idlegrid header of a container made by `pack`; ContainerError otherwise."""
    metadata = read_metadata(data)
    try:
        header = json.loads(metadata.get(HEADER_KEY, "{}"))
    except ValueError as exc:
        raise ContainerError(f"idlegrid header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise ContainerError("idlegrid header must be a JSON object")
    try:
        arrays = load(bytes(data))
    except (SafetensorError, ValueError, TypeError) as exc:
        raise ContainerError(f"not a readable safetensors file: {exc}") from None
    return arrays, header


def read_metadata(data: bytes) -> dict[str, str]:
    """The string-to-string `__metadata__` of a safetensors file (empty if it has none)."""
    if len(data) < 8:
        raise ContainerError("too short for a safetensors file")
    (header_size,) = struct.unpack("<Q", data[:8])
    if header_size > min(_MAX_HEADER_BYTES, len(data) - 8):
        raise ContainerError("safetensors header length runs past the end of the data")
    try:
        header = json.loads(data[8 : 8 + header_size])
    except ValueError as exc:
        raise ContainerError(f"safetensors header is not JSON: {exc}") from None
    metadata = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ContainerError("safetensors __metadata__ must map strings to strings")
    return metadata


def weights_to_safetensors(
    vector: np.ndarray, spec: FlatSpec, metadata: Mapping[str, Any] | None = None
) -> bytes:
    """Named float32 tensors of a flat vector, loadable by `safetensors.torch.load`."""
    return pack(unflatten(np.asarray(vector, dtype=np.float32), spec), dict(metadata or {}))


def weights_from_safetensors(data: bytes, spec: FlatSpec) -> np.ndarray:
    """The flat float32 vector of a safetensors file holding exactly `spec`'s tensors."""
    arrays, _ = unpack(data)
    missing = set(spec.names) - set(arrays)
    extra = set(arrays) - set(spec.names)
    if missing or extra:
        raise ContainerError(f"weights: missing {sorted(missing)}, unexpected {sorted(extra)}")
    named = {}
    for name, shape in spec.entries:
        array = arrays[name]
        if tuple(array.shape) != shape:
            raise ContainerError(f"weights: {name} has shape {array.shape}, expected {shape}")
        if array.dtype.kind != "f":
            raise ContainerError(f"weights: {name} is {array.dtype}, expected floating point")
        named[name] = array
    vector, _ = flatten(named)
    if not np.all(np.isfinite(vector)):
        raise ContainerError("weights contain NaN or infinite values")
    return vector
