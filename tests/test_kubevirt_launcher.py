"""KubeVirt's own virt-launcher code (kubevirt.io/kubevirt at the pin of tests/cluster/peers/kubevirt) calls the
hook, and libvirt defines what comes out (docs/kubevirt-harness.md).

Each scenario runs virt-launcher's sequence in ``launcher-harness``: virt-api's defaulting, the converter with
virt-launcher's converter context (its hostdevice/gpu/generic/DRA code reads the allocation env and the DRA
metadata files), then ``allocateHotplugPorts``, which on q35 defines the domain two or three times through
``SetDomainSpecStrWithHooks``, each time from its own earlier output read back through KubeVirt's
``api.DomainSpec``; each define goes to a real ``qemu:///system`` (never started). For each: every hook call
succeeds through KubeVirt's client, nothing is added twice, libvirt accepts every define and the final
domain (its RNG schema and parser, ``VIR_DOMAIN_DEFINE_VALIDATE``), and QEMU's argv has the ids, bus/addr,
multifunction and ``-fw_cfg`` the project promises.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from lxml import etree

from plugin.allocation import allocate
from simkit.fixture_nodes import A100_NODE, HGX_H100_GPUS, HGX_H100_NODE, HGX_H100_NVSWITCHES, WORKSTATION_NODE
from simkit.sysfs_fixture import build
from tests.discovery_support import discover
from tests.kubevirt_harness_support import HarnessRun, aliases, hostdev_sources, hostdevs, run_harness, unique_vmi
from tests.libvirt_support import missing, qemu_argv
from xmlgen.libvirt_check import LibvirtUnavailable, generic_refusal

pytestmark = [pytest.mark.libvirt, pytest.mark.kubevirt]

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "xmlgen" / "examples" / "seed-node01"
RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
RTX_VAR = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
SEED_ENV = {RTX_VAR: "0000:86:00.0,0000:af:00.0"}
SEED_GPUS = {"ua-gpu-gpu0": "0000:86:00.0", "ua-gpu-gpu1": "0000:af:00.0"}
_DEVICE = re.compile(r"-device\s+'?(\{.*?\})'?(?:\s|$)")


def seed_vmi() -> dict[str, Any]:
    vmi: dict[str, Any] = json.loads((SEED / "vmi.json").read_text())
    return unique_vmi(vmi)


def qemu_devices(command_line: str) -> dict[str, dict[str, Any]]:
    """QEMU's -device arguments by id."""
    devices = [json.loads(match) for match in _DEVICE.findall(command_line)]
    return {str(device.get("id")): device for device in devices if "id" in device}


def assert_sound(
    run: HarnessRun,
    expected: dict[str, str],
    events: tuple[str, ...] = ("OnDefineDomain",),
    for_this_host: Callable[[bytes], bytes] = lambda domain: domain,
) -> bytes:
    """What every scenario must show; returns the final domain. ``events``: the hook RPCs each define goes
    through (OnDefineDomain for the hook sidecar API, MutateDomain for the plugin API); ``for_this_host``
    changes the host side of the final domain before QEMU's argv is asked for (see the NUMA scenario)."""
    report = run.report
    assert report["stage"] == "done" and run.returncode == 0, (report.get("error"), run.stderr[-3000:])
    calls, defines = report["hookCalls"], report["defines"]
    # allocateHotplugPorts on q35 with interfaces: the placeholder define, the real one, and one more when it
    # appends root ports for hotplug; each through the hook (KubeVirt's manager is called even with no sidecar)
    assert 2 <= len(calls) == len(defines) <= 3, (len(calls), len(defines))
    for event in events:
        seen = run.hook_events(event)
        assert len(seen) == len(defines), (event, len(seen), len(defines))
        assert all(line["status"] == "OK" for line in seen), seen
    for number, (call, define) in enumerate(zip(calls, defines, strict=True)):
        assert not call.get("error") and not define.get("error"), (number, call.get("error"), define.get("error"))
        for document in (define["xml"], define["inactive"]):
            sources = hostdev_sources(document)
            assert not [s for s, n in Counter(sources).items() if n > 1], f"define {number}: twice: {sources}"
            for hostdev in hostdevs(document):
                if hostdev.get("type") in ("pci", "mdev"):
                    assert hostdev.get("mode") == "subsystem", etree.tostring(hostdev)
        got = aliases(define["xml"])
        assert {alias: got.get(alias) for alias in expected} == expected, f"define {number}: {got}"
    final = run.final
    assert {alias: aliases(final).get(alias) for alias in expected} == expected
    try:
        refusal = generic_refusal(final.decode())
    except LibvirtUnavailable as exc:
        missing(str(exc))
        raise
    assert refusal is None, refusal
    devices = qemu_devices(qemu_argv(for_this_host(final)))
    for alias, source in expected.items():
        device = devices.get(alias)
        assert device is not None, f"{alias} not in QEMU's argv: {sorted(devices)}"
        assert source in (device.get("host"), str(device.get("sysfsdev", "")).rpartition("/")[2]), device
    return final


