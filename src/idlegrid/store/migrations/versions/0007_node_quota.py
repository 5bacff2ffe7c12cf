"""Daily quota counts in their own table (node_quota), apart from node_trust.

A claim counts against its node's quota and a verdict changes its node's trust; in one
row, each waited for the other's lock until commit. The counts move over as they are.

Revision ID: 0007_node_quota
Revises: 0006_blob_access
Create Date: 2026-12-05
"""

import sqlalchemy as sa
from alembic import op

revision = "0007_node_quota"
down_revision = "0006_blob_access"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_quota",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id"), primary_key=True),
        sa.Column("kind", sa.String(40), primary_key=True),
        sa.Column("backend", sa.String(20), primary_key=True),
        sa.Column("day", sa.Integer, nullable=False),
        sa.Column("used", sa.Integer, nullable=False),
    )
    op.execute(
        "INSERT INTO node_quota (node_id, kind, backend, day, used) "
        "SELECT node_id, kind, backend, quota_day, quota_used FROM node_trust "
        "WHERE quota_used > 0"
    )
    with op.batch_alter_table("node_trust") as batch:
        batch.drop_column("quota_day")
        batch.drop_column("quota_used")


def downgrade() -> None:
    with op.batch_alter_table("node_trust") as batch:
        batch.add_column(sa.Column("quota_day", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("quota_used", sa.Integer, nullable=False, server_default="0"))
    op.execute(
        "UPDATE node_trust SET quota_day = q.day, quota_used = q.used FROM node_quota AS q "
        "WHERE q.node_id = node_trust.node_id AND q.kind = node_trust.kind "
        "AND q.backend = node_trust.backend"
    )
    op.drop_table("node_quota")
