#!/usr/bin/env bash
# Creates .venv and installs the project (extras: "dev" for tests, "runtime" for just the tools) from the
# hash-pinned locks in requirements/ (scripts/lock.sh makes them): the build backend (build.txt), then
# runtime.txt or dev.txt with --require-hashes, then the project itself with --no-deps. pip runs only when
# the lock or pyproject.toml changed; then packages the lock no longer names are removed. pip's output goes
# to .venv/pip.log and is shown only if it fails.
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
case "$extras" in
    dev|runtime) ;;
    *) echo "error: unknown extras '$extras' (dev or runtime)" >&2; exit 2 ;;
esac
lock="requirements/$extras.txt"
for file in "$lock" requirements/build.txt; do
    [ -f "$file" ] || { echo "error: $file is missing (scripts/lock.sh makes it)" >&2; exit 1; }
done
stamp() { cat pyproject.toml requirements/build.txt "$1" | sha256sum | cut -d' ' -f1; }
want=$(stamp "$lock")
[ "$(cat ".venv/.installed-$extras" 2>/dev/null)" = "$want" ] && exit 0
# A dev install also satisfies a runtime one (dev.txt is resolved within runtime.txt's pins).
[ "$extras" = runtime ] && [ "$(cat .venv/.installed-dev 2>/dev/null)" = "$(stamp requirements/dev.txt)" ] && exit 0
if [ "$extras" = dev ] && ! pkg-config --exists libvirt 2>/dev/null; then
    echo "note: building libvirt-python needs libvirt-dev and pkg-config: run scripts/ensure-system.sh as root" >&2
fi
echo "installing the project into .venv from $lock ..." >&2
pip=(.venv/bin/python -m pip --disable-pip-version-check)
export PIP_DEFAULT_TIMEOUT=${PIP_DEFAULT_TIMEOUT:-60}
# Packages in .venv that neither the lock nor the project names (left by an older lock) are removed.
remove_stale() {
    local stale
    stale=$(.venv/bin/python - "$lock" requirements/build.txt <<'PY'
import re, sys
from importlib.metadata import distributions
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
locked = {"pip", "kubevirt-gpu-passthrough"}
for path in sys.argv[1:]:
    for line in open(path, encoding="utf-8"):
        match = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==", line)
        if match:
            locked.add(norm(match.group(1)))
print(" ".join(sorted({norm(d.metadata["Name"]) for d in distributions()} - locked)))
PY
    )
    [ -z "$stale" ] || "${pip[@]}" uninstall -y $stale
}
if ! {
    "${pip[@]}" install --require-hashes -r requirements/build.txt \
        && "${pip[@]}" install --require-hashes --no-build-isolation -r "$lock" \
        && "${pip[@]}" install --no-deps --no-build-isolation -e . \
        && remove_stale
} > .venv/pip.log 2>&1; then
    tail -n 30 .venv/pip.log >&2
    echo "error: pip install from $lock failed; the whole log is in .venv/pip.log" >&2
    exit 1
fi
rm -f .venv/.installed-*
echo "$want" > ".venv/.installed-$extras"