def test_the_seeds_two_gpus_through_kubevirts_launcher_code() -> None:
    run = run_harness(seed_vmi(), SEED_ENV)
    final = assert_sound(run, SEED_GPUS)
    # virt-launcher wrote the two hostdevs itself (without mode=); the hook merged them, added none
    first_input = run.report["hookCalls"][0]["input"]
    assert sorted(hostdev_sources(first_input)) == sorted(SEED_GPUS.values())
    assert all(hostdev.get("mode") is None for hostdev in hostdevs(first_input))
    assert len(hostdevs(final)) == 2
    assert run.report["devicesMetadata"] == []


def multifunction_slots(domain_xml: bytes) -> dict[str, tuple[str | None, str | None, str]]:
    """alias → (bus, slot, function) of each hostdev's guest address, with multifunction='on' noted."""
    found = {}
    for hostdev in hostdevs(domain_xml):
        alias, address = hostdev.find("alias"), hostdev.find("address")
        if alias is None or address is None:
            continue
        flag = "+mf" if address.get("multifunction") == "on" else ""
        found[str(alias.get("name"))] = (address.get("bus"), address.get("slot"), f"{address.get('function')}{flag}")
    return found


COMPANIONS_VAR = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
COMPANIONS = "0000:86:00.0=0000:86:00.1+0000:86:00.2+0000:86:00.3,0000:af:00.0=0000:af:00.1"


def test_companions_share_the_gpus_slot_on_every_call_though_kubevirt_drops_multifunction() -> None:
    run = run_harness(seed_vmi(), {**SEED_ENV, COMPANIONS_VAR: COMPANIONS})
    companions = {  # the hook's companion aliases: ua-gpu<index>-fn<function> (README, "Companions")
        "ua-gpu0-fn1": "0000:86:00.1",
        "ua-gpu0-fn2": "0000:86:00.2",
        "ua-gpu0-fn3": "0000:86:00.3",
        "ua-gpu1-fn1": "0000:af:00.1",
    }
    owners = {"ua-gpu-gpu0": "ua-gpu0-", "ua-gpu-gpu1": "ua-gpu1-"}
    final = assert_sound(run, {**SEED_GPUS, **companions})
    calls = run.report["hookCalls"]
    for number, call in enumerate(calls):  # the hook puts multifunction='on' back on each call
        slots = multifunction_slots(call["output"].encode())
        for gpu in SEED_GPUS:
            bus, slot, function = slots[gpu]
            assert function == "0x0+mf", (number, gpu, slots[gpu])
            for companion in (alias for alias in companions if alias.startswith(owners[gpu])):
                assert slots[companion][:2] == (bus, slot), (number, companion, slots)
    # KubeVirt's read-back (api.DomainSpec has no multifunction attribute) gave the later calls none
    assert all("multifunction" not in call["input"] for call in calls[1:])
    devices = qemu_devices(qemu_argv(final))
    for gpu, function_count in (("ua-gpu-gpu0", 3), ("ua-gpu-gpu1", 1)):
        assert devices[gpu]["multifunction"] is True, devices[gpu]
        bus, addr = str(devices[gpu]["bus"]), str(devices[gpu]["addr"])
        assert addr.endswith(".0x0") or "." not in addr, addr
        for fn in range(1, function_count + 1):
            fn_device = devices[f"{owners[gpu]}fn{fn}"]
            slot = addr.split(".", maxsplit=1)[0]
            assert (fn_device["bus"], fn_device["addr"]) == (bus, f"{slot}.0x{fn}"), fn_device


