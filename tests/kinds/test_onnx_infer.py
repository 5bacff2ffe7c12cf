"""The onnx-infer kind in one process: model checks, datasets, run, compare, assemble."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError
from safetensors.numpy import save

from idlegrid.kinds.base import InputError, RunContext, Verdict
from idlegrid.kinds.onnx.data import Preprocess
from idlegrid.kinds.onnx.examples import IMAGENET_PREPROCESS, conv_net, images, mlp, zip_images
from idlegrid.kinds.onnx.kind import OnnxInferKind, OnnxInferParams, parse_output
from idlegrid.kinds.onnx.model import inspect_model
from idlegrid.kinds.onnx.runtime import choose_providers
from idlegrid.kinds.onnx.shard import payload_header
from idlegrid.training.flat import pack, unpack

KIND = OnnxInferKind()
MLP = mlp()
CONV = conv_net()
ROWS = np.random.default_rng(3).standard_normal((50, 32)).astype(np.float32)


def _params(inputs: dict[str, bytes], **raw: object) -> OnnxInferParams:
    params = KIND.derive_params(inputs, KIND.parse_params(raw))
    assert isinstance(params, OnnxInferParams)
    return params


def _run_all(inputs: dict[str, bytes], params: OnnxInferParams, threads: int = 1) -> list[bytes]:
    blobs = {hashlib.sha256(inputs["model"]).hexdigest(): inputs["model"]}
    ctx = RunContext(threads=threads, fetch=blobs.__getitem__)
    return [KIND.run(s.payload, params, ctx) for s in KIND.split(inputs, params)]


def _assembled(inputs: dict[str, bytes], params: OnnxInferParams) -> tuple[dict, dict]:  # type: ignore[type-arg]
    shards = KIND.split(inputs, params)
    outputs = _run_all(inputs, params)
    for shard, output in zip(shards, outputs, strict=True):
        KIND.check_output(shard.payload, output, params)
    return unpack(KIND.assemble_with_inputs([s.payload for s in shards], outputs, params))


# -- arrays ----------------------------------------------------------------------------


def test_arrays_in_shards_come_back_in_input_order_as_onnx_runtime_computes_them() -> None:
    inputs = {"model": MLP, "data": save({"x": ROWS})}
    params = _params(inputs, shard_size=16, batch_size=5)
    assert [s.items for s in KIND.split(inputs, params)] == [16, 16, 16, 2]
    result, summary = _assembled(inputs, params)
    reference = ort.InferenceSession(MLP).run(["y"], {"x": ROWS})[0]
    np.testing.assert_allclose(result["y"], reference, rtol=1e-6, atol=1e-6)
    assert summary == {"rows": 50, "providers": {"CPUExecutionProvider": 4}}


def test_npy_dataset_feeds_a_single_input_model() -> None:
    buffer = io.BytesIO()
    np.save(buffer, ROWS[:10])
    inputs = {"model": MLP, "data": buffer.getvalue()}
    result, _ = _assembled(inputs, _params(inputs))
    assert result["y"].shape == (10, 16)


def test_output_records_the_provider_and_requirements_come_from_the_model() -> None:
    inputs = {"model": MLP, "data": save({"x": ROWS})}
    params = _params(inputs, batch_size=64)
    _, header = parse_output(_run_all(inputs, params)[0])
    assert header["provider"] == "CPUExecutionProvider"
    needs = KIND.requirements(params)
    assert needs.min_onnx_opset == 17
    assert "CPUExecutionProvider" in needs.onnx_providers
    facts = params.model_facts
    assert facts is not None and facts.initializer_bytes == (32 * 64 + 64 * 64 + 64 * 16 + 144) * 4
    assert needs.min_memory_mb == facts.memory_mb(64) >= 64
    only_cuda = _params(inputs, providers=["CUDAExecutionProvider"])
    assert KIND.requirements(only_cuda).onnx_providers == {"CUDAExecutionProvider"}


def test_model_facts_sent_by_a_researcher_are_replaced_from_the_model() -> None:
    inputs = {"model": MLP, "data": save({"x": ROWS})}
    facts = _params(inputs).model_facts
    assert facts is not None
    lying = facts.model_copy(update={"initializer_bytes": 1})
    params = _params(inputs, model_facts=lying.model_dump())
    assert params.model_facts == facts


def test_selected_outputs_only() -> None:
    data = zip_images(images(6))
    inputs = {"model": CONV, "data": data}
    params = _params(inputs, outputs=["label"], preprocess=IMAGENET_PREPROCESS)
    result, _ = _assembled(inputs, params)
    assert list(result) == ["label"] and result["label"].dtype == np.int64


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (save({"z": ROWS}), r"dataset arrays \['z'\] do not match the model inputs \['x'\]"),
        (save({"x": ROWS.astype(np.float64)}), "input 'x' is float64, the model takes float32"),
        (save({"x": ROWS[:, :31]}), r"the model wants \(rows, 32\)"),
        (save({"x": ROWS[:0]}), "no rows"),
        (b"not a dataset at all", "not .npy, safetensors, or a zip/tar"),
    ],
)
def test_a_dataset_that_does_not_fit_the_model_is_refused(data: bytes, message: str) -> None:
    inputs = {"model": MLP, "data": data}
    with pytest.raises(InputError, match=message):
        KIND.split(inputs, _params(inputs))


def test_unknown_outputs_and_providers_are_refused() -> None:
    inputs = {"model": MLP, "data": save({"x": ROWS})}
    with pytest.raises(InputError, match="no output 'logits'"):
        KIND.split(inputs, _params(inputs, outputs=["logits"]))
    with pytest.raises(InputError, match="unknown execution providers"):
        KIND.split(inputs, _params(inputs, providers=["TurboExecutionProvider"]))


# -- model safety ----------------------------------------------------------------------


def _graph_model(node: onnx.NodeProto, *, domain: str = "", initializer=()) -> bytes:  # type: ignore[no-untyped-def]
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
        initializer=list(initializer),
    )
    opsets = [helper.make_opsetid("", 17)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    return bytes(model.SerializeToString())


def test_custom_operators_are_refused() -> None:
    custom = _graph_model(
        helper.make_node("Evil", ["x"], ["y"], domain="com.evil"), domain="com.evil"
    )
    with pytest.raises(InputError, match="custom operator domain 'com.evil'"):
        inspect_model(custom)


def test_external_data_is_refused() -> None:
    weight = numpy_helper.from_array(np.ones((4,), np.float32), "w")
    weight.ClearField("raw_data")
    weight.data_location = TensorProto.EXTERNAL
    weight.external_data.add(key="location", value="/etc/passwd")
    model = _graph_model(helper.make_node("Add", ["x", "w"], ["y"]), initializer=[weight])
    with pytest.raises(InputError, match="tensor 'w' refers to external data"):
        inspect_model(model)


def test_non_onnx_and_invalid_models_are_refused() -> None:
    with pytest.raises(InputError, match="not an ONNX file"):
        inspect_model(b"\x00\x01 this is no protobuf \xff\xff\xff")
    with pytest.raises(InputError, match="not an ONNX file"):
        inspect_model(b"")
    broken = _graph_model(helper.make_node("Relu", ["x"], ["nowhere"]))
    with pytest.raises(InputError, match="onnx.checker"):
        inspect_model(broken)


def test_a_fixed_batch_dimension_other_than_one_is_refused() -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InputError, match="batch dimension must be free"):
        inspect_model(model.SerializeToString())


# -- images ----------------------------------------------------------------------------


def test_images_run_with_the_declared_preprocessing() -> None:
    blobs = images(10, seed=5) + images(2, seed=6, kind="JPEG")
    inputs = {"model": CONV, "data": zip_images(blobs)}
    params = _params(inputs, shard_size=4, preprocess=IMAGENET_PREPROCESS)
    result, summary = _assembled(inputs, params)
    assert result["logits"].shape == (12, 10) and result["embedding"].shape == (12, 32)
    assert summary["names"][-1] == "000011.jpg"
    from idlegrid.kinds.onnx import data as onnx_data

    spec = Preprocess.model_validate(IMAGENET_PREPROCESS)
    batch = onnx_data.decode_batch(onnx_data.load_images(inputs["data"]), spec, "float32")
    assert batch.shape == (12, 3, 32, 32)
    reference = ort.InferenceSession(CONV).run(None, {"image": batch})
    np.testing.assert_allclose(result["logits"], reference[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(result["label"], reference[2])


def test_a_tar_of_images_works_like_a_zip() -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as archive:
        for index, blob in enumerate(images(3)):
            info = tarfile.TarInfo(f"pics/{index}.png")
            info.size = len(blob)
            archive.addfile(info, io.BytesIO(blob))
    inputs = {"model": CONV, "data": buffer.getvalue()}
    _, summary = _assembled(inputs, _params(inputs, preprocess=IMAGENET_PREPROCESS))
    assert summary["names"] == ["pics/0.png", "pics/1.png", "pics/2.png"]


def test_an_undecodable_image_is_named() -> None:
    blobs = images(3)
    blobs[1] = blobs[1][:40]  # a truncated PNG
    inputs = {"model": CONV, "data": zip_images(blobs, names=["a.png", "b.png", "c.png"])}
    with pytest.raises(InputError, match="image 'b.png' cannot be decoded"):
        KIND.split(inputs, _params(inputs, preprocess=IMAGENET_PREPROCESS))
    other = {"model": CONV, "data": zip_images([blobs[0], b"text"], names=["a.png", "notes.txt"])}
    with pytest.raises(InputError, match="'notes.txt' is not a .jpg, .jpeg or .png"):
        KIND.split(other, _params(other, preprocess=IMAGENET_PREPROCESS))


def test_a_missing_or_wrong_preprocessing_is_refused() -> None:
    inputs = {"model": CONV, "data": zip_images(images(2))}
    with pytest.raises(InputError, match="needs params.preprocess"):
        KIND.split(inputs, _params(inputs))
    wrong_size = {**IMAGENET_PREPROCESS, "crop": (28, 28), "resize": 28}
    with pytest.raises(InputError, match=r"crop \(28, 28\).*the model wants \(rows, 3, 32, 32\)"):
        KIND.split(inputs, _params(inputs, preprocess=wrong_size))
    with pytest.raises(InputError, match="NHWC"):
        KIND.split(inputs, _params(inputs, preprocess={**IMAGENET_PREPROCESS, "layout": "NHWC"}))
    with pytest.raises(ValidationError, match="std values must be positive"):
        KIND.parse_params({"preprocess": {**IMAGENET_PREPROCESS, "std": (0, 1, 1)}})
    with pytest.raises(ValidationError, match="mean needs 1 or 3 values"):
        KIND.parse_params({"preprocess": {**IMAGENET_PREPROCESS, "mean": (0.5, 0.5)}})
    arrays = {"model": MLP, "data": save({"x": ROWS})}
    with pytest.raises(InputError, match="image datasets"):
        KIND.split(arrays, _params(arrays, preprocess=IMAGENET_PREPROCESS))


# -- outputs: check and compare ------------------------------------------------------------


def _honest() -> tuple[bytes, bytes, OnnxInferParams]:
    inputs = {"model": MLP, "data": save({"x": ROWS})}
    params = _params(inputs, shard_size=25)
    payload = KIND.split(inputs, params)[0].payload
    return payload, _run_all(inputs, params)[0], params


def _retouched(output: bytes, **arrays: np.ndarray) -> bytes:
    parsed, header = parse_output(output)
    return pack({**parsed, **arrays}, header)


def test_check_output_refuses_wrong_rows_dtypes_names_and_providers() -> None:
    payload, output, params = _honest()
    y = parse_output(output)[0]["y"]
    KIND.check_output(payload, output, params)
    with pytest.raises(InputError, match="shape"):
        KIND.check_output(payload, _retouched(output, y=y[:-1]), params)
    with pytest.raises(InputError, match="is float16, the model makes float32"):
        KIND.check_output(payload, _retouched(output, y=y.astype(np.float16)), params)
    with pytest.raises(InputError, match="expected"):
        KIND.check_output(payload, _retouched(output, z=y), params)
    with pytest.raises(InputError, match="execution provider"):
        KIND.check_output(payload, pack({"y": y}, {"provider": "Mine"}), params)


def test_compare_agrees_with_an_honest_rerun_and_refuses_cheats() -> None:
    payload, output, params = _honest()
    y = parse_output(output)[0]["y"]
    inputs = {"model": MLP, "data": save({"x": ROWS})}
    rerun = _run_all(inputs, params.model_copy(update={"optimization": "disable"}), threads=2)[0]
    assert KIND.compare(output, rerun, params) is Verdict.AGREE
    noise = np.random.default_rng(0).standard_normal(y.shape).astype(np.float32)
    cheaper = {"model": mlp(layers=2), "data": inputs["data"]}
    cheats = {
        "fewer layers": _run_all(cheaper, _params(cheaper, shard_size=25))[0],
        "float16": _retouched(output, y=y.astype(np.float16).astype(np.float32)),
        "noise": _retouched(output, y=y + 1e-3 * np.abs(y).max() * noise),
        "zeros": _retouched(output, y=np.zeros_like(y)),
        "replayed": _run_all(inputs, params)[1],
        "garbage": b"not safetensors",
    }
    for name, cheat in cheats.items():
        assert KIND.compare(output, cheat, params) is Verdict.DISAGREE, name


def test_compare_takes_per_output_tolerances() -> None:
    _, output, params = _honest()
    y = parse_output(output)[0]["y"]
    nudged = _retouched(output, y=y * np.float32(1 + 3e-4))
    assert KIND.compare(output, nudged, params) is Verdict.DISAGREE
    raw = {**params.model_dump(), "tolerances": {"y": {"rtol": 1e-3, "cosine": None}}}
    loose = OnnxInferParams.model_validate(raw)
    assert KIND.compare(output, nudged, loose) is Verdict.AGREE


def test_provider_choice_prefers_gpus_and_keeps_cpu_as_fallback() -> None:
    have = ["AzureExecutionProvider", "CPUExecutionProvider", "CUDAExecutionProvider"]
    assert choose_providers(have) == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert choose_providers(have, ["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
    assert choose_providers(["CPUExecutionProvider"], ["CUDAExecutionProvider"]) == []
    assert choose_providers(["CoreMLExecutionProvider", "CPUExecutionProvider"])[0] == (
        "CoreMLExecutionProvider"
    )


def test_the_hardware_probe_reports_providers_and_the_newest_loadable_opset() -> None:
    from idlegrid.worker import hardware

    assert "CPUExecutionProvider" in hardware.onnx_providers()
    newest = hardware.onnx_opset()
    assert newest is not None and 17 <= newest <= 64
    assert hardware._loads_opset(ort, newest) and not hardware._loads_opset(ort, newest + 1)


def test_a_saturated_output_is_no_16_bit_cheat() -> None:
    from idlegrid.kinds.onnx.compare import Tolerance, arrays_agree

    one_hot = np.zeros((32, 10), np.float32)
    one_hot[:, 3] = 1.0
    nearly = one_hot.copy()
    nearly[:, 3] = np.float32(0.99999994)  # another backend's last bit
    assert arrays_agree(one_hot, nearly, Tolerance())
    rng = np.random.default_rng(0)
    honest = rng.standard_normal((32, 10)).astype(np.float32)
    assert not arrays_agree(honest, honest.astype(np.float16).astype(np.float32), Tolerance())


def test_a_checked_model_is_not_parsed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Facts are kept by the model's hash: the same bytes are not checked twice, other
    bytes are, and a model that failed fails again with its reason."""
    from idlegrid.kinds.onnx import model as onnx_model

    model = mlp(features=8, hidden=16, outputs=4, layers=2, seed=11)
    other = mlp(features=8, hidden=16, outputs=4, layers=2, seed=12)
    monkeypatch.setattr(onnx_model, "_checked", onnx_model._FactsCache())
    parsed = []
    real = onnx_model._inspect
    monkeypatch.setattr(onnx_model, "_inspect", lambda data: parsed.append(data) or real(data))
    first = inspect_model(model)
    assert inspect_model(model) == first
    inspect_model(other)
    assert parsed == [model, other]
    for _ in range(2):
        with pytest.raises(InputError, match="not an ONNX file"):
            inspect_model(b"\x00\x01 no protobuf \xff")
    assert len(parsed) == 4


def test_a_submission_of_a_checked_model_neither_reads_nor_hashes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The coordinator's second job with one model: its facts are found by the model's
    name in the store; the shards name it without reading its bytes."""
    from idlegrid.blobs.files import BlobStore, StoredInputs
    from idlegrid.kinds.onnx import model as onnx_model

    monkeypatch.setattr(onnx_model, "_checked", onnx_model._FactsCache())
    kind = OnnxInferKind()
    model = mlp(features=8, hidden=16, outputs=4, layers=2, seed=13)
    rows = np.random.default_rng(0).standard_normal((10, 8), np.float32)
    store = BlobStore(tmp_path, max_bytes=2**30)
    names = {"model": store.put(model), "data": store.put(save({"x": rows}))}
    params = kind.parse_params({"shard_size": 4})
    first = kind.derive_params(StoredInputs(store, names), params)
    store.path(names["model"]).unlink()  # the second job must not need the bytes
    inputs = StoredInputs(store, names)
    second = kind.derive_params(inputs, params)
    assert second == first
    specs = kind.split(inputs, second)
    assert [s.items for s in specs] == [4, 4, 2]
    assert {payload_header(s.payload)["model"] for s in specs} == {names["model"]}
