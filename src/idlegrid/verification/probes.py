"""Known-answer checks: the checkers checked. Pure.

A checker is a volunteer too, and one that passes every claim unread would let lies
into results and be paid for it. So some check tasks carry a claim whose right verdict
the coordinator knows: an output with a defect planted in it (`TaskKind.plant_defect`),
which an honest check fails. To its node such a task is any other check (the same
shard's prompts, an output of the right shape, the same message).

- How often: by the node's record (`Trust.probes_passed`, the known-answer checks it
  answered right since its last lie): a new checker gets one in every two of its
  checks, an established one still one in `1 / FLOOR_RATE`, never none.
- What the answer means: right, it is a validated result (paid, and it pays the
  node's passes since its last lie: `pays_passes`); wrong (the planted defect passed,
  or the verdict names another claim, or is no verdict), it is a lie, judged as an
  outvoted result (trust, quota, suspension, a recheck of what it vouched for).
- Established: `ESTABLISHED_AFTER` right answers in a row. Only an established
  checker's pass makes an output canonical alone (`verification.checking`); any
  other needs a second pass from another account. A share `SECOND_PASS_RATE` of
  shards wants a second pass anyway, drawn when their first check is handed out: a
  checker that answers known-answer checks right but passes a partner's lies (the two
  can tell each other which outputs are theirs) meets an honest second checker there.
"""

from __future__ import annotations

from typing import Literal

from idlegrid.verification.trust import Trust

KnownAnswer = Literal["fail"]

# Right answers in a row after which a checker's pass stands alone.
ESTABLISHED_AFTER = 2
# A new checker's share of known-answer checks, how it falls with each right answer,
# and the share that stays however long its record.
FIRST_RATE = 0.5
RATE_DECAY = 0.7
FLOOR_RATE = 0.05
# Shards whose output needs a second pass even after an established checker's, and the
# quorum that marks such a shard (its output and two passes; others have 2).
SECOND_PASS_RATE = 0.1
SECOND_PASS_QUORUM = 3


def rate(trust: Trust) -> float:
    """The share of this checker's checks that are known-answer checks."""
    return max(FLOOR_RATE, FIRST_RATE * RATE_DECAY**trust.probes_passed)


def sends_probe(trust: Trust, *, draw: float) -> bool:
    """Whether a check this node claimed becomes a known-answer check (`draw` in [0, 1))."""
    return draw < rate(trust)


def wants_second_pass(*, draw: float) -> bool:
    """Whether a shard whose first check is handed out now needs two passes in any case
    (`draw` in [0, 1))."""
    return draw < SECOND_PASS_RATE


def established(trust: Trust) -> bool:
    """Whether this checker's record lets its pass make an output canonical alone."""
    return not trust.suspended and trust.probes_passed >= ESTABLISHED_AFTER


def answered_right(known: str, planted_hash: str, verdict: tuple[str, bool] | None) -> bool:
    """Whether a known-answer check's verdict is the right one: about the planted claim,
    and failing it (a planted defect is always wrong)."""
    if verdict is None:
        return False
    claimed, passed = verdict
    return claimed == planted_hash and passed == (known != "fail")
