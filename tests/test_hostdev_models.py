"""Each device kind's hostdev model: what it writes it reads back, finds nothing wrong with, and prepares for QEMU."""

from __future__ import annotations

import pytest
from lxml import etree

from launcher_hook.hostdev import HostdevRenderer, HostdevSpec, Layout, before_alias
from launcher_hook.hostdevs import HOSTDEV_MODELS, model_for_type
from schemas import DEVICE_KINDS, VM_KINDS, DeviceId, PciAddress, ResourceKind

SOURCES: dict[ResourceKind, DeviceId] = {
    ResourceKind.PCI: PciAddress.parse("0000:86:00.0"),
    ResourceKind.MDEV: "4b20d080-1b54-4048-85b3-a6a62d165c01",
}


def test_every_vm_side_kind_of_the_table_has_its_model() -> None:
    assert set(HOSTDEV_MODELS) == set(VM_KINDS)  # a kind that reaches the VM as another uses that one's model
    for key, model in HOSTDEV_MODELS.items():
        assert model.kind is DEVICE_KINDS[key]
        assert model_for_type(model.type_name) is model
    assert model_for_type("usb") is None
    assert model_for_type(None) is None


@pytest.mark.parametrize("kind", list(VM_KINDS))
@pytest.mark.parametrize("layout", [Layout(), Layout("\n\t\t", "\t", expanded_empty=True)])
def test_written_element_reads_back_checks_clean_and_is_prepared_for_qemu(kind: ResourceKind, layout: Layout) -> None:
    model = HOSTDEV_MODELS[kind]
    driver = "vfio" if model.kind.takes_driver_element else None
    spec = HostdevSpec(kind, SOURCES[kind], "ua-gpu0", "VAR", driver=driver, display=True, ramfb=True)
    text = HostdevRenderer(layout)(spec)
    element = etree.fromstring(text)
    assert element.get("type") == model.type_name
    address = element.find("source/address")
    assert address is not None
    assert model.read_source(address) == str(SOURCES[kind])
    assert list(model.source_problems(element, "test")) == []
    model.prepare_for_qemu(element)
    assert (element.find("driver") is not None) == model.kind.takes_driver_element


@pytest.mark.parametrize("kind", list(VM_KINDS))
@pytest.mark.parametrize("layout", [Layout(), Layout("\n\t\t", "\t", expanded_empty=True), Layout("\n  ", "  ")])
@pytest.mark.parametrize("keep", [False, True])
def test_element_with_a_guest_address_is_the_element_with_the_address_before_its_alias(
    kind: ResourceKind, layout: Layout, keep: bool
) -> None:
    model = HOSTDEV_MODELS[kind]
    driver = "vfio" if model.kind.takes_driver_element else None
    spec = HostdevSpec(kind, SOURCES[kind], "ua-gpu0-fn1", "VAR", managed=True, driver=driver, display=True)
    render = HostdevRenderer(layout)
    address = layout.empty("address", 'type="pci" domain="0x0000" bus="0x05" slot="0x00" function="0x1"')
    text = render.addressed(spec, address, keep=keep)
    assert text == before_alias(render(spec), address)
    assert render.addressed(spec, address, keep=keep) == text
    element = etree.fromstring(text)
    assert [child.tag for child in element][-2:] == ["address", "alias"]
    assert element[-2].get("bus") == "0x05" and element[-1].get("name") == "ua-gpu0-fn1"


def test_pci_source_is_read_as_libvirt_reads_numbers() -> None:
    model = HOSTDEV_MODELS[ResourceKind.PCI]
    address = etree.fromstring('<address domain="0" bus="134" slot="0x00" function="0"/>')
    assert model.read_source(address) == "0000:86:00.0"
    assert model.read_source(etree.fromstring('<address domain="0" bus="0x100" slot="0" function="0"/>')) is None
