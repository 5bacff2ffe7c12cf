"""Judging a shard of a kind verified by check tasks, not by replicas (`TaskKind.checks`).

A generation is made once; a check task on another node (distinct account and network,
as replicas are) judges that claimed output and returns a verdict naming it by hash.
Pure: it gets each result's role, what the kind read of each check, and each checker's
record of known-answer checks (`verification.probes`).

For the shard's generations in arrival order, count the checks that passed (p) and
failed (f) each one:
- p > f, and either p >= 2 (two accounts: checks are distinct replicas) or one of the
  passes is an established checker's (unless the shard was drawn for a second check,
  `probes.wants_second_pass`: two checkers that agree to pass each other's lies cannot
  know when a third looks too): the generation is canonical; it and the checks
  that passed it are valid (the passes paid once a known-answer check confirms their
  node's word: `held`), the checks that failed it invalid (a checker that lied);
- f > p and f >= 2: the generation was a lie: it and the checks that passed it are
  invalid; the shard needs a new generation (and a check of it). The checks that failed
  it are valid once the shard is decided (they are paid as any validated result);
- otherwise (no check yet, a single pass of a checker not yet established, a single
  failed check, or a tie): one more check. A single failed check is confirmed by a
  second checker before it counts, so one lying checker cannot make an honest node's
  work a lie; a single pass by a checker without a record is confirmed by a second, so
  one lazy checker cannot make a lie canonical.
A result in the wrong role (a generation task that returned a check, a check of another
output, or a check task that returned a generation) is invalid.

Builds (kinds whose outputs name the build that made them, llm-generate's llama.cpp): a
check on the generation's own build is exact, one from another build holds the claim
to the cross-build margins, which every compute-saving cheat fails (docs/verification.md,
"Calibration and cheats"); so a pass counts from any build. `store.check_routing` still
sends a check to a node of the output's build first, for a while. A generation that
names another build than its node reported is invalid: a node cannot steer its check
to other margins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from idlegrid.verification.quorum import Decision

CONFIRMING_FAILS = 2
# Passes that make an output canonical when none is an established checker's.
CONFIRMING_PASSES = 2
# Passes that decide nothing (another build's, over a short shard) after which an output
# no decisive check judged is set aside: made again on another node, neither valid nor
# invalid (its node is not blamed: a rare build is no lie).
UNDECIDED_BEFORE_REMAKE = 2


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
    # A generation: the build its output names (None: the kind names none).
    claimed_build: str | None = None
    # A check: its node's known-answer record lets its pass stand alone (`probes`).
    established: bool = False
    # A check: False when its pass proves nothing (another build's check of too few
    # tokens: `TaskKind.check_decides`). Such passes neither count nor are judged, and
    # after `UNDECIDED_BEFORE_REMAKE` of them the output is set aside and made again.
    decides: bool = True


@dataclass(frozen=True)
class CheckedOutcome:
    decision: Decision
    # The shard needs one more task (a check, or a new generation after a lie).
    more: bool
    # Undecided: the passes of an output that more passes, or their checkers' records
    # established, would make canonical (no fail outweighs them).
    awaiting: tuple[CheckedVote, ...] = ()


def decide(votes: Sequence[CheckedVote], *, second_pass: bool = False) -> CheckedOutcome:
    """The shard's decision from its results in arrival order (see the module).

    `second_pass`: the shard was drawn for a second check (`probes.wants_second_pass`),
    so even an established checker's pass waits for one more from another account."""
    misplaced = tuple(v.task_id for v in votes if _misplaced(v))
    placed = [v for v in votes if v.task_id not in misplaced]
    generations = [v for v in placed if v.checks is None]
    counted = [v for v in placed if v.checks is not None and v.credibility > 0.0]
    checks = [c for c in counted if c.decides or not _passed(c)]
    undecided = [c for c in counted if not c.decides and _passed(c)]
    invalid = list(misplaced)
    set_aside: list[int] = []
    awaiting: tuple[CheckedVote, ...] = ()
    # Checks that failed a lie: valid with the shard's decision. A lie found earlier is
    # no longer among the votes (its outcome is recorded): the checks that failed it are.
    present = {g.output_hash for g in generations}
    caught = [c.task_id for c in checks if c.checks not in present and not _passed(c)]
    for generation in generations:
        of = [c for c in checks if _of(c, generation)]
        passes = [c for c in of if _passed(c)]
        passed = [c.task_id for c in passes]
        failed = [c.task_id for c in of if not _passed(c)]
        twins = _twins(generation, generations)
        backing = len(passed) + len(twins)
        if backing > len(failed) and _confirmed(backing, passes, second_pass=second_pass):
            return CheckedOutcome(
                Decision(
                    canonical=generation.task_id,
                    valid=(*caught, generation.task_id, *twins, *passed),
                    invalid=(*invalid, *failed),
                    held=tuple(passed),
                ),
                more=False,
            )
        if len(failed) > len(passed) and len(failed) >= CONFIRMING_FAILS:
            invalid += [generation.task_id, *passed]
            caught += failed
            continue
        if backing > len(failed) and passes and not awaiting:
            awaiting = tuple(passes)
        shrugs = [c.task_id for c in undecided if _of(c, generation)]
        if not of and len(shrugs) >= UNDECIDED_BEFORE_REMAKE:
            set_aside += [generation.task_id, *shrugs]
    return CheckedOutcome(
        Decision(canonical=None, valid=(), invalid=tuple(invalid), moot=tuple(set_aside)),
        more=True,
        awaiting=awaiting,
    )