T4 = "nvidia.com/GRID_T4-1Q"
T4_VAR = "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"
VGPU_UUID = "4b20d080-1b54-4048-85b3-a6a62d165c01"


@pytest.mark.parametrize(
    ("display", "expected"),
    [
        ({"display": {"enabled": True}}, ("on", "on")),
        ({"display": {"enabled": False}}, (None, None)),
        (None, ("on", "on")),  # KubeVirt's default: the first mdev GPU gets a display when none asks
    ],
    ids=["display-on", "display-off", "display-unset"],
)
def test_a_vgpus_display_as_kubevirt_and_the_hook_agree(
    display: dict[str, Any] | None, expected: tuple[str | None, str | None]
) -> None:
    vmi = seed_vmi()
    gpu: dict[str, Any] = {"name": "desk", "deviceName": T4}
    if display is not None:
        gpu["virtualGPUOptions"] = display
    vmi["spec"]["domain"]["devices"]["gpus"] = [gpu]
    run = run_harness(vmi, {T4_VAR: VGPU_UUID})
    final = assert_sound(run, {"ua-gpu-desk": VGPU_UUID})
    (hostdev,) = hostdevs(final)
    assert (hostdev.get("type"), hostdev.get("model")) == ("mdev", "vfio-pci")
    shown = None if hostdev.get("display") == "off" else hostdev.get("display")  # libvirt writes display='off' back
    assert (shown, hostdev.get("ramfb")) == expected
    device = qemu_devices(qemu_argv(final))["ua-gpu-desk"]
    wanted = ("on", True) if expected[0] == "on" else ("off", None)
    assert (device.get("display"), device.get("ramfb")) == wanted, device


USB_VAR = "USB_RESOURCE_KUBEVIRT_IO_STORAGE"
NIC = "example.com/NIC"
NIC_VAR = "PCI_RESOURCE_EXAMPLE_COM_NIC"


def usb_shape(hostdev: etree._Element) -> list[tuple[str, dict[str, str]]]:
    return [(str(element.tag), {str(k): str(v) for k, v in element.attrib.items()}) for element in hostdev.iter()]


def test_usb_and_pci_host_devices_next_to_the_gpus() -> None:
    vmi = seed_vmi()
    vmi["spec"]["domain"]["devices"]["hostDevices"] = [
        {"name": "stick", "deviceName": "kubevirt.io/storage"},
        {"name": "nic", "deviceName": NIC},
    ]
    run = run_harness(vmi, {**SEED_ENV, USB_VAR: "001:002", NIC_VAR: "0000:3b:00.0"})
    final = assert_sound(run, {**SEED_GPUS, "ua-hostdevice-nic": "0000:3b:00.0"})
    assert [int(n) for n in aliases(final)["ua-usb-host-stick"].split(":")] == [1, 2]
    for call in run.report["hookCalls"]:  # the hook leaves virt-launcher's USB hostdev as it is
        before, after = (
            [usb_shape(h) for h in hostdevs(call[key]) if h.get("type") == "usb"] for key in ("input", "output")
        )
        assert before == after and len(after) == 1, (before, after)
    assert "ua-usb-host-stick" in qemu_devices(qemu_argv(final))


A100 = "nvidia.com/GA100_A100_PCIE_80GB"
A100_VAR = "PCI_RESOURCE_NVIDIA_COM_GA100_A100_PCIE_80GB"
FW_CFG = re.compile(r"-fw_cfg\s+'?name=opt/ovmf/X-PciMmio64Mb,string=(\d+)'?")


def qemu_args(domain_xml: str) -> str:
    """The domain's <qemu:commandline> arguments, space-separated."""
    root = etree.fromstring(domain_xml.encode())
    return " ".join(str(arg.get("value")) for arg in root.iter("{http://libvirt.org/schemas/domain/qemu/1.0}arg"))


