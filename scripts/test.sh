#!/usr/bin/env bash
# Every test: system pieces (libvirt, QEMU, pci.ids), the venv, ruff, mypy --strict, import-linter, the
# generated-stubs check and pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/ensure-system.sh
bash scripts/bootstrap.sh dev
bash scripts/ensure-realnode.sh
bash scripts/ensure-cluster.sh
export PATH="$PWD/.venv/bin:$PATH"
echo "== ruff";          ruff check .
echo "== mypy --strict"; mypy
echo "== import-linter"; lint-imports --no-cache
echo "== pytest";        python -m pytest "$@"
