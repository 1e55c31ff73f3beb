"""Fuzzing every input the project takes from outside (issue 7): never a crash, never output on error, never a
partial document.

Targets: the PCI address parser, the env/pool parser and ``parse_environ``, the VMI model (``parse_vmi``), the
domain splicer/builder, and the hook's gRPC surface (all three versions, over a real unix socket). Inputs:
random bytes, mutated and generated KubeVirt-shaped documents, and a fixed list of hostile ones (over the 8 MiB
cap, deep nesting, entity expansion, external and parameter entities, invalid UTF-8, BOMs, NULs).

What "correct" means here:
- the parsers and the builder either return or raise ``InputError``; any other exception is a bug;
- the gRPC surface answers OK or ``INVALID_ARGUMENT`` (whose message fits a status: ≤ 512 characters), never
  ``INTERNAL``, a transport error or a dead server; an error carries no ``domainXML``;
- a success is a whole domain: it parses as ``<domain>``, holds exactly the GPUs the allocation gives, once,
  and everything that is not one of those hostdevs is what the input had.

Example counts come from the ``soak`` fixture: short by default, many more under ``--soak`` (``make soak``).
The coverage-guided counterpart is ``tests/fuzz_atheris.py`` (``make fuzz``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from lxml import etree

from launcher_hook import build_domain
from launcher_hook.allocation import allocation_from_env, is_allocation_variable, parse_environ, parse_pool
from launcher_hook.domain import hostdev_source_key, parse_domain
from launcher_hook.server import MAX_MESSAGE_BYTES
from launcher_hook.service import HookService
from launcher_hook.sources import PodIdentity, PodResourcesSource, ProcessEnvSource
from runtime.hook_api import HOOK_API_VERSIONS
from runtime.status import MAX_STATUS_MESSAGE
from schemas import InputError, PciAddress, parse_mdev_uuid
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from schemas.vmi import MAX_JSON_DEPTH, VirtualMachineInstance, parse_vmi
from simkit.podresources_standin import FakeKubelet, fake_kubelet
from tests.conftest import scaled
from tests.hook_support import (
    RTX,
    RTX_VAR,
    SEED_PCI,
    launcher_pod,
    running_hook,
    seed_case,
    short_dir,
    unix_channel,
)

SEED_DOMAIN, SEED_VMI, SEED_ENV = seed_case()
SEED_SOURCES = {("pci", address) for address in SEED_PCI.values()}
MIB = 1024 * 1024
pytestmark = pytest.mark.soak  # make soak runs these with many more examples


def fuzz_settings(soak: bool, short: int, full: int) -> settings:
    """``short`` examples in the default run, ``full`` under ``--soak``; no deadline (2 shared cores)."""
    return settings(
        max_examples=scaled(full, soak, short),
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


def run_fuzz(check: Callable[[], None]) -> None:
    """Run a ``@given`` test and print how many examples it ran and how long it took (the figures of
    ``make soak``). Counting goes through ``.hypothesis.inner_test``, the hook hypothesis offers runners."""
    hooks: Any = check.__dict__["hypothesis"]
    inner = hooks.inner_test
    calls = 0

    def counted(*args: Any, **kwargs: Any) -> None:
        nonlocal calls
        calls += 1
        inner(*args, **kwargs)

    hooks.inner_test = counted
    started = time.perf_counter()
    check()
    name = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::")[-1].removesuffix(" (call)")
    print(f"\nfuzz {name}: {calls} examples in {time.perf_counter() - started:.1f} s")
    assert calls > 0


# --- what a success must look like --------------------------------------------------------------------------


def _ours(hostdev: etree._Element, sources: set[tuple[str, str]]) -> bool:
    return hostdev_source_key(hostdev) in sources


def _skeleton(element: etree._Element, drop: Callable[[etree._Element], bool]) -> Any:
    """Everything about ``element`` but layout whitespace and the dropped descendants (whose tail text stays,
    as the builder keeps it), comparable with ==: tag, attributes and content in document order."""
    content: list[Any] = [element.text or ""]
    for child in element:
        if not drop(child):
            content.append(_skeleton(child, drop))
        content.append(child.tail or "")
    merged: list[Any] = []
    for item in content:
        if isinstance(item, str) and merged and isinstance(merged[-1], str):
            merged[-1] += item
        else:
            merged.append(item)
    tag = element.tag if isinstance(element.tag, str) else repr(element.tag)
    # Whitespace is layout (the splicer may move or drop it), so runs of it compare equal.
    items = [" ".join(item.split()) if isinstance(item, str) else item for item in merged]
    return (tag, sorted(element.attrib.items()), [item for item in items if item != ""])


def assert_whole_domain(output: bytes, given_domain: bytes, expected: dict[str, str]) -> None:
    """``output`` parses as a whole ``<domain>`` with exactly the ``expected`` GPUs (alias → PCI address), each
    once, and is otherwise what ``given_domain`` was. A hostdev the given domain already had for one of those
    devices (virt-launcher's) is merged: it may keep its alias instead of the expected one."""
    parsed = parse_domain(output, 4 * DEFAULT_MAX_INPUT_BYTES)
    original = parse_domain(given_domain, 4 * DEFAULT_MAX_INPUT_BYTES).root
    sources = {("pci", address) for address in expected.values()}
    kept_aliases: dict[str, str] = {}
    for hostdev in original.iterfind("devices/hostdev"):
        key, alias = hostdev_source_key(hostdev), hostdev.find("alias")
        if key in sources and alias is not None and key is not None:
            kept_aliases.setdefault(key[1], alias.get("name") or "")
    ours = [hostdev for hostdev in parsed.root.iterfind("devices/hostdev") if _ours(hostdev, sources)]
    got = {}
    for hostdev in ours:
        alias_element = hostdev.find("alias")
        assert alias_element is not None
        got[alias_element.get("name")] = (hostdev_source_key(hostdev) or ("", ""))[1]
    assert sorted(got.values()) == sorted(expected.values())
    for name, address in expected.items():
        assert got.get(name) == address or got.get(kept_aliases.get(address)) == address
    assert len(ours) == len(expected), "a GPU is in the domain twice"

    def ours_in_devices(element: etree._Element) -> bool:
        """Hostdevs of any ``/domain/devices`` that pass one of the expected devices (the builder owns them)."""
        parent = element.getparent()
        return (
            parent is not None
            and parent.tag == "devices"
            and parent.getparent() is not None
            and parent.getparent() is parent.getroottree().getroot()
            and element.tag == "hostdev"
            and _ours(element, sources)
        )

    def dropped_from_output(element: etree._Element) -> bool:
        # A <devices> the builder had to add holds only our hostdevs.
        added = original.find("devices") is None and element.tag == "devices" and element.getparent() is parsed.root
        return added or ours_in_devices(element)

    assert _skeleton(parsed.root, dropped_from_output) == _skeleton(original, ours_in_devices)


def build_or_refuse(domain: bytes | None, vmi: bytes | None, env: dict[str, str]) -> bytes | None:
    """The builder's output, or None when it raised ``InputError`` (with a message); anything else propagates."""
    try:
        result = build_domain(domain, vmi, env)
    except InputError as error:
        message = str(error)
        assert message
        return None
    assert result.domain_xml
    return result.domain_xml


# --- PCI addresses --------------------------------------------------------------------------------------------

hexish = st.text(alphabet="0123456789abcdefABCDEFgxX :.,-", max_size=20)
near_bdf = st.from_regex(r"[0-9a-fA-F]{3,6}:[0-9a-fA-F]{1,3}:[0-9a-fA-F]{1,3}\.[0-9a-fA-F]{1,2}", fullmatch=True)
valid_addresses = st.builds(
    PciAddress, st.integers(0, 0xFFFFF), st.integers(0, 0xFF), st.integers(0, 0x1F), st.integers(0, 7)
)


def parse_or_none(text: str) -> PciAddress | None:
    try:
        return PciAddress.parse(text)
    except InputError as error:
        message = str(error)
        assert repr(text) in message  # the message names the value
        return None


def test_pci_address_parser_accepts_exactly_the_kernel_form(soak: bool) -> None:
    @fuzz_settings(soak, 400, 4_000)
    @given(near_bdf | hexish | st.text(max_size=24))
    @example("0000:86:00.0")
    @example("10000:e1:00.0")
    @example("0000:86:20.0")  # slot above 0x1f
    @example("0000:86:00.8")
    @example("0000:86:00.0\n")  # a trailing newline must not slip through a $-anchored regex
    @example("\u0660\u0660\u0660\u0660:86:00.0")  # Arabic-Indic digits are digits to int(), not hex to the kernel
    def check(text: str) -> None:
        address = parse_or_none(text)
        if address is None:
            return
        domain, bus, rest = text.split(":")
        slot, function = rest.split(".")
        assert len(domain) in (4, 5)
        assert (len(bus), len(slot), len(function)) == (2, 2, 1)
        assert all(char in "0123456789abcdefABCDEF" for char in domain + bus + slot + function)
        assert tuple(address) == (int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16))
        assert PciAddress.parse(str(address)) == address

    run_fuzz(check)


