"""The harness itself: a boot returns the command's exit status and files, and always stops by itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.realnode.assets import Assets
from tests.realnode.guest import BootError, boot

pytestmark = pytest.mark.realnode


def _qemu_processes_using(path: Path) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if b"qemu-system" in cmdline and str(path).encode() in cmdline:
            found.append(int(entry))
    return found


def test_a_guest_that_does_not_finish_is_stopped_and_named(realnode_assets: Assets, tmp_path: Path) -> None:
    results = tmp_path / "results"
    with pytest.raises(BootError, match=r"timed out after 20 s") as raised:
        boot(realnode_assets, "sleep 600\n", results, devices=(), timeout=20)
    assert "console (tail)" in str(raised.value)
    assert _qemu_processes_using(results) == []
    assert not (results / "rc").exists()


def test_a_command_returns_its_exit_status_and_files(realnode_assets: Assets, tmp_path: Path) -> None:
    results = tmp_path / "results"
    command = "uname -r > kernel.txt; ls /dev/vfio > vfio.txt; echo to-stdout; echo to-stderr >&2; exit 3\n"
    done = boot(realnode_assets, command, results, devices=("edu",), modules=("vfio_pci",), timeout=90)
    assert done.rc == 3, done.describe()
    assert done.stdout == "to-stdout\n"
    assert done.stderr == "to-stderr\n"
    assert done.file("kernel.txt").strip() == realnode_assets.abi
    assert done.file("vfio.txt").split() == ["vfio"]
    assert _qemu_processes_using(results) == []


def test_the_scenario_boots_left_no_process(
    node: object, iommu_off: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    base = tmp_path_factory.getbasetemp()
    assert _qemu_processes_using(base) == []
