"""The llama.cpp build of the node that claimed a task, as the node reported it.

Checks of an llm-generate output go to a node of the build its node reported (same-build
checks are exact), and an output must name that build (`verification.checking`).

Revision ID: 0012_task_build
Revises: 0011_device_activity
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0012_task_build"
down_revision = "0011_device_activity"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("build", sa.String(500), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("build")
