"""GPUDirect P2P cliques (docs/p2p.md): GPUs below one host PCIe switch get one ``x-nv-gpudirect-clique``.

The workstation fixture (``simkit.fixture_nodes.WORKSTATION_NODE``) has two RTX A6000s below one PEX 8747 switch
and a third on a root port of its own. The hook reads their places from that sysfs tree, writes one
``<qemu:override>`` for the two, and libvirt's QEMU driver puts the property on their ``-device``; everything
else about the domain stays as it was without the pass.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from lxml import etree

from bench.workloads import CARD_VARIABLE, gpu_vmi, kubevirt_sized_domain, rendered_domain
from launcher_hook import BuildOptions, build_domain
from launcher_hook.cliques import (
    CLIQUE_PROPERTY,
    GROUPS_KEPT,
    MAX_CLIQUES,
    Clique,
    _device_texts,
    _groups,
    _shared_switches,
    existing_cliques,
    plan_cliques,
)
from launcher_hook.hostdev import HostdevSpec
from launcher_hook.mmio_window import QEMU_NS
from runtime.pci_companions import SysfsCompanions
from runtime.pci_topology import SysfsTopology
from schemas import InputError, PciAddress, ResourceKind
from schemas.pci_topology import ABSENT, MAX_LINK_BYTES, PciPlace, bridges_from_link
from schemas.vmi import CLIQUES_ANNOTATION
from simkit.fixture_nodes import WORKSTATION_NODE
from simkit.sysfs_fixture import build
from tests.libvirt_support import libvirt_verdict, qemu_argv
from xmlgen.cli import cli

PAIR = ["0000:03:00.0", "0000:04:00.0"]
ALONE = "0000:05:00.0"
GPUS = [*PAIR, ALONE]


@pytest.fixture(scope="module")
def sys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ws")
    build(WORKSTATION_NODE, root)
    return root / "sys"


def _options(sys_dir: Path, *, companions: bool = False) -> BuildOptions:
    return BuildOptions(
        topology=SysfsTopology(sys_dir), companion_reader=SysfsCompanions(sys_dir) if companions else None
    )


def _vmi(count: int, **annotations: str) -> bytes:
    document = json.loads(gpu_vmi(count))
    if annotations:
        document["metadata"]["annotations"] = annotations
    return json.dumps(document).encode()


def _cliques(domain: bytes) -> dict[str, str]:
    return existing_cliques(etree.fromstring(domain))


def _place(*bridges: str, gpu: bool = True) -> PciPlace:
    return PciPlace(tuple(PciAddress.parse(bridge) for bridge in bridges), gpu)


def _spec(alias: str, address: str) -> HostdevSpec:
    return HostdevSpec(ResourceKind.PCI, PciAddress.parse(address), alias, CARD_VARIABLE)


# ---- the rule --------------------------------------------------------------------------------------------


def test_the_upstream_bridges_come_from_the_devices_link_and_nothing_else() -> None:
    gpu = PciAddress.parse("0000:03:00.0")
    link = "../../../devices/pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:08.0/0000:03:00.0"
    assert bridges_from_link(link, gpu) == tuple(
        map(PciAddress.parse, ["0000:00:01.0", "0000:01:00.0", "0000:02:08.0"])
    )
    assert bridges_from_link("../../../devices/pci0000:00/0000:03:00.0", gpu) == ()
    for odd in (
        "../../../devices/pci0000:00/0000:00:01.0/0000:04:00.0",  # another function's directory
        "../../../devices/pci0000:00/0000:00:01.0/../../../etc/0000:03:00.0",  # not the kernel's shape
        "/sys/devices/platform/0000:03:00.0",  # no pci<domain>:<bus> component
        "../../../devices/pci0000:00/" + "0000:00:01.0/" * (MAX_LINK_BYTES // 13) + "0000:03:00.0",  # too long
    ):
        assert bridges_from_link(odd, gpu) is None, odd
    assert _place("0000:00:01.0", "0000:01:00.0", "0000:02:08.0").switch == PciAddress.parse("0000:01:00.0")
    assert _place("0000:00:01.0").switch is None and _place("0000:00:01.0", "0000:01:00.0").switch is None


def test_gpus_below_one_switch_share_a_clique_and_a_lone_gpu_or_a_non_gpu_gets_none() -> None:
    switch_a = ("0000:00:01.0", "0000:01:00.0")
    switch_b = ("0000:00:02.0", "0000:06:00.0")
    specs = [_spec(f"ua-gpu{i}", f"0000:{10 + i:02x}:00.0") for i in range(6)]
    places = [
        _place(*switch_a, "0000:02:08.0"),
        _place(*switch_b, "0000:07:08.0"),
        _place(*switch_a, "0000:02:10.0"),
        _place(*switch_b, "0000:07:10.0"),
        _place(*switch_a, "0000:02:18.0", gpu=False),  # an audio function, a NIC: QEMU refuses the property
        _place("0000:00:03.0"),  # on a root port of its own
    ]
    cliques, warnings = plan_cliques(specs, places, {})
    assert [(c.number, str(c.switch), c.aliases) for c in cliques] == [
        (0, "0000:01:00.0", ("ua-gpu0", "ua-gpu2")),
        (1, "0000:06:00.0", ("ua-gpu1", "ua-gpu3")),
    ]
    assert warnings == []
    # The domain's own cliques: kept, their switch partners join them, their numbers are not given out again
    # (libvirt reads an unsigned value in base 10: "01" is 1, "0x1" it refuses).
    kept, warned = plan_cliques(specs, places, {"ua-gpu2": "00", "ua-other": "01"})
    assert [(c.number, c.aliases) for c in kept] == [(0, ("ua-gpu0",)), (2, ("ua-gpu1", "ua-gpu3"))] and not warned
    odd, warned = plan_cliques(specs, places, {"ua-gpu2": "0x0", "ua-gpu3": "4"})
    assert [(c.number, c.aliases) for c in odd] == [(4, ("ua-gpu1",))]
    assert len(warned) == 1 and "the domain's clique '0x0' is not a number" in warned[0]
    three = [_spec(f"ua-t{i}", f"0000:2{i}:00.0") for i in range(3)]
    below = [_place(*switch_a, f"0000:02:0{i}.0") for i in range(3)]
    split, warned = plan_cliques(three, below, {"ua-t0": "3", "ua-t1": "7"})
    assert split == [] and len(warned) == 1 and "different GPUDirect cliques in the domain (3, 7)" in warned[0]
    same, warned = plan_cliques(three, below, {"ua-t0": "3", "ua-t1": "03"})  # one clique, as libvirt reads it
    assert [(c.number, c.aliases) for c in same] == [(3, ("ua-t2",))] and not warned


def test_more_groups_than_clique_numbers_leave_the_last_out_with_a_warning() -> None:
    specs, places = [], []
    for group in range(MAX_CLIQUES + 1):
        for member in range(2):
            specs.append(_spec(f"ua-gpu{group}-{member}", f"0000:{group + 16:02x}:00.{member}"))
            places.append(_place("0000:00:01.0", f"0000:{group + 16:02x}:00.0", f"0000:{group + 40:02x}:0{member}.0"))
    cliques, warnings = plan_cliques(specs, places, {})
    assert [c.number for c in cliques] == list(range(MAX_CLIQUES))
    assert len(warnings) == 1 and "ua-gpu16-0, ua-gpu16-1" in warnings[0] and "16 clique numbers" in warnings[0]


# ---- sysfs -----------------------------------------------------------------------------------------------


def test_the_reader_finds_the_switch_the_display_functions_and_keeps_what_it_read(sys_dir: Path) -> None:
    reader = SysfsTopology(sys_dir).keeping()
    addresses = [PciAddress.parse(a) for a in [*GPUS, "0000:03:00.1", "0000:09:00.0"]]
    places = reader.read_all(addresses)
    assert [str(place.switch) for place in places[:2]] == ["0000:01:00.0", "0000:01:00.0"]
    assert places[2].switch is None and places[2].nvidia_gpu
    assert [place.nvidia_gpu for place in places[:2]] == [True, True]
    assert not places[3].nvidia_gpu  # the A6000's HDMI audio
    assert places[4] == ABSENT  # not in sysfs
    assert reader.kept is not None and reader.kept.reads == 5
    assert reader.read_all(addresses) == places and reader.kept.reads == 5  # nothing read again


def test_a_class_file_that_cannot_be_read_is_an_error_naming_it(tmp_path: Path) -> None:
    build(WORKSTATION_NODE, tmp_path)
    class_file = tmp_path / "sys/bus/pci/devices/0000:04:00.0/class"
    class_file.unlink()
    class_file.mkdir()
    with pytest.raises(InputError, match=r"0000:04:00.0.*class"):
        SysfsTopology(tmp_path / "sys").read_all([PciAddress.parse("0000:04:00.0")])
    with pytest.raises(InputError, match="GPUDirect cliques are read from the PCIe tree"):
        build_domain(kubevirt_sized_domain(), gpu_vmi(3), {CARD_VARIABLE: ",".join(GPUS)}, _options(tmp_path / "sys"))


# ---- the domain ------------------------------------------------------------------------------------------


def test_the_pair_gets_one_clique_that_libvirt_gives_qemu(sys_dir: Path) -> None:
    domain, env = kubevirt_sized_domain(), {CARD_VARIABLE: ",".join(GPUS)}
    result = build_domain(domain, gpu_vmi(3), env, _options(sys_dir))
    assert _cliques(result.domain_xml) == {"ua-gpu0": "0", "ua-gpu1": "0"}
    assert result.cliques is not None and [c.aliases for c in result.cliques.cliques] == [("ua-gpu0", "ua-gpu1")]
    without = build_domain(domain, gpu_vmi(3), env).domain_xml
    override = re.search(rb"\n\t<qemu:override>.*</qemu:override>", result.domain_xml, re.DOTALL)
    assert override is not None
    assert result.domain_xml.replace(override.group(0), b"") == without  # nothing else changed
    assert b'type="unsigned" value="0"></qemu:property>' in override.group(0)  # KubeVirt's empty-element style
    libvirt_verdict(result.domain_xml)
    argv = qemu_argv(result.domain_xml)
    devices = {
        found.group(1): found.group(0)
        for found in re.finditer(r'\{"driver":"vfio-pci"[^}]*"id":"([^"]+)"[^}]*\}', argv)
    }
    assert f'"{CLIQUE_PROPERTY}":0' in devices["ua-gpu0"] and f'"{CLIQUE_PROPERTY}":0' in devices["ua-gpu1"]
    assert CLIQUE_PROPERTY not in devices["ua-gpu2"]


def test_companions_stay_out_of_the_clique_and_the_output_is_a_fixed_point(sys_dir: Path) -> None:
    domain, env = rendered_domain(GPUS), {CARD_VARIABLE: ",".join(GPUS)}  # as virt-launcher rendered them
    first = build_domain(domain, gpu_vmi(3), env, _options(sys_dir, companions=True)).domain_xml
    cliques = _cliques(first)
    assert sorted(cliques) == ["ua-gpu-gpu0", "ua-gpu-gpu1"] and set(cliques.values()) == {"0"}
    assert b"-fn1" in first  # the audio functions joined their GPUs' slots, and have no clique
    again = build_domain(first, gpu_vmi(3), env, _options(sys_dir, companions=True)).domain_xml
    assert again == first
    libvirt_verdict(first)


def test_the_annotation_turns_cliques_off(sys_dir: Path) -> None:
    domain, env = kubevirt_sized_domain(), {CARD_VARIABLE: ",".join(GPUS)}
    off = build_domain(domain, _vmi(3, **{CLIQUES_ANNOTATION: "off"}), env, _options(sys_dir))
    assert off.domain_xml == build_domain(domain, gpu_vmi(3), env).domain_xml and off.cliques is None
    with pytest.raises(InputError, match=CLIQUES_ANNOTATION):
        build_domain(domain, _vmi(3, **{CLIQUES_ANNOTATION: "maybe"}), env, _options(sys_dir))


def test_one_gpu_reads_nothing_and_writes_nothing(tmp_path: Path) -> None:
    domain, env = kubevirt_sized_domain(), {CARD_VARIABLE: PAIR[0]}
    absent = BuildOptions(topology=SysfsTopology(tmp_path / "no-such-root"))  # would fail if it were read
    assert build_domain(domain, gpu_vmi(1), env, absent).domain_xml == build_domain(domain, gpu_vmi(1), env).domain_xml


def test_a_domain_with_its_own_override_keeps_it_and_gets_the_devices_in_it(sys_dir: Path) -> None:
    own = (
        '\t<qemu:override>\n\t\t<qemu:device alias="ua-data0">\n\t\t\t<qemu:frontend>\n\t\t\t\t<qemu:property '
        'name="rotation_rate" type="unsigned" value="1"></qemu:property>\n\t\t\t</qemu:frontend>\n\t\t</qemu:device>\n'
        '\t\t<qemu:device alias="ua-other">\n\t\t\t<qemu:frontend>\n\t\t\t\t<qemu:property '
        f'name="{CLIQUE_PROPERTY}" type="unsigned" value="0"></qemu:property>\n\t\t\t</qemu:frontend>\n'
        "\t\t</qemu:device>\n\t</qemu:override>\n"
    )
    domain = kubevirt_sized_domain().replace(b"</domain>", own.encode() + b"</domain>")
    assert domain.count(b"<qemu:override>") == 1
    result = build_domain(domain, gpu_vmi(3), {CARD_VARIABLE: ",".join(GPUS)}, _options(sys_dir)).domain_xml
    assert result.count(b"<qemu:override>") == 1  # one element, theirs, with our devices added
    assert _cliques(result) == {"ua-other": "0", "ua-gpu0": "1", "ua-gpu1": "1"}  # their number is theirs
    root = etree.fromstring(result)
    (override,) = root.iterchildren(f"{{{QEMU_NS}}}override")
    assert [device.get("alias") for device in override] == ["ua-data0", "ua-other", "ua-gpu0", "ua-gpu1"]


def test_whether_gpus_share_a_switch_is_kept_for_the_same_places_only() -> None:
    shared = [
        _place("0000:00:01.0", "0000:01:00.0", "0000:02:08.0"),
        _place("0000:00:01.0", "0000:01:00.0", "0000:02:10.0"),
    ]
    apart = [_place("0000:00:01.0", "0000:01:00.0", "0000:02:08.0"), _place("0000:00:03.0")]
    assert _shared_switches(shared) and _shared_switches(list(shared))
    assert not _shared_switches(apart) and not _shared_switches(
        [shared[0], _place("0000:00:01.0", "0000:01:00.0", "0000:02:10.0", gpu=False)]
    )
    for n in range(GROUPS_KEPT + 1):  # bounded, and the answers stay right
        assert not _shared_switches(
            [_place(f"0000:00:{n + 1:02x}.0"), _place("0000:00:01.0", "0000:01:00.0", "0000:02:08.0")]
        )
    assert len(_groups) <= GROUPS_KEPT and _shared_switches(shared)


@pytest.mark.parametrize("declared", [True, False], ids=["xmlns-on-root", "no-xmlns"])
def test_the_tree_path_and_the_splice_write_the_same_cliques(sys_dir: Path, declared: bool) -> None:
    """A comment in the domain makes the writer serialise the tree; a root without ``xmlns:qemu`` gets the
    declaration on the new element. Either way libvirt reads the same cliques."""
    domain = kubevirt_sized_domain()
    if not declared:
        domain = re.sub(rb' xmlns:qemu="[^"]*"', b"", domain, count=1)
        domain = re.sub(rb"\t<qemu:commandline>.*</qemu:commandline>\n", b"", domain, flags=re.DOTALL)
        assert b"xmlns:qemu" not in domain and b"qemu:" not in domain
    env = {CARD_VARIABLE: ",".join(GPUS)}
    spliced = build_domain(domain, gpu_vmi(3), env, _options(sys_dir)).domain_xml
    commented = domain.replace(b"<devices>", b"<!-- kept --><devices>", 1)
    tree = build_domain(commented, gpu_vmi(3), env, _options(sys_dir)).domain_xml
    assert b"<!-- kept -->" in tree
    for written in (spliced, tree):
        assert _cliques(written) == {"ua-gpu0": "0", "ua-gpu1": "0"}
        libvirt_verdict(written)
        assert f'"{CLIQUE_PROPERTY}":0' in qemu_argv(written)


def test_xmlgen_render_names_the_cliques(sys_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "domain.xml").write_bytes(kubevirt_sized_domain())
    (tmp_path / "vmi.json").write_bytes(gpu_vmi(3))
    (tmp_path / "environ").write_text(f"{CARD_VARIABLE}={','.join(GPUS)}\n")
    args = ["render", "--domain", str(tmp_path / "domain.xml"), "--vmi", str(tmp_path / "vmi.json")]
    args += ["--environ-file", str(tmp_path / "environ"), "--sysfs-root", str(sys_dir)]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "gpudirect clique 0: ua-gpu0, ua-gpu1 (below host switch 0000:01:00.0)" in result.stderr
    assert _cliques(result.stdout_bytes) == {"ua-gpu0": "0", "ua-gpu1": "0"}


def test_an_alias_with_markup_characters_is_written_escaped(sys_dir: Path) -> None:
    """virt-launcher's aliases are ``ua-gpu-<the VMI entry's name>``; whatever the domain holds, the override is
    well-formed and names the GPUs by the aliases their hostdevs have in the output."""
    domain = rendered_domain(PAIR).replace(b'"ua-gpu-gpu0"', b'"ua-gpu-a&amp;b&quot;&lt;c"')
    result = build_domain(domain, gpu_vmi(2), {CARD_VARIABLE: ",".join(PAIR)}, _options(sys_dir)).domain_xml
    root = etree.fromstring(result)
    aliases = [str(alias.get("name")) for alias in root.iterfind("devices/hostdev/alias")]
    assert sorted(_cliques(result)) == sorted(aliases) and len(aliases) == 2
    assert _device_texts("q", [Clique(0, PciAddress.parse(PAIR[0]), ('a&b"<c',))], "", "", False).startswith(
        '<q:device alias="a&amp;b&quot;&lt;c">'
    )