def test_pci_list_fast_path_agrees_with_item_by_item_parsing(soak: bool) -> None:
    @fuzz_settings(soak, 300, 3_000)
    @given(st.lists(near_bdf | valid_addresses.map(str) | hexish, min_size=1, max_size=6))
    def check(items: list[str]) -> None:
        text = ",".join(items)
        fast = PciAddress.parse_list(text)
        one_by_one = [parse_or_none(item) for item in text.split(",")]
        if fast is not None:
            assert fast == one_by_one
        if all(address is not None for address in one_by_one):
            # The fast path may pass over a list (then the caller parses item by item), but never refuses one.
            assert fast is None or fast == one_by_one

    run_fuzz(check)


def test_every_in_range_address_round_trips(soak: bool) -> None:
    @fuzz_settings(soak, 200, 2_000)
    @given(valid_addresses, st.booleans())
    def check(address: PciAddress, upper: bool) -> None:
        text = str(address).upper() if upper else str(address)
        assert PciAddress.parse(text) == address
        assert PciAddress.parse_list(f"{text},{text}") == [address, address]
        attributes = address.libvirt_attributes()
        assert all(value.startswith("0x") for value in attributes.values())

    run_fuzz(check)


# --- allocation env: pools, environ files ---------------------------------------------------------------------

variables = st.sampled_from(
    [RTX_VAR, "PCI_RESOURCE_EXAMPLE_COM_X", "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q", "PATH", "PCI_RESOURCEX"]
)
pool_items = near_bdf | valid_addresses.map(str) | st.uuids().map(str) | hexish | st.just("")


