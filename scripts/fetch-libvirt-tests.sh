#!/usr/bin/env bash
# Fetches libvirt's own test domains from Debian's `libvirt` source package (the version of the installed
# libvirt0, else bookworm's newest) and keeps the ones tests/test_libvirt_corpus.py sweeps:
# tests/qemuxml2argvdata, tests/qemuxml2xmloutdata and tests/qemuhotplugtestdomains (and the three test
# programs that say what libvirt expects of each), patched as Debian ships them.
#
#   scripts/fetch-libvirt-tests.sh [CACHE_DIR]     (default: .cache/libvirt-tests in the repository)
#
# Prints the folder holding those three directories on stdout (nothing else). Uses a private apt
# configuration with a deb-src entry under CACHE_DIR, so the machine's apt sources stay as they are. A second
# run finds the cache and fetches nothing. Every network call has a timeout; any failure says which step and
# why and exits 1. As root it installs dpkg-dev and xz-utils when missing (dpkg-source unpacks the package).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
cache=${1:-$repo/.cache/libvirt-tests}
suite=${LIBVIRT_TESTS_SUITE:-bookworm}
mirror=${LIBVIRT_TESTS_MIRROR:-http://deb.debian.org/debian}
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

die() { echo "fetch-libvirt-tests: $*" >&2; exit 1; }

version=${LIBVIRT_TESTS_VERSION-$(dpkg-query -W -f='${Version}' libvirt0 2>/dev/null || true)}
out="$cache/libvirt-${version:-newest}"
if [ -f "$out/.complete" ]; then
    echo "$out"
    exit 0
fi

missing=()
command -v dpkg-source >/dev/null || missing+=(dpkg-dev)
command -v xz >/dev/null || missing+=(xz-utils)
[ -f "$keyring" ] || missing+=(debian-archive-keyring)
if [ ${#missing[@]} -gt 0 ]; then
    [ "$(id -u)" = 0 ] || die "needs ${missing[*]} (as root: apt-get install ${missing[*]})"
    echo "fetch-libvirt-tests: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    timeout 300 apt-get update -qq >/dev/null 2>&1 || die "apt-get update failed or timed out (300 s)"
    timeout 300 apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
        || die "apt-get install ${missing[*]} failed or timed out (300 s)"
fi

apt_dir="$cache/apt"
mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/sources.list.d"
cat >"$apt_dir/sources.list" <<EOF
deb-src [signed-by=$keyring] $mirror $suite main
deb-src [signed-by=$keyring] $mirror $suite-updates main
deb-src [signed-by=$keyring] ${LIBVIRT_TESTS_SECURITY_MIRROR:-http://deb.debian.org/debian-security} $suite-security main
EOF
apt_opts=(
    -o "Dir::Etc::SourceList=$apt_dir/sources.list"
    -o "Dir::Etc::SourceParts=$apt_dir/sources.list.d"
    -o "Dir::State::Lists=$apt_dir/lists"
    -o "Dir::Cache=$apt_dir"
    -o "Dir::Cache::archives=$apt_dir/archives"
    -o "Debug::NoLocking=1"
    -o "APT::Sandbox::User=$(id -un)"
    -o "Acquire::Retries=2"
    -o "Acquire::http::Timeout=30"
)
log="$cache/fetch.log"
timeout 180 apt-get "${apt_opts[@]}" update >"$log" 2>&1 \
    || die "apt-get update of the deb-src index ($mirror $suite) failed or timed out (180 s); see $log: $(tail -n 3 "$log" | tr '\n' ' ')"

# apt-get update exits 0 when a source cannot be reached: check that a Sources index came.
ls "$apt_dir/lists/"*_Sources* >/dev/null 2>&1 \
    || die "no deb-src index could be fetched from $mirror ($suite); see $log: $(grep -E '^(Err|W|E):' "$log" | head -n 2 | tr '\n' ' ')"
work="$cache/download"
rm -rf "$work"
mkdir -p "$work"
fetch_source() {  # fetch_source PACKAGE[=VERSION]
    (cd "$work" && timeout 600 apt-get "${apt_opts[@]}" source --download-only "$1") >>"$log" 2>&1
}
wanted="libvirt${version:+=$version}"
if ! fetch_source "$wanted"; then
    [ -n "$version" ] || die "apt-get source --download-only libvirt failed or timed out (600 s); see $log: $(tail -n 3 "$log" | tr '\n' ' ')"
    # The archive keeps only a suite's newest version: a machine that has not upgraded yet gets that one.
    echo "fetch-libvirt-tests: libvirt $version is no longer in $suite's sources; taking its newest" >&2
    fetch_source libvirt \
        || die "apt-get source --download-only libvirt failed or timed out (600 s); see $log: $(tail -n 3 "$log" | tr '\n' ' ')"
fi
dsc=$(ls "$work"/libvirt_*.dsc 2>/dev/null | head -n 1)
[ -n "$dsc" ] || die "apt-get source left no libvirt_*.dsc in $work"
timeout 300 dpkg-source --no-check -x "$dsc" "$work/src" >>"$log" 2>&1 \
    || die "dpkg-source -x $dsc failed or timed out (300 s); see $log"

rm -rf "$out.tmp"
mkdir -p "$out.tmp/tests"
for dir in qemuxml2argvdata qemuxml2xmloutdata qemuhotplugtestdomains; do
    [ -d "$work/src/tests/$dir" ] || die "the source package has no tests/$dir"
    cp -r "$work/src/tests/$dir" "$out.tmp/tests/"
done
# libvirt's own expectations for each file (DO_TEST… / DO_TEST_PARSE_ERROR …), kept to explain verdicts.
for file in qemuxml2argvtest.c qemuxml2xmltest.c qemuhotplugtest.c; do
    cp "$work/src/tests/$file" "$out.tmp/tests/"
done
cp "$work/src/debian/changelog" "$out.tmp/debian-changelog"
basename "$dsc" .dsc >"$out.tmp/source-version"
rm -rf "$out" "$work"
mv "$out.tmp" "$out"
touch "$out/.complete"
echo "$out"
