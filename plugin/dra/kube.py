"""The DRA plugin's Kubernetes API edge: publish the node's ResourceSlices, read ResourceClaims.

Everything here goes through the official ``kubernetes`` client (its REST layer over urllib3) and the plumbing
the node agent shares (:mod:`runtime.kube_api`: configuration, deadlines, bounded reads, :class:`KubeError`):
:class:`KubeApi` is the typed facade (the client is untyped; its objects
never leave this module). Objects travel as plain JSON dicts (``_preload_content=False``): the slices
:mod:`plugin.dra.slices` builds go out as they are, and what comes back is read with a size bound, parsed
once and checked before use. Only ``serve --dra`` imports this module, so the device-plugin path never loads
the client.

- Every call has a timeout (connect, each read) **and a total deadline** (:data:`DEFAULT_DEADLINE`, shorter
  than the kubelet's 45 s for a NodePrepareResources call): urllib3's timeouts bound each socket operation,
  so a server trickling a byte every few seconds would hold a call forever. A watchdog (``_Deadline`` in
  :mod:`runtime.kube_api`) shuts down the sockets the call is using when its deadline passes, so the call fails
  at once with a :class:`KubeError` saying so. No client-side retries: a failed sync is retried whole on the
  next inventory (the serve loop calls :meth:`SlicePublisher.publish` on each new inventory; it logs
  ``dra_slices_published`` when something changed). Errors are
  :class:`KubeError` naming the operation, the object and the API server's answer.
- :class:`SlicePublisher` brings the node's slices (field selector ``spec.nodeName`` + ``spec.driver``) to
  the desired set as Kubernetes' own ResourceSlice controller does: nothing when they already say the same;
  otherwise update the existing ones in place, create the missing ones (``generateName``), then delete the
  surplus, all at a new pool ``generation`` (consumers ignore a pool's older generations, so a reader never
  mixes old and new slices). Each slice is owned by the Node object (so it goes with the node). Taints are
  part of what is compared, so a device turning unhealthy (or healthy) is a change; their ``timeAdded``
  comes from :class:`~plugin.dra.slices.TaintTimes` (when this process first saw the device unhealthy, or the
  earlier time a taint of ours on the server already says), so an unchanged taint never makes a write.
- :class:`KubeClaims` is the :class:`~plugin.dra.claims.ClaimSource` a running plugin uses: GET the
  ``resource.k8s.io/v1`` ResourceClaim and read its allocation (:func:`~plugin.dra.claims.results_from_claim_object`
  checks the UID, so a re-created claim is never prepared with the old one's devices).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes.client

from plugin.dra.claims import AllocatedDevice, ClaimError, ClaimRef, check_ref, results_from_claim_object
from plugin.dra.slices import API_VERSION, KIND, ProductNames, TaintTimes, build_slices, check_node_name
from plugin.inventory import Inventory
from plugin.log import log_event
from runtime.kube_api import DEFAULT_TIMEOUT, JSON, MAX_RESPONSE_BYTES, KubeClient, KubeError
from runtime.pciids import PciIds
from schemas.dra import DRIVER_NAME
from schemas.errors import InputError

DEFAULT_DEADLINE = 20.0
"""Seconds a whole call may take, however the server dribbles its answer: well below the kubelet's 45 s for
NodePrepareResources (``defaultClientCallTimeout``, k8s.io/kubernetes pkg/kubelet/cm/dra/plugin), so a claim
read that cannot finish fails the claim with a clear error before the kubelet gives up on the whole call."""
MAX_SLICES = 64
"""More slices of ours for one node than this is someone else's mess, not a pool we made (64 to 128 devices each)."""
TAINTS_RECHECK_AFTER = 3600.0
"""Seconds after which a publisher that saw the API server drop device taints asks it again (a dry-run update, which
stores nothing): a control plane upgraded to keep them (1.36) while the plugin runs gets the taints of devices that
were already unhealthy, without waiting for a restart or a change of health."""
FIELD_MANAGER = "gpu-device-plugin"
"""``fieldManager`` of our writes (``kubectl get -o yaml --show-managed-fields`` says who wrote what)."""


