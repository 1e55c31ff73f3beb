"""Mdevs of non-PCI parents (the kernel's sample drivers mtty/mdpy/mbochs), offered only by opt-in configuration.

The fixture below lays out sysfs as Debian 6.1's ``mtty`` does (checked against the real kernel in
``tests/realnode``): the parent is ``/sys/devices/virtual/mtty/mtty`` (no ``vendor``), the type directory
``mdev_supported_types/mtty-2`` (name ``Dual port serial``), the mdev a child of the parent with its own IOMMU
group holding it alone, and ``/dev/vfio/<group>`` while it is bound (mtty's own mdev driver, named ``mtty``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from plugin.allocation import DeviceUnavailable, allocate, recheck_device
from plugin.config import PluginConfig, config_json_schema, load_config
from plugin.inventory import Inventory, Resource
from plugin.sysfs import scan
from runtime.pciids import PciIds
from schemas.errors import InputError
from schemas.naming import ResourceKind
from simkit.fixture_nodes import NODE01, VGPU_NODE
from simkit.sysfs_fixture import build

UUID = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
GROUP = 42
RESOURCE = "nvidia.com/Dual_port_serial"
ENV = "MDEV_PCI_RESOURCE_NVIDIA_COM_DUAL_PORT_SERIAL"


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _add_mtty(root: Path, *, bound: bool = True) -> None:
    """One mtty-2 mdev under the virtual parent mtty, as the real kernel shows it."""
    sys = root / "sys"
    parent = sys / "devices" / "virtual" / "mtty" / "mtty"
    for type_id, name in (("mtty-1", "Single port serial"), ("mtty-2", "Dual port serial")):
        type_dir = parent / "mdev_supported_types" / type_id
        type_dir.mkdir(parents=True)
        (type_dir / "name").write_text(f"{name}\n")
        (type_dir / "device_api").write_text("vfio-pci\n")
        (type_dir / "devices").mkdir()
    (parent / "uevent").write_text("")
    mdev = parent / UUID
    mdev.mkdir()
    _link(mdev / "mdev_type", parent / "mdev_supported_types" / "mtty-2")
    _link(sys / "bus" / "mdev" / "devices" / UUID, mdev)
    group = sys / "kernel" / "iommu_groups" / str(GROUP)
    _link(mdev / "iommu_group", group)
    _link(group / "devices" / UUID, mdev)
    if bound:
        driver = sys / "bus" / "mdev" / "drivers" / "mtty"
        driver.mkdir(parents=True)
        _link(mdev / "driver", driver)
        (root / "dev" / "vfio" / str(GROUP)).write_text("")


def _remove_mtty(root: Path) -> None:
    """What ``echo 1 > remove`` leaves: the mdev, its bus link, its group and its group node gone."""
    (root / "sys" / "bus" / "mdev" / "devices" / UUID).unlink()
    group = root / "sys" / "kernel" / "iommu_groups" / str(GROUP)
    (group / "devices" / UUID).unlink()
    (group / "devices").rmdir()
    group.rmdir()
    (root / "dev" / "vfio" / str(GROUP)).unlink(missing_ok=True)


def _scan(root: Path, **settings: object) -> Inventory:
    config = PluginConfig.from_mapping({"host_root": str(root), **settings})
    return scan(root, config, PciIds.load(root / "usr" / "share" / "misc" / "pci.ids"))


def _mtty_resource(inventory: Inventory) -> Resource:
    return next(resource for resource in inventory.resources if resource.name == RESOURCE)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = build(NODE01, tmp_path / "root")
    _add_mtty(root)
    return root


def test_by_default_the_mdev_is_not_offered_and_the_reason_names_the_settings(root: Path) -> None:
    inventory = _scan(root)
    assert RESOURCE not in {resource.name for resource in inventory.resources}
    ignored = next(item for item in inventory.ignored if item.id == UUID)
    assert "is not a PCI function" in ignored.reason
    assert "mdev_parent_selectors [mtty]" in ignored.reason and "mdev_type_selectors [mtty-2]" in ignored.reason


@pytest.mark.parametrize(
    "settings",
    [{"mdev_parent_selectors": ["mtty"]}, {"mdev_type_selectors": ["mtty-2"]}],
    ids=["by-parent", "by-type"],
)
def test_opted_in_the_mdev_is_an_mdev_resource_named_by_its_type(root: Path, settings: dict[str, object]) -> None:
    inventory = _scan(root, **settings)
    resource = _mtty_resource(inventory)
    assert resource.kind is ResourceKind.MDEV
    assert resource.env == ENV
    (device,) = resource.devices
    assert device.id == UUID and device.iommu_group == GROUP and device.healthy
    assert device.mdev_type == "mtty-2" and device.parent is None and device.driver == "mtty"
    assert UUID not in {item.id for item in inventory.ignored}


def test_another_type_or_parent_does_not_select_it(root: Path) -> None:
    inventory = _scan(root, mdev_type_selectors=["mtty-1"], mdev_parent_selectors=["mdpy"])
    assert RESOURCE not in {resource.name for resource in inventory.resources}
    assert UUID in {item.id for item in inventory.ignored}


def test_nvidia_resources_are_unchanged_by_the_new_settings(root: Path) -> None:
    before = _scan(root)
    after = _scan(root, mdev_parent_selectors=["mtty"])
    assert [r for r in after.resources if r.name != RESOURCE] == list(before.resources)


def test_type_selectors_do_not_admit_a_vgpu_of_an_unselected_pci_parent(tmp_path: Path) -> None:
    """The new settings are for non-PCI parents only: NVIDIA vGPUs stay governed by pci_selectors."""
    vgpu = build(VGPU_NODE, tmp_path / "vgpu")
    inventory = _scan(vgpu, pci_selectors=["1234:5678"], mdev_type_selectors=["nvidia-230"])
    assert not [resource for resource in inventory.resources if resource.kind is ResourceKind.MDEV]


def test_allocate_agrees_with_discovery_and_refuses_once_it_is_removed(root: Path) -> None:
    resource = _mtty_resource(_scan(root, mdev_parent_selectors=["mtty"]))
    allocation = allocate(resource, [UUID], root)
    assert allocation.envs == {ENV: UUID}
    assert [spec.host_path for spec in allocation.device_specs] == ["/dev/vfio/vfio", f"/dev/vfio/{GROUP}"]
    _remove_mtty(root)
    assert recheck_device(resource.device(UUID), root) is not None
    with pytest.raises(DeviceUnavailable) as refused:
        allocate(resource, [UUID], root)
    assert refused.value.device_id == UUID
    assert RESOURCE not in {r.name for r in _scan(root, mdev_parent_selectors=["mtty"]).resources}


def test_an_unbound_mdev_is_offered_unhealthy_and_allocate_refuses(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    _add_mtty(root, bound=False)
    resource = _mtty_resource(_scan(root, mdev_parent_selectors=["mtty"]))
    (device,) = resource.devices
    assert not device.healthy and f"/dev/vfio/{GROUP}" in (device.reason or "")
    with pytest.raises(DeviceUnavailable) as refused:
        allocate(resource, [UUID], root)
    assert refused.value.device_id == UUID


def test_settings_from_the_environment_and_bad_names(tmp_path: Path) -> None:
    config = load_config(
        env={"GPU_PLUGIN_MDEV_PARENT_SELECTORS": "mtty, mdpy", "GPU_PLUGIN_MDEV_TYPE_SELECTORS": "mbochs-1"}
    )
    assert config.mdev_parent_selectors == ("mtty", "mdpy") and config.mdev_type_selectors == ("mbochs-1",)
    assert PluginConfig().mdev_parent_selectors == () and PluginConfig().mdev_type_selectors == ()
    with pytest.raises(InputError, match="mdev_type_selectors"):
        load_config(env={"GPU_PLUGIN_MDEV_TYPE_SELECTORS": "../x"})
    schema = json.loads(config_json_schema())
    assert schema["properties"]["mdev_parent_selectors"]["default"] == []


def test_a_virtual_parent_named_like_a_scanned_gpu_is_still_virtual(tmp_path: Path) -> None:
    """A virtual mdev parent whose name is a PCI address the bus scan read (``0000:3b:00.0``, an NVIDIA GPU):
    it is no PCI function (no ``vendor``, not under a PCI root), so it is not offered without opt-in and never
    as that GPU's vGPU."""
    root = build(NODE01, tmp_path / "node")
    _add_mtty(root)
    virtual = root / "sys" / "devices" / "virtual" / "mtty"
    (virtual / "mtty").rename(virtual / "0000:3b:00.0")
    link = root / "sys" / "bus" / "mdev" / "devices" / UUID
    link.unlink()
    _link(link, virtual / "0000:3b:00.0" / UUID)
    group_link = root / "sys" / "kernel" / "iommu_groups" / str(GROUP) / "devices" / UUID
    group_link.unlink()
    _link(group_link, virtual / "0000:3b:00.0" / UUID)
    inventory = _scan(root)
    assert RESOURCE not in [resource.name for resource in inventory.resources]
    ignored = next(item for item in inventory.ignored if item.id == UUID)
    assert "is not a PCI function" in ignored.reason
