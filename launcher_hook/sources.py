"""Where the hook learns the pod's GPU allocation when it is not the ``compute`` container.

The kubelet puts ``PCI_RESOURCE_*`` / ``MDEV_PCI_RESOURCE_*`` only into the container that asked for the
devices (``compute``); a hook sidecar sees none of it (docs/protocols.md, "KubeVirt hooks"). So the hook reads the
allocation from one of four sources, chosen once at start in this order of precedence:

1. the kubelet PodResources API (``--pod-resources-socket``): the named container's devices, turned into the
   same variables the env would hold (docs/protocols.md, "Kubelet PodResources API"); the kubelet's socket is
   root's only, so this needs a sidecar running as root (a root VMI);
2. an environ file (``--environ-file``): ``/proc/<pid>/environ`` or ``KEY=VALUE`` lines;
3. the process env, when it holds an allocation variable (the hook runs inside ``compute`` itself, or tests);
4. otherwise the domain XML of each call (:class:`DomainSource`): virt-launcher has already rendered a
   ``<hostdev>`` for every ``gpus[]``/``hostDevices[]`` entry from its own env, under the alias
   ``ua-gpu-<name>``/``ua-hostdevice-<name>``; no socket and no privilege (docs/kubevirt-hostdevs.md,
   "The domain as the allocation source").

Each source returns an env-shaped mapping for ``build_domain``, and says whether it can carry the plugin's
companion variable (``PCI_COMPANIONS_*``): the env and environ file can; PodResources and the domain hold device
IDs only, so with them the hook reads the GPUs' companions from sysfs (``BuildOptions.companion_reader``). A
source that cannot be read raises ``SourceUnavailable`` (the server answers ``FAILED_PRECONDITION``) naming what
it tried.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import grpc

from launcher_hook.allocation import allocation_variables, parse_environ
from launcher_hook.document import CallInputs, ParsedDomain
from launcher_hook.domain import HostdevsInDomain, hostdevs_of, read_hostdevs
from launcher_hook.hostdevs import MODELS_BY_TYPE
from launcher_hook.matching import KUBEVIRT_ALIAS_PREFIX, KUBEVIRT_USB_ALIAS_PREFIX
from runtime import pod_resources
from runtime.files import read_regular_file
from runtime.pod_resources import rpc_text
from schemas import InputError
from schemas.generated.kubelet.podresources.v1 import api_pb2 as podresources
from schemas.kinds import kind_of_id
from schemas.limits import DEFAULT_MAX_INPUT_BYTES
from schemas.vmi import VirtualMachineInstance, parse_vmi

DEFAULT_CONTAINER = "compute"
POD_RESOURCES_TIMEOUT_SECONDS = pod_resources.TIMEOUT_SECONDS
VIRT_LAUNCHER_POD_PREFIX = "virt-launcher-"
GENERATED_NAME_BASE_MAX = 58
"""The API server cuts a ``generateName`` to 58 characters before adding 5 random ones (63 in all)."""


def launcher_pod_pattern(vmi_name: str) -> re.Pattern[str]:
    """The names the API server can give the pod of ``generateName: virt-launcher-<vmi>-``."""
    base = f"{VIRT_LAUNCHER_POD_PREFIX}{vmi_name}-"[:GENERATED_NAME_BASE_MAX]
    return re.compile(re.escape(base) + "[a-z0-9]{5}")


class SourceUnavailable(Exception):
    """The allocation could not be read: an unreachable socket, an unknown pod, a missing file."""


@dataclass(frozen=True)
class Loaded:
    """An allocation read from a source, env-shaped, and a description of where it came from (for logs)."""

    env: Mapping[str, str]
    source: str
    carries_companions: bool = True
    """Whether the source can hold the plugin's ``PCI_COMPANIONS_*`` variables (an env can; the kubelet's
    PodResources and DRA device metadata cannot: the hook then reads the companions from sysfs)."""


class AllocationSource(Protocol):
    """Anything that can produce the allocation env for one ``OnDefineDomain`` call."""

    def describe(self) -> str:
        """What this source reads, for the start-up log."""
        ...

    def load(self, vmi_json: bytes | None, domain_xml: bytes | None = None) -> Loaded:
        """The allocation now; ``vmi_json`` helps find the pod when its name is not configured; ``domain_xml`` is
        the call's domain (the domain source reads the allocation from it, the others ignore it)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ReadsCallInputs(Protocol):
    """A source that reads the call's documents: given the call's :class:`CallInputs`, it uses the parse the
    builder uses too (each document is parsed once per call)."""

    def load_inputs(self, inputs: CallInputs) -> Loaded: ...


