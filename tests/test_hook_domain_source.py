"""The allocation read from the domain virt-launcher sends: what a non-root hook sidecar can read.

KubeVirt runs the hook sidecars of a non-root VMI (its default) as uid 107 with every capability dropped; the
kubelet keeps its PodResources socket root's (``/var/lib/kubelet/pod-resources`` 0750, ``kubelet.sock`` 0755), so
such a sidecar cannot connect to it (a real Kubernetes 1.36 node answered every call FAILED_PRECONDITION,
"Permission denied"). virt-launcher has already rendered every ``gpus[]``/``hostDevices[]`` entry's device into
the domain (alias ``ua-gpu-<name>``/``ua-hostdevice-<name>``) from its own env, so the hook reads them there.

Here: the source reads each entry's device by its alias into the variables compute's env holds; the domain
source gives the env path's domain, byte for byte, for the repository's cases (``tests/launcher_render_support``
renders virt-launcher's hostdevs into the examples, as KubeVirt v1.9 does); a sidecar run as a non-root uid
against a kubelet socket it cannot reach fails with an error saying why, and without a source option it reads the
domain, companions from sysfs included; errors name the entry; the CLI's precedence.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher_hook import BuildOptions
from launcher_hook.allocation import parse_environ
from launcher_hook.cli import make_source
from launcher_hook.domain import parse_domain
from launcher_hook.service import HookFault, HookService
from launcher_hook.sources import (
    DomainSource,
    EnvironFileSource,
    PodResourcesSource,
    ProcessEnvSource,
    SourceUnavailable,
    env_from_domain,
)
from plugin.allocation import allocate
from plugin.config import PluginConfig
from plugin.sysfs import scan
from runtime.pci_companions import SysfsCompanions
from runtime.pciids import PciIds
from schemas import InputError
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from schemas.vmi import parse_vmi
from simkit.fixture_nodes import NODE01
from simkit.podresources_standin import FakeKubelet, fake_kubelet
from simkit.sysfs_fixture import build
from tests.conftest import FIXTURES
from tests.hook_support import (
    EXAMPLE,
    RTX,
    RTX_VAR,
    STARTED,
    launcher_pod,
    seed_case,
    short_dir,
    unix_channel,
    wait_for_socket,
)
from tests.launcher_render_support import virt_launcher_domain
from tests.test_golden import _options
from tests.test_hook_cli import clean_env, finish, program

GPUS = ["0000:86:00.0", "0000:af:00.0"]
UUID_A = "4b20d080-1b54-4048-85b3-a6a62d165c01"
UUID_B = "7b7b1e7a-2a34-4a61-9c1e-0b8f1a1b2c3d"
NON_ROOT_UID = 107
"""KubeVirt's ``util.NonRootUID``: the uid of a non-root VMI's pod, its hook sidecars included."""


@pytest.fixture
def directory() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def _vmi(gpus: list[dict[str, Any]], host_devices: list[dict[str, Any]] | None = None) -> bytes:
    devices: dict[str, Any] = {"gpus": gpus, "hostDevices": host_devices or []}
    return json.dumps(
        {"metadata": {"name": "vm", "namespace": "ns"}, "spec": {"domain": {"devices": devices}}}
    ).encode()


def _from_domain(domain: bytes, vmi: bytes) -> dict[str, str]:
    return env_from_domain(parse_vmi(vmi), parse_domain(domain, DEFAULT_MAX_INPUT_BYTES))


# --- what the source reads --------------------------------------------------------------------------------------


def test_each_entrys_device_is_read_by_its_alias_into_the_variable_virt_launcher_read() -> None:
    domain, _, _ = seed_case()
    vmi = _vmi(
        [
            {"name": "b", "deviceName": RTX},
            {"name": "a", "deviceName": RTX},
            {"name": "v", "deviceName": "nvidia.com/GRID_T4-1Q"},
            {"name": "dra", "claimName": "c", "requestName": "r"},
        ],
        [{"name": "nvme", "deviceName": "example.com/nvme.fast"}, {"name": "stick", "deviceName": "kubevirt.io/usb"}],
    )
    env = {
        RTX_VAR: "0000:AF:00.0,0000:86:00.0",  # the kubelet's order, virt-launcher's hex case
        "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q": UUID_A.upper(),
        "PCI_RESOURCE_EXAMPLE_COM_NVME_FAST": "0000:d8:00.0,",
    }
    rendered = virt_launcher_domain(domain, vmi, env).decode()
    usb = (
        '<hostdev type="usb" mode="subsystem"><source><address bus="001" device="002"></address></source>'
        '<alias name="ua-usb-host-stick"></alias></hostdev>'
    )
    rendered = rendered.replace("\t</devices>", f"\t\t{usb}\n\t</devices>")
    assert _from_domain(rendered.encode(), vmi) == {
        RTX_VAR: "0000:af:00.0,0000:86:00.0",  # entry order: b got af (the first in the env), a got 86
        "MDEV_PCI_RESOURCE_NVIDIA_COM_GRID_T4-1Q": UUID_A,
        "PCI_RESOURCE_EXAMPLE_COM_NVME_FAST": "0000:d8:00.0",
    }


def test_the_source_is_read_as_libvirt_reads_it_and_the_hooks_own_aliases_count() -> None:
    """C-style numbers (``bus='134'`` is 0x86), and a domain the hook already wrote (``ua-gpuN``, after
    ``--force-gpu-aliases``) reads the same."""
    domain, _, _ = seed_case()
    vmi = _vmi([{"name": "g0", "deviceName": RTX}, {"name": "g1", "deviceName": RTX}])
    hostdevs = (
        '<hostdev type="pci" managed="no"><source><address domain="0" bus="134" slot="0" function="0"/></source>'
        '<alias name="ua-gpu-g0"/></hostdev>'
        '<hostdev type="pci" managed="no"><source><address domain="0x0" bus="0xaf" slot="0x0" function="0x0"/>'
        '</source><alias name="ua-gpu1"/></hostdev>'
    )
    text = domain.decode().replace("\t</devices>", hostdevs + "\t</devices>")
    assert _from_domain(text.encode(), vmi) == {RTX_VAR: "0000:86:00.0,0000:af:00.0"}


def test_an_entry_without_its_hostdev_is_refused_naming_the_entry_and_the_aliases() -> None:
    domain, vmi, _ = seed_case()
    with pytest.raises(InputError) as caught:
        _from_domain(domain, vmi)
    message = str(caught.value)
    assert f"gpus[0] 'gpu0' (deviceName {RTX}) has no <hostdev> aliased 'ua-gpu-gpu0' or 'ua-gpu0'" in message
    assert "gpus[1] 'gpu1'" in message and "virt-launcher renders one" in message


def test_a_hostdev_without_a_readable_source_and_a_device_two_entries_hold_are_named() -> None:
    domain, _, _ = seed_case()
    vmi = _vmi(
        [{"name": "g0", "deviceName": RTX}, {"name": "g1", "deviceName": RTX}, {"name": "g2", "deviceName": RTX}]
    )
    same = '<source><address domain="0x0000" bus="0x86" slot="0x00" function="0x0"/></source>'
    hostdevs = (
        f'<hostdev type="pci" managed="no">{same}<alias name="ua-gpu-g0"/></hostdev>'
        f'<hostdev type="pci" managed="no">{same}<alias name="ua-gpu-g1"/></hostdev>'
        '<hostdev type="pci" managed="no"><source/><alias name="ua-gpu-g2"/></hostdev>'
    )
    text = domain.decode().replace("\t</devices>", hostdevs + "\t</devices>")
    with pytest.raises(InputError) as caught:
        _from_domain(text.encode(), vmi)
    message = str(caught.value)
    assert "gpus[1] 'g1'" in message and "passes 0000:86:00.0, which gpus[0] 'g0'" in message
    assert "gpus[2] 'g2'" in message and "'ua-gpu-g2' has no PCI address or mdev UUID" in message


def test_a_vmi_of_thousands_of_missing_entries_gets_a_bounded_message() -> None:
    domain, _, _ = seed_case()
    vmi = _vmi([{"name": f"g{n}", "deviceName": RTX} for n in range(5000)])
    with pytest.raises(InputError) as caught:
        _from_domain(domain, vmi)
    assert "(and 4992 more)" in str(caught.value) and len(str(caught.value)) < 2000


def test_no_domain_no_vmi_and_bad_documents_are_refused_clearly() -> None:
    source = DomainSource()
    domain, vmi, _ = seed_case()
    with pytest.raises(SourceUnavailable, match="this call has none"):
        source.load(vmi, None)
    with pytest.raises(SourceUnavailable, match="no VMI to name the entries"):
        source.load(None, domain)
    with pytest.raises(InputError, match="domain XML is not well-formed"):
        source.load(vmi, b"<domain>")
    with pytest.raises(InputError, match="VMI JSON is not valid JSON"):
        source.load(b"{", domain)
    with pytest.raises(InputError, match=r"domain XML is 3032 bytes, over the 1200-byte limit"):
        DomainSource(max_input_bytes=1200).load(vmi, domain)  # the builder's limits, here cut to 1200 bytes
    service = HookService(source)
    with pytest.raises(HookFault) as fault:
        service.define_domain(domain, vmi, via="test")
    assert fault.value.code == "INVALID_ARGUMENT" and "'ua-gpu-gpu0'" in fault.value.message


# --- the same domain as the env path ---------------------------------------------------------------------------


def _comparable_cases() -> list[Any]:
    """Every golden case a sidecar would see from KubeVirt: with a VMI, a ``<devices>``, and the plugin's env
    without the companion variable (the companions cases go through sysfs, below)."""
    cases = []
    for case in sorted(path for path in (FIXTURES / "golden").iterdir() if path.is_dir()):
        env = (case / "env").read_text()
        if (case / "vmi.json").exists() and "PCI_COMPANIONS_" not in env and case.name != "options-no-devices":
            cases.append(pytest.param(case, id=case.name))
    return cases


def test_the_comparable_cases_are_most_of_the_golden_ones() -> None:
    assert len(_comparable_cases()) >= 12


@pytest.mark.parametrize("case", _comparable_cases())
def test_the_domain_source_gives_the_env_paths_domain(case: Path) -> None:
    vmi = (case / "vmi.json").read_bytes()
    env = parse_environ((case / "env").read_bytes())
    domain = virt_launcher_domain((case / "domain.xml").read_bytes(), vmi, env)
    options = _options(case)
    by_env = HookService(ProcessEnvSource(env), options).define_domain(domain, vmi, via="test")
    by_domain = HookService(DomainSource(), options).define_domain(domain, vmi, via="test")
    assert by_domain.domain_xml == by_env.domain_xml
    assert by_domain.result.aliases == by_env.result.aliases
    # the hook's own output read again gives the same domain (the plugin API's MutateDomain after the hooks)
    again = HookService(DomainSource(), options).define_domain(by_domain.domain_xml, vmi, via="test")
    assert again.domain_xml == by_domain.domain_xml


def test_forced_aliases_read_again_give_the_same_domain() -> None:
    domain, vmi, env = seed_case()
    domain = virt_launcher_domain(domain, vmi, env)
    options = BuildOptions(force_gpu_aliases=True)
    first = HookService(DomainSource(), options).define_domain(domain, vmi, via="test")
    assert b'<alias name="ua-gpu0">' in first.domain_xml and b"ua-gpu-gpu0" not in first.domain_xml
    assert HookService(DomainSource(), options).define_domain(first.domain_xml, vmi, via="test").domain_xml == (
        first.domain_xml
    )
    assert (
        first.domain_xml
        == HookService(ProcessEnvSource(env), options).define_domain(domain, vmi, via="test").domain_xml
    )


def _plugin_env(root: Path) -> dict[str, str]:
    """What the plugin's Allocate gives compute for the two seed GPUs on the fixture node ``root``."""
    inventory = scan(root, PluginConfig(host_root=str(root)), PciIds.load(root / "usr" / "share" / "misc" / "pci.ids"))
    resource = next(resource for resource in inventory.resources if resource.name == RTX)
    return dict(allocate(resource, GPUS, root).envs)


