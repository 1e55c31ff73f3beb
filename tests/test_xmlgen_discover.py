"""``xmlgen discover`` as a user runs it on a node (here: the fixture trees): table, JSON, CR block, errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from simkit.fixture_nodes import MIXED_NODE, NODE01, T4_1Q_A, T4_1Q_B, T4_2Q, VGPU_NODE, WORKSTATION_NODE
from tests.discovery_support import build_node
from xmlgen.cli import cli

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"


def run(*args: str, env: dict[str, str | None] | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["discover", *args], env=env, catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.fixture(scope="module")
def trees(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("nodes")
    return {node.name: build_node(node, base) for node in (NODE01, VGPU_NODE, MIXED_NODE)}


def test_table_for_node01(trees: dict[str, Path]) -> None:
    code, out, err = run("--host-root", str(trees["node01"]))
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == f"{TU106}  (pci, 4 of 4 healthy)"
    assert "  env PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A" in lines
    assert "  socket kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock" in lines
    row = next(line for line in lines if line.startswith("  0000:86:00.0"))
    assert row.split() == [
        "0000:86:00.0",
        "74",
        "1",
        "pci0000:85",
        "-",
        "Healthy",
        "0000:86:00.1,0000:86:00.2,0000:86:00.3",
    ]
    assert "not offered:" in lines
    assert any(line.split()[:3] == ["0000:d8:00.0", "10DE:1EB8", "nvidia"] for line in lines)


def test_table_shows_the_pcie_switch_a_gpu_is_below(tmp_path: Path) -> None:
    """docs/p2p.md: the workstation's pair shares a switch (one GPUDirect clique in a VM), the third has none."""
    code, out, _warnings = run("--host-root", str(build_node(WORKSTATION_NODE, tmp_path)))
    assert code == 0
    lines = out.splitlines()
    assert "PCIE SWITCH" in next(line for line in lines if "DEVICE" in line)
    switches = {line.split()[0]: line.split()[4] for line in lines if line.startswith("  0000:0")}
    assert switches == {"0000:03:00.0": "0000:01:00.0", "0000:04:00.0": "0000:01:00.0", "0000:05:00.0": "-"}


def test_table_shows_unhealthy_reason_and_unknown_numa(trees: dict[str, Path]) -> None:
    code, out, err = run("--host-root", str(trees["gpu-mixed01"]))
    assert code == 0
    assert "nvidia.com/GA102_GEFORCE_RTX_3090  (pci, 0 of 1 healthy)" in out
    assert "    reason: IOMMU group 74 is not viable: 0000:86:00.1 (10DE:1AEF audio) is bound to snd_hda_intel" in out
    row = next(line for line in out.splitlines() if line.startswith("  0000:5e:00.0"))
    assert row.split()[2] == "?"
    assert err.startswith("warning: 10DE:2FFF is not in ")


def test_json_shape_sorted(trees: dict[str, Path]) -> None:
    code, out, err = run("--host-root", str(trees["gpu-mixed01"]), "--json")
    assert code == 0
    assert "warning:" in err
    document = json.loads(out)
    names = [resource["name"] for resource in document["resources"]]
    assert names == sorted(names) == ["nvidia.com/2fff", "nvidia.com/GA102GL_A10", "nvidia.com/GA102_GEFORCE_RTX_3090"]
    a10 = document["resources"][1]
    assert a10 == {
        "name": "nvidia.com/GA102GL_A10",
        "kind": "pci",
        "env": "PCI_RESOURCE_NVIDIA_COM_GA102GL_A10",
        "socket": "kubevirt-GA102GL_A10.sock",
        "devices": [
            {
                "id": "0000:3b:00.0",
                "iommu_group": 30,
                "numa_node": 0,
                "healthy": True,
                "reason": None,
                "companions": [],
            },
            {
                "id": "0000:d8:00.0",
                "iommu_group": 118,
                "numa_node": 1,
                "healthy": True,
                "reason": None,
                "companions": [],
            },
        ],
    }
    assert document["resources"][0]["devices"][0]["numa_node"] is None
    rtx = document["resources"][2]["devices"][0]
    assert rtx["healthy"] is False
    assert "snd_hda_intel" in rtx["reason"]


def test_json_for_vgpus(trees: dict[str, Path]) -> None:
    code, out, _ = run("--host-root", str(trees["gpu-vgpu01"]), "--json")
    assert code == 0
    resources = json.loads(out)["resources"]
    assert [(resource["name"], resource["kind"], resource["env"]) for resource in resources] == [
        ("nvidia.com/GRID_T4-1Q", "mdev", "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"),
        ("nvidia.com/GRID_T4-2Q", "mdev", "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-2Q"),
    ]
    assert [device["id"] for device in resources[0]["devices"]] == sorted([T4_1Q_A, T4_1Q_B])
    assert resources[1]["devices"][0]["id"] == T4_2Q


