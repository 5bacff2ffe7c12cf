"""The datasets of onnx-infer: named arrays, or images and how to turn them into arrays.

A dataset blob is one of:
- a `.npy` array (for a model with one input),
- a safetensors file of named arrays (one per model input, rows along the first axis),
- a zip or tar of JPEG/PNG files (rows in member-name order), with a `Preprocess` spec
  that says how the worker turns each image into the model's input tensor.

Nothing here runs a model. Images are decoded with Pillow, on the coordinator at
submission (so a broken file is named before any volunteer sees it) and on the worker.
"""

from __future__ import annotations

import io
import tarfile
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from idlegrid.kinds.base import InputError

NPY_MAGIC = b"\x93NUMPY"
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
MAX_IMAGES = 1_000_000
MAX_IMAGE_BYTES = 64 * 2**20
# Decoded size cap, far below Pillow's decompression-bomb threshold.
MAX_IMAGE_PIXELS = 40_000_000
MAX_ARCHIVE_BYTES = 4 * 2**30  # what the members of one archive may unpack to


class Preprocess(BaseModel):
    """How an image becomes a model input: resize, center crop, scale, normalise, layout.

    The image is converted to `color`, its shorter side resized to `resize` (bilinear),
    center-cropped to `crop` (height, width), scaled by `scale` (1/255: pixels in 0..1),
    then normalised per channel: (x - mean) / std. `layout` is the tensor's axis order.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    crop: tuple[int, int] = Field(description="(height, width) of the model input")
    resize: int | None = Field(
        default=None, ge=1, le=8192, description="shorter side before the crop; None: no resize"
    )
    color: Literal["RGB", "L"] = "RGB"
    layout: Literal["NCHW", "NHWC"] = "NCHW"
    scale: float = Field(default=1 / 255, gt=0.0)
    mean: tuple[float, ...] = (0.0, 0.0, 0.0)
    std: tuple[float, ...] = (1.0, 1.0, 1.0)

    @model_validator(mode="after")
    def _consistent(self) -> Preprocess:
        height, width = self.crop
        if not (1 <= height <= 8192 and 1 <= width <= 8192):
            raise ValueError("crop must be (height, width), each 1..8192")
        channels = self.channels
        for field_name, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                raise ValueError(f"{field_name} needs 1 or {channels} values for {self.color}")
        if any(value <= 0 for value in self.std):
            raise ValueError("std values must be positive")
        if self.resize is not None and self.resize < min(height, width):
            raise ValueError(f"resize {self.resize} is smaller than the crop {self.crop}")
        return self

    @property
    def channels(self) -> int:
        return 3 if self.color == "RGB" else 1

    def row_shape(self) -> tuple[int, int, int]:
        height, width = self.crop
        if self.layout == "NCHW":
            return (self.channels, height, width)
        return (height, width, self.channels)


@dataclass(frozen=True)
class Images:
    """Encoded image files in row order: their names and bytes."""

    names: list[str]
    blobs: list[bytes]


def kind_of(data: bytes) -> Literal["npy", "safetensors", "zip", "tar"]:
    """Which of the dataset formats these bytes are, by their magic numbers."""
    if data.startswith(NPY_MAGIC):
        return "npy"
    if data.startswith(b"PK\x03\x04") or data.startswith(b"PK\x05\x06"):
        return "zip"
    if len(data) >= 262 and data[257:262] == b"ustar":
        return "tar"
    if len(data) >= 10 and data[8:9] == b"{":
        return "safetensors"
    raise InputError("dataset is not .npy, safetensors, or a zip/tar of images")


def load_arrays(data: bytes, single_input: str | None) -> dict[str, np.ndarray]:
    """Named arrays of a .npy (named `single_input`) or safetensors dataset."""
    if kind_of(data) == "npy":
        if single_input is None:
            raise InputError("a .npy dataset feeds a model of one input; use safetensors")
        try:
            array = np.load(io.BytesIO(data), allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InputError(f"dataset is not a readable .npy array: {exc}") from None
        return {single_input: array}
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        return dict(load(data))
    except (SafetensorError, ValueError, TypeError) as exc:
        raise InputError(f"dataset is not a readable safetensors file: {exc}") from None


def load_images(data: bytes) -> Images:
    """The JPEG/PNG members of a zip or tar, sorted by name; InputError naming a bad one."""
    members = _zip_members(data) if kind_of(data) == "zip" else _tar_members(data)
    members.sort(key=lambda member: member[0])
    if not members:
        raise InputError("the archive holds no .jpg, .jpeg or .png file")
    if len(members) > MAX_IMAGES:
        raise InputError(f"the archive holds {len(members)} images, over {MAX_IMAGES}")
    return Images(names=[m[0] for m in members], blobs=[m[1] for m in members])


def _wanted(name: str) -> bool:
    base = name.rsplit("/", 1)[-1]
    if name.startswith("__MACOSX/") or base.startswith("._") or not base:
        return False  # macOS resource forks and folders
    if not base.lower().endswith(IMAGE_SUFFIXES):
        raise InputError(f"archive member {name!r} is not a .jpg, .jpeg or .png file")
    return True


def _zip_members(data: bytes) -> list[tuple[str, bytes]]:
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = [
            info for info in archive.infolist() if not info.is_dir() and _wanted(info.filename)
        ]
        _check_sizes([(info.filename, info.file_size) for info in infos])
        return [(info.filename, archive.read(info)) for info in infos]
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise InputError(f"dataset is not a readable zip file: {exc}") from None


def _tar_members(data: bytes) -> list[tuple[str, bytes]]:
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            infos = [info for info in archive.getmembers() if info.isfile() and _wanted(info.name)]
            _check_sizes([(info.name, info.size) for info in infos])
            members = []
            for info in infos:
                extracted = archive.extractfile(info)
                assert extracted is not None  # a regular file always has contents
                members.append((info.name, extracted.read()))
            return members
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise InputError(f"dataset is not a readable tar file: {exc}") from None


def _check_sizes(sizes: Sequence[tuple[str, int]]) -> None:
    for name, size in sizes:
        if size > MAX_IMAGE_BYTES:
            raise InputError(f"image {name!r} is {size} bytes, over {MAX_IMAGE_BYTES}")
    if sum(size for _, size in sizes) > MAX_ARCHIVE_BYTES:
        raise InputError(f"the archive unpacks to over {MAX_ARCHIVE_BYTES} bytes")


def decode(name: str, blob: bytes, spec: Preprocess, dtype: str) -> np.ndarray:
    """One image as a model input row (`spec.row_shape()`, `dtype`); InputError names it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(blob)) as image:
            if image.format not in ("JPEG", "PNG"):
                raise InputError(f"image {name!r} is {image.format}, not JPEG or PNG")
            if image.width * image.height > MAX_IMAGE_PIXELS:
                raise InputError(f"image {name!r} has over {MAX_IMAGE_PIXELS} pixels")
            image.load()
            converted = image.convert(spec.color)
    except UnidentifiedImageError:
        raise InputError(f"image {name!r} cannot be decoded: not a JPEG or PNG image") from None
    except (OSError, SyntaxError, ValueError) as exc:
        if isinstance(exc, InputError):
            raise
        raise InputError(f"image {name!r} cannot be decoded: {exc}") from None
    pixels = np.asarray(_resize_and_crop(converted, spec), dtype=np.float32)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    mean = np.asarray(spec.mean, dtype=np.float32)
    std = np.asarray(spec.std, dtype=np.float32)
    row = (pixels * np.float32(spec.scale) - mean) / std
    if spec.layout == "NCHW":
        row = row.transpose(2, 0, 1)
    return np.ascontiguousarray(row, dtype=dtype)