def _seed_node01(root: Path) -> tuple[bytes, bytes, bytes]:
    """examples/seed-node01 on NODE01 as a sidecar gets it: the domain with virt-launcher's hostdevs, the VMI, and
    the domain the env path gives with compute's env as the plugin's Allocate set it (companion variable and all)."""
    domain, vmi, _ = seed_case()
    env = _plugin_env(root)
    assert any(name.startswith("PCI_COMPANIONS_") for name in env)
    domain = virt_launcher_domain(domain, vmi, env)
    return domain, vmi, HookService(ProcessEnvSource(env)).define_domain(domain, vmi, via="test").domain_xml


def test_seed_node01_from_the_domain_and_sysfs_is_the_env_paths_domain(directory: Path) -> None:
    root = build(NODE01, directory / "root")
    domain, vmi, expected = _seed_node01(root)
    options = BuildOptions(companion_reader=SysfsCompanions(root / "sys"))
    outcome = HookService(DomainSource(), options).define_domain(domain, vmi, via="test")
    assert outcome.domain_xml == expected
    assert b"ua-gpu0-fn1" in expected and not outcome.result.warnings


# --- a non-root sidecar ---------------------------------------------------------------------------------------


_AS_NON_ROOT = """
import concurrent.futures.thread, importlib, os, sys
module, function, uid = sys.argv[1], sys.argv[2], int(sys.argv[3])
entry = getattr(importlib.import_module(module), function)
os.setgroups([])
os.setgid(uid)
os.setuid(uid)
sys.argv = sys.argv[4:]
entry()
"""
"""Start a program's entry point, then become ``uid`` (no groups, no capabilities: setuid from root drops them)
before it runs: this interpreter may live where that uid cannot reach (under /root here), so it and the modules
the program imports late (the gRPC server's thread pool) are loaded first."""


