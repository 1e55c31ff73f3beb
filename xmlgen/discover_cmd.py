"""``xmlgen discover``: what this node would offer KubeVirt, read from sysfs, before any plugin runs.

The same discovery the device plugin runs (:func:`plugin.sysfs.discover_node`), printed as a table for
people, as JSON for scripts, as the KubeVirt CR's ``permittedHostDevices`` block to paste, or as the
ResourceSlices ``serve --dra`` would publish (``--dra-slices NODE``, offline: no API server needed). Warnings
(no pci.ids, an ID it lacks) go to stderr; a bad ``--host-root``, ``--pci-ids`` or ``--config`` is an error
naming it, with nothing on stdout.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import yaml

from plugin import sources
from plugin.config import load_config
from plugin.dra.slices import build_slices
from plugin.inventory import Device, Inventory
from plugin.sysfs import discover_node
from runtime.pciids import PciIds
from schemas import InputError, kind_info
from xmlgen.io import user_errors, write_stdout


def _table(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    return [
        indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def _detail(device: Device) -> str:
    if device.mdev_type is not None:
        return f"{device.mdev_type} on {device.parent or 'a non-PCI parent'}"
    return ",".join(str(companion.address) for companion in device.companions) or "-"


def render_table(inventory: Inventory) -> str:
    """The human-readable report: one block per resource, then what was not offered."""
    lines: list[str] = []
    if not inventory.resources:
        lines.append("no GPUs or vGPUs to offer")
    for resource in inventory.resources:
        lines.append(
            f"{resource.name}  ({resource.kind.value}, {resource.healthy_count} of {len(resource.devices)} healthy)"
        )
        lines.append(f"  env {resource.env}")
        lines.append(f"  socket {resource.socket}")
        if resource.switches:
            switches = ", ".join(f"{switch.address} (group {switch.iommu_group})" for switch in resource.switches)
            lines.append(f"  nvswitches, given with all {len(resource.devices)} GPUs: {switches}")
        companions = kind_info(resource.kind).detail_heading
        rows = [["DEVICE", "GROUP", "NUMA", "PCIE ROOT", "PCIE SWITCH", "HEALTH", companions]]
        reasons: dict[int, str] = {}
        for device in resource.devices:
            rows.append(
                [
                    device.id,
                    "-" if device.iommu_group is None else str(device.iommu_group),
                    "?" if device.numa_node is None else str(device.numa_node),
                    device.pcie_root or "-",
                    device.pcie_switch or "-",
                    device.health,
                    _detail(device),
                ]
            )
            if device.reason:
                reasons[len(rows) - 1] = device.reason
        for index, line in enumerate(_table(rows, "  ")):
            lines.append(line)
            if index in reasons:
                lines.append(f"    reason: {reasons[index]}")
        lines.append("")
    if inventory.ignored:
        lines.append("not offered:")
        lines.extend(
            _table(
                [
                    [item.id, item.vendor_device, item.driver or "(no driver)", item.reason]
                    for item in inventory.ignored
                ],
                "  ",
            )
        )
        lines.append("")
    lines.append(f"names from {inventory.pci_ids_path or 'no pci.ids (hex device IDs)'}")
    return "\n".join(lines) + "\n"


def render_permitted_host_devices(inventory: Inventory) -> str:
    """The ``permittedHostDevices`` block as YAML, every string quoted (``10DE:1F08`` stays a string)."""
    block: dict[str, Any] = sources.permitted_host_devices(inventory)["permittedHostDevices"]
    lines = [
        "# KubeVirt CR: paste under spec.configuration (kubectl edit kubevirt -n kubevirt)",
        "permittedHostDevices:",
    ]
    for key, selector_key in (("pciHostDevices", "pciVendorSelector"), ("mediatedDevices", "mdevNameSelector")):
        entries = block[key]
        if not entries:
            lines.append(f"  {key}: []")
            continue
        lines.append(f"  {key}:")
        for entry in entries:
            lines.append(f"    - {selector_key}: {json.dumps(entry[selector_key])}")
            lines.append(f"      resourceName: {json.dumps(entry['resourceName'])}")
            lines.append("      externalResourceProvider: true")
    return "\n".join(lines) + "\n"


_LOOKS_SCALAR = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.?(inf|Inf|INF)|\.(nan|NaN|NAN)")


class _QuotingDumper(yaml.SafeDumper):
    """Quotes a string any YAML reader could take for a number: PyYAML (YAML 1.1) writes ``1e04`` bare, and
    kubectl's reader (YAML 1.2 rules) reads that as the float 10000, a device ID no more."""


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    if _LOOKS_SCALAR.fullmatch(value) or value.lower() in {
        "true",
        "false",
        "yes",
        "no",
        "on",
        "off",
        "null",
        "~",
        "y",
        "n",
    }:
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style='"')
    return dumper.represent_str(value)


