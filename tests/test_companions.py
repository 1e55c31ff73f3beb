"""A GPU and its companion functions in one guest slot (issue 15): the hook's placement, checked by real libvirt.

The golden cases ``companions-*`` (tests/fixtures/golden) hold the exact documents; here: QEMU's argv shows each
GPU at function 0 with ``multifunction=on`` and its companions at their host functions on the same bus and slot,
the annotation turns it off byte for byte, nothing KubeVirt placed moves, and the refusals and warnings.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from launcher_hook import BuildOptions, build_domain
from launcher_hook.allocation import allocation_from_env, parse_environ
from launcher_hook.companions import place_companions, slot_account
from launcher_hook.domain import ParsedDomain, parse_domain
from schemas import InputError
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from schemas.vmi import parse_vmi
from tests.conftest import FIXTURES
from tests.libvirt_support import libvirt_verdict

GOLDEN = FIXTURES / "golden"
TU106 = "NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
ENV = {
    f"PCI_RESOURCE_{TU106}": "0000:86:00.0,0000:af:00.0",
    f"PCI_COMPANIONS_{TU106}": "0000:86:00.0=0000:86:00.1+0000:86:00.2+0000:86:00.3,0000:af:00.0=0000:af:00.1",
}


def _case(name: str) -> tuple[bytes, bytes | None, dict[str, str], BuildOptions]:
    case = GOLDEN / name
    vmi = case / "vmi.json"
    options = json.loads((case / "options.json").read_text()) if (case / "options.json").exists() else {}
    return (
        (case / "domain.xml").read_bytes(),
        vmi.read_bytes() if vmi.exists() else None,
        parse_environ((case / "env").read_bytes()),
        BuildOptions(**options),
    )


def _seed_domain(machine: str = "q35") -> bytes:
    return (
        (GOLDEN / "seed-two-gpus" / "domain.xml")
        .read_bytes()
        .replace(b'machine="q35"', f'machine="{machine}"'.encode())
    )


def _vmi(annotations: dict[str, Any] | None = None) -> bytes:
    document = json.loads((GOLDEN / "seed-two-gpus" / "vmi.json").read_bytes())
    if annotations is not None:
        document["metadata"]["annotations"] = annotations
    return json.dumps(document).encode()


def _qemu_devices(domain_xml: bytes, aliases: dict[str, str]) -> dict[str, dict[str, Any]]:
    report = libvirt_verdict(domain_xml, aliases)
    return {str(device["id"]): device for device in report.qemu_devices}


@pytest.mark.libvirt
def test_q35_gpu_and_companions_share_one_slot_behind_a_new_root_port() -> None:
    result = build_domain(_seed_domain(), _vmi(), ENV)
    devices = _qemu_devices(result.domain_xml, result.aliases)
    gpu, audio, usb, ucsi = (devices[alias] for alias in ("ua-gpu0", "ua-gpu0-fn1", "ua-gpu0-fn2", "ua-gpu0-fn3"))
    assert (gpu["host"], gpu["addr"], gpu["multifunction"]) == ("0000:86:00.0", "0x0", True)
    assert [device["addr"] for device in (audio, usb, ucsi)] == ["0x0.0x1", "0x0.0x2", "0x0.0x3"]
    assert [device["host"] for device in (audio, usb, ucsi)] == ["0000:86:00.1", "0000:86:00.2", "0000:86:00.3"]
    assert {device["bus"] for device in (gpu, audio, usb, ucsi)} == {"pci.1"}  # the root port the hook added
    second, second_audio = devices["ua-gpu1"], devices["ua-gpu1-fn1"]
    assert (second["bus"], second["addr"], second["multifunction"]) == ("pci.2", "0x0", True)
    assert (second_audio["bus"], second_audio["addr"], second_audio["host"]) == ("pci.2", "0x0.0x1", "0000:af:00.1")
    root = parse_domain(result.domain_xml, DEFAULT_MAX_INPUT_BYTES).root
    ports = [(c.get("index"), c.get("model")) for c in root.iterfind("devices/controller") if c.get("type") == "pci"]
    assert ports == [("1", "pcie-root-port"), ("2", "pcie-root-port")]
    assert [placement.describe() for placement in result.placements] == [
        "ua-gpu0: guest slot 0000:01:00 behind the new pcie-root-port index 1, function 0 0000:86:00.0 "
        "(multifunction), companions at 1 (0000:86:00.1), 2 (0000:86:00.2), 3 (0000:86:00.3)",
        "ua-gpu1: guest slot 0000:02:00 behind the new pcie-root-port index 2, function 0 0000:af:00.0 "
        "(multifunction), companions at 1 (0000:af:00.1)",
    ]


@pytest.mark.libvirt
def test_i440fx_takes_the_highest_free_slot_of_bus_0() -> None:
    result = build_domain(_seed_domain("pc-i440fx-7.2"), _vmi(), ENV)
    devices = _qemu_devices(result.domain_xml, result.aliases)
    assert (devices["ua-gpu0"]["bus"], devices["ua-gpu0"]["addr"]) == ("pci.0", "0x1f")
    assert (devices["ua-gpu0-fn3"]["bus"], devices["ua-gpu0-fn3"]["addr"]) == ("pci.0", "0x1f.0x3")
    assert (devices["ua-gpu1"]["addr"], devices["ua-gpu1-fn1"]["addr"]) == ("0x1e", "0x1e.0x1")
    assert b"pcie-root-port" not in result.domain_xml


@pytest.mark.libvirt
def test_a_gpu_kubevirt_placed_keeps_its_address_and_its_companions_join_it() -> None:
    domain, vmi, env, options = _case("companions-numa")
    result = build_domain(domain, vmi, env, options)
    devices = _qemu_devices(result.domain_xml, result.aliases)
    # train0 sits behind KubeVirt's NUMA root port (index 2, under the pcie-expander-bus): it stays there
    assert (devices["ua-gpu-train0"]["bus"], devices["ua-gpu-train0"]["addr"]) == ("pci.2", "0x0")
    assert devices["ua-gpu-train0"]["multifunction"] is True
    assert (devices["ua-gpu0-fn1"]["bus"], devices["ua-gpu0-fn1"]["addr"]) == ("pci.2", "0x0.0x1")
    assert (devices["ua-gpu-train1"]["bus"], devices["ua-gpu1-fn2"]["bus"]) == ("pci.3", "pci.3")
    original = parse_domain(domain, DEFAULT_MAX_INPUT_BYTES).root
    output = parse_domain(result.domain_xml, DEFAULT_MAX_INPUT_BYTES).root
    for kept in original.iterfind("devices/controller"):  # no controller of KubeVirt's moved or changed
        index = kept.get("index")
        again = [c for c in output.iterfind("devices/controller") if c.get("index") == index]
        assert again and all(c.get("type") != kept.get("type") or c.get("model") == kept.get("model") for c in again)


def test_annotation_off_gives_todays_output_byte_for_byte() -> None:
    today = build_domain(_seed_domain(), _vmi(), {f"PCI_RESOURCE_{TU106}": ENV[f"PCI_RESOURCE_{TU106}"]})
    off = build_domain(_seed_domain(), _vmi({"gpu-passthrough.kubevirt.io/companions": "off"}), ENV)
    assert off.domain_xml == today.domain_xml
    assert off.hostdevs == today.hostdevs and not off.placements
    on = build_domain(_seed_domain(), _vmi({"gpu-passthrough.kubevirt.io/companions": "on"}), ENV)
    assert on.domain_xml == build_domain(_seed_domain(), _vmi(), ENV).domain_xml != today.domain_xml


@pytest.mark.parametrize("value", ["no", "", "OFF", 0, None])
def test_an_unknown_annotation_value_is_refused_naming_it(value: object) -> None:
    with pytest.raises(InputError, match=re.escape("gpu-passthrough.kubevirt.io/companions")):
        parse_vmi(_vmi({"gpu-passthrough.kubevirt.io/companions": value}))


def test_a_virtual_machine_takes_the_annotation_of_its_template() -> None:
    vmi = json.loads(_vmi())
    template: dict[str, Any] = {"metadata": {}, "spec": vmi["spec"]}
    vm = {
        "kind": "VirtualMachine",
        "metadata": {"name": "vm", "annotations": {"gpu-passthrough.kubevirt.io/companions": "off"}},
        "spec": {"template": template},
    }
    assert parse_vmi(json.dumps(vm).encode()).metadata.companions is True
    template["metadata"] = {"annotations": {"gpu-passthrough.kubevirt.io/companions": "off"}}
    assert parse_vmi(json.dumps(vm).encode()).metadata.companions is False


def _no_serialize(self: ParsedDomain) -> bytes:
    raise AssertionError("the tree was serialised")


@pytest.mark.parametrize(
    "name", ["companions-q35", "companions-launcher-rendered", "companions-numa", "companions-i440fx"]
)
def test_bytes_and_tree_paths_give_the_same_document(name: str) -> None:
    domain, vmi, env, options = _case(name)
    merged = build_domain(domain, vmi, env, options)
    plain = {key: value for key, value in env.items() if not key.startswith("PCI_COMPANIONS_")}
    before = build_domain(domain, vmi, plain, options)
    allocation = allocation_from_env(env)
    with pytest.MonkeyPatch.context() as patch:
        if b"<!--" not in domain:  # the bytes path really is taken: nothing is serialised
            patch.setattr(ParsedDomain, "serialize", _no_serialize)
        fast = place_companions(before.domain_xml, before.hostdevs, allocation, DEFAULT_MAX_INPUT_BYTES)
    tree = place_companions(before.domain_xml, before.hostdevs, allocation, DEFAULT_MAX_INPUT_BYTES, allow_fast=False)
    assert fast.domain_xml == tree.domain_xml == merged.domain_xml
    assert fast.hostdevs == tree.hostdevs


def test_a_domain_with_comments_takes_the_tree_path_and_keeps_them() -> None:
    domain = _seed_domain().replace(b"<devices>", b"<devices><!-- keep me -->", 1)
    result = build_domain(domain, _vmi(), ENV)
    assert b"<!-- keep me -->" in result.domain_xml
    assert {spec.alias for spec in result.hostdevs} >= {"ua-gpu0-fn1", "ua-gpu0-fn3", "ua-gpu1-fn1"}
    again = build_domain(result.domain_xml, _vmi(), ENV)
    assert again.domain_xml == result.domain_xml


def _with_hostdev(extra: str, machine: str = "q35") -> bytes:
    return _seed_domain(machine).replace(b"\t</devices>", f"\t\t{extra}\n\t</devices>".encode(), 1)


def test_a_gpu_at_a_function_other_than_0_keeps_its_address_without_companions() -> None:
    rendered = (
        '<hostdev type="pci" managed="no" mode="subsystem"><source><address type="pci" domain="0x0000" bus="0x86" '
        'slot="0x00" function="0x0"></address></source><address type="pci" domain="0x0000" bus="0x05" slot="0x00" '
        'function="0x2"></address><alias name="ua-gpu-gpu0"></alias></hostdev>'
    )
    only_86 = {f"PCI_RESOURCE_{TU106}": "0000:86:00.0", f"PCI_COMPANIONS_{TU106}": "0000:86:00.0=0000:86:00.1"}
    vmi = json.loads(_vmi())
    del vmi["spec"]["domain"]["devices"]["gpus"][1]
    result = build_domain(_with_hostdev(rendered), json.dumps(vmi).encode(), only_86)
    assert any("function 2" in warning and "left out" in warning for warning in result.warnings)
    assert b"ua-gpu0-fn1" not in result.domain_xml and b"multifunction" not in result.domain_xml


def test_a_companion_already_passed_elsewhere_stays_there() -> None:
    elsewhere = (
        '<hostdev type="pci" managed="no" mode="subsystem"><source><address type="pci" domain="0x0000" bus="0x86" '
        'slot="0x00" function="0x1"></address></source><address type="pci" domain="0x0000" bus="0x00" slot="0x07" '
        'function="0x0"></address><alias name="ua-hostdevice-audio"></alias></hostdev>'
    )
    result = build_domain(_with_hostdev(elsewhere), _vmi(), ENV)
    assert any(
        "0000:86:00.1 is not placed" in warning and "ua-hostdevice-audio" in warning for warning in result.warnings
    )
    assert b'slot="0x07"' in result.domain_xml and b"ua-gpu0-fn1" not in result.domain_xml
    assert b"ua-gpu0-fn2" in result.domain_xml  # the others still join the GPU


def test_a_machine_that_is_neither_pcie_nor_i440fx_gets_no_companions() -> None:
    result = build_domain(_seed_domain("s390-ccw-virtio"), _vmi(), ENV)
    assert any("s390-ccw-virtio" in warning for warning in result.warnings)
    assert b"-fn1" not in result.domain_xml


def test_a_companion_alias_held_by_another_element_is_an_error() -> None:
    taken = (
        '<disk type="file" device="disk"><source file="/x"></source><target dev="vdz"></target>'
        '<alias name="ua-gpu0-fn1"></alias></disk>'
    )
    with pytest.raises(InputError, match="ua-gpu0-fn1"):
        build_domain(_with_hostdev(taken), _vmi(), ENV)


def test_a_companion_that_is_a_gpu_of_the_vm_is_not_placed_twice() -> None:
    env = {f"PCI_RESOURCE_{TU106}": "0000:86:00.0,0000:86:00.1", f"PCI_COMPANIONS_{TU106}": "0000:86:00.0=0000:86:00.1"}
    result = build_domain(_seed_domain(), _vmi(), env)
    assert any("is a GPU of this VM itself" in warning for warning in result.warnings)
    assert b"ua-gpu0-fn1" not in result.domain_xml


def test_without_a_domain_companions_are_only_a_warning() -> None:
    result = build_domain(None, _vmi(), ENV)
    assert any("no domain to place them in" in warning for warning in result.warnings)
    assert (
        result.domain_xml
        == build_domain(None, _vmi(), {f"PCI_RESOURCE_{TU106}": ENV[f"PCI_RESOURCE_{TU106}"]}).domain_xml
    )


def test_the_cached_allocation_follows_the_companion_variable() -> None:
    """The hook keeps its last allocation by the variables it read: the companion variable is one of them."""
    with_all = build_domain(_seed_domain(), _vmi(), ENV)
    fewer = {**ENV, f"PCI_COMPANIONS_{TU106}": "0000:86:00.0=0000:86:00.1"}
    with_fewer = build_domain(_seed_domain(), _vmi(), fewer)
    assert b"ua-gpu0-fn3" in with_all.domain_xml and b"ua-gpu0-fn3" not in with_fewer.domain_xml
    assert b"ua-gpu1-fn1" not in with_fewer.domain_xml
    with pytest.raises(InputError, match=f"PCI_COMPANIONS_{TU106}"):
        build_domain(_seed_domain(), _vmi(), {**ENV, f"PCI_COMPANIONS_{TU106}": "0000:86:00.0=0000:87:00.1"})


def test_slot_account_lists_each_multifunction_slot() -> None:
    result = build_domain(_seed_domain(), _vmi(), ENV)
    assert slot_account(result.domain_xml, DEFAULT_MAX_INPUT_BYTES) == [
        "guest slot 0000:01:00 (multifunction, bus 1 is a pcie-root-port): 0: pci 0000:86:00.0, 1: pci 0000:86:00.1, "
        "2: pci 0000:86:00.2, 3: pci 0000:86:00.3",
        "guest slot 0000:02:00 (multifunction, bus 2 is a pcie-root-port): 0: pci 0000:af:00.0, 1: pci 0000:af:00.1",
    ]


def test_a_gpu_none_of_whose_companions_can_join_is_left_as_it_was() -> None:
    elsewhere = (
        '<hostdev type="pci" managed="no" mode="subsystem"><source><address type="pci" domain="0x0000" bus="0xaf" '
        'slot="0x00" function="0x1"></address></source><alias name="ua-hostdevice-audio"></alias></hostdev>'
    )
    result = build_domain(_with_hostdev(elsewhere), _vmi(), ENV)
    assert any("0000:af:00.1 is not placed" in warning for warning in result.warnings)
    root = parse_domain(result.domain_xml, DEFAULT_MAX_INPUT_BYTES).root
    ports = [c.get("index") for c in root.iterfind("devices/controller") if c.get("model") == "pcie-root-port"]
    assert ports == ["1"]  # the first GPU's only: the second keeps KubeVirt's placement (none)
    assert [placement.gpu for placement in result.placements] == ["0000:86:00.0"]


def test_a_gpu_whose_guest_address_is_all_zero_gets_no_companions_at_slot_0() -> None:
    """libvirt reads domain, bus and slot 0 as "assign one": companions at 0000:00:00.N would each land elsewhere."""
    zero = (
        '<hostdev type="pci" managed="no" mode="subsystem"><source><address type="pci" domain="0x0000" bus="0x86" '
        'slot="0x00" function="0x0"></address></source><address type="pci" domain="0x0000" bus="0x00" slot="0x00" '
        'function="0x0"></address><alias name="ua-gpu-gpu0"></alias></hostdev>'
    )
    result = build_domain(_with_hostdev(zero), _vmi(), ENV)
    assert any("0000:00:00.0" in warning and "assign one" in warning for warning in result.warnings)
    assert b"ua-gpu0-fn1" not in result.domain_xml and b'bus="0x00" slot="0x00" function="0x1"' not in result.domain_xml
    assert b"ua-gpu1-fn1" in result.domain_xml  # the other GPU still gets its companion
    assert [placement.gpu for placement in result.placements] == ["0000:af:00.0"]


@pytest.mark.libvirt
def test_a_companion_listed_for_two_gpus_is_passed_once() -> None:
    env = {
        f"PCI_RESOURCE_{TU106}": "0000:86:00.0,0000:86:00.1",
        f"PCI_COMPANIONS_{TU106}": "0000:86:00.0=0000:86:00.2,0000:86:00.1=0000:86:00.2+0000:86:00.3",
    }
    result = build_domain(_seed_domain(), _vmi(), env)
    assert result.domain_xml.count(b'bus="0x86" slot="0x00" function="0x2"') == 1
    assert any(
        "companion 0000:86:00.2 is not placed" in warning and "joined that GPU's guest slot" in warning
        for warning in result.warnings
    )
    devices = _qemu_devices(result.domain_xml, result.aliases)
    assert (devices["ua-gpu0-fn2"]["bus"], devices["ua-gpu0-fn2"]["addr"]) == ("pci.1", "0x0.0x2")
    assert (devices["ua-gpu1-fn3"]["bus"], devices["ua-gpu1-fn3"]["addr"]) == ("pci.2", "0x0.0x3")
    assert build_domain(result.domain_xml, _vmi(), env).domain_xml == result.domain_xml


def test_a_domain_within_the_cap_is_not_refused_for_the_hostdevs_the_hook_adds() -> None:
    """The companion pass re-reads the merge's output, which is larger than the input by the GPUs' hostdevs."""
    domain = _seed_domain()
    options = BuildOptions(max_input_bytes=len(domain))
    result = build_domain(domain, _vmi(), ENV, options)
    assert len(result.domain_xml) > len(domain) and b"ua-gpu0-fn3" in result.domain_xml
    assert result.domain_xml == build_domain(domain, _vmi(), ENV).domain_xml


@pytest.mark.libvirt
def test_a_new_root_port_takes_an_index_above_every_bus_an_address_names() -> None:
    """A VMI interface's pciAddress gives it a guest address on a bus the domain declares no controller for
    (libvirt adds it): the hook's root port must not be that bus, or its slot 0 is used twice."""
    domain = _seed_domain().replace(
        b'<alias name="ua-default"></alias>',
        b'<address type="pci" domain="0x0000" bus="0x01" slot="0x00" function="0x0"></address>'
        b'<alias name="ua-default"></alias>',
    )
    result = build_domain(domain, _vmi(), ENV)
    root = parse_domain(result.domain_xml, DEFAULT_MAX_INPUT_BYTES).root
    ports = [c.get("index") for c in root.iterfind("devices/controller") if c.get("model") == "pcie-root-port"]
    assert ports == ["2", "3"]
    devices = _qemu_devices(result.domain_xml, result.aliases)
    assert (devices["ua-gpu0"]["bus"], devices["ua-gpu0-fn1"]["addr"]) == ("pci.2", "0x0.0x1")