def _non_root(module: str, name: str, *args: str) -> list[str]:
    """The argv that runs ``launcher_hook.<module>``'s ``main`` as program ``name`` under KubeVirt's non-root uid
    (when the tests run as root), or as this user (who is not root already)."""
    if os.geteuid() == 0:
        return [sys.executable, "-c", _AS_NON_ROOT, f"launcher_hook.{module}", "main", str(NON_ROOT_UID), name, *args]
    return [program(name), *args]


def _open_to_all(*paths: Path) -> None:
    """The test's own directories readable (and the hook's socket directory writable) by the non-root uid."""
    for path in paths:
        path.chmod(0o755)
        if os.geteuid() == 0:
            os.chown(path, NON_ROOT_UID, NON_ROOT_UID)


@contextlib.contextmanager
def _root_only_kubelet(directory: Path) -> Iterator[Path]:
    """A live PodResources stand-in whose socket only root may reach, as the kubelet keeps it: the directory
    root's and 0750 (as this user, who is not root, the directory is made 0000: connect() meets EACCES alike)."""
    pod_resources = directory / "pod-resources"
    pod_resources.mkdir()
    with fake_kubelet(FakeKubelet([launcher_pod(GPUS)]), pod_resources / "kubelet.sock") as socket_path:
        socket_path.chmod(0o755)
        pod_resources.chmod(0o750 if os.geteuid() == 0 else 0o000)
        try:
            yield socket_path
        finally:
            pod_resources.chmod(0o700)


