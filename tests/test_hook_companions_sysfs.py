"""Companions where the allocation source carries no companion variable (PodResources; DRA claims later).

The kubelet's PodResources API reports device IDs only, so the plugin's ``PCI_COMPANIONS_<NAME>`` never reaches
a hook sidecar that reads it. The hook then reads each passthrough GPU's companions from sysfs under
``--sysfs-root`` (:mod:`runtime.pci_companions`) by the plugin's own rule
(:func:`schemas.companions.select_companions`). Here, on fixture trees: the reader agrees with the plugin's
``Allocate`` on every tree; ``launcher-hook serve --pod-resources-socket … --sysfs-root <tree>/sys`` gives the
same domain, byte for byte, as the env path with the plugin's variable, and real libvirt puts the card in one
guest slot; a function on a host driver or in another IOMMU group is no companion; the annotation turns it
off; a read failure is a warning and the GPU goes alone; the variable, when a source carries it, wins; what a
service read is kept for its life, and a new service reads again.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher_hook import BuildOptions, build_domain
from launcher_hook.service import HookService
from launcher_hook.sources import PodResourcesSource, ProcessEnvSource
from plugin.allocation import allocate
from plugin.config import PluginConfig
from plugin.inventory import Resource
from plugin.sysfs import scan
from runtime.pci_companions import SysfsCompanions
from runtime.pciids import PciIds
from schemas import InputError
from schemas.companions import parse_companions
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc
from schemas.pci import PciAddress
from simkit.fixture_nodes import NODE01, SRIOV_VGPU_NODE
from simkit.podresources_standin import FakeKubelet, fake_kubelet
from simkit.sysfs_fixture import Function, Node, build
from tests.hook_support import (
    RTX,
    RTX_VAR,
    launcher_pod,
    running_hook,
    seed_case,
    short_dir,
    unix_channel,
    wait_for_socket,
)
from tests.libvirt_support import libvirt_verdict
from tests.plugin_support import rebind
from tests.test_hook_cli import clean_env, finish, program, shim

GPUS = ["0000:86:00.0", "0000:af:00.0"]
COMPANIONS_VAR = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
POD = launcher_pod(list(reversed(GPUS)))  # the kubelet's order is arbitrary
POD_ENV = {"POD_NAME": POD.name, "POD_NAMESPACE": "cxl"}
OFF = {"gpu-passthrough.kubevirt.io/companions": "off"}


def _pci(text: str) -> PciAddress:
    return PciAddress.parse(text)


@pytest.fixture
def directory() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def _node(*changed: Function) -> Node:
    """NODE01 with the functions of ``changed`` (same address) replaced."""
    by_address = {function.address: function for function in changed}
    return dataclasses.replace(NODE01, functions=tuple(by_address.get(f.address, f) for f in NODE01.functions))


def _function(address: str) -> Function:
    return next(function for function in NODE01.functions if function.address == address)


def _resource(root: Path) -> Resource:
    inventory = scan(root, PluginConfig(host_root=str(root)), PciIds.load(root / "usr" / "share" / "misc" / "pci.ids"))
    return next(resource for resource in inventory.resources if resource.name == RTX)


def _plugin_env(root: Path) -> dict[str, str]:
    """What the plugin's Allocate gives compute for the two seed GPUs on ``root``."""
    return dict(allocate(_resource(root), GPUS, root).envs)


def _vmi(annotations: dict[str, str] | None = None) -> bytes:
    _, vmi, _ = seed_case()
    document: dict[str, Any] = json.loads(vmi)
    if annotations:
        document["metadata"]["annotations"] = annotations
    return json.dumps(document).encode()


# --- the reader, and the rule it shares with the plugin -------------------------------------------------------


def test_node01_gpus_have_their_three_vfio_functions(tmp_path: Path) -> None:
    reader = SysfsCompanions(build(NODE01, tmp_path / "root") / "sys")
    for gpu in GPUS:
        assert reader.read(_pci(gpu)) == tuple(_pci(gpu[:-1] + str(f)) for f in (1, 2, 3))
    # a companion that is itself one of the VM's GPUs is not one
    assert reader.read(_pci(GPUS[0]), {_pci("0000:86:00.2")}) == (_pci("0000:86:00.1"), _pci("0000:86:00.3"))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        pytest.param(("0000:86:00.1", "snd_hda_intel"), (2, 3), id="audio-on-host-driver"),
        pytest.param(("0000:86:00.2", None), (1, 3), id="usb-without-driver"),
        pytest.param(("0000:86:00.3", "pci-stub"), (1, 2), id="ucsi-on-pci-stub"),
    ],
)
def test_a_function_not_on_a_vfio_driver_is_no_companion(
    tmp_path: Path, change: tuple[str, str | None], expected: tuple[int, ...]
) -> None:
    root = build(NODE01, tmp_path / "root")
    rebind(root, *change)
    assert SysfsCompanions(root / "sys").read(_pci(GPUS[0])) == tuple(_pci(f"0000:86:00.{f}") for f in expected)


