"""Which ready task a node gets: hard filters, then a weighted score. Pure functions.

A node that asks for work is matched against the ready candidates in two steps:

1. **Hard filters** (`can_run`, `unmet_needs`): the node offers the kind and meets every
   field of the task's `Requirements` (memory, accelerator and backend, GPU memory,
   minimum benchmark, free disk, ONNX execution providers and opset). A node never gets a task it
   cannot run.
2. **Weighted score** (`score_terms`, `score`): the sum of these terms, each weight a
   setting (`CoordinatorSettings.sched_*`), with `expected_s` the task's expected run
   time on this node (`expected_seconds`):

   ============  ==========================================================================
   priority      w_priority x job priority (-100..100)
   age           w_age x age / (age + age_scale_s): older work first, saturating so that
                 an early big job does not outrank everything else forever
   fair_share    w_fair_share x the account's fair-share factor in (0, 1]
                 (`fairshare.factor`: 2^-(recent usage fraction / share fraction))
   speed         w_speed / (1 + expected_s / speed_scale_s): tasks this node is quick at
   locality      w_locality x the fraction of the job's input blobs the node holds
   affinity      w_affinity if the node is the task's preferred node (it holds state for
                 it, e.g. a training shard's optimizer moments from the previous round)
   reliability   w_reliability x node reliability (trust, 0..1) / replication: work that
                 no second replica checks goes to trusted nodes first
   on_time       w_on_time x on_time ^ max(1, expected_s / speed_scale_s): the chance the
                 node returns before the deadline, lower for long tasks on nodes that
                 often let leases run out
   ============  ==========================================================================

Ties go to the oldest task. Terms that depend on the node alone (reliability, on_time for
short tasks) shift all of a node's candidates alike; they order candidates that differ in
replication or length, and compare nodes where nodes compete (speculative backups).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from idlegrid.kinds.base import Requirements

GPU_BACKENDS = frozenset({"cuda", "rocm", "mps"})
NO_NEEDS = Requirements()
TERMS = ("priority", "age", "fair_share", "speed", "locality", "affinity", "reliability", "on_time")
# A node with no benchmark (0 GFLOPS) is assumed this fast for time estimates.
FALLBACK_GFLOPS = 1.0


@dataclass(frozen=True)
class NodeView:
    """What the scheduler knows of a node asking for work."""

    node_id: int
    kinds: frozenset[str]
    backends: frozenset[str]
    memory_mb: int
    gflops: float
    # Largest GPU memory (MiB); 0 without a GPU.
    accelerator_memory_mb: int = 0
    # None: the node did not report it (an older worker).
    disk_free_mb: int | None = None
    onnx_providers: frozenset[str] = frozenset()
    # Newest default-domain opset its ONNX Runtime loads; None: not reported.
    onnx_opset: int | None = None
    # Measured items per second per kind (its benchmark).
    kind_rates: Mapping[str, float] = field(default_factory=dict)
    # Trust in the node's results, 0..1 (fed by `coordinator.matching.node_reliability`).
    reliability: float = 0.5
    # Chance the node returns a task before its deadline, from its history (0..1).
    on_time: float = 0.5
    # Blob hashes the node holds (downloaded, or the inputs of tasks it was given).
    held_blobs: frozenset[str] = frozenset()
    # The account that owns it (a job may take only nodes of named accounts).
    account_id: int = 0


@dataclass(frozen=True)
class Candidate:
    """A ready task with what the scheduler needs to judge it."""

    task_id: int
    job_id: int
    kind: str
    priority: int
    created_at: float
    requirements: Requirements
    account_id: int = 0
    items: int = 1
    cost_flops: float = 0.0
    replication: int = 1
    # The job's input blobs every shard uses (a model, weights): locality counts these.
    input_hashes: frozenset[str] = frozenset()
    # The account's fair-share factor now (`fairshare.factor`), 0..1.
    fair_share: float = 1.0
    # The node that holds state for this task (a preference, never a requirement).
    preferred_node: int | None = None


@dataclass(frozen=True, kw_only=True)
class Weights:
    """Weights and scales of the score's terms (from `CoordinatorSettings.sched_*`)."""

    priority: float = 1.0
    age: float = 1.0
    age_scale_s: float = 600.0
    fair_share: float = 4.0
    speed: float = 1.0
    speed_scale_s: float = 60.0
    locality: float = 1.0
    affinity: float = 1.0
    reliability: float = 0.5
    on_time: float = 1.0


