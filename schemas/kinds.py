"""The device kinds this project hands to VMs, as one table: each kind's facts, declared once.

Both sides branch on the kind of a device: the plugin publishes ``PCI_RESOURCE_*`` or ``MDEV_PCI_RESOURCE_*``,
the hook tells the kinds apart by variable prefix or by the ID's form, parses and prints the IDs, and writes a
``<hostdev type='pci'>`` or ``<hostdev type='mdev'>``. Written as ``X if PCI else Y`` in many modules, a third
kind (USB, SR-IOV vGPU) would silently take the else branch. Here each kind is one :class:`DeviceKind` row of
:data:`DEVICE_KINDS`; code asks the row (``kind_info(kind).env_prefix``, ``.parse_id``, ``.hostdev_type`` …)
instead of comparing kinds. Adding a kind is one :class:`ResourceKind` member and one row here, plus the
per-kind module of each side (the plugin's discovery, the hook's hostdev model). A kind may reach the VM as
another one (an SR-IOV vGPU VF is a PCI function to KubeVirt): its row says so (``reaches_vm_as``), it needs no
hook module, and the hook only sees :data:`VM_KINDS`.

The facts: KubeVirt's env naming (docs/protocols.md, "KubeVirt env naming"), libvirt's hostdev types
(docs/protocols.md, "libvirt hostdev"), the sysfs layout (docs/node.md).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from schemas.errors import InputError
from schemas.mdev import looks_like_mdev_uuid, parse_mdev_uuid
from schemas.pci import PciAddress

DeviceId = PciAddress | str
"""A device's parsed ID: a PCI function (passthrough) or a canonical lower-case mdev UUID (vGPU)."""


class ResourceKind(enum.StrEnum):
    """The key of a device kind (its value is the word logs and JSON use); its facts are in :data:`DEVICE_KINDS`."""

    PCI = "pci"
    MDEV = "mdev"
    SRIOV_VGPU = "sriov_vgpu"

    @property
    def env_prefix(self) -> str:
        return DEVICE_KINDS[self].env_prefix

    @property
    def info(self) -> DeviceKind:
        return DEVICE_KINDS[self]


def env_name_part(resource_name: str) -> str:
    """The resource name as KubeVirt puts it after a variable's prefix: ``/`` and ``.`` become ``_``, upper-cased
    (``nvidia.com/GRID_T4-1Q`` → ``NVIDIA_COM_GRID_T4-1Q``)."""
    return resource_name.replace("/", "_").replace(".", "_").upper()


def swap_prefix(variable: str, prefix: str, other: str) -> str | None:
    """``<other>_<NAME>`` for a ``<prefix>_<NAME>`` variable (``<NAME>`` not empty), else None: the variables
    the plugin sets beside KubeVirt's (``PCI_COMPANIONS_<NAME>``, ``PCI_NVSWITCHES_<NAME>``) share its ``<NAME>``."""
    head = prefix + "_"
    if not variable.startswith(head) or len(variable) == len(head):
        return None
    return f"{other}_{variable[len(head) :]}"


def _parse_pci(text: str) -> DeviceId:
    return PciAddress.parse(text)


def _parse_pci_list(text: str) -> list[DeviceId] | None:
    found = PciAddress.parse_list(text)
    return None if found is None else list(found)


def _no_fast_list(text: str) -> list[DeviceId] | None:
    return None


def _is_pci_address(text: str) -> bool:
    try:
        PciAddress.parse(text)
    except InputError:
        return False
    return True


def _pci_sort_key(text: str) -> tuple[int, ...]:
    return tuple(PciAddress.parse(text))


@dataclass(frozen=True, eq=False)
class DeviceKind:
    """Everything the plugin and the hook need to know about one kind of device."""

    key: ResourceKind
    env_prefix: str
    """virt-launcher's variable prefix; the variable is ``<prefix>_<RESOURCE NAME>``."""
    hostdev_type: str
    """libvirt's ``<hostdev type=…>`` for this kind."""
    sysfs_bus: str
    """The kernel bus the devices are listed under: ``/sys/bus/<bus>/devices/<ID>``."""
    label: str
    """What a person calls one device of this kind (``GPU``, ``vGPU``) in messages."""
    detail_heading: str
    """What ``xmlgen discover`` shows about each device of the kind (its companions, its mdev type)."""
    parse_id: Callable[[str], DeviceId]
    """Parse one ID strictly (raises :class:`InputError` naming the value); returns its canonical form."""
    parse_id_list: Callable[[str], list[DeviceId] | None]
    """All IDs of a comma-separated list in one pass, or None to fall back to ``parse_id`` per item."""
    looks_like_id: Callable[[str], bool]
    """Whether an ID (e.g. one PodResources reports) has this kind's form."""
    id_sort_key: Callable[[str], object]
    """How a list of this kind's IDs is put in a stable order (numerically for PCI addresses)."""
    takes_driver_element: bool
    """Whether ``<driver name='vfio'/>`` may be written on its hostdev (PCI only; libvirt has none for mdev)."""
    default_display: bool
    """Whether a GPU of this kind gets ``display``/``ramfb`` by default (KubeVirt's rule for vGPUs)."""
    needs_vfio_pci: bool
    """Whether the node needs the ``vfio-pci`` driver for it (mdevs hang off their vendor's driver)."""
    reaches_vm_as: ResourceKind | None = None
    """The kind whose variable, ID form and ``<hostdev>`` this kind's devices reach the VM with, when that is
    another kind's (an SR-IOV vGPU VF is a PCI hostdev to KubeVirt and libvirt); None for a kind the VM side
    tells apart. Only the plugin sees such a kind; the hook sees the kind it reaches the VM as."""

    def format_id(self, device_id: DeviceId) -> str:
        """The ID as the plugin publishes it and the kernel names it (``0000:86:00.0``, a lower-case UUID)."""
        return str(device_id)

    def env_var(self, resource_name: str) -> str:
        """The variable virt-launcher reads for ``resource_name``: ``/`` and ``.`` become ``_``, upper-cased."""
        return f"{self.env_prefix}_{env_name_part(resource_name)}"


