"""Preparing and unpreparing claims: the DRA plugin's policy, apart from gRPC (docs/dra.md, "Node side").

:class:`PrepareCore` answers for one claim at a time; the servicers (:mod:`plugin.dra.service`) only translate
messages. For a claim it:

1. reads the claim's allocation from the :class:`~plugin.dra.claims.ClaimSource` (the UID checked) and keeps
   the results of this driver (:data:`schemas.dra.DRIVER_NAME`); other drivers' results are theirs;
2. maps each device name back to a device of the last scan (:func:`schemas.dra.device_id_of`), and re-checks
   it with the device plugin's own rule (:func:`plugin.allocation.allocate`: healthy at the scan, IOMMU group
   unchanged, still on VFIO, ``/dev/vfio`` nodes present), so DRA and the device plugin refuse the same
   devices for the same reasons;
3. writes, per claim request, the KEP 5304 metadata file (:mod:`schemas.dra_metadata`) and one CDI spec file for
   the claim (:mod:`plugin.dra.cdi`) with one CDI device per request: the VFIO nodes and the metadata mount;
4. records the claim in the checkpoint (:mod:`plugin.dra.checkpoint`) and only then answers.

A result with ``adminAccess`` is refused: the scheduler gives such a device even while another claim holds it,
and a VFIO device cannot be shared with a VM (preparing it would take the device from the claim the scheduler
did count). A refusal is the claim's own ``error`` string (naming the claim and the device), never an exception for the
whole call: the kubelet retries the claim later. Bounds: :data:`MAX_CLAIMS_PER_CALL` claims per call,
:data:`MAX_DEVICES_PER_CLAIM` devices of ours per claim, :data:`checkpoint.MAX_CLAIMS` prepared at once. A
device already prepared for another claim is refused (the scheduler never allocates one device twice; a
stale claim or a forged allocation would). An unprepare that comes while a prepare of the same claim is still reading it
(the kubelet gave up on a slow prepare, then the pod went) wins: that prepare fails instead of recording a
claim the kubelet believes gone. One lock serialises the bookkeeping and file writes (milliseconds
each); the claim source, perhaps an API server, is read outside it. A claim source that fails in an
unexpected way fails that claim (``internal error: …``), not the call.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from plugin import allocation
from plugin.allocation import AllocationError
from plugin.dra import cdi, checkpoint
from plugin.dra.checkpoint import PreparedClaim, PreparedDevice
from plugin.dra.claims import (
    AllocatedDevice,
    ClaimError,
    ClaimRef,
    ClaimSource,
    check_ref,
    is_dns_label,
    is_request_name,
)
from plugin.health import UsabilityRule
from plugin.inventory import Device, Inventory, Resource
from plugin.log import log_event
from runtime.files import read_regular_file
from schemas import dra_metadata
from schemas.dra import DRIVER_NAME, device_id_of
from schemas.errors import InputError
from schemas.kinds import ResourceKind

MAX_CLAIMS_PER_CALL = 256
"""Claims in one NodePrepareResources/NodeUnprepareResources call (a pod has a few)."""
MAX_DEVICES_PER_CLAIM = 32
"""Devices of this driver in one claim (Kubernetes allows 32 allocation results per claim)."""
PREPARE_BUDGET = 30.0
"""Seconds one NodePrepareResources call may spend reading its claims from the claim source (an API server):
the kubelet gives the whole call 45 s (``defaultClientCallTimeout``, k8s.io/kubernetes
pkg/kubelet/cm/dra/plugin/dra_plugin.go); what is left covers the file writes and the answer."""
DAMAGED_SUFFIX = ".damaged-"
"""``checkpoint.json.damaged-<ns>``: a checkpoint that could not be read, kept for the operator."""
MAX_DAMAGED_KEPT = 3
"""Damaged checkpoints kept aside at most (each up to ``checkpoint.MAX_CHECKPOINT_BYTES``); the oldest go."""
SHARED_NODES = frozenset({"/dev/vfio/vfio", "/dev/iommu"})
"""Device nodes every VFIO claim is given (the container endpoint, not a device)."""
LOCK_FILE = "lock"
"""Under the state directory: held (a POSIX lock) by the one plugin process that owns the checkpoint and files."""
METADATA_DIR = "metadata"
"""Under the state directory: ``metadata/<claim uid>/<request>/<driver>-metadata.json``."""

_UID = checkpoint.UID_PATTERN


@dataclass(frozen=True, slots=True)
class ClaimOutcome:
    """One claim's answer: its devices, or why it cannot be prepared (``error`` non-empty)."""

    devices: tuple[PreparedDevice, ...] = ()
    error: str = ""