def _resize_and_crop(image, spec: Preprocess):  # type: ignore[no-untyped-def]
    from PIL import Image

    height, width = spec.crop
    if spec.resize is not None:
        ratio = spec.resize / min(image.width, image.height)
        size = (max(width, round(image.width * ratio)), max(height, round(image.height * ratio)))
        image = image.resize(size, Image.Resampling.BILINEAR)
    if image.width < width or image.height < height:
        raise InputError(
            f"image of {image.width}x{image.height} is smaller than the crop {width}x{height}; "
            "set preprocess.resize"
        )
    left, top = (image.width - width) // 2, (image.height - height) // 2
    return image.crop((left, top, left + width, top + height))


def decode_batch(images: Images, spec: Preprocess, dtype: str) -> np.ndarray:
    """Rows of `decode` stacked: (len(images), *spec.row_shape())."""
    rows = [decode(n, b, spec, dtype) for n, b in zip(images.names, images.blobs, strict=True)]
    return np.stack(rows) if rows else np.zeros((0, *spec.row_shape()), dtype=dtype)


def zip_files(paths: Sequence[Path], on_file: Callable[[], object] | None = None) -> bytes:
    """A zip of image files named so that name order is the order given (for a dataset);
    `on_file` is called after each file (a progress bar)."""
    buffer = io.BytesIO()
    width = max(6, len(str(len(paths))))
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for index, path in enumerate(paths):
            if not path.name.lower().endswith(IMAGE_SUFFIXES):
                raise ValueError(f"{path} is not a .jpg, .jpeg or .png file")
            archive.writestr(f"{index:0{width}d}_{path.name}", path.read_bytes())
            if on_file is not None:
                on_file()
    return buffer.getvalue()


def pack_images(blobs: Sequence[bytes]) -> dict[str, np.ndarray]:
    """Encoded images as two arrays (bytes end to end, and offsets) for a shard payload."""
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(blob) for blob in blobs])
    joined = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    return {"image_bytes": joined, "image_offsets": offsets}


def unpack_images(arrays: dict[str, np.ndarray]) -> list[bytes]:
    """The encoded images of `pack_images` arrays."""
    joined, offsets = arrays.get("image_bytes"), arrays.get("image_offsets")
    if joined is None or offsets is None or offsets.ndim != 1 or joined.dtype != np.uint8:
        raise InputError("image shard payload needs image_bytes and image_offsets")
    raw = joined.tobytes()
    bounds = [int(o) for o in offsets]
    pairs = list(zip(bounds, bounds[1:], strict=False))
    if bounds[0] != 0 or bounds[-1] != len(raw) or any(end < start for start, end in pairs):
        raise InputError("image shard offsets do not cover its bytes")
    return [raw[start:end] for start, end in pairs]
