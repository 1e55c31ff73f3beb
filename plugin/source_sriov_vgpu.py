"""SR-IOV vGPUs: virtual functions of an NVIDIA GPU given a vGPU type, found under ``/sys/bus/pci/drivers/nvidia``.

From vGPU 17 on Ada, Hopper and Blackwell GPUs, NVIDIA's host driver no longer makes mdevs: the GPU (the
physical function, PF) is split into SR-IOV virtual functions (VFs) that stay bound to ``nvidia``, and a VF
becomes a vGPU when a type ID is written to its ``nvidia/current_vgpu_type`` (docs/node.md, "SR-IOV vGPUs").
The driver serves such a VF through VFIO itself (``/dev/vfio/<group>``), and KubeVirt passes it to the VM as a
plain PCI function (``PCI_RESOURCE_…``, ``<hostdev type='pci' managed='no'>``).

A VF is offered when it is on ``nvidia``, its ``current_vgpu_type`` is not ``0`` and its PF is a selected GPU.
Its resource is named after its vGPU type's name, as NVIDIA's plugin names mdev types (``NVIDIA L40S-1Q`` →
``nvidia.com/NVIDIA_L40S-1Q``). The driver shows names only in ``creatable_vgpu_types`` (``ID : name`` lines),
and a VF that has a type lists none; the name is read from the other VFs of the same GPU (and the PF's own
list when the driver writes one), else from another GPU of the same PCI device ID (type IDs are the driver's
per GPU model), and last from the node agent's state file (``vgpu.type_names``, the names the agent saw for
that GPU when it made the vGPUs: :mod:`schemas.node_agent_state`; read only when a list falls short). A VF whose
type no list names is not offered, with that reason (every VF of every such GPU is in use, or the GPU is full,
and no agent state names it). Health: its IOMMU group and ``/dev/vfio`` as for any VFIO device; Allocate's
re-check adds that it is still on ``nvidia`` with the same type.
"""

from __future__ import annotations

from dataclasses import dataclass

from plugin.health import PciFunction, UsabilityRule
from plugin.hostroot import Directory, ReadError
from plugin.inventory import Device, Ignored
from plugin.naming import mdev_resource_name
from plugin.node_scan import NodeScan
from schemas.errors import InputError
from schemas.kinds import SRIOV_VGPU, DeviceKind
from schemas.node_agent_state import MAX_STATE_BYTES, parse_state, type_names
from schemas.pci import PciAddress

VF_DRIVER = "nvidia"
"""The driver an SR-IOV vGPU VF stays on (NVIDIA's host driver is its VFIO driver too)."""
MAX_TYPE_ID_DIGITS = 9
"""A vGPU type ID is a small decimal number (``1147``); anything longer is not one."""


def parse_creatable_types(text: str) -> dict[int, str]:
    """``creatable_vgpu_types`` as ``{ID: name}``: ``ID : name`` lines; the header (``ID    : vGPU Name``) and any
    line whose ID is not a plain number are skipped. The first name given for an ID wins.

    >>> parse_creatable_types("ID    : vGPU Name\\n1145  : NVIDIA L40S-1B\\n1147  : NVIDIA L40S-1Q\\n")
    {1145: 'NVIDIA L40S-1B', 1147: 'NVIDIA L40S-1Q'}
    """
    names: dict[int, str] = {}
    for line in text.splitlines():
        number, colon, name = line.partition(":")
        number, name = number.strip(), name.strip()
        if colon and name and number.isdigit() and len(number) <= MAX_TYPE_ID_DIGITS:
            names.setdefault(int(number), name)
    return names


def parse_type_id(text: str | None) -> int | None:
    """``current_vgpu_type``'s number (``0`` when the VF has no type); None when absent or not a number."""
    if text is None:
        return None
    value = text.strip()
    return int(value) if value.isdigit() and len(value) <= MAX_TYPE_ID_DIGITS else None


@dataclass(frozen=True, slots=True)
class _Vf:
    name: str
    directory: str
    type_id: int
    pf: str | None
    function: PciFunction


