"""A real one-node Kubernetes on this machine: etcd, the API server, controller manager, scheduler, kubelet and
containerd 2, each built from its Go module (``tests/cluster/build-peers.sh``) and run as the project's judge.

Why: every Kubernetes-facing behaviour of the project (registration with the kubelet, Allocate's answer reaching
a container, the DaemonSets' placement, the admission policies' CEL, the image itself) must be seen by the real
components, not only by the stand-ins in ``simkit/`` that agree with the project by construction.

The layout follows Kubernetes' ``hack/local-up-cluster.sh``: everything on loopback, one CA, certificates and
kubeconfigs made here (``pki.py``). What this machine needs and the kit sets (docs/real-cluster.md says why):
cgroup v1 with the cgroupfs driver (``failCgroupV1: false``), containerd's ``restrict_oom_score_adj`` (root
lacks CAP_SYS_RESOURCE), CDI on, Debian's runc and CNI plugins, a bridge network ``kgp0`` for pods (no masquerade,
no iptables rules), images made locally and never pulled.

Every wait has a deadline and an error naming what did not come up, with the end of its log. ``down`` stops every
process the kit started (and the containers' processes and shims), unmounts what they mounted, removes the
bridge, the cgroups, the state and the host directories that did not exist before ``up``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.cluster import pki

REPO = Path(__file__).resolve().parents[2]
STATE = Path(os.environ.get("KGP_CLUSTER_STATE", "/var/lib/kgp-cluster"))
RUN = Path(os.environ.get("KGP_CLUSTER_RUN", "/run/kgp-cluster"))
KUBELET_ROOT = Path("/var/lib/kubelet")
NODE = "node01"
# The API server listens where pods look for it: the `kubernetes` Service's address (the first of the service
# range) and port, which `up` puts on the kit's bridge. No kube-proxy runs (it would write iptables rules on the
# machine), so this is how a pod's in-cluster configuration (KUBERNETES_SERVICE_HOST/PORT) reaches the API server
# unchanged: the DRA plugin publishes ResourceSlices from its pod, as on a real node.
API_HOST = "10.96.0.1"
API_PORT = 443
ETCD_CLIENT = "http://127.0.0.1:23791"
ETCD_PEER = "http://127.0.0.1:23801"
BRIDGE = "kgp0"
POD_SUBNET = "10.244.0.0/24"
# The node's address: the pod bridge's gateway, which `up` puts on the bridge it makes. The kubelet refuses a
# loopback node IP, and this machine has no dummy interfaces; the bridge is the kit's own and goes at `down`.
NODE_IP = "10.244.0.1"
SERVICE_RANGE = "10.96.0.0/16"
PAUSE_IMAGE = "localhost/kgp-pause:3.10"
# Host directories the components (or the project's DaemonSets, through hostPath DirectoryOrCreate) may create;
# `down` removes those that did not exist at `up`.
HOST_DIRS = (
    KUBELET_ROOT,
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/var/lib/cni"),
    Path("/run/kubevirt-gpu-passthrough"),
    Path("/var/run/cdi"),
    Path("/etc/cdi"),
    Path("/dev/vfio"),
)
# Start order; `down` stops in the reverse order.
COMPONENTS = ("containerd", "etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet")
FEATURE_GATES: dict[str, bool] = {}
"""Gates every component gets. None is needed for what ``deploy/`` uses on 1.36: ValidatingAdmissionPolicy and
DRA (``resource.k8s.io/v1``) are GA, MutatingAdmissionPolicy went GA in 1.36 (on by default). DRA's device
metadata (KEP-5304) has no gate in 1.36 yet; the DRA suite adds what it needs here."""
FIGURES = Path.home() / ".cache" / "kubevirt-gpu-passthrough" / "cluster-figures.json"
"""The last suite's measured figures (health latency), kept beside the peers' cache for docs/real-cluster.md."""
UP_DEADLINE = 180.0


class ClusterError(RuntimeError):
    """The cluster did not come up, or did not go down cleanly; the message names the component."""


def say(message: str) -> None:
    print(f"cluster: {message}", file=sys.stderr, flush=True)


@dataclass
class Peers:
    """The bin directories of the built peers (``build-peers.sh`` prints them)."""

    dirs: dict[str, Path] = field(default_factory=dict)

    def binary(self, peer: str, name: str) -> Path:
        path = self.dirs[peer] / name
        if not path.is_file():
            raise ClusterError(f"{name} is not in {self.dirs[peer]} (tests/cluster/build-peers.sh {peer})")
        return path


def build_peers(names: Sequence[str] = ("kube", "etcd", "containerd", "buildkit", "kubevirt")) -> Peers:
    """Run ``build-peers.sh`` (fast when every pin is built; a cold build takes long and says so)."""
    script = REPO / "tests" / "cluster" / "build-peers.sh"
    try:
        done = subprocess.run(
            ["bash", str(script), *names], stdout=subprocess.PIPE, text=True, timeout=5400, check=False
        )
    except subprocess.TimeoutExpired as exc:
        raise ClusterError(f"building the peers took over 90 min: {exc}") from exc
    if done.returncode != 0:
        raise ClusterError(f"{script} {' '.join(names)} exited {done.returncode} (its errors are above)")
    peers = Peers()
    for line in done.stdout.splitlines():
        name, _, directory = line.partition("=")
        if directory:
            peers.dirs[name] = Path(directory)
    missing = [name for name in names if name not in peers.dirs]
    if missing:
        raise ClusterError(f"build-peers.sh did not name {', '.join(missing)}")
    return peers


# -- files ----------------------------------------------------------------------------------------------------


def _containerd_config(peers: Peers) -> str:
    return f"""version = 3
