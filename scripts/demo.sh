#!/usr/bin/env bash
# The main job on the bundled example: the seed's VM (two TU106 GPUs) rendered into its domain XML.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh runtime >&2
exec .venv/bin/xmlgen render \
    --domain examples/seed-node01/domain.xml \
    --vmi examples/seed-node01/vmi.json \
    --environ-file examples/seed-node01/compute.environ "$@"
