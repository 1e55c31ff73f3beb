"""What the cluster suite's tests share: kubectl as the cluster's admin, waits with deadlines, kustomize builds
of ``deploy/`` with the patches that point a DaemonSet at a fixture host tree, and the stand-in ``/dev/vfio``.

The patches are the only changes made to ``deploy/``: this machine has no GPUs (sysfs comes from the fixture
tree of :mod:`simkit.fixture_nodes`) and no VFIO (the kubelet hands containers character nodes 1:3 made under
``/dev/vfio``, removed again after the suite).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

from simkit.sysfs_fixture import Node
from simkit.sysfs_fixture import build as build_node
from tests.cluster import kit

DEPLOY = kit.REPO / "deploy"
Doc = dict[str, Any]
T = TypeVar("T")
# A busy two-core machine starts pods slowly; these bound a wait, they are not what is tested.
POD_DEADLINE = 240.0


@dataclass
class Cluster:
    peers: kit.Peers

    def kubectl(
        self, *args: str, stdin: str | None = None, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = kit.kubectl(self.peers, *args, stdin=stdin, timeout=timeout)
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def json(self, *args: str) -> Any:
        return json.loads(self.kubectl(*args, "-o", "json").stdout)

    def apply(self, docs: Iterable[Doc], *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Server-side apply with strict field validation (an unknown field is an error, not a warning)."""
        text = yaml.safe_dump_all(list(docs), sort_keys=False)
        return self.kubectl(
            "apply",
            "--server-side",
            "--validate=strict",
            "--force-conflicts",
            *extra,
            "-f",
            "-",
            stdin=text,
            check=check,
        )

    def let_virt_controller_create_pods(self, namespace: str) -> None:
        """RBAC for KubeVirt's controller account in ``namespace``, which KubeVirt's install grants cluster-wide."""
        binding = self.kubectl(
            "create",
            "rolebinding",
            "kgp-virt-controller",
            "-n",
            namespace,
            "--clusterrole=edit",
            "--serviceaccount=kubevirt:kubevirt-controller",
            "--dry-run=client",
            "-o",
            "yaml",
        ).stdout
        self.kubectl("apply", "-f", "-", stdin=binding)

    def kustomize(self, directory: Path) -> list[Doc]:
        done = self.kubectl("kustomize", str(directory))
        return [doc for doc in yaml.safe_load_all(done.stdout) if doc]

    def node(self) -> Doc:
        node: Doc = self.json("get", "node", kit.NODE)
        return node

    def allocatable(self, resource: str) -> int:
        return int(self.node()["status"].get("allocatable", {}).get(resource, "0"))

    def label_node(self, key: str, value: str | None) -> None:
        self.kubectl("label", "node", kit.NODE, f"{key}-" if value is None else f"{key}={value}", "--overwrite")

    def pods(self, namespace: str, selector: str) -> list[Doc]:
        items: list[Doc] = self.json("get", "pods", "-n", namespace, "-l", selector)["items"]
        return items

    def exec(self, namespace: str, pod: str, container: str, *argv: str, timeout: float = 60) -> str:
        return self.kubectl("exec", "-n", namespace, pod, "-c", container, "--", *argv, timeout=timeout).stdout


def wait_until(
    what: str,
    probe: Callable[[], T | None],
    *,
    deadline: float = POD_DEADLINE,
    explain: Callable[[], str] | None = None,
) -> T:
    """``probe()`` until it returns something other than None/False; past ``deadline`` fail naming ``what``."""
    end = time.monotonic() + deadline
    while True:
        got = probe()
        if got is not None and got is not False:
            return got
        if time.monotonic() > end:
            detail = explain() if explain else ""
            raise AssertionError(f"{what}: not within {deadline:.0f} s. {detail}")
        time.sleep(0.5)


def ready_pod(cluster: Cluster, namespace: str, selector: str) -> Doc | None:
    for pod in cluster.pods(namespace, selector):
        conditions = {c["type"]: c["status"] for c in pod.get("status", {}).get("conditions", [])}
        if pod.get("metadata", {}).get("deletionTimestamp") is None and conditions.get("Ready") == "True":
            return pod
    return None


def describe_pods(cluster: Cluster, namespace: str) -> str:
    done = cluster.kubectl("get", "pods,events", "-n", namespace, "-o", "wide", check=False)
    return done.stdout[-3000:] + done.stderr[-500:]


def daemonset(docs: list[Doc], name: str) -> Doc:
    (found,) = [d for d in docs if d["kind"] == "DaemonSet" and d["metadata"]["name"] == name]
    return found