class ProcessEnvSource:
    """The hook's own env (given at construction, so the caller decides what that is); only the variables the
    builder reads are kept (``allocation_variables``), so a call does not go through the rest each time."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self._env = allocation_variables(env)

    def describe(self) -> str:
        return "process env"

    def load(self, vmi_json: bytes | None, domain_xml: bytes | None = None) -> Loaded:
        return Loaded(self._env, "process env")

    def close(self) -> None:
        return None


MAX_ENVIRON_FILE_BYTES = 4 * 1024 * 1024
"""Largest environ file read (4 MiB). Linux caps a process's argv + env at a quarter of its stack limit (2 MiB
with the usual 8 MiB stack; ``/proc/<pid>/environ`` is never larger), so this is twice what a real one holds."""


def read_environ_file(path: Path, max_bytes: int = MAX_ENVIRON_FILE_BYTES) -> bytes:
    """The bytes of the regular file ``path``, at most ``max_bytes``; ``SourceUnavailable`` naming it otherwise.

    Opened ``O_NONBLOCK`` so that a FIFO (or a device) in its place cannot block the caller in ``open``, then
    refused unless ``fstat`` says it is a regular file (``/proc/<pid>/environ`` is one); read in chunks and
    given up as soon as it passes ``max_bytes`` (``/proc`` files report size 0, so the size is not trusted).
    """
    try:
        return read_regular_file(path, max_bytes, "environ file", shown=str(path))
    except InputError as exc:
        raise SourceUnavailable(str(exc)) from None


class EnvironFileSource:
    """A copy of the compute process's env, read anew on every call (it may appear after the hook starts).

    The file is read with :func:`read_environ_file`: regular files only, at most ``MAX_ENVIRON_FILE_BYTES``.
    """

    def __init__(self, path: Path, max_bytes: int = MAX_ENVIRON_FILE_BYTES) -> None:
        self.path = path
        self.max_bytes = max_bytes

    def describe(self) -> str:
        return f"environ file {self.path}"

    def load(self, vmi_json: bytes | None, domain_xml: bytes | None = None) -> Loaded:
        data = read_environ_file(self.path, self.max_bytes)
        try:
            env = parse_environ(data)
        except InputError as exc:
            raise SourceUnavailable(f"{self.path}: {exc}") from None
        return Loaded(env, self.describe())

    def close(self) -> None:
        return None


def env_from_devices(devices: Iterable[tuple[str, Sequence[str]]]) -> dict[str, str]:
    """The variables the kubelet would have put into the container, from ``(resource_name, device_ids)`` pairs.

    PCI vs mdev is told by each ID's form. IDs of any other form (e.g. ``devices.kubevirt.io/kvm``'s) are not
    GPUs and are left out. The kubelet lists a container's IDs in no particular order, so each variable's IDs
    are sorted (PCI addresses numerically, UUIDs as text): two GPUs of one resource then get stable aliases.
    """
    pools: dict[str, list[str]] = {}
    sort_keys: dict[str, Callable[[str], Any]] = {}
    for resource_name, device_ids in devices:
        for device_id in device_ids:
            kind = kind_of_id(device_id)
            if kind is None:
                continue
            ids = pools.setdefault(kind.env_var(resource_name), [])
            sort_keys[kind.env_var(resource_name)] = kind.id_sort_key
            if device_id not in ids:
                ids.append(device_id)
    env: dict[str, str] = {}
    for variable, ids in pools.items():
        env[variable] = ",".join(sorted(ids, key=sort_keys[variable]))
    return env


@dataclass(frozen=True)
class _VmiRef:
    namespace: str
    name: str


def _vmi_ref(vmi_json: bytes | None) -> _VmiRef | None:
    """The VMI's namespace and name, or None if they cannot be read (the builder reports bad JSON itself)."""
    if not vmi_json:
        return None
    try:
        document = json.loads(vmi_json)
    except (ValueError, RecursionError):
        return None
    metadata = document.get("metadata") if isinstance(document, dict) else None
    if not isinstance(metadata, dict):
        return None
    namespace, name = metadata.get("namespace"), metadata.get("name")
    if isinstance(namespace, str) and isinstance(name, str) and namespace and name:
        return _VmiRef(namespace, name)
    return None


