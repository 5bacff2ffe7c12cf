"""The `idlegrid` command: the coordinator, the worker, the researcher's and admin's verbs."""

from idlegrid.cli.main import main

__all__ = ["main"]
