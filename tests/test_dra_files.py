"""simkit.dra_files: the metadata tree a DRA driver would give a virt-launcher pod, as the hook reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launcher_hook.dra import MetadataFiles
from schemas import InputError, PciAddress, ResourceKind
from schemas.dra_metadata import parse_metadata
from schemas.vmi import parse_vmi
from simkit.dra_files import GENERATED_SUFFIX, write_vmi_tree
from tests.kernel_paths_support import watch_kernel_paths

UUID = "4b20d080-1b54-4048-85b3-a6a62d165c01"
VMI = parse_vmi(
    json.dumps(
        {
            "metadata": {"name": "vm", "namespace": "ns"},
            "spec": {
                "resourceClaims": [
                    {"name": "a", "resourceClaimName": "rc"},
                    {"name": "b", "resourceClaimTemplateName": "t"},
                ],
                "domain": {
                    "devices": {
                        "gpus": [{"name": "g", "claimName": "a", "requestName": "r"}],
                        "hostDevices": [{"name": "h", "claimName": "b", "requestName": "v"}],
                    }
                },
            },
        }
    ).encode()
)


def test_the_tree_names_claims_as_kubernetes_does_and_the_hook_reads_it_back(tmp_path: Path) -> None:
    direct, template = write_vmi_tree(tmp_path, VMI, {("a", "r"): "0000:3B:00.0", ("b", "v"): UUID})
    first = parse_metadata(direct.read_bytes(), str(direct))
    assert (first.claim_name, first.namespace, first.pod_claim_name) == ("rc", "ns", None)
    assert first.requests[0].devices[0].name == "pci-0000-3b-00-0"
    second = parse_metadata(template.read_bytes(), str(template))
    assert (second.claim_name, second.pod_claim_name) == (f"virt-launcher-vm-abcde-b-{GENERATED_SUFFIX}", "b")
    assert not list(tmp_path.rglob(".*.tmp"))
    outcomes = MetadataFiles(tmp_path).resolve(VMI)
    assert {key: (o.kind, o.source) for key, o in outcomes.items()} == {
        ("gpus", 0): (ResourceKind.PCI, PciAddress.parse("0000:3b:00.0")),
        ("hostDevices", 0): (ResourceKind.MDEV, UUID),
    }


def test_a_claim_not_in_the_vmi_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"claim 'zz' is not in the VMI's spec\.resourceClaims"):
        write_vmi_tree(tmp_path, VMI, {("zz", "r"): UUID})


MANY = parse_vmi(
    json.dumps(
        {
            "metadata": {"name": "vm", "namespace": "ns"},
            "spec": {
                "resourceClaims": [{"name": f"c{i}", "resourceClaimName": f"rc{i}"} for i in range(4)],
                "domain": {
                    "devices": {"gpus": [{"name": f"g{i}", "claimName": f"c{i}", "requestName": "r"} for i in range(4)]}
                },
            },
        }
    ).encode()
)
ADDRESSES = [f"0000:{0x10 + i:02x}:00.0" for i in range(4)]


def test_one_call_opens_the_root_once_and_the_kernel_resolves_every_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claims of one VMI are read through one descriptor of the root, each directory and file resolved
    inside it by ``openat2`` (no component walked in Python), where the kernel has it."""
    write_vmi_tree(tmp_path, MANY, {(f"c{i}", "r"): address for i, address in enumerate(ADDRESSES)})
    seen = watch_kernel_paths(monkeypatch, tmp_path)
    outcomes = MetadataFiles(tmp_path).resolve(MANY)
    assert [str(outcomes[("gpus", i)].source) for i in range(4)] == ADDRESSES
    assert seen.root_opens == 1
    assert seen.asked == [f"resourceclaims/rc{i}/r".encode() for i in range(4)]


def test_nothing_read_is_kept_from_one_call_to_the_next(tmp_path: Path, resolver: str) -> None:
    """Each call reads the tree anew: a file rewritten, a claim removed, the whole root replaced."""
    root = tmp_path / "root"
    write_vmi_tree(root, MANY, {(f"c{i}", "r"): address for i, address in enumerate(ADDRESSES)})
    files = MetadataFiles(root)
    assert str(files.resolve(MANY)[("gpus", 0)].source) == ADDRESSES[0]
    write_vmi_tree(root, MANY, {("c0", "r"): ADDRESSES[3]})
    (root / "resourceclaims" / "rc1" / "r" / "gpu-passthrough.kubevirt.io-metadata.json").unlink()
    again = files.resolve(MANY)
    assert str(again[("gpus", 0)].source) == ADDRESSES[3]
    assert again[("gpus", 1)].source is None and again[("gpus", 1)].missing is not None
    root.rename(tmp_path / "old")
    write_vmi_tree(root, MANY, {("c2", "r"): ADDRESSES[0]})
    third = files.resolve(MANY)
    assert str(third[("gpus", 2)].source) == ADDRESSES[0]
    assert third[("gpus", 0)].source is None
