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

socket=/var/run/libvirt/libvirt-sock
if [ -S "$socket" ] && virsh -c qemu:///system version >/dev/null 2>&1; then
    exit 0
fi
if [ $is_root != 1 ]; then
    echo "libvirtd is not running and only root can start it here; the QEMU argv checks will be skipped" >&2
    [ "${CI:-}" = true ] && exit 1
    exit 0
fi
# libvirtd in a container: no systemd, so create its runtime folders and start it by hand.
mkdir -p /var/run/libvirt /var/log/libvirt /var/lib/libvirt/qemu
getent group libvirt-qemu >/dev/null || groupadd --system libvirt-qemu
getent passwd libvirt-qemu >/dev/null || useradd --system --no-create-home -g libvirt-qemu libvirt-qemu
answers() { virsh -c qemu:///system version >/dev/null 2>&1; }
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
