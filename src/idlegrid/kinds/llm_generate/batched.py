"""A shard's prompts decoded together: parallel sequences in one llama.cpp context.

One pass over the weights yields a token for every sequence in flight, as in llama.cpp's
own server and batch engines. The context holds `sequences` slots, each a KV stream of
its own (`kv_unified` off): a sequence's attention then reads only its own cells, in
position order, through the kernel a one-token decode runs, so a sequence decoded beside
others gets the logits it would get alone and the check stays exact (measured:
benchmarks/llm_generate.py --exactness, docs/verification.md).

Continuous batching: a finished sequence's slot takes the next prompt at once. Slots in
flight stay numbered 0..n-1 (llama.cpp evaluates the streams of one micro-batch as one
contiguous range of sequence ids), so when no prompt takes a freed slot the last
sequence moves into it.

Shared prefixes: a prompt that starts with at least `MIN_SHARED` tokens of a prompt
already in the cache copies that slot's KV stream (llama.cpp's sequence copy) and
evaluates only the rest; a prompt sharing a prefix with one admitted in the same step
waits that step, to copy it.

Each sequence keeps its own seeded sampler, stop strings and `max_tokens`; a sequence that
cannot run (its prompt and `max_tokens` do not fit the context) fails alone.
"""

from __future__ import annotations

import ctypes
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from idlegrid.kinds.base import Cancelled, RunContext
from idlegrid.kinds.llm_generate import runtime
from idlegrid.kinds.llm_generate.generate import (
    Settings,
    decode,
    failed,
    settings_of,
    stop_index,
    token_logprobs,
    wants_pieces,
)
from idlegrid.kinds.llm_generate.sampler import choose
from idlegrid.kinds.llm_generate.shard import Completion, LlmGenerateParams, Payload, PayloadPrompt

# The most sequences a node decodes together unless its settings say otherwise: on a CPU
# a step's tokens grow little past 32 (docs/benchmarks.md), and 32 rows fill one
# micro-batch (runtime.UBATCH), the size the check's exactness is measured at.
MAX_SEQUENCES = 32
# A shared prefix shorter than this is evaluated again rather than copied (a copy moves
# the slot's whole KV stream).
MIN_SHARED = 32
# Tokens one llama_decode call takes (llama.cpp cuts them into micro-batches).
BATCH_TOKENS = 512


class ContextFailed(RuntimeError):
    """llama.cpp could not make or use a context this large (out of memory)."""


@dataclass
class _Sequence:
    prompt: PayloadPrompt
    prompt_tokens: list[int]
    settings: Settings
    pending: list[int]  # tokens to evaluate at the next step
    cached: int  # positions already in the slot's KV stream
    generated: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: bytearray = field(default_factory=bytearray)
    pieces: list[bytes] = field(default_factory=list)
    finish: str = ""
    cut: int | None = None


