"""Logging for the command line: the coordinator's and the worker's."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str) -> None:
    """Rich lines on a terminal, plain timestamped ones in a log file; Alembic's INFO
    chatter (one line per migration step) only with --log-level debug."""
    from rich.console import Console
    from rich.logging import RichHandler

    handler: logging.Handler
    if sys.stderr.isatty():
        handler = RichHandler(console=Console(stderr=True), show_path=False)
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
    else:  # log files: one plain line per record
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level.upper(), handlers=[handler])
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if level.lower() != "debug":
        logging.getLogger("alembic").setLevel(logging.WARNING)
