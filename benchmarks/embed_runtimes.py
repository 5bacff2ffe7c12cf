"""embed-text throughput on torch (sentence-transformers) against ONNX Runtime, one process.

    PYTHONPATH=src python benchmarks/embed_runtimes.py [--texts 512] [--threads 2] [--rounds 3]

Both runtimes embed the same stdlib paragraphs through the kind's own `run` (sorting,
batching, pooling, normalising as a worker does), with the same thread count; the ONNX
model is the worker's export of the packaged weights (made first if this machine has
none: tens of seconds, once). Rounds alternate (torch, onnx, torch, ...) so that load
from other processes hits both alike; figures are medians. Prints the lowest per-row
cosine between the two and the kind's verdict, then `onnx/torch: X.XX` (throughput ratio).
"""

from __future__ import annotations

import argparse
import statistics
import time

from idlegrid.kinds.base import RunContext
from idlegrid.kinds.embed_text import onnx as embed_onnx
from idlegrid.kinds.embed_text.kind import (
    EmbedTextKind,
    EmbedTextParams,
    parse_embeddings,
    row_cosines,
    texts_to_jsonl,
)
from idlegrid.kinds.embed_text.samples import stdlib_paragraphs

KIND = EmbedTextKind()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)  # what the worker does for embed-text
    started = time.perf_counter()
    print(f"onnx model: {embed_onnx.exported_model()} ({time.perf_counter() - started:.1f} s)")
    texts = stdlib_paragraphs(args.texts)
    ctx = RunContext(threads=args.threads)
    seconds: dict[str, list[float]] = {"torch": [], "onnx": []}
    outputs: dict[str, bytes] = {}
    params = {rt: EmbedTextParams(shard_size=len(texts), runtime=rt) for rt in seconds}
    payload = KIND.split({"texts": texts_to_jsonl(texts)}, params["torch"])[0].payload
    for runtime in seconds:  # loads, and the first-call costs, outside the rounds
        KIND.run(payload, params[runtime], ctx)
    for _ in range(args.rounds):
        for runtime in seconds:
            started = time.perf_counter()
            outputs[runtime] = KIND.run(payload, params[runtime], ctx)
            seconds[runtime].append(time.perf_counter() - started)
    rates = {rt: len(texts) / statistics.median(s) for rt, s in seconds.items()}
    cosines = row_cosines(parse_embeddings(outputs["torch"]), parse_embeddings(outputs["onnx"]))
    verdict = KIND.compare(outputs["torch"], outputs["onnx"], params["torch"]).value
    print(f"{len(texts)} texts, {args.threads} threads, {args.rounds} rounds")
    for runtime, rate in rates.items():
        print(f"{runtime:5}: {rate:6.1f} texts/s (median)")
    print(
        f"min row cosine torch vs onnx {cosines.min():.12f} (1 - cos {1 - cosines.min():.1e}), "
        f"compare: {verdict}"
    )
    print(f"onnx/torch: {rates['onnx'] / rates['torch']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
