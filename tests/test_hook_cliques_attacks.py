"""Attacks on the GPUDirect clique pass (launcher_hook/cliques.py, docs/p2p.md), each a problem a review found
and the fix: the domain's own clique values read as libvirt reads them (base 10, the last of an alias), an EFI
domain without the QEMU namespace and with a comment getting both its window and its cliques, an existing
``<qemu:override>`` extended by a splice that leaves every other byte. libvirt's QEMU driver judges the cliques."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from lxml import etree

from bench.workloads import CARD_VARIABLE, gpu_vmi, kubevirt_sized_domain
from launcher_hook import BuildOptions, build_domain
from launcher_hook.cliques import CLIQUE_PROPERTY, plan_cliques
from launcher_hook.hostdev import HostdevSpec
from runtime.pci_topology import SysfsTopology
from schemas import PciAddress, ResourceKind
from schemas.pci_topology import PciPlace
from simkit.fixture_nodes import WORKSTATION_NODE
from simkit.sysfs_fixture import build
from tests.libvirt_support import qemu_argv
from tests.test_mmio_window import EFI_DOMAIN, a100s

PAIR = ["0000:03:00.0", "0000:04:00.0"]
ALONE = "0000:05:00.0"
GPUS = [*PAIR, ALONE]
ENV = {CARD_VARIABLE: ",".join(GPUS)}
QEMU_XMLNS = b' xmlns:qemu="http://libvirt.org/schemas/domain/qemu/1.0"'


@pytest.fixture(scope="module")
def sys_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ws-attack")
    build(WORKSTATION_NODE, root)
    return root / "sys"


def _clique_device(alias: str, value: str) -> str:
    return (
        f'<qemu:device alias="{alias}"><qemu:frontend><qemu:property name="{CLIQUE_PROPERTY}" type="unsigned" '
        f'value="{value}"></qemu:property></qemu:frontend></qemu:device>'
    )


def _with_override(domain: bytes, body: str) -> bytes:
    return domain.replace(b"</domain>", f"\t<qemu:override>{body}</qemu:override>\n</domain>".encode())


def _argv_cliques(domain: bytes) -> dict[str, str | None]:
    """alias → the clique QEMU gets on that vfio-pci device (libvirt's QEMU driver), None: none."""
    argv = qemu_argv(domain)
    found: dict[str, str | None] = {}
    for device in re.finditer(r'\{"driver":"vfio-pci"[^}]*"id":"([^"]+)"[^}]*\}', argv):
        values = re.findall(rf'"{CLIQUE_PROPERTY}":(\d+)', device.group(0))
        found[device.group(1)] = values[-1] if values else None
    return found


def _spec(alias: str, address: str) -> HostdevSpec:
    return HostdevSpec(ResourceKind.PCI, PciAddress.parse(address), alias, CARD_VARIABLE)


def _place(*bridges: str) -> PciPlace:
    return PciPlace(tuple(PciAddress.parse(bridge) for bridge in bridges), True)


# ---- 1. a kept clique number written with a leading zero -------------------------------------------------


def test_a_kept_clique_with_a_leading_zero_is_taken_as_libvirt_reads_it() -> None:
    """libvirt (9.0) reads an ``unsigned`` override value in base 10: ``01`` is 1 (and ``0x1`` is refused).
    ``_number`` uses ``int(value, 0)``, for which ``01`` is a ValueError, so 1 is not counted as taken."""
    specs = [_spec("ua-gpu0", PAIR[0]), _spec("ua-gpu1", PAIR[1])]
    places = [
        _place("0000:00:01.0", "0000:01:00.0", "0000:02:08.0"),
        _place("0000:00:01.0", "0000:01:00.0", "0000:02:10.0"),
    ]
    cliques, _ = plan_cliques(specs, places, {"ua-x": "0", "ua-gpu2": "01"})
    assert [c.number for c in cliques] != [1], "clique 1 is the domain's own (libvirt reads '01' as 1)"


def test_a_gpu_the_domain_puts_in_clique_01_does_not_end_up_in_the_pairs_clique(sys_dir: Path) -> None:
    """End to end: the domain gives the lone GPU ua-gpu2 clique ``01`` (libvirt: 1) and another device 0; the
    hook gives the switch pair 1, so QEMU puts the lone GPU (on a root port of its own) in the pair's clique."""
    domain = _with_override(kubevirt_sized_domain(), _clique_device("ua-x", "0") + _clique_device("ua-gpu2", "01"))
    out = build_domain(domain, gpu_vmi(3), ENV, BuildOptions(topology=SysfsTopology(sys_dir))).domain_xml
    got = _argv_cliques(out)
    assert got["ua-gpu0"] == got["ua-gpu1"] is not None
    assert got["ua-gpu2"] != got["ua-gpu0"], f"the lone GPU joined the pair's clique in QEMU: {got}"


# ---- 2. an alias the domain's override names twice --------------------------------------------------------


def test_a_clique_the_domain_sets_twice_for_one_alias_counts_the_value_libvirt_applies(sys_dir: Path) -> None:
    """libvirt applies every ``<qemu:device>`` of an alias in order (the last value wins on ``-device``);
    ``existing_cliques`` keeps the first (``setdefault``), so the number QEMU really gets is given out again."""
    body = _clique_device("ua-gpu2", "1") + _clique_device("ua-gpu2", "0")
    domain = _with_override(kubevirt_sized_domain(), body)
    out = build_domain(domain, gpu_vmi(3), ENV, BuildOptions(topology=SysfsTopology(sys_dir))).domain_xml
    got = _argv_cliques(out)
    assert got["ua-gpu0"] == got["ua-gpu1"] is not None
    assert got["ua-gpu2"] != got["ua-gpu0"], f"the lone GPU joined the pair's clique in QEMU: {got}"


# ---- 3. with the 64-bit MMIO window: tree path, no xmlns:qemu on the root ---------------------------------


@pytest.mark.parametrize("root_binding", [b"", b' xmlns:qemu="urn:other"'], ids=["no-xmlns", "qemu-is-other-uri"])
def test_an_efi_domain_without_the_qemu_namespace_and_with_a_comment_gets_cliques_and_its_window(
    sys_dir: Path, root_binding: bytes
) -> None:
    """An EFI domain whose GPUs have big BARs and share a switch, whose root does not bind libvirt's QEMU
    namespace, with a comment (the writer serialises the tree): the window pass re-parses the serialised output
    with ``max_bytes=len(written)`` after adding a namespace declaration to it, so the call fails with
    "domain XML is N bytes, over the N-byte limit", a limit the input never exceeded. (The window pass alone fails
    the same way: the bug is in ``mmio_window._args_into_tree``, but a clique domain reaches it too.)"""
    domain = re.sub(rb"\t<qemu:commandline>.*</qemu:commandline>\n", b"", EFI_DOMAIN, flags=re.DOTALL)
    domain = domain.replace(QEMU_XMLNS, root_binding).replace(b"<devices>", b"<!-- kept --><devices>", 1)
    options = BuildOptions(topology=SysfsTopology(sys_dir), bars=a100s(*GPUS))
    out = build_domain(domain, None, ENV, options).domain_xml
    assert b"<!-- kept -->" in out and b"X-PciMmio64Mb" in out
    got = _argv_cliques(out)
    assert got["ua-gpu0"] == got["ua-gpu1"] == "0"


# ---- 4. an existing <qemu:override> re-serialises the whole domain ---------------------------------------


def test_an_existing_override_leaves_every_other_byte_of_a_virsh_style_domain(sys_dir: Path) -> None:
    """A domain in ``virsh dumpxml`` style (single-quoted attributes) that already has a ``<qemu:override>``:
    the pass goes to the tree path and the writer re-serialises the whole document, so every attribute of the
    domain is rewritten with double quotes (218 lines differ from the output without the pass), although the
    place to add the devices (before the override's end tag) is unambiguous in the bytes, as the window pass
    finds the end of an existing ``<qemu:commandline>``."""
    own = _clique_device("ua-x", "5").replace('"', "'")
    domain = re.sub(rb'="([^"]*)"', rb"='\1'", kubevirt_sized_domain())
    domain = domain.replace(b"</domain>", f"\t<qemu:override>{own}</qemu:override>\n</domain>".encode())
    with_pass = build_domain(domain, gpu_vmi(3), ENV, BuildOptions(topology=SysfsTopology(sys_dir))).domain_xml
    without = build_domain(domain, gpu_vmi(3), ENV).domain_xml
    cut = without.index(b"\t<qemu:override>")
    assert with_pass[:cut] == without[:cut], "bytes before the override were rewritten"
    assert etree.fromstring(with_pass) is not None
