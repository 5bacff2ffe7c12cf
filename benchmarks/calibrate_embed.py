"""Calibrate embed-text's `compare`: how far apart are honest results, and cheats?

Embeds the same texts many honest ways (thread counts, batch sizes, batch order, float64
arithmetic, and with `--device` that device's float32 kernels) and many dishonest or
broken ways (absolute and relative noise, low-precision rounding of the output,
float16 and bfloat16 arithmetic, a perturbed model, a truncated model), and prints, for
each, the lowest per-row cosine against the reference run (CPU, float32, 2 threads) and
whether the kind's `compare` agrees. The last lines give the largest honest distance,
the smallest dishonest one, and where the threshold sits between them: COSINE_AGREE
must stay above every honest row and below every cheat (on a log scale, about midway).

    .venv/bin/python benchmarks/calibrate_embed.py --texts 256
    .venv/bin/python benchmarks/calibrate_embed.py --texts 256 --device cuda   # a GPU row
    /work/venv-openvino/bin/python benchmarks/calibrate_embed.py --texts 256 --only onnx

The `kind.run, onnx on ...` row is the kind's ONNX runtime on the best execution
provider installed; run the script from an environment with another ONNX Runtime build
(onnxruntime-openvino replaces the `onnxruntime` module, so it has an environment of its
own, with idlegrid's source on PYTHONPATH) for that provider's row.

A GPU (or MPS) node: run the second line there and add its `device=...` rows to the
table in docs/verification.md; if an honest row comes within 10x of the threshold,
widen it there and in `embed_text.COSINE_AGREE`.
"""

from __future__ import annotations

import argparse
import copy
import json
from collections.abc import Callable

import numpy as np
import torch

from idlegrid.kinds.base import RunContext, Verdict
from idlegrid.kinds.embed_text.kind import (
    COSINE_AGREE,
    EmbedTextKind,
    EmbedTextParams,
    embeddings_to_npy,
    load_model,
    row_cosines,
)
from idlegrid.kinds.embed_text.samples import stdlib_paragraphs


def encode(model, texts: list[str], *, batch_size: int, threads: int, sort: bool) -> np.ndarray:  # type: ignore[no-untyped-def]
    torch.set_num_threads(threads)
    if sort:
        return model.encode(texts, batch_size=batch_size, normalize_embeddings=True)
    parts = [
        model.encode(texts[i : i + batch_size], batch_size=batch_size, normalize_embeddings=True)
        for i in range(0, len(texts), batch_size)
    ]
    return np.concatenate(parts)