@dataclass(frozen=True, slots=True)
class SriovVgpuSource:
    """The :class:`~plugin.sources.DeviceSource` of vGPUs on SR-IOV virtual functions."""

    kind: DeviceKind = SRIOV_VGPU
    kubevirt_list: str = "pciHostDevices"
    kubevirt_selector: str = "pciVendorSelector"

    def scan(self, node: NodeScan) -> None:
        try:
            entries = sorted(node.fs.listdir(f"/sys/bus/pci/drivers/{VF_DRIVER}"))
        except OSError:
            return  # the driver is not loaded: no SR-IOV vGPUs
        vfs: list[_Vf] = []
        by_pf: dict[str, dict[int, str]] = {}
        by_model: dict[str, dict[int, str]] = {}
        for entry in entries:
            try:
                PciAddress.parse(entry)
            except InputError:
                continue  # the driver directory also holds bind, unbind, module, new_id…
            directory = f"{node.pci_dir}/{entry}"
            type_id = parse_type_id(node.read_text(f"{directory}/nvidia/current_vgpu_type"))
            if type_id is None:
                continue  # not a vGPU VF (a PF, or a GPU on the host driver)
            node.claim(entry)
            function = node.read_function(directory, entry)
            if function is None:
                continue
            pf = _pci_address(node.fs.readlink_name(f"{directory}/physfn"))
            listed = parse_creatable_types(node.read_text(f"{directory}/nvidia/creatable_vgpu_types") or "")
            if pf is not None:
                _merge(by_pf.setdefault(pf, {}), listed)
            _merge(by_model.setdefault(function.vendor_device, {}), listed)
            if type_id:
                vfs.append(_Vf(entry, directory, type_id, pf, function))
            else:
                node.ignored.append(
                    Ignored(
                        entry,
                        function.vendor_device,
                        function.driver,
                        "an SR-IOV vGPU VF with no vGPU type yet (nvidia/current_vgpu_type is 0)",
                        "create a vGPU on it (gpu-node-agent vgpu apply, or write an ID its "
                        "nvidia/creatable_vgpu_types lists to nvidia/current_vgpu_type); never bind it to vfio-pci",
                    )
                )
        for pf in list(by_pf):
            _merge(
                by_pf[pf],
                parse_creatable_types(node.read_text(f"{node.pci_dir}/{pf}/nvidia/creatable_vgpu_types") or ""),
            )
            self._explain_pf(node, pf)
        from_agent: dict[str, dict[int, str]] | None = None
        for vf in vfs:
            same_model = by_model.get(vf.function.vendor_device, {})
            name = by_pf.get(vf.pf or "", {}).get(vf.type_id) or same_model.get(vf.type_id)
            if name is None and vf.pf is not None:
                if from_agent is None:
                    from_agent = agent_type_names(node)
                name = from_agent.get(vf.pf, {}).get(vf.type_id)
            self._scan_vf(node, vf, name)

    @staticmethod
    def _explain_pf(node: NodeScan, pf: str) -> None:
        """A GPU split into vGPU VFs is not offered because its VFs are, not because it is "not on vfio-pci"."""
        function = node.read_function(f"{node.pci_dir}/{pf}", pf)
        if function is None or function.driver != VF_DRIVER:
            return
        if not node.config.selects(function.vendor, function.device, function.pci_class):
            return  # a GPU the plugin was not asked for is not listed at all
        node.claim(pf)
        enabled = node.read_int(f"{node.pci_dir}/{pf}/sriov_numvfs", 10)
        reason = (
            f"a GPU split into SR-IOV vGPU VFs ({enabled if enabled is not None else 'some'} enabled): "
            "its VFs are offered as vGPUs, not the GPU itself"
        )
        fix = (
            "nothing for vGPUs; to pass the whole GPU through instead, remove its vGPUs, disable its VFs "
            "(sriov_numvfs 0) and bind it to vfio-pci (gpu-node-agent bind)"
        )
        node.ignored.append(Ignored(pf, function.vendor_device, function.driver, reason, fix))

    def _scan_vf(self, node: NodeScan, vf: _Vf, type_name: str | None) -> None:
        function = vf.function
        if vf.pf is None:
            reason = "it has a vGPU type but no physfn link naming a PCI function (its GPU is unknown)"
            node.ignored.append(Ignored(vf.name, function.vendor_device, function.driver, reason))
            return
        if not node.config.selects(function.vendor, function.device, function.pci_class):
            node.ignored.append(
                Ignored(vf.name, function.vendor_device, function.driver, f"its GPU {vf.pf} is not a selected GPU")
            )
            return
        if type_name is None:
            agent = (
                f" nor by the node agent's {node.shown(node.config.node_agent_state)}"
                if node.config.node_agent_state
                else ""
            )
            reason = (
                f"its vGPU type {vf.type_id} is named by no creatable_vgpu_types of its GPU {vf.pf} or of a GPU "
                f"like it (each VF has a type, or the GPU is full){agent}: its resource cannot be named"
            )
            node.ignored.append(Ignored(vf.name, function.vendor_device, function.driver, reason))
            return
        name = node.checked_name(
            mdev_resource_name(type_name, node.config.resource_domain),
            f"vGPU type {vf.type_id} ({type_name!r}) cannot be offered",
        )
        if name is None:
            node.ignored.append(
                Ignored(vf.name, function.vendor_device, function.driver, "its resource name is invalid")
            )
            return
        with node.fs.directory(vf.directory) as handle:
            group = node.read_group_in(handle)
            numa = node.numa(vf.directory, handle)
        problems, companions = node.group_facts(vf.name, group)
        root, path = node.topology(node.link_target(vf.directory))
        device = Device(
            id=vf.name,
            kind=self.kind.key,
            vendor_device=function.vendor_device,
            iommu_group=group,
            numa_node=numa,
            healthy=not problems,
            reason="; ".join(problems) or None,
            companions=companions,
            pcie_root=root,
            pcie_path=path,
            driver=function.driver,
            parent=PciAddress.parse(vf.pf),
            mdev_type=str(vf.type_id),
        )
        node.add(name, self.kind.key, device, function.vendor_device)

    def recheck_driver(self, device: Device, directory: Directory, rule: UsabilityRule) -> str | None:
        """The VF must still be on ``nvidia`` with the vGPU type the scan saw (``directory``: its sysfs
        directory)."""
        driver = directory.readlink_name("driver")
        if driver != VF_DRIVER:
            return f"it is now bound to {driver or 'no driver'}, not to {VF_DRIVER} (its vGPU is gone)"
        try:
            # Two components: read the careful way (every link resolved inside the host root), not by the
            # handle's single-name open.
            now = parse_type_id(directory.fs.read(f"{directory.path}/nvidia/current_vgpu_type"))
        except ReadError as exc:
            return f"its nvidia/current_vgpu_type cannot be read: {exc}"
        if now == 0:
            return f"its vGPU was removed (current_vgpu_type is 0, was {device.mdev_type})"
        if now is None or str(now) != device.mdev_type:
            return f"its vGPU type is now {now if now is not None else 'unreadable'} (was {device.mdev_type})"
        return None


