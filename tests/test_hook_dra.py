"""The hook's DRA path: entries with claimName/requestName get the device their KEP 5304 metadata file names.

What virt-launcher does (KubeVirt pkg/dra/utils.go, pkg/virt-launcher/virtwrap/device/hostdevice/dra/) is the
reference: the directory by resourceClaimName or by the pod claim name, one ``*-metadata.json``, one device,
``mdevUUID`` before ``pciBusID``. Missing and malformed files, links out of the root, and the CLI wiring.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from lxml import etree

from launcher_hook import BuildOptions, build_domain
from launcher_hook.dra import MetadataFiles
from schemas import InputError
from schemas.dra_metadata import metadata_path
from schemas.vmi import parse_vmi
from simkit.dra_files import write_vmi_tree
from tests.conftest import FIXTURES
from tests.test_hook_cli import clean_env, program
from xmlgen.cli import cli

GOLDEN = FIXTURES / "golden"
DOMAIN = (GOLDEN / "vgpu-default-display" / "domain.xml").read_bytes()
A10 = "0000:3b:00.0"
UUID = "4b20d080-1b54-4048-85b3-a6a62d165c01"
RTX_VAR = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"


def vmi_doc(
    gpus: list[dict[str, Any]],
    claims: list[dict[str, Any]] | None = None,
    host_devices: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "metadata": {"name": "vm", "namespace": "ns"},
        "spec": {
            "resourceClaims": claims if claims is not None else [{"name": "gpu", "resourceClaimName": "rc"}],
            "domain": {"devices": {"gpus": gpus, "hostDevices": host_devices or []}},
        },
    }


ONE = [{"name": "g", "claimName": "gpu", "requestName": "req"}]


def build(
    root: Path, document: dict[str, Any], env: dict[str, str] | None = None, domain: bytes = DOMAIN
) -> tuple[dict[str, str], list[str]]:
    result = build_domain(domain, json.dumps(document).encode(), env or {}, BuildOptions(claims=MetadataFiles(root)))
    return result.aliases, result.warnings


def tree(root: Path, document: dict[str, Any], devices: dict[tuple[str, str], str]) -> list[Path]:
    return write_vmi_tree(root, parse_vmi(json.dumps(document).encode()), devices)


def test_direct_and_template_claims_give_a_pci_and_an_mdev_hostdev(tmp_path: Path) -> None:
    document = vmi_doc(
        [
            {"name": "pt", "claimName": "gpu", "requestName": "req"},
            {"name": "vgpu", "claimName": "tpl", "requestName": "v"},
        ],
        [{"name": "gpu", "resourceClaimName": "rc"}, {"name": "tpl", "resourceClaimTemplateName": "t"}],
    )
    written = tree(tmp_path, document, {("gpu", "req"): A10, ("tpl", "v"): UUID})
    assert [str(path.relative_to(tmp_path)) for path in written] == [
        "resourceclaims/rc/req/gpu-passthrough.kubevirt.io-metadata.json",
        "resourceclaimtemplates/tpl/v/gpu-passthrough.kubevirt.io-metadata.json",
    ]
    aliases, warnings = build(tmp_path, document)
    assert (aliases, warnings) == ({"ua-gpu0": A10, "ua-gpu1": UUID}, [])


def test_any_driver_name_is_read_as_virt_launcher_globs(tmp_path: Path) -> None:
    document = vmi_doc(ONE)
    write_vmi_tree(
        tmp_path, parse_vmi(json.dumps(document).encode()), {("gpu", "req"): A10}, driver="vfio.gpu.nvidia.com"
    )
    assert build(tmp_path, document)[0] == {"ua-gpu0": A10}


def test_env_and_dra_entries_in_one_vmi_keep_vmi_order(tmp_path: Path) -> None:
    document = vmi_doc(ONE, host_devices=[{"name": "rtx", "deviceName": "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"}])
    tree(tmp_path, document, {("gpu", "req"): A10})
    aliases, _ = build(tmp_path, document, {RTX_VAR: "0000:86:00.0"})
    assert list(aliases.items()) == [("ua-gpu0", A10), ("ua-hostdev0", "0000:86:00.0")]


def test_a_dra_device_the_env_also_offers_is_not_given_twice(tmp_path: Path) -> None:
    document = vmi_doc(ONE, host_devices=[{"name": "rtx", "deviceName": "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"}])
    tree(tmp_path, document, {("gpu", "req"): A10})
    with pytest.raises(InputError, match="already taken by another entry"):
        build(tmp_path, document, {RTX_VAR: A10})


def test_two_entries_naming_one_device_are_refused(tmp_path: Path) -> None:
    document = vmi_doc([*ONE, {"name": "h", "claimName": "gpu", "requestName": "other"}])
    tree(tmp_path, document, {("gpu", "req"): A10, ("gpu", "other"): A10})
    with pytest.raises(InputError, match=r"gpus\[1\] 'h' .*: 0000:3b:00.0 is named by gpus\[0\] 'g'"):
        build(tmp_path, document)


def test_a_missing_file_names_the_entry_and_the_pattern(tmp_path: Path) -> None:
    with pytest.raises(InputError) as error:
        build(tmp_path, vmi_doc(ONE))
    message = str(error.value)
    assert "gpus[0] 'g' (claimName gpu, requestName req): no file matches" in message
    assert f"{tmp_path}/resourceclaims/rc/req/*-metadata.json" in message
    assert "--dra-metadata-root" in message


def test_a_missing_file_is_fine_when_virt_launcher_rendered_the_entry(tmp_path: Path) -> None:
    rendered = DOMAIN.replace(
        b"\t</devices>",
        b'\t\t<hostdev type="pci" managed="no" mode="subsystem"><source><address domain="0x0000" bus="0x5e" '
        b'slot="0x00" function="0x0"/></source><alias name="ua-dra-gpu-g"/></hostdev>\n\t</devices>',
    )
    aliases, warnings = build(tmp_path, vmi_doc(ONE), domain=rendered)
    # The hook (a sidecar, which does not see the compute container's CDI mounts) keeps virt-launcher's device.
    assert aliases == {"ua-dra-gpu-g": "0000:5e:00.0"}
    assert len(warnings) == 1
    assert "no file matches" in warnings[0]
    assert "virt-launcher's <hostdev> 'ua-dra-gpu-g' is kept with the device it passes, 0000:5e:00.0" in warnings[0]


def test_a_missing_file_and_a_rendered_usb_hostdev_is_left_as_it_is(tmp_path: Path) -> None:
    rendered = DOMAIN.replace(
        b"\t</devices>",
        b'\t\t<hostdev type="usb" managed="no" mode="subsystem"><source><vendor id="0x1234"/>'
        b'<product id="0x5678"/></source><alias name="ua-dra-gpu-g"/></hostdev>\n\t</devices>',
    )
    aliases, warnings = build(tmp_path, vmi_doc(ONE), domain=rendered)
    assert aliases == {}
    assert "virt-launcher's <hostdev> 'ua-dra-gpu-g' is left as it is" in warnings[0]


def test_virt_launcher_rendering_another_device_is_kept_with_a_warning(tmp_path: Path) -> None:
    document = vmi_doc(ONE)
    tree(tmp_path, document, {("gpu", "req"): A10})
    rendered = DOMAIN.replace(
        b"\t</devices>",
        b'\t\t<hostdev type="pci" managed="no" mode="subsystem"><source><address domain="0x0000" bus="0x5e" '
        b'slot="0x00" function="0x0"/></source><alias name="ua-dra-gpu-g"/></hostdev>\n\t</devices>',
    )
    aliases, warnings = build(tmp_path, document, domain=rendered)
    assert aliases == {}
    assert "passes 0000:5e:00.0, but" in warnings[0]
    assert "names 0000:3b:00.0; virt-launcher's is left as it is" in warnings[0]


def test_virt_launcher_rendering_the_same_device_keeps_its_alias(tmp_path: Path) -> None:
    document = vmi_doc(ONE)
    tree(tmp_path, document, {("gpu", "req"): A10})
    rendered = DOMAIN.replace(
        b"\t</devices>",
        b'\t\t<hostdev type="pci" managed="no" mode="subsystem"><source><address domain="0x0000" bus="0x3b" '
        b'slot="0x00" function="0x0"/></source><alias name="ua-dra-gpu-g"/></hostdev>\n\t</devices>',
    )
    assert build(tmp_path, document, domain=rendered) == ({"ua-dra-gpu-g": A10}, [])


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{", "is not a JSON stream"),
        (b'{"apiVersion": "metadata.resource.k8s.io/v9"}', "has no object of apiVersion"),
        (
            b'{"apiVersion": "metadata.resource.k8s.io/v1alpha1", "requests": [{"name": "req", "devices": []}]}',
            "request 'req' has 0 devices",
        ),
        (
            b'{"apiVersion": "metadata.resource.k8s.io/v1alpha1", "requests": [{"name": "req", "devices": '
            b'[{"attributes": {"resource.kubernetes.io/pciBusID": {"string": "3b:00.0"}}}]}]}',
            "malformed PCI address",
        ),
        (b'{"apiVersion": "metadata.resource.k8s.io/v1alpha1", "requests": []}', "has no request 'req'"),
        (b" " * (256 * 1024 + 1), "over the 262144-byte limit"),
    ],
)
def test_a_malformed_file_is_refused_naming_the_entry_and_the_file(
    tmp_path: Path, content: bytes, message: str
) -> None:
    path = Path(metadata_path(tmp_path, "claim", "rc", "req", "example.com"))
    path.parent.mkdir(parents=True)
    path.write_bytes(content)
    with pytest.raises(InputError, match=message) as error:
        build(tmp_path, vmi_doc(ONE))
    assert str(error.value).startswith("gpus[0] 'g' (claimName gpu, requestName req): ")
    assert str(path) in str(error.value)


def test_two_drivers_for_one_request_are_refused_as_virt_launcher_does(tmp_path: Path) -> None:
    document = vmi_doc(ONE)
    tree(tmp_path, document, {("gpu", "req"): A10})
    write_vmi_tree(tmp_path, parse_vmi(json.dumps(document).encode()), {("gpu", "req"): A10}, driver="other.example")
    with pytest.raises(InputError, match=r"2 metadata files in .* KubeVirt takes exactly one driver per request"):
        build(tmp_path, document)


def test_a_link_out_of_the_root_finds_nothing(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    document = vmi_doc(ONE)
    tree(outside, document, {("gpu", "req"): A10})
    root = tmp_path / "root"
    root.mkdir()
    os.symlink(outside / "resourceclaims", root / "resourceclaims")
    with pytest.raises(InputError, match="no file matches"):
        build(root, document)
    os.symlink("/real", root / "resourceclaims2")  # an absolute link resolves inside the root
    (root / "real" / "rc" / "req").mkdir(parents=True)
    os.replace(root / "resourceclaims2", root / "resourceclaims")
    (root / "real" / "rc" / "req" / "x-metadata.json").write_bytes(
        next((outside / "resourceclaims" / "rc" / "req").iterdir()).read_bytes()
    )
    assert build(root, document)[0] == {"ua-gpu0": A10}


@pytest.mark.parametrize(
    ("gpus", "claims", "message"),
    [
        ([{"name": "g", "claimName": "gpu"}], None, "a DRA entry needs both claimName and requestName"),
        ([{"name": "g", "requestName": "r"}], None, "a DRA entry needs both claimName and requestName"),
        (ONE, [{"name": "other", "resourceClaimName": "x"}], "claimName 'gpu' is not in spec.resourceClaims"),
    ],
)
def test_entries_virt_launcher_could_not_resolve_either_are_refused(
    tmp_path: Path, gpus: list[dict[str, Any]], claims: list[dict[str, Any]] | None, message: str
) -> None:
    with pytest.raises(InputError, match=message):
        build(tmp_path, vmi_doc(gpus, claims))


def test_without_a_reader_dra_entries_are_left_to_virt_launcher() -> None:
    result = build_domain(DOMAIN, json.dumps(vmi_doc(ONE)).encode(), {})
    assert result.aliases == {}
    assert result.warnings == [
        "gpus[0] 'g' (claimName gpu, requestName req): no DRA metadata root is configured for the hook; "
        "left to virt-launcher"
    ]


def test_the_first_dra_vgpu_gets_the_default_display_and_options_apply(tmp_path: Path) -> None:
    other = "7b7b1e7a-2a34-4a61-9c1e-0b8f1a1b2c3d"
    document = vmi_doc(
        [
            {"name": "a", "claimName": "gpu", "requestName": "a"},
            {"name": "b", "claimName": "gpu", "requestName": "b", "virtualGPUOptions": {"display": {"enabled": False}}},
        ]
    )
    tree(tmp_path, document, {("gpu", "a"): UUID, ("gpu", "b"): other})
    result = build_domain(DOMAIN, json.dumps(document).encode(), {}, BuildOptions(claims=MetadataFiles(tmp_path)))
    hostdevs = etree.fromstring(result.domain_xml).findall("devices/hostdev")
    assert [(h.get("display"), h.get("ramfb")) for h in hostdevs] == [(None, None), (None, None)]
    document["spec"]["domain"]["devices"]["gpus"][1]["virtualGPUOptions"] = None
    result = build_domain(DOMAIN, json.dumps(document).encode(), {}, BuildOptions(claims=MetadataFiles(tmp_path)))
    hostdevs = etree.fromstring(result.domain_xml).findall("devices/hostdev")
    assert [(h.get("display"), h.get("ramfb")) for h in hostdevs] == [("on", "on"), (None, None)]


def test_xmlgen_render_reads_the_metadata_root_option(tmp_path: Path) -> None:
    document = vmi_doc(ONE)
    tree(tmp_path / "dra", document, {("gpu", "req"): A10})
    (tmp_path / "vmi.json").write_text(json.dumps(document))
    (tmp_path / "domain.xml").write_bytes(DOMAIN)
    args = ["render", "--domain", str(tmp_path / "domain.xml"), "--vmi", str(tmp_path / "vmi.json")]
    result = CliRunner().invoke(cli, [*args, "--dra-metadata-root", str(tmp_path / "dra")], env={})
    assert result.exit_code == 0, result.stderr
    assert b'bus="0x3b"' in result.stdout_bytes
    result = CliRunner().invoke(cli, args, env={"LAUNCHER_HOOK_DRA_METADATA_ROOT": str(tmp_path / "nowhere")})
    assert result.exit_code == 1
    assert f"{tmp_path}/nowhere/resourceclaims/rc/req/*-metadata.json" in result.stderr


def test_the_shim_takes_the_metadata_root_from_its_env_variable(tmp_path: Path) -> None:
    document = vmi_doc(ONE)
    tree(tmp_path, document, {("gpu", "req"): A10})
    done = subprocess.run(
        [program("onDefineDomain"), "--vmi", json.dumps(document), "--domain", DOMAIN.decode()],
        env=clean_env(LAUNCHER_HOOK_DRA_METADATA_ROOT=str(tmp_path)),
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert b'<alias name="ua-gpu0">' in done.stdout


def test_a_fifo_or_a_crowded_directory_in_place_of_the_file_is_refused_without_blocking(tmp_path: Path) -> None:
    path = Path(metadata_path(tmp_path, "claim", "rc", "req", "example.com"))
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with pytest.raises(InputError, match="is a FIFO, not a regular file"):
        build(tmp_path, vmi_doc(ONE))
    path.unlink()
    for index in range(65):
        (path.parent / f"f{index}").write_bytes(b"")
    with pytest.raises(InputError, match="has more than 64 entries"):
        build(tmp_path, vmi_doc(ONE))