def test_a_function_of_another_iommu_group_is_no_companion(tmp_path: Path) -> None:
    ucsi = _function("0000:86:00.3")
    root = build(_node(dataclasses.replace(ucsi, iommu_group=99)), tmp_path / "root")
    assert SysfsCompanions(root / "sys").read(_pci(GPUS[0])) == (_pci("0000:86:00.1"), _pci("0000:86:00.2"))


def test_only_passthrough_gpus_have_companions(tmp_path: Path) -> None:
    """A GPU on a host driver, a non-display device on vfio-pci, an SR-IOV VF (even one moved to vfio-pci)."""
    gpu = _function(GPUS[0])
    nic = dataclasses.replace(gpu, pci_class=0x020000)  # an Ethernet function at the GPU's address
    root = build(_node(nic), tmp_path / "nic")
    assert SysfsCompanions(root / "sys").read(_pci(GPUS[0])) == ()
    root = build(NODE01, tmp_path / "host-driver")
    rebind(root, GPUS[0], "nvidia")
    assert SysfsCompanions(root / "sys").read(_pci(GPUS[0])) == ()
    root = build(SRIOV_VGPU_NODE, tmp_path / "sriov")
    vfs = sorted((root / "sys" / "bus" / "pci" / "devices").glob("*/physfn"))
    assert vfs
    vf = vfs[0].parent.name
    assert SysfsCompanions(root / "sys").read(_pci(vf)) == ()
    rebind(root, vf, "vfio-pci")
    assert SysfsCompanions(root / "sys").read(_pci(vf)) == ()


@pytest.mark.parametrize(
    "variant",
    ["node01", "usb-unbound", "ucsi-pci-stub", "ucsi-other-group"],
)
def test_the_reader_and_the_plugins_allocate_agree(tmp_path: Path, variant: str) -> None:
    node = NODE01
    if variant == "ucsi-other-group":
        node = _node(dataclasses.replace(_function("0000:af:00.3"), iommu_group=99))
    root = build(node, tmp_path / "root")
    resource = _resource(root)  # the scan sees the tree as built
    if variant == "usb-unbound":
        rebind(root, "0000:86:00.2", None)
    if variant == "ucsi-pci-stub":
        rebind(root, "0000:86:00.3", "pci-stub")
    plugin = parse_companions(COMPANIONS_VAR, allocate(resource, GPUS, root).envs.get(COMPANIONS_VAR, ""))
    reader = SysfsCompanions(root / "sys")
    gpus = {_pci(gpu) for gpu in GPUS}
    hook = {gpu: found for gpu in sorted(gpus) if (found := reader.read(gpu, gpus))}
    assert hook == plugin


