#!/usr/bin/env bash
# Build the packages a coordinator serves at /download into its data directory:
#   scripts/build-downloads.sh --data-dir /var/lib/idlegrid            # wheel + one-file worker
#   scripts/build-downloads.sh --data-dir /var/lib/idlegrid --no-binary  # the wheel alone (seconds)
# The wheel is this checkout's version (pip wheel, no dependencies; `idlegrid serve` also
# builds it by itself at start when it is missing); the one-file Linux worker comes from
# scripts/build-worker-binary.sh (about a minute of CPU, 55 MB). The coordinator hashes
# what it finds there (SHA-256) and lists it on its /download page.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
data_dir=./idlegrid-data
binary=1
while [ $# -gt 0 ]; do
    case "$1" in
        --data-dir) data_dir=$2; shift 2 ;;
        --no-binary) binary=0; shift ;;
        *) echo "usage: $0 [--data-dir DIR] [--no-binary]" >&2; exit 2 ;;
    esac
done
out="$data_dir/downloads"
mkdir -p "$out"
echo "building into $out: the idlegrid wheel$([ $binary = 1 ] && echo ' and the one-file worker')"
version=$("$PYTHON" -c "import idlegrid; print(idlegrid.__version__)")
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
rm -rf build  # setuptools would keep files of an earlier build in the wheel
"$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$staging" .
wheel="idlegrid-$version-py3-none-any.whl"
mv "$staging/$wheel" "$out/$wheel"
echo "  $out/$wheel"
if [ $binary = 1 ]; then
    scripts/build-worker-binary.sh >/dev/null
    # Copied under a temporary name and renamed, so the coordinator never serves half a file.
    name="idlegrid-worker-linux-$(uname -m)"
    cp dist/idlegrid-worker "$out/.$name.part"
    mv "$out/.$name.part" "$out/$name"
    echo "  $out/$name"
fi
