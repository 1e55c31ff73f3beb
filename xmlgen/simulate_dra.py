"""``xmlgen simulate --dra``: the whole path through DRA claims instead of device-plugin resources.

The same account as :mod:`xmlgen.simulate`, with the DRA parts (docs/dra.md): the real DRA kubelet plugin
(:func:`plugin.dra.serve.build_runner`, what ``gpu-device-plugin serve --dra --claims-dir`` runs) registers with
the kubelet DRA stand-in (:mod:`simkit.kubelet_dra_standin`) over unix sockets; the ResourceSlices it publishes
(:mod:`plugin.dra.slices`) feed a scheduler stand-in (:mod:`simkit.dra_scheduler`) that allocates the VMI's
claims; the stand-in's ``NodePrepareResources`` makes the plugin write the CDI spec and the KEP 5304 metadata
files; the CDI mounts are applied to a container view (hard links, as a bind mount shows the same file); the
real hook server reads the metadata files there (``--dra-metadata-root``) when called like virt-launcher;
``NodeUnprepareResources`` removes the files.

Where claims come from: the VMI's ``spec.resourceClaims`` name ResourceClaims or ResourceClaimTemplates; their
objects are in a YAML (or JSON) stream (``claims.yaml`` beside the bundled DRA examples, or ``--claims``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import grpc
import yaml

from launcher_hook.builder import BuildOptions
from launcher_hook.claims import dra_entries
from launcher_hook.dra import MetadataFiles
from launcher_hook.server import HookServer
from launcher_hook.service import HookService
from launcher_hook.sources import ProcessEnvSource
from plugin.config import PluginConfig
from plugin.dra.cdi import spec_file_name
from plugin.dra.claims import claim_file_name
from plugin.dra.options import DraOptions
from plugin.dra.serve import build_runner, claim_source
from plugin.dra.slices import build_slices
from plugin.inventory import Inventory
from runtime.pci_bars import SysfsBars
from runtime.pci_companions import SysfsCompanions
from runtime.pciids import PciIds, locate_pci_ids
from schemas.dra import DRIVER_NAME
from schemas.dra_metadata import DEFAULT_ROOT, claimed_device, parse_metadata
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2 as reg
from schemas.generated.kubelet.pluginregistration.v1 import api_pb2_grpc as reg_grpc
from schemas.vmi import VirtualMachineInstance, parse_vmi
from simkit.dra_scheduler import AllocationError, Scheduler, claim_from_template, claim_uid
from simkit.kubelet_dra_standin import DraStandInError, KubeletDraStandIn
from xmlgen.simulate import (
    BUNDLED_NODES,
    SimulationError,
    call_hook,
    call_plugin,
    example,
    host_root_of,
    prepare_and_discover,
    report_domain,
)

_DEFAULT_EXAMPLES = {"node01": "dra-node01", "vgpu": "dra-vgpu", "sriov-vgpu": "dra-sriov-vgpu"}
_WAIT_SECONDS = 10.0
MAX_CLAIM_OBJECTS = 64
"""Most objects the claims stream may hold."""
GENERATED_SUFFIX = "x7k2q"
"""The fixed 'random' suffix of generated claim names (reproducible accounts)."""


def default_dra_vmi(node: str) -> bytes:
    """The DRA VMI simulated on a node when none is given (node01's when the node has no DRA example)."""
    return example(_DEFAULT_EXAMPLES.get(node, "dra-node01"), "vmi.json")


def default_dra_claims(node: str) -> bytes:
    """The ResourceClaims/ResourceClaimTemplates the default DRA VMI names."""
    return example(_DEFAULT_EXAMPLES.get(node, "dra-node01"), "claims.yaml")


def default_dra_domain(node: str) -> bytes:
    """The domain virt-launcher renders for the default DRA VMI (no GPU hostdevs in it)."""
    if node in _DEFAULT_EXAMPLES and node != "node01":
        return example("seed-node01", "domain.xml")
    return example("dra-node01", "domain.xml")


@dataclass
class DraSimulationResult:
    domain_xml: bytes
    claims: list[dict[str, Any]] = field(default_factory=list)
    """The allocated ResourceClaim objects (resource.k8s.io/v1)."""
    cdi_ids: dict[str, list[str]] = field(default_factory=dict)
    """Claim name → the CDI device IDs the kubelet got."""
    files: list[Path] = field(default_factory=list)
    """Every file the plugin wrote for the claims (CDI specs, metadata), all removed by unprepare."""
    hook_version: str = ""
    cel: bool = False


class _NoAliases(yaml.SafeLoader):
    """YAML without anchors' aliases: a claims file has no use for them, and a few nested aliases would expand
    to gigabytes once the objects are copied or printed (the "billion laughs")."""

    def compose_node(self, parent: yaml.Node | None, index: int) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("YAML aliases (*name) are not accepted in a claims file")
        return super().compose_node(parent, index)


def parse_claim_objects(data: bytes) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """(ResourceClaimTemplates, ResourceClaims) by name, from a YAML or JSON stream (a ``List`` is opened)."""
    try:
        documents = [doc for doc in yaml.load_all(data.decode("utf-8"), Loader=_NoAliases) if doc is not None]
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SimulationError(f"the claims file is not YAML or JSON: {exc}") from None
    objects: list[Any] = []
    for doc in documents:
        items = doc.get("items") if isinstance(doc, dict) and doc.get("kind") == "List" else [doc]
        objects += items if isinstance(items, list) else [items]
    if len(objects) > MAX_CLAIM_OBJECTS:
        raise SimulationError(f"the claims file holds {len(objects)} objects, over {MAX_CLAIM_OBJECTS}")
    templates: dict[str, dict[str, Any]] = {}
    claims: dict[str, dict[str, Any]] = {}
    for index, obj in enumerate(objects):
        kind = obj.get("kind") if isinstance(obj, dict) else None
        name = obj.get("metadata", {}).get("name") if isinstance(obj, dict) else None
        if kind not in ("ResourceClaimTemplate", "ResourceClaim") or not isinstance(name, str) or not name:
            raise SimulationError(
                f"claims file object {index} is not a named ResourceClaim or ResourceClaimTemplate (kind {kind!r})"
            )
        (templates if kind == "ResourceClaimTemplate" else claims)[name] = obj
    return templates, claims


class _Slices:
    """The inventory sink: the ResourceSlices the plugin would publish for each new inventory."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self.slices: list[dict[str, Any]] = []
        self.published = threading.Event()

    def publish(self, inventory: Inventory) -> None:
        names = PciIds.load(Path(inventory.pci_ids_path)).device_name if inventory.pci_ids_path else None
        self.slices = (
            build_slices(inventory, self.node_name)
            if names is None
            else build_slices(inventory, self.node_name, product_names=names)
        )
        self.published.set()


def _node_name(node: str) -> str:
    return BUNDLED_NODES[node].name if node in BUNDLED_NODES else "simulated-node"


def _short(value: Mapping[str, Any]) -> str:
    ((_, plain),) = value.items()
    return json.dumps(plain) if isinstance(plain, bool) else str(plain)


def _report_slices(slices: list[dict[str, Any]], log: Callable[[str], None]) -> None:
    shown = ("kind", "productName", "vgpuType", "numaNode", "healthy")
    for obj in slices:
        pool = obj["spec"]["pool"]
        log(
            f"  ResourceSlice (pool {pool['name']}, generation {pool['generation']}, "
            f"{len(obj['spec']['devices'])} devices, driver {obj['spec']['driver']}):"
        )
        for device in obj["spec"]["devices"]:
            attributes = device["attributes"]
            parts = [f"{name}={_short(attributes[name])}" for name in shown if name in attributes]
            bus = attributes.get("resource.kubernetes.io/pciBusID") or attributes.get("mdevUUID")
            where = f" [{_short(bus)}]" if bus else ""
            log(f"    {device['name']}{where}: {', '.join(parts)}")


def _registration_info(socket: str) -> reg.PluginInfo:
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        info: reg.PluginInfo = reg_grpc.RegistrationStub(channel).GetInfo(reg.InfoRequest(), timeout=_WAIT_SECONDS)
        return info


def _pod_claims(
    vmi: VirtualMachineInstance,
    templates: Mapping[str, dict[str, Any]],
    objects: Mapping[str, dict[str, Any]],
    pod: str,
) -> list[tuple[str, dict[str, Any]]]:
    """(the VMI's claim name, the ResourceClaim object) for each ``spec.resourceClaims`` entry a DRA entry uses."""
    namespace = vmi.metadata.namespace or "default"
    used = {claim_name for _, _, claim_name, _ in dra_entries(vmi)}
    found = []
    for entry in vmi.spec.resource_claims:
        if entry.name not in used:
            continue
        if entry.resource_claim_template_name:
            template = templates.get(entry.resource_claim_template_name)
            if template is None:
                raise SimulationError(
                    f"spec.resourceClaims {entry.name!r} names ResourceClaimTemplate "
                    f"{entry.resource_claim_template_name!r}, which the claims file does not hold "
                    f"(it holds {sorted(templates) or 'none'})"
                )
            obj = claim_from_template(template, pod, entry.name, namespace, GENERATED_SUFFIX)
        else:
            name = entry.resource_claim_name or ""
            given = objects.get(name)
            if given is None:
                raise SimulationError(
                    f"spec.resourceClaims {entry.name!r} names ResourceClaim {name!r}, which the claims file "
                    f"does not hold (it holds {sorted(objects) or 'none'})"
                )
            obj = json.loads(json.dumps(given))
            obj.setdefault("apiVersion", "resource.k8s.io/v1")
            meta = obj.setdefault("metadata", {})
            meta["namespace"] = namespace
            meta.setdefault("uid", claim_uid(namespace, name))
        found.append((entry.name, obj))
    return found


def _check_requests(vmi: VirtualMachineInstance, claims: list[tuple[str, dict[str, Any]]]) -> None:
    """Every DRA entry's request is one of its claim's requests (virt-launcher finds no file otherwise)."""
    requests = {
        name: {str(r.get("name")) for r in obj.get("spec", {}).get("devices", {}).get("requests", [])}
        for name, obj in claims
    }
    for key, name, claim_name, request in dra_entries(vmi):
        if claim_name in requests and request not in requests[claim_name]:
            raise SimulationError(
                f"{key[0]}[{key[1]}] {name!r} asks for request {request!r} of claim {claim_name!r}, which has "
                f"requests {sorted(requests[claim_name])}"
            )


def _apply_cdi(
    cdi_dir: Path, plugin_dir: Path, uid: str, ids: list[str], container: Path, log: Callable[[str], None]
) -> tuple[Path, list[Path]]:
    """As the container runtime applies the CDI devices ``ids``: each mount of the claim's spec file made
    visible under ``container`` (a hard link: the same file, as a bind mount shows it). Returns the spec file
    and the metadata files (host paths)."""
    spec_path = cdi_dir / spec_file_name(uid)
    if not spec_path.is_file():
        raise SimulationError(f"NodePrepareResources answered, but no CDI spec for claim uid {uid} is in {cdi_dir}")
    spec = json.loads(spec_path.read_text())
    log(f"    CDI spec {spec_path} (cdiVersion {spec['cdiVersion']}, kind {spec['kind']})")
    by_id = {f"{spec['kind']}={device['name']}": device for device in spec["devices"]}
    metadata_files = []
    for cdi_id in ids:
        device = by_id.get(cdi_id)
        if device is None:
            raise SimulationError(f"CDI device {cdi_id} is not in {spec_path}")
        edits = device["containerEdits"]
        nodes = ", ".join(node["path"] for node in edits.get("deviceNodes", []))
        log(f"      {cdi_id}: device nodes {nodes}")
        for mount in edits.get("mounts", []):
            host, inside = Path(mount["hostPath"]), Path(mount["containerPath"])
            if not host.is_relative_to(plugin_dir) or not inside.is_relative_to(DEFAULT_ROOT) or ".." in inside.parts:
                raise SimulationError(
                    f"CDI device {cdi_id} mounts {str(host)!r} at {str(inside)!r}: not a metadata file of the "
                    f"plugin's ({plugin_dir}) at virt-launcher's root ({DEFAULT_ROOT})"
                )
            target = container / inside.relative_to("/")
            target.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                target.unlink()
            try:
                os.link(host, target)
            except OSError:
                shutil.copyfile(host, target)
            found = claimed_device(parse_metadata(host.read_bytes(), str(host)), inside.parent.name, str(host))
            log(f"        metadata {host}")
            attribute = "mdevUUID" if found.kind == "mdev" else "resource.kubernetes.io/pciBusID"
            log(f"          mounted at {inside}: {attribute} {found.id}")
            metadata_files.append(host)
    return spec_path, metadata_files


def _start_plugin(
    config: PluginConfig,
    options: DraOptions,
    host_root: Path,
    sink: _Slices,
    stack: contextlib.ExitStack,
    log: Callable[[str], None],
) -> KubeletDraStandIn:
    """Step 2: the kubelet stand-in, then the plugin's runner in a thread; the registration told."""
    standin = KubeletDraStandIn(options.registry_dir)
    standin.start()
    stack.callback(standin.stop)
    choice = locate_pci_ids(None, host_root, Path("/"))  # as serve --dra finds pci.ids
    runner = build_runner(
        config, options, claim_source(options), sinks=(sink,), pci_ids=choice.database, warnings=choice.warnings
    )
    thread = threading.Thread(target=runner.run, name="dra-plugin", daemon=True)
    thread.start()
    stack.callback(thread.join, _WAIT_SECONDS)
    stack.callback(runner.request_stop)
    if not runner.ready.wait(_WAIT_SECONDS):
        raise SimulationError("the DRA plugin did not start serving within 10 s")
    try:
        registration = standin.wait_for_registration(DRIVER_NAME, timeout=_WAIT_SECONDS)
    except DraStandInError as exc:
        raise SimulationError(f"the kubelet did not register the DRA plugin: {exc}") from None
    info = _registration_info(registration.socket)
    log(
        f"  GetInfo at {registration.socket}: type {info.type}, name {info.name}, endpoint {info.endpoint}, "
        f"versions {', '.join(info.supported_versions)}"
    )
    log(f"  kubelet registered {registration.driver}; it speaks {registration.service} at {registration.endpoint}")
    return standin


def _schedule(
    vmi: VirtualMachineInstance,
    pod_claims: list[tuple[str, dict[str, Any]]],
    scheduler: Scheduler,
    claims_dir: Path,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """Step 4: each claim allocated and stored where the plugin's claim source reads it."""
    if scheduler.cel:
        log("  selectors: each request's DeviceClass CEL, then its own, evaluated on every device (cel-python)")
    else:
        log(
            "  selectors: cel-python is not installed, so a simplification: a device matches its class by the "
            "'kind' attribute and 'healthy'; the requests' own selectors are NOT evaluated (a real scheduler "
            "evaluates the class's and the request's CEL)"
        )
    allocated = []
    for pod_claim, obj in pod_claims:
        try:
            allocation = scheduler.allocate(obj)
        except AllocationError as exc:
            raise SimulationError(f"the scheduler cannot allocate claim {pod_claim!r}: {exc}") from None
        meta = allocation.claim["metadata"]
        entry = vmi.spec.resource_claim(pod_claim)
        template = entry.resource_claim_template_name if entry is not None else None
        origin = f"made from ResourceClaimTemplate {template}" if template else "existing"
        log(f"  ResourceClaim {meta['namespace']}/{meta['name']} ({origin}; pod claim {pod_claim}, uid {meta['uid']}):")
        for request, device in allocation.results:
            bus = device.attribute("resource.kubernetes.io/pciBusID") or device.attribute("mdevUUID")
            log(f"    status.allocation.devices.results: {request} → {device.pool}/{device.name} ({bus})")
        name = claim_file_name(meta["namespace"], meta["name"])
        (claims_dir / name).write_text(json.dumps(allocation.claim, indent=2))
        allocated.append(allocation.claim)
    return allocated


def _prepare(
    standin: KubeletDraStandIn,
    refs: list[tuple[str, str, str]],
    cdi_dir: Path,
    plugin_dir: Path,
    container: Path,
    result: DraSimulationResult,
    log: Callable[[str], None],
) -> None:
    """Step 5: NodePrepareResources, and the CDI devices applied to the compute container."""
    try:
        answers = standin.prepare(DRIVER_NAME, refs)
    except DraStandInError as exc:
        raise SimulationError(f"NodePrepareResources failed: {exc}") from None
    for namespace, name, uid in refs:
        devices, error = answers[uid]
        if error:
            raise SimulationError(f"NodePrepareResources refused claim {namespace}/{name}: {error}")
        ids = sorted({cdi for device in devices for cdi in device.cdi_ids})
        log(f"  claim {namespace}/{name}: CDI devices {', '.join(ids)}")
        spec_path, metadata_files = _apply_cdi(cdi_dir, plugin_dir, uid, ids, container, log)
        result.cdi_ids[name] = ids
        result.files += [spec_path, *metadata_files]


def _unprepare(
    standin: KubeletDraStandIn, refs: list[tuple[str, str, str]], files: list[Path], log: Callable[[str], None]
) -> None:
    """Step 7: NodeUnprepareResources; every file the plugin wrote must be gone."""
    try:
        errors = standin.unprepare(DRIVER_NAME, refs)
    except DraStandInError as exc:
        raise SimulationError(f"NodeUnprepareResources failed: {exc}") from None
    for namespace, name, uid in refs:
        if errors[uid]:
            raise SimulationError(f"NodeUnprepareResources refused claim {namespace}/{name}: {errors[uid]}")
    left = [str(path) for path in files if path.exists()]
    if left:
        raise SimulationError(f"NodeUnprepareResources left {', '.join(left)}")
    log(f"  claims unprepared; removed {len(files)} files (CDI specs and metadata)")


def _hook(
    work: Path,
    host_root: Path,
    container: Path,
    domain_xml: bytes,
    vmi_json: bytes,
    hook_api: Literal["hooks", "plugins"],
    stack: contextlib.ExitStack,
    log: Callable[[str], None],
) -> tuple[bytes, str]:
    """Step 6: the real hook server, reading the metadata files where the compute container sees them."""
    if hook_api == "plugins":
        log("6. hook sidecar: MutateDomain as virt-launcher calls a Plugin's sidecar (KubeVirt plugin API)")
    else:
        log("6. hook sidecar: OnDefineDomain as virt-launcher calls it")
    metadata_root = container / DEFAULT_ROOT.lstrip("/")
    log(f"  --dra-metadata-root {metadata_root} (the compute container's {DEFAULT_ROOT})")
    bars = SysfsBars(host_root / "sys")
    # As `launcher-hook serve` builds it: the companions of claimed GPUs come from sysfs (no variable names them).
    build = BuildOptions(
        bars=bars, claims=MetadataFiles(metadata_root), companion_reader=SysfsCompanions(host_root / "sys")
    )
    hook = HookServer(work / "hook.sock", HookService(ProcessEnvSource({}), build), api=hook_api)
    hook.start()
    stack.callback(hook.stop)
    call = call_plugin if hook_api == "plugins" else call_hook
    domain, version = call(work / "hook.sock", domain_xml, vmi_json, log)
    report_domain(domain_xml, domain, version, bars, log)
    return domain, version


def simulate_dra(
    node: str,
    vmi_json: bytes,
    domain_xml: bytes,
    claims_data: bytes,
    log: Callable[[str], None],
    *,
    scan_interval: float = 5.0,
    hook_api: Literal["hooks", "plugins"] = "hooks",
    use_cel: bool = True,
) -> DraSimulationResult:
    """Run the DRA path for ``node`` (a bundled node name or a host root) and return the final domain;
    ``use_cel=False`` allocates as without cel-python."""
    vmi = parse_vmi(vmi_json)
    if not dra_entries(vmi):
        raise SimulationError(
            "the VMI has no DRA entry (a gpus[]/hostDevices[] entry with claimName and requestName instead of "
            "deviceName): --dra simulates claims; without --dra, device-plugin resources"
        )
    templates, objects = parse_claim_objects(claims_data)
    node_name = _node_name(node)
    pod = f"virt-launcher-{vmi.metadata.name or 'vmi'}-abcde"
    try:
        pod_claims = _pod_claims(vmi, templates, objects, pod)
        _check_requests(vmi, pod_claims)
    except (AttributeError, KeyError, TypeError) as exc:
        raise SimulationError(
            f"a claim in the claims file is malformed (not the resource.k8s.io/v1 shape): {type(exc).__name__}: {exc}"
        ) from None
    with host_root_of(node) as host_root, contextlib.ExitStack() as stack:
        work = Path(tempfile.mkdtemp(prefix="xd", dir="/tmp"))  # short: unix socket paths are limited to 107 bytes
        stack.callback(shutil.rmtree, work, ignore_errors=True)
        config, _ = prepare_and_discover(node, host_root, log)

        log(f"2. DRA kubelet plugin (serve --dra --claims-dir) registering with the kubelet stand-in in {work}")
        claims_dir = work / "claims"
        claims_dir.mkdir()
        options = DraOptions(
            plugin_dir=work / "plugin",
            registry_dir=work / "registry",
            cdi_dir=work / "cdi",
            claims_dir=claims_dir,
            pool=node_name,
            scan_interval=scan_interval,
        )
        sink = _Slices(node_name)
        standin = _start_plugin(config, options, host_root, sink, stack, log)

        log(f"3. ResourceSlices the plugin publishes for node {node_name} (resource.k8s.io/v1)")
        if not sink.published.wait(_WAIT_SECONDS):
            raise SimulationError("the DRA plugin offered no inventory within 10 s")
        _report_slices(sink.slices, log)
        if not sink.slices:
            log("  no devices: no ResourceSlice")

        log(f"4. scheduler: allocating the ResourceClaims of VMI {vmi.display_name}'s pod {pod}")
        scheduler = Scheduler(node_name, sink.slices, use_cel=use_cel)
        allocated = _schedule(vmi, pod_claims, scheduler, claims_dir, log)
        result = DraSimulationResult(b"", allocated, cel=scheduler.cel)

        log("5. kubelet: NodePrepareResources; the container runtime applies the CDI devices to the compute container")
        refs = [(o["metadata"]["namespace"], o["metadata"]["name"], o["metadata"]["uid"]) for o in allocated]
        container = work / "compute"
        _prepare(standin, refs, options.cdi_dir, options.plugin_dir, container, result, log)

        result.domain_xml, result.hook_version = _hook(
            work, host_root, container, domain_xml, vmi_json, hook_api, stack, log
        )

        log("7. kubelet: the pod is gone (its container view removed); NodeUnprepareResources")
        shutil.rmtree(container, ignore_errors=True)
        _unprepare(standin, refs, result.files, log)
        return result
