"""Trust, credit and replication policy: node_trust, credit totals, shard targets.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def _credit_columns() -> list[sa.Column]:  # type: ignore[type-arg]
    return [
        sa.Column("credit_total", sa.Double, nullable=False, server_default="0"),
        sa.Column("credit_decayed", sa.Double, nullable=False, server_default="0"),
        sa.Column("credit_updated_at", sa.Double, nullable=False, server_default="0"),
    ]


def upgrade() -> None:
    op.add_column("accounts", sa.Column("flagged_at", sa.Double, nullable=True))
    op.add_column("accounts", sa.Column("flag_reason", sa.Text, nullable=True))
    for column in _credit_columns():
        op.add_column("accounts", column)
    op.add_column("nodes", sa.Column("network", sa.String(64), nullable=False, server_default=""))
    op.add_column("nodes", sa.Column("suspended_at", sa.Double, nullable=True))
    for column in _credit_columns():
        op.add_column("nodes", column)
    op.create_index("ix_nodes_account_created", "nodes", ["account_id", "created_at"])
    op.create_index("ix_nodes_address_created", "nodes", ["address", "created_at"])
    op.add_column("shards", sa.Column("target", sa.Integer, nullable=False, server_default="1"))
    op.add_column("shards", sa.Column("quorum", sa.Integer, nullable=False, server_default="1"))
    op.add_column("shards", sa.Column("mode", sa.String(16), nullable=True))
    op.execute(
        "UPDATE shards SET target = (SELECT replication FROM jobs WHERE jobs.id = shards.job_id),"
        " quorum = (SELECT min_quorum FROM jobs WHERE jobs.id = shards.job_id)"
    )
    op.add_column("tasks", sa.Column("account_id", sa.Integer, nullable=True))
    op.add_column("tasks", sa.Column("network", sa.String(64), nullable=True))
    op.add_column("tasks", sa.Column("backend", sa.String(20), nullable=True))
    op.add_column(
        "tasks",
        sa.Column("trusted_only", sa.Boolean, nullable=False, server_default=sa.false()),
    )
    op.add_column("tasks", sa.Column("credit", sa.Double, nullable=True))
    op.create_table(
        "node_trust",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id"), primary_key=True),
        sa.Column("kind", sa.String(40), primary_key=True),
        sa.Column("backend", sa.String(20), primary_key=True),
        sa.Column("consecutive_valid", sa.Integer, nullable=False),
        sa.Column("valid_total", sa.Integer, nullable=False),
        sa.Column("invalid_total", sa.Integer, nullable=False),
        sa.Column("error_total", sa.Integer, nullable=False),
        sa.Column("recent_invalid", sa.Integer, nullable=False),
        sa.Column("daily_quota", sa.Integer, nullable=False),
        sa.Column("suspended", sa.Boolean, nullable=False),
        sa.Column("quota_day", sa.Integer, nullable=False),
        sa.Column("quota_used", sa.Integer, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("node_trust")
    with op.batch_alter_table("tasks") as batch:
        for name in ("credit", "trusted_only", "backend", "network", "account_id"):
            batch.drop_column(name)
    with op.batch_alter_table("shards") as batch:
        for name in ("mode", "quorum", "target"):
            batch.drop_column(name)
    op.drop_index("ix_nodes_address_created", "nodes")
    op.drop_index("ix_nodes_account_created", "nodes")
    with op.batch_alter_table("nodes") as batch:
        for name in (
            "credit_updated_at",
            "credit_decayed",
            "credit_total",
            "suspended_at",
            "network",
        ):
            batch.drop_column(name)
    with op.batch_alter_table("accounts") as batch:
        for name in (
            "credit_updated_at",
            "credit_decayed",
            "credit_total",
            "flag_reason",
            "flagged_at",
        ):
            batch.drop_column(name)
