"""The peer-to-peer all-reduce's parts (p2p/parts.py): compressed as uploads are, every
member reading back the same bytes of the mean, bad parts named."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from idlegrid.p2p import parts
from idlegrid.training.compression import Compression, compress, decode


def run_group(accumulators: list[np.ndarray], settings: Compression, reducers: int | None = None):
    """Every member's Reduction after a whole all-reduce, reduced in process."""
    members = len(accumulators)
    bounds = parts.bounds(accumulators[0].size, settings.chunk_size, reducers or members)
    sides = [parts.Reduction(acc, settings, members, bounds) for acc in accumulators]
    wire = 0
    for step in parts.exchanges(settings):
        for index, (start, end) in enumerate(bounds):
            sent = {shard: side.contribution(step, index) for shard, side in enumerate(sides)}
            answer = parts.reduce(step, settings, end - start, sent)
            wire += sum(map(len, sent.values())) + members * len(answer)
            for side in sides:
                side.take(step, index, answer)
    return sides, wire


def digest(values: np.ndarray) -> str:
    return hashlib.sha256(values.tobytes()).hexdigest()


@pytest.mark.parametrize("method", ["int8", "int4", "sign", "topk", "none"])
@pytest.mark.parametrize("members", [2, 3, 4, 7])
def test_every_member_reads_the_same_mean(method: str, members: int) -> None:
    rng = np.random.default_rng(members)
    length = 1000 + members  # not a multiple of the chunk
    accs = [rng.normal(0, 1 + shard, length).astype(np.float32) for shard in range(members)]
    settings = Compression(method=method, chunk_size=64, topk_fraction=0.1)
    sides, _ = run_group(accs, settings)
    means = [side.mean() for side in sides]
    assert len({digest(mean) for mean in means}) == 1
    truth = np.mean(accs, axis=0)
    error = np.abs(means[0] - truth)
    if method == "none":
        assert np.max(error) < 1e-5
    elif method in ("int8", "int4"):
        qmax = {"int8": 127, "int4": 7}[method]
        # Each member's value is off by at most half its shared scale: the mean as well.
        peak = max(np.max(np.abs(a)) for a in accs)
        assert np.max(error) <= 0.5 * peak / qmax + 1e-6
    # The mean is the mean of what the members' contributions carried: each member's
    # accumulator less what error feedback keeps for its next round.
    carried = [acc - side.residual() for acc, side in zip(accs, sides, strict=True)]
    assert np.allclose(np.mean(carried, axis=0), means[0], rtol=0, atol=1e-5)


def test_int8_sends_a_byte_a_value_and_sums_exactly() -> None:
    """Four members at int8: about a byte a value up, 10 bits a value back (the exact sum)."""
    rng = np.random.default_rng(0)
    length, members = 4096, 4
    accs = [rng.normal(0, 1, length).astype(np.float32) for _ in range(members)]
    settings = Compression(method="int8", chunk_size=256)
    sides, wire = run_group(accs, settings)
    assert parts.sum_bits("int8", 4) == 10
    per_value_each_way = wire / members / length
    # Codes (1 byte) + sums (10/8 byte) + two scale exchanges: per member, all parts.
    assert 2.25 <= per_value_each_way <= 2.25 + 3 * 4 * 2 / 256
    # With one shared scale the codes' sum is exact: every member's mean equals the
    # mean of what each member's codes carried.
    carried = [acc - side.residual() for acc, side in zip(accs, sides, strict=True)]
    assert np.allclose(sides[0].mean(), np.mean(carried, axis=0), rtol=0, atol=1e-6)


def test_error_feedback_carries_what_the_shared_scale_missed() -> None:
    rng = np.random.default_rng(1)
    settings = Compression(method="int4", chunk_size=32, error_feedback=True)
    accs = [rng.normal(0, 1, 300).astype(np.float32) for _ in range(3)]
    sides, _ = run_group(accs, settings)
    for side in sides:
        residual = side.residual()
        # What was missed is below half a step of the shared scale of its chunk.
        assert np.max(np.abs(residual)) <= 0.5 * max(np.max(np.abs(a)) for a in accs) / 7 + 1e-6
        assert not np.allclose(residual, 0)


def test_int8_mean_is_as_close_as_coordinator_mode() -> None:
    """The p2p mean is as near the true mean as coordinator mode's mean of int8 uploads."""
    rng = np.random.default_rng(2)
    accs = [rng.normal(0, 1, 5000).astype(np.float32) * rng.uniform(0.5, 2) for _ in range(4)]
    settings = Compression(method="int8")
    sides, _ = run_group(accs, settings)
    truth = np.mean(accs, axis=0)
    coordinator = np.mean([decode(compress(a, settings)[0]) for a in accs], axis=0)
    p2p_error = np.sqrt(np.mean((sides[0].mean() - truth) ** 2))
    coordinator_error = np.sqrt(np.mean((coordinator - truth) ** 2))
    assert p2p_error <= 2.5 * coordinator_error


def test_a_part_that_does_not_decode_names_its_member() -> None:
    settings = Compression(method="int8", chunk_size=16)
    good = parts.pack_codes(np.zeros(40, np.int8), "int8")
    with pytest.raises(parts.BadPart) as caught:
        parts.reduce("codes", settings, 40, {0: good, 2: good[:-1], 3: good})
    assert caught.value.shard == 2 and "member 2" in str(caught.value)
    with pytest.raises(parts.BadPart) as caught:
        bad = np.array([1.0, np.nan, 1.0], np.float32).tobytes()
        parts.reduce("scales", settings, 40, {0: np.ones(3, np.float32).tobytes(), 1: bad})
    assert caught.value.shard == 1
    with pytest.raises(parts.BadPart):
        parts.reduce("values", Compression(method="topk"), 40,
                     {0: parts.pack_sparse(parts.Sparse(np.array([5, 3], np.uint32),
                                                        np.ones(2, np.float32)))})  # fmt: skip


def test_an_answer_that_does_not_decode_is_refused() -> None:
    settings = Compression(method="int4", chunk_size=16)
    side = parts.Reduction(np.ones(32, np.float32), settings, 4, parts.bounds(32, 16, 2))
    side.take("scales", 0, np.ones(1, np.float32).tobytes())
    with pytest.raises(parts.PartError):
        side.take("codes", 0, b"\x00")
    with pytest.raises(parts.PartError):
        # 6-bit sums of four int4 codes reach 56 at most: 63 is beyond.
        side.take("codes", 0, parts._pack_bits(np.full(16, 63), 6))


@pytest.mark.parametrize(
    ("length", "chunk", "reducers"),
    [(1000, 64, 4), (10, 256, 3), (0, 8, 2), (4096, 256, 4), (1025, 8, 7)],
)
def test_bounds_cover_the_vector_at_chunk_edges(length: int, chunk: int, reducers: int) -> None:
    cut = parts.bounds(length, chunk, reducers)
    assert len(cut) == reducers and cut[0][0] == 0 and cut[-1][1] == length
    for (_, end), (start, _) in zip(cut, cut[1:], strict=False):
        assert end == start and (start % chunk == 0 or start == length)


@pytest.mark.parametrize(("method", "members", "bits"),
                         [("int8", 4, 10), ("int8", 2, 9), ("int4", 4, 6), ("int4", 64, 10),
                          ("sign", 4, 3), ("sign", 1, 1)])  # fmt: skip
def test_sum_bits(method: str, members: int, bits: int) -> None:
    assert parts.sum_bits(method, members) == bits
