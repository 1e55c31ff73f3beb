#!/usr/bin/env bash
# The real-kernel suite's pieces (issue 13, docs/real-kernel.md): resolves Debian's current 6.1 kernel, downloads
# it with its headers, kbuild, linux-source-6.1 and busybox-static (apt-get download, cached outside the repo,
# keyed by package version), builds the mdev sample modules and the guest's initramfs. Fast when cached.
# A missing piece is an error under CI=true; elsewhere a note (tests/realnode then skip, naming it).
set -euo pipefail
cd "$(dirname "$0")/.."
fail() {
    if [ "${CI:-}" = true ]; then echo "error: real-kernel suite: $*" >&2; exit 1; fi
    echo "note: real-kernel suite: $*; tests/realnode will skip" >&2
    exit 0
}
need=()
command -v make >/dev/null || need+=(make)
command -v gcc-12 >/dev/null || need+=(gcc-12)
command -v qemu-system-x86_64 >/dev/null || need+=(qemu-system-x86)
[ -f /usr/share/qemu/qboot.rom ] || need+=(qemu-system-data)
command -v dpkg-deb >/dev/null || fail "dpkg-deb is missing (not a Debian system?)"
if [ ${#need[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        echo "installing ${need[*]} for the real-kernel suite ..." >&2
        timeout 600 apt-get install -y -qq "${need[@]}" >/dev/null 2>&1 \
            || { timeout 300 apt-get update -qq >/dev/null 2>&1 && timeout 600 apt-get install -y -qq "${need[@]}" >/dev/null; } \
            || fail "apt-get install ${need[*]} failed or timed out"
    else
        fail "missing ${need[*]} (as root: apt-get install ${need[*]})"
    fi
fi
# Downloads (first run ~225 MB) and the build (~1-2 min on 2 cores); the Python side has its own timeouts.
if ! timeout 1800 .venv/bin/python -m tests.realnode prepare; then
    fail "preparing the guest failed (above), or took over 30 min"
fi