def _shim(domain: bytes, vmi: bytes, **env: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        _non_root("shim", "onDefineDomain", "--vmi", vmi.decode(), "--domain", domain.decode()),
        env=clean_env(**env),
        capture_output=True,
        timeout=60,
        check=False,
        cwd="/",
    )


def test_a_non_root_sidecar_cannot_reach_the_kubelet_socket_and_is_told_why(directory: Path) -> None:
    _open_to_all(directory)
    root = build(NODE01, directory / "root")
    domain, vmi, _ = _seed_node01(root)
    with _root_only_kubelet(directory) as socket_path:
        done = _shim(
            domain,
            vmi,
            LAUNCHER_HOOK_POD_RESOURCES_SOCKET=str(socket_path),
            LAUNCHER_HOOK_SYSFS_ROOT=str(root / "sys"),
            POD_NAME="virt-launcher-vm-with-gpu-x7k2p",
            POD_NAMESPACE="cxl",
        )
    assert done.returncode == 1 and not done.stdout
    error = done.stderr.decode()
    assert "FAILED_PRECONDITION" in error and "Permission denied" in error, error
    assert "needs a sidecar running as root" in error and "leave out --pod-resources-socket" in error, error


def test_a_non_root_shim_without_a_source_option_reads_the_domain(directory: Path) -> None:
    _open_to_all(directory)
    root = build(NODE01, directory / "root")
    domain, vmi, expected = _seed_node01(root)
    done = _shim(domain, vmi, LAUNCHER_HOOK_SYSFS_ROOT=str(root / "sys"))
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == expected
    (line,) = [json.loads(text) for text in done.stderr.decode().splitlines()]
    assert line["source"] == "domain XML" and line["status"] == "OK" and not line["warnings"]


