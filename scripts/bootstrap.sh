#!/usr/bin/env bash
# Creates .venv and installs the project with its dev extras; re-runs pip only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: Python 3.11 or newer is needed ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi
extras=${1:-dev}
stamp=".venv/.installed-$extras"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv || {
        echo "error: could not create .venv; on Debian: apt-get install python3-venv" >&2
        exit 1
    }
fi
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    if [ "$extras" = dev ] && ! pkg-config --exists libvirt 2>/dev/null; then
        echo "note: libvirt-dev and pkg-config are needed to build libvirt-python; run scripts/ensure-system.sh as root" >&2
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip >/dev/null
    if [ "$extras" = runtime ]; then
        .venv/bin/python -m pip install --quiet -e .
    else
        .venv/bin/python -m pip install --quiet -e ".[$extras]"
    fi
    echo "$want" > "$stamp"
fi