SERVICE_ACCOUNT_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
RESOLV_CONF = Path("/etc/resolv.conf")
_CLUSTER_SEARCH_DOMAIN = re.compile(r"([a-z0-9]([-a-z0-9]*[a-z0-9])?)\.svc\.")
_LAUNCHER_POD = re.compile(rf"{re.escape(VIRT_LAUNCHER_POD_PREFIX)}(.*)[a-z0-9]{{5}}")
_DNS_LABEL_MAX = 63


@dataclass(frozen=True)
class PodIdentity:
    """What the hook knows of its own pod from its own container, never from a caller.

    ``name``/``namespace``: ``POD_NAME``/``POD_NAMESPACE`` (downward API) where the pod spec can set them; the
    namespace also from the service-account namespace file or the cluster DNS search path the kubelet writes into
    ``/etc/resolv.conf`` (``<namespace>.svc.<cluster domain>``). ``hostname``: the pod's hostname, which KubeVirt
    sets to the VMI's name up to its first dot (``dns.SanitizeHostname``; ``spec.hostname`` replaces it).
    ``container``: ``CONTAINER_NAME``, which KubeVirt gives each hook sidecar (``hook-sidecar-<n>``).
    """

    name: str | None = None
    namespace: str | None = None
    hostname: str | None = None
    container: str | None = None
    namespace_from: str = "unknown"


def _read_small(path: Path, limit: int = 64 * 1024) -> str | None:
    try:
        return read_environ_file(path, limit).decode("utf-8", "replace")
    except SourceUnavailable:
        return None


def own_pod_identity(
    env: Mapping[str, str],
    *,
    hostname: str | None = None,
    service_account_namespace: Path = SERVICE_ACCOUNT_NAMESPACE_FILE,
    resolv_conf: Path = RESOLV_CONF,
) -> PodIdentity:
    """The hook's own pod as far as its container tells (see :class:`PodIdentity`); ``hostname`` defaults to
    this host's name."""
    namespace, namespace_from = env.get("POD_NAMESPACE") or None, "POD_NAMESPACE"
    if namespace is None and (text := _read_small(service_account_namespace)):
        namespace, namespace_from = text.strip() or None, str(service_account_namespace)
    if namespace is None and (text := _read_small(resolv_conf)):
        for line in text.splitlines():
            words = line.split()
            if words[:1] == ["search"]:
                found = next((m.group(1) for w in words[1:] if (m := _CLUSTER_SEARCH_DOMAIN.match(w))), None)
                if found:
                    namespace, namespace_from = found, f"the {resolv_conf} search path"
    return PodIdentity(
        name=env.get("POD_NAME") or None,
        namespace=namespace,
        hostname=(hostname if hostname is not None else socket.gethostname()) or None,
        container=env.get("CONTAINER_NAME") or None,
        namespace_from=namespace_from if namespace else "unknown",
    )


def could_be_launcher_pod_of_host(pod_name: str, hostname: str) -> bool:
    """Whether KubeVirt may have named ``pod_name`` for a VMI whose name makes the pod hostname ``hostname``.

    The pod is ``generateName: virt-launcher-<vmi>-`` cut to 58 characters plus 5 random ones; the hostname is
    the VMI's name up to its first dot, cut to 63. A pod name that is cut short keeps only a prefix of the VMI's
    name, and then every hostname it could stand for is accepted.
    """
    match = _LAUNCHER_POD.fullmatch(pod_name)
    if match is None or len(pod_name) > _DNS_LABEL_MAX:
        return False
    kept = match.group(1)  # (vmi + "-") cut to 44 characters
    if len(kept) + len(VIRT_LAUNCHER_POD_PREFIX) < GENERATED_NAME_BASE_MAX:  # not cut: the whole name and "-"
        return kept.endswith("-") and kept[:-1].split(".")[0][:_DNS_LABEL_MAX] == hostname
    if "." in kept:
        return kept.split(".")[0] == hostname
    return hostname.startswith(kept) or (kept.endswith("-") and hostname == kept[:-1])


