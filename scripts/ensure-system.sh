#!/usr/bin/env bash
# Installs and starts what the libvirt checks need: Debian's libvirt, QEMU and pci.ids, and libvirtd with
# the QEMU driver (and valgrind, which tests/test_bench_hook_instructions.py runs the hook under). As root it
# installs what is missing; otherwise it says what is missing. Under CI=true anything missing fails (exit 1)
# instead of letting the libvirt tests skip.
#
# Idempotent: on a machine where everything is in place it only checks (a few virsh calls, each with a
# timeout) and exits 0. Every step that waits has a bound and says what it waited for.
#   /dev/kvm    as Debian's udev rule leaves it: group kvm, 0660, libvirt-qemu in group kvm. Without udev
#               (containers) it can be root:root 0600; then QEMU run as libvirt-qemu cannot open it, libvirtd's
#               capability probe of QEMU hangs and every domxml-to-native waits forever. Fixed here (root),
#               and libvirtd restarted so that it probes again. No /dev/kvm at all is fine: the checks then
#               use QEMU's TCG (domain type 'qemu', see xmlgen/libvirt_check.py).
#   libvirtd    started by hand when not running (no systemd in containers), restarted when it does not answer.
#   the probe   at the end, `virsh domxml-to-native` of a minimal domain, the call the tests make: it must
#               answer within 60 s, or this fails naming the likely cause.
# tests/test_ensure_system.py runs it against stand-ins for virsh, ps, pgrep, pkill and libvirtd.
set -uo pipefail
packages=(libvirt-daemon-driver-qemu libvirt-daemon libvirt-clients libvirt-dev pkg-config qemu-system-x86 qemu-utils ovmf pci.ids gcc python3-venv python3-dev valgrind)
ci=0
[ "${CI:-}" = true ] && ci=1
is_root=0
[ "$(id -u)" = 0 ] && is_root=1
say() { echo "ensure-system: $*" >&2; }
give_up() {  # give_up MESSAGE: an error under CI (exit 1), a note elsewhere (exit 0: the libvirt tests skip)
    if [ $ci = 1 ]; then say "error: $1"; exit 1; fi
    say "$1; the libvirt checks will be skipped"
    exit 0
}

missing=()
for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'install ok installed' || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ $is_root = 1 ] && command -v apt-get >/dev/null; then
        say "installing: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        { timeout 600 apt-get update -qq && timeout 1200 apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/dev/null \
            || { say "error: apt-get install ${missing[*]} failed (or took over its 10/20 minutes)"; exit 1; }
    else
        give_up "missing Debian packages: ${missing[*]} (run as root: apt-get install ${missing[*]})"
    fi
fi

# -- /dev/kvm ---------------------------------------------------------------------------------------------
kvm_fixed=0
if [ ! -e /dev/kvm ]; then
    say "no /dev/kvm here: libvirt's QEMU checks use TCG (domain type 'qemu'), which is enough for domxml-to-native"
elif [ ! -c /dev/kvm ]; then
    say "warning: /dev/kvm is not a character device ($(stat -c %F /dev/kvm)); leaving it alone"
elif [ $is_root = 1 ]; then
    getent group kvm >/dev/null || groupadd --system kvm
    if [ "$(stat -c %G:%a /dev/kvm)" != kvm:660 ]; then
        say "/dev/kvm was $(stat -c %U:%G:%a /dev/kvm); making it root:kvm 0660 as Debian's udev rule does"
        chgrp kvm /dev/kvm && chmod 0660 /dev/kvm && kvm_fixed=1
    fi
    if getent passwd libvirt-qemu >/dev/null && ! id -nG libvirt-qemu | tr ' ' '\n' | grep -qx kvm; then
        say "adding libvirt-qemu to group kvm"
        usermod -a -G kvm libvirt-qemu && kvm_fixed=1
    fi
    # What QEMU will do: open /dev/kvm read-write as libvirt-qemu (with its supplementary groups).
    if getent passwd libvirt-qemu >/dev/null && command -v runuser >/dev/null \
        && ! timeout 10 runuser -u libvirt-qemu -- sh -c ': <> /dev/kvm' 2>/dev/null; then
        say "warning: libvirt-qemu still cannot open /dev/kvm ($(stat -c %U:%G:%a /dev/kvm)); QEMU checks may hang"
    fi