def test_pool_parser_returns_every_listed_id_once_or_refuses_naming_the_variable(soak: bool) -> None:
    @fuzz_settings(soak, 400, 4_000)
    @given(variables, st.lists(pool_items, max_size=6), st.sampled_from(["", ",", ",,"]))
    @example(RTX_VAR, ["0000:86:00.0", "0000:86:00.0"], "")
    @example(RTX_VAR, ["0000:86:00.0", "0000:0086:00.0"], "")
    @example(
        "MDEV_PCI_RESOURCE_X", ["7B7B1E7A-2A34-4A61-9C1E-0B8F1A1B2C3D", "7b7b1e7a-2a34-4a61-9c1e-0b8f1a1b2c3d"], ""
    )
    def check(variable: str, items: list[str], trailer: str) -> None:
        value = ",".join(items) + trailer
        try:
            pool = parse_pool(variable, value)
        except InputError as error:
            message = str(error)
            assert variable in message
            return
        text = value.removesuffix(",")
        listed = text.split(",") if text else []
        assert len(pool.ids) == len(listed) == len(set(pool.ids))
        for item, device_id in zip(listed, pool.ids, strict=True):
            if isinstance(device_id, PciAddress):
                assert PciAddress.parse(item) == device_id
            else:
                assert device_id == parse_mdev_uuid(item) == item.lower()

    run_fuzz(check)


def test_allocation_from_env_keeps_only_allocation_variables(soak: bool) -> None:
    @fuzz_settings(soak, 200, 2_000)
    @given(st.dictionaries(variables | st.text(max_size=12), st.lists(valid_addresses.map(str), max_size=3)))
    def check(env_lists: dict[str, list[str]]) -> None:
        env = {name: ",".join(dict.fromkeys(ids)) for name, ids in env_lists.items()}
        try:
            allocation = allocation_from_env(env)
        except InputError:
            # Only an mdev variable given PCI addresses can be refused here.
            assert any(name.startswith("MDEV_PCI_RESOURCE_") and value for name, value in env.items())
            return
        assert set(allocation.pools) == {name for name in env if is_allocation_variable(name)}

    run_fuzz(check)


env_keys = st.text(alphabet=st.characters(exclude_characters="=\0", exclude_categories=["Cs"]), min_size=1, max_size=12)
env_values = st.text(alphabet=st.characters(exclude_characters="\0", exclude_categories=["Cs"]), max_size=24)
LINE_BREAKS = "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"  # where str.splitlines() breaks
line_keys = (
    st.text(alphabet=st.characters(exclude_characters="=#\0" + LINE_BREAKS, exclude_categories=["Cs"]), max_size=12)
    .map(str.strip)
    .filter(bool)
)
line_values = st.text(
    alphabet=st.characters(exclude_characters="\0" + LINE_BREAKS, exclude_categories=["Cs"]), max_size=24
).map(str.strip)


def test_parse_environ_never_crashes(soak: bool) -> None:
    @fuzz_settings(soak, 400, 4_000)
    @given(st.binary(max_size=512) | st.text(max_size=200).map(str.encode))
    @example(b"\xff\xfeK=V")
    @example(b"=value\0")
    @example(b"A=1\0\0B=2")
    @example(b"\xef\xbb\xbfA=1\n")
    def check(data: bytes) -> None:
        try:
            env = parse_environ(data)
        except InputError as error:
            message = str(error)
            assert message
            return
        assert all(key and "\0" not in key and "\0" not in value for key, value in env.items())

    run_fuzz(check)


def test_parse_environ_reads_back_both_forms(soak: bool) -> None:
    @fuzz_settings(soak, 300, 3_000)
    @given(st.dictionaries(env_keys, env_values, max_size=6), st.dictionaries(line_keys, line_values, max_size=6))
    def check(env: dict[str, str], lines: dict[str, str]) -> None:
        environ = b"".join(f"{key}={value}".encode() + b"\0" for key, value in env.items())
        assert parse_environ(environ) == env  # /proc/<pid>/environ: verbatim
        text = "# a comment\n\n" + "\n".join(f"{key}={value}" for key, value in lines.items()) + "\n"
        assert parse_environ(text.encode()) == lines

    run_fuzz(check)


# --- the VMI model --------------------------------------------------------------------------------------------

vmi_keys = st.sampled_from(
    [
        "spec", "domain", "devices", "gpus", "hostDevices", "name", "deviceName", "virtualGPUOptions",
        "display", "enabled", "ramFB", "kind", "metadata", "namespace", "template", "x", "claimName",
        "requestName", "resourceClaims", "resourceClaimName", "resourceClaimTemplateName",
    ]
)  # fmt: skip
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.sampled_from(["VirtualMachine", RTX, "\ud800", "\udfff", "\x00", "\ufeff"])
)


