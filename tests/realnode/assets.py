"""The guest's kernel, modules and initramfs: resolved and downloaded from Debian, built once, cached.

Everything comes from Debian's package registry through ``apt-get download`` (the only registry this
project's machines reach) and is unpacked with ``dpkg -x``/``dpkg-deb``; nothing downloaded or built is ever
written into the repository. The kernel ABI package (``linux-image-6.1.0-57-amd64``) is resolved at setup
time from ``linux-image-amd64``'s dependency, because Debian's security updates move it; the cache directory
is keyed by that package and its version, so an update builds a fresh set next to the old one.

Cache: ``$KGP_REALNODE_CACHE``, else ``/var/cache/kubevirt-gpu-passthrough/realnode`` when writable, else
``$XDG_CACHE_HOME/kubevirt-gpu-passthrough/realnode`` (``~/.cache``). Layout::

    debs/                          the .deb files apt-get downloaded (names carry their versions)
    linux-image-6.1.0-57-amd64_6.1.192-3/
        vmlinux                    the ELF kernel (PVH entry), decompressed from Debian's vmlinuz
        initramfs.cpio             busybox-static, /init and the modules below
        modules/*.ko               the modules the guest may load (closure of WANTED_MODULES)
        assets.json                versions, module load order, build times
"""

from __future__ import annotations

import json
import lzma
import os
import re
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

SOURCE_PACKAGE = "linux-source-6.1"
IMAGE_METAPACKAGE = "linux-image-amd64"
BUSYBOX_PACKAGE = "busybox-static"

# What the scenarios load: the 9p root, VFIO with its type1 IOMMU backend, mdev and the kernel's mdev samples,
# and the host drivers the emulated functions start on (snd_hda_intel for the "GPU"'s audio companion).
BASE_MODULES = ("virtio_pci", "9pnet_virtio", "9p")
WANTED_MODULES = (
    *BASE_MODULES,
    "vfio_pci",
    "vfio_iommu_type1",
    "mdev",
    "mtty",
    "mdpy",
    "mbochs",
    "snd_hda_intel",
    "pci_stub",
)
SAMPLE_MODULES = ("mtty", "mdpy", "mbochs")

APT_TIMEOUT = 900
BUILD_TIMEOUT = 600


class AssetError(RuntimeError):
    """A piece the real-kernel tests need is missing; the message names it and the cause."""


def cache_root() -> Path:
    explicit = os.environ.get("KGP_REALNODE_CACHE")
    if explicit:
        return Path(explicit)
    system = Path("/var/cache/kubevirt-gpu-passthrough/realnode")
    probe = system if system.exists() else system.parent if system.parent.exists() else system.parent.parent
    if os.access(probe, os.W_OK):
        return system
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "kubevirt-gpu-passthrough" / "realnode"


def _run(argv: Sequence[str], what: str, timeout: float, cwd: Path | None = None) -> str:
    """Run ``argv``; an AssetError naming ``what`` and the cause on failure, absence or timeout."""
    try:
        done = subprocess.run(
            list(argv), cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False, errors="replace"
        )
    except FileNotFoundError:
        raise AssetError(f"{what}: {argv[0]} is not installed") from None
    except subprocess.TimeoutExpired:
        raise AssetError(f"{what}: {' '.join(argv[:3])} … timed out after {timeout:.0f} s") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
        raise AssetError(f"{what}: {' '.join(argv[:4])} … exited {done.returncode}:\n" + "\n".join(tail))
    return done.stdout


def _apt_field(package: str, field: str) -> str:
    text = _run(["apt-cache", "show", "--no-all-versions", package], f"resolving {package}", 120)
    match = re.search(rf"^{field}: (.+)$", text, re.MULTILINE)
    if match is None:
        raise AssetError(f"resolving {package}: apt-cache show has no {field} field (run apt-get update?)")
    return match.group(1).strip()