def _twins(generation: CheckedVote, generations: Sequence[CheckedVote]) -> list[int]:
    """The same bytes made again by other nodes (on the same build): they back the output
    as a pass does, and are paid as outputs."""
    return [
        g.task_id
        for g in generations
        if g.task_id != generation.task_id
        and g.output_hash == generation.output_hash
        and g.credibility > 0.0
    ]


def _confirmed(backing: int, passes: Sequence[CheckedVote], *, second_pass: bool) -> bool:
    """Whether an output is backed enough to be canonical: twice, or by one established
    checker's pass alone (unless the shard was drawn for a second check)."""
    alone = not second_pass and any(c.established for c in passes)
    return backing >= CONFIRMING_PASSES or alone


def confirmation_reason(shard_index: int, checker_nodes: Sequence[int], left_s: float) -> str:
    """What a stalled shard whose output passed only checks of checkers without a record
    waits for, in words (the job's `waiting_for`)."""
    nodes = ", ".join(str(n) for n in sorted(set(checker_nodes)))
    return (
        f"shard {shard_index}: its output passed a check by node {nodes}, whose record as a "
        "checker (known-answer checks) is not established yet, and no other volunteer's "
        f"node can check it; it waits up to {max(left_s, 0.0):.0f} s more for one, or for "
        "that record, then fails"
    )


def settle(votes: Sequence[CheckedVote], *, node_of: dict[int, int]) -> Decision:
    """The decision of a shard verified by checks that no node can add a task to: the
    checking rule's own (`decide`), never another; undecided, it fails with the reason.
    A check verdict is never canonical. `node_of`: task -> node, for the reason."""
    outcome = decide(votes)
    if outcome.decision.canonical is not None:
        return outcome.decision
    invalid = outcome.decision.invalid
    return Decision(
        canonical=None,
        valid=(),
        invalid=invalid,
        fail_reason=stalemate_reason(votes, set(invalid), node_of=node_of),
    )


def stalemate_reason(
    votes: Sequence[CheckedVote], invalid: set[int], *, node_of: dict[int, int]
) -> str:
    """Why a checked shard no node can add a task to was not decided, in words
    (`invalid`: the results its decision found invalid)."""
    outputs = [v for v in votes if v.checks is None and v.task_id not in invalid]
    nodes = ", ".join(str(node_of[v.task_id]) for v in votes)
    if not outputs:
        needs = "a new output (its earlier ones were found wrong)"
    else:
        made = ", ".join(str(node_of[v.task_id]) for v in outputs)
        needs = f"one more check of its output (made by node {made})"
    return (
        f"undecidable: it needs {needs}, and no other node can give it (ran it: nodes "
        f"{nodes}); a node of another volunteer lets a job like it finish"
    )


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
        f"{max(left_s, 0.0):.0f} s more, then nodes of other builds check it, within the "
        "cross-build margins"
    )


def doubt_reason(shard_index: int, node_id: int) -> str:
    """What an ended job says of a shard whose output one check alone passed, by a node
    caught lying since."""
    return (
        f"shard {shard_index}: its output was accepted on one check, by node {node_id}, "
        "which was caught lying since; its job had ended, so it was not checked again"
    )