class KubeApi(KubeClient):
    """The few calls the DRA plugin makes, with JSON dicts in and out (the typed face of the untyped client)."""

    def __init__(
        self, configuration: Any, timeout: tuple[float, float] = DEFAULT_TIMEOUT, deadline: float = DEFAULT_DEADLINE
    ) -> None:
        super().__init__(configuration, timeout, deadline)
        self._resource = kubernetes.client.ResourceV1Api(self._client)
        self._core = kubernetes.client.CoreV1Api(self._client)

    def list_slices(self, node_name: str, driver: str = DRIVER_NAME) -> list[JSON]:
        """The ResourceSlices of ``driver`` on ``node_name`` (field selectors ``spec.nodeName``, ``spec.driver``)."""
        what = f"list ResourceSlices of node {node_name} driver {driver}"
        answer = self._call(
            what,
            self._resource.list_resource_slice,
            field_selector=f"spec.nodeName={node_name},spec.driver={driver}",
        )
        items = answer.get("items")
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise KubeError(f"{what}: the answer has no list of objects in 'items'")
        return items

    def create_slice(self, obj: JSON) -> JSON:
        return self._call(
            "create a ResourceSlice", self._resource.create_resource_slice, obj, field_manager=FIELD_MANAGER
        )

    def replace_slice(self, name: str, obj: JSON) -> JSON:
        return self._call(
            f"update ResourceSlice {name}",
            self._resource.replace_resource_slice,
            name,
            obj,
            field_manager=FIELD_MANAGER,
        )

    def dry_run_replace_slice(self, name: str, obj: JSON) -> JSON:
        """What the server would store for ``obj`` (``dryRun=All``: validated and defaulted, nothing stored)."""
        return self._call(
            f"dry-run update ResourceSlice {name}",
            self._resource.replace_resource_slice,
            name,
            obj,
            field_manager=FIELD_MANAGER,
            dry_run="All",
        )

    def delete_slice(self, name: str) -> None:
        try:
            self._call(f"delete ResourceSlice {name}", self._resource.delete_resource_slice, name)
        except KubeError as exc:
            if "HTTP 404 " not in str(exc):  # already gone: what we wanted
                raise

    def read_node(self, name: str) -> JSON:
        return self._call(f"read Node {name}", self._core.read_node, name)

    def read_claim(self, namespace: str, name: str, until: float | None = None) -> JSON:
        """The ResourceClaim, read within :attr:`deadline` and by ``until`` (``time.monotonic()``) if given."""
        return self._call(
            f"read ResourceClaim {namespace}/{name}",
            self._resource.read_namespaced_resource_claim,
            name,
            namespace,
            until=until,
        )


