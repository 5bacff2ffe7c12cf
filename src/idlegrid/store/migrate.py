"""Run Alembic migrations from code, on a connection the store already holds."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Connection

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(url: str = "") -> Config:
    """An Alembic config for idlegrid's migrations (no alembic.ini needed)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if url:
        config.set_main_option("sqlalchemy.url", url)
    return config


def upgrade(connection: Connection, revision: str = "head") -> None:
    """Bring the database behind `connection` to `revision`."""
    config = alembic_config()
    config.attributes["connection"] = connection
    command.upgrade(config, revision)