def _json_containers(children: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.lists(children, max_size=3) | st.dictionaries(vmi_keys, children, max_size=4)


json_values = st.recursive(json_scalars, _json_containers, max_leaves=40)


def vmi_or_none(data: bytes) -> VirtualMachineInstance | None:
    try:
        return parse_vmi(data)
    except InputError as error:
        message = str(error)
        assert message
        return None


BIG_INT = b"1" * 5000


def test_parse_vmi_on_json_shaped_input(soak: bool) -> None:
    @fuzz_settings(soak, 400, 4_000)
    @given(json_values, st.booleans())
    @example({"spec": {"domain": {"devices": {"gpus": [{"name": "\ud800", "deviceName": "\udfff"}]}}}}, False)
    def check(value: Any, as_vm: bool) -> None:
        document = {"kind": "VirtualMachine", "spec": {"template": value}} if as_vm else value
        vmi = vmi_or_none(json.dumps(document).encode())
        if vmi is not None:
            assert isinstance(vmi.spec.domain.devices.gpus, list)

    run_fuzz(check)


def test_parse_vmi_on_random_and_mutated_bytes(soak: bool) -> None:
    @fuzz_settings(soak, 300, 3_000)
    @given(st.binary(max_size=1024) | mutations(SEED_VMI))
    @example(b'{"spec": ' + BIG_INT + b"}")  # regression: ValueError from json.loads escaped as a crash
    @example(b'{"kind": "VirtualMachine", "spec": ' + BIG_INT + b"}")
    @example(b"\xef\xbb\xbf" + SEED_VMI)
    @example(b'{"spec": {}}\x00')
    def check(data: bytes) -> None:
        vmi_or_none(data)

    run_fuzz(check)


def test_integer_literals_past_pythons_limit_are_input_errors() -> None:
    """Regression (fuzz): ``json.loads`` raises a plain ``ValueError`` for a 5000-digit integer; it used to
    escape ``parse_vmi`` and the hook answered INTERNAL."""
    for document in (b'{"spec": ' + BIG_INT + b"}", b'{"metadata": {"x": ' + BIG_INT + b'}, "kind": "VirtualMachine"}'):
        with pytest.raises(InputError, match="VMI JSON"):
            parse_vmi(document)
        with pytest.raises(InputError):
            build_domain(SEED_DOMAIN, document, SEED_ENV)


@pytest.mark.parametrize("depth", [1_000, 100_000, 1_000_000])
def test_deeply_nested_vmi_json_is_refused_quickly(depth: int) -> None:
    for opening, closing in ((b"[", b"]"), (b'{"a":', b"}")):
        document = b'{"spec": {"x": ' + opening * depth + b"1" + closing * depth + b"}}"
        started = time.perf_counter()
        with pytest.raises(InputError, match=r"nested too deeply|not valid JSON|expected shape"):
            parse_vmi(document)
        assert time.perf_counter() - started < 10


def test_the_depth_bound_does_not_rest_on_the_recursion_limit() -> None:
    """cel-python's Environment raises the process's recursion limit to 2500 (found when the DRA tests ran
    first): the VMI's depth bound must hold whatever the limit is, and a real VMI's depth must pass."""
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(5000)
    try:
        for depth in (MAX_JSON_DEPTH + 1, 1_000, 4_000):
            document = b'{"spec": {"x": ' + b"[" * depth + b"1" + b"]" * depth + b"}}"
            with pytest.raises(InputError, match="nested too deeply"):
                parse_vmi(document)
    finally:
        sys.setrecursionlimit(limit)
    inner = MAX_JSON_DEPTH - 2  # the document's own object and "spec" take two levels
    deep_enough = b'{"spec": {"x": ' + b"[" * inner + b'"]{["' + b"]" * inner + b', "y": [' + b"[]," * 300 + b"[]]}}"
    assert parse_vmi(deep_enough) is not None


# --- the domain builder and splicer ---------------------------------------------------------------------------

XML_TOKENS = [
    b"<", b">", b"/>", b"</", b"<devices>", b"</devices>", b"<devices/>", b"<hostdev>", b"</hostdev>", b"<!--",
    b"-->", b"<![CDATA[", b"]]>", b"<?pi x?>", b"&amp;", b"&#60;", b"&lt;", b"&x;", b'"', b"'", b"=", b"\x00",
    b"\xff", b"\xef\xbb\xbf", b"<!DOCTYPE d>", b'<!ENTITY a "b">', b"\n\t", b"ua-gpu0", b"<alias name='ua-gpu1'/>",
    b"<domain>", b"</domain>", b"xmlns:q='u'", b"<q:devices>", b"]]>", b"\r\n",
    b"<hostdev mode='subsystem' type='pci'><source><address domain='0' bus='0x86' slot='0' function='0'/>"
    b"</source></hostdev>",
]  # fmt: skip


@st.composite
def mutations(draw: st.DrawFn, seed: bytes) -> bytes:
    """``seed`` with a few random edits: a token or random bytes inserted, a range deleted or duplicated."""
    data = seed
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["token", "bytes", "delete", "duplicate"]))
        if action == "token":
            data = data[:at] + draw(st.sampled_from(XML_TOKENS)) + data[at:]
        elif action == "bytes":
            data = data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]
        else:
            end = draw(st.integers(at, min(len(data), at + 64)))
            data = data[:at] + data[end:] if action == "delete" else data[:end] + data[at:end] + data[end:]
    return data


SEED_HOSTDEV_FORMS = [
    # virt-launcher's own rendering: type='pci' on the source address, its alias form
    '<hostdev mode="subsystem" type="pci" managed="no"><source><address type="pci" domain="0x0000" bus="0x86" '
    'slot="0x00" function="0x0"></address></source><alias name="ua-gpu-gpu0"></alias></hostdev>',
    # decimal and octal numbers, as libvirt reads them
    "<hostdev mode='subsystem' type='pci'><source><address domain='0' bus='175' slot='00' function='0'/></source>"
    "</hostdev>",
    # someone else's device: must stay untouched
    "<hostdev mode='subsystem' type='pci'><source><address domain='0x0000' bus='0x3b' slot='0x00' function='0x0'/>"
    "</source><alias name='ua-nic0'/></hostdev>",
]


