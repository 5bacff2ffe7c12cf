#!/usr/bin/env bash
# Set up (first run only) and run the whole test suite, plus ruff and mypy.
# Fast tier: scripts/test.sh -m "not slow"
set -euo pipefail
cd "$(dirname "$0")/.."
cat <<'SAYS'
scripts/test.sh: what it sets up before the tests, each only when missing:
  - as root with apt-get: Debian packages for the browser and desktop tests (chromium,
    chromium-driver, xvfb, xdotool, sway, wtype, dbus, wayland-protocols, trayer, and
    GTK/WebKitGTK with the -dev packages the tray and app window build against; iptables
    for the p2p NAT test);
    otherwise their tests skip;
  - .venv with idlegrid and its worker, desktop, p2p and dev extras (scripts/bootstrap.sh;
    the CPU build of torch 2.13.0 and llama-cpp-python among them: about 20 minutes on a
    first run, 11 to 18 of them building llama.cpp, whose wheel pip then caches);
  - dist/idlegrid-worker, the one-file worker (PyInstaller, about 45 s of CPU, 123 MB),
    rebuilt when a source is newer.
Then ruff, mypy and pytest (the whole suite, 23 to 32 minutes on 2 cores; -m "not slow"
for the fast tier).
SAYS
# The browser and desktop tests need Debian's chromium and Xvfb, the Wayland ones sway,
# wtype, dbus-daemon and the wayland-protocols XML; as root (CI) they are installed here
# when missing, before the virtual environment (the desktop extra compiles against some).
# Without them those tests skip, and fail under CI=true.
missing=()
command -v chromium >/dev/null || missing+=(chromium chromium-driver)
command -v Xvfb >/dev/null || missing+=(xvfb)
command -v xdotool >/dev/null || missing+=(xdotool)
command -v sway >/dev/null || missing+=(sway)
command -v wtype >/dev/null || missing+=(wtype)
command -v dbus-daemon >/dev/null || missing+=(dbus)
[ -f /usr/share/wayland-protocols/staging/ext-idle-notify/ext-idle-notify-v1.xml ] ||
    missing+=(wayland-protocols)
# The tray's tests host it in trayer; the tray and the app window draw through GTK and
# WebKitGTK, whose Python bindings (the desktop extra) build against the -dev packages.
command -v trayer >/dev/null || missing+=(trayer)
# The NAT test (tests/p2p/test_training_p2p_nat.py) builds a masquerading router in a
# network namespace with iptables (as root; iproute2 is there already).
command -v iptables >/dev/null || missing+=(iptables)
for package in libgirepository1.0-dev libcairo2-dev pkg-config gir1.2-gtk-3.0 \
    gir1.2-webkit2-4.1; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" ||
        missing+=("$package")
done
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
scripts/bootstrap.sh
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
# --durations: the slowest tests, printed at the end, show where the suite's time goes.
exec .venv/bin/python -m pytest -n "${IDLEGRID_TEST_PROCESSES:-2}" --dist worksteal \
    --durations=25 "$@"
