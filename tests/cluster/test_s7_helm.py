"""Scenario 7: the Helm chart, installed into the real cluster, stores the same objects as the kustomize apply.

For a few of tests/test_helm_chart.py's variants: the kustomize build is applied server-side and each object
read back from the API server, then deleted; the chart is installed with the variant's values (``helm install``,
the release record in ``default``) and each object read back again. The two must be equal once the fields the
API server writes itself (uid, resourceVersion, timestamps, managedFields, status) are set aside; the only other
difference allowed is Helm's ownership metadata, which ``helm install`` adds to every object it creates (the
label ``app.kubernetes.io/managed-by: Helm``, the annotations ``meta.helm.sh/release-name`` and
``meta.helm.sh/release-namespace``; docs/helm.md, "What a release owns"). ``helm uninstall`` must then remove
every object. The DaemonSets place nothing: the node carries no workload label here.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster import kit
from tests.cluster.support import WORKLOAD_LABEL, Cluster, Doc, wait_until
from tests.helm_support import CHART
from tests.test_helm_chart import VARIANTS, key, kustomized, set_flags

pytestmark = pytest.mark.cluster

RELEASE = "kgp-s7"
RELEASE_NAMESPACE = "default"  # not one the chart creates: Helm would not take over a Namespace it made itself
OWNERSHIP_LABELS = {"app.kubernetes.io/managed-by": "Helm"}
OWNERSHIP_ANNOTATIONS = {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": RELEASE_NAMESPACE}
SERVER_FIELDS = ("uid", "resourceVersion", "generation", "creationTimestamp", "managedFields", "selfLink")
GONE_DEADLINE = 180.0  # namespaces finish deleting once their contents are gone; bounds a wait, not tested


@pytest.fixture(scope="module")
def helm_binary() -> Path:
    return kit.build_peers(("helm",)).binary("helm", "helm")


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [str(helm), f"--kubeconfig={kit.STATE / 'admin.kubeconfig'}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"helm {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}"
    return done


def resource(doc: Doc) -> str:
    """kubectl's fully qualified name of the kind: Kind.version.group (core: Kind)."""
    group, _, version = doc["apiVersion"].rpartition("/")
    return f"{doc['kind']}.{version}.{group}" if group else str(doc["kind"])


def read_back(cluster: Cluster, doc: Doc) -> Doc | None:
    namespace = doc["metadata"].get("namespace")
    done = cluster.kubectl(
        "get", resource(doc), doc["metadata"]["name"], *(["-n", namespace] if namespace else []), "-o", "json",
        "--ignore-not-found", check=True,
    )  # fmt: skip
    if not done.stdout.strip():
        return None
    stored: Doc = yaml.safe_load(done.stdout)
    return stored


def stored_as_written(stored: Doc) -> Doc:
    """``stored`` without what the API server writes itself."""
    stored = {name: value for name, value in stored.items() if name != "status"}
    meta = {name: value for name, value in stored["metadata"].items() if name not in SERVER_FIELDS}
    annotations = {
        name: value
        for name, value in meta.get("annotations", {}).items()
        if name != "kubectl.kubernetes.io/last-applied-configuration"
    }
    meta.pop("annotations", None)
    if annotations:
        meta["annotations"] = annotations
    return {**stored, "metadata": meta}


def without_helms_ownership(stored: Doc) -> Doc:
    """``stored`` without Helm's ownership metadata, asserting it is there, exactly."""
    meta: dict[str, Any] = dict(stored["metadata"])
    labels, annotations = dict(meta.get("labels", {})), dict(meta.get("annotations", {}))
    for mapping, expected in ((labels, OWNERSHIP_LABELS), (annotations, OWNERSHIP_ANNOTATIONS)):
        for name, value in expected.items():
            assert mapping.pop(name, None) == value, f"{key(stored)}: no {name}={value}"
    for field, mapping in (("labels", labels), ("annotations", annotations)):
        meta.pop(field, None)
        if mapping:
            meta[field] = mapping
    return {**stored, "metadata": meta}


def wait_gone(cluster: Cluster, docs: list[Doc], what: str) -> None:
    def left() -> list[tuple[str, str, str, str]]:
        return [key(doc) for doc in docs if read_back(cluster, doc) is not None]

    wait_until(what, lambda: not left(), deadline=GONE_DEADLINE, explain=lambda: f"left: {left()}")


def delete_and_wait(cluster: Cluster, docs: list[Doc]) -> None:
    cluster.kubectl(
        "delete", "--ignore-not-found", "--wait=true", "-f", "-", stdin=yaml.safe_dump_all(docs), timeout=GONE_DEADLINE
    )
    wait_gone(cluster, docs, "the objects to be gone")


@pytest.mark.parametrize("name", ["deploy", "plugin-api", "dra"])
def test_helm_install_stores_what_the_kustomize_apply_stores_and_uninstall_removes_it(
    cluster: Cluster, helm_binary: Path, tmp_path: Path, name: str
) -> None:
    cluster.label_node(WORKLOAD_LABEL, None)  # the DaemonSets place nothing
    variant = VARIANTS[name]
    docs = kustomized(variant, tmp_path)
    delete_and_wait(cluster, docs)  # what earlier scenarios applied of it: Helm takes over nothing

    cluster.apply(docs)
    applied = {}
    for doc in docs:
        stored = read_back(cluster, doc)
        assert stored is not None, key(doc)
        applied[key(doc)] = stored_as_written(stored)
    delete_and_wait(cluster, docs)

    run_helm(helm_binary, "install", RELEASE, str(CHART), "-n", RELEASE_NAMESPACE, *set_flags(variant.values))
    try:
        manifest = [d for d in yaml.safe_load_all(run_helm(helm_binary, "get", "manifest", RELEASE,
                                                           "-n", RELEASE_NAMESPACE).stdout) if d]  # fmt: skip
        assert sorted(key(d) for d in manifest) == sorted(applied)
        for doc in docs:
            stored = read_back(cluster, doc)
            assert stored is not None, key(doc)
            assert without_helms_ownership(stored_as_written(stored)) == applied[key(doc)], key(doc)
    finally:
        run_helm(helm_binary, "uninstall", RELEASE, "-n", RELEASE_NAMESPACE, "--wait", "--timeout", "3m")
    wait_gone(cluster, docs, "helm uninstall to remove every object")
