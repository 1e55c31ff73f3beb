"""The project's programs on a real kernel with an IOMMU (one guest boot; see tests/realnode/inguest.py).

Every value asserted here was read from the guest's own kernel (sysfs, /dev/vfio, VFIO ioctls, QMP) or from
the project's programs running on it: ``xmlgen discover``/``doctor``/``render``, ``gpu-device-plugin serve``
against the kubelet stand-in. Devices are found by ID; their addresses and groups come from the guest.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.libvirt_support import missing as libvirt_missing
from tests.realnode.inguest import walk_pci
from tests.realnode.scenarios import Scenario

pytestmark = pytest.mark.realnode

RESOURCE = "nvidia.com/QEMU_BOCHS_DISPLAY"
ENV = "PCI_RESOURCE_NVIDIA_COM_QEMU_BOCHS_DISPLAY"
COMPANIONS_ENV = "PCI_COMPANIONS_NVIDIA_COM_QEMU_BOCHS_DISPLAY"
MDEV_RESOURCE = "nvidia.com/Dual_port_serial"
MDEV_ENV = "MDEV_PCI_RESOURCE_NVIDIA_COM_DUAL_PORT_SERIAL"


def seen(node: Scenario, key: str, *steps: str) -> Any:
    """The observation ``key``; fails with the guest's output when it or one of ``steps`` went wrong."""
    errors = node.observations.get("errors", {})
    for step in ("scenario", *steps):
        assert step not in errors, f"step {step!r} failed in the guest:\n{errors[step]}\n{node.boot.describe()}"
    assert key in node.observations, f"the guest recorded no {key!r}\n{node.boot.describe()}"
    return node.observations[key]


def checks(run: dict[str, Any]) -> dict[str, dict[str, Any]]:
    assert "json" in run, f"{run['argv']}: not JSON (exit {run['rc']}): {run['stdout'][:500]} {run['stderr'][:500]}"
    return {check["check"]: check for check in run["json"]}


def test_guest_boots_the_resolved_kernel_with_an_iommu(node: Scenario) -> None:
    facts = seen(node, "facts")
    assert node.boot.rc == 0, node.boot.describe()
    assert facts["uname"].endswith("-amd64")
    assert "intel_iommu=on" in facts["cmdline"]
    assert facts["iommu_groups"], "no IOMMU groups: the guest's IOMMU is off"
    assert facts["mdev_bus"] == ["mbochs", "mdpy", "mtty"]


def test_the_scan_reads_every_function_from_the_kernels_uevent(node: Scenario) -> None:
    """The plugin's scan names a function by one read of its ``uevent`` (docs/node.md, "PCI functions in
    sysfs"); on this real kernel every function's ``uevent`` parses, to what its vendor/device/class files say."""
    identities = seen(node, "facts")["uevent_identities"]
    assert len(identities) >= 5, identities
    for address, identity in identities.items():
        assert identity["files"] is not None, address
        assert identity["uevent"] == identity["files"], f"{address}: {identity['text']!r}"


def test_gpu_and_audio_share_a_group_found_by_id(node: Scenario) -> None:
    facts = seen(node, "facts")
    (gpu,) = facts["functions"]["1234:1111"]
    (audio,) = facts["functions"]["8086:293e"]
    (edu,) = facts["functions"]["1234:11e8"]
    assert gpu["iommu_group"] == audio["iommu_group"] != edu["iommu_group"]
    assert gpu["group_members"] == sorted([gpu["address"], audio["address"]])
    assert gpu["driver"] is None
    assert audio["driver"] == "snd_hda_intel"
    assert gpu["real_path"].startswith("/sys/devices/pci0000:00/")


def test_discover_and_doctor_before_binding(node: Scenario) -> None:
    gpu = seen(node, "gpu")
    discovered = seen(node, "discover_before_bind", "discover before_bind")
    assert discovered["rc"] == 0
    assert discovered["json"]["resources"] == []
    doctor = checks(seen(node, "doctor_before_bind", "doctor before_bind"))
    assert doctor["IOMMU"]["status"] == "OK"
    assert doctor["vfio-pci driver"]["status"] == "OK"
    assert doctor["/dev/vfio/vfio"]["status"] == "OK"
    verdict = doctor[f"GPU {gpu}"]
    assert verdict["status"] == "WARN"
    assert "bound to no driver" in verdict["detail"]
    # A GPU on no driver needs no unbind: the fix is driver_override + drivers_probe.
    assert verdict["fix"] is not None
    assert "drivers_probe" in verdict["fix"]
    assert "driver/unbind" not in verdict["fix"]


