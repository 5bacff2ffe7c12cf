"""A node's daily quota counts exactly the tasks it claimed, however the coordinator dies.

The three claim paths (one task, a batch of a replication-1 job's tasks, a backup copy of
a straggling shard) claim through one core (`store.claims.claim`) that counts the claims
in the node's quota inside the claim's own transaction. Here a coordinator process is
killed (SIGKILL, at the fault point `claim-before-quota`) after its claim and before the
count: neither survives, and the quota and the task table agree after every kill, as
they do after a claim that completes.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
from helpers import SRC
from sqlalchemy import func, select
from store_helpers import T0, _account, _claim, _job, _node

from idlegrid.states import TaskState
from idlegrid.store.schema import node_quota, tasks
from idlegrid.store.sql import SqlStore

# One claim in a process of its own: the path, then the node and the task or shard.
CLAIM = """
import asyncio, sys
from idlegrid.store.base import Claimer
from idlegrid.store.sql import SqlStore

T0 = 1_000_000.0

async def main(url, path, node_id, account_id, target):
    store = SqlStore(url)
    await store.open()
    claimer = Claimer(node_id=node_id, account_id=account_id, network=None, backend="cpu")
    if path == "claim_task":
        found = await store.claims.claim_task(
            target, claimer, kind="sleep", lease_deadline=T0 + 100, distinct=None, now=T0
        )
    elif path == "claim_tasks":
        found = await store.claims.claim_tasks(
            {target: T0 + 100, target + 1: T0 + 100}, claimer, kind="sleep", now=T0
        )
    else:
        found = await store.scheduling.add_backup_task(
            target, node_id, lease_deadline=T0 + 100, now=T0, backend="cpu"
        )
    print(found)
    await store.close()

asyncio.run(main(sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])))
"""


async def _books(store: SqlStore, node_id: int) -> tuple[int, int]:
    """(tasks the node holds, its count in today's quota of sleep on the CPU)."""
    async with store.engine.connect() as conn:
        held = (
            await conn.execute(
                select(func.count()).where(
                    tasks.c.node_id == node_id, tasks.c.state == TaskState.ASSIGNED.value
                )
            )
        ).scalar_one()
        used = (
            await conn.execute(select(node_quota.c.used).where(node_quota.c.node_id == node_id))
        ).scalar()
    return int(held), int(used or 0)


async def _claim_in_a_process(url: str, path: str, *args: int, faults: str = "") -> int:
    env = {**os.environ, "PYTHONPATH": str(SRC), "IDLEGRID_FAULTS": faults}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-c", CLAIM, url, path, *map(str, args), env=env
    )
    return await asyncio.wait_for(process.wait(), timeout=60)


@pytest.mark.parametrize("path", ["claim_task", "claim_tasks", "add_backup_task"])
async def test_a_kill_between_claim_and_quota_leaves_the_books_agreeing(
    tmp_path: Path, path: str
) -> None:
    url = f"sqlite+idlegrid:///{tmp_path / 'store.db'}"
    store = SqlStore(url)
    await store.open()
    try:
        alice = await _account(store)
        holder, node = await _node(store, alice, "holder"), await _node(store, alice, "node")
        _, ready = await store.jobs.create_job(_job(alice, shards=4), now=T0)
        if path == "add_backup_task":
            # Stragglers: each shard held by another node, so the node may get a copy.
            for entry in ready:
                await _claim(store, entry.task_id, holder)
            targets = [ready[0].shard_id, ready[1].shard_id]
        else:
            targets = [ready[0].task_id, ready[2].task_id]
        claimed = 2 if path == "claim_tasks" else 1
        ids = (node.id, node.account_id)

        rc = await _claim_in_a_process(url, path, *ids, targets[0], faults="claim-before-quota")
        assert rc == -signal.SIGKILL
        assert await _books(store, node.id) == (0, 0)  # neither the claim nor its count

        assert await _claim_in_a_process(url, path, *ids, targets[0]) == 0
        assert await _books(store, node.id) == (claimed, claimed)

        rc = await _claim_in_a_process(url, path, *ids, targets[1], faults="claim-before-quota")
        assert rc == -signal.SIGKILL
        assert await _books(store, node.id) == (claimed, claimed)
    finally:
        await store.close()
