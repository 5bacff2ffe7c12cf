"""Compression of pseudo-gradients and outer updates: per-chunk quantization and top-k.

Pure numpy, no I/O. A message is a small frozen value; `decode` gives back a dense
float32 vector; `encode_message` gives the exact bytes that cross the network, so byte
counts are `len(encode_message(m))`, never an estimate.

- int8 / int4: symmetric quantization per chunk of `chunk_size` values, one float32 scale
  per chunk (max |x| / 127, or / 7). Rounding is to nearest, so each value is off by at most
  half its chunk's scale. int4 codes (-7..7) are packed two to a byte.
- sign: one bit a value, its sign, times one float32 scale per chunk: the chunk's mean
  |value| (scaled sign, as in EF-SignSGD, Karimireddy et al., 2019). Biased on its own;
  meant for error feedback, which carries what it got wrong into the next message.
- top-k: the k largest magnitudes of (update + residual) are sent as (uint32 index, float32
  value) pairs; what was not sent is the new residual, kept by the sender and added to its
  next update (error feedback), so nothing is lost, only delayed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from idlegrid.training.flat import ContainerError, pack, unpack

Method = Literal["none", "int8", "int4", "sign", "topk"]
_QMAX = {8: 127, 4: 7}
_BITS: dict[str, int] = {"int8": 8, "int4": 4, "sign": 1}
_METHOD_OF_BITS: dict[int, Method] = {8: "int8", 4: "int4", 1: "sign"}


class Compression(BaseModel):
    """How one direction of traffic is compressed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Method = "int8"
    chunk_size: int = Field(default=256, ge=8, le=1 << 20, description="values per scale")
    topk_fraction: float = Field(
        default=0.01, gt=0.0, le=1.0, description="share of values top-k sends"
    )
    error_feedback: bool = Field(
        default=False, description="int8/int4/sign: carry the rounding error into the next message"
    )

    @property
    def stateful(self) -> bool:
        """Whether the sender keeps a residual (error feedback) between messages."""
        return self.method == "topk" or (self.error_feedback and self.method != "none")


@dataclass(frozen=True)
class Dense:
    """An uncompressed float32 vector."""

    values: np.ndarray


@dataclass(frozen=True)
class Quantized:
    """Symmetric per-chunk quantization: value ~= code * scales[chunk]."""

    bits: int
    length: int
    chunk_size: int
    scales: np.ndarray  # float32, one per chunk
    codes: np.ndarray  # int8 (8 bits); uint8 with two codes a byte (4) or eight signs (1)


@dataclass(frozen=True)
class Sparse:
    """A vector of `length` that is zero except at sorted `indices`."""

    length: int
    indices: np.ndarray  # uint32, strictly increasing
    values: np.ndarray  # float32


Message = Dense | Quantized | Sparse


# -- quantization -----------------------------------------------------------------------


def quantize(vector: np.ndarray, *, bits: int = 8, chunk_size: int = 256) -> Quantized:
    """Per-chunk symmetric quantization of a float32 vector to `bits` (8, 4, or 1: sign)."""
    if bits == 1:
        return _sign(vector, chunk_size)
    if bits not in _QMAX:
        raise ValueError(f"bits must be 8, 4 or 1, got {bits}")
    qmax = _QMAX[bits]
    values = np.asarray(vector, dtype=np.float32)
    chunks = _chunked(values, chunk_size)
    scales = (np.max(np.abs(chunks), axis=1) / np.float32(qmax)).astype(np.float32)
    # A zero chunk has scale 0: its codes are 0 and decode to exact zeros.
    safe = np.where(scales > 0, scales, np.float32(1))
    codes = np.clip(np.rint(chunks / safe[:, None]), -qmax, qmax).astype(np.int8)
    flat_codes = codes.ravel()[: values.size]
    packed = flat_codes if bits == 8 else _pack_nibbles(flat_codes)
    return Quantized(bits, values.size, chunk_size, scales, packed)


def _sign(vector: np.ndarray, chunk_size: int) -> Quantized:
    values = np.asarray(vector, dtype=np.float32)
    chunks = _chunked(values, chunk_size)
    # The mean |value| of each chunk's real values (the padding of the last one left out).
    counts = np.full(len(chunks), chunk_size, dtype=np.float32)
    counts[-1] = values.size - chunk_size * (len(chunks) - 1) or 1
    scales = (np.sum(np.abs(chunks), axis=1) / counts).astype(np.float32)
    signs = np.packbits(values >= 0, bitorder="little")
    return Quantized(1, values.size, chunk_size, scales, signs)


