"""Judging a shard of a kind verified by check tasks, not by replicas (`TaskKind.checks`).

A generation is made once; a check task on another node (distinct account and network,
as replicas are) judges that claimed output and returns a verdict naming it by hash.
Pure: it gets each result's role and what the kind read of each check.

For the shard's generations in arrival order, count the checks that passed (p) and
failed (f) each one:
- p > f: the generation is canonical; it and the checks that passed it are valid, the
  checks that failed it invalid (a checker that lied);
- f > p and f >= 2: the generation was a lie: it and the checks that passed it are
  invalid; the shard needs a new generation (and a check of it). The checks that failed
  it are valid once the shard is decided (they are paid as any validated result);
- otherwise (no check yet, or a single failed check, or a tie): one more check. A single
  failed check is confirmed by a second checker before it counts, so one lying checker
  cannot make an honest node's work a lie.
A result in the wrong role (a generation task that returned a check, a check of another
output, or a check task that returned a generation) is invalid.

Builds (kinds whose outputs name the build that made them, llm-generate's llama.cpp):
only a check by a node of the build the generation's node reported counts as a pass
(`same_build`). Across builds honest noise is as large as a near cheat (a requantized
model), so a pass from another build proves nothing and is left out of p (its checker is
valid with the generation, and is not judged if the generation is not); a failed check
counts from any build (honest outputs pass other builds' checks). A generation that
names another build than its node reported is invalid: a node cannot steer its check to
other margins. `store.claims` routes checks to nodes of the generation's build, and
makes the output again when only other builds checked it (`other_builds_before_remake`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from idlegrid.verification.quorum import Decision

CONFIRMING_FAILS = 2
# Checks by nodes of other builds (after the wait for one of its own) before an output
# no node of its build checked is set aside and made again (`store.check_routing`): two,
# so that one failing check of another build can be confirmed by a second (then it is a
# lie), while passes from other builds, which can never make it canonical, stop there.
OTHER_BUILDS_BEFORE_REMAKE = 2


@dataclass(frozen=True)
class CheckedVote:
    """One completed result of the shard, as the verifier read it."""

    task_id: int
    output_hash: str
    # The output this task was told to check (None: a generation task).
    checks: str | None
    # What its output says: None if it is a generation, else (claimed hash, passed).
    verdict: tuple[str, bool] | None
    # Its node's credibility; 0 (suspended) leaves it out of the count.
    credibility: float = 1.0
    # The build its node reported when it claimed the task (None: the kind has none).
    build: str | None = None
    # A generation: the build its output names (None: the kind names none, every check of
    # it counts as a pass).
    claimed_build: str | None = None


@dataclass(frozen=True)
class CheckedOutcome:
    decision: Decision
    # The shard needs one more task (a check, or a new generation after a lie).
    more: bool


def decide(votes: Sequence[CheckedVote]) -> CheckedOutcome:
    """The shard's decision from its results in arrival order (see the module)."""
    misplaced = tuple(v.task_id for v in votes if _misplaced(v))
    placed = [v for v in votes if v.task_id not in misplaced]
    generations = [v for v in placed if v.checks is None]
    checks = [v for v in placed if v.checks is not None and v.credibility > 0.0]
    invalid = list(misplaced)
    # Checks that failed a lie: valid with the shard's decision. A lie found earlier is
    # no longer among the votes (its outcome is recorded): the checks that failed it are.
    present = {g.output_hash for g in generations}
    caught = [c.task_id for c in checks if c.checks not in present and not _passed(c)]
    for generation in generations:
        of = [c for c in checks if _of(c, generation)]
        passed = [c.task_id for c in of if _passed(c) and same_build(generation, c)]
        all_passed = [c.task_id for c in of if _passed(c)]  # with other builds' passes
        failed = [c.task_id for c in of if not _passed(c)]
        if len(passed) > len(failed):
            return CheckedOutcome(
                Decision(
                    canonical=generation.task_id,
                    valid=(*caught, generation.task_id, *all_passed),
                    invalid=(*invalid, *failed),
                ),
                more=False,
            )
        if len(failed) > len(passed) and len(failed) >= CONFIRMING_FAILS:
            invalid += [generation.task_id, *passed]
            caught += failed
    return CheckedOutcome(Decision(canonical=None, valid=(), invalid=tuple(invalid)), more=True)


def same_build(generation: CheckedVote, check: CheckedVote) -> bool:
    """Whether `check` ran on the build `generation`'s node reported (always, for a kind
    whose outputs name no build)."""
    if generation.claimed_build is None:
        return True
    return bool(generation.build) and check.build == generation.build


def _misplaced(vote: CheckedVote) -> bool:
    if vote.checks is None:
        if vote.claimed_build is not None and vote.claimed_build != (vote.build or ""):
            return True  # it names another build than its node reported
        return vote.verdict is not None  # a generation task that answered with a check
    return vote.verdict is None or vote.verdict[0] != vote.checks


def _of(check: CheckedVote, generation: CheckedVote) -> bool:
    return check.checks == generation.output_hash


def _passed(check: CheckedVote) -> bool:
    return check.verdict is not None and check.verdict[1]


def build_wait_reason(shard_index: int, node_id: int, build: str, left_s: float) -> str:
    """What a shard whose output waits for a check on its build says (the job's
    `waiting_for`), while no connected node runs that build."""
    shown = build if len(build) <= 80 else build[:77] + "..."
    return (
        f"shard {shard_index} waits for a check on the build its output names ({shown}; "
        f"node {node_id} made it), and no connected node runs that build: for up to "
        f"{max(left_s, 0.0):.0f} s more, then nodes of other builds check it, whose "
        f"passes cannot make it canonical (after {OTHER_BUILDS_BEFORE_REMAKE} of them it "
        "is made again)"
    )
