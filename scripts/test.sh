#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite, plus ruff and mypy.
# Fast tier: scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
# The browser and desktop tests need Debian's chromium and Xvfb, the Wayland ones sway,
# wtype, dbus-daemon and the wayland-protocols XML; as root (CI) they are installed here
# when missing. Without them those tests skip, and fail under CI=true.
missing=()
command -v chromium >/dev/null || missing+=(chromium chromium-driver)
command -v Xvfb >/dev/null || missing+=(xvfb)
command -v xdotool >/dev/null || missing+=(xdotool)
command -v sway >/dev/null || missing+=(sway)
command -v wtype >/dev/null || missing+=(wtype)
command -v dbus-daemon >/dev/null || missing+=(dbus)
[ -f /usr/share/wayland-protocols/staging/ext-idle-notify/ext-idle-notify-v1.xml ] ||
    missing+=(wayland-protocols)
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing ${missing[*]} for the browser and desktop tests"
        export DEBIAN_FRONTEND=noninteractive
        if ! apt-get install -y -q "${missing[@]}" >/dev/null; then
            apt-get update -q >/dev/null
            apt-get install -y -q "${missing[@]}" >/dev/null
        fi
    else
        echo "not installed: ${missing[*]} (their tests will skip)"
    fi
fi
# The one-file worker that tests/worker/test_worker_binary.py runs against a coordinator: built
# when missing or older than the sources (about 45 s of CPU).
if [ ! -x dist/idlegrid-worker ] ||
    [ -n "$(find src packaging scripts/build-worker-binary.sh -type f -newer dist/idlegrid-worker \
        -not -path "*/__pycache__/*" -print -quit)" ]; then
    scripts/build-worker-binary.sh >/dev/null
fi
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy src/idlegrid
# Two test processes (IDLEGRID_TEST_PROCESSES, 0 for one): most tests wait on real
# processes and sockets more than they compute, so two share two cores well.
exec .venv/bin/python -m pytest -n "${IDLEGRID_TEST_PROCESSES:-2}" --dist worksteal "$@"
