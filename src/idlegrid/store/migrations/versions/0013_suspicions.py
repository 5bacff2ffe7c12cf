"""Suspicions settled: a suspected result is marked, and its node's streak is held.

A spot check that disagrees with a result a node ran alone makes the node a suspect: its
streak counts again from 0 until the quorum says who lied. The streak it had is held
(`node_trust.held_streak`) and given back when every suspected result of it is found
valid (`node_trust.suspicions`, `tasks.suspected`), so a colluder's lying check costs an
honest node nothing.

Revision ID: 0013_suspicions
Revises: 0012_task_build
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0013_suspicions"
down_revision = "0012_task_build"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_trust") as batch:
        batch.add_column(sa.Column("suspicions", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("held_streak", sa.Integer, nullable=False, server_default="0"))
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(
            sa.Column("suspected", sa.Boolean, nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("suspected")
    with op.batch_alter_table("node_trust") as batch:
        batch.drop_column("held_streak")
        batch.drop_column("suspicions")
