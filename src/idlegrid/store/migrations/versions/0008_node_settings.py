"""Each node's settings as the volunteer set them (node_settings), and what the node last
said of itself (node_activity).

Revision ID: 0008_node_settings
Revises: 0007_node_quota
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0008_node_settings"
down_revision = "0007_node_quota"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "node_settings",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id"), primary_key=True),
        sa.Column("name", sa.String(40), primary_key=True),
        sa.Column("value", sa.JSON, nullable=False),
        sa.Column("source", sa.String(8), nullable=False),
        sa.Column("changed_by", sa.String(100), nullable=False, server_default=""),
        sa.Column("changed_at", sa.Double, nullable=False),
    )
    op.create_table(
        "node_activity",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id"), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False, server_default=""),
        sa.Column("reason", sa.String(300), nullable=False, server_default=""),
        sa.Column("device", sa.String(40), nullable=False, server_default=""),
        sa.Column("settings_error", sa.String(500), nullable=False, server_default=""),
        sa.Column("updated_at", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_activity")
    op.drop_table("node_settings")
