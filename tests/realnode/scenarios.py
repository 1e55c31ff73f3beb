"""Host side of the in-guest scenarios (``tests/realnode/inguest.py``): boot, serve libvirt, read the record."""

from __future__ import annotations

import compileall
import json
import os
import shutil
import stat
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tests.realnode.assets import Assets, write_newc
from tests.realnode.guest import BootResult, boot

REPO = Path(__file__).resolve().parents[2]
PLUGIN_CONFIG = """pci_selectors: ["1234:1111"]
name_overrides: {"1234:1111": QEMU_BOCHS_DISPLAY}
mdev_parent_selectors: [mtty]
"""
BASE_DOMAIN = """<domain type="qemu">
  <name>realnode</name>
  <memory unit="MiB">64</memory>
  <os><type arch="x86_64" machine="q35">hvm</type></os>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
  </devices>
</domain>
"""
# The runtime's packages, copied into the guest's tmpfs in one archive: importing them over 9p under TCG
# costs ~30 s (mostly 9p reads and page faults on their .so files); anything not listed still comes from the
# venv over 9p (it stays last on the guest's sys.path).
RUNTIME_PACKAGES = (
    "grpc", "grpcio-*.dist-info", "lxml", "lxml-*.dist-info", "google", "protobuf-*.dist-info", "yaml", "_yaml",
    "click", "click-*.dist-info", "prometheus_client", "prometheus_client-*.dist-info", "typing_extensions.py",
    "typing_extensions-*.dist-info", "kubevirt_gpu_passthrough-*.dist-info",
)  # fmt: skip
def _project_packages() -> tuple[str, ...]:
    """The packages pyproject.toml installs (so a new one reaches the guest too), and the tests."""
    with (REPO / "pyproject.toml").open("rb") as file:
        include = tomllib.load(file)["tool"]["setuptools"]["packages"]["find"]["include"]
    return (*(pattern.rstrip("*") for pattern in include), "tests")


PROJECT_PACKAGES = _project_packages()
# The guest's /usr/bin/python3's standard library (the host's: the guest runs the host's root) goes in the bundle
# too: read cold over 9p it cost ~15 s of the first imports under TCG. Not what the scenarios never import.
STDLIB_SKIPPED = frozenset(
    {"test", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "pydoc_data", "site-packages",
     "dist-packages", f"config-{sys.version_info.major}.{sys.version_info.minor}-x86_64-linux-gnu"}
)  # fmt: skip


def guest_stdlib() -> Path:
    return Path("/usr/lib") / f"python{sys.version_info.major}.{sys.version_info.minor}"


MODULES = ("vfio_pci", "vfio_iommu_type1", "mtty", "mdpy", "mbochs", "snd_hda_intel")


@dataclass(frozen=True)
class Scenario:
    boot: BootResult
    observations: dict[str, Any]


def libvirt_native(results: Path) -> None:
    """Answer the guest's ``request-native``: libvirt's QEMU driver (on the host) turns domain.xml into argv."""
    request = results / "request-native"
    if not request.exists():
        return
    request.unlink()
    try:
        from xmlgen.libvirt_check import check_domain

        report = check_domain((results / "domain.xml").read_bytes())
        (results / "native.json.tmp").write_text(json.dumps(report.qemu_devices))
        (results / "native.json.tmp").rename(results / "native.json")
    except Exception as exc:
        (results / "native.error").write_text(f"{type(exc).__name__}: {exc}")


def compile_project() -> None:
    """Byte-compile the project on the host: the guest sees it read-only, and compiling under TCG costs seconds."""
    for package in PROJECT_PACKAGES:
        compileall.compile_dir(REPO / package, quiet=1)


