"""``xmlgen doctor`` on the fixture nodes, healthy and broken in each way it checks."""

from __future__ import annotations

import datetime
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from plugin.config import PluginConfig
from simkit.fixture_nodes import MIXED_NODE, NODE01, VGPU_NODE
from simkit.sysfs_fixture import Node, build
from xmlgen.cli import cli
from xmlgen.doctor import Check, Status, run_checks

FRESH = datetime.date(2023, 6, 1)  # the fixtures' pci.ids is version 2023.04.10


def node_tree(node: Node, tmp_path: Path, *, kubelet: bool = True) -> Path:
    root = build(node, tmp_path / node.name)
    if kubelet:
        plugins = root / "var/lib/kubelet/device-plugins"
        plugins.mkdir(parents=True)
        (plugins / "kubelet.sock").touch()
    return root


def checks(root: Path, tmp_path: Path, today: datetime.date = FRESH) -> dict[str, Check]:
    image = tmp_path / "empty-image"
    image.mkdir(exist_ok=True)
    return {check.name: check for check in run_checks(PluginConfig(host_root=str(root)), today=today, image_root=image)}


def test_healthy_node01_passes_with_one_warning_for_the_t4_left_on_nvidia(tmp_path: Path) -> None:
    found = checks(node_tree(NODE01, tmp_path), tmp_path)
    assert {name: check.status for name, check in found.items()} == {
        "IOMMU": Status.OK,
        "vfio-pci driver": Status.OK,
        "/dev/vfio/vfio": Status.OK,
        "GPU 0000:3b:00.0": Status.OK,
        "GPU 0000:5e:00.0": Status.OK,
        "GPU 0000:86:00.0": Status.OK,
        "GPU 0000:af:00.0": Status.OK,
        "GPU 0000:d8:00.0": Status.WARN,
        "pci.ids": Status.OK,
        "kubelet device-plugins dir": Status.OK,
    }
    assert "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A" in found["GPU 0000:86:00.0"].detail
    t4 = found["GPU 0000:d8:00.0"]
    assert "bound to nvidia" in t4.detail
    assert t4.fix is not None and "echo vfio-pci > /sys/bus/pci/devices/0000:d8:00.0/driver_override" in t4.fix
    assert "version 2023-04-10" in found["pci.ids"].detail


def test_a_companion_on_a_host_driver_fails_its_gpu_with_the_commands_to_fix_it(tmp_path: Path) -> None:
    found = checks(node_tree(MIXED_NODE, tmp_path), tmp_path)
    rtx = found["GPU 0000:86:00.0"]
    assert rtx.status is Status.FAIL
    assert "0000:86:00.1 (10DE:1AEF audio) is bound to snd_hda_intel" in rtx.detail
    assert rtx.fix is not None and "echo 0000:86:00.1 > /sys/bus/pci/devices/0000:86:00.1/driver/unbind" in rtx.fix
    names = found["resource names"]
    assert (names.status, "nvidia.com/2fff" in names.detail) == (Status.WARN, True)


def test_vgpu_node_needs_no_vfio_pci_and_its_parents_are_fine_on_nvidia(tmp_path: Path) -> None:
    root = node_tree(VGPU_NODE, tmp_path)
    found = checks(root, tmp_path)
    assert found["vfio-pci driver"].status is Status.OK
    assert "not needed" in found["vfio-pci driver"].detail
    parent = found["GPU 0000:3b:00.0"]
    assert (parent.status, "vGPU parent of 2 vGPU(s) (nvidia.com/GRID_T4-1Q)" in parent.detail) == (Status.OK, True)
    assert found["vGPU a297db4a-f4c2-11e6-90f6-d3b88d6c9525"].status is Status.OK
    assert not any(check.status is Status.FAIL for check in found.values())


@pytest.mark.parametrize(
    ("breakage", "check", "status", "words"),
    [
        ("sys/kernel/iommu_groups", "IOMMU", Status.FAIL, "intel_iommu=on"),
        ("sys/bus/pci/drivers/vfio-pci", "vfio-pci driver", Status.FAIL, "modprobe vfio-pci"),
        ("dev/vfio/vfio", "/dev/vfio/vfio", Status.FAIL, "modprobe vfio"),
        ("dev/vfio/74", "GPU 0000:86:00.0", Status.FAIL, "while a function of group 74 is on vfio-pci"),
        ("usr/share/misc/pci.ids", "pci.ids", Status.WARN, "apt-get install pci.ids"),
        ("var/lib/kubelet/device-plugins/kubelet.sock", "kubelet device-plugins dir", Status.WARN, "kubelet running"),
        ("var/lib/kubelet", "kubelet device-plugins dir", Status.FAIL, "--kubelet-dir"),
    ],
)
def test_each_broken_piece_is_reported_with_its_fix(
    tmp_path: Path, breakage: str, check: str, status: Status, words: str
) -> None:
    root = node_tree(NODE01, tmp_path)
    target = root / breakage
    shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
    found = checks(root, tmp_path)[check]
    assert found.status is status
    assert found.fix is not None and words in found.fix


def test_an_old_pci_ids_is_a_warning(tmp_path: Path) -> None:
    found = checks(node_tree(NODE01, tmp_path), tmp_path, today=datetime.date(2026, 11, 30))["pci.ids"]
    assert found.status is Status.WARN
    assert "is from 2023-04-10, 3 years old" in found.detail


def test_cli_exit_code_follows_fail(tmp_path: Path) -> None:
    runner = CliRunner()
    healthy = runner.invoke(cli, ["doctor", "--host-root", str(node_tree(NODE01, tmp_path / "a"))])
    assert healthy.exit_code == 0, healthy.output
    assert "OK    GPU 0000:86:00.0" in healthy.stdout
    broken = runner.invoke(cli, ["doctor", "--host-root", str(node_tree(MIXED_NODE, tmp_path / "b")), "--json"])
    assert broken.exit_code == 1
    report = json.loads(broken.stdout)
    assert {"check": "GPU 0000:86:00.0", "status": "FAIL"}.items() <= next(
        entry for entry in report if entry["check"] == "GPU 0000:86:00.0"
    ).items()


def test_cli_refuses_a_host_root_without_sys(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["doctor", "--host-root", str(tmp_path)])
    assert (result.exit_code, result.stdout) == (1, "")
    assert "error: no sys directory under the host root" in result.stderr
