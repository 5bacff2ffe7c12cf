"""Check tasks: a task may check another task's output instead of making one.

Kinds verified by a check (llm-generate) hand a shard's claimed output to a check task
on another node; `tasks.checks_hash` names that output (and lets the checking node read it).

Revision ID: 0010_check_tasks
Revises: 0009_coordinator_starts
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_check_tasks"
down_revision = "0009_coordinator_starts"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("checks_hash", sa.String(64), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("checks_hash")
