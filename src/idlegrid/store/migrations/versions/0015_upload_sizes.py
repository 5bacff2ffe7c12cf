"""Upload sizes in 64 bits: a blob uploaded in chunks (a model's weights) may pass 2 GiB,
the most a PostgreSQL `integer` holds; SQLite's integers were 64-bit already.

Revision ID: 0015_upload_sizes
Revises: 0014_known_answers
Create Date: 2026-12-07
"""

import sqlalchemy as sa
from alembic import op

revision = "0015_upload_sizes"
down_revision = "0014_known_answers"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        for column in ("size", "received"):
            batch.alter_column(
                column, existing_type=sa.Integer, type_=sa.BigInteger, existing_nullable=False
            )


def downgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        for column in ("size", "received"):
            batch.alter_column(
                column, existing_type=sa.BigInteger, type_=sa.Integer, existing_nullable=False
            )
