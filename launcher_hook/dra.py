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
"""

from __future__ import annotations

from pathlib import Path

from launcher_hook.claims import ClaimOutcome, EntryKey, dra_entries
from runtime.confined import ConfinedRoot, NotInRoot, OpenRoot
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

MAX_DIRECTORY_ENTRIES = 64
"""Most names a request's directory may hold (one file per driver; KubeVirt takes one)."""


class MetadataFiles:
    """The metadata files below ``root`` (virt-launcher's :data:`DEFAULT_ROOT` in its container; in a sidecar,
    wherever the files are visible, e.g. ``/proc/<pid>/root`` + that path).

    One :meth:`resolve` opens the root once, the first time an entry needs it, and reads every claim through
    that descriptor (:class:`runtime.confined.OpenRoot`): per claim, its request directory resolved inside the
    root and listed, and the one file read relative to it. Nothing is kept from one call to the next."""

    def __init__(self, root: Path | str = DEFAULT_ROOT) -> None:
        self.root = Path(root)
        self._confined = ConfinedRoot(self.root, "DRA metadata root")

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
        claims: dict[str, ResourceClaim] = {}
        for each in vmi.spec.resource_claims:
            claims.setdefault(each.name, each)  # the first of a name, as vmi.spec.resource_claim (virt-launcher)
        try:
            for key, name, claim_name, request in entries:
                claim = claims.get(claim_name)
                if claim is None:
                    continue  # the matcher names the entry and the missing resourceClaims[] entry
                try:
                    if tree is None and not root_missing:
                        try:
                            tree = self._confined.open()
                        except NotInRoot:
                            root_missing = True  # every entry: no file matches its pattern
                    outcomes[key] = self._outcome(tree, claim_name, claim.resource_claim_name, request, read)
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
        claim_name: str,
        resource_claim_name: str | None,
        request: str,
        read: dict[str, DeviceMetadata | None],
    ) -> ClaimOutcome:
        if resource_claim_name:
            directory = request_subpath("claim", resource_claim_name, request)
        else:
            directory = request_subpath("template", claim_name, request)
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
            return ClaimOutcome(ResourceKind.MDEV, found.id, shown)
        return ClaimOutcome(ResourceKind.PCI, PciAddress.parse(found.id), shown)
