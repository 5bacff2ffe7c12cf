"""What the peer-to-peer all-reduce carries: each member's part, compressed, and each
reducer's exact sum. Pure numpy, no I/O (the transport is `allreduce`).

The vector is cut into one part per reducing member at chunk boundaries (a chunk: the
`chunk_size` values that share one scale in `training.compression`), so a part's chunks
are the whole vector's chunks. Each reducer takes every member's contribution to its
part and answers all of them with the same bytes, which every member decodes the same
way: the members' means agree bit for bit without any fixed-point trick.

A quantized setting (int8, int4, sign) takes two exchanges:

1. `scales`: each member sends its part's per-chunk statistic (the largest |value|, or
   for sign the mean |value|); the reducer answers with the group's shared scales (the
   largest of them / qmax, or the mean of the means).
2. `codes`: each member quantizes its part with the shared scales, as coordinator mode
   quantizes an upload (int8 codes, int4 nibbles, sign bits: the job's `upload`
   setting); the reducer adds the K members' integer codes, which is exact, and answers
   with the sums packed in as few bits as K sums of codes need (10 bits for K = 4 at
   int8, 6 at int4, 3 at sign). Every member's mean is sum x scale / K.

Error feedback works as in coordinator mode: what a member's codes missed of its
accumulator (the shared scale's rounding) is its residual for the next round.

Top-k: one exchange; each member sends (index, value) pairs of its top-k in the part,
the reducer answers with the sums at the union of the indices (float32, summed in shard
order). `none`: float32 values, float32 sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from idlegrid.training.compression import Compression, topk_count

_QMAX = {"int8": 127, "int4": 7, "sign": 1}


class PartError(ValueError):
    """A contribution or an answer that does not decode; the message says why."""


def bounds(length: int, chunk_size: int, reducers: int) -> list[tuple[int, int]]:
    """Each reducer's [start, end) of a vector of `length`, at chunk boundaries, as even
    as whole chunks allow (a reducer may get an empty part)."""
    if reducers < 1:
        raise ValueError("a group needs a reducer")
    chunks = max(1, math.ceil(length / chunk_size))
    edges = [min(length, chunk_size * (chunks * i // reducers)) for i in range(reducers + 1)]
    return list(zip(edges[:-1], edges[1:], strict=True))


def exchanges(settings: Compression) -> tuple[str, ...]:
    """The exchanges one all-reduce of this setting takes, in order."""
    return ("scales", "codes") if settings.method in _QMAX else ("values",)


def sum_bits(method: str, members: int) -> int:
    """Bits a sum of `members` codes takes, packed (offset to unsigned)."""
    if method == "sign":
        return max(1, members.bit_length())  # (sum + K) / 2 in 0..K
    return (2 * _QMAX[method] * members).bit_length()


# -- a member's side ----------------------------------------------------------------------


def chunk_statistic(part: np.ndarray, settings: Compression) -> np.ndarray:
    """Per chunk of the part: its largest |value| (int8, int4) or mean |value| (sign)."""
    chunks = _chunked(part, settings.chunk_size)
    if settings.method == "sign":
        counts = np.full(len(chunks), settings.chunk_size, dtype=np.float64)
        if len(chunks):
            counts[-1] = part.size - settings.chunk_size * (len(chunks) - 1)
        return (np.abs(chunks).sum(axis=1, dtype=np.float64) / counts).astype(np.float32)
    return np.abs(chunks).max(axis=1, initial=0.0).astype(np.float32)


def codes(part: np.ndarray, scales: np.ndarray, settings: Compression) -> np.ndarray:
    """The part's integer codes under the group's shared scales (int8 values)."""
    if settings.method == "sign":
        return np.where(part >= 0, 1, -1).astype(np.int8)
    qmax = _QMAX[settings.method]
    per_value = np.repeat(scales, settings.chunk_size)[: part.size]
    safe = np.where(per_value > 0, per_value, np.float32(1))
    return np.clip(np.rint(part / safe), -qmax, qmax).astype(np.int8)


def pack_codes(values: np.ndarray, method: str) -> bytes:
    """Codes on the wire as coordinator mode sends them: int8, nibbles, or sign bits."""
    if method == "int8":
        return values.astype(np.int8).tobytes()
    if method == "int4":
        return _pack_bits(values.astype(np.int64) + 7, 4)
    return np.packbits(values > 0, bitorder="little").tobytes()


def unpack_codes(data: bytes, count: int, method: str) -> np.ndarray:
    """`pack_codes` back; PartError if the bytes do not hold `count` codes."""
    if method == "int8":
        if len(data) != count:
            raise PartError(f"{len(data)} bytes for {count} int8 codes")
        return np.frombuffer(data, dtype=np.int8).astype(np.int64)
    if method == "int4":
        values = _unpack_bits(data, count, 4) - 7
        if np.any(np.abs(values) > 7):
            raise PartError("an int4 code outside -7..7")
        return values
    if len(data) != (count + 7) // 8:
        raise PartError(f"{len(data)} bytes for {count} sign bits")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count, bitorder="little")
    return bits.astype(np.int64) * 2 - 1


def dequantized(values: np.ndarray, scales: np.ndarray, chunk_size: int) -> np.ndarray:
    """Codes (or sums of codes) times their chunk's scale, as float32."""
    per_value = np.repeat(np.asarray(scales, np.float32), chunk_size)[: values.size]
    return (values.astype(np.float32) * per_value).astype(np.float32)


