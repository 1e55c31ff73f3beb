"""An HGX board's NVSwitches (docs/nvswitch.md): found, carried by an allocation of the whole board, and written
into the domain as hostdevs that libvirt's QEMU driver gives QEMU.

The fixture is ``simkit.fixture_nodes.hgx_h100_node``: eight H100 SXM5 below four PCIe switches (two each, a
ConnectX-7 beside them), four NVSwitches behind a switch of their own, on ``vfio-pci`` (full passthrough) or on
``nvidia`` (the host's Fabric Manager drives them).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from bench.workloads import kubevirt_sized_domain
from launcher_hook import BuildOptions, build_domain
from launcher_hook.allocation import allocation_from_env
from launcher_hook.nvswitches import ALIAS_PREFIX
from node_agent.sysfs import Sysfs, read_function
from plugin.allocation import DeviceUnavailable, allocate
from plugin.inventory import Resource
from runtime.pci_topology import SysfsTopology
from schemas import InputError, PciAddress
from schemas.fabric import (
    MAX_SWITCHES,
    board_switches,
    format_switches,
    is_nvswitch,
    parse_switches,
    switches_env_var,
)
from simkit.fixture_nodes import HGX_H100_GPUS, HGX_H100_NVSWITCHES, hgx_h100_node
from simkit.sysfs_fixture import Function
from tests.discovery_support import build_node, discover
from tests.libvirt_support import libvirt_verdict, qemu_argv
from tests.node_agent_support import agent
from tests.node_agent_support import build_node as agent_node
from xmlgen.cli import cli

RESOURCE = "nvidia.com/GH100H100_SXM5_80GB"
"""The H100 SXM5's name from pci.ids 2023.04.10, whose line is ``GH100[H100 SXM5 80GB]`` (no space)."""
GPU_VARIABLE = "PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"
SWITCH_VARIABLE = "PCI_NVSWITCHES_NVIDIA_COM_GH100H100_SXM5_80GB"


@pytest.fixture(scope="module")
def hgx_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_node(hgx_h100_node(), tmp_path_factory.mktemp("hgx"))


@pytest.fixture(scope="module")
def board(hgx_root: Path) -> Resource:
    return discover(hgx_root).resource(RESOURCE)


def _vmi(count: int) -> bytes:
    gpus = [{"name": f"gpu{i}", "deviceName": RESOURCE} for i in range(count)]
    spec = {"domain": {"devices": {"gpus": gpus}}}
    return json.dumps({"metadata": {"name": "llm", "namespace": "ml"}, "spec": spec}).encode()


# ---- the rule and the variable ---------------------------------------------------------------------------


def test_the_rule_gives_every_switch_to_the_whole_board_and_none_to_part_of_it() -> None:
    switches = [PciAddress.parse(address) for address in reversed(HGX_H100_NVSWITCHES)]
    assert board_switches(HGX_H100_GPUS, HGX_H100_GPUS, switches) == tuple(sorted(switches))
    assert board_switches(list(reversed(HGX_H100_GPUS)), HGX_H100_GPUS, switches) == tuple(sorted(switches))
    assert board_switches(HGX_H100_GPUS[:4], HGX_H100_GPUS, switches) == ()
    assert board_switches([*HGX_H100_GPUS[:7], "0000:ff:00.0"], HGX_H100_GPUS, switches) == ()
    assert board_switches(HGX_H100_GPUS, HGX_H100_GPUS, []) == ()
    assert is_nvswitch(0x10DE, 0x068000) and not is_nvswitch(0x10DE, 0x030200) and not is_nvswitch(0x1000, 0x068000)


