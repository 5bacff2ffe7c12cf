"""Indexes for per-job counts: shards and tasks by job and state.

A job's open shards are counted after every decision, and its shards and completed tasks
for every job status; without these, each count read every shard (or every completed
task) of the whole grid.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02
"""

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index("ix_shards_job_state", "shards", ["job_id", "state"])
    op.create_index("ix_tasks_job_state", "tasks", ["job_id", "state"])


def downgrade() -> None:
    op.drop_index("ix_tasks_job_state", "tasks")
    op.drop_index("ix_shards_job_state", "shards")