def test_a_non_root_serve_without_a_source_option_reads_the_domain(directory: Path) -> None:
    _open_to_all(directory)
    root = build(NODE01, directory / "root")
    domain, vmi, expected = _seed_node01(root)
    hooks = directory / "hooks"
    hooks.mkdir()
    _open_to_all(hooks)
    socket_path = hooks / "gpu-hostdev.sock"
    process = subprocess.Popen(
        _non_root("cli", "launcher-hook", "serve", "--socket", str(socket_path), "--sysfs-root", str(root / "sys")),
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd="/",
    )
    STARTED.append(process)
    try:
        wait_for_socket(socket_path)
        with unix_channel(socket_path) as channel:
            answer = v1alpha3_pb2_grpc.CallbacksStub(channel).OnDefineDomain(
                v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60
            )
    finally:
        process.terminate()
        code, lines = finish(process)
    assert bytes(answer.domainXML) == expected
    assert code == 0
    (serving,) = [line for line in lines if line["event"] == "serving"]
    assert str(serving["source"]).startswith("domain XML")
    (call,) = [line for line in lines if line["event"] == "OnDefineDomain"]
    assert call["status"] == "OK" and call["source"] == "domain XML"


# --- which source the CLI picks -------------------------------------------------------------------------------


def test_the_cli_reads_the_domain_unless_told_otherwise_or_run_in_compute(tmp_path: Path) -> None:
    assert isinstance(make_source(None, None, "compute", {"HOSTNAME": "x", "USB_RESOURCE_X": "001:002"}), DomainSource)
    assert isinstance(make_source(None, None, "compute", {RTX_VAR: GPUS[0]}), ProcessEnvSource)
    assert isinstance(make_source(None, EXAMPLE / "compute.environ", "compute", {}), EnvironFileSource)
    source = make_source(tmp_path / "kubelet.sock", EXAMPLE / "compute.environ", "compute", {RTX_VAR: GPUS[0]})
    assert isinstance(source, PodResourcesSource)
    source.close()
