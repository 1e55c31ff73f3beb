"""The whole path on one machine: node → device plugin → kubelet → Allocate → hook → domain → libvirt.

``xmlgen simulate`` shows a user, before they touch a cluster, that a VM gets its GPUs and why: the real
device plugin serves a node tree (a bundled fixture node or a directory) to the kubelet stand-in over unix
sockets (first, when the node needs it, what the node agent would change: :mod:`xmlgen.node_prep`); the
stand-in asks for the VMI's GPUs as the kubelet does (preferred allocation, then Allocate);
the real hook server gets the Allocate env and is called like virt-launcher (``Info``, then the newest
``OnDefineDomain``; or, with ``hook_api="plugins"``, KubeVirt's plugin API ``MutateDomain``). Every step is
told on the ``log`` callback; the result is the final domain XML.

This is the one module that runs the plugin and the hook together, which is why it lives in ``xmlgen``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Literal

import grpc

from launcher_hook.builder import BuildOptions
from launcher_hook.companions import slot_account
from launcher_hook.domain import hostdev_source_key, parse_domain
from launcher_hook.mmio_window import WindowOutcome, explicit_window, guest_firmware, plan_window
from launcher_hook.server import PLUGINS_VERSION, HookServer
from launcher_hook.service import HookService
from launcher_hook.sources import ProcessEnvSource
from plugin.config import PluginConfig
from plugin.inventory import Device, Inventory
from plugin.manager import PluginManager
from plugin.sysfs import discover_node
from runtime.hook_api import HOOK_API_VERSIONS
from runtime.pci_bars import SysfsBars
from schemas import InputError
from schemas.generated.kubevirt.hooks import info_pb2, info_pb2_grpc
from schemas.generated.kubevirt.hooks.plugins.v1alpha1 import api_pb2 as plugins_pb2
from schemas.generated.kubevirt.hooks.plugins.v1alpha1 import api_pb2_grpc as plugins_pb2_grpc
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from schemas.pci import PciAddress
from schemas.vmi import VirtualMachineInstance, parse_vmi
from simkit.fixture_nodes import A100_NODE, MIXED_NODE, NODE01, SRIOV_VGPU_NODE, VGPU_NODE
from simkit.kubelet_standin import KubeletStandIn, StandInError
from simkit.sysfs_fixture import Node, build
from xmlgen.node_prep import node_preparation

BUNDLED_NODES: Mapping[str, Node] = {
    "node01": NODE01,
    "vgpu": VGPU_NODE,
    "mixed": MIXED_NODE,
    "sriov-vgpu": SRIOV_VGPU_NODE,
    "a100": A100_NODE,
}
"""The fixture nodes ``--node`` knows by name (the seed's node01, a vGPU node, a mixed node, an SR-IOV vGPU node,
a node of large-BAR A100s)."""
_DEFAULT_VMIS = {
    "vgpu": ("vgpu-node", "vmi.json"),
    "sriov-vgpu": ("sriov-vgpu", "vmi.json"),
    "a100": ("a100-efi", "vmi.json"),
}
_DEFAULT_DOMAINS = {"a100": ("a100-efi", "domain.xml")}
_NEWEST_FIRST = tuple(reversed(HOOK_API_VERSIONS))
_WAIT_SECONDS = 10.0


def example(*parts: str) -> bytes:
    """A file of the bundled examples (installed with the package)."""
    return resources.files("xmlgen").joinpath("examples", *parts).read_bytes()


def default_vmi(node: str) -> bytes:
    """The VMI simulated on a node when none is given: the seed's two-GPU VM, a vGPU desktop, or a VM with one
    vGPU of each type of the SR-IOV vGPU node."""
    return example(*_DEFAULT_VMIS.get(node, ("seed-node01", "vmi.json")))


def default_domain(node: str) -> bytes:
    """The domain virt-launcher would render when none is given: the seed's, or an EFI one on the A100 node."""
    return example(*_DEFAULT_DOMAINS.get(node, ("seed-node01", "domain.xml")))


