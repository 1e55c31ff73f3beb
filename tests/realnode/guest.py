"""Boot a throwaway guest node under QEMU (TCG) with a chosen device set, run a command in it, collect results.

The guest is ``qemu-system-x86_64 -M q35,accel=tcg`` with Debian's kernel (the PVH ``vmlinux`` under qboot),
``-device intel-iommu,intremap=on`` unless ``iommu=False``, and emulated PCI functions standing in for a GPU
node. The host's ``/`` is mounted read-only over virtio-9p and the command runs chrooted into it, so the
project's own venv and programs run against the guest kernel's sysfs and ``/dev/vfio``. A second 9p share
is the guest's ``/tmp/realnode``: the command's working directory, holding ``cmd.sh``, the files given to
:func:`boot` and whatever the command writes there; the guest's init adds ``stdout``, ``stderr`` and ``rc``.

Each boot stops by itself: the init powers off after the command, the kernel has ``panic=-1`` and QEMU
``-no-reboot``, and :func:`boot` kills QEMU's whole process group after ``timeout`` seconds (naming the
cause, with the console's tail). No process is left behind either way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.realnode.assets import BASE_MODULES, Assets

QEMU = "qemu-system-x86_64"
QBOOT = Path("/usr/share/qemu/qboot.rom")

# The emulated node. IDs are what the plugin's configuration selects (no QEMU device takes NVIDIA's vendor
# ID); tests find the functions by these IDs, never by address, because bus and group numbers shift.
GPU_ID = "1234:1111"  # bochs-display, display class: the "GPU"
AUDIO_ID = "8086:293e"  # ich9-intel-hda at function 1 of the GPU's slot: its audio companion (same group)
EDU_ID = "1234:11e8"  # edu, in its own root port
TESTDEV_ID = "1b36:0005"  # pci-testdev, in its own root port

DEVICE_SETS: dict[str, tuple[str, ...]] = {
    # The GPU with its audio function, multifunction behind one root port: one IOMMU group.
    "gpu": (
        "-device", "pcie-root-port,id=rp1,chassis=1,port=1,bus=pcie.0,addr=0x10",
        "-device", "bochs-display,bus=rp1,addr=0x0.0x0,multifunction=on",
        "-device", "ich9-intel-hda,bus=rp1,addr=0x0.0x1",
    ),
    "edu": (
        "-device", "pcie-root-port,id=rp2,chassis=2,port=2,bus=pcie.0,addr=0x11",
        "-device", "edu,bus=rp2",
    ),
    "testdev": (
        "-device", "pcie-root-port,id=rp3,chassis=3,port=3,bus=pcie.0,addr=0x12",
        "-device", "pci-testdev,bus=rp3",
    ),
}  # fmt: skip
DEFAULT_DEVICES = ("gpu", "edu", "testdev")


class BootError(RuntimeError):
    """The guest did not run the command to its end: the message says why and shows the console's tail."""


@dataclass(frozen=True)
class BootResult:
    rc: int
    stdout: str
    stderr: str
    console: str
    results: Path
    """The guest's /tmp/realnode, as left on the host."""
    seconds: float

    def file(self, name: str) -> str:
        return (self.results / name).read_text(errors="replace")

    def describe(self) -> str:
        """Everything a failing assertion should show."""
        return (
            f"guest exit status {self.rc} after {self.seconds:.1f} s\n--- stdout\n{self.stdout[-6000:]}\n"
            f"--- stderr\n{self.stderr[-6000:]}\n--- console (tail)\n{self.console[-3000:]}"
        )


