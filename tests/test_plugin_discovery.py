"""Discovery on realistic sysfs trees written to disk: the three fixture nodes, then one behaviour at a time."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from plugin.inventory import Inventory
from plugin.node_scan import parse_pci_uevent
from plugin.sources import permitted_host_devices
from plugin.sysfs import scan
from runtime.pciids import PciIds
from schemas import InputError, PciAddress, ResourceKind
from simkit.fixture_nodes import (
    CLASS_3D,
    CLASS_AUDIO,
    CLASS_PCI_BRIDGE,
    MIXED_NODE,
    NODE01,
    NVIDIA,
    PCI_IDS_EXCERPT,
    T4_1Q_A,
    T4_1Q_B,
    T4_2Q,
    VGPU_NODE,
    root_port,
    tu106_card,
)
from simkit.sysfs_fixture import Function, Mdev, MdevType, Node
from tests.discovery_support import build_node, discover
from tests.plugin_support import rebind

TU106 = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
CARDS = ("0000:3b:00.0", "0000:5e:00.0", "0000:86:00.0", "0000:af:00.0")


def _node(name: str, *functions: Function, **extra: object) -> Node:
    return Node(name, tuple(functions), pci_ids=PCI_IDS_EXCERPT, **extra)  # type: ignore[arg-type]


# -- the fixture trees are shaped like the kernel's -------------------------------------------------------


def test_tree_has_the_kernel_layout(tmp_path: Path) -> None:
    root = build_node(NODE01, tmp_path)
    bus_link = root / "sys/bus/pci/devices/0000:86:00.0"
    assert os.readlink(bus_link) == "../../../devices/pci0000:85/0000:85:00.0/0000:86:00.0"
    device = bus_link.resolve()
    assert device == (root / "sys/devices/pci0000:85/0000:85:00.0/0000:86:00.0").resolve()
    assert (device / "vendor").read_text() == "0x10de\n"
    assert (device / "device").read_text() == "0x1f08\n"
    assert (device / "class").read_text() == "0x030000\n"
    assert (device / "numa_node").read_text() == "1\n"
    assert "DRIVER=vfio-pci\n" in (device / "uevent").read_text()
    assert "PCI_ID=10DE:1F08\n" in (device / "uevent").read_text()
    assert "PCI_SLOT_NAME=0000:86:00.0\n" in (device / "uevent").read_text()
    assert os.readlink(device / "driver").endswith("bus/pci/drivers/vfio-pci")
    assert (device / "driver").resolve() == (root / "sys/bus/pci/drivers/vfio-pci").resolve()
    assert (device / "iommu_group").resolve() == (root / "sys/kernel/iommu_groups/74").resolve()
    members = sorted(os.listdir(root / "sys/kernel/iommu_groups/74/devices"))
    assert members == ["0000:86:00.0", "0000:86:00.1", "0000:86:00.2", "0000:86:00.3"]
    assert (root / "sys/kernel/iommu_groups/74/devices/0000:86:00.1").resolve() == (device.parent / "0000:86:00.1")
    assert (root / "dev/vfio/74").exists()
    assert (root / "dev/vfio/vfio").exists()
    assert not (root / "dev/vfio/120").exists()  # the T4's group: on nvidia, no vfio node
    assert (root / "usr/share/misc/pci.ids").read_text() == PCI_IDS_EXCERPT
    assert len(os.listdir(root / "sys/bus/pci/devices")) == len(NODE01.functions) == 25


def test_mdev_tree_has_the_kernel_layout(tmp_path: Path) -> None:
    root = build_node(VGPU_NODE, tmp_path)
    link = root / "sys/bus/mdev/devices" / T4_1Q_A
    assert os.readlink(link) == f"../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0/{T4_1Q_A}"
    mdev = link.resolve()
    assert (mdev / "mdev_type").resolve().name == "nvidia-230"
    assert (mdev / "mdev_type" / "name").read_text() == "GRID T4-1Q\n"
    assert (mdev / "iommu_group").resolve().name == "140"
    parent = mdev.parent
    assert (parent / "mdev_supported_types/nvidia-231/name").read_text() == "GRID T4-2Q\n"
    assert (parent / "mdev_supported_types/nvidia-230/devices" / T4_1Q_A).resolve() == mdev
    assert (root / "dev/vfio/140").exists()


def test_fixture_refuses_inconsistent_descriptions(tmp_path: Path) -> None:
    orphan = Function("0000:3b:00.0", NVIDIA, 0x1F08, 0x030000, "vfio-pci", 1, parent="0000:3a:00.0")
    with pytest.raises(ValueError, match="parent bridge"):
        build_node(_node("orphan", orphan), tmp_path)
    gpu = Function("0000:3b:00.0", NVIDIA, 0x1EB8, CLASS_3D, "nvidia", 1)
    with pytest.raises(ValueError, match="no mdev type"):
        build_node(_node("no-type", gpu, mdevs=(Mdev(T4_1Q_A, "0000:3b:00.0", "nvidia-230", 2),)), tmp_path)


# -- the three nodes ---------------------------------------------------------------------------------------


def test_node01_offers_four_rtx_2060_like_the_seed(tmp_path: Path) -> None:
    inventory = discover(build_node(NODE01, tmp_path))
    assert inventory.resource_names == (TU106,)
    resource = inventory.resource(TU106)
    assert resource.kind is ResourceKind.PCI
    assert resource.env == "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
    assert resource.socket == "kubevirt-TU106_GEFORCE_RTX_2060_REV__A.sock"
    assert resource.selectors == ("10DE:1F08",)
    assert tuple(device.id for device in resource.devices) == CARDS
    assert resource.healthy_count == 4
    card = resource.device("0000:86:00.0")
    assert card.iommu_group == 74
    assert card.vfio_group_path == "/dev/vfio/74"
    assert card.numa_node == 1
    assert card.health == "Healthy"
    assert card.reason is None
    assert card.pcie_root == "pci0000:85"
    assert card.pcie_path == ("0000:85:00.0",)
    assert card.driver == "vfio-pci"
    assert [str(companion.address) for companion in card.companions] == ["0000:86:00.1", "0000:86:00.2", "0000:86:00.3"]
    assert [companion.vendor_device for companion in card.companions] == ["10DE:10F9", "10DE:1ADA", "10DE:1ADB"]
    assert all(companion.viable and companion.driver == "vfio-pci" for companion in card.companions)
    assert [device.numa_node for device in resource.devices] == [0, 0, 1, 1]
    # Neither the audio/USB/UCSI functions nor the NIC are resources; the T4 on nvidia is not offered.
    assert [(item.id, item.driver) for item in inventory.ignored] == [("0000:d8:00.0", "nvidia")]
    assert "bound to nvidia" in inventory.ignored[0].reason
    assert inventory.warnings == ()
    assert inventory.pci_ids_path is not None
    assert inventory.pci_ids_path.endswith("node01/usr/share/misc/pci.ids")


def test_node01_json_has_exactly_the_documented_shape(tmp_path: Path) -> None:
    document = discover(build_node(NODE01, tmp_path)).to_json()
    assert list(document) == ["resources"]
    (resource,) = document["resources"]
    assert list(resource) == ["name", "kind", "env", "socket", "devices"]
    assert resource["kind"] == "pci"
    assert resource["devices"][2] == {
        "id": "0000:86:00.0",
        "iommu_group": 74,
        "numa_node": 1,
        "healthy": True,
        "reason": None,
        "companions": ["0000:86:00.1", "0000:86:00.2", "0000:86:00.3"],
    }


def test_vgpu_node_offers_one_resource_per_mdev_type(tmp_path: Path) -> None:
    inventory = discover(build_node(VGPU_NODE, tmp_path))
    assert inventory.resource_names == ("nvidia.com/GRID_T4-1Q", "nvidia.com/GRID_T4-2Q")
    one_q = inventory.resource("nvidia.com/GRID_T4-1Q")
    assert one_q.kind is ResourceKind.MDEV
    assert one_q.env == "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"
    assert one_q.socket == "kubevirt-GRID_T4-1Q.sock"
    assert one_q.selectors == ("GRID T4-1Q",)
    assert tuple(device.id for device in one_q.devices) == tuple(sorted((T4_1Q_A, T4_1Q_B)))
    mdev = one_q.device(T4_1Q_A)
    assert mdev.parent == PciAddress.parse("0000:3b:00.0")
    assert mdev.mdev_type == "nvidia-230"
    assert mdev.iommu_group == 140
    assert mdev.vfio_group_path == "/dev/vfio/140"
    assert mdev.numa_node == 0
    assert mdev.healthy
    assert mdev.companions == ()
    assert mdev.pcie_root == "pci0000:3a"
    assert mdev.vendor_device == "10DE:1EB8"
    two_q = inventory.resource("nvidia.com/GRID_T4-2Q").device(T4_2Q)
    assert (two_q.parent, two_q.numa_node, two_q.iommu_group) == (PciAddress.parse("0000:d8:00.0"), 1, 142)
    # The T4s themselves stay with the host driver that serves the vGPUs: not passthrough resources.
    assert {item.id for item in inventory.ignored} == {"0000:3b:00.0", "0000:d8:00.0"}


def test_mixed_node(tmp_path: Path) -> None:
    inventory = discover(build_node(MIXED_NODE, tmp_path))
    assert inventory.resource_names == (
        "nvidia.com/2fff",
        "nvidia.com/GA102GL_A10",
        "nvidia.com/GA102_GEFORCE_RTX_3090",
    )
    a10 = inventory.resource("nvidia.com/GA102GL_A10")
    assert [device.id for device in a10.devices] == ["0000:3b:00.0", "0000:d8:00.0"]
    assert all(device.healthy and device.companions == () for device in a10.devices)
    unknown = inventory.resource("nvidia.com/2fff").devices[0]
    assert unknown.numa_node is None  # sysfs says -1
    assert unknown.healthy
    assert any("10DE:2FFF is not in" in warning and "name_overrides" in warning for warning in inventory.warnings)
    rtx = inventory.resource("nvidia.com/GA102_GEFORCE_RTX_3090").device("0000:86:00.0")
    assert not rtx.healthy
    assert rtx.health == "Unhealthy"
    assert rtx.reason is not None
    assert "0000:86:00.1" in rtx.reason
    assert "snd_hda_intel" in rtx.reason
    assert "not viable" in rtx.reason
    (audio,) = rtx.companions
    assert (audio.driver, audio.viable, audio.pci_class) == ("snd_hda_intel", False, CLASS_AUDIO)


def test_inventory_is_an_immutable_value(tmp_path: Path) -> None:
    inventory = discover(build_node(NODE01, tmp_path))
    with pytest.raises(dataclasses.FrozenInstanceError):
        inventory.resources = ()  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        inventory.resources[0].devices[0].healthy = False  # type: ignore[misc]
    assert discover(tmp_path / "node01") == inventory


# -- one behaviour at a time -------------------------------------------------------------------------------


def test_gpu_on_host_driver_or_none_is_not_offered(tmp_path: Path) -> None:
    node = _node(
        "host-drivers",
        *tu106_card(0x3A, driver="nvidia"),
        *tu106_card(0x5D, driver="nouveau"),
        Function("0000:86:00.0", NVIDIA, 0x2236, CLASS_3D, None, 7),
    )
    inventory = discover(build_node(node, tmp_path))
    assert inventory.resources == ()
    reasons = {item.id: item.reason for item in inventory.ignored}
    assert reasons["0000:3b:00.0"].startswith("bound to nvidia")
    assert reasons["0000:5e:00.0"].startswith("bound to nouveau")
    assert reasons["0000:86:00.0"].startswith("bound to no driver")


def test_nvgrace_driver_counts_as_vfio(tmp_path: Path) -> None:
    gh200 = Function("0009:01:00.0", NVIDIA, 0x2342, CLASS_3D, "nvgrace_gpu_vfio_pci", 9, 0)
    inventory = discover(build_node(_node("grace", gh200), tmp_path))
    device = inventory.resource("nvidia.com/2342").device("0009:01:00.0")
    assert device.healthy
    assert device.pcie_root == "pci0009:01"
    assert device.pcie_path == ()


def test_configured_drivers_and_selectors(tmp_path: Path) -> None:
    root = build_node(MIXED_NODE, tmp_path)
    only_a10 = discover(root, pci_selectors=("10DE:2236",))
    assert only_a10.resource_names == ("nvidia.com/GA102GL_A10",)
    no_vfio = discover(root, vfio_drivers=("vfio-pci-custom",))
    assert no_vfio.resources == ()
    assert len(no_vfio.ignored) == 4


def test_exact_selector_may_name_a_non_display_function(tmp_path: Path) -> None:
    inventory = discover(build_node(NODE01, tmp_path), pci_selectors=("10DE:*", "10DE:1ADA"))
    usb = inventory.resource("nvidia.com/TU106_USB_3_1_HOST_CONTROLLER")
    assert [device.id for device in usb.devices] == ["0000:3b:00.2", "0000:5e:00.2", "0000:86:00.2", "0000:af:00.2"]
    # Two selected, vfio-bound functions in one group cannot go to different VMs.
    gpu = inventory.resource(TU106).device("0000:3b:00.0")
    assert not gpu.healthy
    assert gpu.reason is not None
    assert "shared with GPU 0000:3b:00.2" in gpu.reason


def test_two_gpus_in_one_group_are_both_unhealthy(tmp_path: Path) -> None:
    switch = Function("0000:3a:00.0", 0x10B5, 0x8747, CLASS_PCI_BRIDGE, "pcieport", 5)
    first = Function("0000:3b:00.0", NVIDIA, 0x2236, CLASS_3D, "vfio-pci", 5, parent="0000:3a:00.0")
    second = Function("0000:3b:01.0", NVIDIA, 0x2236, CLASS_3D, "vfio-pci", 5, parent="0000:3a:00.0")
    inventory = discover(build_node(_node("no-acs", switch, first, second), tmp_path))
    devices = inventory.resource("nvidia.com/GA102GL_A10").devices
    assert [device.healthy for device in devices] == [False, False]
    assert devices[0].reason is not None
    assert "IOMMU group 5 is shared with GPU 0000:3b:01.0" in devices[0].reason
    # The bridge on pcieport does not spoil the group; it is a companion.
    assert "not viable" not in devices[0].reason
    assert [str(companion.address) for companion in devices[0].companions] == ["0000:3a:00.0", "0000:3b:01.0"]


def test_unbound_and_stub_companions_keep_the_group_viable(tmp_path: Path) -> None:
    port, vga, audio, usb, ucsi = tu106_card(0x3A)
    card = (port, vga, dataclasses.replace(audio, driver=None), dataclasses.replace(usb, driver="pci-stub"), ucsi)
    inventory = discover(build_node(_node("stubs", *card), tmp_path))
    assert inventory.resource(TU106).device("0000:3b:00.0").healthy


def test_every_offending_companion_is_named(tmp_path: Path) -> None:
    card = tu106_card(0x85, audio_driver="snd_hda_intel")
    card = (*card[:4], dataclasses.replace(card[4], driver="ucsi_ccg"))
    (device,) = discover(build_node(_node("offenders", *card), tmp_path)).resource(TU106).devices
    assert device.reason == (
        "IOMMU group 74 is not viable: 0000:86:00.1 (10DE:10F9 audio) is bound to snd_hda_intel; "
        "0000:86:00.3 (10DE:1ADB serial bus) is bound to ucsi_ccg (bind them to vfio-pci or unbind)"
    )


def test_allowed_companion_drivers_are_configurable(tmp_path: Path) -> None:
    root = build_node(MIXED_NODE, tmp_path)
    inventory = discover(root, allowed_companion_drivers=("pcieport", "snd_hda_intel"))
    assert inventory.resource("nvidia.com/GA102_GEFORCE_RTX_3090").devices[0].healthy


def test_missing_vfio_group_node_makes_the_device_unhealthy(tmp_path: Path) -> None:
    root = build_node(NODE01, tmp_path)
    (root / "dev/vfio/50").unlink()
    device = discover(root).resource(TU106).device("0000:5e:00.0")
    assert (device.healthy, device.reason) == (False, "/dev/vfio/50 is missing")
    assert discover(root).resource(TU106).healthy_count == 3


def test_missing_vfio_container_makes_every_device_unhealthy(tmp_path: Path) -> None:
    nodes = (dataclasses.replace(NODE01, vfio_container=False), dataclasses.replace(VGPU_NODE, vfio_container=False))
    for node in nodes:
        inventory = discover(build_node(node, tmp_path))
        for resource in inventory.resources:
            for device in resource.devices:
                assert not device.healthy
                assert device.reason is not None
                assert "/dev/vfio/vfio is missing" in device.reason


def test_no_iommu_group(tmp_path: Path) -> None:
    gpu = Function("0000:3b:00.0", NVIDIA, 0x2236, CLASS_3D, "vfio-pci", None, 0)
    device = discover(build_node(_node("no-iommu", gpu), tmp_path)).resource("nvidia.com/GA102GL_A10").devices[0]
    assert device.iommu_group is None
    assert device.vfio_group_path is None
    assert not device.healthy
    assert device.reason is not None
    assert "no IOMMU group" in device.reason


def test_name_override_fixes_an_unknown_id_and_merges_resources(tmp_path: Path) -> None:
    root = build_node(MIXED_NODE, tmp_path)
    renamed = discover(root, name_overrides={"10DE:2FFF": "NEW_GPU"})
    assert "nvidia.com/NEW_GPU" in renamed.resource_names
    assert "nvidia.com/2fff" not in renamed.resource_names
    assert not any("2FFF" in warning for warning in renamed.warnings)
    merged = discover(root, name_overrides={"10DE:2FFF": "GA102GL_A10"})
    a10 = merged.resource("nvidia.com/GA102GL_A10")
    assert [device.id for device in a10.devices] == ["0000:3b:00.0", "0000:5e:00.0", "0000:d8:00.0"]
    assert a10.selectors == ("10DE:2236", "10DE:2FFF")
    whole = discover(root, name_overrides={"10DE:2236": "example.com/a10"})
    assert "example.com/a10" in whole.resource_names


def test_two_ids_with_one_pci_ids_name_share_a_resource(tmp_path: Path) -> None:
    ids = PCI_IDS_EXCERPT.replace("\t2236  GA102GL [A10]\n", "\t2236  GA102GL [A10]\n\t2237  GA102GL [A10]\n")
    first = Function("0000:3b:00.0", NVIDIA, 0x2236, CLASS_3D, "vfio-pci", 1)
    second = Function("0000:3c:00.0", NVIDIA, 0x2237, CLASS_3D, "vfio-pci", 2)
    inventory = discover(build_node(Node("same-name", (first, second), pci_ids=ids), tmp_path))
    (resource,) = inventory.resources
    assert resource.name == "nvidia.com/GA102GL_A10"
    assert [device.id for device in resource.devices] == ["0000:3b:00.0", "0000:3c:00.0"]
    assert resource.selectors == ("10DE:2236", "10DE:2237")
    entries = permitted_host_devices(inventory)["permittedHostDevices"]["pciHostDevices"]
    assert [entry["pciVendorSelector"] for entry in entries] == ["10DE:2236", "10DE:2237"]


def test_no_pci_ids_anywhere_falls_back_to_hex_with_a_warning(tmp_path: Path) -> None:
    node = dataclasses.replace(NODE01, pci_ids=None)
    inventory = discover(build_node(node, tmp_path))
    assert inventory.resource_names == ("nvidia.com/1f08",)
    assert inventory.pci_ids_path is None
    (warning,) = inventory.warnings
    assert "no pci.ids found" in warning
    assert "usr/share/hwdata/pci.ids" in warning


def test_explicit_pci_ids_is_used_and_must_exist(tmp_path: Path) -> None:
    root = build_node(NODE01, tmp_path)
    other = tmp_path / "other.ids"
    other.write_text("10de  NVIDIA Corporation\n\t1f08  Renamed [Card]\n", encoding="utf-8")
    assert discover(root, pci_ids=str(other)).resource_names == ("nvidia.com/RENAMED_CARD",)
    with pytest.raises(InputError, match=r"missing\.ids"):
        discover(root, pci_ids=str(tmp_path / "missing.ids"))


def test_a_name_that_is_no_valid_resource_name_is_reported_not_offered(tmp_path: Path) -> None:
    ids = PCI_IDS_EXCERPT.replace("\t2236  GA102GL [A10]", "\t2236  " + "A" * 70)
    gpu = Function("0000:3b:00.0", NVIDIA, 0x2236, CLASS_3D, "vfio-pci", 1)
    inventory = discover(build_node(Node("long", (gpu,), pci_ids=ids), tmp_path))
    assert inventory.resources == ()
    assert inventory.ignored[0].reason == "its resource name is invalid"
    assert any("name_overrides {10DE:2236: NAME}" in warning for warning in inventory.warnings)


def test_mdevs_of_unselected_parents_are_not_offered(tmp_path: Path) -> None:
    intel_gpu = Function("0000:00:02.0", 0x8086, 0x3E92, 0x030000, "i915", 1, 0)
    node = Node(
        "gvt",
        (intel_gpu,),
        mdev_types=(MdevType("0000:00:02.0", "i915-GVTg_V5_4", "GVTg_V5_4"),),
        mdevs=(Mdev(T4_1Q_A, "0000:00:02.0", "i915-GVTg_V5_4", 3),),
    )
    inventory = discover(build_node(node, tmp_path))
    assert inventory.resources == ()
    # The Intel GPU is no NVIDIA function at all (not even listed); its mdev is listed as not offered.
    assert [item.id for item in inventory.ignored] == [T4_1Q_A]
    assert "0000:00:02.0 (8086:3E92 VGA) is not a selected GPU" in inventory.ignored[0].reason


def test_mdev_without_vfio_group_node_is_unhealthy(tmp_path: Path) -> None:
    root = build_node(VGPU_NODE, tmp_path)
    (root / "dev/vfio/141").unlink()
    resource = discover(root).resource("nvidia.com/GRID_T4-1Q")
    assert resource.device(T4_1Q_B).reason == "/dev/vfio/141 is missing"
    assert resource.device(T4_1Q_A).healthy


def test_malformed_entries_are_skipped_with_a_warning(tmp_path: Path) -> None:
    root = build_node(VGPU_NODE, tmp_path)
    (root / "sys/bus/mdev/devices/not-a-uuid").symlink_to("../../../devices")
    (root / "sys/bus/pci/devices/0000:3b:00.0/uevent").unlink()  # else class is not read at all
    (root / "sys/bus/pci/devices/0000:3b:00.0/class").unlink()
    inventory = discover(root)
    assert any("not-a-uuid" in warning for warning in inventory.warnings)
    assert any("0000:3b:00.0" in warning and "class" in warning for warning in inventory.warnings)
    # The T4 whose class cannot be read is no longer a selected GPU parent: its mdevs are left out.
    assert inventory.resource_names == ("nvidia.com/GRID_T4-2Q",)


def test_host_root_without_sysfs_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no PCI devices under .*sys/bus/pci/devices.*host root"):
        discover(tmp_path / "empty")


def test_scan_takes_a_database_directly(tmp_path: Path) -> None:
    root = build_node(NODE01, tmp_path)
    from plugin.config import PluginConfig

    ids = PciIds.from_text("10de  NVIDIA Corporation\n\t1f08  Direct\n")
    inventory = scan(root, PluginConfig(), ids, warnings=("carried",))
    assert inventory.resource_names == ("nvidia.com/DIRECT",)
    assert inventory.warnings == ("carried",)
    assert scan(root, PluginConfig(), None).resource_names == ("nvidia.com/1f08",)


def test_resources_sorted_by_name_devices_by_id(tmp_path: Path) -> None:
    functions = (root_port(0xD7), *tu106_card(0xAE), *tu106_card(0x3A), *tu106_card(0x85))
    inventory: Inventory = discover(build_node(_node("order", *functions), tmp_path))
    ids = [device.id for device in inventory.resource(TU106).devices]
    assert ids == sorted(ids) == ["0000:3b:00.0", "0000:86:00.0", "0000:af:00.0"]


def test_mdev_type_names_are_trimmed_of_newlines_only_like_nvidia(tmp_path: Path) -> None:
    t4 = Function("0000:3b:00.0", NVIDIA, 0x1EB8, CLASS_3D, "nvidia", 1, 0)
    types = (MdevType(t4.address, "nvidia-230", "GRID  T4-1Q"), MdevType(t4.address, "nvidia-231", "GRID T4-2Q "))
    mdevs = (Mdev(T4_1Q_A, t4.address, "nvidia-230", 2), Mdev(T4_2Q, t4.address, "nvidia-231", 3))
    inventory = discover(build_node(Node("spaces", (t4,), types, mdevs, PCI_IDS_EXCERPT), tmp_path))
    assert inventory.resource_names == ("nvidia.com/GRID_T4-1Q",)
    assert inventory.resource("nvidia.com/GRID_T4-1Q").selectors == ("GRID  T4-1Q",)
    # "GRID T4-2Q " becomes GRID_T4-2Q_ (as in NVIDIA's plugin), which the kubelet would refuse: reported instead.
    assert [(item.id, item.reason) for item in inventory.ignored] == [
        # On nvidia because it hosts vGPUs, which is not a fault to fix with vfio-pci.
        ("0000:3b:00.0", "a vGPU parent of 2 mdev(s): its mdevs are offered as vGPUs, not the GPU itself"),
        (T4_2Q, "its resource name is invalid"),
    ]
    assert any("GRID_T4-2Q_" in warning and "nvidia-231" in warning for warning in inventory.warnings)


# -- uevent: one read names a function (docs/node.md, "PCI functions in sysfs") -----------------------------

KERNEL_UEVENT = (
    "DRIVER=vfio-pci\nPCI_CLASS=30000\nPCI_ID=10DE:1F08\nPCI_SUBSYS_ID=1458:3FC9\nPCI_SLOT_NAME=0000:3b:00.0\n"
    "MODALIAS=pci:v000010DEd00001F08sv00001458sd00003FC9bc03sc00i00\n"
)
FIXTURE_NODES = (NODE01, VGPU_NODE, MIXED_NODE)


def _function_dirs(root: Path) -> list[Path]:
    return sorted(link.resolve() for link in (root / "sys/bus/pci/devices").iterdir())


def test_uevent_gives_vendor_device_and_class() -> None:
    assert parse_pci_uevent(KERNEL_UEVENT) == (NVIDIA, 0x1F08, 0x030000)
    assert parse_pci_uevent("PCI_CLASS=C0330\nPCI_ID=8086:A36D\n") == (0x8086, 0xA36D, 0x0C0330)
    assert parse_pci_uevent("PCI_CLASS=FFFFFF\nPCI_ID=FFFF:FFFF") == (0xFFFF, 0xFFFF, 0xFFFFFF)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "DRIVER=vfio-pci\nPCI_ID=10DE:1F08\nPCI_SLOT_NAME=0000:3b:00.0\n",  # no class (simkit's SR-IOV VFs)
        "PCI_CLASS=30000\nPCI_SLOT_NAME=0000:3b:00.0\n",  # no IDs
        "PCI_CLASS=30000\nPCI_ID=10de:1f08\n",  # the kernel prints upper case
        "PCI_CLASS=30000\nPCI_ID=10DE:1F0\n",
        "PCI_CLASS=30000\nPCI_ID=010DE:1F08\n",
        "PCI_CLASS=30000\nPCI_ID=10DE:1F08 \n",
        "PCI_CLASS=30000\r\nPCI_ID=10DE:1F08\r\n",
        "PCI_CLASS=300\nPCI_ID=10DE:1F08\n",
        "PCI_CLASS=1030000\nPCI_ID=10DE:1F08\n",  # past 24 bits
        "PCI_CLASS=0x30000\nPCI_ID=10DE:1F08\n",
        "PCI_CLASS=+30000\nPCI_ID=10DE:1F08\n",
        "PCI_ID=10DE:1F08\nPCI_CLASS=30000\n",  # not the kernel's order
        "PCI_CLASS=30000\nDRIVER=vfio-pci\nPCI_ID=10DE:1F08\n",
        "PCI_CLASS=30000\nPCI_ID=10DE:1F08\nPCI_ID=8086:1572\n",  # which one?
        "PCI_CLASS=30000\nPCI_ID=10DE:1F08\nPCI_CLASS=20000\n",
        "PCI_CLASS=30000\nPCI_ID=10DE:1F08:0000\n",
        " PCI_CLASS=30000\nPCI_ID=10DE:1F08\n",
        "PCI_CLASS=\uff130000\nPCI_ID=10DE:1F08\n",  # a non-ASCII digit int() would take
        "\ufffd" * 100,
    ],
)
def test_a_uevent_without_the_kernels_two_lines_says_nothing(text: str) -> None:
    assert parse_pci_uevent(text) is None


@pytest.mark.parametrize("node", FIXTURE_NODES, ids=lambda node: node.name)
def test_a_function_named_by_its_uevent_needs_no_other_file(tmp_path: Path, node: Node) -> None:
    """Each function's ``vendor`` is read (the one read a function of another vendor costs); then ``uevent``
    names a function of a selected vendor, and ``device`` and ``class`` are never opened: gone, nothing
    changes."""
    root = build_node(node, tmp_path)
    intact = discover(root)
    for directory in _function_dirs(root):
        for name in ("device", "class"):
            (directory / name).unlink()
    assert discover(root) == intact


def test_a_uevent_naming_another_vendor_than_the_vendor_file_is_not_used(tmp_path: Path) -> None:
    root = build_node(NODE01, tmp_path)
    intact = discover(root)
    uevent = root / "sys/bus/pci/devices/0000:3b:00.0/uevent"
    uevent.write_text(uevent.read_text().replace("PCI_ID=10DE:1F08", "PCI_ID=8086:2204"))
    assert discover(root) == intact  # device and class from the files: still a TU106
    (root / "sys/bus/pci/devices/0000:3b:00.0/class").unlink()
    inventory = discover(root)
    assert "0000:3b:00.0" not in [device.id for device in inventory.resource(TU106).devices]
    assert any("0000:3b:00.0" in warning and "class" in warning for warning in inventory.warnings)


@pytest.mark.parametrize("node", FIXTURE_NODES, ids=lambda node: node.name)
@pytest.mark.parametrize(
    "uevent",
    [
        None,  # missing: hand-written trees
        "DRIVER=vfio-pci\nPCI_ID={vendor:04X}:{device:04X}\n",  # without PCI_CLASS
        "PCI_CLASS={pci_class:X}\nPCI_ID={vendor:04x}:{device:04x}\n",  # lower case
        "PCI_CLASS={pci_class:X}\nPCI_ID=8086:1572\nPCI_ID={vendor:04X}:{device:04X}\n",  # two IDs
        "PCI_CLASS=\nPCI_ID=\n",
    ],
    ids=["missing", "no-class", "lower-case", "two-ids", "empty-values"],
)
def test_without_a_usable_uevent_the_files_give_the_same_scan(tmp_path: Path, node: Node, uevent: str | None) -> None:
    """Missing or malformed ``uevent``: ``vendor``, ``device`` and ``class`` are read as before, with the same
    result (warnings included): nothing is said about a file the kernel always writes whole."""
    root = build_node(node, tmp_path)
    intact = discover(root)
    by_address = {function.address: function for function in node.functions}
    for directory in _function_dirs(root):
        if uevent is None:
            (directory / "uevent").unlink()
            continue
        function = by_address[directory.name]
        (directory / "uevent").write_text(
            uevent.format(vendor=function.vendor, device=function.device, pci_class=function.pci_class)
        )
    assert discover(root) == intact


def test_the_files_are_read_for_a_group_member_without_uevent(tmp_path: Path) -> None:
    """A GPU's group member of another vendor is read when the group is listed, through its directory: from
    its ``uevent``, or from its files when that says nothing."""
    port = root_port(0x85)
    bridge = dataclasses.replace(port, address="0000:85:00.1", iommu_group=74)  # no ACS: in the GPU's group
    root = build_node(_node("shared-group", port, bridge, *tu106_card(0x85)[1:]), tmp_path)
    bridge_dir = (root / "sys/bus/pci/devices/0000:85:00.1").resolve()
    (bridge_dir / "class").unlink()  # never read while uevent names it
    companions = discover(root).resource(TU106).device("0000:86:00.0").companions
    bridge_companion = companions[0]
    assert str(bridge_companion.address) == "0000:85:00.1"
    assert (bridge_companion.vendor_device, bridge_companion.pci_class) == ("8086:2030", CLASS_PCI_BRIDGE)
    (bridge_dir / "uevent").unlink()
    inventory = discover(root)
    companions = inventory.resource(TU106).device("0000:86:00.0").companions
    assert "0000:85:00.1" not in [str(item.address) for item in companions]
    assert any("0000:85:00.1" in warning and "class" in warning for warning in inventory.warnings)


def test_the_driver_comes_from_the_link_never_from_uevent(tmp_path: Path) -> None:
    """``uevent`` still says ``DRIVER=vfio-pci`` after a rebind that moved only the links (as a test or a
    fixture does): the ``driver`` link decides."""
    root = build_node(NODE01, tmp_path)
    rebind(root, "0000:3b:00.0", "nvidia")
    rebind(root, "0000:5e:00.1", "snd_hda_intel")
    rebind(root, "0000:86:00.0", None)
    for address in ("0000:3b:00.0", "0000:5e:00.1", "0000:86:00.0"):
        assert "DRIVER=vfio-pci\n" in (root / "sys/bus/pci/devices" / address / "uevent").read_text()
    inventory = discover(root)
    resource = inventory.resource(TU106)
    assert [device.id for device in resource.devices] == ["0000:5e:00.0", "0000:af:00.0"]
    assert not resource.device("0000:5e:00.0").healthy
    assert "snd_hda_intel" in (resource.device("0000:5e:00.0").reason or "")
    assert resource.device("0000:af:00.0").healthy
    ignored = {item.id: item.driver for item in inventory.ignored}
    assert ignored["0000:3b:00.0"] == "nvidia" and ignored["0000:86:00.0"] is None
