"""plugin.dra.claims: a claim's allocation read from its ResourceClaim object, the UID checked, inputs bounded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from plugin.dra.claims import (
    MAX_RESULTS,
    AllocatedDevice,
    ClaimError,
    ClaimRef,
    StaticClaims,
    claim_file_name,
    claim_object,
    results_from_claim_object,
)

REF = ClaimRef("default", "gpu-claim", "11111111-2222-3333-4444-555555555555")
DEVICES = [
    AllocatedDevice("gpu", "gpu-passthrough.kubevirt.io", "node01", "pci-0000-86-00-0"),
    AllocatedDevice("nic", "other.example.com", "node01", "nic-0"),
]


def test_results_are_read_in_order_for_every_driver() -> None:
    assert results_from_claim_object(claim_object(REF, DEVICES), REF) == DEVICES


def test_a_claim_recreated_under_the_same_name_is_refused() -> None:
    obj = claim_object(ClaimRef(REF.namespace, REF.name, "other-uid"), DEVICES)
    with pytest.raises(ClaimError, match=r"default/gpu-claim .*uid 'other-uid'"):
        results_from_claim_object(obj, REF)


def test_an_unallocated_claim_is_refused_naming_it() -> None:
    obj = claim_object(REF, DEVICES)
    del obj["status"]
    with pytest.raises(ClaimError, match=r"default/gpu-claim.*not allocated"):
        results_from_claim_object(obj, REF)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o.update(kind="Pod"), "not a ResourceClaim"),
        (lambda o: o.update(apiVersion="resource.k8s.io/v1alpha3"), "apiVersion"),
        (lambda o: o["status"]["allocation"]["devices"].update(results="x"), "not a list"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(device=""), r"results\[0\]\.device"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][1].update(pool=7), r"results\[1\]\.pool"),
        (lambda o: o["status"]["allocation"]["devices"]["results"][0].update(request="r" * 300), "over 253"),
        (
            lambda o: o["status"]["allocation"]["devices"].update(
                results=[o["status"]["allocation"]["devices"]["results"][0]] * (MAX_RESULTS + 1)
            ),
            "over the limit",
        ),
        (lambda o: o["metadata"].update(namespace="kube-system"), "namespace 'kube-system'"),
        (
            lambda o: o["status"]["allocation"]["devices"]["results"][0].update(adminAccess="yes"),
            r"results\[0\]\.adminAccess is 'yes', not a bool",
        ),
    ],
)
def test_malformed_claims_are_refused_naming_the_field(mutate: Any, message: str) -> None:
    obj = claim_object(REF, DEVICES)
    mutate(obj)
    with pytest.raises(ClaimError, match=message):
        results_from_claim_object(obj, REF)


def test_static_claims_from_results_and_unknown_claims() -> None:
    source = StaticClaims.from_results({REF: DEVICES})
    assert source.allocated(REF) == DEVICES
    with pytest.raises(ClaimError, match=r"default/other .*not known"):
        source.allocated(ClaimRef("default", "other", "u"))


def test_static_claims_read_a_directory_when_asked(tmp_path: Path) -> None:
    source = StaticClaims.from_directory(tmp_path)
    with pytest.raises(ClaimError, match="not known"):
        source.allocated(REF)
    (tmp_path / claim_file_name(REF.namespace, REF.name)).write_text(json.dumps(claim_object(REF, DEVICES)))
    assert source.allocated(REF) == DEVICES
    (tmp_path / claim_file_name(REF.namespace, REF.name)).write_text("{not json")
    with pytest.raises(ClaimError, match="not JSON"):
        source.allocated(REF)
    (tmp_path / claim_file_name(REF.namespace, REF.name)).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ClaimError, match="not JSON"):
        source.allocated(REF)


@pytest.mark.parametrize(
    "ref",
    [
        ClaimRef("../etc", "x", "u"),
        ClaimRef("default", "a/b", "u"),
        ClaimRef("default", "x", "a/b"),
        ClaimRef("d", "x", ""),
    ],
)
def test_claim_names_that_are_not_kubernetes_names_never_reach_the_file_system(tmp_path: Path, ref: ClaimRef) -> None:
    with pytest.raises(ClaimError):
        StaticClaims.from_directory(tmp_path).allocated(ref)


def test_a_template_claim_carries_the_pods_name_for_it() -> None:
    devices = [AllocatedDevice("gpu", "gpu-passthrough.kubevirt.io", "node01", "pci-0000-86-00-0", "gpu-claim")]
    obj = claim_object(REF, devices)
    assert obj["metadata"]["annotations"] == {"resource.kubernetes.io/pod-claim-name": "gpu-claim"}
    assert results_from_claim_object(obj, REF) == devices
    obj["metadata"]["annotations"]["resource.kubernetes.io/pod-claim-name"] = ""
    with pytest.raises(ClaimError, match="pod-claim-name"):
        results_from_claim_object(obj, REF)


def test_admin_access_is_read_from_each_result() -> None:
    obj = claim_object(REF, DEVICES)
    obj["status"]["allocation"]["devices"]["results"][0]["adminAccess"] = True
    obj["status"]["allocation"]["devices"]["results"][1]["adminAccess"] = None
    first, second = results_from_claim_object(obj, REF)
    assert (first.admin_access, second.admin_access) == (True, False)
    assert results_from_claim_object(claim_object(REF, [first]), REF) == [first]
