"""Who may read and write which blob: every cell of the matrix.

Callers: the researcher who uploaded a blob (or whose job produced it), another
researcher, an admin, a node that holds a task naming the blob, a node of another account,
and anonymous. Operations: GET, HEAD, PUT, and submitting a job over the blob. A blob one
may not read answers 404, as a missing one does.
"""

from __future__ import annotations

import pytest
from alembic import command
from conftest import Api, bearer, sha
from helpers import NODE_WS, SocketNode
from sqlalchemy import insert
from sqlalchemy.engine import Connection

from idlegrid.kinds.sleep import _digest
from idlegrid.store.base import Assignment, Claimer, NewJob, NewShard
from idlegrid.store.migrate import alembic_config, upgrade
from idlegrid.store.schema import uploads
from idlegrid.store.sql import SqlStore

MISSING = sha(b"a blob nobody uploaded")


def _status(api: Api, method: str, blob_hash: str, token: str | None) -> int:
    headers = bearer(token) if token else {}
    return api.client.request(method, f"/v1/blobs/{blob_hash}", headers=headers).status_code


def _submit_status(api: Api, token: str, blob_hash: str) -> int:
    body = {"kind": "embed-text", "inputs": {"texts": blob_hash}}
    response = api.client.post("/v1/jobs", json=body, headers=bearer(token))
    return response.status_code


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_an_uploaded_blob_is_read_by_its_owner_and_admins_only(api: Api, method: str) -> None:
    alice, bob = api.token(account="alice"), api.token(account="bob")
    stranger_node = api.token(account="carol", kind="node")
    blob = api.upload(b'"a text"\n', token=alice)
    expected = {
        alice: 200,  # the owner
        api.admin_token: 200,  # an admin reads everything
        bob: 404,  # another researcher: as if missing
        stranger_node: 404,  # a node with no task naming it
        "": 401,  # anonymous
    }
    assert {who: _status(api, method, blob, who or None) for who in expected} == expected
    # Missing and forbidden answer alike.
    assert _status(api, method, MISSING, bob) == 404
    assert _status(api, method, MISSING, alice) == 404


def test_a_job_over_a_blob_one_may_not_read_is_404_like_a_missing_one(api: Api) -> None:
    alice, bob = api.token(account="alice"), api.token(account="bob")
    blob = api.upload(b'"a text"\n', token=alice)
    assert _submit_status(api, bob, blob) == 404
    assert _submit_status(api, bob, MISSING) == 404
    assert (
        api.client.post(
            "/v1/jobs", json={"kind": "embed-text", "inputs": {"texts": blob}}, headers=bearer(bob)
        ).json()["error"]
        == "not_found"
    )
    assert _submit_status(api, api.admin_token, blob) == 201
    assert _submit_status(api, alice, blob) == 201
    # Bob shows he has the content by uploading it: then it is his too.
    api.upload(b'"a text"\n', token=bob)
    assert _status(api, "GET", blob, bob) == 200
    assert _submit_status(api, bob, blob) == 201


def test_a_node_reads_what_its_tasks_name_and_writes_only_while_it_holds_one(api: Api) -> None:
    alice, bob = api.token(account="alice"), api.token(account="bob")
    worker = api.token(account="volunteer", kind="node")
    other_worker = api.token(account="other-volunteer", kind="node")
    output = _digest(0)
    # No task held: the node may not upload.
    response = api.client.put(f"/v1/blobs/{sha(output)}", content=output, headers=bearer(worker))
    assert response.status_code == 403
    job = api.submit(alice, kind="sleep", params={"tasks": 1}, replication=1)
    with api.client.websocket_connect(NODE_WS) as ws:
        node = SocketNode(api, ws, worker)
        node.join(key="volunteer-pc")
        assign = node.take()
        payload = assign["input"]["hash"]
        for method in ("GET", "HEAD"):
            assert _status(api, method, payload, worker) == 200  # its task names it
            assert _status(api, method, payload, other_worker) == 404
            assert _status(api, method, payload, bob) == 404
            # A shard's payload is the coordinator's working copy, not a result.
            assert _status(api, method, payload, alice) == 404
            assert _status(api, method, payload, api.admin_token) == 200
        node.result(assign["task_id"], output)  # the upload is allowed: it holds the task
        node.expect("result_ack", status="accepted")
        # Within the grace period after the task ended it still reads its input.
        assert _status(api, "GET", payload, worker) == 200
    result = api.job(alice, job["id"])["result"]
    assert result is not None
    assert {
        who: _status(api, "GET", result, who)
        for who in (alice, bob, worker, other_worker, api.admin_token)
    } == {alice: 200, bob: 404, worker: 404, other_worker: 404, api.admin_token: 200}
    # Another account's node holds nothing: it may not upload.
    response = api.client.put(f"/v1/blobs/{sha(b'x')}", content=b"x", headers=bearer(other_worker))
    assert response.status_code == 403


