"""``runtime.sysfs_paths.SysfsView``: the hook's sysfs reads (companions, BARs) resolved beneath the root by the
kernel (``openat2`` ``RESOLVE_BENEATH``), and by ``Resolver`` in Python where the kernel cannot (issue 26).

Both ways give the same answers on every fixture node and on a tree damaged as an attacker or a broken host
could (a device link out of the root by ``..`` and by an absolute target, loops, dangling links, a link to
itself); ``driver`` and ``iommu_group`` are read by their target's last component, as the device plugin reads
them, so a link of theirs that leads out of the root is never followed; no descriptor outlives a call.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime import sysfs_paths
from runtime.pci_bars import SysfsBars
from runtime.pci_companions import SysfsCompanions
from schemas import InputError
from schemas.pci import PciAddress
from simkit.fixture_nodes import NODES
from simkit.sysfs_fixture import build
from tests.libvirt_support import missing

DEVICES = "bus/pci/devices"


@pytest.fixture
def python_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The process as on a kernel without ``openat2``."""
    monkeypatch.setattr(sysfs_paths._Kernel, "openat2", None)


def _kind(exc: InputError) -> str:
    text = str(exc)
    for phrase in (
        "leads out of that root",
        "is not a directory",
        "does not exist",
        "not a class code",
        "Too many levels of symbolic links",
    ):
        if phrase in text:
            return phrase
    return text


def _outcomes(sys: Path) -> dict[str, object]:
    """What the companion reader and the BAR reader say of every device of the tree (and of two absent ones)."""
    names = [*sorted(os.listdir(sys / DEVICES)), "0000:86:00.7", "0000:ff:1f.7"]
    addresses = [PciAddress.parse(name) for name in names]
    found: dict[str, object] = {}
    companions = SysfsCompanions(sys).read_all(addresses, addresses)
    for address, outcome in zip(addresses, companions, strict=True):
        found[f"companions {address}"] = _kind(outcome) if isinstance(outcome, InputError) else outcome
        try:
            found[f"bars {address}"] = SysfsBars(sys).read(address)
        except InputError as exc:
            found[f"bars {address}"] = _kind(exc)
    return found


def _damage(sys: Path, outside: Path) -> None:
    devices = sys / DEVICES
    audio = (devices / "0000:86:00.1").resolve()
    (audio / "iommu_group").unlink()
    (audio / "iommu_group").symlink_to("iommu_group")  # a link to itself
    (audio / "driver").unlink()
    (audio / "driver").symlink_to(str(outside / "vfio-pci"))  # absolute, out of the root: read, never followed
    ucsi = (devices / "0000:86:00.3").resolve()
    (ucsi / "driver").unlink()
    (ucsi / "driver").symlink_to("../gone")  # dangling
    (devices / "0000:af:00.1").unlink()
    (devices / "0000:af:00.1").symlink_to("0000:af:00.2")
    (devices / "0000:af:00.2").unlink()
    (devices / "0000:af:00.2").symlink_to("0000:af:00.1")  # a loop of two
    (devices / "0000:af:00.3").unlink()
    (devices / "0000:af:00.3").symlink_to(os.path.relpath(outside, devices))  # out by ..
    (devices / "0000:86:00.2").unlink()
    (devices / "0000:86:00.2").symlink_to(outside)  # out, absolute
    (devices / "0000:3c:00.0").symlink_to("../../../devices/gone")  # dangling device link


@pytest.mark.parametrize("name", sorted(NODES))
def test_the_kernel_and_python_agree_on_every_fixture_node(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    sys = build(NODES[name], tmp_path / "root") / "sys"
    kernel = _outcomes(sys)
    monkeypatch.setattr(sysfs_paths._Kernel, "openat2", None)
    assert _outcomes(sys) == kernel
    failed = {key for key, value in kernel.items() if isinstance(value, str)}
    assert {key.split()[1] for key in failed} == {"0000:86:00.7", "0000:ff:1f.7"}  # only the absent ones


def test_the_kernel_and_python_agree_on_a_damaged_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sys = build(NODES["node01"], tmp_path / "root") / "sys"
    outside = tmp_path / "outside"
    (outside / "vfio-pci").mkdir(parents=True)
    (outside / "resource").write_text("0x0 0x0 0x0\n" * 6)
    _damage(sys, outside)
    kernel = _outcomes(sys)
    monkeypatch.setattr(sysfs_paths._Kernel, "openat2", None)
    assert _outcomes(sys) == kernel
    assert kernel["bars 0000:86:00.2"] == kernel["bars 0000:af:00.3"] == "leads out of that root"
    assert kernel["bars 0000:af:00.1"] == "Too many levels of symbolic links"
    assert kernel["bars 0000:3c:00.0"] == "does not exist"
    assert kernel["companions 0000:af:00.1"] == "is not a directory"
    # the GPU's companions: the audio function's group link loops (no group), the USB function leads out
    # (an error naming it), so the card is refused as a whole
    assert kernel["companions 0000:86:00.0"] == "leads out of that root"


def test_a_driver_link_out_of_the_root_is_read_by_its_name_never_followed(tmp_path: Path) -> None:
    """The plugin's rule: the driver is the last component of the link's target."""
    sys = build(NODES["node01"], tmp_path / "root") / "sys"
    usb = (sys / DEVICES / "0000:86:00.2").resolve()
    (usb / "driver").unlink()
    (usb / "driver").symlink_to(str(tmp_path / "elsewhere" / "vfio-pci"))  # nothing there: never looked at
    companions = SysfsCompanions(sys).read(PciAddress.parse("0000:86:00.0"))
    assert PciAddress.parse("0000:86:00.2") in companions


def test_no_descriptor_outlives_a_call(tmp_path: Path) -> None:
    sys = build(NODES["node01"], tmp_path / "root") / "sys"
    outside = tmp_path / "outside"
    (outside / "vfio-pci").mkdir(parents=True)
    before = sorted(os.listdir("/proc/self/fd"))
    _outcomes(sys)
    _damage(sys, outside)
    _outcomes(sys)
    assert sorted(os.listdir("/proc/self/fd")) == before


def test_the_kernel_resolves_here() -> None:
    """CI's machines have ``openat2`` (Linux >= 5.6): there the kernel path is the one the tests above judge
    (elsewhere a skip, and a failure under CI=true)."""
    if not sysfs_paths._Kernel.resolves():
        missing("openat2 is not available on this kernel (Linux >= 5.6 has it)", "openat2")


def test_a_root_that_is_not_a_directory_is_named_either_way(tmp_path: Path, python_only: None) -> None:
    with pytest.raises(InputError, match=r"sysfs root .* is not a directory"):
        SysfsBars(tmp_path / "nowhere").read(PciAddress.parse("0000:86:00.0"))
