"""``xmlgen simulate``: the whole path (plugin → kubelet stand-in → Allocate → hook → libvirt) in one command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from lxml import etree

from simkit.fixture_nodes import NODE01
from simkit.sysfs_fixture import build
from tests.conftest import EXAMPLES
from tests.libvirt_support import missing

DEVICE_LINE = re.compile(r"^\s+-device (\{.*\})$", re.MULTILINE)


def simulate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xmlgen", "simulate", *args],
        capture_output=True,
        input="",
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


def hostdevs(domain: str) -> dict[str, str]:
    root = etree.fromstring(domain.encode())
    found = {}
    for hostdev in root.iterfind("devices/hostdev"):
        address = hostdev.find("source/address")
        assert address is not None
        alias = hostdev.find("alias")
        assert alias is not None
        found[str(alias.get("name"))] = address.get("uuid") or "{}:{}:{}.{}".format(
            *(str(address.get(part)).removeprefix("0x") for part in ("domain", "bus", "slot", "function"))
        )
    return found


def qemu_devices(stderr: str) -> dict[str, str]:
    if "QEMU argv not shown" in stderr:
        missing(stderr[stderr.index("QEMU argv not shown") :].splitlines()[0])
    devices = [json.loads(line) for line in DEVICE_LINE.findall(stderr)]
    return {device["id"]: device.get("host") or device["sysfsdev"].rpartition("/")[2] for device in devices}


@pytest.mark.libvirt
def test_node01_seed_vm_gets_two_gpus_into_qemus_argv() -> None:
    done = simulate("--check")
    assert done.returncode == 0, done.stderr
    written = hostdevs(done.stdout)
    # each TU106 with its audio, USB and UCSI functions (the plugin's PCI_COMPANIONS_*), one guest slot per card
    assert list(written) == [f"ua-gpu{gpu}{fn}" for gpu in (0, 1) for fn in ("", "-fn1", "-fn2", "-fn3")]
    assert all(re.fullmatch(r"0000:[0-9a-f]{2}:00\.0", written[alias]) for alias in ("ua-gpu0", "ua-gpu1"))
    assert all(
        written[f"{gpu}-fn{fn}"] == written[gpu][:-1] + str(fn) for gpu in ("ua-gpu0", "ua-gpu1") for fn in (1, 2, 3)
    )
    assert qemu_devices(done.stderr) == written
    assert "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A=" in done.stderr
    slots = re.findall(r"guest slot 0000:(0[12]):00 \(multifunction, bus \d is a pcie-root-port\): 0: pci", done.stderr)
    assert slots == ["01", "02"]
    assert '"multifunction":true,"addr":"0x0"' in done.stderr and '"addr":"0x0.0x3"' in done.stderr
    for step in ("1. node node01", "2. device plugin", "3. kubelet", "4. hook sidecar", "5. libvirt"):
        assert step in done.stderr
    assert "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A=" in done.stderr
    assert "not offered: 0000:d8:00.0" in done.stderr  # the T4 left on nvidia
    assert "kubelet sees capacity 4, allocatable 4" in done.stderr
    assert '"driver":"vfio-pci"' in done.stderr
    assert "  mmio64: not an OVMF (x86 EFI) guest: nothing written" in done.stderr


@pytest.mark.libvirt
def test_a100_node_efi_vm_gets_the_64bit_window_its_bar_needs() -> None:
    done = simulate("--node", "a100", "--check")
    assert done.returncode == 0, done.stderr
    assert list(hostdevs(done.stdout).values()) == ["0000:3b:00.0"]
    assert (
        "  mmio64: 0000:3b:00.0 BAR1 128 GiB, BAR3 32 MiB: 64-bit BARs span 131104 MiB, window 256 GiB → "
        "opt/ovmf/X-PciMmio64Mb=262144 (EFI guest, loader /usr/share/OVMF/OVMF_CODE.fd)"
    ) in done.stderr
    assert '<qemu:arg value="name=opt/ovmf/X-PciMmio64Mb,string=262144"></qemu:arg>' in done.stdout


@pytest.mark.libvirt
def test_vgpu_node_desktop_gets_mdevs_with_a_display() -> None:
    done = simulate("--node", "vgpu", "--check")
    assert done.returncode == 0, done.stderr
    written = hostdevs(done.stdout)
    assert list(written) == ["ua-gpu0", "ua-gpu1"]
    assert qemu_devices(done.stderr) == written
    assert "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q=" in done.stderr
    root = etree.fromstring(done.stdout.encode())
    desktop = next(h for h in root.iterfind("devices/hostdev") if h.find("alias[@name='ua-gpu0']") is not None)
    assert (desktop.get("type"), desktop.get("display"), desktop.get("ramfb")) == ("mdev", "on", "on")


def test_a_directory_node_and_a_custom_vmi(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "node")
    vmi = json.loads((EXAMPLES / "seed-node01" / "vmi.json").read_text())
    vmi["spec"]["domain"]["devices"]["gpus"] = [
        {"name": f"g{i}", "deviceName": "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"} for i in range(4)
    ]
    (tmp_path / "vmi.json").write_text(json.dumps(vmi))
    done = simulate("--node", str(root), "--vmi", str(tmp_path / "vmi.json"))
    assert done.returncode == 0, done.stderr
    written = hostdevs(done.stdout)
    gpus = sorted(source for alias, source in written.items() if "-fn" not in alias)
    assert gpus == ["0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0"]
    assert len(written) == 16  # each card's audio, USB and UCSI functions with it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--node", "nowhere"],
            "error: --node 'nowhere' is neither node01, vgpu, mixed, sriov-vgpu, a100 nor a directory",
        ),
        (
            ["--node", "mixed"],
            "error: the VMI asks for 2 nvidia.com/TU106_GEFORCE_RTX_2060_REV__A, but the node offers",
        ),
        (["--vmi", "-"], "error: VMI JSON is not valid JSON"),
    ],
)
def test_failures_name_the_step_and_print_nothing_on_stdout(args: list[str], message: str) -> None:
    done = simulate(*args)
    assert (done.returncode, done.stdout) == (1, "")
    assert message in done.stderr
