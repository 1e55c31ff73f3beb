#!/usr/bin/env bash
# Installs and starts what the libvirt checks need: Debian's libvirt, QEMU and pci.ids, and libvirtd with
# the QEMU driver. As root it installs what is missing; otherwise it says what is missing. Under CI=true
# anything missing fails (exit 1) instead of letting the libvirt tests skip.
set -uo pipefail
packages=(libvirt-daemon-driver-qemu libvirt-daemon libvirt-clients libvirt-dev pkg-config qemu-system-x86 pci.ids gcc python3-venv python3-dev)
missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
is_root=0
[ "$(id -u)" = 0 ] && is_root=1
if [ ${#missing[@]} -gt 0 ]; then
    if [ $is_root = 1 ] && command -v apt-get >/dev/null; then
        echo "installing: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq >/dev/null && apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
            || { echo "error: apt-get install ${missing[*]} failed" >&2; exit 1; }
    else
        echo "missing Debian packages: ${missing[*]} (run as root: apt-get install ${missing[*]})" >&2
        [ "${CI:-}" = true ] && exit 1
        exit 0
    fi
fi

# /dev/kvm as Debian's udev rule leaves it (group kvm, 0660) with libvirt-qemu in that group. Without udev
# (containers) it can stay root:root 0600: QEMU run as libvirt-qemu cannot open it, libvirtd keeps re-probing
# QEMU's capabilities and every domxml-to-native call waits forever.
kvm_fixed=0
if [ -e /dev/kvm ] && [ $is_root = 1 ]; then
    getent group kvm >/dev/null || groupadd --system kvm
    if [ "$(stat -c %G:%a /dev/kvm)" != kvm:660 ]; then
        chgrp kvm /dev/kvm && chmod 0660 /dev/kvm && kvm_fixed=1
    fi
    if getent passwd libvirt-qemu >/dev/null && ! id -nG libvirt-qemu | tr ' ' '\n' | grep -qx kvm; then
        usermod -a -G kvm libvirt-qemu && kvm_fixed=1
    fi
elif [ -e /dev/kvm ] && [ ! -r /dev/kvm ]; then
    echo "warning: /dev/kvm is $(stat -c %U:%G:%a /dev/kvm); libvirt's QEMU probe may hang (run this script as root)" >&2
fi
virsh_answers() { timeout 15 virsh -c qemu:///system version >/dev/null 2>&1; }
socket=/var/run/libvirt/libvirt-sock
if [ -S "$socket" ] && [ $kvm_fixed = 0 ] && virsh_answers; then
    exit 0
fi
if [ $kvm_fixed = 1 ] && pgrep -x libvirtd >/dev/null; then
    # libvirtd cached a QEMU probe made without /dev/kvm access: restart it so it probes again.
    echo "/dev/kvm made usable for libvirt-qemu; restarting libvirtd" >&2
    pkill -x libvirtd
    for _ in $(seq 1 50); do pgrep -x libvirtd >/dev/null || break; sleep 0.1; done
    pgrep -x libvirtd >/dev/null && pkill -9 -x libvirtd
fi
if [ $is_root != 1 ]; then
    echo "libvirtd is not running and only root can start it here; the QEMU argv checks will be skipped" >&2
    [ "${CI:-}" = true ] && exit 1
    exit 0
fi
# libvirtd in a container: no systemd, so create its runtime folders and start it by hand.
mkdir -p /var/run/libvirt /var/log/libvirt /var/lib/libvirt/qemu
getent group libvirt-qemu >/dev/null || groupadd --system libvirt-qemu
getent passwd libvirt-qemu >/dev/null || useradd --system --no-create-home -g libvirt-qemu $(getent group kvm >/dev/null && echo -G kvm) libvirt-qemu
answers() { virsh_answers; }
wait_until() {  # wait_until SECONDS COMMAND...: poll every 0.1 s
    local tries=$(($1 * 10)); shift
    for _ in $(seq 1 "$tries"); do "$@" && return 0; sleep 0.1; done
    return 1
}
no_libvirtd() { ! pgrep -x libvirtd >/dev/null; }
for attempt in 1 2 3; do
    # A libvirtd that is still shutting down holds its pid file: let it finish before starting another.
    pgrep -x libvirtd >/dev/null && ! wait_until 5 answers && wait_until 5 no_libvirtd
    pgrep -x virtlogd >/dev/null || virtlogd -d
    pgrep -x libvirtd >/dev/null || libvirtd -d
    if wait_until 10 answers; then
        exit 0
    fi
    echo "libvirtd did not answer (attempt $attempt); restarting it" >&2
    pkill -x libvirtd
    wait_until 5 no_libvirtd || pkill -9 -x libvirtd
done
echo "error: libvirtd did not answer on $socket (see /var/log/libvirt)" >&2
[ "${CI:-}" = true ] && exit 1
exit 0
