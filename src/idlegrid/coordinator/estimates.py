"""A job sized against the fleet connected now: the I/O around `policy.sizing`.

At submission (`Intake.submit_job`): the connected nodes that can run the job and their
speeds; shards cut to fit the leases those nodes would get, or the job refused with the
reason; a warning with the estimate when the job would take longer than
`estimate_warning_s`. In a job's single view (`GET /v1/jobs/{id}`, `idlegrid job N`):
the time its remaining work takes on the nodes connected now.

A node's speed is what this process measured of it for the kind (its leases' figure),
else its benchmark's matmul GFLOPS times the kind's `benchmark_share`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from idlegrid.coordinator.context import Context
from idlegrid.coordinator.fleet import Fleet
from idlegrid.coordinator.leases import default_speed, lease_rule
from idlegrid.kinds import KindParams, ShardSpec, TaskKind, get_kind
from idlegrid.kinds.base import InputError
from idlegrid.policy import sizing
from idlegrid.store.base import JobRecord


class TooLong(InputError):
    """A shard no connected node finishes within the lease it would get."""


@dataclass(frozen=True)
class Sized:
    """A job's settings and shards after sizing, and what the researcher is told."""

    params: KindParams
    specs: list[ShardSpec]
    notes: list[str]


class Estimates:
    def __init__(self, ctx: Context, fleet: Fleet) -> None:
        self._ctx = ctx
        self._fleet = fleet

    async def speeds(self, kind: TaskKind, params: KindParams) -> list[sizing.NodeSpeed]:
        """The connected, unsuspended nodes that can run the job, with their speeds."""
        connected = await self._ctx.connected()
        able = {row[0] for row in await self._fleet.able(kind.name, kind.requirements(params))}
        fallback = default_speed(kind.name)
        speeds = []
        for node in await self._fleet.nodes():
            if node.record.id not in able or node.record.id not in connected or node.view is None:
                continue
            session = self._ctx.hub.get(node.record.id)
            measured = None if session is None else session.measured_flops.get(kind.name)
            flops = sizing.node_flops(measured, node.view.gflops, kind.benchmark_share)
            lease_flops = measured if measured else fallback
            slots = session.slots if session is not None else node.record.slots
            speeds.append(sizing.NodeSpeed(node.record.id, flops, lease_flops, max(1, slots)))
        return speeds

    def fit(
        self,
        kind: TaskKind,
        params: KindParams,
        specs: list[ShardSpec],
        speeds: Sequence[sizing.NodeSpeed],
        resplit: Callable[[KindParams], list[ShardSpec]],
    ) -> Sized:
        """Shards that the median connected node finishes within its lease, cut smaller
        where the kind can; TooLong when even the fastest node cannot finish one."""
        rule = lease_rule(self._ctx.settings)
        limit = sizing.shard_limit(speeds, rule)
        if limit is None or all(spec.cost_flops <= limit for spec in specs):
            return Sized(params, specs, [])
        notes = []
        cut = kind.cut(params, limit)
        if cut is not None:
            before = len(specs)
            specs = resplit(cut)
            notes.append(
                f"shards cut to fit their leases: {before} became {len(specs)}, each one the "
                "median connected node that can run it finishes within the lease it would get"
            )
            params = cut
        best = sizing.best_fit(speeds, rule) or 0.0
        for spec in specs:
            if spec.cost_flops > best * sizing.REFUSAL_MARGIN:
                raise TooLong(_too_long(kind, params, spec, speeds, rule))
        return Sized(params, specs, notes)

    def warnings(self, estimate: sizing.Estimate | None) -> list[str]:
        """The estimate in words when it is over the coordinator's threshold."""
        if estimate is None or estimate.seconds <= self._ctx.settings.estimate_warning_s:
            return []
        return [
            f"estimated time: about {sizing.duration(estimate.seconds)} on the "
            f"{estimate.nodes} connected node(s) that can run it ({estimate.slots} slot(s); "
            "from their benchmarks and measured speeds); more nodes, or a smaller job, "
            "make it shorter"
        ]

    async def remaining(self, job: JobRecord) -> sizing.Estimate | None:
        """The time the job's work not yet done takes on the nodes connected now."""
        if job.state.value not in ("queued", "running"):
            return None
        kind = get_kind(job.kind)
        params = kind.parse_params(job.params)
        speeds = await self.speeds(kind, params)
        progress: dict[int, float] = {}
        for session in self._ctx.hub.sessions():
            progress.update(session.progress)
        shards = await self._ctx.store.jobs.list_shards(job.id)
        if kind.rounds is not None:
            closed = sum(1 for r in await self._ctx.store.rounds.training_rounds(job.id)
                         if r.state.value == "closed")  # fmt: skip
            stages = kind.work_stages(params, [], job.replication)[closed:]
        else:
            left = [s.cost_flops * (1.0 - progress.get(s.id, 0.0)) for s in shards
                    if s.state.value != "done"]  # fmt: skip
            stages = kind.work_stages(params, left, job.replication)
        return sizing.estimate(stages, speeds)


def _too_long(
    kind: TaskKind,
    params: KindParams,
    spec: ShardSpec,
    speeds: Sequence[sizing.NodeSpeed],
    rule: sizing.LeaseRule,
) -> str:
    fastest = max(speeds, key=lambda s: s.flops)
    needs = spec.cost_flops / fastest.flops
    lease = sizing.lease_seconds(spec.cost_flops, fastest.lease_flops, rule)
    shard, fix = kind.describe_shard(spec, params)
    return (
        f"{shard} needs about {sizing.duration(needs)} on the fastest connected node that "
        f"can run it, and the lease that node would get is {sizing.duration(lease)}: it "
        f"would be handed to another node before it ends; {fix} (or an operator raises "
        "min_lease_s)"
    )
