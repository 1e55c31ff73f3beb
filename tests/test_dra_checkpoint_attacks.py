"""Attacks on the damaged-checkpoint quarantine (issue 22, finding 6) that it did not hold before.

- ``checkpoint.json`` a symbolic link whose target is gone (or any link): it counted as *no checkpoint*, so
  the start removed the running claim's CDI spec and metadata, and its GPU went to the next claim. A
  checkpoint is only ever written by renaming a regular file over it: a link is damage, quarantined.
- a checkpoint that records one GPU for two claims: a prepare never records that (a device prepared for one
  claim is refused to another), so it is damage too, not a record to serve from.
- a damaged checkpoint that cannot be renamed aside: the start then removed the files of claims it could not
  rebuild, overwrote the damaged file with the rebuilt one (so the next start trusted it) and ``/readyz`` said
  ready. The quarantine now holds for this process and the damaged file is left for the next start.
- ``/var/run/cdi`` full of other vendors' specs: the look for our unattributed specs stopped after the first
  8192 entries of the directory, whoever's, so a spec of ours sorted after them was never seen and its GPU was
  prepared again. Only our own specs count toward the bound, and beyond it every new claim is refused.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from plugin.dra import cdi, checkpoint
from plugin.dra.claims import ClaimRef
from schemas.errors import InputError
from tests.test_dra_checkpoint_damage import RUNNING, SECOND, UID, UID2, Node, gpu


def test_a_checkpoint_that_is_a_dangling_link_is_damage_not_absence(tmp_path: Path) -> None:
    node = Node(tmp_path)
    first = node.core().prepare([RUNNING])[UID]
    before = node.files()
    path = node.state / checkpoint.FILE_NAME
    path.unlink()
    path.symlink_to(tmp_path / "gone.json")
    core = node.core()
    assert node.files() == before  # the running claim's files are all still there
    assert core.prepared()[UID].devices == first.devices
    assert "is prepared for claim vms/running" in core.prepare([SECOND])[UID2].error
    (kept,) = node.kept()
    assert kept.is_symlink()  # the link itself kept aside, its target not followed
    assert (core.quarantine() or "").startswith("quarantined")


def test_a_checkpoint_that_links_to_a_valid_one_elsewhere_is_not_read(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    path = node.state / checkpoint.FILE_NAME
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"version": checkpoint.VERSION, "claims": {}}))  # "nothing is prepared"
    path.unlink()
    path.symlink_to(elsewhere)
    core = node.core()
    assert UID in core.prepared() and (node.cdi_dir / cdi.spec_file_name(UID)).exists()
    assert elsewhere.read_text() == json.dumps({"version": checkpoint.VERSION, "claims": {}})  # untouched


def test_a_checkpoint_giving_one_gpu_to_two_claims_is_damage(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    path = node.state / checkpoint.FILE_NAME
    obj = json.loads(path.read_text())
    forged = json.loads(json.dumps(obj["claims"][UID]))
    forged.update(name="second", files={})
    obj["claims"][UID2] = forged  # the running claim's GPUs, recorded for another claim as well
    path.write_text(json.dumps(obj))
    with pytest.raises(InputError, match=r"device 'pci-0000-86-00-0' of pool 'node01' is recorded for two claims"):
        checkpoint.load(node.state, (node.cdi_dir, node.state / "metadata"))
    core = node.core()
    assert set(core.prepared()) == {UID}  # rebuilt from the files: the one claim that has them
    assert node.kept() and (core.quarantine() or "").startswith("quarantined")


@pytest.mark.parametrize("note_too", [False, True], ids=["rename-fails", "rename-and-note-fail"])
def test_a_damaged_checkpoint_that_cannot_be_renamed_aside_still_quarantines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, note_too: bool
) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    metadata = next((node.state / "metadata" / UID).rglob("*metadata.json"))
    metadata.write_text("{torn")  # this claim cannot be rebuilt: its files must stay, its GPU refused
    node.tear()
    torn = (node.state / checkpoint.FILE_NAME).read_text()
    before = node.files()
    real_replace = os.replace
    path = str(node.state / checkpoint.FILE_NAME)

    def replace(src: str, dst: str) -> None:
        if str(src) == path or (note_too and Path(dst).name.startswith(checkpoint.FILE_NAME + ".damaged-")):
            raise PermissionError(13, "Permission denied")  # the rename aside fails (EBUSY, EACCES, ...)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    core = node.core()
    monkeypatch.undo()
    assert node.files() == before  # nothing removed
    assert "cannot be read after a damaged checkpoint" in core.prepare([SECOND])[UID2].error
    problem = core.quarantine()
    assert problem is not None and problem.startswith("quarantined")
    if note_too:
        assert "could not be kept aside" in problem and not node.kept()
        assert (node.state / checkpoint.FILE_NAME).read_text() == torn  # left for the next start to see again
    else:
        (kept,) = node.kept()
        assert "could not be renamed" in kept.read_text() and "not JSON" in kept.read_text()
    again = node.core()  # the next start, renames working again
    assert node.files() == before and (again.quarantine() or "").startswith("quarantined")


def test_other_vendors_specs_do_not_hide_an_unattributed_spec_of_ours(tmp_path: Path) -> None:
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    shutil.rmtree(node.state / "metadata" / UID)  # the running claim cannot be rebuilt: its spec is unattributed
    node.tear()
    node.cdi_dir.mkdir(exist_ok=True)
    for index in range(checkpoint.MAX_CLAIMS * 2 + 1):  # another vendor's specs, sorted before ours
        (node.cdi_dir / f"amd.com-gpu_{index:05}.json").touch()
    third = ClaimRef("vms", "third", "2b2b2b2b-0000-4000-8000-000000000002")
    node.claims[third] = [gpu("pci-0000-86-00-0")]
    core = node.core()
    assert UID not in core.prepared()
    refused = core.prepare([third])[third.uid].error
    assert "is given by CDI spec" in refused and cdi.spec_file_name(UID) in refused


@pytest.mark.parametrize("damage", ["no-metadata", "torn-metadata"])
def test_the_kubelets_unprepare_of_an_unattributed_claim_frees_its_gpu(tmp_path: Path, damage: str) -> None:
    """A claim whose files survived a damaged checkpoint but could not be rebuilt kept its GPU (or, with a file
    that cannot be read, every GPU) refused until the operator cleaned up by hand, even once the kubelet had
    unprepared it: the kubelet's word that no pod uses it frees what its own files named."""
    node = Node(tmp_path)
    node.core().prepare([RUNNING])
    if damage == "no-metadata":
        shutil.rmtree(node.state / "metadata" / UID)
    else:
        next((node.state / "metadata" / UID).rglob("*metadata.json")).write_text("{torn")
    node.tear()
    core = node.core()
    assert core.prepare([SECOND])[UID2].error  # refused while the running claim's files are unattributed
    assert core.unprepare([RUNNING]) == {UID: ""}
    assert node.files() == {}
    assert core.prepare([SECOND])[UID2].error == ""
    problem = core.quarantine()
    assert problem is not None and "files no claim could be rebuilt from" not in problem
