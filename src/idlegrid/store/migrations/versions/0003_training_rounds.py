"""Training rounds: one row per round of a `diloco-train` job.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "training_rounds",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("job_id", sa.Integer, sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("round", sa.Integer, nullable=False),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("final", sa.Boolean, nullable=False),
        sa.Column("weights_digest", sa.String(64), nullable=False),
        sa.Column("checkpoint_hash", sa.String(64), nullable=False),
        sa.Column("momentum_hash", sa.String(64), nullable=False),
        sa.Column("update_hash", sa.String(64), nullable=True),
        sa.Column("first_shard", sa.Integer, nullable=False),
        sa.Column("train_shards", sa.Integer, nullable=False),
        sa.Column("eval_shard", sa.Integer, nullable=True),
        sa.Column("opened_at", sa.Double, nullable=False),
        sa.Column("deadline", sa.Double, nullable=False),
        sa.Column("closed_at", sa.Double, nullable=True),
        sa.Column("metrics", sa.JSON, nullable=False),
        sa.UniqueConstraint("job_id", "round", name="uq_training_rounds_job_round"),
    )
    op.create_index("ix_training_rounds_due", "training_rounds", ["state", "deadline"])


def downgrade() -> None:
    op.drop_index("ix_training_rounds_due", table_name="training_rounds")
    op.drop_table("training_rounds")