@dataclass
class ResourceGrant:
    """What the kubelet stand-in got from the plugin for one resource (IDs chosen, env, device nodes)."""

    resource: str
    device_ids: list[str]
    envs: dict[str, str]
    device_specs: list[str]


@dataclass
class SimulationResult:
    domain_xml: bytes
    allocations: list[ResourceGrant] = field(default_factory=list)
    hook_version: str = ""


class SimulationError(InputError):
    """The simulated path broke; the message says at which step and why."""


@contextlib.contextmanager
def host_root_of(node: str) -> Iterator[Path]:
    if node in BUNDLED_NODES:
        directory = Path(tempfile.mkdtemp(prefix="xmlgen-node-"))
        try:
            yield build(BUNDLED_NODES[node], directory / node)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    root = Path(node)
    if not (root / "sys").is_dir():
        raise SimulationError(f"--node {node!r} is neither {', '.join(BUNDLED_NODES)} nor a directory with a sys/ tree")
    yield root


def _describe(device: Device) -> str:
    numa = f"NUMA {device.numa_node}" if device.numa_node is not None else "NUMA unknown"
    where = f"{numa}, {device.pcie_root}" if device.pcie_root else numa
    health = "healthy" if device.healthy else f"UNHEALTHY: {device.reason}"
    return f"{device.id} ({where}, IOMMU group {device.iommu_group}): {health}"


def prepare_and_discover(node: str, host_root: Path, log: Callable[[str], None]) -> tuple[PluginConfig, Inventory]:
    """Steps 0 and 1 of both simulations: what the node agent would change (when anything), then discovery."""
    config = PluginConfig(host_root=str(host_root))
    preparation = node_preparation(host_root)
    if preparation.needed:
        log("0. node preparation: what the node agent would change first (simulate changes nothing)")
        for line in preparation.lines():
            log(line)
    log(f"1. node {node}: discovering under {host_root}")
    inventory = discover_node(config)
    report_inventory(inventory, log)
    return config, inventory


def report_inventory(inventory: Inventory, log: Callable[[str], None]) -> None:
    if not inventory.resources:
        log("  no resources: no vfio-bound NVIDIA GPU and no vGPU")
    for resource in inventory.resources:
        log(
            f"  {resource.name} ({resource.kind}, {resource.healthy_count}/{len(resource.devices)} healthy) "
            f"→ socket {resource.socket}, env {resource.env}"
        )
        for device in resource.devices:
            log(f"    {_describe(device)}")
    for ignored in inventory.ignored:
        log(f"  not offered: {ignored.id} ({ignored.vendor_device}): {ignored.reason}")


def _why(chosen: list[str], inventory: Inventory, resource: str) -> str:
    devices = {device.id: device for device in inventory.resource(resource).devices}
    numa = sorted({str(devices[i].numa_node) for i in chosen if i in devices and devices[i].numa_node is not None})
    roots = sorted({str(devices[i].pcie_root) for i in chosen if i in devices and devices[i].pcie_root})
    parts = [f"NUMA node {', '.join(numa)}" if numa else "NUMA unknown"]
    if roots:
        parts.append(f"PCIe root {', '.join(roots)}")
    return "; ".join(parts)


def _requests(vmi: VirtualMachineInstance) -> Counter[str]:
    devices = vmi.spec.domain.devices
    names = [gpu.device_name for gpu in devices.gpus] + [host.device_name for host in devices.host_devices]
    return Counter(name for name in names if name)


