"""Which ready task a node gets: hard filters, then a weighted score. Pure functions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from idlegrid.kinds.base import Requirements


@dataclass(frozen=True)
class NodeView:
    """What the scheduler knows of a node asking for work."""

    node_id: int
    kinds: frozenset[str]
    backends: frozenset[str]
    memory_mb: int
    gflops: float


@dataclass(frozen=True)
class Candidate:
    """A ready task with what the scheduler needs to judge it."""

    task_id: int
    job_id: int
    kind: str
    priority: int
    created_at: float
    requirements: Requirements


@dataclass(frozen=True)
class Weights:
    priority: float = 1.0
    # Per second waited: older work first, so a job is finished before the next is begun.
    age: float = 0.001


def can_run(node: NodeView, candidate: Candidate) -> bool:
    """Hard filter: the node offers the kind and meets the task's requirements."""
    needs = candidate.requirements
    if candidate.kind not in node.kinds:
        return False
    if needs.backends and not (needs.backends & node.backends):
        return False
    if needs.min_memory_mb and node.memory_mb < needs.min_memory_mb:
        return False
    return not (needs.min_gflops and node.gflops < needs.min_gflops)


def score(node: NodeView, candidate: Candidate, *, now: float, weights: Weights) -> float:
    """Higher is better. Issue-defined terms (speed, trust, locality) plug in here."""
    age = max(0.0, now - candidate.created_at)
    return weights.priority * candidate.priority + weights.age * age


def rank(
    node: NodeView, candidates: Iterable[Candidate], *, now: float, weights: Weights = Weights()
) -> Sequence[Candidate]:
    """The candidates this node can run, best first (ties: oldest task first)."""
    fit = [c for c in candidates if can_run(node, c)]
    fit.sort(key=lambda c: (-score(node, c, now=now, weights=weights), c.task_id))
    return fit