def dequantize(message: Quantized) -> np.ndarray:
    """The float32 vector a quantized message stands for (same bits on every machine)."""
    if message.bits == 1:
        bits = np.unpackbits(message.codes, count=message.length, bitorder="little")
        codes = bits.astype(np.float32) * np.float32(2) - np.float32(1)
    elif message.bits == 8:
        codes = message.codes
    else:
        codes = _unpack_nibbles(message.codes, message.length)
    padded = np.zeros(len(message.scales) * message.chunk_size, dtype=np.float32)
    padded[: message.length] = codes
    chunks = padded.reshape(-1, message.chunk_size) * message.scales[:, None]
    return chunks.ravel()[: message.length]


def _chunked(values: np.ndarray, chunk_size: int) -> np.ndarray:
    chunks = max(1, math.ceil(values.size / chunk_size))
    padded = np.zeros(chunks * chunk_size, dtype=np.float32)
    padded[: values.size] = values
    return padded.reshape(chunks, chunk_size)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    # Codes -7..7 stored as two's-complement nibbles, the first value in the low nibble.
    nibbles = (codes.astype(np.int16) & 0x0F).astype(np.uint8)
    if nibbles.size % 2:
        nibbles = np.append(nibbles, np.uint8(0))
    return (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)


def _unpack_nibbles(packed: np.ndarray, length: int) -> np.ndarray:
    nibbles = np.empty(packed.size * 2, dtype=np.uint8)
    nibbles[0::2] = packed & 0x0F
    nibbles[1::2] = packed >> 4
    signed = nibbles.astype(np.int8)
    signed[signed > 7] -= 16
    return signed[:length]


# -- top-k with error feedback ----------------------------------------------------------


def topk_count(length: int, fraction: float) -> int:
    """How many values top-k sends of a vector of `length`."""
    return min(length, max(1, math.ceil(fraction * length))) if length else 0


def topk_compress(
    delta: np.ndarray, residual: np.ndarray | None, k: int
) -> tuple[Sparse, np.ndarray]:
    """Send the `k` largest |delta + residual|; return the message and the new residual.

    The accumulator is split exactly: sent values are copied out of it and the rest is
    the new residual, so message + new residual == delta + residual value by value.
    """
    accumulator = np.asarray(delta, dtype=np.float32).copy()
    if residual is not None:
        accumulator += residual
    k = min(k, accumulator.size)
    chosen = np.argpartition(-np.abs(accumulator), k - 1)[:k] if k else np.zeros(0, np.int64)
    indices = np.sort(chosen).astype(np.uint32)
    values = accumulator[indices]
    accumulator[indices] = 0.0
    return Sparse(accumulator.size, indices, values), accumulator


def densify(message: Sparse) -> np.ndarray:
    """The dense float32 vector of a sparse message."""
    dense = np.zeros(message.length, dtype=np.float32)
    dense[message.indices] = message.values
    return dense


# -- one entry point --------------------------------------------------------------------


def compress(
    delta: np.ndarray, settings: Compression, residual: np.ndarray | None = None
) -> tuple[Message, np.ndarray | None]:
    """Compress `delta` as `settings` say, with error feedback through `residual`.

    Returns the message and the residual to keep for the next call. With a residual,
    quantization feeds back its rounding error too; without one (None) it is stateless,
    unless the settings are `stateful` (top-k, or error feedback asked for): then a
    missing residual starts at zero.
    """
    values = np.asarray(delta, dtype=np.float32)
    if residual is None and settings.stateful and settings.method != "topk":
        residual = np.zeros_like(values)
    if settings.method == "topk":
        return topk_compress(values, residual, topk_count(values.size, settings.topk_fraction))
    accumulator = values if residual is None else values + residual
    message: Message
    if settings.method == "none":
        message = Dense(accumulator.copy())
    else:
        bits = _BITS[settings.method]
        message = quantize(accumulator, bits=bits, chunk_size=settings.chunk_size)
    new_residual = None if residual is None else accumulator - decode(message)
    return message, new_residual


