"""Known-answer checks: a check task whose claim has a planted defect, and each node's
record of them.

A checker is a volunteer too: the coordinator sends some checks whose right verdict it
knows (`tasks.known_answer`), and counts those a node answered right since its last lie
(`node_trust.probes_passed`): a checker whose record is established may make an output
canonical on its own pass; any other needs a second (`verification.checking`).

Revision ID: 0014_known_answers
Revises: 0013_suspicions
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0014_known_answers"
down_revision = "0013_suspicions"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("node_trust") as batch:
        batch.add_column(sa.Column("probes_passed", sa.Integer, nullable=False, server_default="0"))
    with op.batch_alter_table("tasks") as batch:
        batch.add_column(sa.Column("known_answer", sa.String(8), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("tasks") as batch:
        batch.drop_column("known_answer")
    with op.batch_alter_table("node_trust") as batch:
        batch.drop_column("probes_passed")
