"""The shared contracts: PCI addresses, mdev UUIDs, resource names and the env var derived from them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import InputError, PciAddress, ResourceKind, env_var_for, parse_mdev_uuid, socket_name_for
from schemas import validate_resource_name as valid


@pytest.mark.parametrize(
    ("text", "canonical", "attributes"),
    [
        ("0000:86:00.0", "0000:86:00.0", ("0x0000", "0x86", "0x00", "0x0")),
        ("0000:AF:00.0", "0000:af:00.0", ("0x0000", "0xaf", "0x00", "0x0")),
        ("0001:3b:1f.7", "0001:3b:1f.7", ("0x0001", "0x3b", "0x1f", "0x7")),
        ("10000:e1:00.0", "10000:e1:00.0", ("0x10000", "0xe1", "0x00", "0x0")),
        ("ffff:ff:1f.7", "ffff:ff:1f.7", ("0xffff", "0xff", "0x1f", "0x7")),
    ],
)
def test_pci_address_parses_kernel_form(text: str, canonical: str, attributes: tuple[str, ...]) -> None:
    address = PciAddress.parse(text)
    assert str(address) == canonical
    assert tuple(address.libvirt_attributes().values()) == attributes
    assert list(address.libvirt_attributes()) == ["domain", "bus", "slot", "function"]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "86:00.0",
        "0000:86:00",
        "0000:86:20.0",
        "0000:86:00.8",
        "000:86:00.0",
        "100000:86:00.0",
        "0000:086:00.0",
        " 0000:86:00.0",
        "0000:86:00.0\n",
        "0000-86-00.0",
        "0x0000:86:00.0",
        "gggg:86:00.0",
        "0000:86:00.0,0000:af:00.0",
        "\uff10000:86:00.0",  # a full-width digit
    ],
)
def test_pci_address_refuses_malformed_text_naming_it(text: str) -> None:
    with pytest.raises(InputError) as error:
        PciAddress.parse(text)
    assert repr(text) in str(error.value)


def test_pci_address_orders_and_compares_by_value() -> None:
    assert PciAddress.parse("0000:86:00.0") == PciAddress.parse("0000:86:00.0".upper())
    assert sorted(map(PciAddress.parse, ["0000:af:00.0", "0000:3b:00.0", "0000:86:00.1"])) == [
        PciAddress(0, 0x3B, 0, 0),
        PciAddress(0, 0x86, 0, 1),
        PciAddress(0, 0xAF, 0, 0),
    ]
    assert PciAddress.parse("0000:86:00.3").slot_address == "0000:86:00"


def test_pci_address_constructor_refuses_out_of_range_fields() -> None:
    with pytest.raises(InputError, match="slot 0x20"):
        PciAddress(0, 0, 0x20, 0)
    with pytest.raises(InputError, match="bus 0x100"):
        PciAddress(0, 0x100, 0, 0)


@given(st.integers(0, 0xFFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7), st.booleans())
def test_pci_address_round_trips(domain: int, bus: int, slot: int, function: int, upper: bool) -> None:
    address = PciAddress(domain, bus, slot, function)
    text = str(address).upper() if upper else str(address)
    assert PciAddress.parse(text) == address
    assert str(PciAddress.parse(text)) == str(address)
    assert {key: int(value, 16) for key, value in address.libvirt_attributes().items()} == {
        "domain": domain,
        "bus": bus,
        "slot": slot,
        "function": function,
    }


@given(st.text(max_size=20))
def test_pci_address_parse_either_round_trips_or_raises_input_error(text: str) -> None:
    try:
        address = PciAddress.parse(text)
    except InputError:
        return
    assert str(address) == text.lower()


def test_mdev_uuid_is_canonicalised_and_malformed_ones_named() -> None:
    assert parse_mdev_uuid("E3F0A6B2-58C4-4F6B-8E9D-2B1C0D9E8F7A") == "e3f0a6b2-58c4-4f6b-8e9d-2b1c0d9e8f7a"
    for bad in (
        "",
        "e3f0a6b2",
        "e3f0a6b258c44f6b8e9d2b1c0d9e8f7a",
        "0000:86:00.0",
        "e3f0a6b2-58c4-4f6b-8e9d-2b1c0d9e8f7a ",
    ):
        with pytest.raises(InputError) as error:
            parse_mdev_uuid(bad)
        assert repr(bad) in str(error.value)


@pytest.mark.parametrize(
    ("resource", "kind", "variable"),
    [
        (
            "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A",
            ResourceKind.PCI,
            "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A",
        ),
        ("nvidia.com/GRID_T4-1Q", ResourceKind.MDEV, "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"),
        ("intel.com/qat", ResourceKind.PCI, "PCI_RESOURCE_INTEL_COM_QAT"),
        ("example.com/nvme.fast", ResourceKind.PCI, "PCI_RESOURCE_EXAMPLE_COM_NVME_FAST"),
        ("nvidia.com/2fff", ResourceKind.PCI, "PCI_RESOURCE_NVIDIA_COM_2FFF"),
    ],
)
def test_env_var_follows_kubevirt(resource: str, kind: ResourceKind, variable: str) -> None:
    assert env_var_for(resource, kind) == variable


def test_socket_name_is_kubevirt_prefixed_name_part() -> None:
    assert socket_name_for("nvidia.com/TU106_GEFORCE_RTX_2060_REV__A") == "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
    assert socket_name_for("nvidia.com/GRID_T4-1Q") == "kubevirt-GRID_T4-1Q.sock"


@pytest.mark.parametrize(
    "name", ["nvidia.com/TU106_GEFORCE_RTX_2060_REV__A", "nvidia.com/GRID_T4-1Q", "a.b-c.io/x", "nvidia.com/2fff"]
)
def test_extended_resource_names_are_accepted(name: str) -> None:
    assert valid(name) == name


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("TU106", "no domain"),
        ("kubernetes.io/gpu", "reserved"),
        ("node.kubernetes.io/gpu", "reserved"),
        ("NVIDIA.com/gpu", "DNS subdomain"),
        ("nvidia.com/", "1-63 characters"),
        ("nvidia.com/-gpu", "1-63 characters"),
        ("nvidia.com/GRID T4-1Q", "1-63 characters"),
        ("nvidia.com/" + "A" * 64, "1-63 characters"),
        ("nvidia.com/a/b", "1-63 characters"),
    ],
)
def test_bad_resource_names_are_refused_with_the_reason(name: str, why: str) -> None:
    with pytest.raises(InputError, match=why) as error:
        valid(name)
    assert repr(name) in str(error.value)
