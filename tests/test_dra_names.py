"""Names that reach a path or a CDI field are checked as Kubernetes checks them (issue 22, finding 9).

The kubelet never sends a claim whose namespace is not a DNS label or whose name is not a DNS subdomain, and
the API server never stores a result whose request is not a DNS label; a stand-in, a forged claim or a file in
``--claims-dir`` may. Python's ``$`` matches before a trailing newline, so ``re.match(r"^...$")`` let
``"gpu-claim\\n"`` through into the CDI spec's ``containerPath`` and the metadata directory: each name is now
checked whole (apimachinery ``IsDNS1123Label`` / ``IsDNS1123Subdomain``) and refused with an error naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from plugin.dra import cdi
from plugin.dra.claims import (
    AllocatedDevice,
    ClaimError,
    ClaimRef,
    StaticClaims,
    check_ref,
    claim_object,
    results_from_claim_object,
)
from plugin.dra.prepare import PrepareCore
from plugin.dra.slices import build_slices, check_node_name
from plugin.inventory import Inventory
from schemas.dra import DRIVER_NAME
from simkit.fixture_nodes import NODE01
from tests.discovery_support import build_node, discover

UID = "0f4c6a4e-2b7a-4c3e-9d2f-8a1b2c3d4e5f"


@pytest.mark.parametrize(
    ("ref", "culprit"),
    [
        (ClaimRef("vms", "gpu-claim\n", UID), "claim name 'gpu-claim\\n'"),
        (ClaimRef("vms\n", "gpu-claim", UID), "claim namespace 'vms\\n'"),
        (ClaimRef("vms", "a..b", UID), "claim name 'a..b'"),
        (ClaimRef("vms", "a.-b", UID), "claim name 'a.-b'"),
        (ClaimRef("vms", "Gpu", UID), "claim name 'Gpu'"),
        (ClaimRef("vms", "x" * 254, UID), "claim name 'xxxx"),
        (ClaimRef("v" * 64, "gpu-claim", UID), "claim namespace 'vvvv"),
        (ClaimRef("vms", "gpu-claim", UID + "\n"), "uid"),
    ],
)
def test_a_claim_ref_that_kubernetes_would_refuse_is_refused_naming_it(ref: ClaimRef, culprit: str) -> None:
    with pytest.raises(ClaimError, match="not a") as caught:
        check_ref(ref)
    assert culprit in str(caught.value)


@pytest.mark.parametrize("name", ["gpu-claim", "a.b-c", "x" * 253, "0"])
def test_kubernetes_names_pass(name: str) -> None:
    assert check_ref(ClaimRef("vms", name, UID)).name == name


def core_for(tmp_path: Path, ref: ClaimRef, devices: list[AllocatedDevice]) -> PrepareCore:
    root = build_node(NODE01, tmp_path)
    core = PrepareCore(
        StaticClaims({(ref.namespace, ref.name): claim_object(ref, devices)}),
        root,
        tmp_path / "state",
        tmp_path / "cdi",
        pool="node01",
    )
    core.update_inventory(discover(root))
    core.start()
    return core


def gpu(request: str = "gpu", **kw: object) -> AllocatedDevice:
    return AllocatedDevice(request, DRIVER_NAME, "node01", "pci-0000-86-00-0", **kw)  # type: ignore[arg-type]


def written(tmp_path: Path) -> list[Path]:
    return [path for path in (tmp_path / "cdi").rglob("*") if path.is_file()] + [
        path for path in (tmp_path / "state" / "metadata").rglob("*") if path.is_file()
    ]


def test_a_claim_name_with_a_newline_never_reaches_the_cdi_spec(tmp_path: Path) -> None:
    ref = ClaimRef("vms", "gpu-claim\n", UID)
    answer = core_for(tmp_path, ref, [gpu()]).prepare([ref])[UID]
    assert "claim name 'gpu-claim\\n' in namespace vms is not a DNS subdomain" in answer.error
    assert written(tmp_path) == []


@pytest.mark.parametrize("request_name", ["gpu\n", "gpu\n/sub", "GPU", "g" * 64])
def test_a_request_name_that_is_not_a_dns_label_is_refused_naming_it(tmp_path: Path, request_name: str) -> None:
    ref = ClaimRef("vms", "gpu-claim", UID)
    answer = core_for(tmp_path, ref, [gpu(request_name)]).prepare([ref])[UID]
    assert f"request {request_name!r}" in answer.error and "DNS label" in answer.error
    assert written(tmp_path) == []


@pytest.mark.parametrize("pod_claim_name", ["my-gpu\n", "../x", "My_GPU", "a.b"])
def test_a_pod_claim_name_that_is_not_a_dns_label_is_refused(pod_claim_name: str) -> None:
    ref = ClaimRef("vms", "gpu-claim", UID)
    obj = claim_object(ref, [gpu(pod_claim_name=pod_claim_name)])
    with pytest.raises(ClaimError, match=r"resource\.kubernetes\.io/pod-claim-name") as caught:
        results_from_claim_object(obj, ref)
    assert repr(pod_claim_name) in str(caught.value) and "DNS label" in str(caught.value)


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("driver", DRIVER_NAME + "\n", "DNS subdomain"),
        ("pool", "node01\n", "pool name"),
        ("pool", "a//b", "pool name"),
        ("device", "pci-0000-86-00-0\n", "DNS label"),
    ],
)
def test_result_names_are_checked_as_the_api_server_checks_them(field: str, value: str, rule: str) -> None:
    ref = ClaimRef("vms", "gpu-claim", UID)
    obj = claim_object(ref, [gpu()])
    obj["status"]["allocation"]["devices"]["results"][0][field] = value
    with pytest.raises(ClaimError, match=rule) as caught:
        results_from_claim_object(obj, ref)
    assert repr(value) in str(caught.value)


def test_a_uid_with_a_newline_names_no_file() -> None:
    with pytest.raises(ValueError, match="CDI device name"):
        cdi.device_name(UID + "\n", "gpu")
    assert cdi.claim_uid_of_spec(cdi.spec_file_name(UID + "\n")) is None


@pytest.mark.parametrize("name", ["a" * 64, "n" * 253, ("x" * 100) + "." + ("y" * 100)])
def test_a_node_name_kubernetes_accepts_is_accepted(name: str) -> None:
    """apimachinery's IsDNS1123Subdomain (ValidateNodeName, and each part of a pool name) bounds the whole name
    at 253 characters and sets no bound per label (a DNS label's 63 is IsDNS1123Label's): a node Kubernetes
    admits, with a long first label, is one the plugin serves."""
    assert check_node_name(name) == name
    assert build_slices(Inventory(()), name) == []
