"""A job sized against the fleet connected now: how long it takes, and shards that fit
their leases. Pure: node speeds and task costs in, estimates and limits out.

A node's speed for a kind is the FLOP/s of nominal cost (the kind's `cost_flops`) it
does: what the coordinator measured of its validated tasks of the kind, else its
benchmark's matmul GFLOPS times the kind's `benchmark_share` (the fraction of that peak
the kind's tasks reach; calibrated per kind). A job's time is its stages one after
another (a training job's rounds; one stage for other kinds), each stage's tasks spread
over the nodes' slots in queue order, each to the slot free first (as the dispatcher
hands tasks to the nodes that ask).

A lease is the coordinator's own decision (coordinator/leases.py): the task's cost over
the node's measured speed, or over the kind's default speed before any measure, times
`lease_slack`, clamped to [`min_lease_s`, `max_lease_s`]. A task that runs longer than
its lease is given to another node while it runs: work done twice. `fitting_cost` is the
largest task a node finishes within the lease it would get: shards are cut to fit the
median connected node, and a job is refused when even the fastest could not finish one
(`REFUSAL_MARGIN`: by more than an estimate's error).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass

# A shard is refused only when its estimate is this many times what the fastest node's
# lease allows: a node's speed from its benchmark is an estimate (a kind's
# benchmark_share varies by about a third between machines and runs).
REFUSAL_MARGIN = 1.5


@dataclass(frozen=True)
class LeaseRule:
    slack: float
    min_s: float
    max_s: float


@dataclass(frozen=True)
class NodeSpeed:
    """A connected node that can run the job: its estimated FLOP/s for the kind, the
    FLOP/s its leases are computed from (measured, or the kind's default), its slots."""

    node_id: int
    flops: float
    lease_flops: float
    slots: int = 1


@dataclass(frozen=True)
class Estimate:
    seconds: float
    nodes: int
    slots: int


def node_flops(measured: float | None, benchmark_gflops: float, share: float) -> float:
    """A node's FLOP/s for a kind: measured if it has been, else from its benchmark."""
    if measured is not None and measured > 0:
        return measured
    return max(0.0, benchmark_gflops) * 1e9 * share


def lease_seconds(cost_flops: float, lease_flops: float, rule: LeaseRule) -> float:
    """The lease of a task of `cost_flops` on a node whose leases divide by `lease_flops`."""
    estimate = max(0.0, cost_flops) / lease_flops * rule.slack
    if not math.isfinite(estimate):
        estimate = rule.max_s
    return min(rule.max_s, max(rule.min_s, estimate))


def fitting_cost(node: NodeSpeed, rule: LeaseRule) -> float:
    """The largest task cost (FLOPs) `node` finishes within the lease it would get.

    A node at least as fast as its leases assume (speed x slack >= lease speed) finishes
    any task up to the longest lease; a slower one only tasks whose lease is the
    shortest (the floor of `min_s` outlasts them), up to `min_s` of its work."""
    if node.flops <= 0:
        return 0.0
    if node.flops * rule.slack >= node.lease_flops:
        return rule.max_s * node.flops
    return rule.min_s * node.flops


def makespan(costs: Sequence[float], nodes: Sequence[NodeSpeed]) -> float:
    """Seconds until the last of `costs` (tasks that may run at once, in queue order) is
    done on `nodes`, as the dispatcher hands them out: each to the slot free first."""
    speeds = [node.flops for node in nodes if node.flops > 0
              for _ in range(max(1, node.slots))]  # fmt: skip
    if not costs:
        return 0.0
    if not speeds:
        return math.inf
    free = [(0.0, index) for index in range(len(speeds))]
    end = 0.0
    for cost in costs:
        at, index = heapq.heappop(free)
        done = at + max(0.0, cost) / speeds[index]
        end = max(end, done)
        heapq.heappush(free, (done, index))
    return end


def estimate(stages: Sequence[Sequence[float]], nodes: Sequence[NodeSpeed]) -> Estimate | None:
    """The job's time on `nodes`: its stages one after another (None: no node)."""
    usable = [node for node in nodes if node.flops > 0]
    if not usable:
        return None
    seconds = sum(makespan(stage, usable) for stage in stages)
    return Estimate(seconds, len(usable), sum(max(1, n.slots) for n in usable))


def shard_limit(nodes: Sequence[NodeSpeed], rule: LeaseRule) -> float | None:
    """The largest shard cost that fits the lease on the median node (None: no node):
    the typical node's, so that one node saying it is slow does not cut every job."""
    fits = sorted(fitting_cost(node, rule) for node in nodes if node.flops > 0)
    return fits[(len(fits) - 1) // 2] if fits else None


def best_fit(nodes: Sequence[NodeSpeed], rule: LeaseRule) -> float | None:
    """The largest task cost that fits the lease on some node (None: no node); a job
    with a shard over REFUSAL_MARGIN times this is refused."""
    fits = [fitting_cost(node, rule) for node in nodes if node.flops > 0]
    return max(fits) if fits else None


def duration(seconds: float) -> str:
    """Seconds in words, to the minute past an hour: '45 s', '12 min', '3 h 20 min'."""
    if not math.isfinite(seconds):
        return "forever"
    if seconds >= 365 * 86400:
        return "over a year"
    seconds = max(0.0, seconds)
    if seconds < 90:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if minutes else f"{hours} h"
