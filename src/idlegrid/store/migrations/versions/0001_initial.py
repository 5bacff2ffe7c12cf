"""Initial tables: accounts, tokens, nodes, jobs, shards, tasks.

Revision ID: 0001
Revises:
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "accounts",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("is_admin", sa.Boolean, nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("kind", sa.String(10), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("label", sa.String(100), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("revoked_at", sa.Double, nullable=True),
    )
    op.create_table(
        "nodes",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("node_key", sa.String(64), nullable=False, unique=True),
        sa.Column("name", sa.String(100), nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("worker_version", sa.String(50), nullable=False),
        sa.Column("hardware", sa.JSON, nullable=False),
        sa.Column("benchmark", sa.JSON, nullable=False),
        sa.Column("kinds", sa.JSON, nullable=False),
        sa.Column("slots", sa.Integer, nullable=False),
        sa.Column("address", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("last_seen_at", sa.Double, nullable=False),
        sa.Column("connected_seconds", sa.Double, nullable=False),
    )
    op.create_table(
        "jobs",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("params", sa.JSON, nullable=False),
        sa.Column("inputs", sa.JSON, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("replication", sa.Integer, nullable=False),
        sa.Column("min_quorum", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("shards_total", sa.Integer, nullable=False),
        sa.Column("items_total", sa.Integer, nullable=False),
        sa.Column("result_hash", sa.String(64), nullable=True),
        sa.Column("result_size", sa.Integer, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("started_at", sa.Double, nullable=True),
        sa.Column("finished_at", sa.Double, nullable=True),
    )
    op.create_index("ix_jobs_account", "jobs", ["account_id", "id"])
    op.create_index("ix_jobs_state", "jobs", ["state"])
    op.create_table(
        "shards",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("idx", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("input_hash", sa.String(64), nullable=False),
        sa.Column("input_size", sa.Integer, nullable=False),
        sa.Column("item_count", sa.Integer, nullable=False),
        sa.Column("cost_flops", sa.Double, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("canonical_task_id", sa.Integer, nullable=True),
        sa.Column("output_hash", sa.String(64), nullable=True),
        sa.Column("output_size", sa.Integer, nullable=True),
        sa.Column("error", sa.Text, nullable=True),
        sa.Column("finished_at", sa.Double, nullable=True),
        sa.UniqueConstraint("job_id", "idx", name="uq_shards_job_idx"),
    )
    op.create_index("ix_shards_state", "shards", ["state"])
    op.create_table(
        "tasks",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("shard_id", sa.Integer, sa.ForeignKey("shards.id"), nullable=False),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id"), nullable=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("outcome", sa.String(16), nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("assigned_at", sa.Double, nullable=True),
        sa.Column("lease_deadline", sa.Double, nullable=True),
        sa.Column("finished_at", sa.Double, nullable=True),
        sa.Column("output_hash", sa.String(64), nullable=True),
        sa.Column("output_size", sa.Integer, nullable=True),
        sa.Column("elapsed_s", sa.Double, nullable=True),
        sa.Column("failure_reason", sa.Text, nullable=True),
    )
    op.create_index("ix_tasks_state_lease", "tasks", ["state", "lease_deadline"])
    op.create_index("ix_tasks_shard", "tasks", ["shard_id"])
    op.create_index("ix_tasks_node_state", "tasks", ["node_id", "state"])


def downgrade() -> None:
    for table in ("tasks", "shards", "jobs", "nodes", "tokens", "accounts"):
        op.drop_table(table)
