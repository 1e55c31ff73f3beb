"""Which device a DRA entry of the VMI names, read from the DRA driver's metadata files as virt-launcher reads them.

A ``gpus[]``/``hostDevices[]`` entry with ``claimName``/``requestName`` (and no ``deviceName``) gets its device
from a KEP 5304 metadata file rather than from a ``PCI_RESOURCE_*`` variable (docs/dra.md, "Hook side"). The
steps are virt-launcher's (KubeVirt ``pkg/dra/utils.go``):

1. ``claimName`` names a ``spec.resourceClaims[]`` entry; with a ``resourceClaimName`` the files are under
   ``resourceclaims/<resourceClaimName>/``, otherwise (a template) under ``resourceclaimtemplates/<name>/``;
2. the request's directory holds exactly one ``*-metadata.json`` (one driver per request);
3. the file's ``DeviceMetadata`` has the request with exactly one device; its ``mdevUUID`` makes it a vGPU,
   else its ``resource.kubernetes.io/pciBusID`` a PCI function.

This module does the reading (the only I/O of the DRA path, below a :class:`runtime.confined.ConfinedRoot`);
the matcher (:mod:`launcher_hook.matching`) decides what each outcome means, since a file the hook cannot find
is fine when virt-launcher has rendered the entry itself and an error otherwise.

**Kept for the pod's life.** A reader made by :meth:`MetadataFiles.keeping` (the one a ``HookService`` holds)
keeps, per request directory, the device its one file named, and a later call uses it without a system call, as
the sysfs facts of the pod's devices are kept (:mod:`runtime.sysfs_paths`). The device cannot change while the
pod holds the claim: the file is written when the claim is prepared for the pod (KEP 5304: the kubelet writes
the driver's metadata of a prepared claim and the container runtime mounts it through CDI), a claim's allocation
is immutable once made and cannot be taken from a pod among its ``reservedFor``, and a prepared claim is not
prepared again for the same pod; a migration target is another pod, with its own sidecar. (Checking the
directory's and the file's identity on every call cost two ``stat`` calls per claim, 64 for a VM of 32 claimed
GPUs, for a change nothing Kubernetes does makes.) Outcomes that are not a device (no file, an error) are never
kept, so a file that appears later is read. At most :data:`runtime.sysfs_paths.MAX_KEPT` directories, the oldest
evicted.
"""

from __future__ import annotations

from pathlib import Path

from launcher_hook.claims import ClaimOutcome, EntryKey, dra_entries
from runtime.confined import ConfinedRoot, NotInRoot, OpenRoot
from runtime.sysfs_paths import MAX_KEPT, KeptFacts
from schemas import InputError, PciAddress, ResourceKind
from schemas.dra_metadata import (
    DEFAULT_ROOT,
    FILE_SUFFIX,
    MAX_FILE_BYTES,
    DeviceMetadata,
    claimed_device,
    parse_metadata,
    request_subpath,
)
from schemas.vmi import ResourceClaim, VirtualMachineInstance

KeptDirectory = tuple[bool, str, str]
"""A request directory as the kept store names it: (a ResourceClaim's own directory, not a template's; the
claim's directory name; the request)."""

MAX_DIRECTORY_ENTRIES = 64
"""Most names a request's directory may hold (one file per driver; KubeVirt takes one)."""


