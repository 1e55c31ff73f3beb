"""The NVSwitch step of planning: an HGX board's switches, carried by the allocation of all its GPUs, as hostdevs.

Part of planning (before the merge pass writes anything): the device plugin gives a pod every NVSwitch of the
board when it gives it every GPU of the board, in ``PCI_NVSWITCHES_<NAME>`` beside the GPUs'
``PCI_RESOURCE_<NAME>`` (:mod:`schemas.fabric`, docs/nvswitch.md). KubeVirt knows nothing of them (no VMI
entry names them), so the hook adds one ``<hostdev>`` per switch, aliased ``ua-nvswitchN``, to the GPUs' hostdevs;
the merge pass writes them with the rest, and finds them again by their source on KubeVirt's later calls. Each
switch gets a guest slot of its own from libvirt, like a GPU: it is a function of its own on the host.

Switches come only with the VM's GPUs: a variable whose GPUs no hostdev of this VM uses adds nothing (with a
warning).
"""

from __future__ import annotations

from collections.abc import Sequence

from launcher_hook.allocation import EnvAllocation
from launcher_hook.hostdev import HostdevSpec
from schemas.fabric import switches_variable_for
from schemas.kinds import ResourceKind

ALIAS_PREFIX = "ua-nvswitch"
"""The switches' aliases: ``ua-nvswitch0``, ``ua-nvswitch1``, … in address order (KubeVirt keeps ``ua-`` ones)."""


def switch_specs(specs: Sequence[HostdevSpec], allocation: EnvAllocation, warnings: list[str]) -> list[HostdevSpec]:
    """The hostdevs of the NVSwitches that came with the GPUs of ``specs`` (none without a switches variable);
    each like its GPUs' (``managed``, ``driver``)."""
    if not allocation.switches:
        return []
    by_variable: dict[str, HostdevSpec] = {}
    for spec in specs:
        if spec.kind is ResourceKind.PCI:
            by_variable.setdefault(spec.variable, spec)
    added: list[HostdevSpec] = []
    taken = {spec.source for spec in specs}
    for gpus, switches in sorted(allocation.switches.items()):
        variable = switches_variable_for(gpus) or gpus
        gpu = by_variable.get(gpus)
        if gpu is None:
            warnings.append(f"{variable}: no GPU of {gpus} is this VM's, so its NVSwitches are not added")
            continue
        for switch in switches:
            if switch in taken:
                continue  # the VMI named it itself (a hostDevices entry): one hostdev per function
            taken.add(switch)
            added.append(
                HostdevSpec(
                    ResourceKind.PCI,
                    switch,
                    f"{ALIAS_PREFIX}{len(added)}",
                    variable,
                    gpu.managed,
                    gpu.driver,
                    label=f"NVSwitch {switch} ({variable})",
                )
            )
    return added