# -- hard filters ------------------------------------------------------------------------


def unmet_needs(node: NodeView, kind: str, needs: Requirements) -> list[str]:
    """Why this node cannot run a task of `kind` with `needs`; empty when it can."""
    reasons = []
    if kind not in node.kinds:
        reasons.append(f"does not offer kind {kind}")
    if needs == NO_NEEDS:  # most kinds: skip the checks on the claim path
        return reasons
    if needs.backends and not (needs.backends & node.backends):
        reasons.append(f"has no backend of {_names(needs.backends)}")
    gpus = node.backends & GPU_BACKENDS & (needs.backends or GPU_BACKENDS)
    if needs.accelerator and not gpus:
        reasons.append("has no GPU")
    if needs.min_accelerator_memory_mb and node.accelerator_memory_mb < (
        needs.min_accelerator_memory_mb
    ):
        reasons.append(f"has under {needs.min_accelerator_memory_mb} MB of GPU memory")
    if needs.min_memory_mb and node.memory_mb < needs.min_memory_mb:
        reasons.append(f"has under {needs.min_memory_mb} MB of memory")
    if needs.min_gflops and node.gflops < needs.min_gflops:
        reasons.append(f"benchmarks under {needs.min_gflops:g} GFLOPS")
    if needs.min_kind_rate and node.kind_rates.get(kind, 0.0) < needs.min_kind_rate:
        reasons.append(f"runs {kind} under {needs.min_kind_rate:g} items/s")
    if needs.min_disk_mb and (node.disk_free_mb or 0) < needs.min_disk_mb:
        reasons.append(f"has under {needs.min_disk_mb} MB of free disk")
    if needs.onnx_providers and not (needs.onnx_providers & node.onnx_providers):
        reasons.append(f"has no ONNX execution provider of {_names(needs.onnx_providers)}")
    if needs.min_onnx_opset and (node.onnx_opset or 0) < needs.min_onnx_opset:
        reasons.append(f"has no ONNX Runtime that loads opset {needs.min_onnx_opset}")
    if needs.offers - node.kinds:
        reasons.append(f"does not offer {_names(needs.offers - node.kinds)}")
    if needs.accounts and node.account_id not in needs.accounts:
        reasons.append("is not in the job's pool of accounts")
    return reasons


def needs_gpu(needs: Requirements) -> bool:
    """Whether a task can run only on a GPU: it asks for one, or names GPU backends only."""
    return needs.accelerator or bool(needs.backends and not needs.backends - GPU_BACKENDS)


def can_run(node: NodeView, candidate: Candidate) -> bool:
    """Hard filter: the node offers the kind and meets the task's requirements."""
    return not unmet_needs(node, candidate.kind, candidate.requirements)


def unmet(requirements: Requirements, kind: str, nodes: Iterable[NodeView]) -> str | None:
    """Why no registered node can run this job (None when one can): for its status."""
    views = list(nodes)
    if not views:
        return "no node is registered yet"
    if any(not unmet_needs(node, kind, requirements) for node in views):
        return None
    # The need that fewest nodes meet is the one to name first.
    counts: dict[str, int] = {}
    for node in views:
        for reason in unmet_needs(node, kind, requirements):
            counts[reason] = counts.get(reason, 0) + 1
    worst = sorted(counts, key=lambda reason: (-counts[reason], reason))
    return f"no registered node can run it: of {len(views)} node(s), " + "; ".join(
        f"{counts[reason]} {reason}" for reason in worst
    )


def _names(values: frozenset[str]) -> str:
    return "/".join(sorted(values))


# -- score -------------------------------------------------------------------------------