def decode(message: Message) -> np.ndarray:
    """The dense float32 vector a message stands for."""
    if isinstance(message, Dense):
        return message.values
    if isinstance(message, Quantized):
        return dequantize(message)
    return densify(message)


def method_of(message: Message) -> Method:
    """The compression method that makes messages like this one."""
    if isinstance(message, Dense):
        return "none"
    if isinstance(message, Quantized):
        return _METHOD_OF_BITS[message.bits]
    return "topk"


def length(message: Message) -> int:
    """Length of the dense vector a message stands for."""
    return message.values.size if isinstance(message, Dense) else message.length


# -- wire form --------------------------------------------------------------------------


def to_arrays(message: Message, prefix: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A message as a JSON-able description and named arrays (for one container)."""
    if isinstance(message, Dense):
        return {"method": "none"}, {f"{prefix}values": message.values}
    if isinstance(message, Quantized):
        meta = {
            "method": _METHOD_OF_BITS[message.bits],
            "length": message.length,
            "chunk_size": message.chunk_size,
        }
        return meta, {f"{prefix}scales": message.scales, f"{prefix}codes": message.codes}
    arrays = {f"{prefix}indices": message.indices, f"{prefix}values": message.values}
    return {"method": "topk", "length": message.length}, arrays


def from_arrays(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], prefix: str) -> Message:
    """The message `to_arrays` described; ContainerError if the parts do not fit."""
    try:
        method = meta["method"]
        if method == "none":
            return Dense(_array(arrays, f"{prefix}values", np.float32))
        if method in _BITS:
            return _quantized_from(meta, arrays, prefix, bits=_BITS[method])
        if method == "topk":
            return _sparse_from(meta, arrays, prefix)
    except (KeyError, TypeError, ValueError) as exc:
        raise ContainerError(f"malformed {prefix or 'message'}: {exc}") from None
    raise ContainerError(f"unknown compression method {meta.get('method')!r}")


def _array(arrays: Mapping[str, np.ndarray], name: str, dtype: type) -> np.ndarray:
    array = arrays[name]
    if array.dtype != dtype or array.ndim != 1:
        raise ContainerError(f"{name} must be a 1-D {np.dtype(dtype)} array")
    return array


def _quantized_from(
    meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], prefix: str, bits: int
) -> Quantized:
    size, chunk_size = int(meta["length"]), int(meta["chunk_size"])
    scales = _array(arrays, f"{prefix}scales", np.float32)
    codes = _array(arrays, f"{prefix}codes", np.int8 if bits == 8 else np.uint8)
    expected_codes = {8: size, 4: (size + 1) // 2, 1: (size + 7) // 8}[bits]
    if size < 0 or chunk_size < 1 or codes.size != expected_codes:
        raise ContainerError(f"{prefix}codes: {codes.size} codes for {size} values")
    if scales.size != max(1, math.ceil(size / chunk_size)):
        raise ContainerError(f"{prefix}scales: {scales.size} scales for {size} values")
    if not np.all(np.isfinite(scales)) or np.any(scales < 0):
        raise ContainerError(f"{prefix}scales must be finite and non-negative")
    return Quantized(bits, size, chunk_size, scales, codes)


def _sparse_from(meta: Mapping[str, Any], arrays: Mapping[str, np.ndarray], prefix: str) -> Sparse:
    size = int(meta["length"])
    indices = _array(arrays, f"{prefix}indices", np.uint32)
    values = _array(arrays, f"{prefix}values", np.float32)
    if indices.size != values.size:
        raise ContainerError(f"{prefix}: {indices.size} indices for {values.size} values")
    if indices.size and (np.any(np.diff(indices.astype(np.int64)) <= 0) or indices[-1] >= size):
        raise ContainerError(f"{prefix}indices must increase and stay below {size}")
    return Sparse(size, indices, values)


def encode_message(message: Message) -> bytes:
    """The bytes of a message on its own (a safetensors container)."""
    meta, arrays = to_arrays(message, "")
    return pack(arrays, meta)


def decode_message(data: bytes) -> Message:
    """The message `encode_message` wrote; ContainerError otherwise."""
    arrays, meta = unpack(data)
    return from_arrays(meta, arrays, "")


def payload_bytes(message: Message) -> int:
    """Bytes of the message's arrays alone: the information, without container headers."""
    _, arrays = to_arrays(message, "")
    return sum(array.nbytes for array in arrays.values())