@dataclass(frozen=True)
class Sparse:
    """A part's top-k contribution: indices within the part and their values."""

    indices: np.ndarray  # uint32
    values: np.ndarray  # float32


def topk_part(accumulator: np.ndarray, start: int, end: int, settings: Compression) -> Sparse:
    """The part [start, end) of the vector's top-k (chosen over the whole accumulator)."""
    k = topk_count(accumulator.size, settings.topk_fraction)
    chosen = np.sort(np.argpartition(-np.abs(accumulator), k - 1)[:k]) if k else np.zeros(0)
    inside = chosen[(chosen >= start) & (chosen < end)].astype(np.int64)
    return Sparse((inside - start).astype(np.uint32), accumulator[inside].astype(np.float32))


def pack_sparse(sparse: Sparse) -> bytes:
    count = np.array([sparse.indices.size], dtype=np.uint32)
    return count.tobytes() + sparse.indices.astype(np.uint32).tobytes() + sparse.values.tobytes()


def unpack_sparse(data: bytes, length: int) -> Sparse:
    """`pack_sparse` back for a part of `length`; PartError if it does not fit."""
    if len(data) < 4:
        raise PartError("a sparse part without its count")
    count = int(np.frombuffer(data[:4], dtype=np.uint32)[0])
    if len(data) != 4 + 8 * count:
        raise PartError(f"{len(data)} bytes for {count} sparse values")
    indices = np.frombuffer(data[4 : 4 + 4 * count], dtype=np.uint32)
    values = np.frombuffer(data[4 + 4 * count :], dtype=np.float32)
    if count and (np.any(np.diff(indices.astype(np.int64)) <= 0) or indices[-1] >= length):
        raise PartError(f"sparse indices must increase and stay below {length}")
    if not np.all(np.isfinite(values)):
        raise PartError("sparse values must be finite")
    return Sparse(indices, values)


def floats(data: bytes, count: int, what: str) -> np.ndarray:
    """`count` finite float32 values from bytes; PartError otherwise."""
    if len(data) != 4 * count:
        raise PartError(f"{len(data)} bytes for {count} float32 {what}")
    values = np.frombuffer(data, dtype=np.float32)
    if not np.all(np.isfinite(values)):
        raise PartError(f"{what} must be finite")
    return values


# -- a reducer's side ---------------------------------------------------------------------


def reduce_scales(statistics: list[np.ndarray], settings: Compression) -> bytes:
    """The group's shared scales of a part from every member's chunk statistic."""
    stacked = np.stack(statistics).astype(np.float64)
    if settings.method == "sign":
        return (stacked.sum(axis=0) / len(statistics)).astype(np.float32).tobytes()
    qmax = _QMAX[settings.method]
    return (stacked.max(axis=0) / qmax).astype(np.float32).tobytes()