def expected_seconds(node: NodeView, kind: str, *, items: int, cost_flops: float) -> float:
    """Run time of a shard on this node: its measured rate for the kind, else its GFLOPS."""
    rate = node.kind_rates.get(kind, 0.0)
    if rate > 0:
        return items / rate
    gflops = node.gflops if node.gflops > 0 else FALLBACK_GFLOPS
    return cost_flops / (gflops * 1e9)


def score_terms(
    node: NodeView, candidate: Candidate, *, now: float, weights: Weights
) -> dict[str, float]:
    """Each term of the score (module docstring), by name."""
    return dict(zip(TERMS, _terms(node, candidate, now=now, weights=weights), strict=True))


def _terms(
    node: NodeView, candidate: Candidate, *, now: float, weights: Weights
) -> tuple[float, ...]:
    age = max(0.0, now - candidate.created_at)
    expected = expected_seconds(
        node, candidate.kind, items=candidate.items, cost_flops=candidate.cost_flops
    )
    inputs = candidate.input_hashes
    held = len(inputs & node.held_blobs) / len(inputs) if inputs else 0.0
    length = max(1.0, expected / weights.speed_scale_s)
    return (
        weights.priority * candidate.priority,
        weights.age * age / (age + weights.age_scale_s),
        weights.fair_share * candidate.fair_share,
        weights.speed / (1.0 + expected / weights.speed_scale_s),
        weights.locality * held,
        weights.affinity if candidate.preferred_node == node.node_id else 0.0,
        weights.reliability * node.reliability / max(1, candidate.replication),
        weights.on_time * node.on_time**length,
    )


def score(node: NodeView, candidate: Candidate, *, now: float, weights: Weights) -> float:
    """Higher is better: the sum of `score_terms`."""
    return sum(_terms(node, candidate, now=now, weights=weights))


def rank(
    node: NodeView, candidates: Iterable[Candidate], *, now: float, weights: Weights = Weights()
) -> Sequence[Candidate]:
    """The candidates this node can run, best first (ties: oldest task first)."""
    fit = [c for c in candidates if can_run(node, c)]
    fit.sort(key=lambda c: (-score(node, c, now=now, weights=weights), c.task_id))
    return fit


# -- speculative backups -----------------------------------------------------------------


@dataclass(frozen=True)
class RunningShard:
    """A shard's live task on another node, as a candidate for a backup copy."""

    shard_id: int
    job_id: int
    kind: str
    items: int
    cost_flops: float
    requirements: Requirements
    # When the holder is expected to finish (assigned_at + its expected run time).
    holder_finish_at: float


def pick_backup(
    node: NodeView,
    running: Iterable[RunningShard],
    *,
    now: float,
    factor: float,
    min_gain_s: float,
) -> RunningShard | None:
    """The straggling shard an idle node should copy (MapReduce backup tasks), if any.

    Worth it when the holder's remaining time exceeds `factor` times this node's run time
    and the copy would finish at least `min_gain_s` sooner; the biggest gain wins.
    """
    best: tuple[float, RunningShard] | None = None
    for shard in running:
        if unmet_needs(node, shard.kind, shard.requirements):
            continue
        mine = expected_seconds(node, shard.kind, items=shard.items, cost_flops=shard.cost_flops)
        remaining = shard.holder_finish_at - now
        gain = remaining - mine
        if remaining > factor * mine and gain >= min_gain_s and (best is None or gain > best[0]):
            best = (gain, shard)
    return best[1] if best else None


def holder_finish_at(
    assigned_at: float, expected_s: float, *, now: float, progress: float | None = None
) -> float:
    """When a running task is expected to finish.

    From its reported progress where there is some (elapsed / progress), else from the
    holder's expected run time; once that has passed, "as long again as it has run".
    """
    elapsed = max(0.0, now - assigned_at)
    if progress is not None and 0.0 < progress < 1.0 and elapsed > 0:
        return assigned_at + elapsed / progress
    if elapsed <= expected_s:
        return assigned_at + expected_s
    return assigned_at + 2 * elapsed
