"""Form fields that need more than a type to become a kind's settings (a form whose
fields fail their types is answered by `forms`)."""

from __future__ import annotations

from typing import Any


def preprocess(
    crop: str, resize: str, color: str, layout: str, scale: str, mean: str, std: str
) -> dict[str, Any]:
    """The form's preprocessing fields as `onnx_data.Preprocess` takes them; the kind
    checks the values themselves (and says what is wrong) at submission."""
    size = [part for part in crop.lower().replace("x", " ").replace(",", " ").split() if part]
    if len(size) == 1:
        size *= 2
    if len(size) != 2 or not all(part.isdigit() for part in size):
        raise ValueError(f"crop {crop!r} is not a size such as 224x224 (height x width)")
    spec: dict[str, Any] = {
        "crop": [int(size[0]), int(size[1])],
        "color": color,
        "layout": layout,
        "scale": 1 / 255 if scale == "1/255" else 1.0,
    }
    if resize.strip():
        if not resize.strip().isdigit():
            raise ValueError(f"resize {resize!r} is not a whole number of pixels")
        spec["resize"] = int(resize)
    for name, text in (("mean", mean), ("std", std)):
        if text.strip():
            try:
                spec[name] = [float(v) for v in text.replace(",", " ").split()]
            except ValueError:
                raise ValueError(f"{name} {text!r} is not a list of numbers") from None
    return spec


def stop_strings(text: str) -> list[str]:
    """Stop strings from a form field: one per line (blank lines dropped); "\\n" in a line
    stands for a newline."""
    return [line.replace("\\n", "\n") for line in text.splitlines() if line.strip()]