@st.composite
def kubevirt_like_domains(draw: st.DrawFn) -> bytes:
    """A domain shaped like virt-launcher's, varied where the splicer has to decide something."""
    indent = draw(st.sampled_from(["\t", "  ", ""]))
    newline = "\n" if indent else draw(st.sampled_from(["", "\n"]))
    expanded = draw(st.booleans())

    def empty(tag: str, attributes: str = "") -> str:
        return f"<{tag}{attributes}></{tag}>" if expanded else f"<{tag}{attributes}/>"

    def line(depth: int, text: str) -> str:
        return newline + indent * depth + text

    devices_children = draw(
        st.lists(
            st.sampled_from(
                [
                    empty("emulator"),
                    "<graphics type='vnc'>" + empty("listen", " type='socket'") + "</graphics>",
                    "<interface type='ethernet'>" + empty("mac", " address='02:00:00:00:00:01'") + "</interface>",
                    "<!-- a comment with </devices> in it -->",
                    "<![CDATA[</devices>]]>",
                    "<?pi </devices>?>",
                    "<disk type='file'>" + empty("alias", " name='ua-disk0'") + "</disk>",
                    *SEED_HOSTDEV_FORMS,
                ]
            ),
            max_size=6,
        )
    )
    devices_form = draw(st.sampled_from(["children", "self-closing", "absent", "expanded-empty"]))
    if devices_form == "children" and devices_children:
        devices = line(1, "<devices>") + "".join(line(2, child) for child in devices_children) + line(1, "</devices>")
    elif devices_form == "self-closing" or (devices_form == "children" and not devices_children):
        devices = line(1, "<devices/>")
    elif devices_form == "expanded-empty":
        devices = line(1, "<devices></devices>")
    else:
        devices = ""
    extras = draw(
        st.lists(
            st.sampled_from(
                [
                    "<metadata><devices><x></x></devices></metadata>",
                    "<qemu:commandline><qemu:arg value='-x'/></qemu:commandline>",
                    "<!-- before -->",
                    "<description>&lt;/devices&gt; &#x3C;hostdev&#x3E;</description>",
                    "<sysinfo type='smbios'>" + empty("bios") + "</sysinfo>",
                ]
            ),
            max_size=3,
        )
    )
    body = line(1, "<name>fuzz</name>") + "".join(line(1, extra) for extra in extras) + devices
    prolog = draw(st.sampled_from(["", "<?xml version='1.0' encoding='UTF-8'?>\n", "<!-- head -->\n", "\ufeff"]))
    root = "<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>"
    return (prolog + root + body + newline + "</domain>" + draw(st.sampled_from(["", "\n"]))).encode()


def test_builder_on_generated_kubevirt_domains_is_whole_or_refused(soak: bool) -> None:
    @fuzz_settings(soak, 300, 3_000)
    @given(kubevirt_like_domains())
    # Regressions (fuzz): text where the splicer writes indentation was overwritten (the CDATA section lost),
    # and removing a duplicate of a replaced hostdev dropped the text after it.
    @example(
        b"<domain type='kvm'>\n\t<name>fuzz</name>\n\t<devices>\n\t\t<![CDATA[</devices>]]>\n\t</devices>\n</domain>"
    )
    @example(b"<domain type='kvm'>\n\t<devices>\n\t\t<emulator/>text\n\t</devices>\n</domain>")
    @example(
        b"<domain type='kvm'>\n\t<devices>\n\t\t"
        + SEED_HOSTDEV_FORMS[0].encode()
        + b"\n\t\t<emulator/>\n\t\t"
        + SEED_HOSTDEV_FORMS[0].encode()
        + b"\n\t\t<![CDATA[</devices>]]>\n\t</devices>\n</domain>"
    )
    def check(domain: bytes) -> None:
        output = build_or_refuse(domain, SEED_VMI, SEED_ENV)
        if output is None:
            # The only refusals a well-formed domain can get here: a vGPU display without <graphics> does not
            # apply (passthrough), so none at all.
            raise AssertionError(f"a well-formed domain was refused: {domain!r}")
        assert_whole_domain(output, domain, SEED_PCI)
        # Idempotent as a document (layout aside); as bytes from the second build on (a rebuild replaces the
        # hostdevs through the tree, whose serialiser writes attributes double-quoted: "Splicing" in the README).
        again = build_domain(output, SEED_VMI, SEED_ENV).domain_xml
        never = lambda element: False  # noqa: E731
        assert _skeleton(etree.fromstring(again), never) == _skeleton(etree.fromstring(output), never)
        assert build_domain(again, SEED_VMI, SEED_ENV).domain_xml == again

    run_fuzz(check)


def test_builder_on_mutated_and_random_domains_is_whole_or_refused(soak: bool) -> None:
    @fuzz_settings(soak, 400, 4_000)
    @given(mutations(SEED_DOMAIN) | st.binary(max_size=1024), st.booleans())
    def check(domain: bytes, with_vmi: bool) -> None:
        env = SEED_ENV if with_vmi else {RTX_VAR: SEED_ENV[RTX_VAR]}
        output = build_or_refuse(domain, SEED_VMI if with_vmi else None, env)
        if output is not None:
            assert_whole_domain(output, domain, SEED_PCI)

    run_fuzz(check)


# --- hostile documents: the builder and every hook version agree -----------------------------------------------


def _deep_xml(depth: int) -> bytes:
    return b"<domain><devices>" + b"<a>" * depth + b"</a>" * depth + b"</devices></domain>"


