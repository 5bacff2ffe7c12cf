"""The worker side of `llm-generate`: one shard generated, or one claimed output checked,
with the model this task process keeps loaded."""

from __future__ import annotations

import hashlib

from idlegrid.kinds.base import InputError, RunContext
from idlegrid.kinds.llm_generate import runtime
from idlegrid.kinds.llm_generate.check import (
    EXACT,
    CheckReport,
    check_shard,
    decisive,
    margins_for,
)
from idlegrid.kinds.llm_generate.generate import generate_shard
from idlegrid.kinds.llm_generate.shard import (
    CheckVerdict,
    LlmGenerateParams,
    Output,
    Payload,
    read_output,
    write_output,
    write_verdict,
)

N_BATCH = 512
models = runtime.Models()


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
    completions = generate_shard(llm, payload, params, ctx)
    output = Output(completions=completions, backend=runtime.backend(), build=runtime.build())
    return write_output(output)
