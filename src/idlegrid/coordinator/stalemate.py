"""Stalled shards: the I/O around `verification.stalemate`.

A monitor pass reads the open shards whose ready replica nobody holds
(`store.verification.stalled_shards`), asks which registered nodes could still run it
(those that meet its job's requirements, `Fleet.able`, and of those the ones
`verification.stalemate.eligible` lets take a replica), and, where none could, has the
shard decided on the evidence it has or failed (`verification.stalemate.settle`),
recorded as any decision is (`Verifier.record`). A shard that only the operator's
network rule holds back waits (`verification.stalemate.network_bound`). A shard whose
waiting replica is a spot check that no eligible node is trusted enough to take has it
opened to them. A job's status names the shards that wait for nodes that are not
connected, or for a node on another network (`waiting_for`).
"""

from __future__ import annotations

import logging

from idlegrid.coordinator.context import Context
from idlegrid.coordinator.fleet import Fleet
from idlegrid.coordinator.plans import JobPlan, Plans
from idlegrid.coordinator.verifier import Verifier, checked
from idlegrid.store.base import JobRecord, ShardForVerify, StalledShard
from idlegrid.verification import checking, judging, stalemate, trust
from idlegrid.verification.quorum import Decision

log = logging.getLogger(__name__)


class Stalemates:
    """Shards no node can add a result to, settled (see the module)."""

    def __init__(self, ctx: Context, *, fleet: Fleet, plans: Plans, verifier: Verifier) -> None:
        self._ctx = ctx
        self._fleet = fleet
        self._plans = plans
        self._verifier = verifier

    async def settle(self, *, limit: int = 100) -> int:
        """Decide or fail the stalled shards no registered node can help; how many."""
        stalled = await self._ctx.store.verification.stalled_shards(limit=limit)
        decided: list[tuple[ShardForVerify, JobPlan, Decision]] = []
        now = self._ctx.clock()
        for shard in stalled:
            if stalemate.awaits_late(_replicas(shard), now=now):
                continue  # a slow node's result may still come
            nodes, barred = await self.candidates(shard)
            if nodes and shard.checks_only:
                await self._open_checks(shard, nodes)
            if nodes or barred:
                continue
            found = await self._ctx.store.verification.shard_for_verify(shard.shard_id)
            plan = await self._plans.get(shard.job_id)
            if found is None or plan is None or not found.results:
                continue
            decision = self._settle(found, plan, now=now)
            if decision is None:
                continue  # its checker may still earn its record in other shards
            log.info(
                "shard %s: no node can add a result; %s",
                shard.shard_id,
                decision.fail_reason or f"decided, task {decision.canonical} canonical",
            )
            outcome = "stalemate_failed" if decision.fail_reason else "stalemate_decided"
            self._ctx.counters.verified[outcome] += 1
            decided.append((found, plan, decision))
        await self._verifier.record(decided)
        return len(decided)

    async def _open_checks(self, shard: StalledShard, nodes: list[int]) -> None:
        """A spot check that only nodes not trusted yet could take would wait for ever
        (nobody else can earn trust from it): any of those nodes may take it now, as
        once a check disagreed (`store.claims.escalate`)."""
        store = self._ctx.store.verification
        settings = self._ctx.settings.trust
        if any(trust.is_trusted(t, settings) for t in await store.trust_on(nodes, shard.kind)):
            return
        opened = await store.open_checks(shard.shard_id)
        if opened:
            log.info(
                "shard %s: no trusted node can check it; its check is anyone's", shard.shard_id
            )
            self._ctx.counters.alone["checks_opened"] += opened

    def _confirmation_wait(
        self, found: ShardForVerify, votes: list[checking.CheckedVote], *, now: float
    ) -> tuple[list[int], float]:
        """A checked shard whose output waits only for a confirming pass (no node can add
        one): the nodes whose passes it has, and how long it still waits (0: no longer)
        for their records to be established by known-answer checks in other shards."""
        ids = {c.task_id for c in checking.decide(votes).awaiting}
        if not ids:
            return [], 0.0
        latest = max((r.finished_at or 0.0) for r in found.results)
        nodes = [r.node_id for r in found.results if r.task_id in ids]
        return nodes, latest + self._ctx.settings.check_confirm_wait_s - now

    def _settle(self, found: ShardForVerify, plan: JobPlan, *, now: float) -> Decision | None:
        """The stalled shard's decision, or None while it waits for a confirming pass."""
        node_of = {r.task_id: r.node_id for r in found.results}
        if checked(found, plan):  # its own rule decides, and a verdict is never a result
            read = self._verifier.checked_votes(found, plan)
            if self._confirmation_wait(found, read, now=now)[1] > 0:
                return None
            return checking.settle(read, node_of=node_of)
        blobs = self._ctx.blobs
        votes = [judging.Vote(r.task_id, blobs.read(r.output_hash), r.trust) for r in found.results]
        return stalemate.settle(
            votes,
            lambda a, b: plan.kind.compare(a, b, plan.params),
            self._ctx.settings.trust,
            min_quorum=plan.min_quorum,
            node_of=node_of,
        )

    async def candidates(self, shard: StalledShard) -> tuple[list[int], list[int]]:
        """The registered nodes that could still run a replica of `shard` (those that meet
        its job's requirements, as the scheduler's filter reads them, and that the replica
        rules let take it), and where there are none, those that only the operator's
        network rule bars."""
        settings = self._ctx.settings
        plan = await self._plans.get(shard.job_id)
        requirements = plan.requirements if plan is not None else None
        able = [
            stalemate.Member(*node) for node in await self._fleet.able(shard.kind, requirements)
        ]
        rules = {"accounts": settings.distinct_accounts, "networks": settings.distinct_networks}
        replicas = _replicas(shard)
        nodes = stalemate.eligible(able, replicas, **rules)
        return nodes, ([] if nodes else stalemate.network_bound(able, replicas, **rules))

    async def waiting_for(self, job: JobRecord, *, limit: int = 3) -> list[str]:
        """The job's stalled shards whose only eligible nodes are not connected, in words."""
        if job.replication <= 1 or job.state.value not in ("queued", "running"):
            return []
        ctx = self._ctx
        stalled = await ctx.store.verification.stalled_shards(limit=100, job_ids=[job.id])
        connected = await ctx.connected()
        reasons = []
        for shard in stalled:
            nodes, barred = await self.candidates(shard)
            if not nodes and not barred:
                reason = await self._confirmation_reason(shard)
                if reason:
                    reasons.append(reason)
            if nodes and not connected & set(nodes):
                reasons.append(stalemate.waiting_reason(shard.index, nodes))
            elif barred:
                reasons.append(stalemate.network_reason(shard.index, barred))
            if len(reasons) >= limit:
                break
        return reasons

    async def _confirmation_reason(self, shard: StalledShard) -> str:
        """What a stalled checked shard that waits for a confirming pass waits for."""
        found = await self._ctx.store.verification.shard_for_verify(shard.shard_id)
        plan = await self._plans.get(shard.job_id)
        if found is None or plan is None or not found.results or not checked(found, plan):
            return ""
        votes = self._verifier.checked_votes(found, plan)
        nodes, left = self._confirmation_wait(found, votes, now=self._ctx.clock())
        return checking.confirmation_reason(shard.index, nodes, left) if nodes else ""

    async def build_waits(self, job: JobRecord, *, limit: int = 3) -> list[str]:
        """The job's outputs whose check waits for a node of the build they name while
        no connected node runs it (kinds whose outputs name builds), in words."""
        plan = await self._plans.get(job.id)
        if plan is None or not plan.kind.names_builds:
            return []
        if job.state.value not in ("queued", "running"):
            return []
        ctx = self._ctx
        wait_s = ctx.settings.check_build_wait_s
        now = ctx.clock()
        waits = await ctx.store.verification.build_waits(job.id, since=now - wait_s, limit=50)
        if not waits:
            return []
        builds = await self._connected_builds()
        reasons = []
        for wait in waits:
            if any(b == wait.build for n, b in builds.items() if n != wait.node_id):
                continue
            left = wait.since + wait_s - now
            reasons.append(
                checking.build_wait_reason(wait.shard_index, wait.node_id, wait.build, left)
            )
            if len(reasons) >= limit:
                break
        return reasons

    async def _connected_builds(self) -> dict[int, str]:
        """The build each connected node reported: this process's sessions, and for the
        nodes connected to other processes the profile they registered."""
        ctx = self._ctx
        builds = {s.node_id: s.llama_build for s in ctx.hub.sessions()}
        elsewhere = set(await ctx.broker.connections()) - set(builds)
        if elsewhere:
            for node in await self._fleet.nodes():
                if node.record.id in elsewhere:
                    llama = (node.record.hardware or {}).get("llama") or {}
                    builds[node.record.id] = str(llama.get("build") or "")
        return builds


def _replicas(shard: StalledShard) -> list[stalemate.Replica]:
    return [
        stalemate.Replica(
            stalemate.Member(r.node_id, r.account_id, r.network), r.ran, r.late_until, r.bars
        )
        for r in shard.replicas
    ]
