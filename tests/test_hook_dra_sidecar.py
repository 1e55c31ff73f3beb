"""The DRA example VM's hook sidecar (deploy/dra/example/vm.yaml): `launcher-hook serve` with no allocation
option, in a container that does not see the compute container's CDI mounts (no metadata files).

virt-launcher (GPUsWithDRA) has rendered each claimed GPU as ``ua-dra-gpu-<name>``; the hook keeps those hostdevs
with the devices they pass (a warning each, never a failed call) and still puts each card's companion functions
in its GPU's guest slot, read from a fixture sysfs (docs/dra.md, "Hook side").
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

import click
import pytest
import yaml

from launcher_hook import BuildOptions
from launcher_hook.builder import build_domain
from launcher_hook.cli import cli, serve
from launcher_hook.dra import MetadataFiles
from launcher_hook.matching import KUBEVIRT_DRA_ALIAS_PREFIX
from launcher_hook.service import HookService
from launcher_hook.sources import ProcessEnvSource
from runtime.pci_bars import SysfsBars
from runtime.pci_companions import SysfsCompanions
from schemas.generated.kubevirt.hooks import v1alpha3_pb2, v1alpha3_pb2_grpc
from schemas.pci import PciAddress
from simkit.fixture_nodes import A100_NODE, NODE01
from simkit.sysfs_fixture import build
from tests.hook_support import short_dir, unix_channel, wait_for_socket
from tests.libvirt_support import libvirt_verdict
from tests.test_hook_cli import clean_env, finish, program

ROOT = Path(__file__).resolve().parent.parent
VM_YAML = ROOT / "deploy" / "dra" / "example" / "vm.yaml"
DOMAIN = (ROOT / "examples" / "dra-node01" / "domain.xml").read_bytes()
GPUS = {"gpu0": "0000:86:00.0", "gpu1": "0000:af:00.0"}
"""What the scheduler gave each request: node01's two TU106 cards."""


def _vm() -> dict[str, Any]:
    (vm,) = [document for document in yaml.safe_load_all(VM_YAML.read_text()) if document]
    assert isinstance(vm, dict)
    return vm


def _sidecar_args() -> list[str]:
    annotation = _vm()["spec"]["template"]["metadata"]["annotations"]["hooks.kubevirt.io/hookSidecars"]
    (sidecar,) = json.loads(annotation)
    assert sidecar["command"] == ["launcher-hook"] and "pvc" not in sidecar
    args = sidecar["args"]
    assert isinstance(args, list)
    return [str(arg) for arg in args]


def _vmi() -> bytes:
    """The VMI virt-controller makes from the example VM."""
    template = _vm()["spec"]["template"]
    metadata = {"name": "vm-with-dra-gpus", "namespace": "gpu-vms", **template["metadata"]}
    return json.dumps({"metadata": metadata, "spec": template["spec"]}).encode()


def _rendered(domain: bytes) -> bytes:
    """``domain`` with the hostdevs virt-launcher renders for the claimed GPUs (alias ua-dra-gpu-<name>)."""
    hostdevs = b""
    for name, address in GPUS.items():
        _, bus, slot_function = address.split(":")
        slot, function = slot_function.split(".")
        hostdevs += (
            f'\t\t<hostdev mode="subsystem" type="pci" managed="no"><source><address domain="0x0000" '
            f'bus="0x{bus}" slot="0x{slot}" function="0x{function}"/></source>'
            f'<alias name="{KUBEVIRT_DRA_ALIAS_PREFIX["gpus"]}{name}"/></hostdev>\n'
        ).encode()
    assert domain.count(b"\t</devices>") == 1
    return domain.replace(b"\t</devices>", hostdevs + b"\t</devices>")


@pytest.fixture
def directory() -> Iterator[Path]:
    with short_dir() as path:
        yield path


def test_the_example_sidecar_args_parse_and_choose_the_process_env_source() -> None:
    subcommand, *args = _sidecar_args()
    assert cli.get_command(click.Context(cli), subcommand) is serve
    params = serve.make_context("serve", args).params
    # No PodResources, no environ file: the sidecar's own env, which names no device-plugin GPU.
    assert params["pod_resources_socket"] is None and params["environ_file"] is None
    assert params["api"] == "hooks" and str(params["sysfs_root"]) == "/sys" and params["pci_mmio64"] == "auto"
    assert not any(arg.startswith(("--socket", "--plugin-socket")) for arg in args)


