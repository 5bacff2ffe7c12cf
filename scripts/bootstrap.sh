#!/usr/bin/env bash
# Create .venv and install idlegrid with the worker's ML stack and the dev tools.
# Idempotent: reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=".venv/.idlegrid-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # torch is pinned to 2.13.0 in the worker extra: the CPU build this machine kind has.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[worker,dev]"
    echo "$want" > "$stamp"
fi
