"""Entry point of the tray app (the macOS bundle, Windows' windowless `.exe`).

Started with no arguments (from Finder, the Dock or a shortcut) it is `idlegrid worker
tray`; with arguments it is `idlegrid worker ...`, as the tray's own "Open the app window"
starts it again with `app`.
"""

import multiprocessing
import os
import sys
from pathlib import Path


def arguments(argv: list[str]) -> list[str]:
    """The worker's arguments: `tray` when none were given."""
    # Older macOS passes a process serial number to an app that Finder opens.
    given = [argument for argument in argv if not argument.startswith("-psn_")]
    return given or ["tray"]


def log_path(argv: list[str]) -> Path:
    """Where a windowless run writes what it logs: `worker.log` in its state directory
    (`--state-dir`, else the worker's default), as the macOS agent's log is."""
    state = Path.home() / ".idlegrid" / "worker"
    for i, argument in enumerate(argv):
        if argument == "--state-dir" and i + 1 < len(argv):
            state = Path(argv[i + 1])
        elif argument.startswith("--state-dir="):
            state = Path(argument.split("=", 1)[1])
    return state / "worker.log"


def ensure_streams(argv: list[str]) -> None:
    """A windowless Windows program has no stdout or stderr (None): give it the log file
    (the logon task runs the daemon this way), or the null device where that cannot be
    opened, so logging and click can write."""
    missing = [name for name in ("stdout", "stderr") if getattr(sys, name) is None]
    if not missing:
        return
    try:
        path = log_path(argv)
        path.parent.mkdir(parents=True, exist_ok=True)
        stream = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
    except OSError:
        stream = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115
    for name in missing:
        setattr(sys, name, stream)


if __name__ == "__main__":
    multiprocessing.freeze_support()
    ensure_streams(sys.argv[1:])
    from idlegrid.worker.commands import worker

    worker(args=arguments(sys.argv[1:]), prog_name="idlegrid-worker-tray")
