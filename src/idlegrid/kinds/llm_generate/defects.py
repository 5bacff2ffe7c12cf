"""Defects planted in a verified-looking output, for known-answer checks of checkers.

The coordinator sends a checker, now and then, an output it has changed so that an
honest check must fail it (`verification.probes`). The change keeps the output's shape
and every rule a checker could test without the model (token counts, finish reasons,
the text the tokens decode to), so only running the model tells it from a real claim:

- shifted log-probabilities: a few tokens, anywhere in the shard, claimed less likely
  than the model makes them, by more than any margin a check allows (`check.CROSS`);
- a replay: each prompt's completion moved to the next prompt of the shard (with two
  prompts or more), the log-probabilities those tokens had in another context.

Pure: no model, no I/O; `draw` picks the defect and where it goes.
"""

from __future__ import annotations

import dataclasses
import random

from idlegrid.kinds.llm_generate.shard import Output

# How far a shifted log-probability moves: beyond the cross-build margin per token
# (`check.CROSS.logprob`) with room, and below the checker's own value, so the claim
# stays a probability (<= 0).
SHIFT_MIN = 2.0
SHIFT_MAX = 4.0
# Tokens shifted: one in this many of the shard's, at least `MIN_SHIFTED`, so a checker
# that reads only part of the shard misses them all rarely.
SHIFT_EVERY = 8
MIN_SHIFTED = 3


def plant(output: Output, draw: float) -> Output:
    """`output` with a defect an honest check fails (see the module)."""
    rng = random.Random(int(draw * 2**53))
    if len(output.completions) >= 2 and rng.random() < 0.5:
        return _replay(output)
    return _shift_logprobs(output, rng)


def _shift_logprobs(output: Output, rng: random.Random) -> Output:
    places = [(i, j) for i, c in enumerate(output.completions) for j in range(len(c.tokens))]
    count = min(len(places), max(MIN_SHIFTED, len(places) // SHIFT_EVERY))
    chosen = set(rng.sample(places, count))
    completions = [
        dataclasses.replace(
            c,
            logprobs=[
                lp - rng.uniform(SHIFT_MIN, SHIFT_MAX) if (i, j) in chosen else lp
                for j, lp in enumerate(c.logprobs)
            ],
        )
        for i, c in enumerate(output.completions)
    ]
    return dataclasses.replace(output, completions=completions)


def _replay(output: Output) -> Output:
    moved = output.completions[1:] + output.completions[:1]
    # Each completion whole (its finish, error and token bytes too): only its place moves.
    completions = [
        dataclasses.replace(other, index=home.index)
        for home, other in zip(output.completions, moved, strict=True)
    ]
    if [c.tokens for c in completions] == [c.tokens for c in output.completions]:
        return _shift_logprobs(output, random.Random(len(completions)))  # all alike
    return dataclasses.replace(output, completions=completions)
