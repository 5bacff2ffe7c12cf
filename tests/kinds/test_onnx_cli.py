"""The command line's onnx-infer inputs: files in the kind's order, a folder of images."""

from __future__ import annotations

import zipfile
from io import BytesIO
from pathlib import Path

import click
import pytest

from idlegrid.cli.researcher import _input_bytes, _input_files
from idlegrid.kinds.onnx.data import load_images
from idlegrid.kinds.onnx.examples import images

NAMES = ("model", "data")


def test_paths_map_to_the_kinds_inputs_in_order_or_by_name() -> None:
    assert _input_files(("m.onnx", "d.npy"), NAMES) == {
        "model": Path("m.onnx"),
        "data": Path("d.npy"),
    }
    assert _input_files(("data=d.npy", "model=m.onnx"), NAMES)["model"] == Path("m.onnx")
    with pytest.raises(click.BadParameter, match="in that order"):
        _input_files(("m.onnx", "data=d.npy"), NAMES)
    with pytest.raises(click.BadParameter):
        _input_files(("a", "b", "c"), NAMES)


def test_a_folder_is_its_images_zipped_in_name_order(tmp_path: Path) -> None:
    for name, blob in zip(("b.png", "a.PNG", "c.png"), images(3), strict=True):
        (tmp_path / name).write_bytes(blob)
    (tmp_path / "notes.txt").write_text("not an image")
    data = _input_bytes(tmp_path)
    assert zipfile.ZipFile(BytesIO(data)).namelist() == [
        "000000_a.PNG",
        "000001_b.png",
        "000002_c.png",
    ]
    assert len(load_images(data).blobs) == 3
    (tmp_path / "empty").mkdir()
    with pytest.raises(click.BadParameter, match="holds no"):
        _input_bytes(tmp_path / "empty")


def test_the_command_line_runs_a_model_over_arrays_and_over_a_folder_of_images(
    tmp_path: Path,
) -> None:
    """`idlegrid submit onnx-infer` end to end: a coordinator and an ONNX worker process."""
    import json
    import os
    import subprocess
    import sys

    import numpy as np

    ort = pytest.importorskip("onnxruntime")
    from safetensors.numpy import load_file, save_file

    from idlegrid.devtools.localgrid import LocalGrid
    from idlegrid.kinds.onnx import data as onnx_data
    from idlegrid.kinds.onnx.examples import IMAGENET_PREPROCESS, conv_net, mlp

    model, conv = tmp_path / "model.onnx", tmp_path / "conv.onnx"
    model.write_bytes(mlp(features=8, hidden=16, outputs=4, layers=2))
    conv.write_bytes(conv_net())
    rows = np.random.default_rng(1).standard_normal((50, 8)).astype(np.float32)
    save_file({"x": rows}, str(tmp_path / "data.safetensors"))
    folder = tmp_path / "photos"
    folder.mkdir()
    for index, blob in enumerate(images(7, size=40)):
        (folder / f"p{index}.png").write_bytes(blob)
    with LocalGrid(tmp_path / "grid", replication=1) as grid:
        grid.start_worker("onnx", kinds="onnx-infer", benchmark=False, threads=1)
        grid.wait_for_nodes(1)
        env = {**os.environ, "IDLEGRID_SERVER": grid.url, "IDLEGRID_TOKEN": grid.admin_token}

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "idlegrid", *args],
                capture_output=True, text=True, env=env, timeout=300,
            )  # fmt: skip

        arrays = cli(
            "submit", "onnx-infer", str(model), str(tmp_path / "data.safetensors"),
            "--replication", "1", "-p", "shard_size=16", "-o", str(tmp_path / "out.safetensors"),
        )  # fmt: skip
        assert arrays.returncode == 0, arrays.stderr
        session = ort.InferenceSession(model.read_bytes(), providers=["CPUExecutionProvider"])
        (expected,) = session.run(["y"], {"x": rows})
        got = load_file(str(tmp_path / "out.safetensors"))["y"]
        assert np.allclose(got, expected, rtol=1e-5, atol=1e-6)

        pictures = cli(
            "submit", "onnx-infer", str(conv), str(folder), "--replication", "1",
            "-p", f"preprocess={json.dumps(IMAGENET_PREPROCESS)}",
            "-o", str(tmp_path / "photos.safetensors"),
        )  # fmt: skip
        assert pictures.returncode == 0, pictures.stderr
        spec = onnx_data.Preprocess.model_validate(IMAGENET_PREPROCESS)
        batch = onnx_data.decode_batch(
            onnx_data.load_images(onnx_data.zip_files(sorted(folder.iterdir()))), spec, "float32"
        )
        session = ort.InferenceSession(conv.read_bytes(), providers=["CPUExecutionProvider"])
        (logits,) = session.run(["logits"], {"image": batch})
        result = load_file(str(tmp_path / "photos.safetensors"))
        assert result["logits"].shape == (7, 10)
        assert np.allclose(result["logits"], logits, rtol=1e-4, atol=1e-5)

        (folder / "broken.png").write_bytes(b"not a picture")
        broken = cli(
            "submit", "onnx-infer", str(conv), str(folder), "--replication", "1",
            "-p", f"preprocess={json.dumps(IMAGENET_PREPROCESS)}",
        )  # fmt: skip
        assert broken.returncode != 0 and "Traceback" not in broken.stderr
        assert "broken.png" in broken.stderr and "cannot be decoded" in broken.stderr