class PrepareCore:
    """Prepared claims of one node: prepare, unprepare, reconcile at start. Thread-safe."""

    def __init__(
        self,
        claims: ClaimSource,
        host_root: Path,
        state_dir: Path,
        cdi_dir: Path,
        *,
        rule: UsabilityRule = allocation.DEFAULT_RULE,
        pool: str | None = None,
        driver: str = DRIVER_NAME,
        max_claims: int = checkpoint.MAX_CLAIMS,
        on_outcome: Callable[[str, str], None] | None = None,
    ) -> None:
        self.claims = claims
        self.host_root = host_root
        self.state_dir = state_dir.absolute()
        self.cdi_dir = cdi_dir.absolute()
        self.metadata_dir = self.state_dir / METADATA_DIR
        self.rule = rule
        self.pool = pool
        """The pool this node's devices are published in (ResourceSlice ``spec.pool.name``); None: any."""
        self.driver = driver
        self.max_claims = max_claims
        self.on_outcome = on_outcome
        """Called with (operation, result) per claim: ``("prepare", "ok" | "error")``... (metrics)."""
        self._lock = threading.Lock()
        self._prepared: dict[str, PreparedClaim] = {}
        self._by_name: dict[tuple[str, str], tuple[Resource, Device]] = {}
        self._inventory: Inventory | None = None
        self._state_lock_fd: int | None = None
        self._reading: dict[str, int] = {}
        """Claim UID → prepares reading its allocation right now (outside the lock)."""
        self._foreign_nodes: dict[str, str] = {}
        """Device node → the CDI spec of ours that gives it and that no claim could be rebuilt for (quarantine)."""
        self._unreadable: list[str] = []
        """Files of ours that could be neither read nor attributed to a claim (quarantine)."""
        self._withdrawn: set[str] = set()
        """UIDs unprepared while a prepare of them was reading: that prepare must not record them."""
        self._not_kept: str | None = None
        """The damaged checkpoint this start could not rename aside (quarantine while this process runs)."""

    # -- state --------------------------------------------------------------------------------------------

    def update_inventory(self, inventory: Inventory) -> None:
        """Use ``inventory`` (the latest scan) for the next prepares."""
        index: dict[tuple[str, str], tuple[Resource, Device]] = {}
        for resource in inventory.resources:
            for device in resource.devices:
                tag = "mdev" if resource.kind is ResourceKind.MDEV else "pci"
                index[(tag, device.id)] = (resource, device)
        with self._lock:
            self._inventory, self._by_name = inventory, index

    def prepared(self) -> dict[str, PreparedClaim]:
        """The prepared claims by UID (a copy)."""
        with self._lock:
            return dict(self._prepared)

    def start(self) -> None:
        """Load the checkpoint and reconcile the files: restore a recorded claim's missing file, remove files
        of ours no recorded claim owns.

        A checkpoint that cannot be read (torn, tampered) is **quarantined**, not reconciled: it is kept aside
        as ``checkpoint.json.damaged-<ns>`` (the newest :data:`MAX_DAMAGED_KEPT`), and who owns which GPU is
        rebuilt from the files prepares wrote (each claim's metadata files name its claim and devices; its CDI
        spec its nodes), so no running claim loses its files and no GPU is prepared for a second claim. While a
        damaged copy is kept, no file of ours is removed at start, a device node named by a spec of ours that
        no claim could be rebuilt for is refused to new claims, and :meth:`quarantine` (``/readyz``) says so."""
        with self._lock:
            self._take_state_lock()
            damaged: str | None = None
            try:
                self._prepared = checkpoint.load(self.state_dir, (self.cdi_dir, self.metadata_dir))
                for claim in self._prepared.values():
                    self._check_own_files(claim)
            except InputError as exc:
                damaged = str(exc)
            self._foreign_nodes, self._unreadable, self._not_kept = {}, [], None
            if damaged is not None:
                kept = self._keep_damaged(damaged)
                self._prepared = self._rebuild()
                log_event(
                    "dra_checkpoint_damaged",
                    error=damaged,
                    kept_as=kept,
                    rebuilt=sorted(self._prepared),
                    unattributed=sorted(set(self._foreign_nodes.values()) | set(self._unreadable)),
                )
                if kept is None:
                    # Nothing kept aside: saving the rebuilt claims over it would end the quarantine at the next
                    # start (it would trust the rebuilt record and remove the files it could not attribute). So
                    # it stays where it is, each start rebuilds again, and this process is quarantined all the
                    # same (a prepare or unprepare that saves will fail the same way, most likely: a state
                    # directory that takes no new file).
                    self._not_kept = str(self.state_dir / checkpoint.FILE_NAME)
                else:
                    try:
                        checkpoint.save(self.state_dir, self._prepared.values())
                    except OSError as exc:
                        log_event("dra_checkpoint_unwritable", error=exc.strerror or str(exc))
            elif self._damaged_copies():
                self._find_unattributed()
            restored = sum(self._restore(claim)[0] for claim in self._prepared.values())
            removed = [] if self._quarantined() else self._remove_orphans()
            log_event("dra_reconciled", prepared=sorted(self._prepared), restored_files=restored, removed=removed)

    def quarantine(self) -> str | None:
        """None unless a damaged checkpoint is kept aside (this start's or an earlier one's); else what that
        means, for ``/readyz``. The operator ends it by removing the kept copies once read."""
        copies = self._damaged_copies()
        if not copies and self._not_kept is None:
            return None
        if self._not_kept is not None:
            first = f"quarantined: the damaged DRA checkpoint {self._not_kept} could not be kept aside (renamed)"
        else:
            first = f"quarantined: a damaged DRA checkpoint is kept as {copies[-1]}"
        parts = [
            first + (f" (and {len(copies) - 1} older)" if len(copies) > 1 else ""),
            "claim ownership was rebuilt from the files on disk and no file of ours is removed at start",
        ]
        unattributed = sorted(set(self._foreign_nodes.values()) | set(self._unreadable))
        if unattributed:
            parts.append(
                f"files no claim could be rebuilt from, their devices refused to new claims: {unattributed[:4]}"
            )
        parts.append(f"remove {self.state_dir / checkpoint.FILE_NAME}.damaged-* once checked")
        return "; ".join(parts)

    def _quarantined(self) -> bool:
        return self._not_kept is not None or bool(self._damaged_copies())

    def _damaged_copies(self) -> list[str]:
        """The damaged checkpoints kept aside, oldest first."""
        prefix = checkpoint.FILE_NAME + DAMAGED_SUFFIX
        try:
            names = [entry.name for entry in os.scandir(self.state_dir) if entry.name.startswith(prefix)]
        except OSError:
            return []
        return [str(self.state_dir / name) for name in sorted(names, key=lambda name: (len(name), name))]

    def _keep_damaged(self, damaged: str) -> str | None:
        """Rename the damaged checkpoint to ``checkpoint.json.damaged-<ns>``, dropping the oldest copies beyond
        :data:`MAX_DAMAGED_KEPT`; the new name. When it cannot be renamed (a mount point, a directory the plugin
        may write files in but not rename this one), a note of what was wrong with it takes the copy's place (the
        quarantine lasts as long as a copy is kept); None when not even that can be written. Lock held."""
        path = self.state_dir / checkpoint.FILE_NAME
        target = path.with_name(f"{path.name}{DAMAGED_SUFFIX}{time.time_ns()}")
        try:
            os.replace(path, target)
        except OSError as exc:
            why = exc.strerror or str(exc)
            log_event("dra_checkpoint_unwritable", error=f"cannot keep {path} aside: {why}")
            note = f"{path} could not be renamed to this name ({why}); it was damaged: {damaged}\n"
            try:
                checkpoint.write_atomic(target, note, 0o600)
            except OSError as exc:
                log_event("dra_checkpoint_unwritable", error=f"cannot write {target}: {exc.strerror or exc}")
                return None
        for old in self._damaged_copies()[:-MAX_DAMAGED_KEPT]:
            with contextlib.suppress(OSError):
                os.unlink(old)
        return str(target)

    def _rebuild(self) -> dict[str, PreparedClaim]:
        """The claims whose files are on disk, read back from them (a damaged checkpoint). Lock held."""
        rebuilt: dict[str, PreparedClaim] = {}
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            for entry in sorted(os.scandir(self.metadata_dir), key=lambda entry: entry.name)[: self.max_claims]:
                if not entry.is_dir(follow_symlinks=False) or not _UID.fullmatch(entry.name):
                    self._unreadable.append(entry.path)
                    continue
                try:
                    rebuilt[entry.name] = self._rebuilt_claim(entry.name)
                except (InputError, OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
                    self._unreadable.append(entry.path)
                    log_event("dra_rebuild_failed", claim=entry.name, error=str(exc)[:300])
        # One device in the files of two claims: which one holds it is unknown, so neither is trusted (a record
        # of both would be a checkpoint that checkpoint.load refuses at every later start).
        owners: dict[tuple[str, str], set[str]] = defaultdict(set)
        for uid, claim in rebuilt.items():
            for device in claim.devices:
                owners[(device.pool, device.device)].add(uid)
        for uid in sorted(set().union(*(uids for uids in owners.values() if len(uids) > 1))):
            del rebuilt[uid]
            self._unreadable.append(str(self.metadata_dir / uid))
            log_event("dra_rebuild_failed", claim=uid, error="a device of it is in the files of another claim too")
        self._prepared = rebuilt
        self._find_unattributed()
        return rebuilt

    def _rebuilt_claim(self, uid: str) -> PreparedClaim:
        """One claim from its metadata files (``metadata/<uid>/<request>/<driver>-metadata.json``) and its CDI
        spec; InputError when they do not agree with what a prepare of it writes."""
        base = self.metadata_dir / uid
        files: dict[str, str] = {}
        devices: list[PreparedDevice] = []
        names: set[tuple[str, str]] = set()
        requests = sorted(os.scandir(base), key=lambda entry: entry.name)
        if not requests or len(requests) > checkpoint.MAX_FILES_PER_CLAIM - 1:
            raise InputError(f"{base}: {len(requests)} request directories")
        for request in requests:
            path = Path(request.path) / f"{self.driver}{dra_metadata.FILE_SUFFIX}"
            if not request.is_dir(follow_symlinks=False) or not is_dns_label(request.name):
                raise InputError(f"{request.path} is not a request directory of ours")
            data = read_regular_file(path, checkpoint.MAX_FILE_BYTES, "DRA metadata file")
            metadata = dra_metadata.parse_metadata(data, str(path))
            ref = check_ref(ClaimRef(metadata.namespace, metadata.claim_name, metadata.uid))
            if ref.uid != uid:
                raise InputError(f"{path} is for claim uid {ref.uid!r}, not {uid}")
            names.add((ref.namespace, ref.name))
            cdi_id = cdi.device_id(cdi.device_name(uid, request.name))
            for entry in metadata.requests:
                if entry.name.partition("/")[0] != request.name:
                    raise InputError(f"{path} lists request {entry.name!r} in the directory of {request.name!r}")
                devices += [
                    PreparedDevice((request.name,), device.pool, device.name, (cdi_id,))
                    for device in entry.devices
                    if device.driver == self.driver
                ]
            files[str(path)] = data.decode("utf-8")
        if len(names) != 1 or not devices:
            raise InputError(f"{base}: its files name {len(names)} claims and {len(devices)} devices of ours")
        spec = self.cdi_dir / cdi.spec_file_name(uid)
        if os.path.lexists(spec):
            text = read_regular_file(spec, checkpoint.MAX_FILE_BYTES, "CDI spec").decode("utf-8")
            found = {device["name"] for device in json.loads(text)["devices"]}
            if found != {cdi.device_name(uid, request.name) for request in requests}:
                raise InputError(f"{spec} names CDI devices {sorted(found)}, not the claim's requests")
            files[str(spec)] = text
        ((namespace, name),) = names
        return PreparedClaim(namespace, name, uid, tuple(devices), files)

    def _find_unattributed(self) -> None:
        """Note the device nodes of every CDI spec of ours that no claim owns (refused to new claims while a
        damaged checkpoint is kept) and the specs that cannot even be read. Lock held."""
        with contextlib.suppress(FileNotFoundError, NotADirectoryError):
            # Only our specs count toward the bound: /var/run/cdi holds other vendors' too, however many.
            ours = sorted(
                (entry for entry in os.scandir(self.cdi_dir) if cdi.claim_uid_of_spec(entry.name) is not None),
                key=lambda entry: entry.name,
            )
            if len(ours) > self.max_claims * 2:
                self._unreadable.append(f"{self.cdi_dir} ({len(ours)} CDI specs of ours, over {self.max_claims * 2})")
            for entry in ours[: self.max_claims * 2]:
                uid = cdi.claim_uid_of_spec(entry.name)
                if uid is None or uid in self._prepared:
                    continue
                try:
                    text = read_regular_file(Path(entry.path), checkpoint.MAX_FILE_BYTES, "CDI spec")
                    nodes = {
                        node["path"]
                        for device in json.loads(text)["devices"]
                        for node in device["containerEdits"].get("deviceNodes", [])
                    }
                except (InputError, OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
                    self._unreadable.append(entry.path)
                    continue
                for node in nodes - SHARED_NODES:
                    self._foreign_nodes[node] = entry.path

    def _take_state_lock(self) -> None:
        """Hold ``<state dir>/lock`` for the life of the process; InputError when another process holds it.

        A second plugin on the same directories (a surge pod of a rolling update, one started by hand) would
        otherwise reconcile under the first one's feet (removing the files of a prepare not yet recorded) and,
        once the first is gone, serve from a checkpoint read long before and overwrite the newer one."""
        if self._state_lock_fd is not None:
            return  # held since an earlier start (closing a second descriptor would drop a POSIX lock)
        path = self.state_dir / LOCK_FILE
        try:
            self.state_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise InputError(f"cannot open the DRA plugin's lock {path}: {exc.strerror or exc}") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise InputError(
                    f"another DRA plugin process holds {path}: its claims and files are that process's; stop it first"
                ) from None
            raise InputError(f"cannot lock {path}: {exc.strerror or exc}") from None
        self._state_lock_fd = fd

    def _check_own_files(self, claim: PreparedClaim) -> None:
        """InputError unless every file recorded for ``claim`` is one a prepare of it writes: its own CDI spec
        or a file below its own metadata directory. ``/var/run/cdi`` holds other vendors' specs too, and an
        unprepare deletes what the record names."""
        spec = self.cdi_dir / cdi.spec_file_name(claim.uid)
        metadata = self.metadata_dir / claim.uid
        for name in claim.files:
            path = Path(name)
            if path != spec and not (path.is_relative_to(metadata) and path != metadata):
                raise InputError(
                    f"DRA checkpoint: claim {claim.uid}: file {name[:120]!r} is not one of the claim's own "
                    f"({spec} or below {metadata})"
                )

    # -- prepare ------------------------------------------------------------------------------------------

    def prepare(self, refs: Sequence[ClaimRef], until: float | None = None) -> dict[str, ClaimOutcome]:
        """Prepare each claim; the answer by UID (every claim of ``refs`` has one). Claims are read from the
        claim source by ``until`` (``time.monotonic()``; default :data:`PREPARE_BUDGET` from now): the reads of
        one call share that time, so the kubelet gets an answer, some claims failed, before its own deadline."""
        if len(refs) > MAX_CLAIMS_PER_CALL:
            raise InputError(f"{len(refs)} claims in one call, over the limit of {MAX_CLAIMS_PER_CALL}")
        if until is None:
            until = time.monotonic() + PREPARE_BUDGET
        answers: dict[str, ClaimOutcome] = {}
        for ref in refs:
            try:
                outcome = ClaimOutcome(devices=self._prepare_one(ref, until))
            except (ClaimError, InputError, AllocationError, ValueError) as exc:
                text = exc.message if isinstance(exc, AllocationError) else str(exc)
                if not text.startswith("claim "):
                    text = f"claim {ref}: {text}"
                outcome = ClaimOutcome(error=text)
                log_event("dra_prepare_refused", claim=str(ref), error=text)
            except Exception as exc:  # the claim source's or our own bug: this claim fails, the others go on
                outcome = ClaimOutcome(error=f"claim {ref}: internal error: {type(exc).__name__}: {exc}")
                log_event("dra_internal_error", claim=str(ref), error=outcome.error)
            answers[ref.uid] = outcome
            if self.on_outcome is not None:
                self.on_outcome("prepare", "error" if outcome.error else "ok")
        return answers

    def _prepare_one(self, ref: ClaimRef, until: float) -> tuple[PreparedDevice, ...]:
        """The claim's devices: the recorded answer, or a new prepare. The claim source (perhaps an API GET)
        is asked outside the lock, so a slow one does not hold up other claims."""
        check_ref(ref)
        if not _UID.fullmatch(ref.uid):
            raise ClaimError(f"claim {ref}: the uid is not a Kubernetes UID")
        with self._lock:
            known = self._known(ref)
            if known is not None:
                return known
            self._reading[ref.uid] = self._reading.get(ref.uid, 0) + 1
        try:
            try:
                if time.monotonic() >= until:
                    raise ClaimError(
                        f"claim {ref}: not read: the call's time ran out reading the claims before it (the kubelet "
                        "asks again)"
                    )
                results = self.claims.allocated(ref, until)
            except InputError:
                raise
            except Exception as exc:  # the source's own trouble (a connection reset...): this claim fails
                raise ClaimError(f"claim {ref}: reading its allocation failed: {type(exc).__name__}: {exc}") from None
            with self._lock:
                known = self._known(ref)  # prepared meanwhile by a concurrent call
                if known is not None:
                    return known
                if ref.uid in self._withdrawn:
                    raise ClaimError(
                        f"claim {ref} was unprepared while it was being prepared; not prepared (the kubelet asks "
                        "again if it still needs it)"
                    )
                return self._prepare_new(ref, results)
        finally:
            with self._lock:
                left = self._reading.pop(ref.uid) - 1
                if left:
                    self._reading[ref.uid] = left
                else:
                    self._withdrawn.discard(ref.uid)

    def _known(self, ref: ClaimRef) -> tuple[PreparedDevice, ...] | None:
        """The recorded answer for ``ref`` (its missing files rewritten), None when not prepared. Lock held."""
        known = self._prepared.get(ref.uid)
        if known is None:
            return None
        if (known.namespace, known.name) != (ref.namespace, ref.name):
            raise ClaimError(f"claim {ref}: uid already prepared for claim {known.namespace}/{known.name}")
        self._check_nodes(ref, known)
        failed = self._restore(known)[1]
        if failed:
            path, why = failed[0]
            raise ClaimError(f"claim {ref}: its file {path} is missing and cannot be written again: {why}")
        return known.devices

    def _check_nodes(self, ref: ClaimRef, claim: PreparedClaim) -> None:
        """ClaimError when the device nodes recorded for ``claim`` are no longer the ones its devices need now (the
        device plugin's rule on the last scan, each device re-checked). IOMMU groups are numbered at boot and
        VFIO cdevs (``/dev/vfio/devices/vfioN``) at each bind to vfio-pci: after a reboot or a rebind, the
        recorded spec (rewritten to the emptied ``/var/run/cdi``) would hand the container another device's
        node, perhaps one prepared for another claim. Lock held."""
        if self._inventory is None:
            return
        text = claim.files.get(str(self.cdi_dir / cdi.spec_file_name(claim.uid)))
        if text is None:
            return
        try:
            spec = json.loads(text)
            recorded = {
                device["name"]: {node["path"] for node in device["containerEdits"].get("deviceNodes", [])}
                for device in spec["devices"]
            }
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ClaimError(
                f"claim {ref}: its recorded CDI spec cannot be read; unprepare it and prepare again"
            ) from None
        members: dict[str, list[tuple[Resource, Device]]] = {}
        for prepared in claim.devices:
            try:
                found = self._by_name.get(device_id_of(prepared.device))
            except InputError:
                found = None
            if found is None:
                raise ClaimError(f"claim {ref}: device {prepared.device} is no longer on this node (last scan)")
            for cdi_id in prepared.cdi_ids:
                members.setdefault(cdi_id.partition("=")[2], []).append(found)
        expected = {name: set(self._device_nodes(found)) for name, found in members.items()}
        if expected != recorded:
            was, now = sorted(set().union(*recorded.values())), sorted(set().union(*expected.values()))
            raise ClaimError(
                f"claim {ref}: its devices' VFIO nodes changed since it was prepared (recorded {was}, now {now}: "
                "IOMMU groups renumbered or a device bound again); its CDI spec would give the container other "
                "devices' nodes"
            )

    def _prepare_new(self, ref: ClaimRef, results: Sequence[AllocatedDevice]) -> tuple[PreparedDevice, ...]:
        """Prepare a claim not recorded yet from its allocation ``results``. Lock held."""
        if len(self._prepared) >= self.max_claims:
            raise ClaimError(f"claim {ref}: {len(self._prepared)} claims are prepared, the limit is {self.max_claims}")
        ours = [result for result in results if result.driver == self.driver]
        if len(ours) > MAX_DEVICES_PER_CLAIM:
            raise ClaimError(f"claim {ref} has {len(ours)} devices of {self.driver}, over {MAX_DEVICES_PER_CLAIM}")
        admin = next((result for result in ours if result.admin_access), None)
        if admin is not None:
            raise ClaimError(
                f"claim {ref}: device {admin.device} is allocated with adminAccess; a VFIO device is given to one "
                "VM alone, so admin access to it is not supported"
            )
        chosen = [self._lookup(ref, result) for result in ours]
        self._check_not_taken(ref, ours)
        by_request: dict[str, list[tuple[AllocatedDevice, Resource, Device]]] = defaultdict(list)
        for result, (resource, device) in zip(ours, chosen, strict=True):
            base = result.request.partition("/")[0]
            if not is_request_name(result.request) or not is_dns_label(base):
                raise ClaimError(
                    f"claim {ref}: request {base[:80]!r} (result {result.request[:80]!r}) is not a request name "
                    "(a DNS label: it names a directory and a CDI device)"
                )
            by_request[base].append((result, resource, device))
        files: dict[str, str] = {}
        cdi_devices: list[cdi.CdiDevice] = []
        prepared: list[PreparedDevice] = []
        if self._unreadable:
            raise ClaimError(
                f"claim {ref}: not prepared: file {self._unreadable[0]} of ours cannot be read after a damaged "
                'checkpoint, so which GPU it gives is unknown (quarantine: docs/dra.md, "Restarts")'
            )
        for request, members in sorted(by_request.items()):
            nodes = self._device_nodes([(resource, device) for _, resource, device in members])
            taken = sorted(set(nodes) & self._foreign_nodes.keys())
            if taken:
                raise ClaimError(
                    f"claim {ref}: device node {taken[0]} is given by CDI spec {self._foreign_nodes[taken[0]]}, of a "
                    "claim whose ownership could not be rebuilt after a damaged checkpoint (quarantine: docs/dra.md, "
                    '"Restarts"); not prepared twice'
                )
            host_path, container_path, text = self._metadata(ref, request, members)
            files[str(host_path)] = text
            name = cdi.device_name(ref.uid, request)
            cdi_devices.append(cdi.CdiDevice(name, nodes, (cdi.Mount(str(host_path), container_path),)))
            # The kubelet hands a container the devices whose request_names hold the request the container
            # names, compared exactly, and a container names only top-level requests: so the base request, never
            # "req/subrequest" (Kubernetes' kubelet-plugin helper strips it the same way).
            prepared += [
                PreparedDevice((request,), result.pool, result.device, (cdi.device_id(name),))
                for result, _, _ in members
            ]
        if cdi_devices:
            files[str(self.cdi_dir / cdi.spec_file_name(ref.uid))] = cdi.render_spec(cdi_devices)
        claim = PreparedClaim(ref.namespace, ref.name, ref.uid, tuple(prepared), files)
        try:
            for path, text in files.items():
                checkpoint.write_atomic(Path(path), text)
            self._prepared[ref.uid] = claim
            checkpoint.save(self.state_dir, self._prepared.values())
        except OSError as exc:
            self._prepared.pop(ref.uid, None)
            self._delete_files(claim)
            raise ClaimError(f"claim {ref}: cannot write its files: {exc.strerror or exc}") from None
        log_event("dra_prepared", claim=str(ref), devices=[device.device for device in prepared], files=sorted(files))
        return claim.devices

    def _lookup(self, ref: ClaimRef, result: AllocatedDevice) -> tuple[Resource, Device]:
        if self.pool is not None and result.pool != self.pool:
            raise ClaimError(f"claim {ref}: device {result.device!r} is from pool {result.pool!r}, not {self.pool!r}")
        try:
            tag, device_id = device_id_of(result.device)
        except InputError as exc:
            raise ClaimError(f"claim {ref}: {exc}") from None
        found = self._by_name.get((tag, device_id))
        if found is None:
            scanned = "no scan yet" if self._inventory is None else "not in the node's last scan"
            raise ClaimError(f"claim {ref}: device {result.device} ({device_id}) is not on this node ({scanned})")
        return found

    def _check_not_taken(self, ref: ClaimRef, ours: Sequence[AllocatedDevice]) -> None:
        names = [result.device for result in ours]
        twice = next((name for name in names if names.count(name) > 1), None)
        if twice is not None:
            raise ClaimError(f"claim {ref}: device {twice} is allocated twice in it")
        for other in self._prepared.values():
            taken = {device.device for device in other.devices}.intersection(names)
            if taken:
                raise ClaimError(
                    f"claim {ref}: device {sorted(taken)[0]} is prepared for claim "
                    f"{other.namespace}/{other.name} (uid {other.uid})"
                )

    def _device_nodes(self, members: Sequence[tuple[Resource, Device]]) -> tuple[str, ...]:
        """The VFIO nodes of one request's devices, re-checked as Allocate does (per resource)."""
        by_resource: dict[str, tuple[Resource, list[str]]] = {}
        for resource, device in members:
            by_resource.setdefault(resource.name, (resource, []))[1].append(device.id)
        nodes: list[str] = []
        for resource, ids in by_resource.values():
            answer = allocation.allocate(resource, ids, self.host_root, self.rule)
            nodes += [spec.host_path for spec in answer.device_specs if spec.host_path not in nodes]
        return tuple(nodes)

    def _metadata(
        self, ref: ClaimRef, request: str, members: Sequence[tuple[AllocatedDevice, Resource, Device]]
    ) -> tuple[Path, str, str]:
        """Where the request's KEP 5304 file lives on the node and in the container, and its text.

        The file sits in the directory of the top-level request; inside, each device is listed under its
        result's full request name (``gpu/high-memory`` for a prioritized-list alternative), as Kubernetes'
        device metadata protocol says."""
        pod_claim_name = members[0][0].pod_claim_name
        by_name: dict[str, list[dra_metadata.MetadataDevice]] = {}
        for result, resource, device in members:
            by_name.setdefault(result.request, []).append(
                dra_metadata.MetadataDevice(
                    driver=self.driver,
                    pool=result.pool,
                    name=result.device,
                    attributes=(
                        dra_metadata.device_attributes(mdev_uuid=device.id)
                        if resource.kind is ResourceKind.MDEV
                        else dra_metadata.device_attributes(pci_bus_id=device.id)
                    ),
                )
            )
        document = dra_metadata.DeviceMetadata(
            claim_name=ref.name,
            namespace=ref.namespace,
            uid=ref.uid,
            pod_claim_name=pod_claim_name,
            requests=tuple(dra_metadata.MetadataRequest(name, tuple(devices)) for name, devices in by_name.items()),
        )
        source, directory = dra_metadata.claim_directory(ref.name, pod_claim_name)
        container = dra_metadata.metadata_path(dra_metadata.DEFAULT_ROOT, source, directory, request, self.driver)
        host = self.metadata_dir / ref.uid / request / f"{self.driver}{dra_metadata.FILE_SUFFIX}"
        return host, str(container), dra_metadata.render_metadata(document).decode("utf-8")

    # -- unprepare ----------------------------------------------------------------------------------------

    def unprepare(self, refs: Sequence[ClaimRef]) -> dict[str, str]:
        """Unprepare each claim: by UID, ``""`` when done (an unknown claim is done), else why not."""
        if len(refs) > MAX_CLAIMS_PER_CALL:
            raise InputError(f"{len(refs)} claims in one call, over the limit of {MAX_CLAIMS_PER_CALL}")
        answers: dict[str, str] = {}
        with self._lock:
            for ref in refs:
                if ref.uid in self._reading:
                    self._withdrawn.add(ref.uid)  # a prepare reading it now must not record it afterwards
                claim = self._prepared.pop(ref.uid, None)
                error = ""
                if claim is None and _UID.fullmatch(ref.uid):
                    self._release_unattributed(ref)
                if claim is not None:
                    try:
                        checkpoint.save(self.state_dir, self._prepared.values())
                    except OSError as exc:
                        self._prepared[ref.uid] = claim
                        error = f"claim {ref}: cannot record the unprepare: {exc.strerror or exc}"
                    else:
                        self._delete_files(claim)  # a file left behind goes at the next start
                        log_event("dra_unprepared", claim=str(ref))
                answers[ref.uid] = error
                if error:
                    log_event("dra_unprepare_failed", claim=str(ref), error=error)
                if self.on_outcome is not None:
                    self.on_outcome("unprepare", "error" if error else "ok")
        return answers

    def _release_unattributed(self, ref: ClaimRef) -> None:
        """The kubelet unprepares a claim whose files of ours survived a damaged checkpoint but could not be
        rebuilt into a claim (quarantine): no pod on this node uses it any more, so its spec and metadata go and
        the devices they named are free again, as after the unprepare of a recorded claim. Lock held."""
        spec = str(self.cdi_dir / cdi.spec_file_name(ref.uid))
        metadata = str(self.metadata_dir / ref.uid)
        if spec not in self._foreign_nodes.values() and not {spec, metadata} & set(self._unreadable):
            return
        with contextlib.suppress(OSError):
            os.unlink(spec)
        shutil.rmtree(metadata, ignore_errors=True)
        if os.path.lexists(spec) or os.path.lexists(metadata):
            return  # still there (a directory where the spec should be...): still refused, still reported
        self._foreign_nodes = {node: path for node, path in self._foreign_nodes.items() if path != spec}
        self._unreadable = [path for path in self._unreadable if path not in (spec, metadata)]
        log_event("dra_unattributed_released", claim=str(ref), files=[spec, metadata])

    # -- files --------------------------------------------------------------------------------------------

    def _restore(self, claim: PreparedClaim) -> tuple[int, list[tuple[str, str]]]:
        """Rewrite the claim's files that are missing: how many were, and (path, why) of those that could not be."""
        count = 0
        failed: list[tuple[str, str]] = []
        for path, text in claim.files.items():
            if not os.path.lexists(path):
                try:
                    checkpoint.write_atomic(Path(path), text)
                    count += 1
                except OSError as exc:
                    failed.append((path, exc.strerror or str(exc)))
                    log_event("dra_restore_failed", claim=claim.uid, file=path, error=exc.strerror or str(exc))
        return count, failed

    def _delete_files(self, claim: PreparedClaim) -> None:
        for path in claim.files:
            with contextlib.suppress(OSError):
                os.unlink(path)
        shutil.rmtree(self.metadata_dir / claim.uid, ignore_errors=True)

    def _remove_orphans(self) -> list[str]:
        """Remove our spec files and metadata directories of claims not prepared; their names."""
        removed: list[str] = []
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.cdi_dir):
                if entry.name.startswith("." + cdi.SPEC_PREFIX) and entry.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)  # a write cut short by a crash
                    continue
                uid = cdi.claim_uid_of_spec(entry.name)
                if uid is not None and uid not in self._prepared and entry.is_file(follow_symlinks=False):
                    with contextlib.suppress(OSError):
                        os.unlink(entry.path)
                        removed.append(entry.path)
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.metadata_dir):
                if entry.name not in self._prepared:
                    if entry.is_dir(follow_symlinks=False):
                        shutil.rmtree(entry.path, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(entry.path)
                    removed.append(entry.path)
        return removed


def outcome_counts(outcomes: Mapping[str, ClaimOutcome]) -> tuple[int, int]:
    """(prepared, refused) among ``outcomes``."""
    refused = sum(1 for outcome in outcomes.values() if outcome.error)
    return len(outcomes) - refused, refused