def agent_type_names(node: NodeScan) -> dict[str, dict[int, str]]:
    """The SR-IOV vGPU type names the node agent recorded (``{GPU address: {type ID: name}}``), read from the
    configured ``node_agent_state`` under the host root: bounded, a FIFO or device never opened for long, links
    resolved inside the root. Empty when not configured or absent (no agent, or it has not run yet); a file
    that cannot be used is a warning naming it, and the scan goes on without it."""
    path = node.config.node_agent_state
    if not path:
        return {}
    try:
        text = node.fs.read(path, MAX_STATE_BYTES)
        if text is None:
            return {}
        return type_names(parse_state(text, node.shown(path)))
    except ReadError as exc:
        problem = f"{node.root.rstrip('/')}{exc}"
    except InputError as exc:
        problem = str(exc)
    node.warnings.append(f"ignoring the node agent's state file (SR-IOV vGPU type names): {problem}")
    return {}


def _pci_address(name: str | None) -> str | None:
    """A link's last component if it is a PCI address (``physfn`` → ``0000:3b:00.0``), else None: a link that
    leads elsewhere (``/etc``, ``..``) names no GPU, and must not end the scan."""
    if name is None:
        return None
    try:
        PciAddress.parse(name)
    except InputError:
        return None
    return name


def _merge(names: dict[int, str], listed: dict[int, str]) -> None:
    for type_id, name in listed.items():
        names.setdefault(type_id, name)


SRIOV_VGPU_SOURCE = SriovVgpuSource()
