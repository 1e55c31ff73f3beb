"""A stand-in for what virt-launcher renders into the domain for ``gpus[]``/``hostDevices[]``, before any hook.

Written from KubeVirt v1.9's ``pkg/virt-launcher/virtwrap/device/hostdevice`` (``hostdev.go``,
``addresspool.go``, ``gpu/hostdev.go``, ``generic/hostdev.go``) and ``converter/compute/host_device.go``, for
tests of the hook's domain source (docs/kubevirt-hostdevs.md, "The domain as the allocation source"):

- pools: per resource, ``PCI_RESOURCE_<NAME>``/``MDEV_PCI_RESOURCE_<NAME>`` from compute's env, one trailing comma
  dropped, split on ``,``; each entry pops the first address of its resource, which then leaves every pool;
- per list, every entry's PCI hostdev first, then the mdev ones; ``hostDevices[]`` before ``gpus[]`` in the
  domain (``NewHostDeviceDomainConfigurator(generic, gpus, sriov)`` concatenates them in that order);
- PCI: ``<hostdev type="pci" managed="no">`` (v1.9 sets no ``mode``), source address ``type="pci"`` and the
  env's hex digits after ``0x``; mdev: ``type="mdev" mode="subsystem" model="vfio-pci"``; alias
  ``ua-gpu-<name>``/``ua-hostdevice-<name>``; a GPU mdev's display as ``createMDEVHostDeviceWithDisplay`` and
  the default (first mdev GPU ``display``/``ramfb`` on when no GPU sets display options);
- Go's ``xml.MarshalIndent`` with tabs: each child on its own line, empty elements as ``<x></x>``.

Entries already in the domain (their alias is there) keep their element, and their device leaves the pools; USB
and DRA entries are not rendered (the fixtures that have them already hold virt-launcher's element).
"""

from __future__ import annotations

import json
import re
from typing import Any

from lxml import etree

from schemas.kinds import env_name_part

