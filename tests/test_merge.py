"""The hook merges with the hostdevs virt-launcher already rendered, and leaves alone what is not its own.

virt-launcher renders a ``<hostdev>`` for each ``gpus[]`` / ``hostDevices[]`` entry from the same allocation
variables the hook reads (alias ``ua-gpu-<name>`` / ``ua-hostdevice-<name>``, sometimes a guest address behind
a NUMA ``pcie-expander-bus``, a boot order, a ROM setting, a driver). These tests build domains of that shape
and check that each such element survives the hook, that libvirt accepts the result, and that QEMU gets the
same device ids, bus/addr and bootindex as it would have without the hook.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
from lxml import etree

from bench.workloads import kubevirt_rendered_domain, rendered_domain, sixteen_gpus
from launcher_hook import BuildOptions, build_domain
from launcher_hook.allocation import allocation_from_env
from launcher_hook.domain import merge_hostdevs, parse_domain, read_hostdevs
from launcher_hook.matching import HostdevOptions, match_vmi
from schemas import InputError
from schemas.vmi import parse_vmi
from tests.libvirt_support import libvirt_verdict, missing
from xmlgen.libvirt_check import LibvirtUnavailable, qemu_sources, qemu_vfio_devices

SEED = (Path(__file__).resolve().parent.parent / "xmlgen" / "examples" / "seed-node01" / "domain.xml").read_text()
A100 = "nvidia.com/GA100_A100SXM464GB"
A100_VAR = "PCI_RESOURCE_NVIDIA_COM_GA100_A100SXM464GB"
T4 = "nvidia.com/GRID_T4-1Q"
T4_VAR = "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q"
USB = "kubevirt.io/storage"
USB_VAR = "USB_RESOURCE_KUBEVIRT_IO_STORAGE"
UUID_A = "4b20d080-1b54-4048-85b3-a6a62d165c01"
UUID_B = "7b7b1e7a-2a34-4a61-9c1e-0b8f1a1b2c3d"

# A NUMA-aware placement as virt-launcher writes it: a pcie-expander-bus on the GPU's NUMA node and a root
# port behind it, with the GPU's guest address on that port (the domain gets a matching NUMA cell).
NUMA_CONTROLLERS = (
    '\t\t<controller type="pci" index="1" model="pcie-expander-bus"><target busNr="254"><node>0</node></target>'
    "</controller>\n"
    '\t\t<controller type="pci" index="2" model="pcie-root-port"><address type="pci" domain="0x0000" bus="0x01"'
    ' slot="0x00" function="0x0"></address></controller>\n'
)


def kubevirt_pci(name: str, bus: int, extra: str = "", driver: str = '<driver name="vfio"></driver>') -> str:
    """A PCI GPU as virt-launcher renders it (its element order: source, boot, address, alias, driver, acpi).

    The driver stands in for virt-launcher's iommufd ``<driver iommufd="yes">``, which libvirt 9.0 does not
    know (it drops the attribute; its schema refuses it); ``name="vfio"`` is the form 9.0 accepts, and this
    host, without an IOMMU, needs it for QEMU's argv.
    """
    source = f'<address type="pci" domain="0x0000" bus="0x{bus:02x}" slot="0x00" function="0x0"></address>'
    return (
        f'\t\t<hostdev type="pci" managed="no"><source>{source}</source>{extra}'
        f'<alias name="ua-gpu-{name}"></alias>{driver}</hostdev>\n'
    )


def with_mode(domain: bytes) -> bytes:
    """``domain`` with mode='subsystem' on virt-launcher's PCI hostdevs, as the hook writes them."""
    return domain.replace(b'<hostdev type="pci" managed="no">', b'<hostdev type="pci" managed="no" mode="subsystem">')


def kubevirt_mdev(name: str, uuid: str, flags: str = "") -> str:
    return (
        f'\t\t<hostdev type="mdev" mode="subsystem" model="vfio-pci"{flags}><source><address uuid="{uuid}"></address>'
        f'</source><alias name="ua-gpu-{name}"></alias></hostdev>\n'
    )


def kubevirt_usb(name: str) -> str:
    return (
        '\t\t<hostdev type="usb" mode="subsystem"><source><address bus="001" device="002"></address></source>'
        f'<alias name="ua-usb-host-{name}"></alias></hostdev>\n'
    )


def domain_with(hostdevs: str, *, controllers: str = "", usb: bool = False, graphics: bool = True) -> bytes:
    text = SEED.replace("\t</devices>", controllers + hostdevs + "\t</devices>")
    text = text.replace(
        '<topology sockets="1" cores="1" threads="1"></topology>',
        '<topology sockets="1" cores="1" threads="1"></topology>'
        '<numa><cell id="0" cpus="0" memory="1048576" unit="KiB"></cell></numa>',
    )
    if usb:  # virt-launcher adds a USB controller when a USB host device is found
        text = text.replace('model="none"></controller>', 'model="qemu-xhci"></controller>', 1)
    if not graphics:
        start, end = text.index("\t\t<graphics"), text.index("</graphics>\n") + len("</graphics>\n")
        text = text[:start] + text[end:]
    return text.encode()


def vmi_json(gpus: list[dict[str, Any]], host_devices: list[dict[str, Any]] | None = None) -> bytes:
    devices: dict[str, Any] = {"gpus": gpus}
    if host_devices:
        devices["hostDevices"] = host_devices
    return json.dumps(
        {"metadata": {"name": "vm", "namespace": "ns"}, "spec": {"domain": {"devices": devices}}}
    ).encode()


