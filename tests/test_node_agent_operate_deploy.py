"""deploy/components/node-label-protocol: the operate DaemonSet, its RBAC, and the policy that keeps each node's
agent to its own Node's labels and annotations of our key set.

The ValidatingAdmissionPolicy's CEL is evaluated with cel-python on admission requests as the API server builds
them for a PATCH of a Node (an ``UPDATE``: ``object`` the patched Node, ``oldObject`` the stored one;
``variables`` in order), its match condition first, then every validation must be exactly ``true``. The key set
it allows is checked against the agent's own (:mod:`node_agent.protocol`).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from node_agent.preparer import FEATURE_LABELS
from node_agent.protocol import (
    ANNOTATION_PREFIX,
    ANNOTATIONS,
    PAUSED,
    PLUGIN_DEPLOY_LABEL,
    STATE_LABELS,
    WORKLOAD_STATE_LABEL,
)
from tests.admission_support import AdmissionPolicy
from tests.test_deploy import DEPLOY, kustomize_build, load_all

COMPONENT = DEPLOY / "components" / "node-label-protocol"
AGENT = "system:serviceaccount:kubevirt-gpu-passthrough:gpu-node-agent"
NODE_CLAIM = "authentication.kubernetes.io/node-name"


@pytest.fixture(scope="module")
def policy() -> AdmissionPolicy:
    docs = {doc["kind"]: doc for doc in load_all((COMPONENT / "admission.yaml").read_text())}
    assert docs["ValidatingAdmissionPolicyBinding"]["spec"]["validationActions"] == ["Deny"]
    return AdmissionPolicy(docs["ValidatingAdmissionPolicy"])


def node(name: str = "node01", labels: dict[str, str] | None = None, notes: dict[str, str] | None = None) -> Any:
    base = {"kubernetes.io/hostname": name, "nvidia.com/gpu.workload.config": "vm-passthrough"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {**base, **(labels or {})},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0", **(notes or {})},
        },
        "spec": {"podCIDR": "10.0.0.0/24"},
    }


def update(obj: Any, caller: str | None = "node01", user: str = AGENT, sub: str = "") -> dict[str, Any]:
    """An admission request as the API server gives it to CEL: ``subResource`` only for a subresource (the real
    API server's request has no such key otherwise: reading it unguarded is an evaluation error, a denial)."""
    extra = {} if caller is None else {NODE_CLAIM: [caller]}
    request: dict[str, Any] = {
        "operation": "UPDATE",
        "name": obj["metadata"]["name"],
        "userInfo": {"username": user, "extra": extra},
    }
    if sub:
        request["subResource"] = sub
    return request


def changed(old: Any, labels: dict[str, str | None] | None = None, notes: dict[str, str | None] | None = None) -> Any:
    new = copy.deepcopy(old)
    for key, value in (labels or {}).items():
        if value is None:
            new["metadata"]["labels"].pop(key, None)
        else:
            new["metadata"]["labels"][key] = value
    for key, value in (notes or {}).items():
        if value is None:
            new["metadata"]["annotations"].pop(key, None)
        else:
            new["metadata"]["annotations"][key] = value
    return new


def test_the_agent_may_write_its_own_keys_on_its_own_node(policy: AdmissionPolicy) -> None:
    old = node(labels={PLUGIN_DEPLOY_LABEL: "true"})
    pause = changed(
        old,
        {PLUGIN_DEPLOY_LABEL: PAUSED, WORKLOAD_STATE_LABEL: "pending", "nvidia.com/gpu.count": "2"},
        {ANNOTATION_PREFIX + "workload.config.message": "applying"},
    )
    assert policy.admit(update(pause), pause, old) == (True, [])
    restore = changed(pause, {PLUGIN_DEPLOY_LABEL: None, "nvidia.com/gpu.count": None})
    assert policy.admit(update(restore), restore, pause) == (True, [])


@pytest.mark.parametrize(
    ("labels", "notes"),
    [
        ({"nvidia.com/gpu.workload.config": "container"}, None),  # the user's choice, not the agent's
        ({"kubernetes.io/hostname": None}, None),
        ({"node-role.kubernetes.io/control-plane": ""}, None),
        (None, {"node.alpha.kubernetes.io/ttl": "30"}),
        (None, {"example.com/mine": "x"}),
    ],
)
def test_the_agent_may_not_touch_anyone_elses_labels_or_annotations(
    policy: AdmissionPolicy, labels: dict[str, str | None] | None, notes: dict[str, str | None] | None
) -> None:
    old = node()
    new = changed(old, labels, notes)
    matched, failed = policy.admit(update(new), new, old)
    assert matched and failed


def test_the_agent_may_not_write_another_node_or_the_spec_or_status(policy: AdmissionPolicy) -> None:
    old = node("node02")
    new = changed(old, {WORKLOAD_STATE_LABEL: "success"})
    assert policy.admit(update(new, caller="node01"), new, old)[1]  # another node's
    assert policy.admit(update(new, caller=None), new, old)[1]  # a token without a node
    mine = node()
    spec = copy.deepcopy(mine)
    spec["spec"]["unschedulable"] = True
    assert policy.admit(update(spec), spec, mine)[1]
    status = changed(mine, {WORKLOAD_STATE_LABEL: "success"})
    assert policy.admit(update(status, sub="status"), status, mine)[1]
    delete = {**update(mine), "operation": "DELETE"}
    assert policy.admit(delete, None, mine)[1]


def test_the_policy_leaves_everyone_else_alone(policy: AdmissionPolicy) -> None:
    old = node()
    new = changed(old, {"nvidia.com/gpu.workload.config": "container"})
    assert policy.admit(update(new, user="system:serviceaccount:gpu-operator:gpu-operator"), new, old) == (False, [])


def test_the_policy_allows_exactly_the_agents_key_set() -> None:
    (doc,) = [doc for doc in load_all((COMPONENT / "admission.yaml").read_text()) if doc["kind"].endswith("Policy")]
    variables = {item["name"]: item["expression"] for item in doc["spec"]["variables"]}
    assert yaml.safe_load(variables["ourLabels"]) == list(STATE_LABELS)
    assert yaml.safe_load(variables["featurePrefixes"]) == list(FEATURE_LABELS)
    assert all(key.startswith(ANNOTATION_PREFIX) for key in ANNOTATIONS)
    assert f'"{ANNOTATION_PREFIX}"' in " ".join(item["expression"] for item in doc["spec"]["validations"])


def test_the_component_runs_operate_everywhere_and_replaces_the_per_workload_agents(tmp_path: Path) -> None:
    top = os.path.relpath(DEPLOY, tmp_path)
    component = os.path.relpath(COMPONENT, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [top], "components": [component]}))
    built = kustomize_build(tmp_path)
    daemonsets = {doc["metadata"]["name"]: doc for doc in built if doc["kind"] == "DaemonSet"}
    assert set(daemonsets) == {"gpu-device-plugin", "gpu-node-agent"}
    agent = daemonsets["gpu-node-agent"]
    pod = agent["spec"]["template"]["spec"]
    assert agent["metadata"]["namespace"] == "kubevirt-gpu-passthrough"
    assert pod["containers"][0]["args"] == ["operate"]
    assert pod["automountServiceAccountToken"] is True
    env = {item["name"]: item for item in pod["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    mounts = {mount["mountPath"] for mount in pod["containers"][0]["volumeMounts"]}
    assert {"/host/sys", "/host/dev/vfio", "/var/lib/kubelet/pod-resources", "/run/nvidia/validations"} <= mounts
    (account,) = [
        doc for doc in built if doc["kind"] == "ServiceAccount" and doc["metadata"]["name"] == "gpu-node-agent"
    ]
    assert account["automountServiceAccountToken"] is True
    (role,) = [doc for doc in built if doc["kind"] == "ClusterRole" and doc["metadata"]["name"] == "gpu-node-agent"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]}]
    plugin = daemonsets["gpu-device-plugin"]["spec"]["template"]["spec"]["affinity"]["nodeAffinity"]
    terms = plugin["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert {"key": PLUGIN_DEPLOY_LABEL, "operator": "NotIn", "values": [PAUSED]} in terms[0]["matchExpressions"]