def variants(
    texts: list[str], device: str | None
) -> dict[str, tuple[bool, Callable[[], np.ndarray]]]:
    """name -> (honest?, how to compute it)."""
    model = load_model("cpu")

    def with_model(changed, **kw):  # type: ignore[no-untyped-def]
        return lambda: encode(
            changed, texts, **({"batch_size": 64, "threads": 2, "sort": True} | kw)
        )

    def perturbed(scale: float):  # type: ignore[no-untyped-def]
        clone = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in clone.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * p.std() * scale)
        return clone

    def truncated():  # type: ignore[no-untyped-def]
        clone = copy.deepcopy(model)
        clone[0].auto_model.encoder.layer = clone[0].auto_model.encoder.layer[:-1]
        return clone

    def double():  # type: ignore[no-untyped-def]
        return copy.deepcopy(model).double()

    def bf16() -> np.ndarray:
        torch.set_num_threads(2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model.encode(texts, batch_size=64, normalize_embeddings=True)
        return np.asarray(out, dtype=np.float32)

    def fp16() -> np.ndarray:
        # Computed in float16, normalized in float64 and stored as float32: low mantissa
        # bits set, so the structural 16-bit check cannot see it; only the cosine can.
        torch.set_num_threads(2)
        half = copy.deepcopy(model).half()
        out = np.asarray(
            half.encode(texts, batch_size=64, normalize_embeddings=False), dtype=np.float64
        )
        return (out / np.linalg.norm(out, axis=1, keepdims=True)).astype(np.float32)

    def on_device(name: str, batch_size: int) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            moved = load_model(name)
            out = moved.encode(texts, batch_size=batch_size, normalize_embeddings=True)
            return np.asarray(out, dtype=np.float32)

        return make

    reference = encode(model, texts, batch_size=64, threads=2, sort=True)
    rng = np.random.default_rng(0)

    def noisy(sigma: float, *, relative: bool = False) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            noise = rng.normal(0, sigma, reference.shape)
            out = reference * (1 + noise) if relative else reference + noise
            out = out / np.linalg.norm(out, axis=1, keepdims=True)
            return out.astype(np.float32)

        return make

    def rounded(dtype: str) -> Callable[[], np.ndarray]:
        def make() -> np.ndarray:
            if dtype == "float16":
                return reference.astype(np.float16).astype(np.float32)
            bits = reference.view(np.uint32) & np.uint32(0xFFFF0000)  # bfloat16 truncation
            return bits.view(np.float32)

        return make

    on_devices: dict[str, tuple[bool, Callable[[], np.ndarray]]] = {}
    if device:
        on_devices = {
            f"device={device}, batch=64": (True, on_device(device, 64)),
            f"device={device}, batch=8": (True, on_device(device, 8)),
        }
    return on_devices | {
        "threads=1": (True, with_model(model, threads=1)),
        "batch=1": (True, with_model(model, batch_size=1)),
        "batch=8": (True, with_model(model, batch_size=8)),
        "batch=128": (True, with_model(model, batch_size=128)),
        "unsorted batches of 32": (True, with_model(model, batch_size=32, sort=False)),
        "float64 arithmetic": (True, with_model(double())),
        "kind.run (threads=2)": (True, lambda: _kind_run(texts)),
        f"kind.run, onnx on {_onnx_provider()}": (True, lambda: _kind_run(texts, runtime="onnx")),
        "noise sigma=1e-4": (False, noisy(1e-4)),
        "noise sigma=1e-3": (False, noisy(1e-3)),
        "noise 1e-3 relative": (False, noisy(1e-3, relative=True)),
        "noise 1e-4 relative": (False, noisy(1e-4, relative=True)),
        "float16 arithmetic": (False, fp16),
        "output rounded to float16": (False, rounded("float16")),
        "output rounded to bfloat16": (False, rounded("bfloat16")),
        "bfloat16 arithmetic": (False, bf16),
        "weights perturbed 1%": (False, with_model(perturbed(0.01))),
        "weights perturbed 0.1%": (False, with_model(perturbed(0.001))),
        "last layer dropped": (False, with_model(truncated())),
        "reference": (True, lambda: reference),
    }


def _kind_run(texts: list[str], runtime: str = "torch") -> np.ndarray:
    torch.set_num_threads(2)
    payload = json.dumps({"offset": 0, "texts": texts}).encode()
    params = EmbedTextParams(runtime=runtime)  # type: ignore[arg-type]
    out = EmbedTextKind().run(payload, params, RunContext())
    from idlegrid.kinds.embed_text.kind import parse_embeddings

    return parse_embeddings(out)


def _onnx_provider() -> str:
    """The execution provider the kind's ONNX runtime takes here (the best one installed:
    in an environment with onnxruntime-openvino, OpenVINO)."""
    from idlegrid.kinds.onnx.runtime import available_providers, choose_providers

    return choose_providers(available_providers())[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument(
        "--device", default=None, help="also run honestly on this torch device (cuda, mps)"
    )
    parser.add_argument(
        "--only", nargs="+", default=None, help="run only the variants whose names contain these"
    )
    args = parser.parse_args()
    texts = stdlib_paragraphs(args.texts)
    kind, params = EmbedTextKind(), EmbedTextParams()
    runs = variants(texts, args.device)
    reference = runs.pop("reference")[1]()
    if args.only:
        runs = {name: run for name, run in runs.items() if any(s in name for s in args.only)}
    ref_bytes = embeddings_to_npy(reference)
    honest_floor, cheat_ceiling, closest_cheat = 1.0, 0.0, 0.0
    wrong: list[str] = []
    print(f"{'variant':<30} {'honest':>6} {'min cosine':>14} {'1 - min cos':>12}  compare")
    for name, (honest, make) in runs.items():
        out = np.asarray(make(), dtype=np.float32)
        low = float(row_cosines(reference, out).min())
        verdict = kind.compare(ref_bytes, embeddings_to_npy(out), params)
        print(f"{name:<30} {honest!s:>6} {low:>14.10f} {1 - low:>12.2e}  {verdict.value}")
        if honest:
            honest_floor = min(honest_floor, low)
        else:
            closest_cheat = max(closest_cheat, low)
            cheat_ceiling = max(cheat_ceiling, low) if verdict == Verdict.AGREE else cheat_ceiling
        if (verdict == Verdict.AGREE) != honest:
            wrong.append(name)
    print(f"largest honest 1 - cos: {1 - honest_floor:.2e}")
    print(f"smallest dishonest 1 - cos: {1 - closest_cheat:.2e}")
    print(f"threshold 1 - COSINE_AGREE: {1 - COSINE_AGREE:.2e}")
    print(f"highest cheat that compare still accepts: {cheat_ceiling:.10f} (0 = none)")
    print(f"misjudged: {', '.join(wrong) or 'none'}")


if __name__ == "__main__":
    main()