def test_a_link_out_of_the_root_or_a_missing_device_is_an_error_naming_it(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    reader = SysfsCompanions(root / "sys")
    with pytest.raises(InputError, match=r"PCI device 0000:87:00\.0: bus/pci/devices/0000:87:00\.0 does not exist"):
        reader.read(_pci("0000:87:00.0"))
    link = root / "sys" / "bus" / "pci" / "devices" / "0000:86:00.1"
    link.unlink()
    link.symlink_to(tmp_path)  # leads out of the root
    with pytest.raises(InputError, match=r"PCI device 0000:86:00\.1: bus/pci/devices/0000:86:00\.1 .*leads out"):
        reader.read(_pci(GPUS[0]))
    with pytest.raises(InputError, match="is not a directory"):
        SysfsCompanions(root / "nowhere").read(_pci(GPUS[0]))


def test_a_class_file_that_is_not_a_class_code_is_named(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    (root / "sys" / "bus" / "pci" / "devices" / GPUS[0] / "class").write_text("VGA\n")
    with pytest.raises(InputError, match=r"PCI device 0000:86:00\.0: .*class' says 'VGA', not a class code"):
        SysfsCompanions(root / "sys").read(_pci(GPUS[0]))


# --- the builder -----------------------------------------------------------------------------------------------


def test_the_variable_a_source_carries_wins_over_sysfs(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    domain, vmi, _ = seed_case()
    env = {RTX_VAR: ",".join(GPUS), COMPANIONS_VAR: f"{GPUS[0]}=0000:86:00.1"}
    result = build_domain(domain, vmi, env, BuildOptions(companion_reader=SysfsCompanions(root / "sys")))
    assert [(p.gpu, p.functions) for p in result.placements] == [(GPUS[0], (1,))]


def test_a_read_failure_is_a_warning_and_the_gpu_goes_alone(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    (root / "sys" / "bus" / "pci" / "devices" / GPUS[1] / "class").write_bytes(b"x" * 100)  # over the cap
    domain, vmi, _ = seed_case()
    env = {RTX_VAR: ",".join(GPUS)}
    result = build_domain(domain, vmi, env, BuildOptions(companion_reader=SysfsCompanions(root / "sys")))
    assert [(p.gpu, p.functions) for p in result.placements] == [(GPUS[0], (1, 2, 3))]
    (warning,) = result.warnings
    assert "0000:af:00.0" in warning and "placed alone" in warning and "/class" in warning
    assert "ua-gpu1-fn" not in result.domain_xml.decode()


def test_the_annotation_off_reads_nothing(tmp_path: Path) -> None:
    class Refuses:
        def describe(self) -> str:
            return "nothing"

        def read(self, gpu: PciAddress, gpus: Collection[PciAddress] = ()) -> tuple[PciAddress, ...]:
            raise AssertionError(f"read {gpu}")

    domain, _, _ = seed_case()
    env = {RTX_VAR: ",".join(GPUS)}
    off = build_domain(domain, _vmi(OFF), env, BuildOptions(companion_reader=Refuses()))
    assert off.domain_xml == build_domain(domain, _vmi(OFF), env).domain_xml
    assert not off.placements and not off.warnings


# --- PodResources end to end ---------------------------------------------------------------------------------


def _define(socket_path: Path, domain: bytes, vmi: bytes) -> bytes:
    with unix_channel(socket_path) as channel:
        stub = v1alpha3_pb2_grpc.CallbacksStub(channel)
        return bytes(
            stub.OnDefineDomain(v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60).domainXML
        )


def _env_path(root: Path, vmi: bytes) -> bytes:
    """The domain the hook gives with compute's env as the plugin's Allocate set it (the companion variable)."""
    domain, _, _ = seed_case()
    env = _plugin_env(root)
    assert COMPANIONS_VAR in env
    return HookService(ProcessEnvSource(env)).define_domain(domain, vmi, via="test").domain_xml


def _serve(directory: Path, kubelet_socket: Path, sysfs: Path) -> subprocess.Popen[bytes]:
    socket_path = directory / "hook.sock"
    process = subprocess.Popen(
        [
            program("launcher-hook"),
            "serve",
            "--socket",
            str(socket_path),
            "--pod-resources-socket",
            str(kubelet_socket),
            "--sysfs-root",
            str(sysfs),
            "--log-format",
            "json",
        ],
        env=clean_env(**POD_ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for_socket(socket_path)
    except AssertionError:
        process.kill()
        raise AssertionError(f"launcher-hook serve did not start: {process.communicate()[1].decode()}") from None
    return process


@pytest.mark.libvirt
def test_serve_with_podresources_and_sysfs_gives_the_env_paths_domain(directory: Path) -> None:
    root = build(NODE01, directory / "root")
    domain, _, _ = seed_case()
    with fake_kubelet(FakeKubelet([POD]), directory / "kubelet.sock") as kubelet_socket:
        process = _serve(directory, kubelet_socket, root / "sys")
        try:
            on = _define(directory / "hook.sock", domain, _vmi())
            off = _define(directory / "hook.sock", domain, _vmi(OFF))
        finally:
            os.kill(process.pid, 15)
            code, lines = finish(process)
    assert code == 0
    assert on == _env_path(root, _vmi())
    assert off == _env_path(root, _vmi(OFF)) != on
    assert b"ua-gpu0-fn1" not in off
    calls = [line for line in lines if line["event"] == "OnDefineDomain"]
    assert [call["status"] for call in calls] == ["OK", "OK"] and not any(call["warnings"] for call in calls)
    aliases = {"ua-gpu0": GPUS[0], "ua-gpu1": GPUS[1]}
    aliases.update({f"ua-gpu{n}-fn{f}": f"{gpu[:-1]}{f}" for n, gpu in enumerate(GPUS) for f in (1, 2, 3)})
    devices = {str(device["id"]): device for device in libvirt_verdict(on, aliases).qemu_devices}
    for n in range(2):
        gpu = devices[f"ua-gpu{n}"]
        assert (gpu["addr"], gpu["multifunction"]) == ("0x0", True)
        for f in (1, 2, 3):
            companion = devices[f"ua-gpu{n}-fn{f}"]
            assert (companion["bus"], companion["addr"]) == (gpu["bus"], f"0x0.0x{f}")


def test_podresources_source_keeps_sysfs_facts_for_the_service_life(directory: Path) -> None:
    """What the service read of a GPU is kept for its life (one sidecar serves one pod, whose devices are fixed
    while it holds them): a function rebound between two calls is not seen by the second call, which gives the
    first's bytes; a new service (a new pod's sidecar) reads the host again and sees it."""
    root = build(NODE01, directory / "root")
    domain, vmi, _ = seed_case()
    with fake_kubelet(FakeKubelet([POD]), directory / "kubelet.sock") as kubelet_socket:
        source = PodResourcesSource(kubelet_socket, pod_name=POD.name, pod_namespace="cxl")
        service = HookService(source, BuildOptions(companion_reader=SysfsCompanions(root / "sys")))
        with running_hook(service, directory / "hook.sock"):
            first = _define(directory / "hook.sock", domain, vmi)
            rebind(root, "0000:86:00.1", "snd_hda_intel")
            second = _define(directory / "hook.sock", domain, vmi)
        fresh = HookService(source, BuildOptions(companion_reader=SysfsCompanions(root / "sys")))
        with running_hook(fresh, directory / "fresh.sock"):
            third = _define(directory / "fresh.sock", domain, vmi)
        source.close()
    assert b"ua-gpu0-fn1" in first and second == first
    assert b"ua-gpu0-fn1" not in third and b"ua-gpu0-fn2" in third


def test_env_sources_never_read_sysfs(directory: Path) -> None:
    """The env and environ-file sources carry the plugin's variable: its absence means no companions."""
    root = build(NODE01, directory / "root")
    domain, vmi, _ = seed_case()
    service = HookService(
        ProcessEnvSource({RTX_VAR: ",".join(GPUS)}), BuildOptions(companion_reader=SysfsCompanions(root / "sys"))
    )
    outcome = service.define_domain(domain, vmi, via="test")
    assert not outcome.result.placements and b"-fn1" not in outcome.domain_xml


def test_the_shim_with_podresources_reads_sysfs_too(directory: Path) -> None:
    """The sidecar-shim program takes the same choice from ``LAUNCHER_HOOK_*`` variables."""
    root = build(NODE01, directory / "root")
    domain, vmi, _ = seed_case()
    with fake_kubelet(FakeKubelet([POD]), directory / "kubelet.sock") as kubelet_socket:
        done = shim(
            "--vmi", vmi.decode(), "--domain", domain.decode(),
            LAUNCHER_HOOK_POD_RESOURCES_SOCKET=str(kubelet_socket),
            LAUNCHER_HOOK_SYSFS_ROOT=str(root / "sys"),
            **POD_ENV,
        )  # fmt: skip
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout == _env_path(root, vmi)


def test_link_loops_end_in_a_named_error_or_no_companion(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "root")
    audio = (root / "sys" / "bus" / "pci" / "devices" / "0000:86:00.1").resolve()
    for name in ("iommu_group", "driver"):
        (audio / name).unlink()
        (audio / name).symlink_to(name)  # a link to itself: the kernel's ELOOP, never followed for good
    reader = SysfsCompanions(root / "sys")
    assert reader.read(_pci(GPUS[0])) == (_pci("0000:86:00.2"), _pci("0000:86:00.3"))
    usb = root / "sys" / "bus" / "pci" / "devices" / "0000:86:00.2"
    usb.unlink()
    usb.symlink_to("0000:86:00.2")
    with pytest.raises(InputError, match=r"PCI device 0000:86:00\.2: bus/pci/devices/0000:86:00\.2 .* not a directory"):
        reader.read(_pci(GPUS[0]))