def qemu_devices(domain_xml: bytes) -> list[dict[str, Any]]:
    """The vfio ``-device`` arguments libvirt's QEMU driver makes of ``domain_xml`` as it is (no validation
    of ours first: virt-launcher's own form, with ``type=`` on the source address, is what libvirt's parser
    accepts)."""
    text = domain_xml.decode()
    if not os.path.exists("/dev/kvm"):
        text = text.replace('type="kvm"', 'type="qemu"', 1)
    try:
        return qemu_vfio_devices(text)
    except LibvirtUnavailable as exc:
        missing(str(exc))
        raise


def placement(devices: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What the guest sees of each device: QEMU id, host device, bus, addr, bootindex."""
    return sorted(
        (d.get("id"), d.get("host") or d.get("sysfsdev"), d.get("bus"), d.get("addr"), d.get("bootindex"))
        for d in devices
    )


def element_by_alias(xml: bytes, alias: str) -> etree._Element:
    found = etree.fromstring(xml).xpath(f"devices/hostdev[alias/@name='{alias}']")
    assert isinstance(found, list) and len(found) == 1, f"{alias}: {found!r}"
    element = found[0]
    assert isinstance(element, etree._Element)
    return element


def canonical(element: etree._Element) -> tuple[Any, ...]:
    """An element's attributes and children, children in any order, ``type=`` of the source address aside."""
    clone = copy.deepcopy(element)
    address = clone.find("source/address")
    if address is not None:
        address.attrib.pop("type", "")
    children = []
    for child in clone:
        child.tail = None
        children.append(etree.tostring(child, method="c14n"))
    return sorted(clone.attrib.items()), sorted(children)


# --- merging with virt-launcher's GPUs ------------------------------------------------------------------------

RENDERED = (
    kubevirt_pci(
        "train0",
        0x86,
        '<boot order="1"></boot><address type="pci" domain="0x0000" bus="0x02" slot="0x00" function="0x0"></address>'
        '<rom bar="off"></rom>',
    )
    + kubevirt_pci("train1", 0xAF, '<acpi index="7"></acpi>')
    + kubevirt_mdev("desk", UUID_A, ' display="on" ramfb="on"')
)
RENDERED_VMI = vmi_json(
    [
        {"name": "train0", "deviceName": A100},
        {"name": "train1", "deviceName": A100},
        {"name": "desk", "deviceName": T4},
    ]
)
RENDERED_ENV = {A100_VAR: "0000:86:00.0,0000:af:00.0", T4_VAR: UUID_A}


def test_virt_launchers_gpus_survive_the_hook_and_qemu_gets_the_same_devices() -> None:
    before = domain_with(RENDERED, controllers=NUMA_CONTROLLERS)
    result = build_domain(before, RENDERED_VMI, RENDERED_ENV)
    after = result.domain_xml
    aliases = {"ua-gpu-train0": "0000:86:00.0", "ua-gpu-train1": "0000:af:00.0", "ua-gpu-desk": UUID_A}
    assert result.aliases == aliases
    assert after.count(b"<hostdev ") == 3  # merged, nothing added
    for alias in aliases:  # alias, guest address, boot order, rom, acpi, driver, display: all kept; mode= added
        assert canonical(element_by_alias(after, alias)) == canonical(element_by_alias(with_mode(before), alias))
    assert b'<address type="pci" domain="0x0000" bus="0x86"' not in after  # the schema refuses type= there
    assert b'<address type="pci" domain="0x0000" bus="0x02" slot="0x00" function="0x0"></address>' in after
    report = libvirt_verdict(after, aliases)
    assert qemu_sources(report) == aliases
    assert placement(report.qemu_devices) == placement(qemu_devices(before))
    train0 = next(device for device in report.qemu_devices if device["id"] == "ua-gpu-train0")
    assert (train0["bootindex"], train0["bus"], train0.get("rombar")) == (1, "pci.2", 0)


def test_only_what_the_hook_corrects_changes_and_the_rest_keeps_its_bytes() -> None:
    before = domain_with(RENDERED, controllers=NUMA_CONTROLLERS)
    after = build_domain(before, RENDERED_VMI, RENDERED_ENV).domain_xml
    # the corrections: type= dropped from the PCI source addresses, and their <driver> moved next to <source>
    # (libvirt's schema wants them together; virt-launcher writes the driver last)
    # and mode= added (virt-launcher 1.9 writes none on PCI hostdevs; libvirt's Go XML library wants it)
    expected = with_mode(before).replace(
        b'<source><address type="pci" ', b'<driver name="vfio"></driver><source><address '
    )
    assert after == expected.replace(b'<driver name="vfio"></driver></hostdev>', b"</hostdev>")
    # an element with nothing to correct keeps its bytes even when they are not how lxml would write them
    untouched = (
        "\t\t<hostdev mode='subsystem' type='mdev' model='vfio-pci'><source><address uuid='" + UUID_A + "'/></source>"
        "<alias name='ua-gpu-desk'/></hostdev>\n"
    )
    domain = domain_with(untouched)
    no_display = [{"name": "desk", "deviceName": T4, "virtualGPUOptions": {"display": {"enabled": False}}}]
    assert build_domain(domain, vmi_json(no_display), {T4_VAR: UUID_A}).domain_xml == domain


def test_an_iommufd_driver_is_kept_as_virt_launcher_wrote_it() -> None:
    # libvirt 9.0 does not know iommufd= (newer libvirt, which virt-launcher writes it for, does): kept as is
    hostdev = kubevirt_pci("g", 0x86, driver='<driver iommufd="yes"></driver><acpi nodeset="0"></acpi>')
    out = build_domain(domain_with(hostdev), vmi_json([{"name": "g", "deviceName": A100}]), {A100_VAR: "0000:86:00.0"})
    assert b'<driver iommufd="yes"></driver><source><address domain=' in out.domain_xml
    assert b'<alias name="ua-gpu-g"></alias><acpi nodeset="0"></acpi></hostdev>' in out.domain_xml


MERGE_CASES: dict[str, tuple[bytes, list[dict[str, Any]], dict[str, str]]] = {
    "16 GPUs as virt-launcher writes them (the benchmark's)": (
        kubevirt_rendered_domain(),
        json.loads(sixteen_gpus()[0])["spec"]["domain"]["devices"]["gpus"],
        sixteen_gpus()[1],
    ),
    "virt-launcher's PCI GPUs and vGPU, one GPU added": (
        domain_with(RENDERED, controllers=NUMA_CONTROLLERS),
        [
            {"name": "train0", "deviceName": A100},
            {"name": "train1", "deviceName": A100},
            {"name": "desk", "deviceName": T4},
            {"name": "extra", "deviceName": A100},
        ],
        {A100_VAR: "0000:86:00.0,0000:af:00.0,0000:3b:00.0", T4_VAR: UUID_A},
    ),
    "two ramfb vGPUs": (
        domain_with(
            kubevirt_mdev("v0", UUID_A, ' display="on" ramfb="on"')
            + kubevirt_mdev("v1", UUID_B, ' ramfb="on" model="vfio-pci" display="on"').replace(
                ' model="vfio-pci" ramfb', " ramfb", 1
            )
        ),
        [
            {"name": "v0", "deviceName": T4, "virtualGPUOptions": {"display": {}}},
            {"name": "v1", "deviceName": T4, "virtualGPUOptions": {"display": {"enabled": True}}},
        ],
        {T4_VAR: f"{UUID_A},{UUID_B}"},
    ),
    "display on a PCI GPU, driver last, decimal bus, no alias": (
        domain_with(
            kubevirt_pci("g", 0x86).replace('mode="subsystem">', 'mode="subsystem" display="on">')
            + kubevirt_pci("h", 0xAF).replace('bus="0xaf"', 'bus="175"').replace('<alias name="ua-gpu-h"></alias>', "")
        ),
        [{"name": "g", "deviceName": A100}, {"name": "h", "deviceName": A100}],
        {A100_VAR: "0000:86:00.0,0000:af:00.0"},
    ),
}


@pytest.mark.parametrize("case", list(MERGE_CASES), ids=list(MERGE_CASES))
def test_byte_patching_and_reserialising_merge_to_the_same_bytes(case: str) -> None:
    domain, gpus, env = MERGE_CASES[case]
    vmi = parse_vmi(vmi_json(gpus))
    outputs = []
    for fast in (True, False):  # patching the original bytes, or serialising the whole edited tree
        parsed = parse_domain(domain, 1 << 20)
        existing = read_hostdevs(parsed)
        specs, _ = match_vmi(vmi, allocation_from_env(env), HostdevOptions(driver="vfio"), existing.view)
        spliced = merge_hostdevs(parsed, specs, existing, allow_fast=fast)
        outputs.append(spliced.domain_xml)
    assert outputs[0] == outputs[1]
    assert (
        b'<source><address type="pci"' not in outputs[0]
        and b'<address type="pci" domain="0x0000" bus="0x10"' not in (outputs[0])
    )
    aliases = {spec.alias: spec.source_text for spec in spliced.hostdevs}
    assert len(aliases) == len(gpus)
    report = libvirt_verdict(outputs[0], aliases)
    assert qemu_sources(report) == aliases


def test_merging_twice_gives_the_same_document() -> None:
    once = build_domain(domain_with(RENDERED, controllers=NUMA_CONTROLLERS), RENDERED_VMI, RENDERED_ENV).domain_xml
    assert build_domain(once, RENDERED_VMI, RENDERED_ENV).domain_xml == once


def test_hook_and_virt_launcher_agree_on_which_entry_has_which_device_whatever_the_order() -> None:
    # virt-launcher read the variable as B,A (Allocate order); the hook gets A,B (PodResources, sorted). The
    # entry keeps virt-launcher's device, so each entry's display settings land on its own element.
    gpus = [
        {"name": "plain", "deviceName": T4, "virtualGPUOptions": {"display": {"enabled": False}}},
        {"name": "desk", "deviceName": T4, "virtualGPUOptions": {"display": {"enabled": True}}},
    ]
    domain = domain_with(kubevirt_mdev("plain", UUID_B) + kubevirt_mdev("desk", UUID_A, ' display="on" ramfb="on"'))
    result = build_domain(domain, vmi_json(gpus), {T4_VAR: f"{UUID_A},{UUID_B}"})
    assert result.aliases == {"ua-gpu-plain": UUID_B, "ua-gpu-desk": UUID_A}
    assert result.domain_xml == domain
    libvirt_verdict(result.domain_xml, result.aliases)


def test_force_gpu_aliases_renames_virt_launchers_gpus_with_a_warning() -> None:
    before = domain_with(RENDERED, controllers=NUMA_CONTROLLERS)
    result = build_domain(before, RENDERED_VMI, RENDERED_ENV, BuildOptions(force_gpu_aliases=True))
    aliases = {"ua-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0", "ua-gpu2": UUID_A}
    assert result.aliases == aliases
    assert len([w for w in result.warnings if "--force-gpu-aliases" in w and "will not find it" in w]) == 3
    report = libvirt_verdict(result.domain_xml, aliases)
    # the same devices in the same places, under the new ids
    new_ids = {"ua-gpu-train0": "ua-gpu0", "ua-gpu-train1": "ua-gpu1", "ua-gpu-desk": "ua-gpu2"}
    renamed = [(new_ids[row[0]], *row[1:]) for row in placement(qemu_devices(before))]
    assert sorted(renamed) == placement(report.qemu_devices)


def test_an_alias_libvirt_would_drop_is_replaced_by_the_hooks() -> None:
    hostdev = kubevirt_pci("my.gpu", 0x86)  # '.' is outside libvirt's alias characters: it would drop it
    vmi = vmi_json([{"name": "my.gpu", "deviceName": A100}])
    result = build_domain(domain_with(hostdev), vmi, {A100_VAR: "0000:86:00.0"})
    assert result.aliases == {"ua-gpu0": "0000:86:00.0"}
    assert any("'ua-gpu-my.gpu' is not one libvirt keeps" in warning for warning in result.warnings)
    libvirt_verdict(result.domain_xml, result.aliases)


def test_display_on_a_pci_hostdev_is_removed_with_a_warning() -> None:
    hostdev = kubevirt_pci("g", 0x86).replace('managed="no">', 'managed="no" display="on" ramfb="on">')
    gpus = [{"name": "g", "deviceName": A100, "virtualGPUOptions": {"display": {"enabled": True}}}]
    result = build_domain(domain_with(hostdev), vmi_json(gpus), {A100_VAR: "0000:86:00.0"})
    assert b'display="on"' not in result.domain_xml
    assert any("display/ramfb removed from the PCI hostdev 'ua-gpu-g'" in warning for warning in result.warnings)
    libvirt_verdict(result.domain_xml, result.aliases)


def test_the_hook_adds_what_virt_launcher_did_not_render_next_to_what_it_did() -> None:
    gpus = [{"name": "train0", "deviceName": A100}, {"name": "train1", "deviceName": A100}]
    domain = domain_with(kubevirt_pci("train0", 0x86))
    result = build_domain(domain, vmi_json(gpus), {A100_VAR: "0000:86:00.0,0000:af:00.0"})
    assert result.aliases == {"ua-gpu-train0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0"}
    libvirt_verdict(result.domain_xml, result.aliases)


# --- what is not the hook's ---------------------------------------------------------------------------------


def test_a_usb_host_device_next_to_gpus_is_left_byte_for_byte() -> None:
    # KubeVirt's examples/vmi-usb.yaml plus two GPUs virt-launcher has not rendered
    vmi = vmi_json(
        [{"name": "train0", "deviceName": A100}, {"name": "train1", "deviceName": A100}],
        [{"name": "node-usb-to-vmi-storage", "deviceName": USB}],
    )
    usb = kubevirt_usb("node-usb-to-vmi-storage")
    domain = domain_with(usb, usb=True)
    env = {USB_VAR: "001:002", A100_VAR: "0000:86:00.0,0000:af:00.0"}
    result = build_domain(domain, vmi, env)
    out = result.domain_xml
    assert out.startswith(domain[: domain.index(b"\t</devices>")])  # everything up to the new GPUs, USB included
    assert usb.encode() in out
    assert result.aliases == {"ua-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0"}
    assert result.warnings == [
        f"hostDevices[0] 'node-usb-to-vmi-storage' (deviceName {USB}): not in the hook's allocation "
        "(PCI_RESOURCE_KUBEVIRT_IO_STORAGE, MDEV_PCI_RESOURCE_KUBEVIRT_IO_STORAGE); virt-launcher's <hostdev> "
        "'ua-usb-host-node-usb-to-vmi-storage' is left as it is"
    ]
    libvirt_verdict(out, result.aliases)
    # without a domain (xmlgen render): the USB variable alone says it is virt-launcher's
    alone = build_domain(None, vmi, env)
    assert alone.aliases == result.aliases
    assert alone.warnings == [
        f"hostDevices[0] 'node-usb-to-vmi-storage' (deviceName {USB}): a USB device ({USB_VAR}); left to virt-launcher"
    ]


def test_an_entry_virt_launcher_rendered_from_a_variable_the_hook_cannot_see_is_left_alone() -> None:
    # e.g. a permittedHostDevices entry served by KubeVirt's own plugin (externalResourceProvider: false): its
    # device IDs are IOMMU groups, so the hook's PodResources view has no variable for it
    nic = (
        '\t\t<hostdev type="pci" managed="no" mode="subsystem"><source><address type="pci" domain="0x0000" '
        'bus="0x3b" slot="0x00" function="0x0"></address></source><alias name="ua-hostdevice-nic"></alias></hostdev>\n'
    )
    vmi = vmi_json([{"name": "train0", "deviceName": A100}], [{"name": "nic", "deviceName": "example.com/nic"}])
    domain = domain_with(nic)
    result = build_domain(domain, vmi, {A100_VAR: "0000:86:00.0"})
    assert nic.encode() in result.domain_xml  # not even type= is corrected: not the hook's element
    assert result.aliases == {"ua-gpu0": "0000:86:00.0"}
    assert (
        len(result.warnings) == 1
        and "virt-launcher's <hostdev> 'ua-hostdevice-nic' is left as it is" in (result.warnings[0])
    )


def test_an_entry_with_no_variable_and_nothing_rendered_is_refused_as_virt_launcher_would() -> None:
    vmi = vmi_json([{"name": "train0", "deviceName": A100}], [{"name": "nic", "deviceName": "example.com/nic"}])
    with pytest.raises(
        InputError,
        match=r"hostDevices\[0\] 'nic' .*no allocation variable found; looked for "
        r"PCI_RESOURCE_EXAMPLE_COM_NIC and MDEV_PCI_RESOURCE_EXAMPLE_COM_NIC",
    ):
        build_domain(domain_with(""), vmi, {A100_VAR: "0000:86:00.0"})


def test_a_rendered_entry_whose_device_the_allocation_lacks_is_left_as_rendered() -> None:
    domain = domain_with(kubevirt_pci("train0", 0x86))
    result = build_domain(domain, vmi_json([{"name": "train0", "deviceName": A100}]), {A100_VAR: "0000:af:00.0"})
    assert result.domain_xml == domain
    assert result.aliases == {}
    assert "passes 0000:86:00.0, which PCI_RESOURCE_NVIDIA_COM_GA100_A100SXM464GB does not offer" in result.warnings[0]


# --- vGPU display and ramfb, as libvirt's QEMU driver enforces them -------------------------------------------


def displays(xml: bytes) -> dict[str | None, tuple[str | None, str | None]]:
    return {
        hostdev.findtext("alias[@name]") or hostdev.find("alias").get("name"): (  # type: ignore[union-attr]
            hostdev.get("display"),
            hostdev.get("ramfb"),
        )
        for hostdev in etree.fromstring(xml).iterfind("devices/hostdev")
    }


def vgpus(*options: dict[str, Any] | None) -> bytes:
    return vmi_json(
        [
            {"name": f"v{index}", "deviceName": T4} | ({"virtualGPUOptions": {"display": o}} if o is not None else {})
            for index, o in enumerate(options)
        ]
    )


TWO_UUIDS = {T4_VAR: f"{UUID_A},{UUID_B}"}


def test_two_vgpus_asking_for_a_display_get_ramfb_on_the_first_only() -> None:
    result = build_domain(domain_with(""), vgpus({}, {}), TWO_UUIDS)
    assert displays(result.domain_xml) == {"ua-gpu0": ("on", "on"), "ua-gpu1": ("on", None)}
    assert any("gpus[1] 'v1'" in warning and "no ramfb='on'" in warning for warning in result.warnings)
    libvirt_verdict(result.domain_xml, result.aliases)


def test_an_explicit_ramfb_wins_over_the_default_and_two_explicit_ones_are_an_error() -> None:
    explicit = {"ramFB": {"enabled": True}}
    out = build_domain(domain_with(""), vgpus({}, explicit), TWO_UUIDS).domain_xml
    assert displays(out) == {"ua-gpu0": ("on", None), "ua-gpu1": ("on", "on")}
    out = build_domain(domain_with(""), vgpus({"ramFB": {"enabled": False}}, {}), TWO_UUIDS).domain_xml
    assert displays(out) == {"ua-gpu0": ("on", None), "ua-gpu1": ("on", "on")}
    with pytest.raises(InputError) as error:
        build_domain(domain_with(""), vgpus(explicit, explicit), TWO_UUIDS)
    assert f"gpus[0] 'v0' (deviceName {T4}) and gpus[1] 'v1' (deviceName {T4}) both ask for ramfb" in str(error.value)


def test_virt_launchers_two_ramfb_vgpus_are_corrected_to_one() -> None:
    # What KubeVirt renders for two GPUs with display options: ramfb on both, which libvirt refuses
    before = domain_with(
        kubevirt_mdev("v0", UUID_A, ' display="on" ramfb="on"')
        + kubevirt_mdev("v1", UUID_B, ' display="on" ramfb="on"')
    )
    with pytest.raises(AssertionError, match="Only one vgpu device can have 'ramfb' enabled"):
        qemu_devices(before)
    result = build_domain(before, vgpus({}, {}), TWO_UUIDS)
    assert displays(result.domain_xml) == {"ua-gpu-v0": ("on", "on"), "ua-gpu-v1": ("on", None)}
    report = libvirt_verdict(result.domain_xml, result.aliases)
    assert [device.get("ramfb") for device in sorted(report.qemu_devices, key=lambda d: str(d["id"]))] == [True, None]


def test_ramfb_held_by_a_hostdev_that_is_not_the_hooks_counts() -> None:
    other = kubevirt_mdev("other", UUID_B, ' display="on" ramfb="on"').replace("ua-gpu-other", "ua-foreign")
    domain = domain_with(other)
    result = build_domain(domain, vgpus({}), {T4_VAR: UUID_A})
    assert displays(result.domain_xml)["ua-gpu0"] == ("on", None)
    assert "<hostdev> 'ua-foreign' at line" in result.warnings[0]
    libvirt_verdict(result.domain_xml, result.aliases)
    with pytest.raises(InputError, match=r"gpus\[0\] 'v0' .* asks for ramfb, but <hostdev> 'ua-foreign' at line \d+ "):
        build_domain(domain, vgpus({"ramFB": {"enabled": True}}), {T4_VAR: UUID_A})


def test_a_default_display_virt_launcher_wrote_without_graphics_is_turned_off() -> None:
    # KubeVirt turns the first vGPU's display on even with autoattachGraphicsDevice: false; libvirt refuses it
    before = domain_with(kubevirt_mdev("v0", UUID_A, ' display="on" ramfb="on"'), graphics=False)
    result = build_domain(before, vgpus(None), {T4_VAR: UUID_A})
    assert displays(result.domain_xml) == {"ua-gpu-v0": (None, None)}
    libvirt_verdict(result.domain_xml, result.aliases)


# --- a domain with two <devices> --------------------------------------------------------------------------------


def test_two_devices_elements_are_read_as_libvirt_reads_them() -> None:
    # libvirt's parser takes the devices of every <devices> element (and writes one back); its schema refuses
    # two. The hook merges with virt-launcher's GPU wherever it is and adds the others to the last <devices>.
    second = "\t<devices>\n" + kubevirt_pci("train1", 0xAF) + "\t</devices>\n"
    domain = domain_with(kubevirt_pci("train0", 0x86)).replace(b"\t<metadata>", second.encode() + b"\t<metadata>")
    gpus = [{"name": f"train{index}", "deviceName": A100} for index in range(3)]
    result = build_domain(domain, vmi_json(gpus), {A100_VAR: "0000:86:00.0,0000:af:00.0,0000:3b:00.0"})
    out = result.domain_xml
    assert result.aliases == {
        "ua-gpu-train0": "0000:86:00.0",
        "ua-gpu-train1": "0000:af:00.0",
        "ua-gpu2": "0000:3b:00.0",
    }
    first, last = etree.fromstring(out).findall("devices")
    assert [h.find("alias").get("name") for h in last.iterfind("hostdev")] == ["ua-gpu-train1", "ua-gpu2"]  # type: ignore[union-attr]
    assert len(first.findall("hostdev")) == 1
    report = libvirt_verdict(out, result.aliases)
    assert qemu_sources(report) == result.aliases


def test_an_empty_first_devices_element_does_not_take_the_hostdevs() -> None:
    domain = domain_with("").replace(b"\t<devices>\n", b"\t<devices/>\n\t<devices>\n", 1)
    result = build_domain(domain, vmi_json([{"name": "g", "deviceName": A100}]), {A100_VAR: "0000:86:00.0"})
    assert b"\t<devices/>\n\t<devices>\n" in result.domain_xml
    devices = etree.fromstring(result.domain_xml).findall("devices")
    assert [len(element.findall("hostdev")) for element in devices] == [0, 1]
    libvirt_verdict(result.domain_xml, result.aliases)


# --- the programs ---------------------------------------------------------------------------------------------


def test_xmlgen_render_merges_warns_on_stderr_and_forces_aliases_when_asked(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from xmlgen.cli import cli

    domain, vmi, environ = tmp_path / "domain.xml", tmp_path / "vmi.json", tmp_path / "environ"
    domain.write_bytes(domain_with(kubevirt_usb("stick") + kubevirt_pci("train0", 0x86), usb=True))
    vmi.write_bytes(vmi_json([{"name": "train0", "deviceName": A100}], [{"name": "stick", "deviceName": USB}]))
    environ.write_text(f"{A100_VAR}=0000:86:00.0\n{USB_VAR}=001:002\n")
    args = ["render", "--domain", str(domain), "--vmi", str(vmi), "--environ-file", str(environ)]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    assert result.exit_code == 0
    assert 'alias name="ua-gpu-train0"' in result.stdout and kubevirt_usb("stick") in result.stdout
    assert result.stderr.startswith("warning: hostDevices[0] 'stick'") and "ua-usb-host-stick" in result.stderr
    result = CliRunner().invoke(cli, [*args, "--force-gpu-aliases"], catch_exceptions=False)
    assert result.exit_code == 0
    assert 'alias name="ua-gpu0"' in result.stdout and "ua-gpu-train0" not in result.stdout
    assert "--force-gpu-aliases" in result.stderr and "will not find it" in result.stderr


def test_launcher_hook_serve_forces_aliases_by_flag_or_env() -> None:
    from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc
    from tests.hook_support import short_dir, unix_channel
    from tests.test_hook_cli import finish, start_serve

    domain = domain_with(kubevirt_pci("train0", 0x86))
    params = v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi_json([{"name": "train0", "deviceName": A100}]))
    for args, env in (((), {}), (("--force-gpu-aliases",), {}), ((), {"LAUNCHER_HOOK_FORCE_GPU_ALIASES": "1"})):
        with short_dir() as directory:
            socket_path = directory / "hook.sock"
            process = start_serve(socket_path, *args, **{A100_VAR: "0000:86:00.0", **env})
            with unix_channel(socket_path) as channel:
                stub = v1alpha3_pb2_grpc.CallbacksStub(channel)
                out = stub.OnDefineDomain(params, timeout=60).domainXML
                stub.Shutdown(v1alpha3_pb2.ShutdownParams(), timeout=10)
            code, lines = finish(process)
        assert code == 0
        forced = bool(args or env)
        assert (b'<alias name="ua-gpu0">' in out) is forced and (b'<alias name="ua-gpu-train0">' in out) is not forced
        (call,) = [line for line in lines if line["event"] == "OnDefineDomain"]
        assert call["gpus"] == {"ua-gpu0" if forced else "ua-gpu-train0": "0000:86:00.0"}
        assert bool(call["warnings"]) is forced


def test_the_shim_forces_aliases_by_flag_or_env() -> None:
    from tests.test_hook_cli import shim

    domain = domain_with(kubevirt_pci("train0", 0x86)).decode()
    vmi = vmi_json([{"name": "train0", "deviceName": A100}]).decode()
    for args, env in (((), {}), (("--force-gpu-aliases",), {}), ((), {"LAUNCHER_HOOK_FORCE_GPU_ALIASES": "1"})):
        done = shim("--vmi", vmi, "--domain", domain, *args, **{A100_VAR: "0000:86:00.0", **env})
        assert done.returncode == 0, done.stderr.decode()
        forced = bool(args or env)
        assert (b'<alias name="ua-gpu0">' in done.stdout) is forced
        assert (b'<alias name="ua-gpu-train0">' in done.stdout) is not forced
        (call,) = [json.loads(line) for line in done.stderr.decode().splitlines()]
        assert bool(call["warnings"]) is forced


@pytest.mark.parametrize(
    "source",
    [
        b"<domain><devices><hostdev/><hostdevs/><hostdev\n type='pci'></hostdev><hostdev>",
        b"<domain><x:hostdev xmlns:x='urn:x'/><hostdev\t/><metadata><hostdev/></metadata>",
        b"<hostdev",
        b"",
    ],
)
def test_hostdev_start_tags_are_found_with_or_without_a_prefix(source: bytes) -> None:
    from launcher_hook.domain import _HOSTDEV_START, _hostdev_starts

    assert _hostdev_starts(source) == [match.start() for match in _HOSTDEV_START.finditer(source)]


def test_without_a_vmi_virt_launchers_hostdevs_are_merged_too() -> None:
    domain = domain_with(kubevirt_pci("train0", 0x86) + kubevirt_mdev("desk", UUID_A, ' display="on" ramfb="on"'))
    result = build_domain(domain, None, {A100_VAR: "0000:86:00.0,0000:af:00.0", T4_VAR: UUID_A})
    # variables in name order: the mdev one first (it keeps virt-launcher's display), then the PCI ones
    assert result.aliases == {"ua-gpu-desk": UUID_A, "ua-gpu-train0": "0000:86:00.0", "ua-gpu2": "0000:af:00.0"}
    assert displays(result.domain_xml)["ua-gpu-desk"] == ("on", "on")
    libvirt_verdict(result.domain_xml, result.aliases)


def _plain_pci(name: str, bus: int) -> str:
    """virt-launcher's PCI GPU without a driver (the form the hook reads from the bytes)."""
    return kubevirt_pci(name, bus, driver="")


READ_CASES: dict[str, bytes] = {
    "sixteen as rendered": kubevirt_rendered_domain(),
    "boot order and guest address": domain_with(
        _plain_pci("g", 0x86).replace(
            "</source>",
            '</source><boot order="2"></boot><address type="pci" domain="0x0000" bus="0x02" slot="0x00"'
            ' function="0x0"></address>',
        ),
        controllers=NUMA_CONTROLLERS,
    ),
    "no type on the source address": domain_with(_plain_pci("g", 0x86).replace(' type="pci" domain', " domain")),
    "self-closed elements, managed": re.sub(
        rb"<([\w:]+)([^<>]*)></\1>",
        rb"<\1\2/>",
        domain_with(_plain_pci("g", 0x86).replace('"no"', '"yes"')),
    ),
    # each of these leaves the reading to the tree
    "a comment": domain_with("<!-- x -->" + _plain_pci("g", 0x86)),
    "upper-case hex": domain_with(_plain_pci("g", 0x86).replace("0x86", "0x8A")),
    "a character reference": domain_with(_plain_pci("g", 0x86).replace("0x86", "0x&#x38;6")),
    "a driver": domain_with(kubevirt_pci("g", 0x86)),
    "an attribute more": domain_with(_plain_pci("g", 0x86).replace('managed="no"', 'managed="no" x="1"')),
    "twice the same source": domain_with(_plain_pci("g", 0x86) + _plain_pci("h", 0x86)),
    "a hostdev outside <devices>": domain_with(_plain_pci("g", 0x86)).replace(
        b"</domain>", _plain_pci("x", 0xAF).encode() + b"</domain>"
    ),
    "in another namespace": domain_with(_plain_pci("g", 0x86)).replace(b"<devices>", b'<devices xmlns="urn:x">'),
    "a usb device too": domain_with(_plain_pci("g", 0x86) + kubevirt_usb("stick")),
    "slot out of range": domain_with(_plain_pci("g", 0x86).replace('slot="0x00"', 'slot="0x20"')),
}
FROM_BYTES = {
    "sixteen as rendered",
    "boot order and guest address",
    "no type on the source address",
    "self-closed elements, managed",
}


@pytest.mark.parametrize("case", list(READ_CASES), ids=list(READ_CASES))
def test_hostdevs_read_from_the_bytes_are_what_the_tree_says(case: str) -> None:
    """virt-launcher's PCI form is read from the bytes (``kubevirt_forms``); it must say what the tree read
    says, and anything else must be left to the tree read."""
    from launcher_hook.domain import hostdevs_from_tree

    parsed = parse_domain(READ_CASES[case], 1 << 20)
    fast, tree = read_hostdevs(parsed), hostdevs_from_tree(parsed)
    assert (fast.kubevirt_forms is not None) is (case in FROM_BYTES)
    assert fast.view == tree.view
    assert fast.by_source == tree.by_source
    assert fast.in_order == tree.in_order


@pytest.mark.parametrize("case", list(READ_CASES), ids=list(READ_CASES))
def test_a_hostdev_text_read_again_says_what_it_said_the_first_time(case: str) -> None:
    """What a hostdev's bytes say is kept by its text (``domain._forms_read``); a second read of the same
    domain, from what was kept, must give what the first read and the tree read give."""
    from launcher_hook import domain as module

    module._forms_read.clear()
    first = read_hostdevs(parse_domain(READ_CASES[case], 1 << 20))
    assert (first.kubevirt_forms is not None) is (case in FROM_BYTES)
    again = read_hostdevs(parse_domain(READ_CASES[case], 1 << 20))
    assert again.kubevirt_forms == first.kubevirt_forms
    assert again.spans is not None if first.spans is not None else again.spans is None
    assert again.view == first.view
    assert [element.sourceline for element in again.in_order or []] == [
        element.sourceline for element in first.in_order or []
    ]


def test_the_hostdev_texts_kept_are_bounded() -> None:
    """A hook fed ever new domains keeps at most ``FORMS_KEPT`` hostdev texts, however many it reads."""
    from launcher_hook import domain as module

    module._forms_read.clear()
    addresses = [f"0000:{bus:02x}:00.0" for bus in range(0x10, 0x42)]  # 50 GPUs a domain
    for domain_number in range(module.FORMS_KEPT // len(addresses) + 2):
        domain = rendered_domain(addresses, alias_prefix=f"ua-gpu-d{domain_number}-")
        assert read_hostdevs(parse_domain(domain, 1 << 22)).kubevirt_forms is not None
        assert len(module._forms_read) <= module.FORMS_KEPT


@pytest.mark.parametrize("case", sorted(FROM_BYTES))
@pytest.mark.parametrize(
    "options", [HostdevOptions(), HostdevOptions(driver="vfio"), HostdevOptions(force_gpu_aliases=True)]
)
def test_a_merge_with_hostdevs_read_from_the_bytes_gives_the_general_paths_bytes(
    case: str, options: HostdevOptions
) -> None:
    domain = READ_CASES[case]
    names = [alias.decode()[len("ua-gpu-") :] for alias in re.findall(rb'alias name="(ua-gpu-[^"]+)"', domain)]
    buses = [
        int(bus, 16) for bus in re.findall(rb'<source>\s*<address(?: type="pci")? domain="0x0000" bus="0x(..)"', domain)
    ]
    gpus = [{"name": name, "deviceName": A100} for name in names] + [{"name": "added", "deviceName": A100}]
    env = {A100_VAR: ",".join(f"0000:{bus:02x}:00.0" for bus in [*buses, 0xEE])}
    outputs = []
    for fast in (True, False):
        parsed = parse_domain(domain, 1 << 20)
        existing = read_hostdevs(parsed)
        specs, warnings = match_vmi(parse_vmi(vmi_json(gpus)), allocation_from_env(env), options, existing.view)
        spliced = merge_hostdevs(parsed, specs, existing, allow_fast=fast)
        outputs.append((spliced.domain_xml, spliced.hostdevs, warnings + spliced.warnings))
    assert outputs[0] == outputs[1]
    assert b'<source><address type="pci"' not in outputs[0][0]
    assert outputs[0][0].count(b"<hostdev ") == len(gpus)


# --- mode='subsystem' on every PCI and mdev hostdev ----------------------------------------------------------
# KubeVirt v1.9's createPCIHostDevice (pkg/virt-launcher/virtwrap/device/hostdevice/hostdev.go, and the DRA and
# SR-IOV ones alike) writes <hostdev type="pci" managed="no"> without mode=. libvirt's own parser takes that as
# mode='subsystem', but libvirt's Go XML library (libvirt.org/go/libvirtxml), which KubeVirt's plugin pipeline
# converts the domain with, refuses it ("Missing 'mode' attribute on domain hostdev"). The hook writes mode= on
# every PCI and mdev hostdev it merges, as on every one it creates (docs/kubevirt-hostdevs.md, "Shape").


def _without_mode(hostdevs: str) -> str:
    return hostdevs.replace(' mode="subsystem"', "").replace(" mode='subsystem'", "")


def _modes(domain_xml: bytes) -> dict[str, str | None]:
    root = etree.fromstring(domain_xml)
    modes: dict[str, str | None] = {}
    for hostdev in root.iterfind("devices/hostdev"):
        alias = hostdev.find("alias")
        if hostdev.get("type") in ("pci", "mdev") and alias is not None:
            modes[str(alias.get("name"))] = hostdev.get("mode")
    return modes


MODELESS_CASES = {
    "virt-launcher 1.9's PCI form": _without_mode(_plain_pci("train0", 0x86) + _plain_pci("train1", 0xAF)),
    "with a driver and a guest address": _without_mode(RENDERED),
    "an mdev without mode": _without_mode(kubevirt_mdev("desk", UUID_A, ' display="on"')),
    "self-closed": _without_mode(_plain_pci("train0", 0x86)).replace("></address>", "/>").replace("></alias>", "/>"),
}


@pytest.mark.parametrize("case", list(MODELESS_CASES), ids=list(MODELESS_CASES))
@pytest.mark.parametrize("fast", [True, False], ids=["bytes", "tree"])
def test_every_pci_and_mdev_hostdev_the_hook_merges_gets_mode_subsystem(case: str, fast: bool) -> None:
    hostdevs = MODELESS_CASES[case]
    assert "mode=" not in hostdevs
    aliases = re.findall(r'alias name="ua-gpu-([^"]+)"', hostdevs)
    gpus = [{"name": name, "deviceName": T4 if name == "desk" else A100} for name in aliases]
    domain = domain_with(hostdevs, controllers=NUMA_CONTROLLERS)
    parsed = parse_domain(domain, 1 << 20)
    existing = read_hostdevs(parsed)
    specs, _ = match_vmi(parse_vmi(vmi_json(gpus)), allocation_from_env(RENDERED_ENV), HostdevOptions(), existing.view)
    after = merge_hostdevs(parsed, specs, existing, allow_fast=fast).domain_xml
    modes = _modes(after)
    assert sorted(modes) == sorted(f"ua-gpu-{name}" for name in aliases)
    assert set(modes.values()) == {"subsystem"}, modes
    libvirt_verdict(after)


def test_the_bytes_and_the_tree_paths_add_mode_to_the_same_bytes() -> None:
    domain = domain_with(MODELESS_CASES["virt-launcher 1.9's PCI form"])
    gpus = [{"name": "train0", "deviceName": A100}, {"name": "train1", "deviceName": A100}]
    outputs = []
    for fast in (True, False):
        parsed = parse_domain(domain, 1 << 20)
        existing = read_hostdevs(parsed)
        env = allocation_from_env(RENDERED_ENV)
        specs, _ = match_vmi(parse_vmi(vmi_json(gpus)), env, HostdevOptions(), existing.view)
        outputs.append(merge_hostdevs(parsed, specs, existing, allow_fast=fast).domain_xml)
    assert outputs[0] == outputs[1]
    assert outputs[0].count(b'<hostdev type="pci" managed="no" mode="subsystem">') == 2


def test_a_hostdev_with_another_mode_is_set_to_subsystem_with_a_warning() -> None:
    domain = domain_with(_plain_pci("train0", 0x86).replace('managed="no"', 'managed="no" mode="capabilities"'))
    result = build_domain(domain, vmi_json([{"name": "train0", "deviceName": A100}]), RENDERED_ENV)
    assert _modes(result.domain_xml) == {"ua-gpu-train0": "subsystem"}
    assert any("mode='capabilities'" in warning for warning in result.warnings), result.warnings