def test_an_efi_a100_gets_its_64_bit_window_on_every_call(tmp_path: Path) -> None:
    sysfs = build(A100_NODE, tmp_path / "node") / "sys"
    vmi = seed_vmi()
    vmi["spec"]["domain"]["firmware"] = {"bootloader": {"efi": {"secureBoot": False}}}
    vmi["spec"]["domain"]["devices"]["gpus"] = [{"name": "big", "deviceName": A100}]
    run = run_harness(
        vmi,
        {A100_VAR: "0000:3b:00.0"},
        hook_args=["--sysfs-root", str(sysfs)],
        harness_args=["--ovmf", "/usr/share/OVMF"],
    )
    final = assert_sound(run, {"ua-gpu-big": "0000:3b:00.0"})
    calls = run.report["hookCalls"]
    for number, call in enumerate(calls):
        assert FW_CFG.findall(qemu_args(call["output"])) == ["262144"], number
    # KubeVirt's read-back (api.DomainSpec keeps no <qemu:commandline>) gave the later calls none of the hook's
    assert all("X-PciMmio64Mb" not in call["input"] for call in calls[1:])
    command_line = qemu_argv(final)
    assert FW_CFG.findall(command_line) == ["262144"]
    assert "OVMF_CODE" in command_line


def test_gpus_below_one_host_switch_get_their_gpudirect_clique_on_every_call(tmp_path: Path) -> None:
    """docs/p2p.md: the workstation's two A6000s below one PEX switch share a clique, the third has none; KubeVirt's
    read-back drops ``<qemu:override>`` as it drops ``<qemu:commandline>``, so each call's output has it anew."""
    sysfs = build(WORKSTATION_NODE, tmp_path / "node") / "sys"
    vmi = seed_vmi()
    vmi["spec"]["domain"]["devices"]["gpus"] = [{"name": f"g{i}", "deviceName": RTX} for i in range(3)]
    addresses = ["0000:03:00.0", "0000:04:00.0", "0000:05:00.0"]
    run = run_harness(vmi, {RTX_VAR: ",".join(addresses)}, hook_args=["--sysfs-root", str(sysfs)])
    final = assert_sound(run, {f"ua-gpu-g{i}": address for i, address in enumerate(addresses)})
    calls = run.report["hookCalls"]
    for number, call in enumerate(calls):
        assert call["output"].count("x-nv-gpudirect-clique") == 2, number
    assert all("x-nv-gpudirect-clique" not in call["input"] for call in calls[1:])  # (KubeVirt's read-back)
    devices = qemu_devices(qemu_argv(final))
    assert [devices[f"ua-gpu-g{i}"].get("x-nv-gpudirect-clique") for i in range(3)] == [0, 0, None]


def test_force_gpu_aliases_renames_kubevirts_gpus_on_every_call() -> None:
    run = run_harness(seed_vmi(), SEED_ENV, hook_args=["--force-gpu-aliases"])
    final = assert_sound(run, {"ua-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0"})
    assert "ua-gpu-gpu0" not in aliases(final)
    events = run.hook_events("OnDefineDomain")
    assert all(event["warnings"] for event in events[:1]), events


DRA_A10 = "0000:3b:00.0"