def test_binding_only_the_gpu_creates_a_group_node_that_is_not_viable(node: Scenario) -> None:
    gpu, audio = seen(node, "gpu"), seen(node, "audio")
    bound = seen(node, "bind_gpu_only", "bind gpu only")
    group = bound["gpu"]["iommu_group"]
    assert bound["gpu"]["driver"] == "vfio-pci"
    assert bound["audio"]["driver"] == "snd_hda_intel"
    # The kernel creates /dev/vfio/<group> for the first function bound, viable or not...
    assert str(group) in bound["dev_vfio"]
    # ...and says at VFIO_GROUP_GET_STATUS that it is not viable.
    assert bound["status"]["viable"] is False
    (resource,) = seen(node, "discover_gpu_only", "discover gpu_only")["json"]["resources"]
    (device,) = resource["devices"]
    assert device["id"] == gpu
    assert device["iommu_group"] == group
    assert device["healthy"] is False
    assert f"{audio} (8086:293E audio) is bound to snd_hda_intel" in device["reason"]
    doctor = checks(seen(node, "doctor_gpu_only", "doctor gpu_only"))
    assert doctor[f"GPU {gpu}"]["status"] == "FAIL"
    assert f"echo {audio} > /sys/bus/pci/drivers_probe" in doctor[f"GPU {gpu}"]["fix"]
    assert seen(node, "plugin_gpu_only", "plugin sees the GPU") == {gpu: "Unhealthy"}


def test_binding_the_companion_makes_the_group_viable_and_the_gpu_healthy(node: Scenario) -> None:
    gpu = seen(node, "gpu")
    both = seen(node, "bind_both", "bind audio")
    assert both["audio"]["driver"] == "vfio-pci"
    assert both["status"]["viable"] is True
    # No /dev/vfio event here (the node already exists): the driver's bind uevent makes the plugin rescan.
    assert both["healthy_after"] is not None
    assert both["healthy_after"] <= 1.0
    (resource,) = seen(node, "discover_bound", "discover bound")["json"]["resources"]
    assert resource["name"] == RESOURCE
    assert resource["devices"][0]["healthy"] is True
    assert resource["devices"][0]["companions"] == [both["audio"]["address"]]
    doctor = checks(seen(node, "doctor_bound", "doctor bound"))
    assert doctor[f"GPU {gpu}"]["status"] == "OK"
    assert seen(node, "doctor_bound")["rc"] == 0


def test_listandwatch_lists_the_real_device_and_allocate_gives_its_real_group(node: Scenario) -> None:
    gpu = seen(node, "gpu")
    group = seen(node, "bind_both")["gpu"]["iommu_group"]
    assert seen(node, "listandwatch", "plugin")["devices"] == {gpu: "Healthy"}
    allocate = seen(node, "allocate", "allocate")
    # The audio function shares the GPU's slot and group and is on vfio-pci: it is the GPU's companion.
    assert allocate["envs"] == {ENV: gpu, COMPANIONS_ENV: f"{gpu}={seen(node, 'audio')}"}
    paths = sorted(spec["host_path"] for spec in allocate["devices"])
    assert paths == sorted([f"/dev/vfio/{group}", "/dev/vfio/vfio"])
    assert allocate["char_device"] == dict.fromkeys(paths, True)


def test_the_allocated_group_opens_as_qemu_opens_it(node: Scenario) -> None:
    vfio = seen(node, "vfio", "vfio ioctls")
    assert vfio["api_version"] == 0
    assert vfio["type1v2"] == 1
    assert vfio["viable"] is True
    assert vfio["set_iommu"] == 0
    assert vfio["device_fd"] > 0
    assert vfio["device_fd_link"] == "anon_inode:[vfio-device]"
    assert vfio["device_is_pci"] is True
    assert vfio["num_regions"] >= 7  # 6 BARs + ROM (+ config, VGA)
    # A device of another group cannot be had through this group.
    assert vfio["other_device"] == "ENODEV"


