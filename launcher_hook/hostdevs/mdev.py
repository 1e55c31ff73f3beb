"""``<hostdev type='mdev'>``: a mediated device (vGPU) by UUID (docs/protocols.md, "libvirt hostdev").

Written with ``model='vfio-pci'`` and, per KubeVirt's display rules, ``display='on'``/``ramfb='on'``; no
``managed`` and no ``<driver>`` (libvirt has neither for mdevs).
"""

from __future__ import annotations

from collections.abc import Iterator

from lxml import etree

from launcher_hook.hostdevs.base import (
    CHANGED_SWITCHES,
    Finding,
    HostdevModel,
    HostdevSpec,
    Layout,
    Severity,
    set_switch,
)
from schemas.kinds import MDEV_VGPU

_GUEST_ADDRESS_TYPES = {"vfio-pci": "pci", "vfio-ccw": "ccw"}


class MdevHostdev(HostdevModel):
    kind = MDEV_VGPU

    def template(self, layout: Layout) -> str:
        return '<hostdev mode="subsystem" type="mdev" model="vfio-pci"%s>' + layout.tail('uuid="%s"')

    def render(self, template: str, driver_template: str, spec: HostdevSpec, *guest: str) -> str:
        flags = (' display="on"' + (' ramfb="on"' if spec.ramfb else "")) if spec.display else ""
        return template % (flags, spec.source, *guest, spec.alias)

    def read_source(self, address: etree._Element) -> str | None:
        uuid = address.get("uuid")
        return uuid.lower() if uuid else None

    def source_problems(self, hostdev: etree._Element, label: str) -> Iterator[Finding]:
        address = hostdev.find("source/address")
        if address is None:
            yield Severity.ERROR, f"{label}: no <source><address uuid='…'/></source>"
        elif address.get("uuid") is None:
            yield (
                Severity.ERROR,
                f"{label}: the source <address> of an mdev needs uuid=; this one has "
                f"{', '.join(str(key) + '=' for key in address.attrib) or 'no attribute'} "
                "(a PCI device is passed with type='pci')",
            )
        model = hostdev.get("model")
        if model is None:
            yield Severity.ERROR, f"{label}: mdev hostdev has no model= (vfio-pci for vGPUs)"
        for attribute in ("display", "ramfb"):
            switch = hostdev.get(attribute)
            if switch is not None and switch not in ("on", "off"):
                yield Severity.ERROR, f"{label}: {attribute}={switch!r} must be 'on' or 'off'"
        if hostdev.get("display") is not None and model not in (None, "vfio-pci"):
            yield Severity.ERROR, f"{label}: display= is only supported with model='vfio-pci' (libvirt's QEMU driver)"
        if hostdev.get("ramfb") == "on" and hostdev.get("display") != "on":
            yield (
                Severity.WARNING,
                f"{label}: ramfb='on' without display='on' shows nothing until the guest driver loads",
            )
        guest = hostdev.find("address")
        wanted = _GUEST_ADDRESS_TYPES.get(model or "")
        if guest is not None and wanted is not None and guest.get("type") != wanted:
            yield (
                Severity.ERROR,
                f"{label}: guest <address type={guest.get('type')!r}> does not fit model={model!r}, "
                f"which takes type='{wanted}'",
            )
        if model == "vfio-pci" and hostdev.find("boot") is not None:
            yield (
                Severity.ERROR,
                f"{label}: <boot> is not supported on mdevs of model 'vfio-pci' (libvirt's QEMU driver)",
            )

    def correct_existing(
        self,
        hostdev: etree._Element,
        address: etree._Element | None,
        spec: HostdevSpec,
        alias: str,
        warnings: list[str],
    ) -> set[str]:
        if set_switch(hostdev, "display", spec.display) | set_switch(hostdev, "ramfb", spec.ramfb):
            return {CHANGED_SWITCHES}
        return set()


MODEL = MdevHostdev()