def test_the_example_vm_asks_only_for_claimed_gpus() -> None:
    gpus = _vm()["spec"]["template"]["spec"]["domain"]["devices"]["gpus"]
    assert {gpu["name"]: (gpu["claimName"], gpu["requestName"]) for gpu in gpus} == {
        "gpu0": ("gpus", "gpu0"),
        "gpu1": ("gpus", "gpu1"),
    }
    assert not any("deviceName" in gpu for gpu in gpus)


def _define(socket_path: Path, domain: bytes, vmi: bytes) -> bytes:
    with unix_channel(socket_path) as channel:
        stub = v1alpha3_pb2_grpc.CallbacksStub(channel)
        return bytes(
            stub.OnDefineDomain(v1alpha3_pb2.OnDefineDomainParams(domainXML=domain, vmi=vmi), timeout=60).domainXML
        )


@pytest.mark.libvirt
def test_the_example_sidecar_keeps_virt_launchers_dra_gpus_and_adds_their_companions(directory: Path) -> None:
    root = build(NODE01, directory / "root")
    socket_path = directory / "hook.sock"
    _, *args = _sidecar_args()
    process = subprocess.Popen(
        [
            program("launcher-hook"),
            "serve",
            *args,
            "--socket",
            str(socket_path),
            "--sysfs-root",
            str(root / "sys"),
            "--dra-metadata-root",
            str(directory / "not-mounted-in-the-sidecar"),
            "--log-format",
            "json",
        ],
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        try:
            wait_for_socket(socket_path)
        except AssertionError:
            process.kill()
            raise AssertionError(f"launcher-hook serve did not start: {process.communicate()[1].decode()}") from None
        domain = _define(socket_path, _rendered(DOMAIN), _vmi())
    finally:
        os.kill(process.pid, 15)
        code, lines = finish(process)
    assert code == 0
    (call,) = [line for line in lines if line["event"] == "OnDefineDomain"]
    assert call["status"] == "OK" and call["source"] == "domain XML"  # a sidecar without a source option
    warnings = call["warnings"]
    assert isinstance(warnings, list) and len(warnings) == 2
    for name, address in GPUS.items():
        assert any(
            f"'ua-dra-gpu-{name}' is kept with the device it passes, {address}" in str(warning) for warning in warnings
        )
    aliases = {f"ua-dra-gpu-{name}": address for name, address in GPUS.items()}
    aliases.update(
        {f"ua-gpu{n}-fn{f}": f"{address[:-1]}{f}" for n, address in enumerate(GPUS.values()) for f in (1, 2, 3)}
    )
    assert call["gpus"] == aliases
    devices = {str(device["id"]): device for device in libvirt_verdict(domain, aliases).qemu_devices}
    for name in GPUS:
        gpu = devices[f"ua-dra-gpu-{name}"]
        assert (gpu["addr"], gpu["multifunction"]) == ("0x0", True)
    for n, name in enumerate(GPUS):
        for f in (1, 2, 3):
            companion = devices[f"ua-gpu{n}-fn{f}"]
            assert (companion["bus"], companion["addr"]) == (devices[f"ua-dra-gpu-{name}"]["bus"], f"0x0.0x{f}")


def test_a_kept_dra_gpu_gets_the_64_bit_window_its_bars_need(tmp_path: Path) -> None:
    """An EFI guest's A100 that virt-launcher rendered from a claim: no metadata file, BARs from sysfs."""
    efi = (ROOT / "xmlgen" / "examples" / "a100-efi" / "domain.xml").read_bytes()
    address = "0000:3b:00.0"
    rendered = efi.replace(
        b"\t</devices>",
        b'\t\t<hostdev mode="subsystem" type="pci" managed="no"><source><address domain="0x0000" bus="0x3b" '
        b'slot="0x00" function="0x0"/></source><alias name="ua-dra-gpu-g"/></hostdev>\n\t</devices>',
    )
    vmi = {
        "metadata": {"name": "vm", "namespace": "ns"},
        "spec": {
            "resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "a100"}],
            "domain": {"devices": {"gpus": [{"name": "g", "claimName": "gpu", "requestName": "req"}]}},
        },
    }
    sys = build(A100_NODE, tmp_path / "node") / "sys"
    options = BuildOptions(
        bars=SysfsBars(sys), claims=MetadataFiles(tmp_path / "absent"), companion_reader=SysfsCompanions(sys)
    )
    result = HookService(ProcessEnvSource({}), options).define_domain(rendered, json.dumps(vmi).encode(), via="test")
    assert result.result.aliases == {"ua-dra-gpu-g": address}
    assert result.result.mmio is not None and result.result.mmio.written_mib == 262144
    assert b"name=opt/ovmf/X-PciMmio64Mb,string=262144" in result.domain_xml


@pytest.mark.libvirt
def test_a_kept_dra_gpu_renamed_by_force_gpu_aliases_builds_the_same_bytes_again(tmp_path: Path) -> None:
    """--force-gpu-aliases renames virt-launcher's ua-dra-gpu-<name> to ua-gpuN; the hook's output fed back (still
    no metadata file) finds the device under ua-gpuN and gives the same bytes, not 'no file matches'."""
    sys = build(NODE01, tmp_path / "node") / "sys"
    options = BuildOptions(
        claims=MetadataFiles(tmp_path / "absent"), companion_reader=SysfsCompanions(sys), force_gpu_aliases=True
    )
    first = build_domain(_rendered(DOMAIN), _vmi(), {}, options)
    aliases = {f"ua-gpu{n}": address for n, address in enumerate(GPUS.values())}
    aliases.update(
        {f"ua-gpu{n}-fn{f}": f"{address[:-1]}{f}" for n, address in enumerate(GPUS.values()) for f in (1, 2, 3)}
    )
    assert first.aliases == aliases
    again = build_domain(first.domain_xml, _vmi(), {}, options)
    assert again.domain_xml == first.domain_xml
    assert any(
        "the hook's own <hostdev> 'ua-gpu1' is kept with the device it passes, 0000:af:00.0" in w
        for w in again.warnings
    )
    libvirt_verdict(again.domain_xml, aliases)


class _Recording:
    """SysfsCompanions that notes every device it is asked about."""

    def __init__(self, sys: Path) -> None:
        self.sysfs = SysfsCompanions(sys)
        self.read_for: list[str] = []

    def describe(self) -> str:
        return self.sysfs.describe()

    def read(self, gpu: PciAddress, gpus: Collection[PciAddress] = ()) -> tuple[PciAddress, ...]:
        self.read_for.append(str(gpu))
        return self.sysfs.read(gpu, gpus)


@pytest.mark.libvirt
def test_an_env_source_reads_sysfs_only_for_the_kept_dra_gpu_never_for_its_device_plugin_gpu(tmp_path: Path) -> None:
    """The env source carries the plugin's companion variable: its device-plugin GPU without one gets none and
    is never read; the DRA GPU kept from virt-launcher's rendering (no metadata file) is read and gets its three."""
    reader = _Recording(build(NODE01, tmp_path / "node") / "sys")
    domain = DOMAIN.replace(
        b"\t</devices>",
        b'\t\t<hostdev mode="subsystem" type="pci" managed="no"><source><address domain="0x0000" bus="0x86" '
        b'slot="0x00" function="0x0"/></source><alias name="ua-dra-gpu-d"/></hostdev>\n\t</devices>',
    )
    gpus = [{"name": "d", "claimName": "gpus", "requestName": "gpu0"}, {"name": "p", "deviceName": "nvidia.com/TU106"}]
    vmi = json.loads(_vmi())
    vmi["spec"]["domain"]["devices"]["gpus"] = gpus
    service = HookService(
        ProcessEnvSource({"PCI_RESOURCE_NVIDIA_COM_TU106": GPUS["gpu1"]}),
        BuildOptions(claims=MetadataFiles(tmp_path / "absent"), companion_reader=reader),
    )
    outcome = service.define_domain(domain, json.dumps(vmi).encode(), via="test")
    assert reader.read_for == [GPUS["gpu0"]]
    aliases = {"ua-dra-gpu-d": GPUS["gpu0"], "ua-gpu1": GPUS["gpu1"]}
    aliases.update({f"ua-gpu0-fn{f}": f"{GPUS['gpu0'][:-1]}{f}" for f in (1, 2, 3)})
    assert outcome.result.aliases == aliases
    libvirt_verdict(outcome.domain_xml, aliases)
    # Without the DRA entry, nothing is read at all.
    vmi["spec"]["domain"]["devices"]["gpus"] = gpus[1:]
    reader.read_for.clear()
    service.define_domain(DOMAIN, json.dumps(vmi).encode(), via="test")
    assert reader.read_for == []
