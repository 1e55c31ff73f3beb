"""Which allocated device goes to which VMI entry, with which alias and display flags (docs/protocols.md, "KubeVirt
env naming")."""

from __future__ import annotations

import json
from typing import Any

import pytest

from launcher_hook.builder import BuildOptions, plan_hostdevs
from launcher_hook.hostdev import HostdevSpec
from schemas import InputError, PciAddress, ResourceKind
from schemas.vmi import VirtualMachineInstance, parse_vmi

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
T4_1Q = "nvidia.com/GRID_T4-1Q"
PCI_TU106 = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
MDEV_TU106 = "MDEV_PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
MDEV_T4 = "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"
UUID_A = "4b20d080-1b54-4048-85b3-a6a62d165c01"
UUID_B = "7b7b1e7a-2a34-4a61-9c1e-0b8f1a1b2c3d"


def vmi(gpus: list[dict[str, Any]], host_devices: list[dict[str, Any]] | None = None) -> VirtualMachineInstance:
    devices: dict[str, Any] = {"gpus": gpus}
    if host_devices is not None:
        devices["hostDevices"] = host_devices
    return parse_vmi(
        json.dumps({"metadata": {"name": "vm", "namespace": "ns"}, "spec": {"domain": {"devices": devices}}}).encode()
    )


def plan(model: VirtualMachineInstance | None, env: dict[str, str], **options: Any) -> list[HostdevSpec]:
    return plan_hostdevs(model, env, BuildOptions(**options))[0]


def summary(specs: list[HostdevSpec]) -> list[tuple[str, str]]:
    return [(spec.alias, spec.source_text) for spec in specs]


def test_gpus_with_one_device_name_take_addresses_in_list_order() -> None:
    model = vmi([{"name": "b", "deviceName": TU106}, {"name": "a", "deviceName": TU106}])
    specs = plan(model, {PCI_TU106: "0000:af:00.0,0000:86:00.0"})
    assert summary(specs) == [("ua-gpu0", "0000:af:00.0"), ("ua-gpu1", "0000:86:00.0")]
    assert all(spec.kind is ResourceKind.PCI and spec.variable == PCI_TU106 for spec in specs)


def test_pci_pool_is_used_before_the_mdev_pool() -> None:
    model = vmi([{"name": "a", "deviceName": TU106}, {"name": "b", "deviceName": TU106}])
    specs = plan(model, {PCI_TU106: "0000:86:00.0", MDEV_TU106: UUID_A})
    assert summary(specs) == [("ua-gpu0", "0000:86:00.0"), ("ua-gpu1", UUID_A)]
    assert [spec.kind for spec in specs] == [ResourceKind.PCI, ResourceKind.MDEV]


def test_alias_is_the_index_in_gpus_and_entries_without_device_name_are_left_alone() -> None:
    model = vmi(
        [{"name": "nothing"}, {"name": "weird name/!", "deviceName": TU106}],
        [
            {"name": "x", "deviceName": "example.com/nic"},
            {"name": "dra2"},
            {"name": "y", "deviceName": "example.com/nic"},
        ],
    )
    specs = plan(model, {PCI_TU106: "0000:86:00.0", "PCI_RESOURCE_EXAMPLE_COM_NIC": "0000:3b:00.0,0000:3b:00.1"})
    assert summary(specs) == [
        ("ua-gpu1", "0000:86:00.0"),
        ("ua-hostdev0", "0000:3b:00.0"),
        ("ua-hostdev2", "0000:3b:00.1"),
    ]


def test_missing_variable_names_the_gpu_its_device_name_and_both_variables() -> None:
    model = vmi([{"name": "gpu0", "deviceName": TU106}])
    with pytest.raises(InputError) as error:
        plan(model, {"PCI_RESOURCE_NVIDIA_COM_OTHER": "0000:86:00.0"})
    message = str(error.value)
    for part in ("gpus[0] 'gpu0'", TU106, PCI_TU106, MDEV_TU106):
        assert part in message


def test_too_few_addresses_names_the_variable_and_both_counts() -> None:
    model = vmi([{"name": f"g{i}", "deviceName": TU106} for i in range(3)])
    with pytest.raises(InputError) as error:
        plan(model, {PCI_TU106: "0000:86:00.0,0000:af:00.0"})
    assert str(error.value) == f"too few devices for {TU106}: {PCI_TU106} lists 2, the VMI needs 3"


def test_malformed_address_names_value_and_variable() -> None:
    with pytest.raises(InputError, match=f"{PCI_TU106}: malformed PCI address '0000:86:00'"):
        plan(vmi([{"name": "g", "deviceName": TU106}]), {PCI_TU106: "0000:86:00"})


def test_malformed_variable_is_refused_even_when_the_vmi_does_not_ask_for_it() -> None:
    with pytest.raises(InputError, match="MDEV_PCI_RESOURCE_X"):
        plan(vmi([]), {"MDEV_PCI_RESOURCE_X": "not-a-uuid"})


def test_without_vmi_every_variable_is_taken_in_name_order() -> None:
    env = {PCI_TU106: "0000:af:00.0,0000:86:00.0", MDEV_T4: UUID_A, "PCI_RESOURCE_A": "0000:01:00.0", "HOME": "/"}
    specs = plan(None, env)
    assert summary(specs) == [
        ("ua-gpu0", UUID_A),
        ("ua-gpu1", "0000:01:00.0"),
        ("ua-gpu2", "0000:af:00.0"),
        ("ua-gpu3", "0000:86:00.0"),
    ]
    assert (specs[0].display, specs[0].ramfb) == (True, True)
    assert not any(spec.display for spec in specs[1:])


