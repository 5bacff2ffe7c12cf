"""The `store.blob_uploads` role on SQLite and PostgreSQL: chunked uploads of blobs past
2 GiB, found again by their hash, and the migration that made their sizes 64-bit."""

from __future__ import annotations

import hashlib

from alembic import command
from sqlalchemy import select
from sqlalchemy.engine import Connection

from idlegrid.store.migrate import alembic_config, upgrade
from idlegrid.store.schema import uploads
from idlegrid.store.sql import SqlStore

GIB = 1024**3


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


async def test_an_upload_past_2_gib_counts_its_chunks_and_is_found_by_its_hash(
    store: SqlStore,
) -> None:
    alice = await store.accounts.create_account("alice", is_admin=False, now=0.0)
    bob = await store.accounts.create_account("bob", is_admin=False, now=0.0)
    model = sha(b"a large model")
    upload = await store.blob_uploads.start(
        alice.id, blob_hash=model, size=3 * GIB, name="model.safetensors", now=10.0
    )
    assert await store.blob_uploads.advance(upload.id, alice.id, offset=0, length=2 * GIB + 5)
    assert not await store.blob_uploads.advance(upload.id, alice.id, offset=0, length=5)
    assert not await store.blob_uploads.advance(upload.id, alice.id, offset=2 * GIB + 5, length=GIB)
    found = await store.blob_uploads.arriving(alice.id, model)
    assert found is not None and found.id == upload.id and found.received == 2 * GIB + 5
    assert await store.blob_uploads.arriving(bob.id, model) is None  # another's
    assert await store.blob_uploads.get(upload.id, bob.id) is None
    assert await store.blob_uploads.arriving_bytes(alice.id) == 3 * GIB
    assert await store.blob_uploads.sweep(alice.id, before=10.0) == []  # not older
    assert await store.blob_uploads.sweep(alice.id, before=11.0) == [upload.id]
    assert await store.blob_uploads.arriving_bytes(alice.id) == 0


async def test_the_migration_keeps_uploads_and_widens_their_sizes(store: SqlStore) -> None:
    alice = await store.accounts.create_account("alice", is_admin=False, now=0.0)
    async with store.engine.begin() as conn:
        await conn.execute(
            uploads.insert().values(
                account_id=alice.id, name="texts.jsonl", purpose="texts", size=23,
                received=23, state="done", blob_hash=sha(b"texts"), created_at=0.0,
            )
        )  # fmt: skip
        await conn.run_sync(_downgrade, "0014_known_answers")
        await conn.run_sync(upgrade)
        rows = (await conn.execute(select(uploads.c.name, uploads.c.size))).all()
    assert [tuple(row) for row in rows] == [("texts.jsonl", 23)]
    upload = await store.blob_uploads.start(
        alice.id, blob_hash=sha(b"model"), size=5 * GIB, name="model", now=1.0
    )
    assert (await store.blob_uploads.get(upload.id, alice.id)).size == 5 * GIB  # type: ignore[union-attr]


def _downgrade(connection: Connection, revision: str) -> None:
    config = alembic_config()
    config.attributes["connection"] = connection
    command.downgrade(config, revision)