def test_dra_claims_keep_kubevirts_dra_aliases() -> None:
    vmi = seed_vmi()
    vmi["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "rc"}]
    vmi["spec"]["domain"]["devices"]["gpus"] = [{"name": "g", "claimName": "gpu", "requestName": "req"}]
    run = run_harness(vmi, {}, dra_devices={("gpu", "req"): DRA_A10})
    final = assert_sound(run, {"ua-dra-gpu-g": DRA_A10})
    assert len(hostdevs(final)) == 1


def test_kubevirts_device_metadata_has_tagged_host_devices_and_no_tagged_gpu() -> None:
    """buildDevicesMetadata looks a GPU's alias up among the tagged hostDevices[] (KubeVirt v1.9's
    manager.go; its taggedGPUs map is never read): a tagged GPU gets no metadata, a tagged host device does,
    with the aliases the hook kept."""
    vmi = seed_vmi()
    vmi["spec"]["domain"]["devices"]["gpus"][0]["tag"] = "train"
    vmi["spec"]["domain"]["devices"]["hostDevices"] = [{"name": "nic", "deviceName": NIC, "tag": "fast"}]
    run = run_harness(vmi, {**SEED_ENV, NIC_VAR: "0000:3b:00.0"})
    final = assert_sound(run, {**SEED_GPUS, "ua-hostdevice-nic": "0000:3b:00.0"})
    address = next(h for h in hostdevs(final) if h.find("alias").get("name") == "ua-hostdevice-nic").find("address")  # type: ignore[union-attr]
    assert address is not None
    (entry,) = run.report["devicesMetadata"]
    assert (entry["type"], entry["tags"], entry["bus"]) == ("hostdev", ["fast"], "pci")
    wanted = "%04x:%02x:%02x.%x" % tuple(int(address.get(k, "0"), 0) for k in ("domain", "bus", "slot", "function"))  # noqa: UP031
    assert entry["address"] == wanted


TWO_NODES = {  # virt-handler's node topology (cmdv1.Topology): two NUMA nodes of two CPUs, 2 MiB pages on each
    "numa_cells": [
        {
            "id": node,
            "memory": {"amount": 8388608, "unit": "KiB"},
            "pages": [{"count": 2048, "unit": "KiB", "size": 2048}],
            "cpus": [{"id": 2 * node}, {"id": 2 * node + 1}],
        }
        for node in (0, 1)
    ]
}
GPU_NODES = {"0000:86:00.0": 0, "0000:af:00.0": 1}


def numa_node_of_bus(domain_xml: bytes) -> dict[str, int]:
    """Guest bus (``0x02``) → the NUMA node of the pcie-expander-bus its root port hangs off."""
    root = etree.fromstring(domain_xml)
    controllers = {c.get("index"): c for c in root.iterfind("devices/controller[@type='pci']")}
    nodes = {}
    for index, controller in controllers.items():
        address = controller.find("address")
        if controller.get("model") != "pcie-root-port" or address is None:
            continue
        parent = controllers.get(str(int(address.get("bus", "0"), 16)))
        node = parent.findtext("target/node") if parent is not None else None
        if parent is not None and parent.get("model") == "pcie-expander-bus" and node is not None:
            nodes[f"0x{int(str(index)):02x}"] = int(node)
    return nodes


def on_one_host_node(domain_xml: bytes) -> bytes:
    """The domain without its host NUMA binding (``<numatune>``) and hugepage backing: this host has one NUMA
    node and no hugetlbfs, and libvirt's QEMU driver checks both; the guest's NUMA cells and KubeVirt's
    expander buses, which the placement is about, stay."""
    root = etree.fromstring(domain_xml)
    for tag in ("numatune", "memoryBacking"):
        for element in root.findall(tag):
            root.remove(element)
    return etree.tostring(root)


@pytest.mark.parametrize("with_companions", [False, True], ids=["gpus", "gpus-and-companions"])
def test_pci_numa_aware_topology_keeps_kubevirts_expander_buses(tmp_path: Path, with_companions: bool) -> None:
    pci = tmp_path / "pci"
    for address, node in GPU_NODES.items():  # the stand-in for /sys/bus/pci/devices/<address>/numa_node
        (pci / address).mkdir(parents=True)
        (pci / address / "numa_node").write_text(f"{node}\n")
    topology = tmp_path / "topology.json"
    topology.write_text(json.dumps(TWO_NODES))
    vmi = seed_vmi()
    domain = vmi["spec"]["domain"]
    domain["cpu"] = {"cores": 4, "dedicatedCpuPlacement": True, "numa": {"guestMappingPassthrough": {}}}
    domain["memory"] = {"hugepages": {"pageSize": "2Mi"}}
    domain["resources"] = {"requests": {"memory": "2Gi"}}
    env = (
        {**SEED_ENV, COMPANIONS_VAR: "0000:86:00.0=0000:86:00.1,0000:af:00.0=0000:af:00.1"}
        if with_companions
        else SEED_ENV
    )
    run = run_harness(
        vmi,
        env,
        harness_args=["--pci-numa-aware", "--pci-sysfs", str(pci), "--topology", str(topology), "--cpuset", "0,1,2,3"],
    )
    expected = dict(SEED_GPUS)
    if with_companions:
        expected |= {"ua-gpu0-fn1": "0000:86:00.1", "ua-gpu1-fn1": "0000:af:00.1"}
    final = assert_sound(run, expected, for_this_host=on_one_host_node)
    for number, define in enumerate(run.report["defines"]):  # on every call, each GPU stays on its node's port
        document = define["inactive"].encode()
        buses, slots = numa_node_of_bus(document), multifunction_slots(document)
        for alias, address in SEED_GPUS.items():
            bus, _slot, function = slots[alias]
            assert buses.get(str(bus)) == GPU_NODES[address], (number, alias, slots[alias], buses)
            assert function == ("0x0+mf" if with_companions else "0x0"), (number, alias, function)
        for companion, owner in (("ua-gpu0-fn1", "ua-gpu-gpu0"), ("ua-gpu1-fn1", "ua-gpu-gpu1")):
            if with_companions:
                assert slots[companion][:2] == slots[owner][:2], (number, companion, slots)
    assert b"pcie-expander-bus" in final


def test_the_deployed_vm_goes_through_all_three_calls() -> None:
    """deploy/hook-sidecar/vm-two-gpus.yaml (16 GiB: virt-launcher wants 6 free hotplug ports) as the VM
    controller makes its VMI: allocateHotplugPorts defines it three times, the last after appending root
    ports, and the hook keeps the two GPUs once each on every call."""
    vm = yaml.safe_load((ROOT / "deploy" / "hook-sidecar" / "vm-two-gpus.yaml").read_text())
    run = run_harness(unique_vmi(vm), SEED_ENV)
    final = assert_sound(run, SEED_GPUS)
    calls = run.report["hookCalls"]
    assert len(calls) == 3
    ports = [
        len(etree.fromstring(c["input"].encode()).findall("devices/controller[@model='pcie-root-port']")) for c in calls
    ]
    assert ports[2] > ports[1], ports  # the third call's domain has the appended ports
    assert len(hostdevs(final)) == 2


def test_the_recommended_sidecar_reads_the_allocation_from_kubevirts_domain() -> None:
    """deploy/hook-sidecar/vm-two-gpus.yaml's hook (`launcher-hook serve`, no source option, no allocation
    variable in the sidecar): it takes the GPUs from the hostdevs virt-launcher wrote, on every call, also
    from the later calls' read-back domains."""
    run = run_harness(seed_vmi(), {**SEED_ENV, COMPANIONS_VAR: COMPANIONS}, hook_reads_env=False)
    final = assert_sound(run, SEED_GPUS)
    assert len(hostdevs(final)) == 2  # no companions: compute's env is not this source, and this /sys has no such GPU
    assert all("domain" in str(event.get("source", "")) for event in run.hook_events("OnDefineDomain"))


H100 = "nvidia.com/GH100H100_SXM5_80GB"
H100_VAR = "PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"


def test_a_whole_hgx_board_gets_its_nvswitches_on_every_call(tmp_path: Path) -> None:
    """docs/nvswitch.md: the plugin's answer for all eight GPUs carries the four NVSwitches; the hook adds one
    hostdev per switch, KubeVirt's read-back keeps them (``ua-`` aliases), and no call adds one twice."""
    root = build(HGX_H100_NODE, tmp_path / "node")
    board = discover(root).resource(H100)
    env = dict(allocate(board, list(HGX_H100_GPUS), root).envs)  # the plugin's answer, as the kubelet passes it
    vmi = seed_vmi()
    vmi["spec"]["domain"]["devices"]["gpus"] = [{"name": f"h{i}", "deviceName": H100} for i in range(8)]
    run = run_harness(vmi, env, hook_args=["--sysfs-root", str(root / "sys")])
    expected = {f"ua-gpu-h{i}": address for i, address in enumerate(HGX_H100_GPUS)}
    expected |= {f"ua-nvswitch{i}": address for i, address in enumerate(HGX_H100_NVSWITCHES)}
    final = assert_sound(run, expected)
    calls = run.report["hookCalls"]
    assert all("ua-nvswitch3" in call["input"] for call in calls[1:])  # KubeVirt's read-back kept them
    assert len(hostdevs(final)) == 12
    devices = qemu_devices(qemu_argv(final))
    # four GPUDirect cliques, one per host PCIe switch; the NVSwitches are in none
    assert [devices[f"ua-gpu-h{i}"].get("x-nv-gpudirect-clique") for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all("x-nv-gpudirect-clique" not in devices[f"ua-nvswitch{i}"] for i in range(4))