def test_no_allocation_at_all_renders_nothing() -> None:
    assert plan(None, {"HOME": "/"}) == []
    assert plan(vmi([{"name": "dra"}]), {}) == []


def _display(gpus: list[dict[str, Any]], uuids: list[str]) -> list[tuple[bool, bool]]:
    specs = plan(vmi(gpus), {MDEV_T4: ",".join(uuids)})
    return [(spec.display, spec.ramfb) for spec in specs]


def test_first_mdev_gpu_gets_display_and_ramfb_when_no_gpu_sets_display_options() -> None:
    gpus = [{"name": "a", "deviceName": T4_1Q}, {"name": "b", "deviceName": T4_1Q}]
    assert _display(gpus, [UUID_A, UUID_B]) == [(True, True), (False, False)]


def test_display_options_follow_kubevirt() -> None:
    gpus: list[dict[str, Any]] = [
        {"name": "a", "deviceName": T4_1Q},
        {"name": "b", "deviceName": T4_1Q, "virtualGPUOptions": {"display": {}}},
    ]
    assert _display(gpus, [UUID_A, UUID_B]) == [(False, False), (True, True)]
    gpus[1]["virtualGPUOptions"] = {"display": {"ramFB": {"enabled": False}}}
    assert _display(gpus, [UUID_A, UUID_B]) == [(False, False), (True, False)]
    gpus[1]["virtualGPUOptions"] = {"display": {"enabled": False}}
    assert _display(gpus, [UUID_A, UUID_B]) == [(False, False), (False, False)]
    gpus[1]["virtualGPUOptions"] = {"display": {"enabled": True, "ramFB": {"enabled": True}}}
    assert _display(gpus, [UUID_A, UUID_B]) == [(False, False), (True, True)]


def test_display_is_not_written_on_pci_gpus_and_a_warning_says_so() -> None:
    model = vmi([{"name": "g", "deviceName": TU106, "virtualGPUOptions": {"display": {"enabled": True}}}])
    specs, warnings = plan_hostdevs(model, {PCI_TU106: "0000:86:00.0"}, BuildOptions())
    assert (specs[0].display, specs[0].ramfb) == (False, False)
    assert len(warnings) == 1
    assert "gpus[0] 'g'" in warnings[0] and "mdev hostdevs only" in warnings[0]


def test_managed_and_driver_options_apply_to_pci_hostdevs_only() -> None:
    env = {PCI_TU106: "0000:86:00.0", MDEV_T4: UUID_A}
    specs = plan(
        vmi([{"name": "a", "deviceName": TU106}, {"name": "b", "deviceName": T4_1Q}]), env, managed=True, driver="vfio"
    )
    assert (specs[0].managed, specs[0].driver) == (True, "vfio")
    assert specs[1].driver is None
    assert specs[0].source == PciAddress.parse("0000:86:00.0")


def test_unknown_driver_option_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported hostdev driver 'kvm'"):
        plan(None, {}, driver="kvm")


def test_a_kept_match_is_only_reused_for_the_same_inputs_and_comes_back_as_fresh_lists() -> None:
    """``match_vmi`` keeps its result with the allocation; a VMI, option or domain that differs in anything the
    match reads gets its own answer, and what a caller does to the lists it got does not reach the next call."""
    from launcher_hook.allocation import allocation_from_env
    from launcher_hook.matching import DomainHostdevs, HostdevOptions, match_vmi

    env = {PCI_TU106: "0000:af:00.0,0000:86:00.0", MDEV_T4: UUID_A}
    allocation = allocation_from_env(env)
    two = vmi([{"name": "a", "deviceName": TU106}, {"name": "b", "deviceName": TU106}])
    first, warnings = match_vmi(two, allocation, HostdevOptions())
    first.clear()
    warnings.append("mine")
    again, warnings_again = match_vmi(
        vmi([{"name": "a", "deviceName": TU106}, {"name": "b", "deviceName": TU106}]), allocation, HostdevOptions()
    )
    assert summary(again) == [("ua-gpu0", "0000:af:00.0"), ("ua-gpu1", "0000:86:00.0")] and warnings_again == []
    renamed = match_vmi(
        vmi([{"name": "z", "deviceName": TU106}, {"name": "b", "deviceName": TU106}]), allocation, HostdevOptions()
    )[0]
    assert renamed[0].label.startswith("gpus[0] 'z'")
    assert [spec.managed for spec in match_vmi(two, allocation, HostdevOptions(managed=True))[0]] == [True, True]
    rendered = DomainHostdevs({"ua-gpu-b": ("pci", "0000:af:00.0")})
    claimed = match_vmi(two, allocation, HostdevOptions(), rendered)[0]
    assert summary(claimed) == [("ua-gpu0", "0000:86:00.0"), ("ua-gpu1", "0000:af:00.0")]
    vgpu = vmi([{"name": "v", "deviceName": T4_1Q, "virtualGPUOptions": {"display": {"enabled": False}}}])
    assert [spec.display for spec in match_vmi(vgpu, allocation, HostdevOptions())[0]] == [False]
    vgpu_on = vmi([{"name": "v", "deviceName": T4_1Q}])
    assert [spec.display for spec in match_vmi(vgpu_on, allocation, HostdevOptions())[0]] == [True]
    assert [spec.display for spec in match_vmi(vgpu_on, allocation, HostdevOptions(graphics=False))[0]] == [False]
