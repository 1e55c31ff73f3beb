#!/usr/bin/env bash
# The real-kernel harness from the shell (docs/real-kernel.md):
#   scripts/realnode.sh prepare                      download/build/cache the guest (Debian's 6.1 kernel)
#   scripts/realnode.sh run 'ls /dev/vfio'           boot a guest node, run a command in it, print its output
#   scripts/realnode.sh scenario node                the whole path on a real kernel, observations as JSON
#   scripts/realnode.sh simulate                     the whole path, told step by step (xmlgen simulate --kernel)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/bootstrap.sh dev
exec .venv/bin/python -m tests.realnode "$@"
