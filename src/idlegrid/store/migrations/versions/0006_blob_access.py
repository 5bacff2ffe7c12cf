"""Who may read which blob: the accounts that uploaded it, and the blobs each job names.

Revision ID: 0006_blob_access
Revises: 0005_dashboard
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0006_blob_access"
down_revision = "0005_dashboard"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "blob_owners",
        sa.Column("blob_hash", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    op.create_index("ix_blob_owners_account", "blob_owners", ["account_id"])
    op.create_table(
        "job_blobs",
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), primary_key=True),
        sa.Column("blob_hash", sa.String(64), primary_key=True),
    )
    op.create_index("ix_job_blobs_hash", "job_blobs", ["blob_hash"])
    op.create_index("ix_shards_input_hash", "shards", ["input_hash"])
    op.create_index("ix_tasks_account_state", "tasks", ["account_id", "state"])
    _backfill()


def _backfill() -> None:
    """Blobs that existed before: uploads finished in the browser belong to their
    uploader; jobs name their inputs and their rounds' weights."""
    op.execute(
        "INSERT INTO blob_owners (blob_hash, account_id, size, created_at) "
        "SELECT blob_hash, account_id, MAX(size), MIN(created_at) FROM uploads "
        "WHERE state = 'done' AND blob_hash IS NOT NULL GROUP BY blob_hash, account_id"
    )
    bind = op.get_bind()
    jobs = sa.table("jobs", sa.column("id", sa.Integer), sa.column("inputs", sa.JSON))
    named = {
        (row.id, blob_hash)
        for row in bind.execute(sa.select(jobs.c.id, jobs.c.inputs))
        for blob_hash in (row.inputs or {}).values()
        if isinstance(blob_hash, str)
    }
    rounds = sa.text("SELECT job_id, checkpoint_hash, update_hash FROM training_rounds")
    for job_id, checkpoint_hash, update_hash in bind.execute(rounds):
        named |= {(job_id, h) for h in (checkpoint_hash, update_hash) if h}
    if named:
        table = sa.table("job_blobs", sa.column("job_id"), sa.column("blob_hash"))
        op.bulk_insert(table, [{"job_id": j, "blob_hash": h} for j, h in sorted(named)])


def downgrade() -> None:
    op.drop_index("ix_tasks_account_state", "tasks")
    op.drop_index("ix_shards_input_hash", "shards")
    op.drop_index("ix_job_blobs_hash", "job_blobs")
    op.drop_table("job_blobs")
    op.drop_index("ix_blob_owners_account", "blob_owners")
    op.drop_table("blob_owners")
