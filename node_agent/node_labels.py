"""Node labels for GPUs GPU feature discovery cannot see: those on VFIO and those hosting vGPUs (pure).

GPU feature discovery (GFD, ``internal/lm`` of NVIDIA/k8s-device-plugin) reads GPUs through the driver's NVML,
which a VFIO-bound GPU has none of, and the GPU Operator deploys it only on ``container`` nodes. Users select
nodes by its labels, so the agent offers the same names where it can know the value (docs/node-agent.md,
"Node labels"):

- ``nvidia.com/gpu.product``: the product, in GFD's style (characters outside ``[A-Za-z0-9-_. ]`` dropped,
  each run of blanks one ``-``), from the pci.ids device name's bracketed model (``TU104GL [Tesla T4]`` →
  ``Tesla-T4``; NVML's name can differ, e.g. ``A100-PCIe-40GB`` where NVML says ``NVIDIA A100-PCIE-40GB``), of
  the first VM GPU by address, as GFD labels the first device; left out when pci.ids does not name it;
- ``nvidia.com/gpu.count``: how many GPUs serve VMs (``vm-passthrough`` and ``vm-vgpu``);
- ``nvidia.com/vgpu.type.<TYPE>``: per vGPU type (``T4-1Q``, ``A100-1-5C``: NVIDIA's name without ``GRID ``/
  ``NVIDIA ``), how many vGPUs of it exist now. This one is the agent's own (GFD has no such label).

Both ``nvidia.com/gpu.*`` labels are left out on a node where any GPU is ``container``: GFD runs there and owns
them. ``nvidia.com/gpu.memory`` is never set: only the driver knows a GPU's memory (a BAR's size is not it).
Every key and value is a valid Kubernetes label (:func:`valid_label`); the keys the agent owns are
:data:`OWNED_KEYS` and those starting with :data:`VGPU_TYPE_PREFIX` (:func:`owned`), so a caller can remove
the stale ones.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from node_agent import vgpu as vgpus
from node_agent.sysfs import Sysfs, read_function
from node_agent.workload import CONTAINER, PASSTHROUGH, VGPU
from runtime.pciids import PciIds

DOMAIN = "nvidia.com"
PRODUCT = f"{DOMAIN}/gpu.product"
COUNT = f"{DOMAIN}/gpu.count"
VGPU_TYPE_PREFIX = f"{DOMAIN}/vgpu.type."
OWNED_KEYS = frozenset({PRODUCT, COUNT})
MAX_NAME = 63
"""A label key's name part and a label value are at most 63 characters (Kubernetes' label syntax)."""

_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_PREFIX = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_GFD_DROPPED = re.compile(r"[^A-Za-z0-9\-_. ]")
_OUTSIDE_NAME = re.compile(r"[^-A-Za-z0-9_.]+")
_BRACKETED = re.compile(r"\[([^\[\]]+)\]\s*$")


def owned(key: str) -> bool:
    """Whether ``key`` is one of the labels this module sets (the ones a caller may remove when stale)."""
    return key in OWNED_KEYS or key.startswith(VGPU_TYPE_PREFIX)


def valid_label(key: str, value: str) -> bool:
    """Kubernetes' label syntax: an optional DNS-subdomain prefix (at most 253) and ``/``, a name of at most 63
    alphanumerics, ``-``, ``_``, ``.`` starting and ending alphanumeric; a value empty or of the name's syntax."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or _PREFIX.fullmatch(prefix) is None):
        return False
    if not name or len(name) > MAX_NAME or _NAME.fullmatch(name) is None:
        return False
    return value == "" or (len(value) <= MAX_NAME and _NAME.fullmatch(value) is not None)


def _trimmed(text: str) -> str:
    """``text`` cut to 63 characters and to an alphanumeric at both ends (possibly empty)."""
    text = text[:MAX_NAME]
    start = next((i for i, char in enumerate(text) if char.isascii() and char.isalnum()), len(text))
    end = next((i for i in range(len(text), 0, -1) if text[i - 1].isascii() and text[i - 1].isalnum()), 0)
    return text[start:end] if start < end else ""


def label_value(text: str) -> str:
    """``text`` as GFD sanitises a label value (dropped characters, blanks to ``-``), made a valid value."""
    return _trimmed("-".join(_GFD_DROPPED.sub("", text).split()))


def product_name(pci_ids_name: str) -> str:
    """The model of a pci.ids device name: its trailing bracketed part (``TU104GL [Tesla T4]`` → ``Tesla T4``),
    else the whole name."""
    found = _BRACKETED.search(pci_ids_name)
    return (found.group(1) if found else pci_ids_name).strip()


def vgpu_type_key(type_name: str) -> str | None:
    """``nvidia.com/vgpu.type.<TYPE>`` for a vGPU type name, the name part kept valid and within 63 characters;
    None when nothing of the name is left."""
    bare = type_name.strip().removeprefix("GRID ").removeprefix("NVIDIA ").strip()
    room = MAX_NAME - len(VGPU_TYPE_PREFIX.partition("/")[2])
    part = _trimmed(_OUTSIDE_NAME.sub("-", bare))[:room]
    part = _trimmed(part)
    return VGPU_TYPE_PREFIX + part if part else None


def node_labels(
    fs: Sysfs,
    workloads: Mapping[str, str],
    pciids: PciIds | None,
    type_names: Mapping[str, Mapping[int, str]] | None = None,
) -> dict[str, str]:
    """The labels for the node's VM GPUs (see the module doc). ``workloads``: GPU address → workload (as
    :class:`~node_agent.workload.Outcome` gives it); ``type_names``: SR-IOV type names of earlier runs (the
    state file's ``vgpu.type_names``: a VF holding a vGPU no longer lists its type's name)."""
    labels: dict[str, str] = {}
    vm = sorted(address for address, workload in workloads.items() if workload in (PASSTHROUGH, VGPU))
    if vm and not any(workload == CONTAINER for workload in workloads.values()):
        labels[COUNT] = str(len(vm))
        first = read_function(fs, vm[0])
        name = pciids.device_name(first.vendor, first.device) if pciids is not None else None
        product = label_value(product_name(name)) if name else ""
        if product:
            labels[PRODUCT] = product
    on_vgpu = {address for address, workload in workloads.items() if workload == VGPU}
    counts: dict[str, int] = {}
    for parent in vgpus.read_parents(fs, required=False):
        if parent.name not in on_vgpu:
            continue
        named = vgpus.known_sriov_types(parent, dict((type_names or {}).get(parent.name, {})))
        for key, ids in parent.vgpus().items():
            if parent.kind == "mdev":
                type_name = next((kind.name for kind in parent.mdev_types if kind.type_id == key), key)
            else:
                type_name = named.get(int(key), "")
            label = vgpu_type_key(type_name) if type_name else None
            if label is not None:
                counts[label] = counts.get(label, 0) + len(ids)
    labels.update({key: str(count) for key, count in sorted(counts.items())})
    return labels