class PodResourcesSource:
    """The named container's devices of the hook's OWN pod, from the kubelet PodResources API on a unix socket.

    The PodResources API lists every pod of the node, so the hook must never let a caller choose the pod: the VMI
    a caller sends only has to agree with the pod the hook found for itself (its namespace and its
    ``virt-launcher-<vmi>-xxxxx`` name), or the call is refused. The hook's own pod is
    ``POD_NAMESPACE/POD_NAME`` (downward API) when its spec can set them. A sidecar added through
    ``hooks.kubevirt.io/hookSidecars`` gets no such env, so then it is found by ``List``: the one pod on this node
    (in the hook's namespace, when known, see :class:`PodIdentity`) named ``virt-launcher-<vmi>-xxxxx`` for a VMI
    whose name gives this pod's hostname, with a container named like this sidecar. It is remembered from then on.

    ``Get`` is tried first; where the kubelet has it disabled (``UNKNOWN`` "... Get method disabled", or
    ``UNIMPLEMENTED``) the source falls back to ``List`` and remembers to go there directly next time.

    The first answer that gives the container devices is kept for the source's life (``keep_answer``, on by
    default; docs/kubevirt-hostdevs.md, "Kept for the pod's life"): the kubelet allocates a container's devices
    before it starts and changes them for no running pod, so KubeVirt's second and third ``OnDefineDomain`` of a
    VM start ask the kubelet nothing. The caller's VMI is still checked against the kept pod on every call. An
    answer without devices, or an error, is not kept: the next call asks again.
    """

    def __init__(
        self,
        socket_path: Path,
        container: str = DEFAULT_CONTAINER,
        pod_name: str | None = None,
        pod_namespace: str | None = None,
        timeout: float = POD_RESOURCES_TIMEOUT_SECONDS,
        identity: PodIdentity | None = None,
        keep_answer: bool = True,
    ) -> None:
        self.socket_path = socket_path
        self.container = container
        self.identity = identity or PodIdentity(
            name=pod_name or None,
            namespace=pod_namespace or None,
            namespace_from="POD_NAMESPACE" if pod_namespace else "unknown",
        )
        self.timeout = timeout
        self._get_disabled = False
        self._own: tuple[str, str] | None = None  # (namespace, name), once found
        self._own_lock = threading.Lock()
        self._keep_answer = keep_answer
        self._kept: tuple[podresources.PodResources, Loaded] | None = None  # the pod, its container's allocation
        self._client = pod_resources.PodResourcesClient(socket_path, timeout)

    @property
    def pod_name(self) -> str | None:
        return self.identity.name

    @property
    def pod_namespace(self) -> str | None:
        return self.identity.namespace

    def describe(self) -> str:
        me = self.identity
        if me.name:
            pod = f"pod {me.namespace or '?'}/{me.name}"
        else:
            where = f"namespace {me.namespace} (from {me.namespace_from})" if me.namespace else "any namespace"
            pod = f"its own pod: hostname {me.hostname or '?'}, {where}"
        return f"PodResources {self.socket_path} ({pod}, container {self.container})"

    def close(self) -> None:
        self._client.close()

    def load(self, vmi_json: bytes | None, domain_xml: bytes | None = None) -> Loaded:
        ref = _vmi_ref(vmi_json)
        if ref is None and vmi_json:
            parse_vmi(vmi_json)  # a VMI that is not valid is the caller's error: the builder's InputError
        return self._load(ref)

    def load_inputs(self, inputs: CallInputs) -> Loaded:
        """:meth:`load` with the VMI the builder reads too (decoded once); a VMI the builder refuses is read as
        :meth:`load` reads it (its name, if the JSON has one), so the faults are the same."""
        try:
            vmi = inputs.vmi
        except InputError:
            return self.load(inputs.vmi_json)
        meta = vmi.metadata if vmi is not None else None
        ref = _VmiRef(meta.namespace, meta.name) if meta is not None and meta.namespace and meta.name else None
        if ref is None and inputs.vmi_json:
            return self.load(inputs.vmi_json)
        return self._load(ref)

    def _load(self, ref: _VmiRef | None) -> Loaded:
        with self._own_lock:
            kept = self._kept
        if kept is not None:
            pod, loaded = kept
            if ref is not None:
                _check_caller_claim(ref, pod)
            return loaded
        pod, method = self._own_pod()
        if ref is not None:
            _check_caller_claim(ref, pod)
        containers = {container.name: container for container in pod.containers}
        chosen = containers.get(self.container)
        if chosen is None:
            raise SourceUnavailable(
                f"PodResources {method} at {self.socket_path}: pod {pod.namespace}/{pod.name} has no container "
                f"{self.container!r} (it has: {', '.join(sorted(containers)) or 'none'})"
            )
        env = env_from_devices((devices.resource_name, list(devices.device_ids)) for devices in chosen.devices)
        loaded = Loaded(
            env,
            f"PodResources {method} {self.socket_path} pod {pod.namespace}/{pod.name} container {self.container}",
            carries_companions=False,
        )
        if env and self._keep_answer:
            with self._own_lock:
                self._kept = (pod, loaded)
        return loaded

    def _own_pod(self) -> tuple[podresources.PodResources, str]:
        me = self.identity
        if me.name:
            if not me.namespace:
                raise SourceUnavailable(
                    f"POD_NAME is {me.name!r} but this hook cannot tell its namespace: set POD_NAMESPACE "
                    "(the VMI a caller sends is not trusted to name it)"
                )
            return self._pod_by_name(me.namespace, me.name)
        with self._own_lock:
            own = self._own
        if own is not None:
            return self._pod_by_name(*own)
        pod = self._find_own_pod()
        with self._own_lock:
            self._own = (pod.namespace, pod.name)
        return pod, "List"

    def _unreachable(self, method: str, error: grpc.RpcError) -> SourceUnavailable:
        details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
        if "permission denied" in details.lower():
            hint = (
                f"this process (uid {os.getuid()}) may not connect to it: the kubelet keeps the socket and its "
                "directory root's (0755 in a 0750 directory), so PodResources needs a sidecar running as root "
                "(a root VMI; KubeVirt runs the hook sidecars of a non-root VMI as uid 107); leave out "
                "--pod-resources-socket and the hook reads the allocation from the domain virt-launcher sends"
            )
        else:
            hint = "is /var/lib/kubelet/pod-resources mounted into this container?"
        return SourceUnavailable(
            f"the kubelet PodResources socket {self.socket_path} did not answer {method} ({rpc_text(error)}); {hint}"
        )

    def _list(self, tried: str) -> list[podresources.PodResources]:
        try:
            return self._client.list()
        except grpc.RpcError as error:
            if isinstance(error, grpc.Call) and error.code() in (
                grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ):
                raise self._unreachable("List", error) from None
            raise SourceUnavailable(
                f"PodResources at {self.socket_path}: {tried}List failed: {rpc_text(error)}"
            ) from None

    def _pod_by_name(self, namespace: str, name: str) -> tuple[podresources.PodResources, str]:
        tried = ""
        if not self._get_disabled:
            try:
                return self._client.get(namespace, name), "Get"
            except grpc.RpcError as error:
                code = error.code() if isinstance(error, grpc.Call) else None
                if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise self._unreachable("Get", error) from None
                if code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNIMPLEMENTED):
                    raise SourceUnavailable(
                        f"PodResources Get at {self.socket_path} for pod {namespace}/{name}: {rpc_text(error)}"
                    ) from None
                details = (error.details() if isinstance(error, grpc.Call) else None) or ""
                if code is grpc.StatusCode.UNIMPLEMENTED or "disabled" in details.lower():
                    self._get_disabled = True
                tried = f"Get said {rpc_text(error)}; "
        pods = self._list(tried)
        for pod in pods:
            if pod.name == name and pod.namespace == namespace:
                return pod, "List"
        raise SourceUnavailable(
            f"PodResources at {self.socket_path}: pod {namespace}/{name} not found ({tried}List has {len(pods)} pods, "
            "none of them this one)"
        )

    def _find_own_pod(self) -> podresources.PodResources:
        me = self.identity
        if not me.hostname:
            raise SourceUnavailable(
                "this hook cannot tell which pod is its own: POD_NAME is not set and its hostname is unknown"
            )
        pods = self._list("")
        wanted = [
            pod
            for pod in pods
            if (me.namespace is None or pod.namespace == me.namespace)
            and could_be_launcher_pod_of_host(pod.name, me.hostname)
            and (me.container is None or any(container.name == me.container for container in pod.containers))
        ]
        where = f"in namespace {me.namespace} (from {me.namespace_from})" if me.namespace else "in any namespace"
        what = f"virt-launcher-<VMI>-xxxxx {where} for hostname {me.hostname!r}" + (
            f" with a container {me.container!r}" if me.container else ""
        )
        if len(wanted) == 1:
            return wanted[0]
        if not wanted:
            raise SourceUnavailable(
                f"PodResources List at {self.socket_path}: no pod {what} among {len(pods)} pods on this node, so "
                "this hook cannot tell which pod is its own (a VMI with spec.hostname hides its name); "
                "set POD_NAME and POD_NAMESPACE"
            )
        names = ", ".join(sorted(f"{pod.namespace}/{pod.name}" for pod in wanted))
        raise SourceUnavailable(
            f"PodResources List at {self.socket_path}: several pods could be this hook's own ({what}: {names}); "
            "set POD_NAME and POD_NAMESPACE"
        )