def test_the_wanted_companions_kept_with_the_allocation_warn_on_every_call_and_are_bounded() -> None:
    """``wanted_companions`` keeps its result with the allocation, by the hostdevs: a later call for the same
    hostdevs gives the same GPUs (a fresh list) and the same warnings again, and at most ``WANTED_KEPT`` lists
    are kept however many the hook sees."""
    from launcher_hook import companions as module
    from launcher_hook.hostdev import HostdevSpec
    from schemas import PciAddress, ResourceKind

    variable = f"PCI_RESOURCE_{TU106}"
    allocation = allocation_from_env(
        {variable: "0000:86:00.0,0000:86:00.1", f"PCI_COMPANIONS_{TU106}": "0000:86:00.0=0000:86:00.1+0000:86:00.2"}
    )
    gpu, other = (
        HostdevSpec(ResourceKind.PCI, PciAddress.parse(address), f"ua-gpu{index}", variable, label=f"gpus[{index}]")
        for index, address in enumerate(("0000:86:00.0", "0000:86:00.1"))
    )
    for _ in range(3):
        warnings: list[str] = []
        found = module.wanted_companions([gpu, other], allocation, warnings)
        assert found == [(0, gpu, (PciAddress.parse("0000:86:00.2"),))]
        assert warnings == [
            "gpus[0]: companion 0000:86:00.1 is a GPU of this VM itself; it is not placed again in the GPU's slot"
        ]
        found.clear()  # the caller's list: what is kept does not change
    for number in range(module.WANTED_KEPT * 2):
        module.wanted_companions([gpu, other._replace(alias=f"ua-hostdev{number}")], allocation, [])
        assert len(allocation.derived[module._WANTED]) <= module.WANTED_KEPT


