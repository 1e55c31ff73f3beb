#!/usr/bin/env bash
# Builds the real peers the cluster kit runs (Kubernetes 1.36 and, for the DRA scenario on the oldest supported
# release, 1.34; etcd, containerd, BuildKit) from their Go modules,
# by module name, into a cache outside the repository keyed by the pins: every file of tests/cluster/peers/<peer>/
# (go.mod, go.sum, the project's own harness sources), the Go version and the build flags. A peer whose key is already built is not rebuilt. Prints the
# peer's bin directory as `<peer>=<dir>` lines.
#
#   tests/cluster/build-peers.sh [peer ...]      (default: every peer)
#   KGP_PEERS_CACHE=/some/dir                     (default: ${XDG_CACHE_HOME:-~/.cache}/kubevirt-gpu-passthrough/peers)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cache="${KGP_PEERS_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kubevirt-gpu-passthrough/peers}"
mkdir -p "$cache"
peers=("$@")
[ ${#peers[@]} -gt 0 ] || peers=(kube etcd containerd buildkit kubevirt kube134 helm)

build_flags() {  # sets cgo and the array extra for peer $1
    # Static binaries, as the projects' own releases ship them; containerd without the btrfs snapshotter
    # (its cgo headers are not on the machine and the cluster uses overlayfs). Kubernetes gets the version
    # stamp its release build gives (hack/lib/version.sh): components report and compare versions.
    cgo=CGO_ENABLED=0
    extra=(-trimpath)
    # KubeVirt's launcher harness links virt-launcher's libvirt bindings: cgo against Debian's libvirt-dev.
    case "$1" in
        containerd) extra+=(-tags=no_btrfs,no_devmapper,no_zfs) ;;
        kubevirt) cgo=CGO_ENABLED=1 ;;
        kube|kube1[0-9][0-9])
            local v
            v="$(awk '$1 == "k8s.io/kubernetes" {print $2; exit} $1 == "require" && $2 == "k8s.io/kubernetes" {print $3; exit}' "$here/peers/$1/go.mod")"
            [[ "$v" =~ ^v[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "build-peers: no k8s.io/kubernetes version in peers/$1/go.mod" >&2; exit 2; }
            local major="${v#v}"; major="${major%%.*}"
            local minor="${v#v*.}"; minor="${minor%%.*}"
            local X="" pkg
            for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
                X+=" -X $pkg.gitVersion=$v -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
            done
            extra+=("-ldflags=${X# }") ;;
        helm)
            # Helm's own release stamp (its Makefile): its version, and the Kubernetes version `helm template`
            # and `helm lint` assume without a cluster, from the client-go it links (v0.N.x is Kubernetes 1.N).
            local v kv
            v="$(awk '$1 == "helm.sh/helm/v3" {print $2; exit}' "$here/peers/$1/go.mod")"
            kv="$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$here/peers/$1/go.mod")"
            [[ "$v" =~ ^v3\.[0-9]+\.[0-9]+$ && "$kv" =~ ^v0\.[0-9]+\.[0-9]+$ ]] \
                || { echo "build-peers: no helm.sh/helm/v3 or k8s.io/client-go version in peers/$1/go.mod" >&2; exit 2; }
            local minor="${kv#v0.}"; minor="${minor%%.*}"
            local X="-X helm.sh/helm/v3/internal/version.version=$v -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
            local pkg
            for pkg in helm.sh/helm/v3/pkg/lint/rules helm.sh/helm/v3/pkg/chartutil; do
                X+=" -X $pkg.k8sVersionMajor=1 -X $pkg.k8sVersionMinor=$minor"
            done
            extra+=("-ldflags=$X") ;;
    esac
}

for peer in "${peers[@]}"; do
    mod="$here/peers/$peer"
    [ -f "$mod/go.mod" ] || { echo "build-peers: no such peer: $peer ($mod/go.mod)" >&2; exit 2; }
    build_flags "$peer"
    flags="$cgo ${extra[*]}"
    # Every file of the peer's module (go.mod, go.sum and any source of the project's own, such as a harness).
    key="$( (cd "$mod" && find . -type f ! -name '*.orig' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; go version; echo "$flags") \
        | sha256sum | cut -c1-16)"
    dest="$cache/$peer-$key"
    # One build of a peer at a time (a second caller waits for the first, then finds it built).
    exec {lock}>"$cache/.$peer.lock"
    flock "$lock"
    if [ ! -f "$dest/.built" ]; then
        echo "build-peers: building $peer ($key) into $dest; cold builds on 2 cores: kube ~30 min, helm ~6 min, the others a few minutes each" >&2
        start=$(date +%s)
        tmp="$(mktemp -d "$cache/.$peer-XXXXXX")"
        (cd "$mod" && env "$cgo" GOBIN="$tmp/bin" GOFLAGS=-mod=readonly go install "${extra[@]}" tool)
        echo "$(( $(date +%s) - start ))" > "$tmp/build-seconds"
        touch "$tmp/.built"
        rm -rf "$dest"
        mv "$tmp" "$dest"
        echo "build-peers: built $peer in $(cat "$dest/build-seconds") s" >&2
    fi
    exec {lock}>&-
    echo "$peer=$dest/bin"
done
