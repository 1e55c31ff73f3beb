"""``runtime.sysfs_paths.Resolver`` resolves every path as ``os.path.realpath`` does and says what
``os.path.lexists`` says, remembering only within one reader's call (issue 26: the companion reader's links).

Checked on every path of a fixture node's sysfs (each device's directory, ``iommu_group``, ``driver``, ``class``,
``physfn``, functions that are not there) and on the links an attacker or a broken tree could hold: a loop, a
link to itself, an absolute target, a target out of the root, ``..`` after a name, a dangling link.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from runtime.sysfs_paths import Resolver
from schemas import InputError
from simkit.fixture_nodes import NODE01
from simkit.sysfs_fixture import build

DEVICES = "bus/pci/devices"


def _relatives(sys: Path) -> list[str]:
    names = [*sorted(os.listdir(sys / DEVICES)), "0000:86:00.7", "0000:ff:1f.7"]
    leaves = ("", "/iommu_group", "/driver", "/class", "/physfn", "/nothing", "/driver/../driver")
    return [f"{DEVICES}/{name}{leaf}" for name in names for leaf in leaves] + ["bus", "devices", "kernel/iommu_groups"]


def _expected(sys: Path, relative: str) -> tuple[str, bool] | str:
    real = os.path.realpath(f"{sys.resolve()}/{relative}")
    base = str(sys.resolve())
    if real != base and not real.startswith(base + "/"):
        return "out"
    return real, os.path.lexists(f"{sys.resolve()}/{relative}")


def _got(paths: Resolver, relative: str) -> tuple[str, bool] | str:
    try:
        found = paths.link(relative, "device")
        resolved = paths.resolve(relative, "device")
    except InputError:
        return "out"
    assert found is None or found[0] == resolved
    return str(resolved), found is not None


def _damage(sys: Path, tmp: Path) -> None:
    audio = (sys / DEVICES / "0000:86:00.1").resolve()
    (audio / "iommu_group").unlink()
    (audio / "iommu_group").symlink_to("iommu_group")  # a link to itself
    (audio / "driver").unlink()
    (audio / "driver").symlink_to(str(tmp))  # absolute, out of the root
    usb = (sys / DEVICES / "0000:86:00.2").resolve()
    (usb / "driver").unlink()
    (usb / "driver").symlink_to("../../../../../..")  # up and out
    ucsi = (sys / DEVICES / "0000:86:00.3").resolve()
    (ucsi / "iommu_group").unlink()
    (ucsi / "iommu_group").symlink_to("../0000:86:00.0/../0000:86:00.0/iommu_group")  # .. after a name
    (ucsi / "driver").unlink()
    (ucsi / "driver").symlink_to("../gone")  # dangling
    (sys / DEVICES / "0000:af:00.1").unlink()
    (sys / DEVICES / "0000:af:00.1").symlink_to("0000:af:00.2")
    (sys / DEVICES / "0000:af:00.2").unlink()
    (sys / DEVICES / "0000:af:00.2").symlink_to("0000:af:00.1")  # a loop of two


@pytest.mark.parametrize("damaged", [False, True])
def test_the_resolver_agrees_with_realpath_and_lexists_everywhere(tmp_path: Path, damaged: bool) -> None:
    sys = build(NODE01, tmp_path / "root") / "sys"
    if damaged:
        _damage(sys, tmp_path)
    relatives = _relatives(sys)
    expected = {relative: _expected(sys, relative) for relative in relatives}
    paths = Resolver(sys, "test")  # one resolver for all: what it remembers must never change an answer
    for relative in relatives + list(reversed(relatives)):
        assert _got(paths, relative) == expected[relative], relative
    if damaged:
        assert expected[f"{DEVICES}/0000:86:00.2/driver"] == "out"
        assert expected[f"{DEVICES}/0000:86:00.3/driver"][1] is True  # a dangling link is there