def test_the_gpu_and_its_audio_companion_reach_qemu_as_one_multifunction_slot(node: Scenario) -> None:
    gpu, audio = seen(node, "gpu"), seen(node, "audio")
    inner = seen(node, "inner_qemu", "inner qemu")
    if "native_error" in inner and "not reachable" in inner["native_error"]:
        libvirt_missing(inner["native_error"])
    assert "run" in inner, inner
    # libvirt's argv for the domain the hook wrote: the GPU at function 0 with multifunction=on, the audio
    # function at function 1 of the same slot, on one bus (the root port the hook added).
    native = {d["id"]: d for d in inner["native"]}
    assert sorted((d["driver"], d["host"], d["id"]) for d in native.values()) == [
        ("vfio-pci", gpu, "ua-gpu0"),
        ("vfio-pci", audio, "ua-gpu0-fn1"),
    ]
    assert native["ua-gpu0"]["multifunction"] is True or native["ua-gpu0"]["multifunction"] == "on"
    assert (native["ua-gpu0"]["addr"], native["ua-gpu0-fn1"]["addr"]) == ("0x0", "0x0.0x1")
    assert native["ua-gpu0"]["bus"] == native["ua-gpu0-fn1"]["bus"] != "pcie.0"
    run = inner["run"]
    assert run["exit"] == 0, run["log"]
    greeting, capabilities, pci, quit_reply = run["qmp"]
    assert "QMP" in greeting
    assert capabilities == {"return": {}}
    assert quit_reply == {"return": {}}
    devices = {d["qdev_id"]: d for bus in pci["return"] for d in walk_pci(bus["devices"])}
    ours, companion = devices["ua-gpu0"], devices["ua-gpu0-fn1"]
    assert (ours["id"]["vendor"], ours["id"]["device"]) == (0x1234, 0x1111)
    assert ours["class_info"]["class"] == 0x0380
    assert (companion["id"]["vendor"], companion["id"]["device"]) == (0x8086, 0x293E)
    assert companion["class_info"]["class"] == 0x0403
    # One guest slot: same bus, same slot, functions 0 and 1 -- behind the root port the hostdevs name.
    assert (ours["bus"], ours["slot"], ours["function"]) == (companion["bus"], 0, 0)
    assert (companion["slot"], companion["function"]) == (0, 1)
    assert ours["bus"] != 0
    (port,) = [d for d in devices.values() if d.get("pci_bridge", {}).get("bus", {}).get("secondary") == ours["bus"]]
    assert port["qdev_id"] == native["ua-gpu0"]["bus"]


def test_the_whole_group_leaving_vfio_pci_flips_health_within_a_second(node: Scenario) -> None:
    gpu = seen(node, "gpu")
    off = seen(node, "flip_group_off", "health: whole group leaves vfio-pci")
    assert off["group_node_gone_after"] is not None, "the kernel kept /dev/vfio/<group>"
    assert off["unhealthy_after"] is not None
    assert off["unhealthy_after"] <= 1.0
    assert off["devices"] == {gpu: "Unhealthy"}
    # Back on vfio-pci the resource is served and registered anew: under TCG that takes up to a few seconds.
    on = seen(node, "flip_group_on", "health: group back on vfio-pci")
    assert on["healthy_after"] is not None
    assert on["healthy_after"] <= 3.0
    assert on["devices"] == {gpu: "Healthy"}


def test_one_function_leaving_vfio_pci_flips_health_within_a_second(node: Scenario) -> None:
    gpu_off = seen(node, "flip_gpu_off", "health: only the GPU leaves vfio-pci")
    # The audio function keeps the group on vfio-pci: /dev/vfio/<group> stays, nothing there changes.
    assert gpu_off["group_node_still_there"] is True
    assert gpu_off["unhealthy_after"] is not None
    assert gpu_off["unhealthy_after"] <= 1.0
    # Served and registered anew, as above.
    gpu_on = seen(node, "flip_gpu_on")
    assert gpu_on["healthy_after"] is not None
    assert gpu_on["healthy_after"] <= 3.0


def test_a_real_mdev_is_created_and_removed(node: Scenario) -> None:
    mdev = seen(node, "mdev", "mdev")
    created = mdev["created"]
    assert created["type"] == "mtty-2"
    assert created["driver"] == "mtty"
    assert created["real_path"].startswith("/sys/devices/virtual/mtty/mtty/")
    assert created["parent_has_vendor"] is False
    assert created["group_members"] == [created["uuid"]]
    assert created["group_node_exists"] is True
    assert mdev["mtty"]["types"]["mtty-2"]["name"] == "Dual port serial"
    assert mdev["removed"] == {**mdev["removed"], "link_exists": False, "group_node_exists": False}