_QuotingDumper.add_representer(str, _represent_str)


def render_dra_slices(inventory: Inventory, node_name: str, as_json: bool = False) -> str:
    """The node's ResourceSlices at generation 1, productName from the pci.ids the inventory was named from."""
    names = PciIds.load(Path(inventory.pci_ids_path)).device_name if inventory.pci_ids_path else None
    slices = (
        build_slices(inventory, node_name) if names is None else build_slices(inventory, node_name, product_names=names)
    )
    if as_json:
        return json.dumps({"apiVersion": "v1", "kind": "List", "items": slices}, indent=2) + "\n"
    if not slices:
        return "# no GPUs or vGPUs to offer: no ResourceSlice\n"
    header = f"# ResourceSlices of node {node_name} (kubectl create -f: they have generateName, not a name)\n"
    return header + yaml.dump_all(slices, Dumper=_QuotingDumper, sort_keys=False)


@click.command()
@click.option(
    "--host-root",
    metavar="DIR",
    help="Where the node's / is (sysfs under DIR/sys). Default: the config's host_root, else /.",
)
@click.option(
    "--pci-ids",
    metavar="FILE",
    help="pci.ids to name devices by (must exist). Default: the config's, else the first of "
    "usr/share/hwdata/pci.ids, usr/share/misc/pci.ids, usr/pci.ids under the host root, then under /.",
)
@click.option(
    "--config",
    "config_path",
    metavar="FILE",
    help="Plugin configuration, YAML or JSON (schemas/plugin-config.schema.json). Default: $GPU_PLUGIN_CONFIG; "
    "GPU_PLUGIN_* variables override it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of the table.")
@click.option(
    "--dra-slices",
    "dra_node",
    metavar="NODE",
    help="Print the resource.k8s.io/v1 ResourceSlices serve --dra would publish for node NODE (YAML; a JSON "
    "List with --json), to review or to write CEL selectors against.",
)
@click.option(
    "--permitted-host-devices",
    is_flag=True,
    help="Print the KubeVirt CR permittedHostDevices block for what this node has (YAML; JSON with --json).",
)
@user_errors
def discover(
    host_root: str | None,
    pci_ids: str | None,
    config_path: str | None,
    as_json: bool,
    dra_node: str | None,
    permitted_host_devices: bool,
) -> None:
    """Discover the vfio-bound NVIDIA GPUs and vGPU mdevs of a node and the resources they become."""
    config = load_config(Path(config_path) if config_path else None, os.environ, host_root=host_root, pci_ids=pci_ids)
    if not Path(config.host_root).is_dir():
        raise InputError(f"host root {config.host_root!r} is not a directory")
    inventory = discover_node(config)
    for warning in inventory.warnings:
        click.echo(f"warning: {warning}", err=True)
    if dra_node is not None and permitted_host_devices:
        raise InputError("--dra-slices and --permitted-host-devices print different things: choose one")
    if dra_node is not None:
        text = render_dra_slices(inventory, dra_node, as_json)
    elif permitted_host_devices:
        text = (
            json.dumps(sources.permitted_host_devices(inventory), indent=2) + "\n"
            if as_json
            else render_permitted_host_devices(inventory)
        )
    else:
        text = inventory.to_json_text() if as_json else render_table(inventory)
    write_stdout(text.encode("utf-8"))