@dataclass(frozen=True)
class Resolved:
    """The exact packages of one kernel build."""

    abi: str
    """``6.1.0-57-amd64``: the kernel release (``uname -r`` in the guest)."""
    version: str
    """``6.1.192-3``: the Debian version of the image, headers and source packages."""
    busybox_version: str

    @property
    def image(self) -> str:
        return f"linux-image-{self.abi}"

    @property
    def key(self) -> str:
        return f"{self.image}_{self.version}"

    def packages(self) -> list[str]:
        flavour_free = self.abi.rsplit("-", 1)[0]
        return [
            f"{self.image}={self.version}",
            f"linux-headers-{self.abi}={self.version}",
            f"linux-headers-{flavour_free}-common={self.version}",
            f"linux-kbuild-6.1={self.version}",
            f"{SOURCE_PACKAGE}={self.version}",
            f"{BUSYBOX_PACKAGE}={self.busybox_version}",
        ]


def resolve() -> Resolved:
    """The current kernel ABI package behind ``linux-image-amd64`` and the versions to download."""
    depends = _apt_field(IMAGE_METAPACKAGE, "Depends")
    match = re.search(r"linux-image-(\d[\w.-]*-amd64)", depends)
    if match is None:
        raise AssetError(f"resolving {IMAGE_METAPACKAGE}: no linux-image-*-amd64 in its Depends ({depends})")
    abi = match.group(1)
    version = _apt_field(f"linux-image-{abi}", "Version")
    source_version = _apt_field(SOURCE_PACKAGE, "Version")
    if source_version != version:
        raise AssetError(
            f"linux-image-{abi} is {version} but {SOURCE_PACKAGE} is {source_version}: "
            "the mdev samples must be built from the image's own source (apt-get update?)"
        )
    return Resolved(abi, version, _apt_field(BUSYBOX_PACKAGE, "Version"))


@dataclass(frozen=True)
class Assets:
    """A built guest: what :func:`tests.realnode.guest.boot` needs."""

    directory: Path
    abi: str
    version: str
    vmlinux: Path
    initramfs: Path
    module_order: tuple[str, ...]
    """Every module in the initramfs, each after its dependencies."""
    dependencies: dict[str, tuple[str, ...]]

    def load_order(self, wanted: Iterable[str]) -> list[str]:
        """``wanted`` and their dependencies, in an order ``insmod`` accepts."""
        needed: set[str] = set()
        stack = [name.replace("-", "_") for name in wanted]
        while stack:
            name = stack.pop()
            if name in needed:
                continue
            if name not in self.dependencies:
                raise AssetError(f"module {name} is not in the guest's initramfs (add it to WANTED_MODULES)")
            needed.add(name)
            stack.extend(self.dependencies[name])
        return [name for name in self.module_order if name in needed]


def _read_assets(directory: Path) -> Assets | None:
    try:
        meta = json.loads((directory / "assets.json").read_text())
    except (OSError, ValueError):
        return None
    files = [directory / "vmlinux", directory / "initramfs.cpio"]
    if not all(path.is_file() for path in files):
        return None
    return Assets(
        directory=directory,
        abi=meta["abi"],
        version=meta["version"],
        vmlinux=files[0],
        initramfs=files[1],
        module_order=tuple(meta["module_order"]),
        dependencies={name: tuple(deps) for name, deps in meta["dependencies"].items()},
    )


def cached(resolved: Resolved | None = None) -> Assets | None:
    """The built assets for ``resolved`` (default: the newest built key in the cache), if present."""
    root = cache_root()
    if resolved is not None:
        return _read_assets(root / resolved.key)
    candidates = sorted(root.glob("linux-image-*/assets.json"), key=lambda path: path.stat().st_mtime, reverse=True)
    for meta in candidates:
        assets = _read_assets(meta.parent)
        if assets is not None:
            return assets
    return None


