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
