#!/usr/bin/env bash
# Build the one-file `idlegrid-worker` with PyInstaller, on Linux or macOS:
#   scripts/build-worker-binary.sh [--with-ml]   -> dist/idlegrid-worker
# (on macOS also "dist/idlegrid worker.app", the tray app; on Windows use
# scripts/build-worker-binary.ps1). The binary is `idlegrid worker` (same flags and
# subcommands). It holds the daemon and the kinds that need no ML stack (sleep, noop);
# --with-ml bundles torch and sentence-transformers as well (hundreds of MB). The recipe
# is packaging/build_worker.py with packaging/idlegrid-worker.spec. CI builds it and runs
# it against a coordinator (tests/worker/test_worker_binary.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# PyInstaller comes with the dev tools (pyproject.toml); without them, install it here.
"$PYTHON" -m PyInstaller --version >/dev/null 2>&1 ||
  "$PYTHON" -m pip install --quiet "pyinstaller>=6.11,<7"
# The tray (pystray over GTK) and the app window (pywebview over WebKitGTK) come in with
# their GObject bindings when the build's Python has the desktop extra.
"$PYTHON" packaging/build_worker.py "$@"
dist/idlegrid-worker --help | head -3
