"""A shard that no node can add a result to: decided on the evidence it has, or failed.

An open shard waits for results (`judging.waits`) and, undecided, for one more replica
(`replication.undecided`). In a small pool that replica may have no node to run it:
every node that could has run the shard already (replicas stay on distinct nodes,
accounts and networks), or is suspended, or cannot meet the job's requirements (the
caller passes only the nodes that can: `able`). Then waiting longer decides nothing,
and the shard would hold its job open for ever. The rule for that case
(docs/verification.md, "When no node can add a result"):

- It applies only when no eligible node is left (`eligible` is empty): in a pool large
  enough for the shard's next replica, the quorum's own rules decide, unchanged.
- It does not apply when only the operator's network rule bars the nodes that could
  take the replica (`network_bound`): one setting (`idlegrid serve --replica-networks`)
  or a volunteer on another network lets the shard go on, so it waits, and its job says
  so (`network_reason`), rather than failing for how the operator set the grid up.
- It waits for the late results it may still get: a replica whose lease ran out may be
  still running on a slow node, whose result then counts as any other. It is waited
  for one more lease length (`late_until`); so a node that holds a task and never
  answers delays the shard by at most twice its lease, and stalls it no longer.
- Voters are the results of unsuspended nodes. The largest group of agreeing voters
  wins if it has at least the job's quorum (and at least two), a strict majority of
  the voters, and at most one voter dissents, whose node is not trusted (a trusted
  node outvoted shows misplaced trust somewhere, which numbers alone cannot settle).
- Otherwise the shard fails, with a reason that names its groups and its nodes.

Credibility (`quorum.group_posteriors`) is not asked for: two or three new nodes that
agree against one cannot reach it in a dispute (`TrustSettings.dispute_margin`), and
no more nodes are coming. Results are judged either way: the dissent of a decided
shard is invalid, and counts against its node's trust.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from idlegrid.kinds.base import Verdict
from idlegrid.verification import quorum
from idlegrid.verification import trust as trust_rules
from idlegrid.verification.judging import Vote
from idlegrid.verification.trust import TrustSettings


@dataclass(frozen=True)
class Member:
    """A node as the replica rules see it: its id, its account, its network."""

    node_id: int
    account_id: int | None
    network: str | None


@dataclass(frozen=True)
class Replica:
    """A task of the shard that bars other replicas: its node, account and network, and
    whether it ran (or runs): a failed or expired replica bars only its own node."""

    member: Member
    ran: bool
    late_until: float | None = None  # expired: its result is waited for until then
    # False: a check that bars nobody (kinds verified by checks: one that caught a lie,
    # or an answered known-answer check), so its node may check the shard again.
    bars: bool = True


def late_until(assigned_at: float | None, lease_deadline: float | None) -> float | None:
    """Until when an expired replica's late result is waited for: one more lease."""
    if assigned_at is None or lease_deadline is None:
        return None
    return lease_deadline + max(lease_deadline - assigned_at, 0.0)


def awaits_late(replicas: Sequence[Replica], *, now: float) -> bool:
    """Whether a replica whose lease ran out may still send its result (the module)."""
    return any(r.late_until is not None and r.late_until > now for r in replicas)


def eligible(
    able: Sequence[Member],
    replicas: Sequence[Replica],
    *,
    accounts: bool,
    networks: bool,
) -> list[int]:
    """The ids of the `able` nodes (unsuspended, offering the kind, meeting the job's
    requirements) that may still take a replica of the shard, as
    `store.claims.distinct_from` would let them."""
    barring = [r for r in replicas if r.bars]
    nodes = {r.member.node_id for r in barring}
    ran = [r.member for r in barring if r.ran]
    barred_accounts = {m.account_id for m in ran} if accounts else set()
    barred_networks = {m.network for m in ran if m.network} if networks else set()
    return [
        m.node_id
        for m in able
        if m.node_id not in nodes
        and m.account_id not in barred_accounts
        and not (m.network and m.network in barred_networks)
    ]


