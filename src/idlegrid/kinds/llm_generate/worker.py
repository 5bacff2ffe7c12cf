"""The worker side of `llm-generate`: one shard generated, or one claimed output checked,
with the model this task process keeps loaded."""

from __future__ import annotations

import hashlib
import logging
from typing import Any

from idlegrid.kinds.base import InputError, RunContext
from idlegrid.kinds.llm_generate import runtime
from idlegrid.kinds.llm_generate.batched import ContextFailed, Engine, sequences_for
from idlegrid.kinds.llm_generate.batched import generate_shard as generate_together
from idlegrid.kinds.llm_generate.check import (
    EXACT,
    CheckReport,
    check_shard,
    decisive,
    margins_for,
)
from idlegrid.kinds.llm_generate.shard import (
    CheckVerdict,
    LlmGenerateParams,
    Output,
    Payload,
    read_output,
    write_output,
    write_verdict,
)

log = logging.getLogger(__name__)

N_BATCH = 512
# Of the memory free when a shard starts, the most its sequences' KV caches may take (the
# rest is for the system, the volunteer's programs and the other slots).
MEMORY_SHARE = 0.5
models = runtime.Models()
_engine: Engine | None = None  # the batched context of the loaded model, kept with it


def loaded(payload: Payload, ctx: RunContext) -> object:
    """The shard's model, loaded once per hash, context and threads in this process."""
    key = runtime.ModelKey(payload.model, payload.n_ctx, ctx.threads, N_BATCH)
    return models.get(key, lambda: runtime.model_path(payload.model, ctx))


def run_shard(payload: Payload, params: LlmGenerateParams, ctx: RunContext) -> bytes:
    """A shard's output: its generation, or with `ctx.check` the check of that claim."""
    llm = loaded(payload, ctx)
    if ctx.check is not None:
        margins = EXACT
        try:
            claimed = read_output(ctx.check)
            margins = margins_for(claimed, runtime.backend(), runtime.build())
            report = check_shard(llm, payload, claimed, params, ctx, margins)
        except InputError as exc:  # not even a well-formed output
            report = CheckReport().fail(str(exc))
        verdict = CheckVerdict(
            claimed=hashlib.sha256(ctx.check).hexdigest(),
            passed=report.passed,
            reason=report.reason,
            tokens=report.tokens,
            greedy_gap=report.greedy_gap,
            logprob_error=report.logprob_error,
            backend=runtime.backend(),
            decides=not report.passed or decisive(margins, report.tokens),
        )
        return write_verdict(verdict)
    completions, sequences = _generate(llm, payload, params, ctx)
    output = Output(
        completions=completions,
        backend=runtime.backend(),
        build=runtime.build(),
        sequences=sequences,
    )
    return write_output(output)


def _generate(
    llm: Any, payload: Payload, params: LlmGenerateParams, ctx: RunContext
) -> tuple[list[Any], int]:
    """The shard's completions, decoded together; on running out of memory, with half the
    sequences, down to one (each step logged)."""
    import psutil

    sequences = sequences_for(
        params,
        len(payload.prompts),
        cap=ctx.sequences,
        memory_bytes=int(psutil.virtual_memory().available * MEMORY_SHARE),
    )
    while True:
        try:
            engine = _engine_for(llm, sequences, payload.n_ctx)
            return generate_together(engine, payload, params, ctx), sequences
        except ContextFailed as exc:
            _drop_engine()
            if sequences == 1:
                raise
            log.warning("%s: decoding %d sequences together instead", exc, sequences // 2)
            sequences //= 2


def _engine_for(llm: Any, sequences: int, n_ctx: int) -> Engine:
    """The batched context for this model, sequences and context, made once and kept."""
    global _engine
    engine = _engine
    if engine is not None and (engine.llm, engine.sequences, engine.n_ctx) == (
        llm,
        sequences,
        n_ctx,
    ):
        return engine
    _drop_engine()
    _engine = Engine(llm, sequences=sequences, n_ctx=n_ctx)
    return _engine


def _drop_engine() -> None:
    global _engine
    if _engine is not None:
        _engine.close()
        _engine = None