LONG_ENTITY = b"A" * 100_000
HOSTILE_DOMAINS: dict[str, bytes] = {
    "billion laughs": b"""<?xml version="1.0"?>
<!DOCTYPE lolz [<!ENTITY lol "lol">"""
    + b"".join(
        f'<!ENTITY lol{n} "{("&lol" + (str(n - 1) if n > 1 else "") + ";") * 10}">'.encode() for n in range(1, 10)
    )
    + b"""]><domain><name>&lol9;</name><devices><emulator/></devices></domain>""",
    "quadratic blowup": b'<!DOCTYPE domain [<!ENTITY a "'
    + LONG_ENTITY
    + b'">]><domain><name>'
    + b"&a;" * 50_000
    + b"</name><devices><emulator/></devices></domain>",
    "undeclared entity used many times": b"<domain><name>" + b"&a;" * 200_000 + b"</name></domain>",
    "external entity": b'<!DOCTYPE domain [<!ENTITY x SYSTEM "file:///etc/passwd">]><domain><name>&x;</name></domain>',
    "external DTD": b'<!DOCTYPE domain SYSTEM "http://127.0.0.1:9/evil.dtd"><domain><devices/></domain>',
    "parameter entity": b'<!DOCTYPE domain [<!ENTITY % p SYSTEM "file:///etc/passwd"> %p;]><domain/>',
    "parameter entity inline": b"<!DOCTYPE domain [<!ENTITY % p \"<!ENTITY x 'y'>\"> %p;]><domain>&x;</domain>",
    "DOCTYPE after a BOM and a comment": b"\xef\xbb\xbf<!-- c --><!DOCTYPE domain []><domain/>",
    "deep nesting 300": _deep_xml(300),
    "deep nesting 100k": _deep_xml(100_000),
    "deep nesting unclosed 1M": b"<domain><devices>" + b"<a>" * 1_000_000,
    "over the cap": SEED_DOMAIN + b" " * (DEFAULT_MAX_INPUT_BYTES + 1 - len(SEED_DOMAIN)),
    "12 MiB": SEED_DOMAIN + b"<!---->" * (12 * MIB // 7),
    "invalid UTF-8 0xff": SEED_DOMAIN.replace(b"cxl_vm", b"cxl\xffvm"),
    "overlong UTF-8": SEED_DOMAIN.replace(b"cxl_vm", b"cxl\xc0\xafvm"),
    "UTF-8 encoded surrogate": SEED_DOMAIN.replace(b"cxl_vm", b"cxl\xed\xa0\x80vm"),
    "above U+10FFFF": SEED_DOMAIN.replace(b"cxl_vm", b"cxl\xf4\x90\x80\x80vm"),
    "truncated UTF-8 at the end": SEED_DOMAIN + b"\xe2\x82",
    "UTF-16 with BOM": SEED_DOMAIN.decode().encode("utf-16"),
    "UTF-16BE": b"\xfe\xff" + SEED_DOMAIN.decode().encode("utf-16-be"),
    "UTF-32 with BOM": SEED_DOMAIN.decode().encode("utf-32"),
    "declares ISO-8859-1": b"<?xml version='1.0' encoding='ISO-8859-1'?>" + SEED_DOMAIN,
    "BOM then declares ISO-8859-1": b"\xef\xbb\xbf<?xml version='1.0' encoding='ISO-8859-1'?>" + SEED_DOMAIN,
    "NUL in text": SEED_DOMAIN.replace(b"cxl_vm", b"cxl\x00vm"),
    "NUL at the end": SEED_DOMAIN + b"\x00",
    "NUL first": b"\x00" + SEED_DOMAIN,
    "character reference to NUL": SEED_DOMAIN.replace(b"cxl_vm", b"cxl&#0;vm"),
    "empty": b"",
    "root is not domain": b"<network><devices><a/></devices></network>",
}
# Inputs that are fine: they must build, whole.
GOOD_DOMAINS: dict[str, bytes] = {
    "UTF-8 BOM": b"\xef\xbb\xbf" + SEED_DOMAIN,
    "BOM and declaration": b"\xef\xbb\xbf<?xml version='1.0' encoding='UTF-8'?>\n" + SEED_DOMAIN,
    "exactly the cap": SEED_DOMAIN + b" " * (DEFAULT_MAX_INPUT_BYTES - len(SEED_DOMAIN)),
    "deep nesting 250": SEED_DOMAIN.replace(b"<devices>", b"<devices>" + b"<a>" * 240 + b"</a>" * 240, 1),
    "XInclude is not expanded": SEED_DOMAIN.replace(
        b"<devices>",
        b"<devices><xi:include xmlns:xi='http://www.w3.org/2001/XInclude' href='/etc/passwd' parse='text'/>",
        1,
    ),
    "character references": SEED_DOMAIN.replace(b"cxl_vm", b"cxl&#x5F;&#60;&amp;vm"),
}
HOSTILE_VMIS: dict[str, bytes] = {
    "over the cap": SEED_VMI + b" " * (DEFAULT_MAX_INPUT_BYTES + 1 - len(SEED_VMI)),
    "deep arrays": b'{"spec": ' + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}",
    "deep objects": b'{"spec": {"domain": ' + b'{"a":' * 200_000 + b"1" + b"}" * 200_000 + b"}}",
    "integer past 4300 digits": b'{"spec": ' + BIG_INT + b"}",
    "invalid UTF-8": SEED_VMI.replace(b"vm-with-gpu", b"vm\xffwith"),
    "UTF-16": SEED_VMI.decode().encode("utf-16"),
    "raw NUL": SEED_VMI.replace(b"vm-with-gpu", b"vm\x00with"),
    "NaN": b'{"spec": NaN}',
    "lone surrogates in the names": b'{"spec": {"domain": {"devices": {"gpus": [{"name": "\\ud800", '
    b'"deviceName": "\\udfff/x"}]}}}}',
    "100k invalid GPUs (a huge error)": json.dumps(
        {"spec": {"domain": {"devices": {"gpus": [{"name": 1}] * 100_000}}}}
    ).encode(),
    "a GPU name of 1 MiB": json.dumps(
        {"spec": {"domain": {"devices": {"gpus": [{"name": "g" * MIB, "deviceName": "example.com/none"}]}}}}
    ).encode(),
    "not an object": b"[]",
    "a VirtualMachine without a template": b'{"kind": "VirtualMachine", "spec": {}}',
}
GOOD_VMIS: dict[str, bytes] = {
    "UTF-8 BOM": b"\xef\xbb\xbf" + SEED_VMI,  # fine, as for domains (README, Input limits)
    "NUL escaped in a string": SEED_VMI.replace(b'"vm-with-gpu"', b'"vm\\u0000with"', 1),
    "exactly the cap": SEED_VMI + b" " * (DEFAULT_MAX_INPUT_BYTES - len(SEED_VMI)),
    "as a VirtualMachine": json.dumps(
        {"kind": "VirtualMachine", "metadata": {"name": "v"}, "spec": {"template": json.loads(SEED_VMI)}}
    ).encode(),
}