def test_permitted_host_devices_block_pastes_into_the_cr(trees: dict[str, Path]) -> None:
    code, out, err = run("--host-root", str(trees["node01"]), "--permitted-host-devices")
    assert (code, err) == (0, "")
    assert '    - pciVendorSelector: "10DE:1F08"' in out
    assert yaml.safe_load(out) == {
        "permittedHostDevices": {
            "pciHostDevices": [
                {"pciVendorSelector": "10DE:1F08", "resourceName": TU106, "externalResourceProvider": True}
            ],
            "mediatedDevices": [],
        }
    }
    code, out, _ = run("--host-root", str(trees["gpu-vgpu01"]), "--permitted-host-devices")
    assert code == 0
    block = yaml.safe_load(out)["permittedHostDevices"]
    assert block["pciHostDevices"] == []
    assert block["mediatedDevices"] == [
        {"mdevNameSelector": "GRID T4-1Q", "resourceName": "nvidia.com/GRID_T4-1Q", "externalResourceProvider": True},
        {"mdevNameSelector": "GRID T4-2Q", "resourceName": "nvidia.com/GRID_T4-2Q", "externalResourceProvider": True},
    ]
    code, out, _ = run("--host-root", str(trees["gpu-vgpu01"]), "--permitted-host-devices", "--json")
    assert code == 0
    assert json.loads(out) == {"permittedHostDevices": block}


def test_config_file_and_env(trees: dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "plugin.yaml"
    config.write_text(f"host_root: {trees['gpu-mixed01']}\nname_overrides:\n  10DE:2FFF: NEW_GPU\n", encoding="utf-8")
    code, out, err = run("--config", str(config), "--json")
    assert (code, err) == (0, "")
    assert "nvidia.com/NEW_GPU" in [resource["name"] for resource in json.loads(out)["resources"]]
    code, out, _ = run("--json", env={"GPU_PLUGIN_CONFIG": str(config), "GPU_PLUGIN_PCI_SELECTORS": "10DE:2236"})
    assert code == 0
    assert [resource["name"] for resource in json.loads(out)["resources"]] == ["nvidia.com/GA102GL_A10"]


def test_pci_ids_flag(trees: dict[str, Path], tmp_path: Path) -> None:
    ids = tmp_path / "pci.ids"
    ids.write_text("10de  NVIDIA Corporation\n\t1f08  Flagged [Name]\n", encoding="utf-8")
    code, out, _ = run("--host-root", str(trees["node01"]), "--pci-ids", str(ids), "--json")
    assert code == 0
    assert json.loads(out)["resources"][0]["name"] == "nvidia.com/FLAGGED_NAME"


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (["--pci-ids", "/nonexistent/pci.ids"], "/nonexistent/pci.ids"),
        (["--config", "/nonexistent/plugin.yaml"], "/nonexistent/plugin.yaml"),
        (["--host-root", "/nonexistent/host"], "/nonexistent/host"),
    ],
)
def test_bad_paths_fail_cleanly(trees: dict[str, Path], args: list[str], culprit: str) -> None:
    if "--host-root" not in args:
        args = ["--host-root", str(trees["node01"]), *args]
    code, out, err = run(*args, "--json")
    assert (code, out) == (1, "")
    assert err.startswith("error: ")
    assert culprit in err


def test_broken_config_fails_cleanly(trees: dict[str, Path], tmp_path: Path) -> None:
    config = tmp_path / "broken.yaml"
    config.write_text("pci_selectors: ['NVIDIA']\n", encoding="utf-8")
    code, out, err = run("--host-root", str(trees["node01"]), "--config", str(config))
    assert (code, out) == (1, "")
    assert str(config) in err
    assert "pci_selectors" in err
    code, out, err = run("--host-root", str(trees["node01"]), env={"GPU_PLUGIN_VFIO_DRIVER": "vfio-pci"})
    assert (code, out) == (1, "")
    assert "GPU_PLUGIN_VFIO_DRIVER" in err


def test_directory_without_sysfs_fails_cleanly(tmp_path: Path) -> None:
    code, out, err = run("--host-root", str(tmp_path))
    assert (code, out) == (1, "")
    assert "sys/bus/pci/devices" in err


def test_as_a_process(trees: dict[str, Path]) -> None:
    env = {key: value for key, value in os.environ.items() if not key.startswith("GPU_PLUGIN_")}
    done = subprocess.run(
        [sys.executable, "-m", "xmlgen", "discover", "--host-root", str(trees["node01"]), "--json"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout)["resources"][0]["name"] == TU106
    failed = subprocess.run(
        [sys.executable, "-m", "xmlgen", "discover", "--pci-ids", "/nonexistent.ids"],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    assert (failed.returncode, failed.stdout) == (1, "")
    assert "/nonexistent.ids" in failed.stderr
