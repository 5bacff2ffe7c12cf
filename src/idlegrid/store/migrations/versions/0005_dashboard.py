"""Web dashboard: passwords and roles, sessions, teams, uploads, validated-work aggregates.

Revision ID: 0005_dashboard
Revises: 0004
Create Date: 2026-12-03
"""

import math

import sqlalchemy as sa
from alembic import op

revision = "0005_dashboard"
down_revision = "0004"
branch_labels = None
depends_on = None

NO_RANK = -1e18
WEEK_S = 7 * 86_400.0


def _rank_columns() -> list[sa.Column]:  # type: ignore[type-arg]
    return [
        sa.Column("credit_rank", sa.Double, nullable=False, server_default=str(NO_RANK)),
        sa.Column("validated_total", sa.Integer, nullable=False, server_default="0"),
    ]


def _credit_columns() -> list[sa.Column]:  # type: ignore[type-arg]
    return [
        sa.Column("credit_total", sa.Double, nullable=False, server_default="0"),
        sa.Column("credit_decayed", sa.Double, nullable=False, server_default="0"),
        sa.Column("credit_updated_at", sa.Double, nullable=False, server_default="0"),
        *_rank_columns(),
    ]


def upgrade() -> None:
    for table in ("accounts", "nodes"):
        for column in _rank_columns():
            op.add_column(table, column)
    op.add_column("accounts", sa.Column("email", sa.String(254), nullable=True))
    op.add_column("accounts", sa.Column("password_hash", sa.Text, nullable=True))
    op.add_column(
        "accounts",
        sa.Column("role", sa.String(16), nullable=False, server_default="researcher"),
    )
    op.add_column("accounts", sa.Column("disabled_at", sa.Double, nullable=True))
    op.add_column("accounts", sa.Column("team_id", sa.Integer, nullable=True))
    op.create_index("ux_accounts_email", "accounts", ["email"], unique=True)
    op.create_index("ix_accounts_credit_total", "accounts", ["credit_total"])
    op.create_index("ix_accounts_credit_rank", "accounts", ["credit_rank"])
    op.create_index("ix_accounts_team_credit", "accounts", ["team_id", "credit_total"])
    op.create_index("ix_nodes_credit_total", "nodes", ["credit_total"])
    op.create_index("ix_nodes_credit_rank", "nodes", ["credit_rank"])
    op.create_table(
        "teams",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("name", sa.String(100), nullable=False, unique=True),
        sa.Column("description", sa.Text, nullable=False, server_default=""),
        sa.Column("founder_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("members", sa.Integer, nullable=False, server_default="0"),
        sa.Column("created_at", sa.Double, nullable=False),
        *_credit_columns(),
    )
    op.create_index("ix_teams_credit_total", "teams", ["credit_total"])
    op.create_index("ix_teams_credit_rank", "teams", ["credit_rank"])
    op.create_table(
        "web_sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("csrf", sa.String(64), nullable=False),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("expires_at", sa.Double, nullable=False),
    )
    op.create_index("ix_web_sessions_account", "web_sessions", ["account_id"])
    op.create_table(
        "uploads",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("name", sa.String(200), nullable=False),
        sa.Column("purpose", sa.String(16), nullable=False),
        sa.Column("size", sa.Integer, nullable=False),
        sa.Column("received", sa.Integer, nullable=False, server_default="0"),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("blob_hash", sa.String(64), nullable=True),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("finished_at", sa.Double, nullable=True),
    )
    op.create_index("ix_uploads_account", "uploads", ["account_id", "id"])
    op.create_table(
        "grid_hourly",
        sa.Column("hour", sa.Integer, primary_key=True),
        sa.Column("validated", sa.Integer, nullable=False, server_default="0"),
        sa.Column("flops", sa.Double, nullable=False, server_default="0"),
        sa.Column("credit", sa.Double, nullable=False, server_default="0"),
    )
    op.create_table(
        "node_daily",
        sa.Column("node_id", sa.Integer, sa.ForeignKey("nodes.id"), primary_key=True),
        sa.Column("day", sa.Integer, primary_key=True),
        sa.Column("validated", sa.Integer, nullable=False, server_default="0"),
        sa.Column("flops", sa.Double, nullable=False, server_default="0"),
        sa.Column("credit", sa.Double, nullable=False, server_default="0"),
    )
    _backfill()


def _backfill() -> None:
    """Admins get the admin role; credit earned before this migration gets its rank and
    validated counts (one pass over credited tasks, once)."""
    bind = op.get_bind()
    bind.execute(sa.text("UPDATE accounts SET role = 'admin' WHERE is_admin"))
    for table, column in (("nodes", "node_id"), ("accounts", "account_id")):
        bind.execute(
            sa.text(
                f"UPDATE {table} SET validated_total = (SELECT count(*) FROM tasks"
                f" WHERE tasks.{column} = {table}.id AND tasks.credit IS NOT NULL)"
            )
        )
        rows = bind.execute(
            sa.text(
                f"SELECT id, credit_decayed, credit_updated_at FROM {table}"
                " WHERE credit_decayed > 0"
            )
        ).all()
        for row in rows:
            rank = math.log(row.credit_decayed) + row.credit_updated_at * math.log(2) / WEEK_S
            bind.execute(
                sa.text(f"UPDATE {table} SET credit_rank = :rank WHERE id = :id"),
                {"rank": rank, "id": row.id},
            )


def downgrade() -> None:
    for name in ("node_daily", "grid_hourly", "uploads", "web_sessions", "teams"):
        op.drop_table(name)
    for index in ("ix_nodes_credit_rank", "ix_nodes_credit_total"):
        op.drop_index(index, "nodes")
    for index in (
        "ix_accounts_team_credit",
        "ix_accounts_credit_rank",
        "ix_accounts_credit_total",
        "ux_accounts_email",
    ):
        op.drop_index(index, "accounts")
    with op.batch_alter_table("accounts") as batch:
        for column in ("team_id", "disabled_at", "role", "password_hash", "email"):
            batch.drop_column(column)
        for column in ("validated_total", "credit_rank"):
            batch.drop_column(column)
    with op.batch_alter_table("nodes") as batch:
        for column in ("validated_total", "credit_rank"):
            batch.drop_column(column)
