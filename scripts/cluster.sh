#!/usr/bin/env bash
# The real one-node Kubernetes (docs/real-cluster.md): scripts/cluster.sh up|down|status|logs <component>|image|kubectl ...
# `up` builds the peers from their Go modules the first time (cached outside the repository, ~45 min cold on
# 2 cores), then starts etcd, the API server, controller manager, scheduler, containerd and the kubelet
# (~1 min). Runs as root. `down` leaves no process, mount or file of the kit's behind.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/bootstrap.sh dev >&2
exec .venv/bin/python -m tests.cluster "$@"