def test_the_variable_is_read_strictly_and_every_refusal_names_it() -> None:
    value = format_switches(PciAddress.parse(address) for address in reversed(HGX_H100_NVSWITCHES))
    assert value == ",".join(HGX_H100_NVSWITCHES)
    assert parse_switches(SWITCH_VARIABLE, value) == tuple(map(PciAddress.parse, HGX_H100_NVSWITCHES))
    assert switches_env_var(RESOURCE) == SWITCH_VARIABLE
    assert format_switches([]) is None
    for bad in ("", "0000:07:00.0,", "0000:07:00.0,0000:07:00.0", "07:00.0", ",".join(["0000:07:00.0"] * 99)):
        with pytest.raises(InputError, match=SWITCH_VARIABLE):
            parse_switches(SWITCH_VARIABLE, bad)
    many = ",".join(f"0000:{bus:02x}:00.0" for bus in range(MAX_SWITCHES + 1))
    with pytest.raises(InputError, match="over the limit"):
        parse_switches(SWITCH_VARIABLE, many)
    # The hook refuses switches whose GPUs' variable is not there, and garbage, naming the variable.
    with pytest.raises(InputError, match=f"{SWITCH_VARIABLE} is set but {GPU_VARIABLE} is not"):
        allocation_from_env({SWITCH_VARIABLE: value})
    with pytest.raises(InputError, match=SWITCH_VARIABLE):
        allocation_from_env({GPU_VARIABLE: ",".join(HGX_H100_GPUS), SWITCH_VARIABLE: "bogus"})


# ---- discovery -------------------------------------------------------------------------------------------


def test_full_passthrough_the_gpus_resource_carries_the_four_switches(hgx_root: Path) -> None:
    inventory = discover(hgx_root)
    assert inventory.resource_names == (RESOURCE,)  # the switches are no resource of their own
    board = inventory.resource(RESOURCE)
    assert [device.id for device in board.devices] == sorted(HGX_H100_GPUS)
    assert [str(switch.address) for switch in board.switches] == list(HGX_H100_NVSWITCHES)
    assert {switch.driver for switch in board.switches} == {"vfio-pci"}
    assert len({switch.iommu_group for switch in board.switches}) == 4
    assert inventory.ignored == () and board.to_json()["nvswitches"] == list(HGX_H100_NVSWITCHES)
    # Two GPUs below each PCIe switch (their GPUDirect clique), NUMA 0 and 1 half each.
    assert len({device.pcie_switch for device in board.devices}) == 4
    assert [device.numa_node for device in board.devices] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_switches_on_the_host_driver_are_the_shared_model_and_go_to_no_vm(tmp_path: Path) -> None:
    inventory = discover(build_node(hgx_h100_node("nvidia"), tmp_path))
    assert inventory.resource(RESOURCE).switches == ()
    assert [item.id for item in inventory.ignored] == list(HGX_H100_NVSWITCHES)
    assert all("shared NVSwitch model" in item.reason and item.driver == "nvidia" for item in inventory.ignored)


def test_a_board_with_one_switch_off_vfio_carries_none_and_says_which(tmp_path: Path) -> None:
    node = hgx_h100_node()
    functions = tuple(
        replace(function, driver="nvidia") if function.address == HGX_H100_NVSWITCHES[2] else function
        for function in node.functions
    )
    inventory = discover(build_node(replace(node, functions=functions), tmp_path))
    assert inventory.resource(RESOURCE).switches == ()
    reasons = {item.id: item.reason for item in inventory.ignored}
    assert sorted(reasons) == list(HGX_H100_NVSWITCHES)
    assert all("only 3 of the node's 4 NVSwitches" in reason for reason in reasons.values())
    assert "bound to nvidia" in reasons[HGX_H100_NVSWITCHES[2]]


def test_two_nvidia_gpu_resources_leave_the_board_unknown(tmp_path: Path) -> None:
    node = hgx_h100_node()
    other = Function("0000:c1:00.0", 0x10DE, 0x2236, 0x030200, "vfio-pci", 200, 1, parent=None)
    inventory = discover(build_node(replace(node, functions=(*node.functions, other)), tmp_path))
    assert all(resource.switches == () for resource in inventory.resources)
    assert {item.id for item in inventory.ignored} == set(HGX_H100_NVSWITCHES)
    assert all("which GPUs form the board is not known" in item.reason for item in inventory.ignored)


# ---- Allocate --------------------------------------------------------------------------------------------


def test_allocating_the_whole_board_hands_out_the_switches_too(hgx_root: Path, board: Resource) -> None:
    answer = allocate(board, list(HGX_H100_GPUS), hgx_root)
    assert answer.envs[GPU_VARIABLE] == ",".join(HGX_H100_GPUS)
    assert answer.envs[SWITCH_VARIABLE] == ",".join(HGX_H100_NVSWITCHES)
    nodes = [spec.host_path for spec in answer.device_specs]
    for switch in board.switches:
        assert nodes.count(switch.vfio_group_path) == 1
    gpu_groups = [f"/dev/vfio/{device.iommu_group}" for device in board.devices]
    assert set(gpu_groups) <= set(nodes) and len(nodes) == len(set(nodes))


