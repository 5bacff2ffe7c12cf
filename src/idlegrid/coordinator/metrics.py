"""Prometheus metrics of one coordinator process, in the plain-text exposition format.

Counters count what this process saw since it started (Prometheus sums them over the
processes); gauges from the store and the broker describe the whole grid.
"""

from __future__ import annotations

from idlegrid.coordinator.context import Context, Counters
from idlegrid.states import JobState, TaskState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
RECEIPTS = ("accepted", "late", "duplicate", "rejected")


class _Exposition:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def metric(self, name: str, kind: str, help_text: str, samples: dict[str, float]) -> None:
        """One metric; `samples` maps a label set ("" for none) to its value."""
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for labels, value in samples.items():
            self.lines.append(f"{name}{labels} {value:g}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _by(label: str, values: dict[str, int], keys: tuple[str, ...]) -> dict[str, float]:
    return {f'{{{label}="{key}"}}': float(values.get(key, 0)) for key in keys}


async def render(ctx: Context) -> str:
    """The metrics page of this process."""
    out = _Exposition()
    await _gauges(ctx, out)
    _counters(ctx.counters, out)
    return out.text()


async def _gauges(ctx: Context, out: _Exposition) -> None:
    """What the grid holds now: nodes, the ready queue, tasks and jobs by state."""
    tasks, jobs = await ctx.store.jobs.state_counts()
    out.metric(
        "idlegrid_connected_nodes",
        "gauge",
        "Nodes connected to this coordinator process.",
        {"": len(ctx.hub)},
    )
    out.metric(
        "idlegrid_grid_connected_nodes",
        "gauge",
        "Nodes connected to any coordinator process of the grid.",
        {"": len(await ctx.broker.connections())},
    )
    out.metric(
        "idlegrid_ready_queue_depth",
        "gauge",
        "Tasks in the broker's ready queue.",
        {"": await ctx.broker.ready_count()},
    )
    out.metric(
        "idlegrid_tasks",
        "gauge",
        "Tasks in the store by state.",
        _by("state", tasks, tuple(s.value for s in TaskState)),
    )
    out.metric(
        "idlegrid_jobs",
        "gauge",
        "Jobs in the store by state.",
        _by("state", jobs, tuple(s.value for s in JobState)),
    )


def _counters(counters: Counters, out: _Exposition) -> None:
    """What this process has counted since it started."""
    out.metric(
        "idlegrid_results_total",
        "counter",
        "Results received by this process, by receipt (rejected: not counted).",
        _by("status", counters.results, RECEIPTS),
    )
    out.metric(
        "idlegrid_results_verified_total",
        "counter",
        "Results the verifier of this process marked valid or invalid.",
        _by("outcome", counters.verified, ("valid", "invalid")),
    )
    out.metric(
        "idlegrid_lease_expiries_total",
        "counter",
        "Task leases this process expired (deadline passed, node silent or lost it).",
        {"": counters.lease_expiries},
    )
    out.metric(
        "idlegrid_backup_tasks_total",
        "counter",
        "Speculative backup copies of straggling shards this process handed out.",
        {"": counters.backups},
    )