# -- the store's rules, with time ---------------------------------------------------------


async def _job(store: SqlStore, *, inputs: dict[str, str], payload: str) -> tuple[int, int]:
    owner = await store.accounts.create_account("owner", is_admin=False, now=0.0)
    volunteer = await store.accounts.create_account("volunteer", is_admin=False, now=0.0)
    created = await store.jobs.create_job(
        NewJob(
            account_id=owner.id,
            kind="sleep",
            params={"tasks": 1},
            inputs=inputs,
            replication=1,
            min_quorum=1,
            max_attempts=3,
            priority=0,
            shards=[NewShard(index=0, input_hash=payload, input_size=1, items=1, cost_flops=1)],
        ),
        now=0.0,
    )
    node = await store.nodes.register_node(
        volunteer.id, "volunteer-key", name="pc", worker_version="test", hardware={},
        benchmark={}, kinds=["sleep"], slots=1, address="", now=0.0,
    )  # fmt: skip
    (ready,) = created.ready
    claimer = Claimer(node_id=node.id, account_id=volunteer.id, network="", backend="cpu")
    claimed = await store.claims.claim_task(
        ready.task_id, claimer, kind="sleep", now=0.0, lease_deadline=100.0, distinct=None
    )
    assert isinstance(claimed, Assignment)
    return volunteer.id, node.id


async def test_a_task_names_its_payload_and_its_jobs_inputs_until_the_grace_ends(
    store: SqlStore,
) -> None:
    model, payload, other = sha(b"model"), sha(b"payload"), sha(b"other")
    volunteer, node_id = await _job(store, inputs={"model": model}, payload=payload)
    for blob_hash in (model, payload):
        assert await store.blob_owners.tasks_name(volunteer, blob_hash, since=0.0)
    assert not await store.blob_owners.tasks_name(volunteer, other, since=0.0)
    assert await store.blob_owners.holds_tasks(volunteer, since=0.0)
    # The task's lease ran out at 100 and it was expired: readable until 100 + grace.
    expired = await store.results.expire_overdue(now=150.0)
    assert [task.node_id for task in expired] == [node_id]
    assert await store.blob_owners.tasks_name(volunteer, payload, since=150.0 - 600.0)
    assert await store.blob_owners.holds_tasks(volunteer, since=150.0 - 600.0)
    assert not await store.blob_owners.tasks_name(volunteer, payload, since=101.0)
    assert not await store.blob_owners.holds_tasks(volunteer, since=101.0)


async def test_an_account_owns_what_it_uploaded(store: SqlStore) -> None:
    alice = await store.accounts.create_account("alice", is_admin=False, now=0.0)
    bob = await store.accounts.create_account("bob", is_admin=False, now=0.0)
    blob = sha(b"data")
    await store.blob_owners.add_blob_owner(blob, alice.id, size=4, now=0.0)
    await store.blob_owners.add_blob_owner(blob, alice.id, size=4, now=1.0)  # again: no change
    assert await store.blob_owners.owns_or_produced(alice.id, blob)
    assert not await store.blob_owners.owns_or_produced(bob.id, blob)


async def test_the_migration_gives_existing_blobs_their_owners_and_jobs(store: SqlStore) -> None:
    alice = await store.accounts.create_account("alice", is_admin=False, now=0.0)
    uploaded, named = sha(b"uploaded in the browser"), sha(b"named by a job")
    await store.jobs.create_job(
        NewJob(
            account_id=alice.id, kind="sleep", params={"tasks": 1}, inputs={"texts": named},
            replication=1, min_quorum=1, max_attempts=3, priority=0,
            shards=[NewShard(index=0, input_hash=sha(b"p"), input_size=1, items=1, cost_flops=1)],
        ),
        now=0.0,
    )  # fmt: skip
    async with store.engine.begin() as conn:
        await conn.execute(
            insert(uploads).values(
                account_id=alice.id, name="texts.jsonl", purpose="texts", size=23,
                received=23, state="done", blob_hash=uploaded, created_at=0.0,
            )
        )  # fmt: skip
        # As the database was before: no ownership yet; then the migration runs.
        await conn.run_sync(_downgrade, "0005_dashboard")
        await conn.run_sync(upgrade)
    assert await store.blob_owners.owns_or_produced(alice.id, uploaded)
    assert await store.blob_owners.owns_or_produced(alice.id, named)


def _downgrade(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.downgrade(config, revision)