elif [ ! -r /dev/kvm ] || [ ! -w /dev/kvm ]; then
    say "warning: /dev/kvm is $(stat -c %U:%G:%a /dev/kvm); libvirt's QEMU probe may hang (run this script as root)"
fi

# -- libvirtd ---------------------------------------------------------------------------------------------
socket=/var/run/libvirt/libvirt-sock
virsh_timeout=${ENSURE_SYSTEM_VIRSH_TIMEOUT:-15}   # seconds for `virsh version` (tests/test_ensure_system.py)
probe_timeout=${ENSURE_SYSTEM_PROBE_TIMEOUT:-60}   # seconds for the domxml-to-native probe
virsh_answers() { timeout "$virsh_timeout" virsh -c qemu:///system version >/dev/null 2>&1; }
probe_domain="<domain type='$([ -c /dev/kvm ] && echo kvm || echo qemu)'><name>ensure-system-probe</name><memory>65536</memory><os><type arch='x86_64'>hvm</type></os></domain>"
qemu_answers() {  # what the tests call: domxml-to-native, bounded
    local file
    file=$(mktemp) || return 1
    echo "$probe_domain" > "$file"
    timeout "$probe_timeout" virsh -c qemu:///system domxml-to-native qemu-argv "$file" >/dev/null 2>"$file.err"
    local status=$?
    [ $status = 124 ] && echo "no answer within $probe_timeout s" > "$file.err"
    probe_error=$(head -c 300 "$file.err")
    rm -f "$file" "$file.err"
    return $status
}
wait_until() {  # wait_until SECONDS COMMAND...: poll every 0.1 s until SECONDS have passed (plus one last call)
    local end=$(($(date +%s) + $1)); shift
    until "$@"; do
        [ "$(date +%s)" -ge "$end" ] && return 1
        sleep 0.1
    done
}
running() { ps -C libvirtd -o stat= 2>/dev/null | grep -qv '^Z'; }  # a zombie (not yet reaped) is not running
not_running() { ! running; }
stop_libvirtd() {
    pkill -x libvirtd
    wait_until 5 not_running || { pkill -9 -x libvirtd; wait_until 2 not_running; }
}
finish() {  # the final probe: the call the tests make must answer
    probe_error=""
    if qemu_answers; then
        exit 0
    fi
    give_up "libvirtd answers, but not domxml-to-native ($probe_error); is /dev/kvm usable by libvirt-qemu? ($(stat -c %U:%G:%a /dev/kvm 2>/dev/null || echo 'no /dev/kvm')); see /var/log/libvirt"
}

if [ $kvm_fixed = 1 ] && running; then
    # libvirtd cached a QEMU probe made without /dev/kvm access: restart it so it probes again.
    say "/dev/kvm made usable for libvirt-qemu; restarting libvirtd"
    stop_libvirtd
fi
if [ -S "$socket" ] && running && virsh_answers; then
    finish
fi
if [ $is_root != 1 ]; then
    running && give_up "libvirtd runs but does not answer on $socket, and only root can restart it here"
    give_up "libvirtd is not running and only root can start it here"
fi
# libvirtd in a container: no systemd, so create its runtime folders and start it by hand.
mkdir -p /var/run/libvirt /var/log/libvirt /var/lib/libvirt/qemu
getent group libvirt-qemu >/dev/null || groupadd --system libvirt-qemu
getent passwd libvirt-qemu >/dev/null || useradd --system --no-create-home -g libvirt-qemu $(getent group kvm >/dev/null && echo -G kvm) libvirt-qemu
for attempt in 1 2 3; do
    # A libvirtd that is still shutting down holds its pid file: let it finish before starting another.
    running && ! wait_until 5 virsh_answers && wait_until 5 not_running
    pgrep -x virtlogd >/dev/null || virtlogd -d
    if ! running; then
        say "starting libvirtd"
        libvirtd -d
    fi
    if wait_until 10 virsh_answers; then
        finish
    fi
    say "libvirtd did not answer on $socket within 10 s (attempt $attempt of 3); restarting it"
    stop_libvirtd
done
give_up "libvirtd did not answer on $socket after 3 starts (see /var/log/libvirt)"
