"""``xmlgen discover --dra-slices NODE``: the ResourceSlices serve --dra would publish, printed offline for review.

The YAML must read back as exactly the objects the publisher builds (PyYAML and a YAML 1.2 reader such as
kubectl's alike: a device ID like ``1e04`` stays a string), validate strictly for Kubernetes 1.34, and the
JSON form is a ``List`` ``kubectl create -f`` takes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from plugin.dra.slices import build_slices
from plugin.inventory import Device, Inventory, Resource
from schemas.kinds import ResourceKind
from simkit.fixture_nodes import MIXED_NODE, NODE01, SRIOV_VGPU_NODE, VGPU_NODE
from simkit.sysfs_fixture import Node
from tests.discovery_support import build_node
from tests.dra_cluster_support import DRA_OLDEST_KUBERNETES, node_slices, validate_strictly
from xmlgen.cli import cli
from xmlgen.discover_cmd import render_dra_slices


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(cli, ["discover", *args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


@pytest.mark.parametrize("node", [NODE01, VGPU_NODE, MIXED_NODE, SRIOV_VGPU_NODE], ids=lambda node: node.name)
def test_printed_slices_are_what_the_publisher_builds(node: Node, tmp_path: Path) -> None:
    root = build_node(node, tmp_path)
    code, out, err = run("--host-root", str(root), "--dra-slices", node.name)
    assert code == 0 and all(line.startswith("warning: ") for line in err.splitlines())  # stdout stays YAML
    assert out.startswith(f"# ResourceSlices of node {node.name} ")
    printed = list(yaml.safe_load_all(out))
    assert printed == node_slices(node, tmp_path / "again")
    for obj in printed:
        validate_strictly(obj, DRA_OLDEST_KUBERNETES)
    code, out, _ = run("--host-root", str(root), "--dra-slices", node.name, "--json")
    assert code == 0
    assert json.loads(out) == {"apiVersion": "v1", "kind": "List", "items": printed}


def test_a_device_id_that_looks_like_a_number_stays_a_string() -> None:
    device = Device("0000:86:00.0", ResourceKind.PCI, "10DE:1E04", 74, 1, True, None)  # RTX 2080 Ti: 1e04
    inventory = Inventory((Resource("nvidia.com/1e04", ResourceKind.PCI, (device,), ("10DE:1E04",)),))
    out = render_dra_slices(inventory, "node01")
    assert 'deviceID:\n        string: "1e04"' in out
    assert list(yaml.safe_load_all(out)) == build_slices(inventory, "node01")


def test_bad_node_name_and_conflicting_options_are_errors(tmp_path: Path) -> None:
    root = build_node(NODE01, tmp_path)
    code, out, err = run("--host-root", str(root), "--dra-slices", "Node_01")
    assert code != 0 and out == "" and "node name 'Node_01' is not a DNS subdomain" in err
    code, out, err = run("--host-root", str(root), "--dra-slices", "node01", "--permitted-host-devices")
    assert code != 0 and out == "" and "choose one" in err


def test_a_node_without_gpus_prints_no_slice() -> None:
    assert render_dra_slices(Inventory(()), "node01") == "# no GPUs or vGPUs to offer: no ResourceSlice\n"
    assert json.loads(render_dra_slices(Inventory(()), "node01", as_json=True))["items"] == []