def point_at_fixture(docs: list[Doc], fixture: Path) -> list[Doc]:
    """Each DaemonSet's hostPath ``/sys`` (and ``/lib/modules``, absent here) into the fixture tree."""
    for doc in docs:
        if doc["kind"] != "DaemonSet":
            continue
        for volume in doc["spec"]["template"]["spec"].get("volumes", []):
            host = volume.get("hostPath")
            if host and host["path"] in ("/sys", "/lib/modules"):
                host["path"] = str(fixture / host["path"].lstrip("/"))
    return docs


def make_dev_vfio(groups: Iterable[str]) -> list[Path]:
    """``/dev/vfio/vfio`` and ``/dev/vfio/<group>`` as character nodes 1:3 (this kernel has no VFIO)."""
    made: list[Path] = []
    directory = Path("/dev/vfio")
    directory.mkdir(exist_ok=True)
    for name in ("vfio", *groups):
        path = directory / name
        if not path.exists():
            os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            made.append(path)
    return made


def fixture_tree(node: Node) -> tuple[Path, list[Path]]:
    """``node``'s fixture tree under the kit's state (built once) and the stand-in ``/dev/vfio`` nodes of its groups;
    returns the tree and the nodes made here (for :func:`remove_dev_vfio`)."""
    root = kit.STATE / "fixtures" / node.name
    if not (root / "sys").exists():
        build_node(node, root)
    (root / "lib" / "modules").mkdir(parents=True, exist_ok=True)
    return root, make_dev_vfio(sorted(p.name for p in (root / "dev" / "vfio").iterdir() if p.name.isdigit()))


def remove_dev_vfio(made: Iterable[Path]) -> None:
    for path in made:
        path.unlink(missing_ok=True)


def env_of(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def iter_events(cluster: Cluster, namespace: str) -> Iterator[Doc]:
    yield from cluster.json("get", "events", "-n", namespace)["items"]


RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
RTX_ENV = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
PLUGIN_NAMESPACE = "kubevirt-gpu-passthrough"
PLUGIN_SELECTOR = "app.kubernetes.io/name=gpu-device-plugin"
WORKLOAD_LABEL = "nvidia.com/gpu.workload.config"


def deploy_plugin(cluster: Cluster, fixture: Path) -> list[Doc]:
    """``deploy/device-plugin`` as it is, its ``/sys`` pointed at the fixture tree; applied (idempotent)."""
    docs = point_at_fixture(cluster.kustomize(DEPLOY / "device-plugin"), fixture)
    cluster.apply(docs)
    return docs


def plugin_serving(cluster: Cluster, count: int = 4) -> Doc:
    """Wait for the plugin pod Ready (its /readyz: registered) and the node's allocatable to show ``count``."""
    pod = wait_until(
        "the device plugin pod Ready",
        lambda: ready_pod(cluster, PLUGIN_NAMESPACE, PLUGIN_SELECTOR),
        explain=lambda: describe_pods(cluster, PLUGIN_NAMESPACE),
    )
    wait_until(
        f"allocatable {RTX} = {count}",
        lambda: cluster.allocatable(RTX) == count,
        explain=lambda: f"allocatable is {cluster.node()['status'].get('allocatable')}",
    )
    return pod


def cluster_session(release: str = "kube") -> Iterator[Cluster]:
    """A test session's cluster of ``release`` (a package fixture's body, ``yield from``): up with the project's
    image, then down with nothing left. A missing piece (not root, the peers cannot be built) fails under
    ``CI=true`` and skips elsewhere. A cluster already up is used and left up, unless it runs another release:
    that fails naming it. ``KGP_CLUSTER_KEEP=1`` leaves the session's cluster up."""
    from tests.cluster import images
    from tests.libvirt_support import missing

    if os.geteuid() != 0:
        missing("the real cluster runs as root (kubelet, containerd, runc)", "cluster piece missing")
    try:
        peers = kit.build_peers(tuple(dict.fromkeys(("kube", "etcd", "containerd", "buildkit", "kubevirt", release))))
    except kit.ClusterError as exc:
        missing(f"the peers cannot be built: {exc}", "cluster piece missing")
        raise  # unreachable
    was_up = kit.pid_of("kube-apiserver") is not None or kit.pid_of("kubelet") is not None
    if was_up and kit.running_release() != release:
        raise AssertionError(
            f"a Kubernetes {kit.RELEASES[kit.running_release()]} cluster is up; this suite runs "
            f"{kit.RELEASES[release]} on the same node (scripts/cluster.sh down, or run without KGP_CLUSTER_KEEP=1)"
        )
    try:
        kit.up(peers, release=release)
        images.build_project_image(peers)
    except BaseException:
        if not was_up:  # a cluster half up is not left behind
            kit.down()
        raise
    yield Cluster(peers)
    if not was_up and os.environ.get("KGP_CLUSTER_KEEP") != "1":
        problems = kit.down()
        assert not problems, f"scripts/cluster.sh down left: {problems}"
