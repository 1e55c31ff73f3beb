"""What the DRA plugin has prepared, kept on disk so that a restart neither leaks nor prepares twice.

The kubelet may call NodePrepareResources again for a claim it already prepared (after its own restart, or
when an answer was lost) and calls NodeUnprepareResources once the claim's last pod is gone, perhaps long
after this process restarted. So every prepared claim is recorded, before the kubelet is answered, in
``<state dir>/checkpoint.json``: the claim (namespace, name, UID), the answer (devices with their CDI IDs)
and every file written for it **with its content**. That gives three guarantees:

- re-prepare of a recorded claim returns the recorded answer and rewrites a file that went missing (``/var/run``
  is a tmpfs: a node reboot empties it while the checkpoint in ``/var/lib/kubelet`` survives);
- unprepare deletes exactly the recorded files;
- at start, files of ours that no recorded claim owns are removed (a crash between writing a claim's files and
  recording it), so nothing leaks.

The file is written to a temporary name in the same directory, flushed and renamed: a reader sees the old
checkpoint or the new one, never half of one. Reading it is strict and bounded; paths in it must lie under the
directories the plugin owns, so a tampered checkpoint cannot make the plugin write or delete elsewhere.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.files import read_open_file
from schemas.errors import InputError

FILE_NAME = "checkpoint.json"
VERSION = 1
MAX_CHECKPOINT_BYTES = 64 * 1024 * 1024
"""Bound on the checkpoint (4096 claims of 32 devices with their files stay well below)."""
MAX_CLAIMS = 4096
"""Claims prepared at once on one node; a prepare beyond this is refused for the claim."""
MAX_FILES_PER_CLAIM = 64
MAX_FILE_BYTES = 256 * 1024

UID_PATTERN = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,126}[A-Za-z0-9])?")
"""A claim UID as the plugin names files after it (Kubernetes UIDs are UUIDs); used with ``fullmatch``."""


@dataclass(frozen=True, slots=True)
class PreparedDevice:
    """One device of a prepared claim, as answered to the kubelet."""

    requests: tuple[str, ...]
    pool: str
    device: str
    cdi_ids: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"requests": list(self.requests), "pool": self.pool, "device": self.device, "cdiIDs": list(self.cdi_ids)}


@dataclass(frozen=True, slots=True)
class PreparedClaim:
    namespace: str
    name: str
    uid: str
    devices: tuple[PreparedDevice, ...]
    files: Mapping[str, str] = field(default_factory=dict)
    """Absolute path → text of every file written for the claim."""

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "devices": [device.to_json() for device in self.devices],
            "files": dict(sorted(self.files.items())),
        }


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    """Write ``text`` to ``path`` through a flushed temporary file renamed over it (``.name.pid.tmp``: CDI
    runtimes and the kubelet's watcher skip dot files); OSError on failure, the temporary removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temporary, mode)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def save(state_dir: Path, claims: Iterable[PreparedClaim]) -> None:
    """Record ``claims`` as the prepared set (atomically); OSError when it cannot be written."""
    obj = {"version": VERSION, "claims": {claim.uid: claim.to_json() for claim in sorted(claims, key=lambda c: c.uid)}}
    write_atomic(state_dir / FILE_NAME, json.dumps(obj, indent=1, sort_keys=True) + "\n", 0o600)


def load(state_dir: Path, owned: Iterable[Path]) -> dict[str, PreparedClaim]:
    """The recorded claims by UID; empty when there is no checkpoint. InputError naming the file when it is
    damaged, oversized, not a regular file (a symbolic link too, even one whose target is gone: :func:`save`
    only ever renames a regular file over it), names a file outside the ``owned`` directories or one device
    for two claims."""
    path = state_dir / FILE_NAME
    if not os.path.lexists(path):
        return {}
    shown = str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return {}  # removed since the look: the same as none
    except OSError as exc:
        why = "it is a symbolic link" if exc.errno == errno.ELOOP else (exc.strerror or str(exc))
        raise InputError(f"DRA checkpoint {shown} cannot be read: {why}") from None
    data = read_open_file(fd, MAX_CHECKPOINT_BYTES, "DRA checkpoint", shown)
    try:
        obj = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise InputError(f"DRA checkpoint {shown} is not JSON: {exc}") from None
    if not isinstance(obj, dict) or type(obj.get("version")) is not int or obj.get("version") != VERSION:
        raise InputError(f"DRA checkpoint {shown} is not a version {VERSION} checkpoint")
    raw_claims = obj.get("claims")
    if not isinstance(raw_claims, dict) or len(raw_claims) > MAX_CLAIMS:
        raise InputError(f"DRA checkpoint {shown}: claims must be an object of at most {MAX_CLAIMS} entries")
    roots = [root.absolute() for root in owned]
    claims = {uid: _claim(uid, raw, roots, shown) for uid, raw in raw_claims.items()}
    owner: dict[tuple[str, str], str] = {}
    for claim in claims.values():
        for device in sorted({(device.pool, device.device) for device in claim.devices}):
            other = owner.setdefault(device, claim.uid)
            if other != claim.uid:
                raise InputError(
                    f"DRA checkpoint {shown}: device {device[1][:80]!r} of pool {device[0][:80]!r} is recorded for "
                    f"two claims ({other} and {claim.uid}); a prepare never gives one device twice"
                )
    return claims


def _claim(uid: str, raw: object, roots: list[Path], shown: str) -> PreparedClaim:
    where = f"DRA checkpoint {shown}: claim {uid[:80]!r}"
    if not UID_PATTERN.fullmatch(uid):
        raise InputError(f"{where}: not a Kubernetes UID")
    if not isinstance(raw, dict):
        raise InputError(f"{where} is not an object")
    devices = raw.get("devices")
    files = raw.get("files")
    if not isinstance(devices, list) or not isinstance(files, dict) or len(files) > MAX_FILES_PER_CLAIM:
        raise InputError(f"{where}: devices must be a list and files an object of at most {MAX_FILES_PER_CLAIM}")
    for path, text in files.items():
        if not isinstance(text, str) or len(text) > MAX_FILE_BYTES:
            raise InputError(f"{where}: file {path[:120]!r} has no text or too much")
        if not _inside(Path(path), roots):
            raise InputError(f"{where}: file {path[:120]!r} is outside the plugin's directories")
    return PreparedClaim(
        namespace=_str(raw.get("namespace"), where),
        name=_str(raw.get("name"), where),
        uid=uid,
        devices=tuple(_device(item, where) for item in devices),
        files=dict(files),
    )


def _device(raw: object, where: str) -> PreparedDevice:
    if not isinstance(raw, dict):
        raise InputError(f"{where}: a device is not an object")
    requests, cdi_ids = raw.get("requests"), raw.get("cdiIDs")
    if not isinstance(requests, list) or not isinstance(cdi_ids, list):
        raise InputError(f"{where}: a device's requests and cdiIDs must be lists")
    return PreparedDevice(
        requests=tuple(_str(item, where) for item in requests),
        pool=_str(raw.get("pool"), where),
        device=_str(raw.get("device"), where),
        cdi_ids=tuple(_str(item, where) for item in cdi_ids),
    )


def _str(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > 512:
        raise InputError(f"{where}: {str(value)[:80]!r} is not a string of at most 512 characters")
    return value


def _inside(path: Path, roots: list[Path]) -> bool:
    if not path.is_absolute() or ".." in path.parts:
        return False
    return any(path.is_relative_to(root) and path != root for root in roots)