def _check_caller_claim(ref: _VmiRef, pod: podresources.PodResources) -> None:
    """Refuse a call whose VMI is not the one this hook's own pod runs: its devices are not the caller's to see."""
    same_namespace = ref.namespace == pod.namespace
    same_vmi = not pod.name.startswith(VIRT_LAUNCHER_POD_PREFIX) or bool(
        launcher_pod_pattern(ref.name).fullmatch(pod.name)
    )
    if not (same_namespace and same_vmi):
        raise SourceUnavailable(
            f"the VMI {ref.namespace}/{ref.name} is not the one this hook's pod {pod.namespace}/{pod.name} runs; "
            "refusing to read another pod's devices"
        )


class DomainSource:
    """The allocation as virt-launcher rendered it into the domain XML of the call itself: no socket, no privilege.

    virt-launcher reads ``PCI_RESOURCE_<NAME>``/``MDEV_PCI_RESOURCE_<NAME>`` from its own env (it runs in
    ``compute``) and writes one ``<hostdev>`` per ``gpus[]``/``hostDevices[]`` entry with a ``deviceName``, with
    the alias ``ua-gpu-<name>``/``ua-hostdevice-<name>`` and the device's PCI address or mdev UUID as its source,
    before it calls ``OnDefineDomain`` (docs/kubevirt-hostdevs.md, "The domain as the allocation source"). So each
    entry's device is the source of the hostdev with its alias (or the hook's own ``ua-gpuN``/``ua-hostdevN``,
    for a domain this hook already went through), read as libvirt reads it (:func:`read_hostdevs`), and filed
    under the variable virt-launcher read it from, in entry order. DRA entries (no ``deviceName``) are left to
    the builder's claim reader; a ``hostDevices[]`` entry virt-launcher rendered as USB (``ua-usb-host-<name>``)
    is left to virt-launcher. The domain carries no companion variable: the hook reads companions from sysfs.

    Both documents are read with the builder's own limits (``max_input_bytes``) and parsers, so the source
    refuses what the builder would (``InputError``: ``INVALID_ARGUMENT``); so is an entry with no hostdev to read,
    naming the entry and the aliases looked for. A call without a domain or a VMI is ``SourceUnavailable``.
    """

    def __init__(self, max_input_bytes: int = DEFAULT_MAX_INPUT_BYTES) -> None:
        self.max_input_bytes = max_input_bytes

    def describe(self) -> str:
        return "domain XML of each call (virt-launcher's ua-gpu-<name>/ua-hostdevice-<name> hostdevs)"

    def load(self, vmi_json: bytes | None, domain_xml: bytes | None = None) -> Loaded:
        if not domain_xml:
            raise SourceUnavailable("the allocation is read from the call's domain XML, and this call has none")
        if not vmi_json:
            raise SourceUnavailable(
                "the allocation is read from the call's domain XML by each gpus[]/hostDevices[] entry's alias, "
                "and this call has no VMI to name the entries"
            )
        return self.load_inputs(CallInputs(domain_xml, vmi_json, self.max_input_bytes))

    def load_inputs(self, inputs: CallInputs) -> Loaded:
        """:meth:`load` from the call's documents as the builder parses them (once: the builder uses the same
        parse; their limit is the builder's ``max_input_bytes``)."""
        if not inputs.domain_xml:
            raise SourceUnavailable("the allocation is read from the call's domain XML, and this call has none")
        if not inputs.vmi_json:
            raise SourceUnavailable(
                "the allocation is read from the call's domain XML by each gpus[]/hostDevices[] entry's alias, "
                "and this call has no VMI to name the entries"
            )
        vmi, parsed = inputs.vmi, inputs.domain
        assert vmi is not None
        assert parsed is not None
        return Loaded(env_from_domain(vmi, parsed, hostdevs_of(inputs)), "domain XML", carries_companions=False)

    def close(self) -> None:
        return None