def test_part_of_the_board_gets_no_switch(hgx_root: Path, board: Resource) -> None:
    answer = allocate(board, list(HGX_H100_GPUS[:4]), hgx_root)
    assert SWITCH_VARIABLE not in answer.envs
    assert not {switch.vfio_group_path for switch in board.switches} & {s.host_path for s in answer.device_specs}


def test_a_switch_that_left_vfio_after_the_scan_refuses_the_whole_board(tmp_path: Path) -> None:
    root = build_node(hgx_h100_node(), tmp_path)
    board = discover(root).resource(RESOURCE)
    link = root / "sys/bus/pci/devices" / HGX_H100_NVSWITCHES[1] / "driver"
    target = os.readlink(link)
    link.unlink()
    os.symlink(target.replace("vfio-pci", "nvidia"), link)
    with pytest.raises(DeviceUnavailable, match=f"NVSwitch {HGX_H100_NVSWITCHES[1]} of the board: bound to nvidia"):
        allocate(board, list(HGX_H100_GPUS), root)
    assert SWITCH_VARIABLE not in allocate(board, list(HGX_H100_GPUS[:2]), root).envs  # part of it is unaffected
    os.unlink(link)
    os.symlink(target, link)
    (root / "dev/vfio" / str(board.switches[3].iommu_group)).unlink()
    with pytest.raises(DeviceUnavailable, match=f"NVSwitch {HGX_H100_NVSWITCHES[3]} of the board: /dev/vfio/"):
        allocate(board, list(HGX_H100_GPUS), root)


# ---- the hook --------------------------------------------------------------------------------------------


def _board_env(hgx_root: Path, board: Resource) -> dict[str, str]:
    return dict(allocate(board, list(HGX_H100_GPUS), hgx_root).envs)


def test_the_hook_adds_one_hostdev_per_switch_that_libvirt_gives_qemu(hgx_root: Path, board: Resource) -> None:
    env = _board_env(hgx_root, board)
    result = build_domain(kubevirt_sized_domain(), _vmi(8), env)
    aliases = {spec.alias: str(spec.source) for spec in result.hostdevs}
    switches = {f"{ALIAS_PREFIX}{i}": address for i, address in enumerate(HGX_H100_NVSWITCHES)}
    assert {alias: aliases[alias] for alias in switches} == switches
    assert len(aliases) == 12 and result.warnings == []
    # libvirt's RNG, its test driver and the QEMU driver: every GPU and switch a vfio-pci device of its own.
    libvirt_verdict(result.domain_xml, aliases)
    argv = qemu_argv(result.domain_xml)
    for alias, address in switches.items():
        bus = int(address[5:7], 16)
        assert re.search(rf'"driver":"vfio-pci","host":"0000:{bus:02x}:00.0","id":"{alias}"', argv), alias
    # A fixed point: KubeVirt's next call sends the domain back, and the hook changes nothing.
    again = build_domain(result.domain_xml, _vmi(8), env)
    assert again.domain_xml == result.domain_xml and again.warnings == []


def test_part_of_the_board_gets_gpus_only_and_the_cliques_leave_the_switches_out(
    hgx_root: Path, board: Resource
) -> None:
    part = dict(allocate(board, list(HGX_H100_GPUS[:4]), hgx_root).envs)
    result = build_domain(kubevirt_sized_domain(), _vmi(4), part)
    assert not any(spec.alias.startswith(ALIAS_PREFIX) for spec in result.hostdevs)
    whole = build_domain(
        kubevirt_sized_domain(),
        _vmi(8),
        _board_env(hgx_root, board),
        BuildOptions(topology=SysfsTopology(hgx_root / "sys")),
    )
    assert whole.cliques is not None
    cliques = [clique.aliases for clique in whole.cliques.cliques]
    assert cliques == [("ua-gpu0", "ua-gpu1"), ("ua-gpu2", "ua-gpu3"), ("ua-gpu4", "ua-gpu5"), ("ua-gpu6", "ua-gpu7")]
    libvirt_verdict(whole.domain_xml)


