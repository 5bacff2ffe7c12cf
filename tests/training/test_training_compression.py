"""Compression of pseudo-gradients: error bounds, exact byte counts, error feedback."""

from __future__ import annotations

import math

import numpy as np
import pytest

from idlegrid.training import compression as c
from idlegrid.training.flat import ContainerError


def _vector(length: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Runs of 64 values of very different magnitudes: per-chunk scales must adapt to each.
    magnitudes = np.repeat(10.0 ** rng.integers(-6, 2, length // 64 + 1), 64)[:length]
    return (rng.standard_normal(length) * magnitudes).astype(np.float32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("length", "chunk_size"), [(4096, 256), (1000, 64), (7, 8), (1, 8)])
def test_quantization_error_is_at_most_half_a_scale_per_chunk(
    bits: int, length: int, chunk_size: int
) -> None:
    vector = _vector(length)
    message = c.quantize(vector, bits=bits, chunk_size=chunk_size)
    decoded = c.dequantize(message)
    assert decoded.dtype == np.float32 and decoded.shape == vector.shape
    chunks = math.ceil(length / chunk_size)
    assert message.scales.shape == (chunks,)
    error = np.abs(decoded.astype(np.float64) - vector)
    bound = np.repeat(message.scales.astype(np.float64), chunk_size)[:length] / 2
    # Rounding x / scale and code * scale in float32 adds a few ulps on top of scale / 2.
    assert np.all(error <= bound * (1 + 1e-6) + np.abs(vector) * 1e-6)
    qmax = 127 if bits == 8 else 7
    maxima = np.abs(np.pad(vector, (0, chunks * chunk_size - length))).reshape(chunks, -1)
    assert np.allclose(message.scales, maxima.max(axis=1) / qmax, rtol=1e-6)


def test_a_zero_chunk_decodes_to_exact_zeros() -> None:
    vector = np.concatenate([np.zeros(256), np.ones(256)]).astype(np.float32)
    message = c.quantize(vector, bits=8, chunk_size=256)
    assert message.scales[0] == 0
    assert np.array_equal(c.dequantize(message), vector)


def test_int4_codes_pack_two_to_a_byte_and_keep_their_sign() -> None:
    vector = np.array([-7, -1, 0, 1, 7, -3, 5], dtype=np.float32)
    message = c.quantize(vector, bits=4, chunk_size=8)
    assert message.codes.dtype == np.uint8 and message.codes.size == 4
    assert np.array_equal(c.dequantize(message), vector)


def test_sign_sends_one_bit_a_value_scaled_by_the_chunks_mean_magnitude() -> None:
    vector = np.array([-4, 2, 0, -2, 1, 1, -1, 3, 5, -5], dtype=np.float32)
    message = c.quantize(vector, bits=1, chunk_size=8)
    assert message.codes.dtype == np.uint8 and message.codes.size == 2
    # Chunk means of |x|: 14 / 8 for the first chunk, 10 / 2 for the last (no padding).
    assert message.scales.tolist() == pytest.approx([1.75, 5.0])
    signs = np.where(vector >= 0, 1.0, -1.0)
    expected = np.concatenate([signs[:8] * 1.75, signs[8:] * 5.0])
    assert c.dequantize(message).tolist() == pytest.approx(expected.tolist())


def _expected_payload(message: c.Message) -> int:
    n = c.length(message)
    if isinstance(message, c.Dense):
        return 4 * n
    if isinstance(message, c.Quantized):
        chunks = max(1, math.ceil(n / message.chunk_size))
        codes = {8: n, 4: (n + 1) // 2, 1: (n + 7) // 8}[message.bits]
        return codes + 4 * chunks
    return 8 * message.indices.size


@pytest.mark.parametrize("method", ["none", "int8", "int4", "sign", "topk"])
@pytest.mark.parametrize("length", [1, 999, 10_000])
def test_byte_counts_are_exact_and_messages_round_trip(method: str, length: int) -> None:
    settings = c.Compression(method=method, chunk_size=128, topk_fraction=0.05)
    vector = _vector(length, seed=length)
    message, _ = c.compress(vector, settings, np.zeros_like(vector))
    assert c.payload_bytes(message) == _expected_payload(message)
    encoded = c.encode_message(message)
    # The container adds one small JSON header, independent of the length.
    assert 0 < len(encoded) - c.payload_bytes(message) <= 400
    decoded = c.decode_message(encoded)
    assert c.method_of(decoded) == method
    assert np.array_equal(c.decode(decoded), c.decode(message))


def test_int8_is_about_a_quarter_of_fp32_and_topk_fraction_sets_the_count() -> None:
    vector = _vector(65_536)
    int8, _ = c.compress(vector, c.Compression(method="int8", chunk_size=256))
    dense, _ = c.compress(vector, c.Compression(method="none"))
    assert c.payload_bytes(int8) / c.payload_bytes(dense) == pytest.approx(0.254, abs=1e-3)
    topk, _ = c.compress(vector, c.Compression(method="topk", topk_fraction=0.01), None)
    assert isinstance(topk, c.Sparse) and topk.indices.size == 656


def test_topk_sends_the_largest_magnitudes_in_index_order() -> None:
    delta = np.array([0.1, -5.0, 0.2, 3.0, -0.3, 4.0], dtype=np.float32)
    message, residual = c.topk_compress(delta, None, 3)
    assert message.indices.tolist() == [1, 3, 5]
    assert message.values.tolist() == [-5.0, 3.0, 4.0]
    assert residual.tolist() == pytest.approx([0.1, 0.0, 0.2, 0.0, -0.3, 0.0])


def test_error_feedback_accumulates_exactly_what_was_dropped() -> None:
    # Integer-valued float32 inputs keep every sum exact, so equality is bit for bit.
    rng = np.random.default_rng(1)
    residual = np.zeros(500, dtype=np.float32)
    sent_total = np.zeros(500, dtype=np.float32)
    input_total = np.zeros(500, dtype=np.float32)
    for _ in range(20):
        delta = rng.integers(-1000, 1000, 500).astype(np.float32)
        message, residual = c.topk_compress(delta, residual, 25)
        sent_total += c.densify(message)
        input_total += delta
        assert np.array_equal(sent_total + residual, input_total)


@pytest.mark.parametrize("method", ["int8", "int4", "sign", "topk"])
def test_error_feedback_loses_nothing_over_rounds(method: str) -> None:
    settings = c.Compression(method=method, chunk_size=64, topk_fraction=0.02)
    rng = np.random.default_rng(2)
    residual: np.ndarray | None = np.zeros(2000, dtype=np.float32)
    sent = np.zeros(2000, dtype=np.float64)
    inputs = np.zeros(2000, dtype=np.float64)
    for _ in range(30):
        delta = rng.standard_normal(2000).astype(np.float32)
        message, residual = c.compress(delta, settings, residual)
        sent += c.decode(message)
        inputs += delta
    assert residual is not None
    assert np.allclose(sent + residual, inputs, atol=1e-4)
    # Without feedback the same scheme drops what it does not send, for good.
    assert np.abs(residual).max() < np.abs(inputs).max()


def test_stateless_quantization_returns_no_residual() -> None:
    message, residual = c.compress(_vector(100), c.Compression(method="int8"))
    assert residual is None and isinstance(message, c.Quantized)


@pytest.mark.parametrize(
    ("method", "error_feedback", "stateful"),
    [("none", False, False), ("none", True, False), ("int8", False, False),
     ("int8", True, True), ("int4", True, True), ("topk", False, True)],
)  # fmt: skip
def test_which_settings_keep_a_residual(method: str, error_feedback: bool, stateful: bool) -> None:
    settings = c.Compression(method=method, error_feedback=error_feedback)  # type: ignore[arg-type]
    assert settings.stateful is stateful


def test_quantization_with_error_feedback_starts_its_residual_at_zero() -> None:
    settings = c.Compression(method="int4", error_feedback=True)
    delta = _vector(1000)
    message, residual = c.compress(delta, settings)  # a worker's first task: no residual yet
    assert residual is not None
    np.testing.assert_array_equal(c.decode(message) + residual, delta)


@pytest.mark.parametrize(
    ("meta", "arrays", "match"),
    [
        ({"method": "int8", "length": 4, "chunk_size": 8},
         {"scales": np.ones(1, np.float32), "codes": np.zeros(3, np.int8)}, "codes"),
        ({"method": "int8", "length": 4, "chunk_size": 8},
         {"scales": np.ones(1, np.float32), "codes": np.zeros(4, np.uint8)}, "int8"),
        ({"method": "int4", "length": 4, "chunk_size": 2},
         {"scales": np.ones(1, np.float32), "codes": np.zeros(2, np.uint8)}, "scales"),
        ({"method": "int8", "length": 1, "chunk_size": 8},
         {"scales": np.array([np.nan], np.float32), "codes": np.zeros(1, np.int8)}, "finite"),
        ({"method": "topk", "length": 4},
         {"indices": np.array([2, 1], np.uint32), "values": np.ones(2, np.float32)}, "increase"),
        ({"method": "topk", "length": 4},
         {"indices": np.array([1, 4], np.uint32), "values": np.ones(2, np.float32)}, "below"),
        ({"method": "topk", "length": 4},
         {"indices": np.array([1], np.uint32), "values": np.ones(2, np.float32)}, "indices"),
        ({"method": "zstd"}, {}, "unknown"),
        ({"method": "int8"}, {}, "malformed"),
    ],
)  # fmt: skip
def test_malformed_messages_are_refused(
    meta: dict[str, object], arrays: dict[str, np.ndarray], match: str
) -> None:
    with pytest.raises(ContainerError, match=match):
        c.from_arrays(meta, arrays, "")
