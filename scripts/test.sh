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
# KubeVirt's launcher harness (the tests marked kubevirt): built before pytest, not inside a test's timeout (a
# cold build takes minutes); without Go the tests skip, and under CI=true this step fails instead.
if command -v go >/dev/null || [ "${CI:-}" = true ]; then
    echo "== kubevirt peer"; bash tests/cluster/build-peers.sh kubevirt
    # Helm for the chart's tests (tests/test_helm_chart.py; a cold build takes about 6 min on 2 cores).
    echo "== helm peer";     bash tests/cluster/build-peers.sh helm
fi
echo "== ruff";          ruff check .
echo "== mypy --strict"; mypy
echo "== import-linter"; lint-imports --no-cache
echo "== pytest";        python -m pytest "$@"