def _allocate(
    standin: KubeletStandIn, inventory: Inventory, vmi: VirtualMachineInstance, log: Callable[[str], None]
) -> list[ResourceGrant]:
    allocations = []
    for resource, count in sorted(_requests(vmi).items()):
        if resource not in inventory.resource_names:
            offered = ", ".join(inventory.resource_names) or "nothing"
            raise SimulationError(f"the VMI asks for {count} {resource}, but the node offers {offered}")
        standin.wait_for_registration(resource, timeout=_WAIT_SECONDS)
        seen = standin.wait_for_devices(resource, bool, timeout=_WAIT_SECONDS)
        healthy = sorted(device for device, health in seen.items() if health == "Healthy")
        if len(healthy) < count:
            raise SimulationError(
                f"the VMI asks for {count} {resource}, the kubelet sees {len(healthy)} healthy: "
                "the pod would stay Pending"
            )
        try:
            chosen = standin.preferred_allocation(resource, healthy, [], count)
            response = standin.allocate(resource, chosen)
        except (StandInError, grpc.RpcError) as exc:
            raise SimulationError(f"Allocate for {resource} failed: {exc}") from None
        log(
            f"  {resource}: the VMI asks for {count}, the kubelet sees {len(healthy)} healthy; "
            f"the plugin prefers {', '.join(chosen)} "
            f"({_why(chosen, inventory, resource)})"
        )
        container = response.container_responses[0]
        envs = dict(container.envs)
        specs = [f"{spec.host_path} ({spec.permissions})" for spec in container.devices]
        for name, value in sorted(envs.items()):
            log(f"    env {name}={value}")
        log(f"    devices {', '.join(specs)}")
        allocations.append(ResourceGrant(resource, list(chosen), envs, specs))
    return allocations


def call_hook(socket: Path, domain_xml: bytes, vmi_json: bytes, log: Callable[[str], None]) -> tuple[bytes, str]:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        info = info_pb2_grpc.InfoStub(channel).Info(info_pb2.InfoParams(), timeout=_WAIT_SECONDS)
        version = next((name for name in _NEWEST_FIRST if name in info.versions), None)
        if version is None or "OnDefineDomain" not in [point.name for point in info.hookPoints]:
            raise SimulationError(f"the hook offers versions {list(info.versions)} without OnDefineDomain we know")
        log(f"  Info: {info.name}, versions {', '.join(info.versions)}; virt-launcher would pick {version}")
        messages, stubs = HOOK_API_VERSIONS[version]
        try:
            result = stubs.CallbacksStub(channel).OnDefineDomain(
                messages.OnDefineDomainParams(domainXML=domain_xml, vmi=vmi_json), timeout=60
            )
        except grpc.RpcError as exc:
            raise SimulationError(f"OnDefineDomain failed with {exc.code().name}: {exc.details()}") from None
    return bytes(result.domainXML), version


def call_plugin(socket: Path, domain_xml: bytes, vmi_json: bytes, log: Callable[[str], None]) -> tuple[bytes, str]:
    """As virt-launcher calls a Plugin CR's sidecar: no Info, one MutateDomain (domain type libvirt, Boot)."""
    request = plugins_pb2.MutateDomainRequest(
        domain_type="libvirt",
        domain=domain_xml,
        vmi=vmi_json,
        sidecar_context=plugins_pb2.SidecarContext(invocation_context="Boot"),
    )
    log(f"  MutateDomain ({PLUGINS_VERSION}): domain type libvirt, invocation context Boot")
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        try:
            result = plugins_pb2_grpc.DomainHookServiceStub(channel).MutateDomain(request, timeout=30)
        except grpc.RpcError as exc:
            raise SimulationError(f"MutateDomain failed with {exc.code().name}: {exc.details()}") from None
    return bytes(result.domain), PLUGINS_VERSION