def test_switches_of_gpus_the_vm_does_not_use_are_not_added(hgx_root: Path, board: Resource) -> None:
    env = _board_env(hgx_root, board)
    vmi = json.dumps({"metadata": {"name": "x", "namespace": "ml"}, "spec": {"domain": {"devices": {}}}}).encode()
    result = build_domain(kubevirt_sized_domain(), vmi, env)
    assert result.hostdevs == []
    assert any(SWITCH_VARIABLE in warning and "not added" in warning for warning in result.warnings)


# ---- the node agent --------------------------------------------------------------------------------------


def test_the_node_agent_binds_the_switches_it_is_told_to_with_the_gpus_and_nothing_else(tmp_path: Path) -> None:
    node = hgx_h100_node("nvidia")
    on_host = tuple(replace(f, driver="nvidia") if f.device == 0x2330 else f for f in node.functions)
    sim = agent_node(replace(node, functions=on_host), tmp_path / "root")
    result = agent(sim, "bind", "--all", "--select", "10de:22a3")
    assert result.exit_code == 0, result.output
    fs = Sysfs(sim.root)
    for address in (*HGX_H100_GPUS, *HGX_H100_NVSWITCHES):
        assert read_function(fs, address).driver == "vfio-pci", address
    for nic in ("0000:15:00.0", "0000:35:00.0", "0000:95:00.0", "0000:b5:00.0"):
        assert read_function(fs, nic).driver == "mlx5_core", nic
    assert read_function(fs, "0000:11:00.0").driver == "pcieport"
    # Bound, the node offers the whole board with its switches.
    board = discover(sim.root).resource(RESOURCE)
    assert [str(switch.address) for switch in board.switches] == list(HGX_H100_NVSWITCHES)
    # Without the switches' selector, --all leaves them to the host's Fabric Manager.
    sim = agent_node(replace(node, functions=on_host), tmp_path / "again")
    assert agent(sim, "bind", "--all").exit_code == 0
    assert {read_function(Sysfs(sim.root), a).driver for a in HGX_H100_NVSWITCHES} == {"nvidia"}


def test_xmlgen_discover_names_the_switches_and_why_they_are_not_offered(tmp_path: Path) -> None:
    full = CliRunner().invoke(cli, ["discover", "--host-root", str(build_node(hgx_h100_node(), tmp_path / "a"))])
    assert full.exit_code == 0, full.output
    assert "nvswitches, given with all 8 GPUs: 0000:07:00.0 (group 13), 0000:08:00.0" in full.output
    shared = CliRunner().invoke(
        cli, ["discover", "--host-root", str(build_node(hgx_h100_node("nvidia"), tmp_path / "b"))]
    )
    assert shared.exit_code == 0, shared.output
    assert "nvswitches" not in shared.output and "shared NVSwitch model" in shared.output


def test_switches_in_one_iommu_group_are_carried_with_one_group_node(tmp_path: Path) -> None:
    """Some HGX H200 hosts put all four NVSwitches in one IOMMU group (no ACS between them): one node then."""
    node = hgx_h100_node()
    functions = tuple(
        replace(function, iommu_group=13) if function.address in HGX_H100_NVSWITCHES else function
        for function in node.functions
    )
    root = build_node(replace(node, functions=functions), tmp_path)
    board = discover(root).resource(RESOURCE)
    assert [str(switch.address) for switch in board.switches] == list(HGX_H100_NVSWITCHES)
    answer = allocate(board, list(HGX_H100_GPUS), root)
    nodes = [spec.host_path for spec in answer.device_specs]
    assert nodes.count("/dev/vfio/13") == 1 and answer.envs[SWITCH_VARIABLE] == ",".join(HGX_H100_NVSWITCHES)


def test_more_switches_than_a_board_has_go_to_no_vm(tmp_path: Path) -> None:
    node = hgx_h100_node()
    extra = tuple(
        Function(f"0000:e{i:x}:00.0", 0x10DE, 0x22A3, 0x068000, "vfio-pci", 300 + i, 1) for i in range(MAX_SWITCHES)
    )
    root = build_node(replace(node, functions=(*node.functions, *extra)), tmp_path)
    inventory = discover(root)
    assert inventory.resource(RESOURCE).switches == ()
    assert len(inventory.ignored) == 4 + MAX_SWITCHES
    assert all("more than a board has" in item.reason for item in inventory.ignored)
    assert SWITCH_VARIABLE not in allocate(inventory.resource(RESOURCE), list(HGX_H100_GPUS), root).envs