def reduce_codes(contributions: list[np.ndarray], method: str) -> bytes:
    """The exact sum of every member's codes, packed in `sum_bits` bits a value."""
    total = np.asarray(np.sum(np.stack(contributions), axis=0, dtype=np.int64))
    members = len(contributions)
    if method == "sign":
        return _pack_bits((total + members) // 2, sum_bits(method, members))
    return _pack_bits(total + _QMAX[method] * members, sum_bits(method, members))


def unpack_sums(data: bytes, count: int, method: str, members: int) -> np.ndarray:
    """`reduce_codes` back to signed sums; PartError if the bytes do not fit."""
    width = sum_bits(method, members)
    raw = _unpack_bits(data, count, width)
    if method == "sign":
        if np.any(raw > members):
            raise PartError("a sum of signs beyond the group's size")
        return raw * 2 - members
    span = _QMAX[method] * members
    if np.any(raw > 2 * span):
        raise PartError("a sum of codes beyond what the group's codes reach")
    return raw - span


def reduce_sparse(contributions: list[Sparse], length: int) -> bytes:
    """The sums of every member's sparse values at the union of their indices."""
    total = np.zeros(length, dtype=np.float32)
    touched = np.zeros(length, dtype=bool)
    for sparse in contributions:  # in shard order: the same float sums on any reducer
        total[sparse.indices] += sparse.values
        touched[sparse.indices] = True
    indices = np.flatnonzero(touched).astype(np.uint32)
    return pack_sparse(Sparse(indices, total[indices]))


def reduce_dense(contributions: list[np.ndarray]) -> bytes:
    """The float32 sum of every member's values (added in shard order)."""
    total = np.zeros_like(contributions[0], dtype=np.float32)
    for values in contributions:
        total += values
    return total.tobytes()


# -- one all-reduce ------------------------------------------------------------------------


class BadPart(PartError):
    """A member's contribution that does not decode: the reducer names the member."""

    def __init__(self, shard: int, why: str) -> None:
        super().__init__(f"member {shard}'s part does not decode: {why}")
        self.shard = shard


def chunks_of(length: int, chunk_size: int) -> int:
    return math.ceil(length / chunk_size)


def reduce(step: str, settings: Compression, length: int,
           contributions: dict[int, bytes]) -> bytes:  # fmt: skip
    """A reducer's answer to every member at one exchange of a part of `length` values,
    from each member's contribution (shard -> bytes); BadPart names a member whose
    contribution does not decode."""
    order = sorted(contributions)
    method = settings.method
    decoded: list = []
    for shard in order:
        data = contributions[shard]
        try:
            if step == "scales":
                decoded.append(floats(data, chunks_of(length, settings.chunk_size), "scales"))
            elif step == "codes":
                decoded.append(unpack_codes(data, length, method))
            elif method == "topk":
                decoded.append(unpack_sparse(data, length))
            else:
                decoded.append(floats(data, length, "values"))
        except PartError as exc:
            raise BadPart(shard, str(exc)) from None
    if step == "scales":
        if any(np.any(values < 0) for values in decoded):
            raise BadPart(order[[bool(np.any(v < 0)) for v in decoded].index(True)],
                          "a negative chunk statistic")  # fmt: skip
        return reduce_scales(decoded, settings)
    if step == "codes":
        return reduce_codes(decoded, method)
    if method == "topk":
        return reduce_sparse(decoded, length)
    return reduce_dense(decoded)


class Reduction:
    """One member's side of an all-reduce of its accumulator (its pseudo-gradient plus
    what error feedback owes): what it sends each reducer at each exchange, what it makes
    of their answers, and at the end the group's mean and its own new residual."""

    def __init__(self, accumulator: np.ndarray, settings: Compression, members: int,
                 parts: list[tuple[int, int]]) -> None:  # fmt: skip
        self.accumulator = np.asarray(accumulator, dtype=np.float32)
        self.settings, self.members, self.parts = settings, members, parts
        self.steps = exchanges(settings)
        self._scales: dict[int, np.ndarray] = {}
        self._sums: dict[int, np.ndarray] = {}
        self._sent: dict[int, np.ndarray] = {}  # part -> what this member's codes carried

    def _part(self, index: int) -> np.ndarray:
        start, end = self.parts[index]
        return self.accumulator[start:end]

    def contribution(self, step: str, index: int) -> bytes:
        """This member's bytes for part `index` at exchange `step`."""
        settings, part = self.settings, self._part(index)
        if step == "scales":
            return chunk_statistic(part, settings).tobytes()
        if step == "codes":
            own = codes(part, self._scales[index], settings)
            self._sent[index] = dequantized(own, self._scales[index], settings.chunk_size)
            return pack_codes(own, settings.method)
        if settings.method == "topk":
            start, end = self.parts[index]
            sparse = topk_part(self.accumulator, start, end, settings)
            sent = np.zeros(end - start, dtype=np.float32)
            sent[sparse.indices] = sparse.values
            self._sent[index] = sent
            return pack_sparse(sparse)
        self._sent[index] = part.copy()
        return part.tobytes()

    def take(self, step: str, index: int, answer: bytes) -> None:
        """A reducer's answer for part `index` at `step`; PartError if it does not decode."""
        start, end = self.parts[index]
        if end == start:
            return  # an empty part: nothing was sent or answered
        length, settings = end - start, self.settings
        if step == "scales":
            scales = floats(answer, chunks_of(length, settings.chunk_size), "shared scales")
            if np.any(scales < 0):
                raise PartError("negative shared scales")
            self._scales[index] = scales
        elif step == "codes":
            self._sums[index] = unpack_sums(answer, length, settings.method, self.members)
        elif settings.method == "topk":
            sparse = unpack_sparse(answer, length)
            dense = np.zeros(length, dtype=np.float32)
            dense[sparse.indices] = sparse.values
            self._sums[index] = dense
        else:
            self._sums[index] = floats(answer, length, "sums")

    def mean(self) -> np.ndarray:
        """The group's mean: the same bytes on every member that took the same answers."""
        mean = np.zeros(self.accumulator.size, dtype=np.float32)
        for index, (start, end) in enumerate(self.parts):
            if end == start:
                continue
            sums = self._sums[index]
            if self.settings.method in _QMAX:
                total = dequantized(sums, self._scales[index], self.settings.chunk_size)
            else:
                total = np.asarray(sums, dtype=np.float32)
            mean[start:end] = total / np.float32(self.members)
        return mean

    def residual(self) -> np.ndarray:
        """What this member's contributions missed of its accumulator (error feedback)."""
        sent = np.zeros_like(self.accumulator)
        for index, (start, end) in enumerate(self.parts):
            if end > start:
                sent[start:end] = self._sent[index]
        return self.accumulator - sent


# -- bit packing --------------------------------------------------------------------------


def _pack_bits(values: np.ndarray, width: int) -> bytes:
    """Unsigned integers below 2^width, `width` bits each, least significant bit first."""
    if width <= 16:  # each value's two little-endian bytes as bits, its low `width` kept
        pairs = np.asarray(values, dtype="<u2").view(np.uint8).reshape(-1, 2)
        bits = np.unpackbits(pairs, axis=1, bitorder="little")[:, :width]
    else:
        unsigned = np.asarray(values, dtype=np.uint64)
        shifts = np.arange(width, dtype=np.uint64)
        bits = ((unsigned[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(bits.ravel(), bitorder="little").tobytes()


def _unpack_bits(data: bytes, count: int, width: int) -> np.ndarray:
    if len(data) != (count * width + 7) // 8:
        raise PartError(f"{len(data)} bytes for {count} values of {width} bits")
    bits = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count * width,
                         bitorder="little").reshape(count, width)  # fmt: skip
    if width <= 16:  # a bit column at a time, in 16 bits
        total = np.zeros(count, dtype=np.uint16)
        for bit in range(width):
            total |= bits[:, bit].astype(np.uint16) << np.uint16(bit)
        return total.astype(np.int64)
    weights = 1 << np.arange(width, dtype=np.int64)
    return bits.astype(np.int64) @ weights


def _chunked(values: np.ndarray, chunk_size: int) -> np.ndarray:
    chunks = math.ceil(values.size / chunk_size)
    padded = np.zeros(chunks * chunk_size, dtype=np.float32)
    padded[: values.size] = values
    return padded.reshape(chunks, chunk_size)
