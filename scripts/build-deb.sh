#!/usr/bin/env bash
# Build the Debian package of the one-file worker:
#   scripts/build-deb.sh      -> dist/idlegrid-worker_VERSION_ARCH.deb
# It carries dist/idlegrid-worker (built first when missing or older than the sources),
# a system service, the tray's autostart entry, the app's menu entry and a man page
# (src/idlegrid/worker/packages.py lays them out). CI builds it, installs it, runs it
# against a coordinator and removes it (tests/worker/test_worker_deb.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
if [ ! -x dist/idlegrid-worker ] ||
    [ -n "$(find src packaging scripts/build-worker-binary.sh -type f -newer dist/idlegrid-worker \
        -not -path "*/__pycache__/*" -print -quit)" ]; then
    scripts/build-worker-binary.sh >/dev/null
fi
version=$(PYTHONPATH=src "$PYTHON" -c 'import idlegrid; print(idlegrid.__version__)')
arch=$(dpkg --print-architecture)
root=build/deb/idlegrid-worker
PYTHONPATH=src "$PYTHON" -m idlegrid.worker.packages "$root" dist/idlegrid-worker \
    packaging/linux/idlegrid-worker.1 "$version" "$arch"
# gzip: the one-file worker inside is compressed already, and xz would take minutes.
package="dist/idlegrid-worker_${version}_${arch}.deb"
dpkg-deb --root-owner-group -Zgzip --build "$root" "$package" >/dev/null
echo "built $package"