def simulate(
    node: str,
    vmi_json: bytes,
    domain_xml: bytes,
    log: Callable[[str], None],
    *,
    scan_interval: float = 5.0,
    hook_api: Literal["hooks", "plugins"] = "hooks",
) -> SimulationResult:
    """Run the whole path for ``node`` (a bundled node name or a host root) and return the final domain;
    ``hook_api`` is how the hook is called: the hook sidecar API or KubeVirt's plugin API."""
    vmi = parse_vmi(vmi_json)
    with host_root_of(node) as host_root, contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="xs", dir="/tmp"))  # short: unix socket paths are limited to 107 bytes
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        config, inventory = prepare_and_discover(node, host_root, log)

        log(f"2. device plugin serving {work / 'plugins'} to the kubelet stand-in")
        standin = KubeletStandIn(work / "plugins")
        standin.start()
        stack.callback(standin.stop)
        manager = PluginManager.from_config(config, work / "plugins", scan_interval=scan_interval)
        thread = threading.Thread(target=manager.run, name="device-plugin", daemon=True)
        thread.start()
        stack.callback(thread.join, _WAIT_SECONDS)
        stack.callback(manager.request_stop)
        if not manager.ready.wait(_WAIT_SECONDS):
            raise SimulationError("the device plugin did not start serving within 10 s")
        for name in inventory.resource_names:
            registration = standin.wait_for_registration(name, timeout=_WAIT_SECONDS)
            standin.wait_for_devices(name, bool, timeout=_WAIT_SECONDS)  # the first ListAndWatch message
            log(
                f"  registered {name} at {registration.endpoint}; kubelet sees capacity "
                f"{standin.capacity(name)}, allocatable {standin.allocatable(name)}"
            )

        log(f"3. kubelet: preferred allocation and Allocate for VMI {vmi.display_name}")
        allocations = _allocate(standin, inventory, vmi, log)
        env = {name: value for allocation in allocations for name, value in allocation.envs.items()}

        if hook_api == "plugins":
            log("4. hook sidecar: MutateDomain as virt-launcher calls a Plugin's sidecar (KubeVirt plugin API)")
        else:
            log("4. hook sidecar: OnDefineDomain as virt-launcher calls it")
        bars = SysfsBars(host_root / "sys")
        hook = HookServer(work / "hook.sock", HookService(ProcessEnvSource(env), BuildOptions(bars=bars)), api=hook_api)
        hook.start()
        stack.callback(hook.stop)
        call = call_plugin if hook_api == "plugins" else call_hook
        domain, version = call(work / "hook.sock", domain_xml, vmi_json, log)
        report_domain(domain_xml, domain, version, bars, log)
        return SimulationResult(domain, allocations, version)


def report_domain(before: bytes, domain: bytes, version: str, bars: SysfsBars, log: Callable[[str], None]) -> None:
    """The account of the hook's result: its hostdevs, the companions' guest slots, the 64-bit window."""
    log(f"  hostdevs written ({version}):")
    for hostdev in parse_domain(domain, DEFAULT_MAX_INPUT_BYTES).root.iterfind("devices/hostdev"):
        alias = hostdev.find("alias")
        kind, source = hostdev_source_key(hostdev) or ("?", "?")
        log(f"    {alias.get('name') if alias is not None else '(no alias)'} → {kind} {source}")
    slots = slot_account(domain, DEFAULT_MAX_INPUT_BYTES)
    if slots:
        log("  GPUs with their companion functions, one guest slot each (guest function: host device):")
        for line in slots:
            log(f"    {line}")
    log(f"  mmio64: {_window_account(before, domain, bars).describe()}")


def _window_account(before: bytes, after: bytes, bars: SysfsBars) -> WindowOutcome:
    """What the hook decided about the guest's 64-bit PCI window, told from the domains before and after."""
    root = parse_domain(after, DEFAULT_MAX_INPUT_BYTES).root
    outcome = WindowOutcome(guest_firmware(root))
    keys = (hostdev_source_key(hostdev) for hostdev in root.iterfind("devices/hostdev"))
    addresses = [PciAddress.parse(key[1]) for key in keys if key is not None and key[0] == "pci"]
    if outcome.firmware is None or not addresses:
        return outcome
    outcome.plan = plan_window(bars.read_all(addresses))
    outcome.explicit = explicit_window(parse_domain(before, DEFAULT_MAX_INPUT_BYTES).root)
    written = explicit_window(root)
    if outcome.explicit is None and written is not None:
        outcome.written_mib = written.mib
    return outcome