def _metadata(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    metadata = obj.get("metadata")
    return metadata if isinstance(metadata, Mapping) else {}


def _spec(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    spec = obj.get("spec")
    return spec if isinstance(spec, Mapping) else {}


def _generation(obj: Mapping[str, Any]) -> int:
    pool = _spec(obj).get("pool")
    value = pool.get("generation") if isinstance(pool, Mapping) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _canonical(devices: object) -> str:
    """``devices`` as comparable text (key order aside)."""
    return json.dumps(devices, sort_keys=True)


def _tainted(obj: Mapping[str, Any]) -> bool:
    devices = _spec(obj).get("devices")
    return isinstance(devices, list) and any(isinstance(d, Mapping) and d.get("taints") for d in devices)


def _pool_name(obj: Mapping[str, Any]) -> object:
    pool = _spec(obj).get("pool")
    return pool.get("name") if isinstance(pool, Mapping) else None


@dataclass(frozen=True)
class PublishResult:
    """What one sync did: the pool generation now published and the slices created, updated and deleted."""

    generation: int
    created: int = 0
    updated: int = 0
    deleted: int = 0

    @property
    def changed(self) -> bool:
        return bool(self.created or self.updated or self.deleted)


class SlicePublisher:
    """Keeps ``node_name``'s ResourceSlices equal to what the latest inventory offers (see the module doc)."""

    def __init__(
        self,
        api: KubeApi,
        node_name: str,
        product_names: ProductNames | None = None,
        taint_times: TaintTimes | None = None,
    ) -> None:
        """``product_names``: pci.ids names for ``productName``; default: the pci.ids the inventory was named
        from (``Inventory.pci_ids_path``), read once per path. ``taint_times``: the clock of the taints'
        ``timeAdded`` (tests give one with their own clock)."""
        self._api = api
        self.taint_times = taint_times or TaintTimes()
        self.server_drops_taints = False
        """Whether the last write of a tainted device came back without its taints (the gate off there)."""
        self.taints_recheck_after = TAINTS_RECHECK_AFTER
        """Seconds after learning that the server drops taints before asking again (:meth:`_recheck_taints`)."""
        self._taints_checked = 0.0
        """``time.monotonic()`` when the server was last seen dropping taints."""
        self._node_name = check_node_name(node_name)
        self._product_names = product_names
        self._pci_ids: tuple[str | None, ProductNames | None] = (None, None)
        self._owner: JSON | None = None

    def _names_for(self, inventory: Inventory) -> ProductNames | None:
        if self._product_names is not None:
            return self._product_names
        path = inventory.pci_ids_path
        if path is None:
            return None
        if self._pci_ids[0] != path:
            try:
                self._pci_ids = (path, PciIds.load(Path(path)).device_name)
            except InputError:  # gone since the scan: no productName this time, tried again next time
                return None
        return self._pci_ids[1]

    def owner_reference(self) -> JSON:
        """The Node as owner (its UID, read at the first sync and again before each write); the slices go when
        the Node object does."""
        if self._owner is None:
            node = self._api.read_node(self._node_name)
            uid = _metadata(node).get("uid")
            if not isinstance(uid, str) or not uid:
                raise KubeError(f"read Node {self._node_name}: the object has no metadata.uid")
            self._owner = {"apiVersion": "v1", "kind": "Node", "name": self._node_name, "uid": uid, "controller": True}
        return self._owner

    def _desired(self, inventory: Inventory, generation: int) -> list[JSON]:
        names = self._names_for(inventory)
        times = self.taint_times.times
        slices = (
            build_slices(inventory, self._node_name, generation, taint_times=times)
            if names is None
            else build_slices(inventory, self._node_name, generation, names, taint_times=times)
        )
        owner = self.owner_reference() if slices else None
        for obj in slices:
            obj["metadata"]["ownerReferences"] = [owner]
        return slices

    def _up_to_date(self, existing: list[JSON], desired: list[JSON]) -> bool:
        """Whether the published slices already say what ``desired`` says (any generation, one for all)."""
        if len(existing) != len(desired) or len({_generation(obj) for obj in existing}) > 1:
            return False
        owners = [_metadata(want).get("ownerReferences") for want in desired]
        for have in existing:
            pool = _spec(have).get("pool")
            if (
                not isinstance(pool, Mapping)
                or _pool_name(have) != self._node_name
                or pool.get("resourceSliceCount") != len(desired)
                or _metadata(have).get("ownerReferences") not in owners
            ):
                return False
        # Which slice holds which run of devices does not matter (created slices get random names, so their
        # name order is not the order they were written in): the same runs, each in one slice, is the same pool.
        return sorted(_canonical(_spec(have).get("devices", [])) for have in existing) == sorted(
            _canonical(self._as_stored(want["spec"]["devices"])) for want in desired
        )

    def _as_stored(self, devices: list[JSON]) -> list[JSON]:
        """``devices`` as this API server keeps them: without taints when it drops the field (the gate off)."""
        if not self.server_drops_taints:
            return devices
        return [{key: value for key, value in device.items() if key != "taints"} for device in devices]

    def _note_taints(self, sent: JSON, answer: JSON) -> None:
        """Learn from a write's answer whether the server keeps device taints (a 1.34/1.35 API server with
        ``DRADeviceTaints`` off drops them; comparing them against its slices would write at every sync)."""
        if not _tainted(sent):
            return
        drops = not _tainted(answer)
        if drops:
            self._taints_checked = time.monotonic()
        if drops and not self.server_drops_taints:
            log_event(
                "dra_taints_dropped",
                node=self._node_name,
                note="the API server dropped spec.devices[].taints (DRADeviceTaints off); the healthy attribute "
                "still tells unhealthy devices",
            )
        self.server_drops_taints = drops

    def _recheck_taints(self, existing: list[JSON], desired: list[JSON]) -> bool:
        """Whether a server seen dropping taints keeps them now (asked with a dry-run update of one slice of ours,
        at most every :attr:`taints_recheck_after` seconds, only while a device is tainted); then the slices need
        the write that brings their taints."""
        if not self.server_drops_taints or time.monotonic() < self._taints_checked + self.taints_recheck_after:
            return False
        wanted = next((obj for obj in desired if _tainted(obj)), None)
        target = next((obj for obj in existing if _pool_name(obj) == self._node_name), None)
        if wanted is None or target is None:
            return False
        name = str(_metadata(target).get("name", ""))
        probe = copy.deepcopy(wanted)
        probe["metadata"] = {
            "name": name,
            "resourceVersion": _metadata(target).get("resourceVersion"),
            "ownerReferences": wanted["metadata"]["ownerReferences"],
        }
        probe["spec"]["pool"]["generation"] = _generation(target)
        try:
            answer = self._api.dry_run_replace_slice(name, probe)
        except KubeError as exc:  # the slices are as wanted: a failed question is asked again later, not a failure
            log_event("dra_taints_recheck_failed", node=self._node_name, error=str(exc))
            self._taints_checked = time.monotonic()
            return False
        self._note_taints(probe, answer)
        if not self.server_drops_taints:
            log_event("dra_taints_kept", node=self._node_name, note="the API server keeps device taints now")
        return not self.server_drops_taints

    def publish(self, inventory: Inventory) -> None:
        """:meth:`sync` and log what changed: the serve loop's inventory sink (``plugin.dra.runner``)."""
        result = self.sync(inventory)
        if result.changed:
            log_event(
                "dra_slices_published",
                node=self._node_name,
                generation=result.generation,
                created=result.created,
                updated=result.updated,
                deleted=result.deleted,
            )

    def sync(self, inventory: Inventory) -> PublishResult:
        """Bring the node's slices to ``inventory``'s devices; :class:`KubeError` when a call fails (the next
        call starts over from what the server has)."""
        self.taint_times.observe(inventory)  # before the list: a device's time is when we saw it, API up or not
        existing = self._api.list_slices(self._node_name)
        if len(existing) > MAX_SLICES:
            raise KubeError(
                f"node {self._node_name} has {len(existing)} ResourceSlices of driver {DRIVER_NAME}, over the "
                f"{MAX_SLICES} this plugin would ever make; delete them (kubectl delete resourceslices "
                f"--field-selector spec.nodeName={self._node_name},spec.driver={DRIVER_NAME})"
            )
        self.taint_times.adopt(existing)
        current = max((_generation(obj) for obj in existing), default=0)
        generation = current + 1
        owner_known = self._owner is not None
        desired = self._desired(inventory, generation)
        if self._up_to_date(existing, desired) and not self._recheck_taints(existing, desired):
            return PublishResult(current)
        if owner_known:  # about to write: read the Node again (one deleted and re-created has a new UID)
            self._owner = None
            desired = self._desired(inventory, generation)
        # The pool name is immutable: a slice of ours naming another pool is deleted, never reused.
        reusable = sorted(
            (obj for obj in existing if _pool_name(obj) == self._node_name),
            key=lambda obj: str(_metadata(obj).get("name", "")),
        )
        stale = [obj for obj in existing if _pool_name(obj) != self._node_name]
        created = updated = deleted = 0
        for obj in desired:
            if reusable:
                old = reusable.pop(0)
                name = str(_metadata(old).get("name", ""))
                obj["metadata"] = {
                    "name": name,
                    "resourceVersion": _metadata(old).get("resourceVersion"),
                    "ownerReferences": obj["metadata"]["ownerReferences"],
                }
                self._note_taints(obj, self._api.replace_slice(name, obj))
                updated += 1
            else:
                self._note_taints(obj, self._api.create_slice(obj))
                created += 1
        for old in [*reusable, *stale]:
            self._api.delete_slice(str(_metadata(old).get("name", "")))
            deleted += 1
        return PublishResult(generation, created, updated, deleted)

    def withdraw(self) -> int:
        """Delete every slice of ours on the node (the driver is being removed); how many there were."""
        existing = self._api.list_slices(self._node_name)
        for obj in existing:
            self._api.delete_slice(str(_metadata(obj).get("name", "")))
        return len(existing)


def cluster_side(
    node_name: str,
    kubeconfig: Path | None = None,
    timeout: tuple[float, float] = DEFAULT_TIMEOUT,
    deadline: float = DEFAULT_DEADLINE,
) -> tuple[KubeClaims, SlicePublisher]:
    """What ``serve --dra`` needs from the API server, on one client: the claim source and the slice publisher
    for ``node_name`` (in-cluster credentials, or ``kubeconfig`` for a plugin run by hand)."""
    api = KubeApi.from_environment(kubeconfig, timeout, deadline)
    return KubeClaims(api), SlicePublisher(api, node_name)


class KubeClaims:
    """The :class:`~plugin.dra.claims.ClaimSource` of a plugin in a cluster: GET the v1 ResourceClaim."""

    def __init__(self, api: KubeApi) -> None:
        self._api = api

    def allocated(self, claim: ClaimRef, until: float | None = None) -> list[AllocatedDevice]:
        check_ref(claim)
        try:
            obj = self._api.read_claim(claim.namespace, claim.name, until)
        except KubeError as exc:
            raise ClaimError(f"claim {claim}: {exc}") from None
        return results_from_claim_object(obj, claim)


__all__ = [
    "API_VERSION",
    "DEFAULT_DEADLINE",
    "DEFAULT_TIMEOUT",
    "JSON",
    "KIND",
    "MAX_RESPONSE_BYTES",
    "KubeApi",
    "KubeClaims",
    "KubeError",
    "PublishResult",
    "SlicePublisher",
    "cluster_side",
]