def qemu_argv(
    assets: Assets,
    results: Path,
    *,
    iommu: bool,
    devices: Sequence[str],
    modules: Iterable[str],
    memory_mb: int,
) -> list[str]:
    load = assets.load_order([*BASE_MODULES, *modules])
    append = [
        "console=ttyS0",
        "panic=-1",
        "quiet",
        "loglevel=4",
        "mitigations=off",
        "tsc=reliable",
        f"rn.load={','.join(load)}",
        "intel_iommu=on" if iommu else "intel_iommu=off",
    ]
    argv = [
        QEMU,
        "-M", "q35,accel=tcg",
        "-m", str(memory_mb),
        "-smp", "2",
        "-nodefaults", "-no-user-config", "-no-reboot",
        "-display", "none", "-monitor", "none", "-serial", "stdio",
        "-bios", str(QBOOT),
        "-kernel", str(assets.vmlinux),
        "-initrd", str(assets.initramfs),
        "-append", " ".join(append),
    ]  # fmt: skip
    if iommu:
        argv += ["-device", "intel-iommu,intremap=on"]
    for name in devices:
        argv += DEVICE_SETS[name]
    argv += [
        "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device", "virtio-9p-pci,fsdev=hostroot,mount_tag=hostroot,bus=pcie.0,addr=0x8",
        "-fsdev", f"local,id=results,path={results},security_model=none",
        "-device", "virtio-9p-pci,fsdev=results,mount_tag=results,bus=pcie.0,addr=0x9",
    ]  # fmt: skip
    return argv


def boot(
    assets: Assets,
    command: str,
    results: Path,
    *,
    iommu: bool = True,
    devices: Sequence[str] = DEFAULT_DEVICES,
    modules: Iterable[str] = (),
    files: Mapping[str, str] = {},
    timeout: float = 120.0,
    memory_mb: int = 1024,
    service: Callable[[Path], None] | None = None,
) -> BootResult:
    """Boot, run ``command`` (a ``/bin/sh`` script) in the guest, and return its exit status and files.

    ``results`` (created) becomes the guest's ``/tmp/realnode``; ``files`` are written there first.
    A guest that does not finish within ``timeout`` seconds is killed and :class:`BootError` raised.
    ``service``, if given, is called with ``results`` every 50 ms while the guest runs: the host's side of a
    conversation through the shared directory (e.g. libvirt's ``domxml-to-native``, which needs the host).
    """
    if not QBOOT.is_file():
        raise BootError(f"{QBOOT} is missing (Debian package qemu-system-data)")
    results.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (results / name).write_text(text)
    (results / "cmd.sh").write_text(command)
    for name in ("rc", "stdout", "stderr"):
        (results / name).unlink(missing_ok=True)
    argv = qemu_argv(assets, results, iommu=iommu, devices=devices, modules=modules, memory_mb=memory_mb)
    (results / "qemu.argv").write_text("\n".join(argv) + "\n")
    console_path = results / "console.log"
    started = time.monotonic()
    with console_path.open("wb") as console:
        try:
            process = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT, start_new_session=True
            )
        except FileNotFoundError:
            raise BootError(f"{QEMU} is not installed (Debian package qemu-system-x86)") from None
        try:
            deadline = started + timeout
            while process.poll() is None and time.monotonic() < deadline:
                if service is not None:
                    service(results)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(timeout=0.05)
        finally:
            _stop(process)
    seconds = time.monotonic() - started
    (results / "boot.seconds").write_text(f"{seconds:.1f}\n")
    console_text = console_path.read_text(errors="replace")
    rc_path = results / "rc"
    if not rc_path.is_file():
        why = (
            f"timed out after {timeout:.0f} s"
            if seconds >= timeout
            else f"QEMU exited {process.returncode} after {seconds:.1f} s"
        )
        raise BootError(f"the guest did not finish its command: {why}\n--- console (tail)\n{console_text[-4000:]}")
    return BootResult(
        rc=int(rc_path.read_text().strip() or "-1"),
        stdout=_read(results / "stdout"),
        stderr=_read(results / "stderr"),
        console=console_text,
        results=results,
        seconds=seconds,
    )


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Kill QEMU's process group if it is still there, and reap it."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    process.wait(timeout=30)
