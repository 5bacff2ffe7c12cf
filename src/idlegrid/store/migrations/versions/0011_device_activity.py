"""Each device of a node on its own: what the node last said of each GPU and its CPU
slots (state, why, the tasks on it), beside the node's own state in node_activity.

Revision ID: 0011_device_activity
Revises: 0010_check_tasks
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0011_device_activity"
down_revision = "0010_check_tasks"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_activity") as batch:
        batch.add_column(sa.Column("devices", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("node_activity") as batch:
        batch.drop_column("devices")