PCI_PASSTHROUGH = DeviceKind(
    key=ResourceKind.PCI,
    env_prefix="PCI_RESOURCE",
    hostdev_type="pci",
    sysfs_bus="pci",
    label="GPU",
    detail_heading="COMPANIONS",
    parse_id=_parse_pci,
    parse_id_list=_parse_pci_list,
    looks_like_id=_is_pci_address,
    id_sort_key=_pci_sort_key,
    takes_driver_element=True,
    default_display=False,
    needs_vfio_pci=True,
)
MDEV_VGPU = DeviceKind(
    key=ResourceKind.MDEV,
    env_prefix="MDEV_PCI_RESOURCE",
    hostdev_type="mdev",
    sysfs_bus="mdev",
    label="vGPU",
    detail_heading="MDEV TYPE",
    parse_id=parse_mdev_uuid,
    parse_id_list=_no_fast_list,
    looks_like_id=looks_like_mdev_uuid,
    id_sort_key=str.lower,
    takes_driver_element=False,
    default_display=True,
    needs_vfio_pci=False,
)

SRIOV_VGPU = DeviceKind(
    key=ResourceKind.SRIOV_VGPU,
    env_prefix=PCI_PASSTHROUGH.env_prefix,
    hostdev_type=PCI_PASSTHROUGH.hostdev_type,
    sysfs_bus="pci",
    label="vGPU",
    detail_heading="VGPU TYPE",
    parse_id=_parse_pci,
    parse_id_list=_parse_pci_list,
    looks_like_id=_is_pci_address,
    id_sort_key=_pci_sort_key,
    takes_driver_element=True,
    default_display=False,
    needs_vfio_pci=False,
    reaches_vm_as=ResourceKind.PCI,
)
"""An NVIDIA vGPU on an SR-IOV virtual function (vGPU 17+ on Ada, Hopper, Blackwell; docs/node.md, "SR-IOV
vGPUs"): the VF stays on the ``nvidia`` driver, which serves it through VFIO itself, and goes to the VM as a
whole PCI function, ``managed='no'``, as KubeVirt passes it (its PR #16890)."""

DEVICE_KINDS: dict[ResourceKind, DeviceKind] = {kind.key: kind for kind in (PCI_PASSTHROUGH, MDEV_VGPU, SRIOV_VGPU)}
"""Every kind the plugin serves, in the order virt-launcher looks for a GPU's device (PCI pool first, then mdev)."""

VM_KINDS: dict[ResourceKind, DeviceKind] = {
    key: kind for key, kind in DEVICE_KINDS.items() if kind.reaches_vm_as is None
}
"""The kinds the VM side tells apart (each its own variable prefix and ``<hostdev>``): what the hook iterates."""

_BY_PREFIX = sorted(VM_KINDS.values(), key=lambda kind: -len(kind.env_prefix))  # longest prefix wins
ENV_PREFIXES: tuple[str, ...] = tuple(f"{kind.env_prefix}_" for kind in VM_KINDS.values())
"""``PCI_RESOURCE_``, ``MDEV_PCI_RESOURCE_``: the start of every allocation variable."""


def kind_info(kind: ResourceKind) -> DeviceKind:
    """The table row of ``kind``."""
    return DEVICE_KINDS[kind]


def kind_of_variable(variable: str) -> DeviceKind | None:
    """The VM-side kind whose allocation variable ``variable`` is (by prefix), or None for any other variable."""
    for kind in _BY_PREFIX:
        if variable.startswith(kind.env_prefix) and variable[len(kind.env_prefix) : len(kind.env_prefix) + 1] == "_":
            return kind
    return None


def kind_of_id(device_id: str) -> DeviceKind | None:
    """The VM-side kind whose ID form ``device_id`` has, or None (e.g. another plugin's device ID)."""
    for kind in VM_KINDS.values():
        if kind.looks_like_id(device_id):
            return kind
    return None
