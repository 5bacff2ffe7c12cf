#!/usr/bin/env bash
# Vendor Swagger UI (npm's swagger-ui-dist) for the coordinator's /docs page, offline.
#   scripts/vendor-swagger-ui.sh [VERSION]     (default: the version vendored now)
set -euo pipefail
cd "$(dirname "$0")/.."
target=src/idlegrid/coordinator/api/swagger_ui
version="${1:-$(sed -n 's/^version: //p' "$target/VERSION")}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "swagger-ui-dist@$version" >/dev/null && tar xzf ./*.tgz)
for file in swagger-ui-bundle.js swagger-ui-bundle.js.LICENSE.txt swagger-ui.css \
    favicon-32x32.png LICENSE NOTICE; do
    cp "$work/package/$file" "$target/$file"
done
printf 'swagger-ui-dist from the npm registry\nversion: %s\n' "$version" > "$target/VERSION"
echo "vendored swagger-ui-dist $version into $target"