def test_a_real_mdev_is_advertised_as_an_mdev_resource_when_opted_in(node: Scenario) -> None:
    """mdev_parent_selectors: [mtty] (plugin.yaml): the mdev's add uevent makes the plugin register it."""
    mdev = seen(node, "mdev", "mdev")
    uuid = mdev["created"]["uuid"]
    assert mdev["advertised_after"] is not None, f"not advertised within 15 s: {mdev['plugin_resources_with_mdev']}"
    assert mdev["advertised_after"] <= 5.0
    assert mdev["plugin_resources_with_mdev"][MDEV_RESOURCE] == {uuid: "Healthy"}
    assert mdev["listandwatch"]["devices"] == {uuid: "Healthy"}
    # The GPU's resource is untouched by the mdev's.
    assert mdev["plugin_resources_with_mdev"][RESOURCE] == {seen(node, "gpu"): "Healthy"}
    (resource,) = [r for r in mdev["discover_with_mdev"]["json"]["resources"] if r["name"] == MDEV_RESOURCE]
    assert resource["kind"] == "mdev" and resource["env"] == MDEV_ENV
    assert [(d["id"], d["iommu_group"], d["healthy"]) for d in resource["devices"]] == [
        (uuid, int(mdev["created"]["iommu_group"]), True)
    ]


def test_allocate_gives_the_real_mdev_and_its_group_node(node: Scenario) -> None:
    mdev = seen(node, "mdev", "mdev")
    uuid, group = mdev["created"]["uuid"], mdev["created"]["iommu_group"]
    assert "allocate" in mdev, "Allocate of the mdev failed in the guest"
    allocate = mdev["allocate"]
    assert allocate["envs"] == {MDEV_ENV: uuid}
    paths = sorted(spec["host_path"] for spec in allocate["devices"])
    assert paths == sorted([f"/dev/vfio/{group}", "/dev/vfio/vfio"])
    assert allocate["char_device"] == dict.fromkeys(paths, True)
    # The allocated group opens as QEMU opens an mdev (by its UUID), on the guest's kernel.
    vfio = mdev["vfio"]
    assert "error" not in vfio, vfio
    assert vfio["viable"] is True and vfio["set_iommu"] == 0
    assert vfio["device_fd_link"] == "anon_inode:[vfio-device]"
    assert vfio["device_is_pci"] is True  # mtty's device_api is vfio-pci


def test_a_removed_mdev_is_withdrawn(node: Scenario) -> None:
    mdev = seen(node, "mdev", "mdev")
    removed = mdev["removed"]
    assert removed["withdrawn_after"] is not None, f"still served 15 s after remove: {removed}"
    assert removed["withdrawn_after"] <= 5.0
    # Its only device gone, the resource's server stopped: ListAndWatch ended, its socket removed.
    assert removed["stream_open"] is False and removed["socket_left"] is False
    assert mdev["plugin_resources_after_remove"][RESOURCE] is True
    names = [r["name"] for r in mdev["discover_after_remove"]["json"]["resources"]]
    assert names == [RESOURCE]


def test_without_the_opt_in_an_mdev_of_a_non_pci_parent_is_named_not_offered(node: Scenario) -> None:
    mdev = seen(node, "mdev", "mdev")
    uuid = mdev["created"]["uuid"]
    discovered = mdev["discover_not_opted_in"]
    assert discovered["rc"] == 0, discovered
    assert [resource["name"] for resource in discovered["json"]["resources"]] == [RESOURCE]
    assert "PCI function mtty: cannot read vendor" not in discovered["stderr"]
    table = mdev["discover_table_not_opted_in"]["stdout"]
    assert "not offered:" in table
    (line,) = [line for line in table.splitlines() if uuid in line]
    assert "is not a PCI function" in line and "mdev_parent_selectors" in line


def test_unbinding_back_returns_the_node_to_its_start(node: Scenario) -> None:
    unbound = seen(node, "unbound", "unbind back")
    assert unbound["gpu"]["driver"] is None
    assert unbound["audio"]["driver"] == "snd_hda_intel"
    assert unbound["dev_vfio"] == ["vfio"]
    assert seen(node, "discover_after_unbind")["json"]["resources"] == []
    assert seen(node, "plugin_exit") == 0
    assert seen(node, "plugin_sockets_left") == []


# -- gpu-node-agent on the real kernel ---------------------------------------------------------------------------