def ensure(log: bool = True) -> Assets:
    """Resolve, download, build and cache the guest; fast when the cache already holds this version."""
    resolved = resolve()
    done = cached(resolved)
    if done is not None:
        return done
    root = cache_root()
    debs = root / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    timings: dict[str, float] = {}

    def say(message: str) -> None:
        if log:
            print(f"realnode: {message} ({time.monotonic() - started:.1f} s)", flush=True)

    missing = [spec for spec in resolved.packages() if not _deb_for(debs, spec)]
    if missing:
        say(f"downloading {', '.join(spec.split('=')[0] for spec in missing)}")
        # Downloaded as root into a root-owned directory, apt's _apt sandbox user cannot write: say so quietly.
        _run(["apt-get", "download", "-q", *missing], "apt-get download (Debian's package registry)", APT_TIMEOUT, debs)
    timings["download"] = time.monotonic() - started
    for spec in resolved.packages():
        if not _deb_for(debs, spec):
            raise AssetError(f"apt-get download did not leave a .deb for {spec} in {debs}")

    target = root / resolved.key
    with tempfile.TemporaryDirectory(prefix="realnode-build-", dir=root) as scratch_name:
        scratch = Path(scratch_name)
        tree = scratch / "tree"
        step = time.monotonic()
        for spec in resolved.packages():
            if spec.startswith(SOURCE_PACKAGE):
                continue
            _run(["dpkg", "-x", str(_deb_for(debs, spec)), str(tree)], f"unpacking {spec}", BUILD_TIMEOUT)
        timings["unpack"] = time.monotonic() - step
        say("unpacked the kernel, headers, kbuild and busybox")

        step = time.monotonic()
        samples = _build_samples(resolved, debs, tree, scratch)
        timings["build_samples"] = time.monotonic() - step
        say(f"built {', '.join(path.name for path in samples)} from {SOURCE_PACKAGE}")

        staging = scratch / "out"
        (staging / "modules").mkdir(parents=True)
        _extract_vmlinux(tree / "boot" / f"vmlinuz-{resolved.abi}", staging / "vmlinux")
        index = _module_index(tree / "lib" / "modules" / resolved.abi, samples)
        dependencies, order = _closure(index, WANTED_MODULES)
        for name in order:
            shutil.copy2(index[name], staging / "modules" / f"{name}.ko")
        busybox = tree / "bin" / "busybox"
        _write_initramfs(staging / "initramfs.cpio", busybox, staging / "modules", order)
        timings["total"] = time.monotonic() - started
        meta = {
            "abi": resolved.abi,
            "version": resolved.version,
            "busybox": resolved.busybox_version,
            "packages": resolved.packages(),
            "module_order": order,
            "dependencies": {name: dependencies[name] for name in order},
            "seconds": {name: round(value, 1) for name, value in timings.items()},
        }
        (staging / "assets.json").write_text(json.dumps(meta, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    say(f"guest assets ready in {target}")
    assets = _read_assets(target)
    if assets is None:
        raise AssetError(f"{target}: built, but cannot be read back")
    return assets


def _deb_for(debs: Path, spec: str) -> Path | None:
    name, _, version = spec.partition("=")
    # apt-get download escapes the epoch's colon as %3a.
    pattern = f"{name}_{version.replace(':', '%3a')}_*.deb"
    found = sorted(debs.glob(pattern))
    return found[0] if found else None


def _build_samples(resolved: Resolved, debs: Path, tree: Path, scratch: Path) -> list[Path]:
    """mtty, mdpy and mbochs from ``linux-source-6.1``'s samples/vfio-mdev, against the image's headers."""
    source_deb = _deb_for(debs, f"{SOURCE_PACKAGE}={resolved.version}")
    assert source_deb is not None
    source = scratch / "samples"
    source.mkdir()
    member = "./usr/src/linux-source-6.1.tar.xz"
    deb = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(source_deb)], stdout=subprocess.PIPE)
    try:
        tar_xz = _run_stdin(deb, ["tar", "-xO", member], f"reading {member} from {source_deb.name}")
    finally:
        if deb.stdout is not None:
            deb.stdout.close()
        try:
            deb.wait(timeout=60)
        except subprocess.TimeoutExpired:
            deb.kill()
            deb.wait()
    _run_with_input(
        ["tar", "-xJ", "--strip-components=3", "-C", str(source), "linux-source-6.1/samples/vfio-mdev"],
        tar_xz,
        f"extracting samples/vfio-mdev from {member}",
    )
    headers = tree / "usr" / "src" / f"linux-headers-{resolved.abi}"
    makefile = headers / "Makefile"
    # Debian's per-flavour Makefile includes the common headers by absolute path; point it at the unpacked copy.
    makefile.write_text(makefile.read_text().replace("include /usr/src/", f"include {tree}/usr/src/"))
    flags = [f"CONFIG_SAMPLE_VFIO_MDEV_{name.upper()}=m" for name in SAMPLE_MODULES]
    _run(
        ["make", "-C", str(headers), f"M={source}", f"-j{os.cpu_count() or 1}", *flags, "modules"],
        "building the mdev sample modules (needs gcc-12 and make)",
        BUILD_TIMEOUT,
    )
    built = [source / f"{name}.ko" for name in SAMPLE_MODULES]
    for path in built:
        if not path.is_file():
            raise AssetError(f"building the mdev samples left no {path.name}")
    return built