def site_packages() -> Path:
    return REPO / ".venv" / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _tree_entries(source: Path, arcname: str) -> Iterator[tuple[str, int, bytes, int]]:
    """``source`` (a file or a directory tree) as newc entries under ``arcname``, mtimes kept (bytecode is
    checked against its source's mtime: a changed one would be recompiled, under TCG)."""
    info = source.lstat()
    if stat.S_ISLNK(info.st_mode):
        yield arcname, stat.S_IFLNK | 0o777, os.readlink(source).encode(), int(info.st_mtime)
    elif stat.S_ISDIR(info.st_mode):
        yield arcname, stat.S_IFDIR | 0o755, b"", int(info.st_mtime)
        for child in sorted(source.iterdir()):
            yield from _tree_entries(child, f"{arcname}/{child.name}")
    elif stat.S_ISREG(info.st_mode):
        yield arcname, stat.S_IFREG | (info.st_mode & 0o777), source.read_bytes(), int(info.st_mtime)


def python_initramfs(assets: Assets, target: Path) -> Assets:
    """The guest's initramfs with the runtime's packages and the project (with its bytecode) appended as a
    second cpio archive: the kernel unpacks it into the guest's rootfs as ``/py/site``, ``/py/repo`` and
    ``/py/stdlib`` (first on ``PYTHONPATH``), and
    cmd.sh bind-mounts it at ``/tmp/py`` (through ``/proc/1/root``). Nothing to copy in the guest: a tar
    unpacked from the 9p share took ~12 s under TCG. Returns the assets with that initramfs."""
    site = site_packages()
    entries: list[tuple[str, int, bytes, int]] = [
        ("py", stat.S_IFDIR | 0o755, b"", 0),
        ("py/site", stat.S_IFDIR | 0o755, b"", 0),
        ("py/repo", stat.S_IFDIR | 0o755, b"", 0),
    ]
    for pattern in RUNTIME_PACKAGES:
        for path in sorted(site.glob(pattern)):
            entries.extend(_tree_entries(path, f"py/site/{path.name}"))
    for package in PROJECT_PACKAGES:
        entries.extend(_tree_entries(REPO / package, f"py/repo/{package}"))
    stdlib = guest_stdlib()
    if stdlib.is_dir():
        entries.append(("py/stdlib", stat.S_IFDIR | 0o755, b"", 0))
        for path in sorted(stdlib.iterdir()):
            if path.name not in STDLIB_SKIPPED:
                entries.extend(_tree_entries(path, f"py/stdlib/{path.name}"))
    with target.open("wb") as out:
        with assets.initramfs.open("rb") as base:
            shutil.copyfileobj(base, out)
        out.write(b"\x00" * (-out.tell() % 4))
        write_newc(out, entries)
    return replace(assets, initramfs=target)


def run_scenario(assets: Assets, name: str, results: Path, *, iommu: bool = True, timeout: float = 240) -> Scenario:
    """Boot a guest and run ``python -m tests.realnode.inguest NAME`` in it with the project's venv."""
    compile_project()
    results.mkdir(parents=True, exist_ok=True)
    guest_assets = python_initramfs(assets, results / "initramfs-python.cpio")
    command = (
        'echo "realnode: cmd.sh at $(cut -d" " -f1 /proc/uptime) s of uptime" >&2\n'
        "mkdir -p /tmp/py && mount --bind /proc/1/root/py /tmp/py\n"
        "export PYTHONDONTWRITEBYTECODE=1"
        f" PYTHONPATH=/tmp/py/stdlib:/tmp/py/stdlib/lib-dynload:/tmp/py/site:/tmp/py/repo:{site_packages()}\n"
        f"export PATH={REPO}/.venv/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
        f"cd /tmp/py/repo && exec /usr/bin/python3 -m tests.realnode.inguest {name}\n"
    )
    result = boot(
        guest_assets,
        command,
        results,
        iommu=iommu,
        modules=MODULES,
        files={"plugin.yaml": PLUGIN_CONFIG, "base-domain.xml": BASE_DOMAIN},
        timeout=timeout,
        service=libvirt_native,
    )
    try:
        observations = json.loads((results / "observations.json").read_text())
    except (OSError, ValueError):
        observations = {}
    return Scenario(result, observations)
