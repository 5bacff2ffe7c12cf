"""Each start of a coordinator process, with its restart grace (coordinator_starts).

A valid result that came after its shard was decided is paid when a coordinator start
made it late (`verification.credit.late_result_paid`): the verifier reads the starts
during its lease.

Revision ID: 0009_coordinator_starts
Revises: 0008_node_settings
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0009_coordinator_starts"
down_revision = "0008_node_settings"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "coordinator_starts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("process_id", sa.String(120), nullable=False),
        sa.Column("started_at", sa.Double, nullable=False),
        sa.Column("grace_s", sa.Double, nullable=False),
    )
    op.create_index("ix_coordinator_starts_started", "coordinator_starts", ["started_at"])


def downgrade() -> None:
    op.drop_index("ix_coordinator_starts_started", "coordinator_starts")
    op.drop_table("coordinator_starts")
