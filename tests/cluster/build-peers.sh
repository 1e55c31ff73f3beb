#!/usr/bin/env bash
# Builds the real peers the cluster kit runs (Kubernetes, etcd, containerd, BuildKit) from their Go modules,
# by module name, into a cache outside the repository keyed by the pins: tests/cluster/peers/<peer>/go.mod and
# go.sum, the Go version and the build flags. A peer whose key is already built is not rebuilt. Prints the
# peer's bin directory as `<peer>=<dir>` lines.
#
#   tests/cluster/build-peers.sh [peer ...]      (default: every peer)
#   KGP_PEERS_CACHE=/some/dir                     (default: ${XDG_CACHE_HOME:-~/.cache}/kubevirt-gpu-passthrough/peers)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${KGP_PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubevirt-gpu-passthrough/peers}"
mkdir -p "$cache"
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(kube etcd containerd buildkit)

build_flags() {
    # Static binaries, as the projects' own releases ship them; containerd without the btrfs snapshotter
    # (its cgo headers are not on the machine and the cluster uses overlayfs).
    # KubeVirt's launcher harness links virt-launcher's libvirt bindings: cgo against Debian's libvirt-dev.
    case "$1" in
        containerd) echo "CGO_ENABLED=0 -trimpath -tags=no_btrfs,no_devmapper,no_zfs" ;;
        kubevirt)   echo "CGO_ENABLED=1 -trimpath" ;;
        *)          echo "CGO_ENABLED=0 -trimpath" ;;
    esac
}

peer_sources() {
    # The project's own Go files in a peer's module (KubeVirt's: its tools and the unserved stand-ins) are part
    # of what is built, so of the key; the other peers have none, and their keys are as before.
    case "$1" in
        kubevirt) (cd "$here/peers/$1" && find . -name '*.go' -o -name 'go.mod' -path './unserved/*' | LC_ALL=C sort | xargs sha256sum) ;;
    esac
}

for peer in "${peers[@]}"; do
    mod="$here/peers/$peer"
    [ -f "$mod/go.mod" ] || { echo "build-peers: no such peer: $peer ($mod/go.mod)" >&2; exit 2; }
    flags="$(build_flags "$peer")"
    key="$( (cat "$mod/go.mod" "$mod/go.sum"; go version; echo "$flags"; peer_sources "$peer") | sha256sum | cut -c1-16)"
    dest="$cache/$peer-$key"
    if [ ! -f "$dest/.built" ]; then
        echo "build-peers: building $peer ($key) into $dest; a cold build of kube takes ~30 min on 2 cores" >&2
        start=$(date +%s)
        tmp="$(mktemp -d "$cache/.$peer-XXXXXX")"
        read -r cgo rest <<<"$flags"
        # shellcheck disable=SC2086
        (cd "$mod" && env "$cgo" GOBIN="$tmp/bin" GOFLAGS=-mod=readonly go install $rest tool)
        echo "$(( $(date +%s) - start ))" > "$tmp/build-seconds"
        touch "$tmp/.built"
        rm -rf "$dest"
        mv "$tmp" "$dest"
        echo "build-peers: built $peer in $(cat "$dest/build-seconds") s" >&2
    fi
    echo "$peer=$dest/bin"
done
