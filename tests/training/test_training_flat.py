"""Flat weight vectors, their digests, and the safetensors container."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from idlegrid.training import flat


def _named() -> dict[str, np.ndarray]:
    return {
        "layer.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "layer.bias": np.array([7, 8], dtype=np.float32),
        "scalar": np.array(9, dtype=np.float32),
    }


def test_flatten_and_unflatten_round_trip_in_order() -> None:
    vector, spec = flat.flatten(_named())
    assert vector.dtype == np.float32 and vector.tolist() == [0, 1, 2, 3, 4, 5, 7, 8, 9]
    assert spec.size == 9 and spec.names == ("layer.weight", "layer.bias", "scalar")
    back = flat.unflatten(vector, spec)
    for name, array in _named().items():
        assert np.array_equal(back[name], array) and back[name].shape == array.shape
    assert flat.FlatSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError):
        flat.unflatten(vector[:-1], spec)


@pytest.mark.parametrize("raw", [{"a": 1}, [["a"]], [["a", ["x"]]], [["a", [-1]]]])
def test_bad_specs_are_refused(raw: object) -> None:
    with pytest.raises(flat.ContainerError):
        flat.FlatSpec.from_json(raw)


def test_digest_is_of_float32_bytes() -> None:
    vector = np.array([1.0, 2.0], dtype=np.float32)
    assert flat.digest(vector) == flat.digest(vector.astype(np.float64))
    assert flat.digest(vector) != flat.digest(np.array([1.0, 2.0000002], dtype=np.float32))


def test_pack_and_unpack_keep_arrays_dtypes_and_header() -> None:
    arrays = {"a": np.arange(5, dtype=np.int8), "b": np.ones(3, np.float32),
              "c": np.array([1, 2], np.uint32), "empty": np.zeros(0, np.uint8)}  # fmt: skip
    blob = flat.pack(arrays, {"round": 3, "name": "x"})
    back, header = flat.unpack(blob)
    assert header == {"round": 3, "name": "x"}
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and np.array_equal(back[name], array)


def test_weights_safetensors_are_named_tensors_that_safetensors_reads() -> None:
    from safetensors.numpy import load

    vector, spec = flat.flatten(_named())
    blob = flat.weights_to_safetensors(vector, spec, {"round": 1})
    assert set(load(blob)) == set(spec.names)
    assert np.array_equal(flat.weights_from_safetensors(blob, spec), vector)
    assert flat.read_metadata(blob) == {"idlegrid": '{"round":1}'}


def test_weights_that_do_not_fit_the_spec_are_refused() -> None:
    vector, spec = flat.flatten(_named())
    other = flat.FlatSpec((("layer.weight", (3, 2)), ("layer.bias", (2,)), ("scalar", ())))
    with pytest.raises(flat.ContainerError, match="shape"):
        flat.weights_from_safetensors(flat.weights_to_safetensors(vector, spec), other)
    fewer = flat.FlatSpec(spec.entries[:2])
    with pytest.raises(flat.ContainerError, match="unexpected"):
        flat.weights_from_safetensors(flat.weights_to_safetensors(vector, spec), fewer)
    nan = vector.copy()
    nan[0] = np.nan
    with pytest.raises(flat.ContainerError, match="NaN"):
        flat.weights_from_safetensors(flat.weights_to_safetensors(nan, spec), spec)


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"1234567",
        struct.pack("<Q", 10**9) + b"{}",
        struct.pack("<Q", 5) + b"nope!",
        struct.pack("<Q", 28) + b'{"__metadata__":{"a":1}}    ',
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 50) + b'{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}',
    ],
)
def test_garbage_is_a_container_error(blob: bytes) -> None:
    with pytest.raises(flat.ContainerError):
        flat.unpack(blob)


def test_a_non_json_idlegrid_header_is_refused() -> None:
    from safetensors.numpy import save

    blob = save({"a": np.zeros(1, np.float32)}, metadata={"idlegrid": "{nope"})
    with pytest.raises(flat.ContainerError, match="JSON"):
        flat.unpack(blob)
