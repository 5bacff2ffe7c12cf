"""Entry point of the tray app (the macOS bundle, Windows' windowless `.exe`).

Started with no arguments (from Finder, the Dock or a shortcut) it is `idlegrid worker
tray`; with arguments it is `idlegrid worker ...`, as the tray's own "Open the app window"
starts it again with `app`.
"""

import multiprocessing
import os
import sys


def arguments(argv: list[str]) -> list[str]:
    """The worker's arguments: `tray` when none were given."""
    # Older macOS passes a process serial number to an app that Finder opens.
    given = [argument for argument in argv if not argument.startswith("-psn_")]
    return given or ["tray"]


def ensure_streams() -> None:
    """A windowless Windows program has no stdout or stderr (None): give it the null device,
    where logging and click can write."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115


if __name__ == "__main__":
    multiprocessing.freeze_support()
    ensure_streams()
    from idlegrid.worker.commands import worker

    worker(args=arguments(sys.argv[1:]), prog_name="idlegrid-worker-tray")