def network_bound(
    able: Sequence[Member],
    replicas: Sequence[Replica],
    *,
    accounts: bool,
    networks: bool,
) -> list[int]:
    """The `able` nodes that only the network rule keeps from the shard's next replica
    (they share a network with a node that ran it); [] where some node is eligible, or
    the rule is off."""
    if not networks or eligible(able, replicas, accounts=accounts, networks=True):
        return []
    return eligible(able, replicas, accounts=accounts, networks=False)


def settle(
    votes: Sequence[Vote],
    compare: Callable[[bytes, bytes], Verdict],
    settings: TrustSettings,
    *,
    min_quorum: int,
    node_of: dict[int, int],
) -> quorum.Decision:
    """The decision of a shard no node can add a result to (the module's rule).

    `votes`: its results in arrival order with their nodes' trust; `node_of`: task ->
    node, for the reason of a failure.
    """
    results = [(v.task_id, v.output) for v in votes]
    voters = [(v.task_id, v.output) for v in votes if not v.trust.suspended]
    trust_of = {v.task_id: v.trust for v in votes}
    if voters:
        groups = quorum.groups(voters, compare)
        best = max(groups, key=lambda g: (len(g), -g[0]))
        leader = voters[best[0]][1]
        dissent = [t for t, out in voters if compare(leader, out) == Verdict.DISAGREE]
        if (
            len(best) >= max(min_quorum, 2)
            and 2 * len(best) > len(voters)
            and len(dissent) <= 1
            and not any(trust_rules.is_trusted(trust_of[t], settings) for t in dissent)
        ):
            return quorum.decided(results, voters, best, compare)
    return quorum.Decision(
        canonical=None,
        valid=(),
        invalid=(),
        fail_reason=failure_reason(votes, compare, node_of=node_of),
    )


def failure_reason(
    votes: Sequence[Vote],
    compare: Callable[[bytes, bytes], Verdict],
    *,
    node_of: dict[int, int],
) -> str:
    """Why a shard no node can add a result to was not decided, in words."""
    voters = [(v.task_id, v.output) for v in votes if not v.trust.suspended]
    sizes = sorted((len(g) for g in quorum.groups(voters, compare)), reverse=True)
    nodes = ", ".join(str(node_of[v.task_id]) for v in votes)
    if len(votes) == 1:
        return (
            f"undecidable: it has only one result and no other node can add one (ran it: "
            f"nodes {nodes}); the rule needs a strict majority of at least two agreeing nodes"
        )
    split = " against ".join(str(n) for n in sizes) if sizes else "no result of a node in standing"
    return (
        f"undecidable: its results disagree ({split}) and no other node can add one "
        f"(ran it: nodes {nodes}); the rule needs a strict majority of at least two "
        "agreeing nodes against at most one untrusted dissenter"
    )


def waiting_reason(shard_index: int, eligible_nodes: Sequence[int]) -> str:
    """What a stalled shard waits for, in words (the job's `waiting_for`): the only
    nodes that could add a result, none of them connected."""
    nodes = ", ".join(str(n) for n in sorted(set(eligible_nodes)))
    return (
        f"shard {shard_index} waits for one more result, which only nodes {nodes} "
        "can give (none of them is connected)"
    )


def network_reason(shard_index: int, barred_nodes: Sequence[int]) -> str:
    """What a shard that only the network rule holds back waits for, in words."""
    nodes = ", ".join(str(n) for n in sorted(set(barred_nodes)))
    return (
        f"shard {shard_index} waits for one more result from a node on another network: "
        f"nodes {nodes} could give it but share a network with a node that ran it; a "
        "volunteer on another network, or the operator's `idlegrid serve "
        '--replica-networks shared` (docs/operations.md, "Replicas and networks"), '
        "lets it go on"
    )
