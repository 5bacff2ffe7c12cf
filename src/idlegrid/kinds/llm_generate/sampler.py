"""The sampler both sides of `llm-generate` run: the generator picks tokens with it, the
checker repeats its pick from its own logits. Pure numpy, no llama.cpp.

A token's pick depends on the logits, the settings and one uniform draw that follows from
the prompt's seed and the token's position alone (`draw`), so a checker with the same
logits makes the same pick. Temperature 0 is greedy (the argmax). Otherwise the logits
are divided by the temperature, cut to the `top_k` largest and then to the smallest set
whose probability reaches `top_p` (ties broken by the lower token id), and the draw
walks their cumulative probability.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

# Tokens whose probability is below exp(-TAIL) of the largest carry no mass a pick can
# land on (together under 49152 * exp(-30) = 5e-9); dropping them first spares a sort of
# the whole vocabulary at each token.
TAIL = 30.0


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of one position's logits (float64)."""
    shifted = logits.astype(np.float64) - float(np.max(logits))
    return shifted - float(np.log(np.sum(np.exp(shifted))))


def draw(seed: int, position: int) -> float:
    """The uniform draw in [0, 1) of a prompt's `position`-th generated token."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 11) / float(1 << 53)


def candidates(logits: np.ndarray, sampling: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """The tokens a sampled pick may land on, most likely first, and their probabilities
    (summing to 1)."""
    scaled = logits.astype(np.float64) / sampling.temperature
    keep = np.flatnonzero(scaled >= float(np.max(scaled)) - TAIL)
    order = np.lexsort((keep, -scaled[keep]))  # probability descending, then token id
    tokens = keep[order]
    if sampling.top_k:
        tokens = tokens[: sampling.top_k]
    weights = np.exp(scaled[tokens] - float(scaled[tokens[0]]))
    probs = weights / float(np.sum(weights))
    if sampling.top_p < 1.0:
        reach = int(np.searchsorted(np.cumsum(probs), sampling.top_p)) + 1
        tokens, probs = tokens[:reach], probs[:reach] / float(np.sum(probs[:reach]))
    return tokens, probs


def choose(logits: np.ndarray, sampling: Sampling, *, seed: int, position: int) -> int:
    """The token the sampler picks at `position` of a prompt seeded `seed`."""
    if sampling.greedy:
        return int(np.argmax(logits))
    tokens, probs = candidates(logits, sampling)
    index = int(np.searchsorted(np.cumsum(probs), draw(seed, position), side="right"))
    return int(tokens[min(index, len(tokens) - 1)])


def interval(logits: np.ndarray, sampling: Sampling, token: int) -> tuple[float, float] | None:
    """The range of draws for which the sampler picks `token` from these logits (None:
    no draw picks it)."""
    tokens, probs = candidates(logits, sampling)
    where = np.flatnonzero(tokens == token)
    if not where.size:
        return None
    cumulative = np.cumsum(probs)
    position = int(where[0])
    low = float(cumulative[position - 1]) if position else 0.0
    return low, float(cumulative[position])
