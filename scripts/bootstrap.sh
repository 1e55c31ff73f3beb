#!/usr/bin/env bash
# Creates .venv and installs the project (extras: "dev" for tests, "runtime" for just the tools). pip runs
# only when pyproject.toml changed; its output goes to .venv/pip.log and is shown only if it fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    echo "error: Python 3.11 or newer is needed ($PYTHON is $("$PYTHON" --version 2>&1))" >&2
    exit 1
fi
extras=${1:-dev}
if [ ! -x .venv/bin/python ]; then
    if ! "$PYTHON" -m venv .venv >/dev/null 2>&1; then
        rm -rf .venv
        # Debian's python3 needs python3-venv for this; install it when we can.
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            echo "installing python3-venv ..." >&2
            (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv) >/dev/null
        fi
        "$PYTHON" -m venv .venv || {
            echo "error: could not create .venv; on Debian: apt-get install python3-venv" >&2
            exit 1
        }
    fi
fi
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
# A dev install also satisfies a runtime one.
for have in dev "$extras"; do
    [ "$(cat ".venv/.installed-$have" 2>/dev/null)" = "$want" ] && exit 0
done
if [ "$extras" = dev ] && ! pkg-config --exists libvirt 2>/dev/null; then
    echo "note: building libvirt-python needs libvirt-dev and pkg-config: run scripts/ensure-system.sh as root" >&2
fi
echo "installing the project into .venv ($extras) ..." >&2
target="."
[ "$extras" = runtime ] || target=".[$extras]"
if ! { .venv/bin/python -m pip install --upgrade pip && .venv/bin/python -m pip install -e "$target"; } > .venv/pip.log 2>&1; then
    tail -n 30 .venv/pip.log >&2
    echo "error: pip install failed; the whole log is in .venv/pip.log" >&2
    exit 1
fi
rm -f .venv/.installed-*
echo "$want" > ".venv/.installed-$extras"