def test_the_agent_binds_the_gpu_and_its_companion_to_vfio_pci(node: Scenario) -> None:
    gpu, audio = seen(node, "gpu"), seen(node, "audio")
    agent = seen(node, "agent", "agent bind")
    assert agent["bind"]["rc"] == 0, agent["bind"]
    assert sorted(agent["bind"]["json"]["changed"]) == sorted([gpu, audio])
    after = agent["after_bind"]
    assert after["gpu"]["driver"] == "vfio-pci" and after["audio"]["driver"] == "vfio-pci"
    assert after["gpu"]["driver_override"] == after["audio"]["driver_override"] == "vfio-pci"
    assert after["status"]["viable"] is True
    assert str(after["gpu"]["iommu_group"]) in after["dev_vfio"]
    # The GPU had no driver (override + bind), the audio was on snd_hda_intel (override + unbind + bind).
    assert agent["bind"]["json"]["writes"] == 5
    assert agent["state"]["bind"]["changed"] == agent["bind"]["json"]["changed"]


def test_the_agent_rebinding_writes_nothing_and_validates_ready(node: Scenario) -> None:
    agent = seen(node, "agent", "agent bind again", "agent validate")
    again = agent["bind_again"]
    assert again["rc"] == 0 and again["json"]["writes"] == 0 and again["json"]["changed"] == []
    assert agent["validate"]["rc"] == 0 and agent["validate"]["json"]["ready"] is True
    assert agent["ready_file"] is True


def test_the_agent_refuses_to_unbind_a_group_held_open(node: Scenario) -> None:
    gpu = seen(node, "gpu")
    agent = seen(node, "agent", "agent unbind refused while held")
    held = agent["unbind_held"]
    group = agent["after_bind"]["gpu"]["iommu_group"]
    assert held["rc"] == 1
    assert f"IOMMU group {group} is in use by a VM" in held["error"]
    assert f"pid {agent['held_pid']} (" in held["error"] and f"holds /dev/vfio/{group}" in held["error"]
    assert f"{gpu} (1234:1111, on vfio-pci)" in held["error"]
    assert agent["after_unbind_held"]["gpu"]["driver"] == "vfio-pci"
    assert agent["after_unbind_held"]["audio"]["driver"] == "vfio-pci"


def test_the_agent_unbinds_back_and_the_kernel_reprobes(node: Scenario) -> None:
    agent = seen(node, "agent", "agent unbind")
    assert agent["unbind"]["rc"] == 0, agent["unbind"]
    after = agent["after_unbind"]
    assert after["gpu"]["driver"] is None and after["audio"]["driver"] == "snd_hda_intel"
    assert after["gpu"]["driver_override"] == after["audio"]["driver_override"] == "(null)"
    assert str(agent["after_bind"]["gpu"]["iommu_group"]) not in after["dev_vfio"]
    assert agent["unbind_again"]["rc"] == 0 and agent["unbind_again"]["json"]["writes"] == 0
    assert (
        agent["validate_unbound"]["rc"] == 1
        and "is on snd_hda_intel, not vfio-pci" in agent["validate_unbound"]["error"]
    )
    assert agent["ready_file_unbound"] is False


def test_the_agent_creates_and_removes_real_mdevs_from_a_vgpu_config(node: Scenario) -> None:
    agent = seen(node, "agent", "agent vgpu apply")
    assert agent["mtty_before"]["devices"] == []
    assert agent["apply_two"]["rc"] == 0, agent["apply_two"]
    two = agent["mtty_two"]["devices"]
    assert len(two) == 2 and agent["mtty_two"]["bus_links"] == two
    assert int(agent["mtty_two"]["available_instances"]) == int(agent["mtty_before"]["available_instances"]) - 2
    assert agent["apply_two_again"]["rc"] == 0 and agent["apply_two_again"]["json"]["writes"] == 0
    assert agent["apply_one"]["rc"] == 0 and agent["apply_one"]["json"]["writes"] == 1
    (kept,) = agent["mtty_one"]["devices"]
    assert kept in two
    assert agent["apply_one_again"]["json"]["writes"] == 0


def test_the_agent_never_removes_an_mdev_held_open(node: Scenario) -> None:
    agent = seen(node, "agent", "agent vgpu remove refused while held")
    (kept,) = agent["mtty_one"]["devices"]
    held = agent["apply_none_held"]
    assert held["rc"] == 1 and "VMs hold" in held["error"] and kept in held["error"]
    assert agent["mtty_held"]["devices"] == [kept]
    assert agent["apply_none"]["rc"] == 0 and agent["mtty_none"]["devices"] == []
