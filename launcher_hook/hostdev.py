"""One declarative model for libvirt's ``<hostdev>`` and the one pure function that renders it.

As in virt-manager's virtinst, the model holds what the element means and the renderer alone decides the
element's shape and child order (driver, source, alias), so every hostdev the project writes has one form:
the one that passes libvirt's RNG schema (FACTS.md §5). The renderer writes text, not lxml elements: the
splicer can then insert it into the original bytes unchanged (the fast path) or parse it into the tree
(the general path), and both give the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from schemas import PciAddress, ResourceKind


class HostdevSpec(NamedTuple):
    """A host device for the VM: its source, the alias QEMU will know it by, and options.

    A NamedTuple rather than a frozen dataclass: one is built per GPU on the OnDefineDomain path.
    """

    kind: ResourceKind
    source: PciAddress | str
    alias: str
    variable: str
    """The allocation variable the source came from (for messages and logs)."""
    managed: bool = False
    driver: str | None = None
    display: bool = False
    ramfb: bool = False
    label: str = ""
    """Which VMI entry (or variable) asked for the device, for messages: ``gpus[0] 'gpu0' (deviceName …)``."""
    force_alias: bool = False
    """Give a hostdev already in the domain for this source ``alias`` too (``--force-gpu-aliases``); without it,
    such a hostdev keeps the alias it has (virt-launcher's ``ua-gpu-<name>``, which KubeVirt looks devices up by)."""

    @property
    def source_text(self) -> str:
        return str(self.source)


@dataclass(frozen=True)
class Layout:
    """How the surrounding document writes XML: indentation and empty elements."""

    indent: str = ""
    """Whitespace before the hostdev's start tag (``"\\n\\t\\t"`` in KubeVirt's domains; ``""`` when compact)."""
    unit: str = ""
    """One level of indentation (``"\\t"``), or ``""`` for a compact document."""
    expanded_empty: bool = False
    """Write empty elements as ``<x></x>`` (Go's encoding/xml, which KubeVirt uses) instead of ``<x/>``."""

    def empty(self, tag: str, attributes: str) -> str:
        return f"<{tag} {attributes}></{tag}>" if self.expanded_empty else f"<{tag} {attributes}/>"


class HostdevRenderer:
    """Renders hostdevs for one layout: the skeletons are laid out once, each hostdev fills in its values.

    Every value is built from validated parts (hex numbers, a canonical UUID, an alias of ``[a-z0-9-]``, a
    driver from a fixed list), so nothing needs escaping.
    """

    def __init__(self, layout: Layout = Layout()) -> None:
        # printf-style templates: the layout is whitespace only, so no '%' but ours is in them.
        inner = layout.indent + layout.unit if layout.unit else ""
        innermost = inner + layout.unit if layout.unit else ""
        closing = layout.indent if layout.unit else ""

        def tail(address: str) -> str:
            alias = layout.empty("alias", 'name="%s"')
            source = f"{inner}<source>{innermost}{layout.empty('address', address)}{inner}</source>"
            return f"{source}{inner}{alias}{closing}</hostdev>"

        pci_address = 'domain="0x%04x" bus="0x%02x" slot="0x%02x" function="0x%x"'
        self._pci = '<hostdev mode="subsystem" type="pci" managed="%s">%s' + tail(pci_address)
        self._mdev = '<hostdev mode="subsystem" type="mdev" model="vfio-pci"%s>' + tail('uuid="%s"')
        self._driver = inner + layout.empty("driver", 'name="%s"')

    def __call__(self, spec: HostdevSpec) -> str:
        """The ``<hostdev>`` element for ``spec`` as XML text."""
        source = spec.source
        if isinstance(source, PciAddress):
            driver = self._driver % spec.driver if spec.driver else ""
            return self._pci % ("yes" if spec.managed else "no", driver, *source, spec.alias)
        flags = (' display="on"' + (' ramfb="on"' if spec.ramfb else "")) if spec.display else ""
        return self._mdev % (flags, source, spec.alias)


def render_hostdev(spec: HostdevSpec, layout: Layout = Layout()) -> str:
    """The ``<hostdev>`` element for ``spec`` as XML text, laid out like its surroundings."""
    return HostdevRenderer(layout)(spec)
