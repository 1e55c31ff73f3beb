"""deploy/dra/admission.yaml: the API server, not the plugin, keeps each node's plugin to its own slices.

The ValidatingAdmissionPolicy's CEL is evaluated here with cel-python on admission requests as the API server
builds them (``request``, ``object``, ``oldObject``: ``object`` is null for a DELETE, ``oldObject`` for a
CREATE; ``variables`` from the policy's own variables, in order), the way Kubernetes runs a policy: its
match conditions first (a request they do not match is not this policy's business), then every validation must
be exactly ``true``. Requests: from the plugin on its own node, on another node, for another driver, with no
node claim in the token, and from someone else.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from schemas.dra import DRIVER_NAME
from tests.admission_support import AdmissionPolicy
from tests.test_deploy import DEPLOY

POLICY_FILE = DEPLOY / "dra" / "admission.yaml"
NODE_CLAIM = "authentication.kubernetes.io/node-name"
PLUGIN_USER = "system:serviceaccount:kubevirt-gpu-passthrough:gpu-dra-plugin"


def documents() -> dict[str, dict[str, Any]]:
    return {doc["kind"]: doc for doc in yaml.safe_load_all(POLICY_FILE.read_text())}


@pytest.fixture(scope="module")
def policy() -> AdmissionPolicy:
    return AdmissionPolicy(documents()["ValidatingAdmissionPolicy"])


def slice_on(node: str | None, driver: str = DRIVER_NAME, pool: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "driver": driver,
        "pool": {"name": pool or node or "shared", "generation": 1, "resourceSliceCount": 1},
        "devices": [],
    }
    if node is None:
        spec["allNodes"] = True
    else:
        spec["nodeName"] = node
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"}, "spec": spec}


def request(operation: str, node: str | None = "node01", user: str = PLUGIN_USER) -> dict[str, Any]:
    extra = {} if node is None else {NODE_CLAIM: [node], "authentication.kubernetes.io/pod-name": ["p"]}
    return {"operation": operation, "userInfo": {"username": user, "extra": extra}}


def for_operation(operation: str, target: dict[str, Any]) -> tuple[Any, Any]:
    return {"CREATE": (target, None), "UPDATE": (target, target), "DELETE": (None, target)}[operation]


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_the_plugin_may_write_its_own_nodes_slices_of_its_driver(policy: AdmissionPolicy, operation: str) -> None:
    assert policy.admit(request(operation), *for_operation(operation, slice_on("node01"))) == (True, [])


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
@pytest.mark.parametrize(
    ("target", "named"),
    [
        (slice_on("node02"), "node node02"),
        (slice_on("node01", driver="gpu.example.com"), "driver gpu.example.com"),
        (slice_on(None), "node (none)"),
    ],
    ids=["other-node", "other-driver", "no-node"],
)
def test_the_plugin_may_not_write_another_nodes_or_drivers_slices(
    policy: AdmissionPolicy, operation: str, target: dict[str, Any], named: str
) -> None:
    matched, failed = policy.admit(request(operation), *for_operation(operation, target))
    assert matched and failed
    assert all("the gpu-dra-plugin on node node01 may" in message and named in message for message in failed)


def test_its_own_node_in_another_pool_is_refused(policy: AdmissionPolicy) -> None:
    matched, failed = policy.admit(request("CREATE"), slice_on("node01", pool="node02"), None)
    assert matched and len(failed) == 1 and "in its node's pool" in failed[0]


def test_an_update_that_takes_another_nodes_slice_is_refused(policy: AdmissionPolicy) -> None:
    """The old object counts too: a slice of node02 rewritten to say node01 (the API server refuses the
    change of an immutable field anyway; the policy does not rely on that)."""
    matched, failed = policy.admit(request("UPDATE"), slice_on("node01"), slice_on("node02"))
    assert matched and len(failed) == 1 and "node node02" in failed[0]


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_a_token_without_a_node_may_write_nothing(policy: AdmissionPolicy, operation: str) -> None:
    matched, failed = policy.admit(request(operation, node=None), *for_operation(operation, slice_on("node01")))
    assert matched and failed and "authentication.kubernetes.io/node-name" in failed[0]


def test_a_token_naming_two_nodes_may_write_nothing(policy: AdmissionPolicy) -> None:
    ask = request("CREATE")
    ask["userInfo"]["extra"][NODE_CLAIM] = ["node01", "node02"]
    matched, failed = policy.admit(ask, slice_on("node01"), None)
    assert matched and failed


def test_other_users_are_not_this_policys_business(policy: AdmissionPolicy) -> None:
    """The kubelet (NodeRestriction), the scheduler and an administrator are judged by their own rules."""
    for user in ("system:node:node01", "system:serviceaccount:kubevirt-gpu-passthrough:other", "admin"):
        assert policy.admit(request("CREATE", node=None, user=user), slice_on("node02"), None) == (False, [])


def test_the_policy_is_bound_to_deny_and_covers_every_write_of_a_slice() -> None:
    docs = documents()
    vap, binding = docs["ValidatingAdmissionPolicy"], docs["ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == vap["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"] and "matchResources" not in binding["spec"]
    assert vap["spec"]["failurePolicy"] == "Fail"
    (rule,) = vap["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == ["resource.k8s.io"] and rule["resources"] == ["resourceslices"]
    assert rule["apiVersions"] == ["*"] and sorted(rule["operations"]) == ["CREATE", "DELETE", "UPDATE"]


def test_the_policy_file_is_in_the_build() -> None:
    assert "admission.yaml" in yaml.safe_load((DEPLOY / "dra" / "kustomization.yaml").read_text())["resources"]
    assert Path(POLICY_FILE).is_file()


@pytest.mark.parametrize("operation", ["UPDATE", "DELETE"])
def test_a_change_or_delete_without_the_old_object_is_refused(policy: AdmissionPolicy, operation: str) -> None:
    """The API server sends the stored object as ``oldObject`` on UPDATE and on DELETE (on DELETE since
    Kubernetes 1.15, kubernetes/kubernetes#76346); the policy does not rely on it: without the slice it would
    change or delete, the node it is on is unknown, so the write is refused, not admitted by default."""
    obj = slice_on("node01") if operation == "UPDATE" else None
    matched, failed = policy.admit(request(operation), obj, None)
    assert matched and failed and any("no old object" in message for message in failed)


def test_a_create_without_an_object_is_refused(policy: AdmissionPolicy) -> None:
    matched, failed = policy.admit(request("CREATE"), None, None)
    assert matched and failed


@pytest.mark.parametrize(
    "placement",
    [{"nodeSelector": {"nodeSelectorTerms": [{"matchFields": []}]}}, {"perDeviceNodeSelection": True}],
    ids=["nodeSelector", "perDeviceNodeSelection"],
)
@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_a_slice_placed_otherwise_than_by_node_name_is_refused(
    policy: AdmissionPolicy, operation: str, placement: dict[str, Any]
) -> None:
    target = slice_on(None)
    del target["spec"]["allNodes"]
    target["spec"].update(placement)
    matched, failed = policy.admit(request(operation), *for_operation(operation, target))
    assert matched and failed and all("node (none)" in message for message in failed)


def test_an_update_that_moves_its_own_slice_to_another_node_is_refused(policy: AdmissionPolicy) -> None:
    matched, failed = policy.admit(request("UPDATE"), slice_on("node02"), slice_on("node01"))
    assert matched and len(failed) == 1 and "node node02" in failed[0]