root = "{STATE / "containerd"}"
state = "{RUN / "containerd"}"

[grpc]
  address = "{RUN / "containerd" / "containerd.sock"}"

[plugins.'io.containerd.internal.v1.opt']
  path = "{STATE / "containerd-opt"}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"

[plugins.'io.containerd.cri.v1.runtime']
  enable_cdi = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  # Root here lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below the caller's, so pod sandboxes
  # fail unless the CRI keeps the kubelet's values at or above containerd's own.
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "/usr/sbin/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "{STATE / "cni"}"
    max_conf_num = 1
"""


def _cni_config() -> str:
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "kgp",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP, "rangeStart": "10.244.0.10"}]],
                        "routes": [{"dst": "0.0.0.0/0"}],
                        "dataDir": str(STATE / "cni-ipam"),
                    },
                }
            ],
        },
        indent=2,
    )


def _kubelet_config() -> str:
    gates = "".join(f"\n  {name}: {str(on).lower()}" for name, on in FEATURE_GATES.items()) or " {}"
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: {NODE_IP}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {STATE / "pki" / "ca.crt"}}}
authorization: {{mode: Webhook}}
tlsCertFile: {STATE / "pki" / "kubelet-serving.crt"}
tlsPrivateKeyFile: {STATE / "pki" / "kubelet-serving.key"}
containerRuntimeEndpoint: unix://{RUN / "containerd" / "containerd.sock"}
cgroupDriver: cgroupfs
# This machine has cgroup v1 (hybrid); Kubernetes 1.35+ refuses it unless told.
failCgroupV1: false
failSwapOn: false
staticPodPath: {STATE / "manifests"}
clusterDomain: cluster.local
# No DNS server runs; the address makes the kubelet write the cluster search path (<namespace>.svc.…) into
# pods' resolv.conf, as on a real cluster (the hook reads its namespace from it).
clusterDNS: ["10.96.0.10"]
resolvConf: /etc/resolv.conf
serializeImagePulls: false
# A test machine's disk is shared with other work: never evict or collect images for disk pressure.
evictionHard: {{memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
nodeStatusUpdateFrequency: 2s
syncFrequency: 10s
featureGates:{gates}
"""


def _gate_flag() -> list[str]:
    if not FEATURE_GATES:
        return []
    return ["--feature-gates=" + ",".join(f"{name}={str(on).lower()}" for name, on in FEATURE_GATES.items())]


