"""The DRA names (schemas/dra.py): device names are DNS labels that map back to the device they name."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import InputError
from schemas.dra import DEVICE_CLASSES, DRIVER_NAME, MAX_DEVICE_NAME, device_id_of, device_name
from schemas.kinds import ResourceKind

DNS_LABEL = re.compile(r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$")


@given(st.integers(0, 0xFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7))
def test_a_pci_device_name_is_a_dns_label_that_names_its_address(domain: int, bus: int, slot: int, fn: int) -> None:
    address = f"{domain:04x}:{bus:02x}:{slot:02x}.{fn}"
    name = device_name(ResourceKind.PCI, address)
    assert DNS_LABEL.match(name) and len(name) <= MAX_DEVICE_NAME
    assert device_id_of(name) == ("pci", address)


@given(st.uuids())
def test_an_mdev_device_name_is_a_dns_label_that_names_its_uuid(uuid: object) -> None:
    name = device_name(ResourceKind.MDEV, str(uuid).upper())
    assert DNS_LABEL.match(name) and len(name) <= MAX_DEVICE_NAME
    assert device_id_of(name) == ("mdev", str(uuid))


@pytest.mark.parametrize(
    "name", ["gpu-0", "pci-0000-86-00", "pci-0000-86-00-8", "pci-0000-86-0-0", "mdev-xyz", "pci-0000-86-00-0-", ""]
)
def test_names_this_driver_does_not_give_are_refused(name: str) -> None:
    with pytest.raises(InputError):
        device_id_of(name)


def test_device_classes_are_dns_subdomains_of_the_driver() -> None:
    assert set(DEVICE_CLASSES) == set(ResourceKind)
    for name in DEVICE_CLASSES.values():
        assert name.endswith("." + DRIVER_NAME) and len(name) <= 253