_PCI = re.compile(r"^([0-9a-fA-F]{4}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def _pools(prefix: str, resources: list[str], env: dict[str, str]) -> dict[str, list[str]]:
    pools: dict[str, list[str]] = {}
    for resource in resources:
        value = env.get(f"{prefix}_{env_name_part(resource)}")
        if value is not None:
            text = value.removesuffix(",")
            pools[resource] = text.split(",") if text else []
    return pools


def _take(pools: dict[str, list[str]], address: str) -> None:
    for resource, addresses in pools.items():
        pools[resource] = [a for a in addresses if a.lower() != address.lower()]


def _present(text: str) -> dict[str, str]:
    """virt-launcher's aliases already in the domain → the device each passes (kernel form)."""
    found: dict[str, str] = {}
    for hostdev in etree.fromstring(text.encode()).iterfind("devices/hostdev"):
        alias, address = hostdev.find("alias"), hostdev.find("source/address")
        name = alias.get("name", "") if alias is not None else ""
        if address is None or not name.startswith(("ua-gpu-", "ua-hostdevice-")):
            continue
        if address.get("uuid"):
            found[name] = address.get("uuid", "").lower()
        else:
            numbers = [int(address.get(part, "0"), 0) for part in ("domain", "bus", "slot", "function")]
            found[name] = "{:04x}:{:02x}:{:02x}.{:x}".format(*numbers)
    return found


def _display(entry: dict[str, Any]) -> dict[str, Any] | None:
    options = entry.get("virtualGPUOptions") or {}
    display = options.get("display")
    return display if isinstance(display, dict) else None


def _pci_element(indent: str, alias: str, address: str, entry: dict[str, Any], is_gpu: bool) -> str:
    match = _PCI.match(address)
    assert match, f"virt-launcher refuses the PCI address {address!r}"
    domain, bus, slot, function = match.groups()
    attributes = ""
    display = _display(entry) if is_gpu else None
    if display is not None and display.get("enabled") is True:
        attributes = ' display="on"'
        if (display.get("ramFB") or {}).get("enabled") is True:
            attributes += ' ramfb="on"'
    return (
        f'{indent}<hostdev type="pci" managed="no"{attributes}>\n'
        f"{indent}\t<source>\n"
        f'{indent}\t\t<address type="pci" domain="0x{domain}" bus="0x{bus}" slot="0x{slot}" function="0x{function}">'
        "</address>\n"
        f"{indent}\t</source>\n"
        f'{indent}\t<alias name="{alias}"></alias>\n'
        f"{indent}</hostdev>\n"
    )


def _mdev_element(indent: str, alias: str, uuid: str, flags: tuple[bool, bool]) -> str:
    attributes = (' display="on"' if flags[0] else "") + (' ramfb="on"' if flags[1] else "")
    return (
        f'{indent}<hostdev type="mdev" mode="subsystem" model="vfio-pci"{attributes}>\n'
        f"{indent}\t<source>\n"
        f'{indent}\t\t<address uuid="{uuid}"></address>\n'
        f"{indent}\t</source>\n"
        f'{indent}\t<alias name="{alias}"></alias>\n'
        f"{indent}</hostdev>\n"
    )


def _list(
    entries: list[dict[str, Any]], prefix: str, is_gpu: bool, env: dict[str, str], present: dict[str, str], indent: str
) -> str:
    wanted = [e for e in entries if e.get("deviceName") and f"{prefix}{e['name']}" not in present]
    resources = sorted({e["deviceName"] for e in entries if e.get("deviceName")})
    pci, mdev = _pools("PCI_RESOURCE", resources, env), _pools("MDEV_PCI_RESOURCE", resources, env)
    for taken in present.values():  # an element already there keeps its device
        for pools in (pci, mdev):
            _take(pools, taken)
    out: list[str] = []
    for entry in wanted:
        addresses = pci.get(entry["deviceName"]) or []
        if addresses:
            address = addresses[0]
            _take(pci, address)
            out.append(_pci_element(indent, f"{prefix}{entry['name']}", address, entry, is_gpu))
    mdevs: list[tuple[dict[str, Any], str]] = []
    for entry in wanted:
        uuids = mdev.get(entry["deviceName"]) or []
        if uuids and not any(f"{prefix}{entry['name']}" in element for element in out):
            _take(mdev, uuids[0])
            mdevs.append((entry, uuids[0]))
    any_display = is_gpu and any(_display(entry) is not None for entry in entries)
    for position, (entry, uuid) in enumerate(mdevs):
        flags = (False, False)
        display = _display(entry) if is_gpu else None
        if display is not None and display.get("enabled") in (None, True):
            ramfb = display.get("ramFB")
            flags = (True, ramfb is None or ramfb.get("enabled") is True)
        if is_gpu and not any_display and position == 0:
            flags = (True, True)
        out.append(_mdev_element(indent, f"{prefix}{entry['name']}", uuid, flags))
    return "".join(out)


def virt_launcher_domain(domain_xml: bytes, vmi_json: bytes, env: dict[str, str]) -> bytes:
    """``domain_xml`` with the hostdevs virt-launcher renders for ``vmi_json``'s entries from ``env`` (compute's
    env), inserted before the last ``</devices>`` as Go's encoder lays them out."""
    document = json.loads(vmi_json)
    devices = document["spec"]["domain"]["devices"]
    text = domain_xml.decode()
    present = _present(text)
    end = text.rindex("</devices>")
    line_start = text.rindex("\n", 0, end) + 1
    indent = text[line_start:end] + "\t"
    rendered = _list(devices.get("hostDevices") or [], "ua-hostdevice-", False, env, present, indent)
    rendered += _list(devices.get("gpus") or [], "ua-gpu-", True, env, present, indent)
    return (text[:line_start] + rendered + text[line_start:]).encode()
