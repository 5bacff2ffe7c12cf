"""Leases: how long a task may run on a node, and what happens when one runs out.

A lease is the coordinator's estimate of the shard's run time on the node (from what it
measured of the node, never from what the node says), with slack, clamped to the
minimum.
"""

from __future__ import annotations

from idlegrid.coordinator.hub import NodeSession
from idlegrid.policy import scheduler
from idlegrid.settings import CoordinatorSettings
from idlegrid.store.base import ReadyTask


def lease_for(
    settings: CoordinatorSettings,
    view: scheduler.NodeView,
    kind: str,
    *,
    items: int,
    cost_flops: float,
) -> float:
    """Lease length for a shard of `items` / `cost_flops` (each shard its own) on a node."""
    estimate = scheduler.expected_seconds(view, kind, items=items, cost_flops=cost_flops)
    return max(settings.min_lease_s, estimate * settings.lease_slack)


def lease_seconds(settings: CoordinatorSettings, session: NodeSession, entry: ReadyTask) -> float:
    """Estimated run time of this shard on this node with slack, at least the minimum."""
    return lease_for(
        settings, session.view, entry.kind, items=entry.items, cost_flops=entry.cost_flops
    )