RELEASES = {"kube": "1.36", "kube134": "1.34"}
"""The Kubernetes builds the kit can run (peers of ``build-peers.sh``): 1.36, and 1.34, the oldest release
``deploy/dra`` and ``serve --dra`` claim (``resource.k8s.io/v1``), for the DRA suite (tests/cluster_oldest).
kubectl always comes from ``kube`` (it speaks to both)."""


def running_release() -> str:
    """The peer whose Kubernetes binaries the cluster runs (``kube`` unless ``up`` was told otherwise)."""
    try:
        name = (STATE / "kube-peer").read_text().strip()
    except OSError:
        return "kube"
    return name if name in RELEASES else "kube"


def _commands(peers: Peers, release: str | None = None) -> dict[str, list[str]]:
    p = STATE / "pki"
    kube = peers.dirs[release or running_release()]
    return {
        "containerd": [str(peers.binary("containerd", "containerd")), "--config", str(STATE / "containerd.toml")],
        "etcd": [
            str(peers.binary("etcd", "server")),
            "--name=kgp",
            f"--data-dir={STATE / 'etcd'}",
            f"--listen-client-urls={ETCD_CLIENT}",
            f"--advertise-client-urls={ETCD_CLIENT}",
            f"--listen-peer-urls={ETCD_PEER}",
            f"--initial-advertise-peer-urls={ETCD_PEER}",
            f"--initial-cluster=kgp={ETCD_PEER}",
            "--listen-metrics-urls=http://127.0.0.1:23811",
            # A test cluster on a shared disk: durability is not what is tested.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ],
        "kube-apiserver": [
            str(kube / "kube-apiserver"),
            f"--bind-address={API_HOST}",
            f"--advertise-address={API_HOST}",
            f"--secure-port={API_PORT}",
            f"--etcd-servers={ETCD_CLIENT}",
            f"--service-cluster-ip-range={SERVICE_RANGE}",
            "--endpoint-reconciler-type=none",
            f"--client-ca-file={p / 'ca.crt'}",
            f"--tls-cert-file={p / 'apiserver.crt'}",
            f"--tls-private-key-file={p / 'apiserver.key'}",
            f"--kubelet-client-certificate={p / 'apiserver-kubelet-client.crt'}",
            f"--kubelet-client-key={p / 'apiserver-kubelet-client.key'}",
            f"--kubelet-certificate-authority={p / 'ca.crt'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--service-account-key-file={p / 'service-account.pub'}",
            f"--service-account-signing-key-file={p / 'service-account.key'}",
            "--service-account-issuer=https://kubernetes.default.svc",
            "--authorization-mode=Node,RBAC",
            "--enable-admission-plugins=NodeRestriction",
            "--allow-privileged=true",
            "--profiling=false",
            *_gate_flag(),
        ],
        "kube-controller-manager": [
            str(kube / "kube-controller-manager"),
            f"--kubeconfig={STATE / 'controller-manager.kubeconfig'}",
            f"--authentication-kubeconfig={STATE / 'controller-manager.kubeconfig'}",
            f"--authorization-kubeconfig={STATE / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1",
            f"--service-account-private-key-file={p / 'service-account.key'}",
            f"--root-ca-file={p / 'ca.crt'}",
            "--use-service-account-credentials=true",
            f"--cluster-signing-cert-file={p / 'ca.crt'}",
            f"--cluster-signing-key-file={p / 'ca.key'}",
            "--leader-elect=false",
            "--profiling=false",
            *_gate_flag(),
        ],
        "kube-scheduler": [
            str(kube / "kube-scheduler"),
            f"--kubeconfig={STATE / 'scheduler.kubeconfig'}",
            f"--authentication-kubeconfig={STATE / 'scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={STATE / 'scheduler.kubeconfig'}",
            "--bind-address=127.0.0.1",
            "--leader-elect=false",
            "--profiling=false",
            *_gate_flag(),
        ],
        "kubelet": [
            str(kube / "kubelet"),
            f"--config={STATE / 'kubelet.yaml'}",
            f"--kubeconfig={STATE / 'kubelet.kubeconfig'}",
            f"--hostname-override={NODE}",
            f"--node-ip={NODE_IP}",
            f"--root-dir={KUBELET_ROOT}",
            "--v=2",
        ],
    }


def write_files(peers: Peers) -> None:
    for directory in (
        STATE / "pki",
        STATE / "cni",
        STATE / "manifests",
        STATE / "logs",
        STATE / "pids",
        RUN / "containerd",
    ):
        directory.mkdir(parents=True, exist_ok=True)
    p = STATE / "pki"
    pki.make_ca(p)
    server = f"https://{API_HOST}:{API_PORT}"
    for who in (
        pki.Identity(
            "apiserver",
            "kube-apiserver",
            server=True,
            sans=(
                "DNS:localhost",
                "DNS:kubernetes",
                "DNS:kubernetes.default",
                "DNS:kubernetes.default.svc",
                "DNS:kubernetes.default.svc.cluster.local",
                "IP:127.0.0.1",
                "IP:10.96.0.1",
            ),
        ),
        pki.Identity("admin", "kgp-admin", groups=("system:masters",)),
        pki.Identity("apiserver-kubelet-client", "kube-apiserver-kubelet-client", groups=("system:masters",)),
        pki.Identity("controller-manager", "system:kube-controller-manager"),
        pki.Identity("scheduler", "system:kube-scheduler"),
        pki.Identity("kubelet", f"system:node:{NODE}", groups=("system:nodes",)),
        pki.Identity("kubelet-serving", NODE, server=True, sans=(f"DNS:{NODE}", f"IP:{NODE_IP}")),
    ):
        pki.issue(p, who)
    pki.make_service_account_keys(p)
    for user, name in (
        ("admin", "admin"),
        ("controller-manager", "controller-manager"),
        ("scheduler", "scheduler"),
        ("kubelet", "kubelet"),
    ):
        pki.kubeconfig(STATE / f"{name}.kubeconfig", server=server, pki=p, user=user)
    (STATE / "containerd.toml").write_text(_containerd_config(peers))
    (STATE / "cni" / "10-kgp.conflist").write_text(_cni_config())
    (STATE / "kubelet.yaml").write_text(_kubelet_config())


# -- processes ------------------------------------------------------------------------------------------------


def _pidfile(name: str) -> Path:
    return STATE / "pids" / f"{name}.pid"


def pid_of(name: str) -> int | None:
    """The live process the kit started as ``name``, or None."""
    try:
        pid = int(_pidfile(name).read_text())
        exe = os.readlink(f"/proc/{pid}/exe")
    except (OSError, ValueError):
        return None
    return pid if Path(exe).name.removesuffix(" (deleted)") in (name, "server") else None


def log_tail(name: str, lines: int = 25) -> str:
    try:
        text = (STATE / "logs" / f"{name}.log").read_text(errors="replace")
    except OSError:
        return f"(no log for {name})"
    return "\n".join(text.splitlines()[-lines:])


def start(name: str, argv: list[str], peers: Peers) -> None:
    if pid_of(name):
        return
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(peers.dirs["containerd"]), "/usr/sbin", "/usr/bin", "/sbin", "/bin"])
    with (STATE / "logs" / f"{name}.log").open("ab") as log:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
            cwd=STATE,
        )
    _pidfile(name).write_text(str(process.pid))
    say(f"started {name} (pid {process.pid}; log {STATE / 'logs' / (name + '.log')})")


