"""The device-kind table: each kind's prefix, ID forms and hostdev type, and the lookups both sides use."""

from __future__ import annotations

import pytest

from schemas import (
    DEVICE_KINDS,
    VM_KINDS,
    InputError,
    PciAddress,
    ResourceKind,
    env_var_for,
    kind_of_id,
    kind_of_variable,
)


def test_every_resource_kind_has_one_row_with_distinct_prefix_and_hostdev_type() -> None:
    assert set(DEVICE_KINDS) == set(ResourceKind)
    assert len({kind.env_prefix for kind in VM_KINDS.values()}) == len(VM_KINDS)
    assert len({kind.hostdev_type for kind in VM_KINDS.values()}) == len(VM_KINDS)
    assert list(VM_KINDS) == [ResourceKind.PCI, ResourceKind.MDEV]  # virt-launcher's pool order


def test_a_kind_that_reaches_the_vm_as_another_has_that_kinds_variable_ids_and_hostdev() -> None:
    others = [kind for kind in DEVICE_KINDS.values() if kind.reaches_vm_as is not None]
    assert [kind.key for kind in others] == [ResourceKind.SRIOV_VGPU]
    for kind in others:
        assert kind.reaches_vm_as is not None
        seen_as = VM_KINDS[kind.reaches_vm_as]
        assert (kind.env_prefix, kind.hostdev_type) == (seen_as.env_prefix, seen_as.hostdev_type)
        assert kind.parse_id("0000:3b:00.4") == seen_as.parse_id("0000:3b:00.4")
        assert kind_of_id("0000:3b:00.4") is seen_as


@pytest.mark.parametrize(
    ("variable", "expected"),
    [
        ("PCI_RESOURCE_NVIDIA_COM_X", ResourceKind.PCI),
        ("MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q", ResourceKind.MDEV),
        ("PCI_RESOURCEX", None),
        ("USB_RESOURCE_X", None),
        ("HOME", None),
    ],
)
def test_kind_of_variable_by_prefix(variable: str, expected: ResourceKind | None) -> None:
    kind = kind_of_variable(variable)
    assert (kind.key if kind else None) == expected


def test_env_var_round_trips_through_the_table() -> None:
    for key, kind in DEVICE_KINDS.items():
        variable = env_var_for("nvidia.com/GRID_T4-1Q", key)
        assert variable == kind.env_var("nvidia.com/GRID_T4-1Q")
        assert kind_of_variable(variable) is VM_KINDS[kind.reaches_vm_as or key]


def test_ids_parse_print_and_identify_their_kind() -> None:
    pci, mdev = DEVICE_KINDS[ResourceKind.PCI], DEVICE_KINDS[ResourceKind.MDEV]
    address = pci.parse_id("0000:86:00.0")
    assert address == PciAddress(0, 0x86, 0, 0)
    assert pci.format_id(address) == "0000:86:00.0"
    uuid = mdev.parse_id("4B20D080-1B54-4048-85B3-A6A62D165C01")
    assert mdev.format_id(uuid) == "4b20d080-1b54-4048-85b3-a6a62d165c01"
    assert kind_of_id("0000:86:00.0") is pci
    assert kind_of_id(mdev.format_id(uuid)) is mdev
    assert kind_of_id("kvm") is None
    with pytest.raises(InputError, match="malformed PCI address"):
        pci.parse_id(mdev.format_id(uuid))
    with pytest.raises(InputError, match="malformed mdev UUID"):
        mdev.parse_id("0000:86:00.0")
