"""Calibrate onnx-infer's fuzzy compare: how far honest runs of one shard are apart, and
how far cheats are, through the kind's own worker code.

Honest variants: ONNX Runtime thread counts, graph optimisation levels, batch sizes, and
the execution providers this machine has (run it on a GPU machine to add those rows).
Cheats: a cheaper model (one layer fewer / half the channels), float16 (the output
rounded to it, or weights and inputs at its precision), noise, zeros, another shard's
answer. Prints one table row per variant and output: the largest row-relative
difference, the largest 1 - cosine, and the kind's verdict against the reference run.

    PYTHONPATH=src python benchmarks/calibrate_onnx.py            # CPU rows
    PYTHONPATH=src python benchmarks/calibrate_onnx.py --markdown # as docs/verification.md has it
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable

import numpy as np
from safetensors.numpy import save

from idlegrid.kinds.base import RunContext
from idlegrid.kinds.onnx.compare import distances
from idlegrid.kinds.onnx.examples import IMAGENET_PREPROCESS, conv_net, images, mlp, zip_images
from idlegrid.kinds.onnx.kind import OnnxInferKind, OnnxInferParams, parse_output
from idlegrid.kinds.onnx.runtime import available_providers, compute_providers
from idlegrid.training.flat import pack

KIND = OnnxInferKind()
ROWS = 64


def _case(name: str) -> tuple[bytes, bytes, dict[str, object], bytes]:
    """(model, data, params, the cheaper model) of a calibration case."""
    if name == "mlp":
        rows = np.random.default_rng(1).standard_normal((ROWS, 32)).astype(np.float32)
        return mlp(), save({"x": rows}), {}, mlp(layers=2)
    data = zip_images(images(ROWS, seed=1))
    return conv_net(), data, {"preprocess": IMAGENET_PREPROCESS}, conv_net(channels=4)


def _run(
    model: bytes, data: bytes, raw: dict[str, object], *, threads: int = 1, shard: int = 0
) -> bytes:
    inputs = {"model": model, "data": data}
    params = KIND.derive_params(inputs, KIND.parse_params({"shard_size": ROWS // 2, **raw}))
    assert isinstance(params, OnnxInferParams)
    payload = KIND.split(inputs, params)[shard].payload
    blobs = {hashlib.sha256(model).hexdigest(): model}
    return KIND.run(payload, params, RunContext(threads=threads, fetch=blobs.__getitem__))


def _honest_variants() -> list[tuple[str, dict[str, object], int]]:
    variants: list[tuple[str, dict[str, object], int]] = [
        ("threads=2", {}, 2),
        ("threads=4", {}, 4),
        ("optimization=disable", {"optimization": "disable"}, 1),
        ("optimization=basic", {"optimization": "basic"}, 1),
        ("batch_size=1", {"batch_size": 1}, 1),
        ("batch_size=7", {"batch_size": 7}, 1),
        ("batch_size=64, threads=2", {"batch_size": 64}, 2),
    ]
    for provider in compute_providers(available_providers()):
        if provider != "CPUExecutionProvider":
            variants.append((provider, {"providers": [provider]}, 1))
    return variants


def _tamper(output: bytes, change: Callable[[np.ndarray], np.ndarray]) -> bytes:
    arrays, header = parse_output(output)
    changed = {
        name: change(a).astype(a.dtype) if a.dtype.kind == "f" else a for name, a in arrays.items()
    }
    return pack(changed, header)


def _noise(scale: float) -> Callable[[np.ndarray], np.ndarray]:
    def add(a: np.ndarray) -> np.ndarray:
        rng = np.random.default_rng(7)
        return a + rng.standard_normal(a.shape) * scale * np.abs(a).max()

    return add


def _rows(case: str, variant: str, reference: bytes, other: bytes, params: dict[str, object]):  # type: ignore[no-untyped-def]
    first, _ = parse_output(reference)
    second, _ = parse_output(other)
    parsed = OnnxInferParams.model_validate(params)
    verdict = KIND.compare(reference, other, parsed).value
    for name in sorted(first):
        if first[name].dtype.kind != "f":
            same = np.array_equal(first[name], second[name])
            yield case, variant, name, "exact" if same else "differs", "", verdict
            continue
        relative, cosine_gap = distances(first[name], second[name])
        yield case, variant, name, f"{relative:.1e}", f"{cosine_gap:.1e}", verdict


def calibrate() -> list[tuple[str, ...]]:
    table = []
    for case in ("mlp", "conv_net"):
        model, data, raw, cheaper = _case(case)
        reference = _run(model, data, raw)
        params = {**raw}
        for variant, extra, threads in _honest_variants():
            other = _run(model, data, {**raw, **extra}, threads=threads)
            table += _rows(case, f"honest: {variant}", reference, other, params)
        cheats = {
            "cheat: fewer layers/channels": _run(cheaper, data, raw),
            "cheat: output rounded to float16": _tamper(
                reference, lambda a: a.astype(np.float16).astype(np.float32)
            ),
            "cheat: noise 1e-3 of max": _tamper(reference, _noise(1e-3)),
            "cheat: noise 1e-4 of max": _tamper(reference, _noise(1e-4)),
            "cheat: zeros": _tamper(reference, np.zeros_like),
            "cheat: another shard's answer": _run(model, data, raw, shard=1),
        }
        for variant, other in cheats.items():
            table += _rows(case, variant, reference, other, params)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = parser.parse_args()
    print(f"providers here: {compute_providers(available_providers())}")
    header = (
        "model",
        "variant vs threads=1, all, batch 32",
        "output",
        "max row-rel diff",
        "max 1-cos",
        "verdict",
    )
    rows = calibrate()
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in rows:
            print("| " + " | ".join(row) + " |")
        return
    for row in rows:
        print(f"{row[0]:9} {row[1]:42} {row[2]:10} {row[3]:>9} {row[4]:>9}  {row[5]}")


if __name__ == "__main__":
    main()
