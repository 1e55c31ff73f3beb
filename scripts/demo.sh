#!/usr/bin/env bash
# The main job on the bundled example: the seed's node01 and its two-GPU VM, through the whole path
# (device plugin → kubelet stand-in → Allocate → hook → domain XML). The domain goes to stdout, the account
# of each step to stderr. Extra arguments go to `xmlgen simulate` (e.g. --node vgpu; --check needs libvirt).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh runtime >&2
exec .venv/bin/xmlgen simulate "$@"