class MetadataFiles:
    """The metadata files below ``root`` (virt-launcher's :data:`DEFAULT_ROOT` in its container; in a sidecar,
    wherever the files are visible, e.g. ``/proc/<pid>/root`` + that path).

    One :meth:`resolve` opens the root once, the first time an entry needs it, and reads every claim through
    that descriptor (:class:`runtime.confined.OpenRoot`): per claim, its request directory resolved inside the
    root and listed, and the one file read relative to it. ``kept`` (:meth:`keeping`): the device read, per request
    directory, used again for the reader's life; None: every call reads."""

    def __init__(
        self, root: Path | str = DEFAULT_ROOT, kept: KeptFacts[KeptDirectory, ClaimOutcome] | None = None
    ) -> None:
        self.root = Path(root)
        self._confined = ConfinedRoot(self.root, "DRA metadata root")
        self.kept = kept

    def keeping(self, bound: int = MAX_KEPT) -> MetadataFiles:
        """This reader with a store of its own (at most ``bound`` request directories, the oldest evicted)."""
        return MetadataFiles(self.root, KeptFacts(bound))

    def describe(self) -> str:
        return f"DRA metadata files under {str(self.root)!r}"

    def resolve(self, vmi: VirtualMachineInstance) -> dict[EntryKey, ClaimOutcome]:
        outcomes: dict[EntryKey, ClaimOutcome] = {}
        read: dict[str, DeviceMetadata | None] = {}
        tree: OpenRoot | None = None
        root_missing = False
        entries = dra_entries(vmi)
        if not entries:
            return outcomes
        kept = self.kept
        claims: dict[str, ResourceClaim] = {}
        for each in vmi.spec.resource_claims:
            claims.setdefault(each.name, each)  # the first of a name, as vmi.spec.resource_claim (virt-launcher)
        try:
            for key, name, claim_name, request in entries:
                claim = claims.get(claim_name)
                if claim is None:
                    continue  # the matcher names the entry and the missing resourceClaims[] entry
                # (the directory by its parts: a kept one was checked when it was read, and is not built again)
                own = claim.resource_claim_name
                kept_as: KeptDirectory = (True, own, request) if own else (False, claim_name, request)
                found = kept.get(kept_as) if kept is not None else None
                if found is not None:
                    outcomes[key] = found
                    continue
                try:
                    directory = request_subpath("claim" if own else "template", kept_as[1], request)
                    if tree is None and not root_missing:
                        try:
                            tree = self._confined.open()
                        except NotInRoot:
                            root_missing = True  # every entry: no file matches its pattern
                    outcomes[key] = self._outcome(tree, directory, request, read, kept_as)
                except InputError as exc:
                    label = f"{key[0]}[{key[1]}] {name!r} (claimName {claim_name}, requestName {request})"
                    raise InputError(f"{label}: {exc}") from None
        finally:
            if tree is not None:
                tree.close()
        return outcomes

    def _outcome(
        self,
        tree: OpenRoot | None,
        directory: str,
        request: str,
        read: dict[str, DeviceMetadata | None],
        kept_as: KeptDirectory,
    ) -> ClaimOutcome:
        shown_dir = self._confined.path_text(directory)
        if tree is None:
            pattern = f"{shown_dir}/*{FILE_SUFFIX}"
            return ClaimOutcome(None, None, pattern, f"no file matches {pattern}")
        try:
            listing = tree.directory(directory, MAX_DIRECTORY_ENTRIES, repr(shown_dir))
        except NotInRoot:
            pattern = f"{shown_dir}/*{FILE_SUFFIX}"
            return ClaimOutcome(None, None, pattern, f"no file matches {pattern}")
        with listing:
            names = [n for n in listing.names if n.endswith(FILE_SUFFIX)]
            if not names:
                pattern = f"{shown_dir}/*{FILE_SUFFIX}"
                return ClaimOutcome(None, None, pattern, f"no file matches {pattern}")
            if len(names) > 1:
                raise InputError(
                    f"{len(names)} metadata files in {shown_dir} ({', '.join(names)}); KubeVirt takes exactly one "
                    "driver per request"
                )
            relative = f"{directory}/{names[0]}"
            shown = f"{shown_dir}/{names[0]}"
            if relative not in read:
                try:
                    data = listing.read(names[0], MAX_FILE_BYTES, "DRA metadata file", repr(shown))
                except NotInRoot:
                    read[relative] = None
                else:
                    read[relative] = parse_metadata(data, shown)
        metadata = read[relative]
        if metadata is None:
            return ClaimOutcome(None, None, shown, f"{shown} disappeared while it was read")
        found = claimed_device(metadata, request, shown)
        if found.kind == "mdev":
            outcome = ClaimOutcome(ResourceKind.MDEV, found.id, shown)
        else:
            outcome = ClaimOutcome(ResourceKind.PCI, PciAddress.parse(found.id), shown)
        if self.kept is not None:
            self.kept.put(kept_as, outcome)
        return outcome