def wait_for(what: str, check: Callable[[], bool], *, component: str, deadline: float = UP_DEADLINE) -> None:
    """Poll ``check`` until true; past ``deadline`` seconds (or when ``component`` dies) fail naming ``what``."""
    end = time.monotonic() + deadline
    said = time.monotonic()
    while True:
        if check():
            return
        if component and pid_of(component) is None:
            raise ClusterError(f"{component} exited while waiting for {what}; its log ends:\n{log_tail(component)}")
        if time.monotonic() > end:
            raise ClusterError(f"{what}: not within {deadline:.0f} s; {component}'s log ends:\n{log_tail(component)}")
        if time.monotonic() - said > 15:
            say(f"still waiting for {what}")
            said = time.monotonic()
        time.sleep(0.5)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return bool(answer.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def kubectl_path(peers: Peers) -> Path:
    return peers.dirs["kube"] / "kubectl"


def kubectl(
    peers: Peers, *args: str, stdin: str | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(kubectl_path(peers)), f"--kubeconfig={STATE / 'admin.kubeconfig'}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _api_ready(peers: Peers) -> bool:
    try:
        return kubectl(peers, "get", "--raw=/readyz", timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _node_ready(peers: Peers) -> bool:
    try:
        done = kubectl(
            peers, "get", "node", NODE, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}", timeout=20
        )
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0 and done.stdout.strip() == "True"


def _default_service_account(peers: Peers) -> bool:
    try:
        return kubectl(peers, "get", "serviceaccount", "default", "-n", "default", timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def _record_host_dirs() -> None:
    path = STATE / "host-dirs.json"
    if path.exists():
        return
    absent = [str(d) for d in HOST_DIRS if not d.exists()]
    path.write_text(json.dumps(absent))


def up(peers: Peers | None = None, release: str = "kube") -> Peers:
    """Bring the cluster up (or check that it is up) with the Kubernetes of peer ``release``; returns the peers.

    A cluster already up with another release is an error naming both (``down`` it first)."""
    if os.geteuid() != 0:
        raise ClusterError("the cluster kit runs as root (kubelet, containerd and runc need it)")
    if release not in RELEASES:
        raise ClusterError(f"no Kubernetes release {release!r}; the kit runs {sorted(RELEASES)}")
    if pid_of("kube-apiserver") is not None and running_release() != release:
        raise ClusterError(
            f"a Kubernetes {RELEASES[running_release()]} cluster is up; {RELEASES[release]} was asked for "
            "(scripts/cluster.sh down first)"
        )
    peers = peers or build_peers(("kube", "etcd", "containerd", "buildkit", "kubevirt", release))
    started = time.monotonic()
    STATE.mkdir(parents=True, exist_ok=True)
    _record_host_dirs()
    (STATE / "kube-peer").write_text(release)
    write_files(peers)
    make_bridge()
    commands = _commands(peers, release)
    start("containerd", commands["containerd"], peers)
    wait_for("containerd's socket", (RUN / "containerd" / "containerd.sock").exists, component="containerd")
    start("etcd", commands["etcd"], peers)
    wait_for("etcd's /health", lambda: _http_ok(f"{ETCD_CLIENT}/health"), component="etcd")
    start("kube-apiserver", commands["kube-apiserver"], peers)
    wait_for("the API server's /readyz", lambda: _api_ready(peers), component="kube-apiserver")
    for name in ("kube-controller-manager", "kube-scheduler"):
        start(name, commands[name], peers)
    from tests.cluster import images  # the pause image must be in containerd before the kubelet's first pod

    images.ensure_pause(peers)
    start("kubelet", commands["kubelet"], peers)
    wait_for(f"node {NODE} Ready", lambda: _node_ready(peers), component="kubelet")
    wait_for(
        "the default service account", lambda: _default_service_account(peers), component="kube-controller-manager"
    )
    install_kubevirt_crds(peers)
    say(f"up in {time.monotonic() - started:.0f} s; KUBECONFIG={STATE / 'admin.kubeconfig'}")
    return peers


def _ip(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)


def make_bridge() -> None:
    """The pods' bridge with the node's address (the CNI bridge plugin then finds it made)."""
    if not Path(f"/sys/class/net/{BRIDGE}").exists():
        made = _ip("link", "add", BRIDGE, "type", "bridge")
        if made.returncode != 0:
            raise ClusterError(f"ip link add {BRIDGE} type bridge: {made.stderr.strip()}")
    if NODE_IP not in _ip("-4", "-o", "addr", "show", "dev", BRIDGE).stdout:
        added = _ip("addr", "add", f"{NODE_IP}/24", "dev", BRIDGE)
        if added.returncode != 0:
            raise ClusterError(f"ip addr add {NODE_IP}/24 dev {BRIDGE}: {added.stderr.strip()}")
    if f"{API_HOST}/32" not in _ip("-4", "-o", "addr", "show", "dev", BRIDGE).stdout:
        added = _ip("addr", "add", f"{API_HOST}/32", "dev", BRIDGE)
        if added.returncode != 0:
            raise ClusterError(f"ip addr add {API_HOST}/32 dev {BRIDGE}: {added.stderr.strip()}")
    _ip("link", "set", BRIDGE, "up")


def install_kubevirt_crds(peers: Peers) -> None:
    """KubeVirt's CRDs as KubeVirt's own code makes them (``kubevirt-crds``), applied and Established."""
    done = subprocess.run(
        [str(peers.binary("kubevirt", "kubevirt-crds"))], capture_output=True, text=True, timeout=60, check=False
    )
    if done.returncode != 0:
        raise ClusterError(f"kubevirt-crds exited {done.returncode}: {done.stderr.strip()[-400:]}")
    applied = kubectl(peers, "apply", "--server-side", "--force-conflicts", "-f", "-", stdin=done.stdout)
    if applied.returncode != 0:
        raise ClusterError(f"applying KubeVirt's CRDs: {applied.stderr.strip()[-800:]}")
    # What KubeVirt's operator would have made: its namespace and virt-controller's account (the identity the
    # PodResources-claim policy admits, deploy/hook-sidecar/pod-resources-policy.yaml).
    made = kubectl(
        peers,
        "apply",
        "-f",
        "-",
        stdin=(
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: kubevirt}\n---\n"
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: kubevirt-controller, namespace: kubevirt}\n"
        ),
    )
    if made.returncode != 0:
        raise ClusterError(f"making KubeVirt's namespace: {made.stderr.strip()[-400:]}")
    names = [line.removeprefix("  name: ").strip() for line in done.stdout.splitlines() if line.startswith("  name: ")]

    def established() -> bool:
        # Not `kubectl wait`: it fails at once on a CRD whose status has no conditions yet.
        got = kubectl(
            peers,
            "get",
            "crd",
            *names,
            "-o",
            "jsonpath={range .items[*]}{.status.conditions[?(@.type=='Established')].status}{' '}{end}",
            timeout=30,
        )
        return got.returncode == 0 and got.stdout.split() == ["True"] * len(names)

    wait_for(f"KubeVirt's {len(names)} CRDs Established", established, component="kube-apiserver", deadline=120)


# -- down -----------------------------------------------------------------------------------------------------


def _processes() -> Iterator[tuple[int, str, str]]:
    """(pid, exe, cmdline) of every process."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            exe = os.readlink(entry / "exe")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        yield int(entry.name), exe, cmdline


def _kill(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def _cgroup_dirs() -> list[Path]:
    """The kubelet's pod cgroups (``kubepods``) in every v1 hierarchy, deepest first."""
    found: list[Path] = []
    for hierarchy in Path("/sys/fs/cgroup").iterdir():
        top = hierarchy / "kubepods"
        if top.is_dir():
            found.extend(Path(path) for path, _dirs, _files in os.walk(top))
    return sorted(found, key=lambda path: len(path.parts), reverse=True)


def _pod_pids() -> set[int]:
    pids: set[int] = set()
    for directory in _cgroup_dirs():
        with contextlib.suppress(OSError, ValueError):
            pids.update(int(line) for line in (directory / "cgroup.procs").read_text().split())
    return pids


KIT_PEERS = ("kube", "kube134", "etcd", "containerd", "buildkit")


def _ours(exe: str, cmdline: str, roots: Sequence[Path]) -> bool:
    """A process of the kit's: a cluster peer's binary (not the KubeVirt harness's), or one naming its dirs."""
    path = Path(exe)
    peer = any(path.is_relative_to(root) and path.parent.parent.name.split("-")[0] in KIT_PEERS for root in roots)
    return peer or str(RUN) in cmdline or str(STATE) in cmdline


def _mounts_under(roots: Sequence[Path]) -> list[str]:
    points: list[str] = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if any(point == str(root) or point.startswith(str(root) + "/") for root in roots):
                points.append(point)
    return sorted(set(points), key=lambda p: p.count("/"), reverse=True)


def down(peers_root: Path | None = None) -> list[str]:
    """Stop everything the kit started and remove what it made; returns what could not be removed."""
    cache = peers_root or Path(os.environ.get("KGP_PEERS_CACHE", Path.home() / ".cache/kubevirt-gpu-passthrough/peers"))
    roots = [cache]
    for name in ("kubelet", "buildkitd"):
        pid = pid_of(name)
        if pid:
            _kill(pid, signal.SIGTERM)
    # The pods' processes and their shims: they outlive containerd by design.
    for _round in range(3):
        pids = _pod_pids() | {
            pid for pid, exe, cmd in _processes() if "containerd-shim" in exe and _ours(exe, cmd, roots)
        }
        for pid in pids:
            _kill(pid, signal.SIGKILL)
        if not pids:
            break
        time.sleep(0.5)
    for name in (*reversed(COMPONENTS), "buildkitd"):
        pid = pid_of(name)
        if pid:
            _kill(pid, signal.SIGTERM)
    end = time.monotonic() + 20
    while time.monotonic() < end and any(pid_of(name) for name in (*COMPONENTS, "buildkitd")):
        time.sleep(0.2)
    for pid, exe, cmd in list(_processes()):
        if pid != os.getpid() and _ours(exe, cmd, roots):
            _kill(pid, signal.SIGKILL)
    time.sleep(0.2)
    problems: list[str] = []
    for point in _mounts_under([KUBELET_ROOT, STATE, RUN]):
        done = subprocess.run(["umount", point], capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", point], capture_output=True, text=True, timeout=30, check=False)
    for directory in _cgroup_dirs():
        with contextlib.suppress(OSError):
            directory.rmdir()
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, timeout=30, check=False)
    absent: list[str] = []
    with contextlib.suppress(OSError, ValueError):
        absent = json.loads((STATE / "host-dirs.json").read_text())
    for directory in [*(Path(d) for d in absent), RUN, STATE]:
        if directory.exists() and not _mounts_under([directory]):
            shutil.rmtree(directory, ignore_errors=True)
    left = [pid for pid, exe, cmd in _processes() if pid != os.getpid() and _ours(exe, cmd, roots)]
    if left:
        problems.append(f"processes left: {left}")
    mounts = _mounts_under([KUBELET_ROOT, STATE, RUN])
    if mounts:
        problems.append(f"mounts left: {mounts}")
    problems.extend(f"{d} left" for d in [*(Path(a) for a in absent), RUN, STATE] if d.exists())
    if _cgroup_dirs():
        problems.append(f"cgroups left: {[str(d) for d in _cgroup_dirs()[:5]]}")
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        problems.append(f"bridge {BRIDGE} left")
    return problems


def status() -> dict[str, object]:
    return {name: pid_of(name) for name in (*COMPONENTS, "buildkitd")} | {"state": str(STATE)}


def stop(name: str, deadline: float = 30.0) -> None:
    """SIGTERM the component, SIGKILL it past ``deadline``; returns once it is gone."""
    pid = pid_of(name)
    if pid is None:
        return
    _kill(pid, signal.SIGTERM)
    end = time.monotonic() + deadline
    while pid_of(name) is not None:
        if time.monotonic() > end:
            _kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def restart(name: str, peers: Peers) -> None:
    """Stop and start one component with the command ``up`` gives it (the kubelet, for the fault suite)."""
    stop(name)
    start(name, _commands(peers)[name], peers)
