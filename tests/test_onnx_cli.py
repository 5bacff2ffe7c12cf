"""The command line's onnx-infer inputs: files in the kind's order, a folder of images."""

from __future__ import annotations

import zipfile
from io import BytesIO
from pathlib import Path

import click
import pytest

from idlegrid.cli_researcher import _input_bytes, _input_files
from idlegrid.kinds.onnx_data import load_images
from idlegrid.kinds.onnx_examples import images

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
