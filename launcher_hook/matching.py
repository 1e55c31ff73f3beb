"""Which allocated device becomes which of the VM's devices, and with what alias.

Follows virt-launcher (FACTS.md §4): each ``gpus[]`` entry takes the next unused ID of its
``deviceName``, the PCI variable first and then the mdev one, an ID being used once across all
variables; ``hostDevices[]`` entries the same way. Where KubeVirt only logs a missing variable and fails
later with a count mismatch, this names the GPU, the resource and the variables looked for.

Aliases are ``ua-gpuN`` / ``ua-hostdevN`` with N the entry's index in its list, so they never depend on
user-chosen names (which may hold characters libvirt silently drops from aliases).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from launcher_hook.allocation import Allocation, DeviceId, Pool
from launcher_hook.hostdev import HostdevSpec
from schemas import InputError, ResourceKind, env_var_for
from schemas.vmi import GPU, VGPUOptions, VirtualMachineInstance


@dataclass(frozen=True)
class HostdevOptions:
    """Rendering choices that are not in the VMI."""

    managed: bool = False
    driver: str | None = None
    graphics: bool = True
    """Whether the domain has a ``<graphics>`` device: libvirt's QEMU driver refuses ``display='on'`` on an
    mdev hostdev without one, so the default display is only turned on with it."""


class _Request(NamedTuple):
    """One VMI entry that asks for a device: where it sits and which resource it names."""

    list_name: str  # "gpus" or "hostDevices"
    position: int
    name: str
    device_name: str
    gpu: GPU | None

    @property
    def alias(self) -> str:
        return f"ua-gpu{self.position}" if self.list_name == "gpus" else f"ua-hostdev{self.position}"

    @property
    def label(self) -> str:
        return f"{self.list_name}[{self.position}] {self.name!r} (deviceName {self.device_name})"


def _requests(vmi: VirtualMachineInstance) -> list[_Request]:
    devices = vmi.spec.domain.devices
    requests = [
        _Request("gpus", index, gpu.name, gpu.device_name, gpu)
        for index, gpu in enumerate(devices.gpus)
        if gpu.device_name
    ]
    requests += [
        _Request("hostDevices", index, host.name, host.device_name, None)
        for index, host in enumerate(devices.host_devices)
        if host.device_name
    ]
    return requests


def _pools_for(device_name: str, allocation: Allocation) -> list[Pool]:
    """The PCI pool, then the mdev pool, of ``device_name`` (either may be absent)."""
    return [
        pool
        for kind in (ResourceKind.PCI, ResourceKind.MDEV)
        if (pool := allocation.pool(env_var_for(device_name, kind))) is not None
    ]


def _check_supply(requests: Sequence[_Request], pools_by_name: dict[str, list[Pool]]) -> None:
    """Every requested resource has a variable with enough IDs; otherwise say exactly what is missing."""
    for request in requests:
        if not pools_by_name[request.device_name]:
            pci, mdev = (env_var_for(request.device_name, kind) for kind in (ResourceKind.PCI, ResourceKind.MDEV))
            raise InputError(
                f"{request.label}: no allocation variable found; looked for {pci} and {mdev} "
                "(is the device plugin serving this resource, and is this the compute container's env?)"
            )
    for device_name, count in Counter(request.device_name for request in requests).items():
        pools = pools_by_name[device_name]
        found = len({device_id for pool in pools for device_id in pool.ids})
        if found < count:
            raise InputError(
                f"too few devices for {device_name}: {' + '.join(pool.variable for pool in pools)} lists {found}, "
                f"the VMI needs {count}"
            )


def _display_flags(options: VGPUOptions | None, first_mdev: bool, any_display: bool) -> tuple[bool, bool]:
    """KubeVirt's display/ramfb rules for an mdev GPU (PCI hostdevs never get them: libvirt's schema has
    them on mdev hostdevs only)."""
    display = options.display if options else None
    if display is None:
        return (True, True) if first_mdev and not any_display else (False, False)
    if display.enabled is False:
        return False, False
    return True, not (display.ram_fb is not None and display.ram_fb.enabled is False)


def match_vmi(
    vmi: VirtualMachineInstance, allocation: Allocation, options: HostdevOptions
) -> tuple[list[HostdevSpec], list[str]]:
    """Hostdev specs for the VMI's GPUs and host devices, in VMI order, and warnings for the user."""
    requests = _requests(vmi)
    pools_by_name = {name: _pools_for(name, allocation) for name in {request.device_name for request in requests}}
    _check_supply(requests, pools_by_name)
    any_display = any(
        gpu.virtual_gpu_options and gpu.virtual_gpu_options.display for gpu in vmi.spec.domain.devices.gpus
    )
    # One cursor per resource over its IDs, PCI pool first: each request takes the next one not yet used.
    cursors: dict[str, Iterator[tuple[Pool, DeviceId]]] = {
        name: ((pool, device_id) for pool in pools for device_id in pool.ids) for name, pools in pools_by_name.items()
    }
    used: set[DeviceId] = set()
    specs: list[HostdevSpec] = []
    warnings: list[str] = []
    first_mdev_seen = False
    for request in requests:
        for pool, device_id in cursors[request.device_name]:  # noqa: B007 - pool is used after the break
            if device_id not in used:
                break
        else:
            raise InputError(
                f"{request.label}: every device of {request.device_name} is already taken by another entry"
            )
        used.add(device_id)
        gpu_options = request.gpu.virtual_gpu_options if request.gpu is not None else None
        if pool.kind is ResourceKind.MDEV:
            is_first_mdev = request.list_name == "gpus" and not first_mdev_seen
            first_mdev_seen |= is_first_mdev
            display, ramfb = _display_flags(gpu_options, is_first_mdev and options.graphics, bool(any_display))
            if display and not options.graphics:
                raise InputError(
                    f"{request.label} asks for a vGPU display, but the domain has no <graphics> device and "
                    "libvirt refuses display='on' without one (keep autoattachGraphicsDevice on, or set "
                    "virtualGPUOptions.display.enabled: false)"
                )
            specs.append(
                HostdevSpec(pool.kind, device_id, request.alias, pool.variable, options.managed, None, display, ramfb)
            )
            continue
        if gpu_options is not None and gpu_options.display is not None and gpu_options.display.enabled is True:
            warnings.append(
                f"{request.label}: display/ramfb are not written on PCI passthrough hostdevs "
                "(libvirt's schema allows them on mdev hostdevs only and its parser drops them)"
            )
        specs.append(HostdevSpec(pool.kind, device_id, request.alias, pool.variable, options.managed, options.driver))
    return specs, warnings


def match_all(allocation: Allocation, options: HostdevOptions) -> list[HostdevSpec]:
    """Without a VMI: every variable in name order, IDs in listed order, aliases ``ua-gpu0``, ``ua-gpu1``…"""
    specs: list[HostdevSpec] = []
    seen: set[DeviceId] = set()
    first_mdev = True
    for variable in sorted(allocation.pools):
        pool = allocation.pools[variable]
        for device_id in pool.ids:
            if device_id in seen:
                continue
            seen.add(device_id)
            on = pool.kind is ResourceKind.MDEV and first_mdev and options.graphics
            first_mdev &= pool.kind is not ResourceKind.MDEV
            specs.append(_spec(pool, device_id, f"ua-gpu{len(specs)}", options, on, on))
    return specs


def _spec(
    pool: Pool, device_id: DeviceId, alias: str, options: HostdevOptions, display: bool, ramfb: bool
) -> HostdevSpec:
    return HostdevSpec(
        kind=pool.kind,
        source=device_id,
        alias=alias,
        variable=pool.variable,
        managed=options.managed,
        driver=options.driver if pool.kind is ResourceKind.PCI else None,
        display=display,
        ramfb=ramfb,
    )
