"""One declarative model for libvirt's ``<hostdev>`` and the pure function that renders it.

As in virt-manager's virtinst, the model holds what the element means and the renderer alone decides
the element's shape and child order (driver, source, alias), so every hostdev the project writes has one
form: the one that passes libvirt's RNG schema (FACTS.md §5).
"""

from __future__ import annotations

from dataclasses import dataclass

from lxml import etree

from schemas import PciAddress, ResourceKind


@dataclass(frozen=True)
class HostdevSpec:
    """A host device for the VM: its source, the alias QEMU will know it by, and options."""

    kind: ResourceKind
    source: PciAddress | str
    alias: str
    variable: str
    """The allocation variable the source came from (for messages and logs)."""
    managed: bool = False
    driver: str | None = None
    display: bool = False
    ramfb: bool = False

    @property
    def source_text(self) -> str:
        return str(self.source)


def render_hostdev(spec: HostdevSpec) -> etree._Element:
    """The ``<hostdev>`` element for ``spec``, without any whitespace formatting."""
    if spec.kind is ResourceKind.PCI:
        assert isinstance(spec.source, PciAddress)
        hostdev = etree.Element(
            "hostdev", {"mode": "subsystem", "type": "pci", "managed": "yes" if spec.managed else "no"}
        )
        if spec.driver:
            etree.SubElement(hostdev, "driver", {"name": spec.driver})
        source = etree.SubElement(hostdev, "source")
        etree.SubElement(source, "address", spec.source.libvirt_attributes())
    else:
        attributes = {"mode": "subsystem", "type": "mdev", "model": "vfio-pci"}
        if spec.display:
            attributes["display"] = "on"
            if spec.ramfb:
                attributes["ramfb"] = "on"
        hostdev = etree.Element("hostdev", attributes)
        source = etree.SubElement(hostdev, "source")
        etree.SubElement(source, "address", {"uuid": str(spec.source)})
    etree.SubElement(hostdev, "alias", {"name": spec.alias})
    return hostdev