_OWN_ALIAS_PREFIX = {"gpus": "ua-gpu", "hostDevices": "ua-hostdev"}
"""The hook's own alias of an entry it added (this prefix and the entry's index, ``matching._Request.alias``)."""


def env_from_domain(
    vmi: VirtualMachineInstance, parsed: ParsedDomain, hostdevs: HostdevsInDomain | None = None
) -> dict[str, str]:
    """The variables virt-launcher's env held for ``vmi``'s entries, as its hostdevs in ``parsed`` show them.

    ``hostdevs``: the domain's hostdevs when the caller has read them (the call's one read, shared with the
    merge). Per entry with a ``deviceName`` (in ``gpus[]`` then ``hostDevices[]`` order): the source of the hostdev
    aliased ``ua-gpu-<name>``/``ua-hostdevice-<name>`` (else the hook's ``ua-gpuN``/``ua-hostdevN``), under
    ``PCI_RESOURCE_<NAME>`` or ``MDEV_PCI_RESOURCE_<NAME>`` by the hostdev's type. ``InputError`` (the domain and
    the VMI the caller sent disagree) names every entry whose hostdev is missing or has no source the hook reads,
    and a device two entries hold.
    """
    aliases = (hostdevs if hostdevs is not None else read_hostdevs(parsed)).view.alias_sources
    devices = vmi.spec.domain.devices
    pools: dict[str, list[str]] = {}
    holder: dict[tuple[str, str], tuple[str, int, str, str | None]] = {}  # each device → the entry holding it
    problems: list[str] = []
    variables: dict[tuple[object, str], str] = {}
    entries: list[tuple[str, int, str, str | None]] = [
        ("gpus", index, gpu.name, gpu.device_name) for index, gpu in enumerate(devices.gpus)
    ] + [("hostDevices", index, host.name, host.device_name) for index, host in enumerate(devices.host_devices)]
    for entry in entries:
        list_name, index, name, device_name = entry
        if not device_name:
            continue  # a DRA entry: its device comes from its claim's metadata
        if list_name == "hostDevices" and KUBEVIRT_USB_ALIAS_PREFIX + name in aliases:
            continue  # a USB device virt-launcher rendered and owns
        alias = KUBEVIRT_ALIAS_PREFIX[list_name] + name  # (virt-launcher's alias, else the hook's own)
        if alias not in aliases:
            alias = f"{_OWN_ALIAS_PREFIX[list_name]}{index}"
            if alias not in aliases:
                wanted = (KUBEVIRT_ALIAS_PREFIX[list_name] + name, alias)
                problems.append(f"{_label(entry)} has no <hostdev> aliased {' or '.join(repr(a) for a in wanted)}")
                continue
        key = aliases[alias]
        model = MODELS_BY_TYPE.get(key[0] or "") if key is not None else None  # (model_for_type)
        if key is None or model is None:
            problems.append(f"{_label(entry)}: its <hostdev> {alias!r} has no PCI address or mdev UUID the hook reads")
            continue
        if key in holder:
            problems.append(
                f"{_label(entry)}: its <hostdev> {alias!r} passes {key[1]}, which {_label(holder[key])} holds too"
            )
            continue
        holder[key] = entry
        variable = variables.get((model, device_name))
        if variable is None:  # (worked out once per resource: the GPUs share a few)
            variable = variables[(model, device_name)] = model.kind.env_var(device_name)
        pools.setdefault(variable, []).append(key[1])
    if problems:
        shown = "; ".join(problems[:_PROBLEMS_SHOWN])
        more = f" (and {len(problems) - _PROBLEMS_SHOWN} more)" if len(problems) > _PROBLEMS_SHOWN else ""
        raise InputError(
            f"domain XML: {shown}{more}; virt-launcher renders one for every entry whose PCI_RESOURCE_<NAME> or "
            "MDEV_PCI_RESOURCE_<NAME> it has, before it calls the hook (was the domain made by virt-launcher, or "
            "did an earlier hook change it?)"
        )
    return {variable: ",".join(ids) for variable, ids in pools.items()}


def _label(entry: tuple[str, int, str, str | None]) -> str:
    """An entry of :func:`env_from_domain` as its messages name it."""
    list_name, index, name, device_name = entry
    return f"{list_name}[{index}] {name!r} (deviceName {device_name})"


_PROBLEMS_SHOWN = 8
"""Entries an error names at most (a VMI may list thousands; the message says how many more)."""