def test_the_aliases_logged_are_a_fresh_dict_and_the_kept_ones_bounded() -> None:
    """``BuildResult.aliases`` (the log line's ``gpus``) is made from what is kept for the same hostdevs: changing
    the dict it gave changes no later one, and at most ``ALIASES_KEPT`` lists are kept."""
    from launcher_hook import builder
    from launcher_hook.hostdev import HostdevSpec
    from schemas import PciAddress, ResourceKind

    spec = HostdevSpec(ResourceKind.PCI, PciAddress.parse("0000:86:00.0"), "ua-gpu0", f"PCI_RESOURCE_{TU106}")
    first = builder.BuildResult(b"", [spec]).aliases
    assert first == {"ua-gpu0": "0000:86:00.0"}
    first["ua-gpu0"] = "changed"
    assert builder.BuildResult(b"", [spec]).aliases == {"ua-gpu0": "0000:86:00.0"}
    for number in range(builder.ALIASES_KEPT * 2):
        assert builder.BuildResult(b"", [spec._replace(alias=f"ua-gpu{number}")]).aliases == {
            f"ua-gpu{number}": "0000:86:00.0"
        }
        assert len(builder._aliases_kept) <= builder.ALIASES_KEPT


def test_when_no_bus_index_is_left_the_next_gpu_is_placed_alone_and_the_output_says_why() -> None:
    """A GPU the merge adds on q35 gets a root port of index one above every controller's; at a top index of
    254 the first GPU takes 255 (the last bus) and the second is left without companions, a warning naming it,
    and no root port or guest address given to it."""
    top = b'<controller type="pci" index="254" model="pcie-root-port"></controller>'
    domain = _seed_domain().replace(b'\t\t<controller type="usb"', b"\t\t" + top + b'\n\t\t<controller type="usb"')
    assert domain.count(top) == 1
    result = build_domain(domain, _vmi(), ENV)
    root = parse_domain(result.domain_xml, DEFAULT_MAX_INPUT_BYTES).root
    ports = [c.get("index") for c in root.iterfind("devices/controller") if c.get("model") == "pcie-root-port"]
    assert ports == ["254", "255"]
    aliases = [str(name) for name in root.xpath("devices/hostdev/alias/@name")]  # type: ignore[union-attr]
    assert aliases == ["ua-gpu0", "ua-gpu0-fn1", "ua-gpu0-fn2", "ua-gpu0-fn3", "ua-gpu1"]
    second = root.findall("devices/hostdev")[-1]
    assert second.find("address") is None
    assert any(
        warning.endswith(": no PCI controller index is left for a root port; companions left out")
        for warning in result.warnings
    ), result.warnings