def _run_stdin(producer: subprocess.Popen[bytes], argv: list[str], what: str) -> bytes:
    try:
        done = subprocess.run(argv, stdin=producer.stdout, capture_output=True, timeout=BUILD_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        producer.kill()
        raise AssetError(f"{what}: timed out after {BUILD_TIMEOUT} s") from None
    if done.returncode != 0:
        raise AssetError(f"{what}: {done.stderr.decode(errors='replace').strip()[-500:]}")
    return done.stdout


def _run_with_input(argv: list[str], data: bytes, what: str) -> None:
    try:
        done = subprocess.run(argv, input=data, capture_output=True, timeout=BUILD_TIMEOUT, check=False)
    except subprocess.TimeoutExpired:
        raise AssetError(f"{what}: timed out after {BUILD_TIMEOUT} s") from None
    if done.returncode != 0:
        raise AssetError(f"{what}: {done.stderr.decode(errors='replace').strip()[-500:]}")


def _extract_vmlinux(vmlinuz: Path, target: Path) -> None:
    """Debian's bzImage holds an xz-compressed ELF ``vmlinux``; QEMU boots it directly (PVH, twice as fast)."""
    data = vmlinuz.read_bytes()
    offset = data.find(b"\xfd7zXZ\x00")
    while offset >= 0:
        try:
            elf = lzma.LZMADecompressor(format=lzma.FORMAT_XZ).decompress(data[offset:])
        except lzma.LZMAError:
            elf = b""
        if elf.startswith(b"\x7fELF"):
            target.write_bytes(elf)
            return
        offset = data.find(b"\xfd7zXZ\x00", offset + 1)
    raise AssetError(f"{vmlinuz}: no xz-compressed ELF kernel inside (not CONFIG_KERNEL_XZ?)")


def _module_depends(path: Path) -> list[str]:
    data = path.read_bytes()
    match = re.search(rb"(?:^|\x00)depends=([^\x00]*)\x00", data)
    if match is None:
        return []
    return [name.replace("-", "_") for name in match.group(1).decode().split(",") if name]


def _module_index(modules_dir: Path, extra: Iterable[Path]) -> dict[str, Path]:
    index: dict[str, Path] = {}
    for path in modules_dir.rglob("*.ko"):
        index[path.name[:-3].replace("-", "_")] = path
    for path in extra:
        index[path.name[:-3].replace("-", "_")] = path
    return index


def _closure(index: dict[str, Path], wanted: Iterable[str]) -> tuple[dict[str, list[str]], list[str]]:
    dependencies: dict[str, list[str]] = {}
    order: list[str] = []

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in dependencies:
            return
        if name in chain:
            raise AssetError(f"module dependency cycle: {' -> '.join((*chain, name))}")
        path = index.get(name)
        if path is None:
            raise AssetError(f"module {name} (needed by {' -> '.join(chain) or 'the guest'}) is not in the image")
        deps = _module_depends(path)
        for dep in deps:
            visit(dep, (*chain, name))
        dependencies[name] = deps
        order.append(name)

    for name in wanted:
        visit(name, ())
    return dependencies, order


INIT = r"""#!/bin/busybox sh
# The guest's /init (tests/realnode/assets.py). Loads the modules named on the kernel command line
# (rn.load=a,b,...), mounts the host's root read-only over 9p, tmpfs on /tmp and /run, the results share on
# /tmp/realnode, runs /tmp/realnode/cmd.sh chrooted into the host root and powers off. Its exit status goes
# to /tmp/realnode/rc.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
load=$(sed -n 's/.*rn\.load=\([^ ]*\).*/\1/p' /proc/cmdline | tr , ' ')
for module in $load; do
    insmod /lib/modules/$module.ko 2>/tmp/insmod.err || echo "realnode: insmod $module: $(cat /tmp/insmod.err)"
done
fail() { echo "realnode: $*"; poweroff -f; }
mkdir -p /newroot /results
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=loose,ro hostroot /newroot \
    || fail "cannot mount the host root"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 results /results || fail "cannot mount the results share"
mount -t proc proc /newroot/proc
mount -t sysfs sysfs /newroot/sys
mount -t devtmpfs devtmpfs /newroot/dev
mount -t tmpfs -o mode=1777 tmpfs /newroot/tmp
mount -t tmpfs -o mode=755 tmpfs /newroot/run
mkdir -p /newroot/tmp/realnode /newroot/dev/pts /newroot/dev/shm
mount -t devpts devpts /newroot/dev/pts
mount -t tmpfs tmpfs /newroot/dev/shm
mount --bind /results /newroot/tmp/realnode
[ -e /sys/kernel/debug ] && mount -t debugfs debugfs /newroot/sys/kernel/debug 2>/dev/null
echo "realnode: running cmd.sh"
chroot /newroot /bin/sh -c 'cd /tmp/realnode && HOME=/tmp exec /bin/sh ./cmd.sh' \
    >/results/stdout 2>/results/stderr </dev/null
echo $? > /results/rc
sync
poweroff -f
"""


def _write_initramfs(target: Path, busybox: Path, modules: Path, order: list[str]) -> None:
    """A newc cpio archive: /init, /bin/busybox, /lib/modules/<name>.ko."""
    entries: list[tuple[str, int, bytes]] = []
    for directory in ("bin", "dev", "proc", "sys", "tmp", "lib", "lib/modules", "newroot", "results"):
        entries.append((directory, stat.S_IFDIR | 0o755, b""))
    entries.append(("init", stat.S_IFREG | 0o755, INIT.encode()))
    entries.append(("bin/busybox", stat.S_IFREG | 0o755, busybox.read_bytes()))
    entries.append(("bin/sh", stat.S_IFLNK | 0o777, b"busybox"))
    entries.extend(
        (f"lib/modules/{name}.ko", stat.S_IFREG | 0o644, (modules / f"{name}.ko").read_bytes()) for name in order
    )
    with target.open("wb") as out:
        write_newc(out, [(name, mode, data, 0) for name, mode, data in entries])


def write_newc(out: BinaryIO, entries: Iterable[tuple[str, int, bytes, int]]) -> None:
    """``entries`` (path, mode, contents, mtime; parents first) as one newc cpio archive, trailer included. The kernel
    unpacks archives written one after another into the same rootfs (see scenarios.python_initramfs)."""
    for number, (name, mode, data, mtime) in enumerate([*entries, ("TRAILER!!!", 0, b"", 0)], start=1):
        encoded = name.encode() + b"\x00"
        header = "070701" + "".join(
            f"{value:08X}" for value in (number, mode, 0, 0, 1, mtime, len(data), 0, 0, 0, 0, len(encoded), 0)
        )
        out.write(header.encode() + encoded)
        out.write(b"\x00" * (-(110 + len(encoded)) % 4))
        out.write(data)
        out.write(b"\x00" * (-len(data) % 4))
