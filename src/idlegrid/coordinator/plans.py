"""Job plans: what this process keeps in memory of a job to dispatch and verify it.

A plan is read from the store once per process (the job's kind, its parsed params, its
requirements) and kept until the job ends here or in another process (`job_ended`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from idlegrid.kinds import KindParams, Requirements, TaskKind, get_kind
from idlegrid.store import Store


@dataclass(frozen=True)
class JobPlan:
    """What the coordinator keeps in memory about a job to dispatch and verify it."""

    kind: TaskKind
    params: KindParams
    requirements: Requirements
    replication: int
    min_quorum: int
    account_id: int = 0
    # The job's input blobs (shared by all its shards): what locality looks for.
    inputs: frozenset[str] = frozenset()


class Plans:
    """Plans by job id, loaded on first use.

    `on_new_plan` runs after a plan was loaded: a new job may belong to an account that
    did not exist when the shares were configured (see `matching.Shares`).
    """

    def __init__(self, store: Store, *, on_new_plan: Callable[[], Awaitable[None]]) -> None:
        self._store = store
        self._on_new_plan = on_new_plan
        self._plans: dict[int, JobPlan] = {}

    async def get(self, job_id: int) -> JobPlan | None:
        """The job's plan; None if there is no such job."""
        plan = self._plans.get(job_id)
        if plan is None:
            job = await self._store.jobs.get_job(job_id)
            if job is None:
                return None
            kind = get_kind(job.kind)
            params = kind.parse_params(job.params)
            plan = JobPlan(
                kind=kind,
                params=params,
                requirements=kind.requirements(params),
                replication=job.replication,
                min_quorum=job.min_quorum,
                account_id=job.account_id,
                inputs=frozenset(job.inputs.values()),
            )
            self._plans[job_id] = plan
            await self._on_new_plan()
        return plan

    def loaded(self, job_id: int) -> JobPlan:
        """The plan of a job that `get` loaded a moment ago (KeyError if it did not)."""
        return self._plans[job_id]

    def forget(self, job_id: int) -> None:
        self._plans.pop(job_id, None)
