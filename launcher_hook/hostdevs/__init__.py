"""The hostdev model of every device kind, found by the kind's key: ``launcher_hook.hostdevs.<key>.MODEL``.

Each VM-side kind (:data:`schemas.kinds.VM_KINDS`) has its model in the module named after its key (``pci``,
``mdev``), so adding a kind here is adding that one module; nothing lists the models by hand. A kind that
reaches the VM as another (``reaches_vm_as``: an SR-IOV vGPU is a PCI function) uses that kind's model.
"""

from __future__ import annotations

import importlib

from launcher_hook.hostdevs.base import HostdevModel
from schemas import VM_KINDS, ResourceKind


def _load(kind: ResourceKind) -> HostdevModel:
    model = importlib.import_module(f"{__name__}.{kind.value}").MODEL
    if not isinstance(model, HostdevModel) or model.kind.key is not kind:
        raise TypeError(f"{__name__}.{kind.value}.MODEL is not the hostdev model of {kind.value}")
    return model


HOSTDEV_MODELS: dict[ResourceKind, HostdevModel] = {kind: _load(kind) for kind in VM_KINDS}
"""Each kind's model, in the table's order."""
MODELS_BY_TYPE: dict[str, HostdevModel] = {model.type_name: model for model in HOSTDEV_MODELS.values()}
"""The models by libvirt's ``<hostdev type=…>``."""


def model_for_type(hostdev_type: str | None) -> HostdevModel | None:
    """The model of a ``<hostdev type=…>`` this project writes, or None (usb, scsi… are libvirt's only)."""
    return MODELS_BY_TYPE.get(hostdev_type or "")
