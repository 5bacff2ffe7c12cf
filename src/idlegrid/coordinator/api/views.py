"""Jobs, shards and nodes as the API shows them; the dashboard shows the same figures."""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from idlegrid.coordinator.api.common import BlobHash
from idlegrid.coordinator.grid import Grid
from idlegrid.policy.sizing import Estimate
from idlegrid.store.base import (
    JobRecord,
    NodeRecord,
    ShardRecord,
)
from idlegrid.verification.credit import CreditTotals, recent_average


class ShardOut(BaseModel):
    index: int
    state: str
    items: int
    attempts: int
    live_tasks: int
    progress: float
    error: str | None = Field(
        default=None, description="why the shard failed (None unless it failed)"
    )


class EstimateOut(BaseModel):
    seconds: float = Field(description="the job's remaining work on the nodes connected now")
    nodes: int = Field(description="connected nodes that can run it")
    slots: int = Field(description="their task slots")


class JobOut(BaseModel):
    id: int
    kind: str
    state: str
    params: dict[str, Any]
    inputs: dict[str, BlobHash]
    replication: int
    priority: int
    shards_total: int
    shards_done: int
    items_total: int
    progress: float
    shard_counts: dict[str, int]
    tasks_completed: int
    max_total_results: int
    effective_replication: float | None = Field(
        description="tasks run per shard done (adaptive replication lowers it)"
    )
    waiting_for: list[str] = Field(
        default_factory=list,
        description="why the job cannot progress: no node can run it, or too few to "
        "hold its replicas (single-job view and submission only)",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="at submission: what will keep the job waiting, with the fix",
    )
    estimate: EstimateOut | None = Field(
        default=None,
        description="how long its remaining work takes on the connected nodes that can run "
        "it, from their measured speeds or benchmarks (submission, and the single-job view "
        "with its shards; None: it ended, or no connected node can run it)",
    )
    doubts: list[str] = Field(
        default_factory=list,
        description="shards of an ended job whose result rested on one check by a node "
        "caught lying since (kinds verified by checks): run them again to be sure "
        "(single-job view only)",
    )
    result: BlobHash | None
    result_size: int | None
    error: str | None
    created_at: float
    started_at: float | None
    finished_at: float | None
    shards: list[ShardOut] | None = None


class NodeOut(BaseModel):
    id: int
    name: str
    state: str
    online: bool
    slots: int
    kinds: list[str]
    hardware: dict[str, Any]
    benchmark: dict[str, Any]
    worker_version: str
    uptime_s: float
    last_seen_at: float
    credit_total: float
    recent_average_credit: float
    suspended: bool
    # What the node's idle policy said last ("paused: user active 12 s ago"); "" when it
    # is not connected.
    activity: str = ""


async def job_out(grid: Grid, job: JobRecord, *, with_shards: bool) -> JobOut:
    shard_list = None
    waiting_for: list[str] = []
    doubts: list[str] = []
    if with_shards:
        progress = grid.task_progress()
        shard_list = [shard_out(s, progress) for s in await grid.store.jobs.list_shards(job.id)]
        waiting_for = await grid.waiting_for(job)
        doubts = await grid.doubts(job)
    done = job.shard_counts.get("done", 0)
    return JobOut(
        id=job.id,
        kind=job.kind,
        state=job.state.value,
        params=job.params,
        inputs=job.inputs,
        replication=job.replication,
        priority=job.priority,
        shards_total=job.shards_total,
        shards_done=done,
        items_total=job.items_total,
        progress=done / job.shards_total if job.shards_total else 1.0,
        shard_counts=job.shard_counts,
        tasks_completed=job.tasks_run,
        max_total_results=job.max_attempts,
        effective_replication=round(job.tasks_run / done, 3) if done else None,
        result=job.result_hash,
        result_size=job.result_size,
        error=job.error,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        shards=shard_list,
        waiting_for=waiting_for,
        doubts=doubts,
    )


def shard_out(shard: ShardRecord, progress: dict[int, float]) -> ShardOut:
    fraction = 1.0 if shard.state.value == "done" else 0.0
    return ShardOut(
        index=shard.index,
        state=shard.state.value,
        items=shard.items,
        attempts=shard.attempts,
        live_tasks=shard.live_tasks,
        progress=fraction if fraction else progress.get(shard.id, 0.0),
        error=shard.error,
    )


def credit_out(totals: CreditTotals, now: float) -> dict[str, float]:
    """Credit for validated work: all time, and the recent average per day (RAC)."""
    return {
        "credit_total": totals.total,
        "recent_average_credit": recent_average(totals, now=now),
    }


def node_out(node: NodeRecord, *, online: bool, now: float, activity: str = "") -> NodeOut:
    return NodeOut(
        id=node.id,
        name=node.name,
        state=node.state.value,
        online=online,
        slots=node.slots,
        kinds=node.kinds,
        hardware=node.hardware,
        benchmark=node.benchmark,
        worker_version=node.worker_version,
        uptime_s=node.connected_seconds,
        last_seen_at=node.last_seen_at,
        suspended=node.suspended_at is not None,
        activity=activity,
        **credit_out(node.credit, now),
    )


def estimate_out(estimate: Estimate | None) -> EstimateOut | None:
    if estimate is None or not math.isfinite(estimate.seconds):
        return None
    return EstimateOut(seconds=round(estimate.seconds, 1), nodes=estimate.nodes,
                       slots=estimate.slots)  # fmt: skip
