"""``gpu-device-plugin serve --print-slices``: the ResourceSlices ``serve --dra`` would publish, from one scan,
as the issue asks (a review of the DRA objects without a cluster; docs/dra.md, "Cluster side")."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from plugin.cli import serve
from schemas.dra import ATTR_PCI_BUS_ID, DRIVER_NAME
from simkit.fixture_nodes import NODE01
from simkit.sysfs_fixture import build
from xmlgen.discover_cmd import render_dra_slices


def test_print_slices_prints_the_nodes_pool_and_serves_nothing(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    kubelet = tmp_path / "kubelet"
    result = CliRunner().invoke(
        serve, ["--host-root", str(root), "--kubelet-dir", str(kubelet), "--print-slices", "--node-name", "node01"]
    )
    assert result.exit_code == 0, result.output
    listed = json.loads(result.stdout)
    assert listed["kind"] == "List"
    (only,) = listed["items"]
    assert only["apiVersion"] == "resource.k8s.io/v1" and only["kind"] == "ResourceSlice"
    assert only["spec"]["driver"] == DRIVER_NAME and only["spec"]["nodeName"] == "node01"
    buses = {device["attributes"][ATTR_PCI_BUS_ID]["string"] for device in only["spec"]["devices"]}
    assert {"0000:86:00.0", "0000:af:00.0"} <= buses
    assert not kubelet.exists()  # nothing served, no socket directory made
    # the same objects xmlgen discover --dra-slices prints (its JSON form)
    assert listed == json.loads(render_dra_slices_for(root))


def render_dra_slices_for(root: Path) -> str:
    from plugin.config import PluginConfig
    from plugin.sysfs import scan
    from runtime.pciids import PciIds

    inventory = scan(root, PluginConfig(host_root=str(root)), PciIds.load(root / "usr" / "share" / "misc" / "pci.ids"))
    return render_dra_slices(inventory, "node01", as_json=True)


def test_print_slices_needs_the_node_name(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    result = CliRunner().invoke(serve, ["--host-root", str(root), "--print-slices"], env={"GPU_PLUGIN_NODE_NAME": ""})
    assert result.exit_code == 1
    assert "--print-slices needs --node-name" in result.output