def test_what_the_pass_reads_of_the_domain_is_what_the_path_expressions_select() -> None:
    """``_Domain`` walks the tree with lxml's child and descendant loops; on documents with the shapes that
    tell them apart (a second ``<os>`` and ``<devices>``, namespaced look-alikes, addresses in a ``<source>``,
    nested deeper or in a comment, controllers without or with a bad index) it finds what the XPath and
    ElementPath expressions it replaced select: the machine, bus kind, controller indexes and guest addresses, and
    each hostdev's first ``<address>`` child."""
    from lxml import etree

    from launcher_hook.companions import _Domain
    from launcher_hook.hostdevs.base import c_number

    def expected(parsed: ParsedDomain) -> dict[str, Any]:
        root = parsed.root
        os_type = root.find("os/type")
        machine = (os_type.get("machine") if os_type is not None else None) or ""
        controllers = [c for c in root.iterfind("devices/controller") if c.get("type") == "pci"]
        indexes = [c_number(c.get("index"), 10) for c in controllers]
        used: dict[tuple[int | None, ...], etree._Element | None] = {}
        selected = etree.XPath("devices//address[@type='pci'][not(parent::source)]")(root)
        assert isinstance(selected, list)
        for address in selected:
            assert isinstance(address, etree._Element)
            values = [address.get(name) for name in ("domain", "bus", "slot", "function")]
            numbers = tuple(0 if value is None else c_number(value) for value in values)
            if None not in numbers and numbers[:3] != (0, 0, 0):
                used.setdefault(numbers, address.getparent())
        top = max([0, *(index for index in indexes if index is not None), *(key[1] or 0 for key in used)])
        models = {c.get("model") for c in controllers}
        if "pcie-root" in models or "q35" in machine or machine.startswith("virt"):
            bus_kind: str | None = "pcie"
        elif "pci-root" in models or machine == "pc" or machine.startswith("pc-"):
            bus_kind = "pci"
        else:
            bus_kind = None
        return {
            "machine": machine,
            "unindexed": None in indexes,
            "next_index": top + 1,
            "used": list(used.items()),
            "devices": len(root.findall("devices")),
            "bus_kind": bus_kind,
            "guests": [
                (hostdev, guest)
                for hostdev in root.iterfind("devices/hostdev")
                if (guest := next(hostdev.iterchildren("address"), None)) is not None
            ],
        }

    pci = 'type="pci" domain="0x0000" bus="0x%02x" slot="0x%02x" function="0x0"'
    documents = [
        '<domain><os><type machine="pc-q35-9.0">hvm</type></os><devices/></domain>',
        '<domain><os/><os><type machine="pc">hvm</type></os><devices>'
        f'<controller type="pci" index="3" model="pcie-root-port"/><controller type="pci" model="pci-bridge"/>'
        f'<controller type="usb" index="9"/><hostdev><source><address {pci % (0x40, 0)}/></source></hostdev>'
        f"<disk><address {pci % (5, 1)}/></disk><interface><rom><address {pci % (7, 2)}/></rom></interface>"
        f'<!-- <address {pci % (9, 9)}/> --><x:address xmlns:x="urn:x" {pci % (11, 3)}/>'
        f'<video><address type="drive" bus="0x10"/></video><sound><address {pci % (0, 0)}/></sound>'
        f"<devices><address {pci % (12, 4)}/></devices></devices>"
        f'<devices><controller type="pci" index="x"/><memballoon><address {pci % (2, 5)}/></memballoon></devices>'
        f"<sysinfo><address {pci % (30, 6)}/></sysinfo></domain>",
        '<domain xmlns:q="urn:q"><q:os><type machine="virt">hvm</type></q:os><os><type>hvm</type></os><devices>'
        f'<controller type="pci" index="07" model="pcie-root"/><disk><address {pci % (5, 1)}/></disk>'
        f"<hostdev><address {pci % (5, 1)}/></hostdev><source><address {pci % (6, 1)}/></source></devices></domain>",
        '<domain><os><type machine="q35">hvm</type></os><devices>'
        f'<hostdev><source><address {pci % (0x41, 0)}/></source><address type="drive"/><address {pci % (8, 0)}/>'
        f"</hostdev><hostdev><rom><address {pci % (9, 0)}/></rom></hostdev><hostdev/><x:hostdev xmlns:x='urn:x'>"
        f"<address {pci % (10, 0)}/></x:hostdev></devices><devices><hostdev><address {pci % (13, 0)}/></hostdev>"
        "</devices></domain>",
    ]
    for text in documents:
        parsed = parse_domain(text.encode(), DEFAULT_MAX_INPUT_BYTES)
        found = _Domain(parsed)
        got = {name: getattr(found, name) for name in ("machine", "unindexed", "next_index", "devices", "bus_kind")}
        guests = list(found.guests.items())
        assert {**got, "used": list(found.used.items()), "guests": guests} == expected(parsed), text