@pytest.mark.parametrize("name", sorted(HOSTILE_DOMAINS))
def test_hostile_domain_is_refused_by_the_builder_quickly(name: str) -> None:
    started = time.perf_counter()
    with pytest.raises(InputError) as caught:
        build_domain(HOSTILE_DOMAINS[name], SEED_VMI, SEED_ENV)
    assert time.perf_counter() - started < 10
    message = str(caught.value)
    assert "root:x:" not in message  # nothing of /etc/passwd, ever


@pytest.mark.parametrize("name", sorted(GOOD_DOMAINS))
def test_odd_but_good_domain_builds_whole(name: str) -> None:
    domain = GOOD_DOMAINS[name]
    output = build_domain(domain, SEED_VMI, SEED_ENV).domain_xml
    assert_whole_domain(output, domain, SEED_PCI)
    assert b"root:x:" not in output


@pytest.mark.parametrize("name", sorted(HOSTILE_VMIS))
def test_hostile_vmi_is_refused_by_the_builder_quickly(name: str) -> None:
    started = time.perf_counter()
    with pytest.raises(InputError):
        build_domain(SEED_DOMAIN, HOSTILE_VMIS[name], SEED_ENV)
    assert time.perf_counter() - started < 10


@pytest.mark.parametrize("name", sorted(GOOD_VMIS))
def test_odd_but_good_vmi_builds_whole(name: str) -> None:
    output = build_domain(SEED_DOMAIN, GOOD_VMIS[name], SEED_ENV).domain_xml
    assert_whole_domain(output, SEED_DOMAIN, SEED_PCI)


# --- the hook's gRPC surface ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hook_socket() -> Iterator[Path]:
    with short_dir() as directory:
        socket_path = directory / "gpu-hostdev.sock"
        with running_hook(HookService(ProcessEnvSource(SEED_ENV)), socket_path):
            yield socket_path


@pytest.fixture(scope="module")
def channel(hook_socket: Path) -> Iterator[grpc.Channel]:
    # No client-side limits: the answer to an 8 MiB domain is over gRPC's 4 MiB default receive limit.
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    channel = grpc.insecure_channel(f"unix:{hook_socket}", options=options)
    try:
        yield channel
    finally:
        channel.close()


def call(channel: grpc.Channel, version: str, domain: bytes, vmi: bytes) -> tuple[bytes | None, grpc.StatusCode, str]:
    """OnDefineDomain as virt-launcher calls it: (domainXML or None on error, status code, status message)."""
    pb2, pb2_grpc = HOOK_API_VERSIONS[version]
    try:
        response, outcome = pb2_grpc.CallbacksStub(channel).OnDefineDomain.with_call(
            pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60
        )
    except grpc.RpcError as error:
        failed = error
    else:
        return response.domainXML, outcome.code(), outcome.details() or ""
    assert isinstance(failed, grpc.Call)
    return None, failed.code(), failed.details() or ""


def assert_answer(answer: tuple[bytes | None, grpc.StatusCode, str], domain: bytes, good: bool | None) -> None:
    """OK with a whole domain, or INVALID_ARGUMENT with a short message and no domain; ``good`` forces one."""
    output, code, details = answer
    if code is grpc.StatusCode.OK:
        assert good is not False, f"accepted: {details}"
        assert output is not None
        assert_whole_domain(output, domain, SEED_PCI)
    else:
        assert good is not True, f"refused: {code} {details}"
        assert code is grpc.StatusCode.INVALID_ARGUMENT, f"{code}: {details[:300]}"
        assert output is None
        assert 0 < len(details) <= MAX_STATUS_MESSAGE
        assert "root:x:" not in details


def test_hook_on_random_bytes_and_mutations_all_versions(channel: grpc.Channel, soak: bool) -> None:
    @fuzz_settings(soak, 150, 1_500)
    @given(
        st.sampled_from(sorted(HOOK_API_VERSIONS)),
        st.binary(max_size=512) | mutations(SEED_DOMAIN) | st.just(SEED_DOMAIN),
        st.binary(max_size=512) | mutations(SEED_VMI) | st.just(SEED_VMI),
    )
    def check(version: str, domain: bytes, vmi: bytes) -> None:
        # The builder called directly decides: its output byte for byte, or INVALID_ARGUMENT.
        try:
            direct = build_domain(domain, vmi, SEED_ENV)
        except InputError:
            assert_answer(call(channel, version, domain, vmi), domain, False)
            return
        answer = call(channel, version, domain, vmi)
        assert answer == (direct.domain_xml, grpc.StatusCode.OK, "")
        assert_whole_domain(direct.domain_xml, domain, direct.aliases)

    run_fuzz(check)


def test_hook_on_generated_kubevirt_domains_all_versions(channel: grpc.Channel, soak: bool) -> None:
    @fuzz_settings(soak, 100, 1_000)
    @given(st.sampled_from(sorted(HOOK_API_VERSIONS)), kubevirt_like_domains())
    def check(version: str, domain: bytes) -> None:
        assert_answer(call(channel, version, domain, SEED_VMI), domain, True)

    run_fuzz(check)


