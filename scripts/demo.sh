#!/usr/bin/env bash
# Set up (first run only) and run the demo: a coordinator on SQLite, three local workers
# (one per replica), an embedding job over the standard library's docstrings, checked
# against a reference.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/idlegrid demo "$@"