class Engine:
    """A llama.cpp context of `sequences` slots of `n_ctx` tokens each, on a loaded model
    (a `Llama` of runtime.load: its weights and its context settings)."""

    def __init__(self, llm: Any, *, sequences: int, n_ctx: int) -> None:
        import llama_cpp
        from llama_cpp import _internals

        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_ctx = sequences * n_ctx
        params.n_seq_max = sequences
        params.kv_unified = False
        params.n_batch = BATCH_TOKENS
        params.n_ubatch = runtime.UBATCH
        from llama_cpp._utils import suppress_stdout_stderr

        try:
            with suppress_stdout_stderr(disable=False):  # llama.cpp's notes on the context
                self._ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
        except ValueError:
            raise ContextFailed(
                f"llama.cpp could not make a context of {sequences} sequences of {n_ctx} tokens"
            ) from None
        self._lib = llama_cpp
        self.llm = llm
        self.sequences = sequences
        self.n_ctx = n_ctx
        self.vocab = llm.n_vocab()
        self._batch = llama_cpp.llama_batch_init(BATCH_TOKENS, 0, 1)

    def close(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        self._ctx.close()

    def clear(self) -> None:
        self._ctx.kv_cache_clear()

    def copy(self, source: int, target: int, keep: int) -> None:
        """Slot `target` takes slot `source`'s KV stream, cut to its first `keep` positions."""
        memory = self._ctx.memory
        self._lib.llama_memory_seq_rm(memory, target, -1, -1)
        self._lib.llama_memory_seq_cp(memory, source, target, -1, -1)
        self._lib.llama_memory_seq_rm(memory, target, keep, -1)

    def drop(self, slot: int) -> None:
        self._lib.llama_memory_seq_rm(self._ctx.memory, slot, -1, -1)

    def decode(self, rows: list[tuple[int, int, int, bool]]) -> np.ndarray:
        """Evaluate (slot, position, token, wants_logits) rows, slots ascending; the logits
        of the rows that want them, in row order."""
        batch = self._batch
        blocks = []
        for start in range(0, len(rows), BATCH_TOKENS):
            chunk = rows[start : start + BATCH_TOKENS]
            outputs = 0
            for i, (slot, position, token, logits) in enumerate(chunk):
                batch.token[i] = token
                batch.pos[i] = position
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = slot
                batch.logits[i] = logits
                outputs += logits
            batch.n_tokens = len(chunk)
            code = self._lib.llama_decode(self._ctx.ctx, batch)
            if code != 0:
                raise ContextFailed(f"llama_decode returned {code} for {len(chunk)} tokens")
            if outputs:
                pointer = ctypes.cast(
                    self._lib.llama_get_logits(self._ctx.ctx), ctypes.POINTER(ctypes.c_float)
                )
                block = np.ctypeslib.as_array(pointer, (outputs, self.vocab))
                last = start + BATCH_TOKENS >= len(rows)
                blocks.append(block if last else block.copy())
        if not blocks:
            return np.empty((0, self.vocab), dtype=np.float32)
        return blocks[0] if len(blocks) == 1 else np.concatenate(blocks)


def sequences_for(
    params: LlmGenerateParams, prompts: int, *, cap: int, memory_bytes: int | None
) -> int:
    """Sequences to decode together: the node's cap, no more than the shard's prompts, and
    no more KV streams at the shard's context than `memory_bytes` holds beside the weights."""
    wanted = max(1, min(cap, prompts))
    facts = params.model_facts
    if memory_bytes is None or facts is None or not params.n_ctx:
        return wanted
    per_sequence = max(1, facts.kv_cache_bytes(params.n_ctx))
    fits = (memory_bytes - facts.file_bytes) // per_sequence
    return max(1, min(wanted, int(fits)))


def generate_shard(
    engine: Engine, payload: Payload, params: LlmGenerateParams, ctx: RunContext
) -> list[Completion]:
    """The completions of a shard's prompts, in payload order, decoded together."""
    engine.clear()
    total = sum(p.prompt_tokens + settings_of(p, params).max_tokens for p in payload.prompts)
    done = 0
    queue: deque[PayloadPrompt] = deque(payload.prompts)
    slots: list[_Sequence | None] = []
    results: dict[int, Completion] = {}
    while queue or slots:
        if ctx.is_cancelled():
            raise Cancelled()
        _admit(engine, slots, queue, params, results)
        _compact(engine, slots)
        if not slots:
            continue
        live = [s for s in slots if s is not None]
        rows: list[tuple[int, int, int, bool]] = []
        for slot, sequence in enumerate(live):
            last = len(sequence.pending) - 1
            rows.extend(
                (slot, sequence.cached + offset, token, offset == last)
                for offset, token in enumerate(sequence.pending)
            )
        logits = engine.decode(rows)
        for sequence in live:
            sequence.cached += len(sequence.pending)
        for slot in _advance(engine.llm, live, logits):
            sequence = live[slot]
            results[sequence.prompt.index] = _completion(sequence)
            done += sequence.prompt.prompt_tokens + sequence.settings.max_tokens
            slots[slot] = None
            ctx.report_progress(min(1.0, done / max(1, total)))
        while slots and slots[-1] is None:
            slots.pop()
            engine.drop(len(slots))
    return [results[p.index] for p in payload.prompts]


def _admit(
    engine: Engine,
    slots: list[_Sequence | None],
    queue: deque[PayloadPrompt],
    params: LlmGenerateParams,
    results: dict[int, Completion],
) -> None:
    """Fill free slots (the lowest first) from the queue."""
    fresh: list[_Sequence] = []
    deferred: list[PayloadPrompt] = []
    while queue and (None in slots or len(slots) < engine.sequences):
        prompt = queue.popleft()
        tokens = runtime.tokenize(engine.llm, prompt.text)
        settings = settings_of(prompt, params)
        if len(tokens) + settings.max_tokens > engine.n_ctx:
            results[prompt.index] = failed(
                prompt,
                f"its {len(tokens)} prompt tokens and max_tokens {settings.max_tokens} "
                f"exceed the context of {engine.n_ctx}",
            )
            continue
        donor, shared = _donor(slots, tokens)
        if donor is None and any(
            _common(other.prompt_tokens, tokens) >= MIN_SHARED for other in fresh
        ):
            deferred.append(prompt)  # copies that prompt's stream at the next step
            continue
        slot = slots.index(None) if None in slots else len(slots)
        if slot == len(slots):
            slots.append(None)
        if donor is not None:
            engine.copy(donor, slot, shared)
        else:
            engine.drop(slot)
        sequence = _Sequence(
            prompt=prompt,
            prompt_tokens=tokens,
            settings=settings,
            pending=tokens[shared:],
            cached=shared,
        )
        slots[slot] = sequence
        fresh.append(sequence)
    queue.extendleft(reversed(deferred))


def _compact(engine: Engine, slots: list[_Sequence | None]) -> None:
    """Move the last sequences into free slots below them, so slots 0..n-1 are in flight."""
    while None in slots:
        hole = slots.index(None)
        last = len(slots) - 1
        if slots[last] is None:
            slots.pop()
            engine.drop(last)
            continue
        moving = slots.pop()
        assert moving is not None
        engine.copy(last, hole, moving.cached)
        engine.drop(last)
        slots[hole] = moving


def _donor(slots: list[_Sequence | None], tokens: list[int]) -> tuple[int | None, int]:
    """The slot whose evaluated prompt shares the longest prefix with `tokens`: at least
    `MIN_SHARED` tokens, and short of the whole prompt (its last token is evaluated again
    for its logits)."""
    best, best_shared = None, 0
    for slot, sequence in enumerate(slots):
        if sequence is None:
            continue
        shared = min(_common(sequence.prompt_tokens, tokens), len(tokens) - 1, sequence.cached)
        if shared >= MIN_SHARED and shared > best_shared:
            best, best_shared = slot, shared
    return best, best_shared


def _common(a: list[int], b: list[int]) -> int:
    limit = min(len(a), len(b))
    index = 0
    while index < limit and a[index] == b[index]:
        index += 1
    return index


def _advance(llm: Any, live: list[_Sequence], logits: np.ndarray) -> list[int]:
    """Each sequence's next token from its row of `logits` (row i: slot i); the slots
    that finished."""
    tokens = [
        int(np.argmax(logits[slot]))
        if sequence.settings.sampling.greedy
        else choose(
            logits[slot],
            sequence.settings.sampling,
            seed=sequence.prompt.seed,
            position=len(sequence.generated),
        )
        for slot, sequence in enumerate(live)
    ]
    logprobs = token_logprobs(logits, tokens)
    finished = []
    for slot, sequence in enumerate(live):
        if _take(llm, sequence, tokens[slot], float(logprobs[slot])):
            finished.append(slot)
    return finished


def _take(llm: Any, sequence: _Sequence, token: int, logprob: float) -> bool:
    """Append a picked token; whether the sequence is finished."""
    sequence.generated.append(token)
    sequence.logprobs.append(logprob)
    if runtime.is_end(llm, token):
        sequence.pieces.append(runtime.piece(llm, token))
        sequence.finish = "stop"
        return True
    piece = runtime.piece(llm, token)
    sequence.text += piece
    sequence.pieces.append(piece)
    if sequence.settings.stop:
        cut = stop_index(decode(sequence.text), sequence.settings.stop)
        if cut is not None:
            sequence.finish, sequence.cut = "stop", cut
            return True
    if len(sequence.generated) >= sequence.settings.max_tokens:
        sequence.finish = "length"
        return True
    sequence.pending = [token]
    return False


def _completion(sequence: _Sequence) -> Completion:
    text = decode(sequence.text)
    return Completion(
        index=sequence.prompt.index,
        text=text if sequence.cut is None else text[: sequence.cut],
        tokens=sequence.generated,
        logprobs=sequence.logprobs,
        finish="stop" if sequence.finish == "stop" else "length",
        pieces=sequence.pieces if wants_pieces(sequence.prompt) else None,
    )