def test_hook_reading_pod_resources_on_random_vmis(soak: bool) -> None:
    """With the PodResources source the hook finds its own pod, and a VMI naming another pod is refused before the
    builder reads it: still only OK, INVALID_ARGUMENT or FAILED_PRECONDITION (not our pod), with a short message."""
    with short_dir() as directory:
        kubelet = FakeKubelet([launcher_pod(list(SEED_PCI.values()))])
        with fake_kubelet(kubelet, directory / "kubelet.sock") as kubelet_socket:
            source = PodResourcesSource(kubelet_socket, identity=PodIdentity(hostname="vm-with-gpu", namespace="cxl"))
            hook = directory / "hook.sock"
            with running_hook(HookService(source), hook), unix_channel(hook) as channel:

                @fuzz_settings(soak, 100, 1_000)
                @given(
                    st.sampled_from(sorted(HOOK_API_VERSIONS)),
                    mutations(SEED_VMI) | st.binary(max_size=256) | json_values.map(json.dumps).map(str.encode),
                )
                @example("v1alpha3", SEED_VMI)
                @example("v1alpha1", SEED_VMI.replace(b'"devices"', b'"<devices"', 1))  # a VMI without GPUs
                @example("v1alpha2", SEED_VMI.replace(b'"vm-with-gpu"', b'"vm-\\ud800"', 1))
                def check(version: str, vmi: bytes) -> None:
                    output, code, details = call(channel, version, SEED_DOMAIN, vmi)
                    if code is grpc.StatusCode.OK:
                        # What the kubelet reports turns into the env the builder would get in compute.
                        direct = build_domain(SEED_DOMAIN, vmi, {RTX_VAR: ",".join(SEED_PCI.values())})
                        assert output == direct.domain_xml
                        assert_whole_domain(output, SEED_DOMAIN, direct.aliases)
                        return
                    assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION), details
                    assert output is None
                    assert 0 < len(details) <= MAX_STATUS_MESSAGE

                run_fuzz(check)
            source.close()
    assert "List" in kubelet.calls


@pytest.mark.parametrize("version", sorted(HOOK_API_VERSIONS))
def test_hook_refuses_every_hostile_input_with_invalid_argument(channel: grpc.Channel, version: str) -> None:
    for name, domain in HOSTILE_DOMAINS.items():
        started = time.perf_counter()
        assert_answer(call(channel, version, domain, SEED_VMI), domain, False)
        assert time.perf_counter() - started < 20, name
    for name, vmi in HOSTILE_VMIS.items():
        started = time.perf_counter()
        assert_answer(call(channel, version, SEED_DOMAIN, vmi), SEED_DOMAIN, False)
        assert time.perf_counter() - started < 20, name
    for domain in GOOD_DOMAINS.values():
        assert_answer(call(channel, version, domain, SEED_VMI), domain, True)
    for vmi in GOOD_VMIS.values():
        assert_answer(call(channel, version, SEED_DOMAIN, vmi), SEED_DOMAIN, True)


def test_hook_both_documents_over_the_cap_in_one_message_is_invalid_argument(channel: grpc.Channel) -> None:
    """Both just over 8 MiB: within the server's 16 MiB + 64 KiB message limit, so the builder's 8 MiB cap
    answers."""
    domain = SEED_DOMAIN + b" " * (8 * MIB)
    vmi = SEED_VMI + b" " * (8 * MIB)
    assert len(domain) + len(vmi) < MAX_MESSAGE_BYTES
    output, code, details = call(channel, "v1alpha3", domain, vmi)
    assert (output, code) == (None, grpc.StatusCode.INVALID_ARGUMENT)
    assert "over the 8388608-byte limit" in details


def test_a_message_over_grpcs_limit_is_refused_by_grpc_and_the_hook_keeps_serving(channel: grpc.Channel) -> None:
    """Above 16 MiB + 64 KiB gRPC itself refuses the message (RESOURCE_EXHAUSTED) before the hook sees it; documented in
    the README. The server is unharmed."""
    output, code, details = call(channel, "v1alpha3", SEED_DOMAIN + b" " * MAX_MESSAGE_BYTES, SEED_VMI)
    assert (output, code) == (None, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert "larger than max" in details
    assert_answer(call(channel, "v1alpha3", SEED_DOMAIN, SEED_VMI), SEED_DOMAIN, True)


def test_a_huge_error_message_is_cut_to_fit_a_status(channel: grpc.Channel) -> None:
    """Regression (fuzz): 100k invalid GPUs made a 1.3 MB message; gRPC clients drop trailers over 16 KiB, so
    virt-launcher saw RESOURCE_EXHAUSTED 'metadata size exceeds hard limit' instead of the refusal."""
    output, code, details = call(channel, "v1alpha3", SEED_DOMAIN, HOSTILE_VMIS["100k invalid GPUs (a huge error)"])
    assert (output, code) == (None, grpc.StatusCode.INVALID_ARGUMENT)
    assert len(details) == MAX_STATUS_MESSAGE
    assert details.startswith("VMI JSON does not have the expected shape: spec.domain.devices.gpus.0.name")
    assert details.endswith("...")


def test_lone_surrogates_in_a_vmi_reach_the_status_escaped(channel: grpc.Channel) -> None:
    """Regression (fuzz): a message holding a lone surrogate (from ``"\\ud800"`` in the VMI) cannot be encoded
    as UTF-8; gRPC replaced it with 'Exception calling application: ...'. Now it is written escaped."""
    output, code, details = call(channel, "v1alpha2", SEED_DOMAIN, HOSTILE_VMIS["lone surrogates in the names"])
    assert (output, code) == (None, grpc.StatusCode.INVALID_ARGUMENT)
    assert "no allocation variable found" in details
    assert "\\ud800" in details
    assert "Exception calling application" not in details


def test_the_server_survives_the_whole_fuzz_run(hook_socket: Path) -> None:
    with unix_channel(hook_socket) as fresh:
        assert_answer(call(fresh, "v1alpha1", SEED_DOMAIN, SEED_VMI), SEED_DOMAIN, True)
