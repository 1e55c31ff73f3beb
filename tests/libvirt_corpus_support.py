"""libvirt's own test domains for hostdevs, and libvirt's own verdict on each, for the corpus sweep.

The files come from Debian's ``libvirt`` source package (scripts/fetch-libvirt-tests.sh caches them under
``.cache/libvirt-tests``; never committed): every file of ``tests/qemuxml2argvdata`` and
``tests/qemuxml2xmloutdata`` whose name mentions hostdev, mdev or vfio, and the live domains of
``tests/qemuhotplugtestdomains`` that hold a hostdev.

libvirt's verdict is computed here, live, in two steps (docs/validation.md explains the choice):

1. ``test:///default`` with ``VIR_DOMAIN_DEFINE_VALIDATE``: libvirt's RNG schema and its generic parser and
   validator (duplicate hostdevs, ramfb, drive addresses, mdev address types …), for every file;
2. ``qemu:///system`` with ``VIR_DOMAIN_DEFINE_VALIDATE``, then undefine: the QEMU driver's parse and
   qemu_validate against the host's QEMU (display='on' needs <graphics>, boot on vhost-scsi, zPCI …), for
   x86 domains, with ``<emulator>`` set to the host's ``qemu-system-x86_64`` and a fresh name. Domains of
   other architectures (s390x, ppc64) cannot be judged by this host's QEMU: step 1 alone is libvirt's
   verdict there, and the sweep lists them by name.

``domxml-to-native`` is not used: it looks for host resources (SCSI generic nodes, /dev/vhost-scsi,
/dev/dri, secrets) and libvirt 9.0's libvirtd crashes on ``net-hostdev-bootorder.xml`` there.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from pathlib import Path

from lxml import etree

from tests.libvirt_support import missing as missing_piece

REPO = Path(__file__).resolve().parent.parent
FETCH_SCRIPT = REPO / "scripts" / "fetch-libvirt-tests.sh"
CACHE = REPO / ".cache" / "libvirt-tests"
FETCH_TIMEOUT_S = 900
_NAME = re.compile(r"hostdev|mdev|vfio")
HOST_EMULATOR = "/usr/bin/qemu-system-x86_64"
X86 = {"x86_64", "i686", None}


def unavailable(reason: str) -> None:
    """Fail under CI=true, skip elsewhere (the project's one rule: tests.libvirt_support.missing)."""
    missing_piece(reason, "libvirt's test domains are needed")


def fetch_corpus() -> Path:
    """The cached ``tests`` folder of Debian's libvirt source package (fetched on first use)."""
    if shutil.which("dpkg-query") is None:
        unavailable("not a Debian system: dpkg-query is missing, so libvirt's source package cannot be fetched")
    try:
        done = subprocess.run(
            ["bash", str(FETCH_SCRIPT), str(CACHE)],
            capture_output=True,
            text=True,
            timeout=FETCH_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        unavailable(f"{FETCH_SCRIPT.name} took over {FETCH_TIMEOUT_S} s")
        raise  # unreachable
    if done.returncode != 0:
        unavailable(f"{FETCH_SCRIPT.name} failed: {done.stderr.strip()[-600:]}")
    return Path(done.stdout.strip().splitlines()[-1]) / "tests"


def corpus_files(tests: Path) -> list[Path]:
    files = [
        path
        for folder in ("qemuxml2argvdata", "qemuxml2xmloutdata")
        for path in sorted((tests / folder).glob("*.xml"))
        if _NAME.search(path.name)
    ]
    files += [path for path in sorted((tests / "qemuhotplugtestdomains").glob("*live*.xml")) if _NAME.search(path.name)]
    return files


def arch_of(root: etree._Element) -> str | None:
    os_type = root.find("os/type")
    return os_type.get("arch") if os_type is not None else None


def _fresh(root: etree._Element, emulator: str | None) -> str:
    clone = copy.deepcopy(root)
    name = clone.find("name")
    if name is None:
        name = etree.SubElement(clone, "name")
    name.text = f"corpus-{uuid.uuid4().hex[:12]}"
    for stale in clone.findall("uuid"):
        clone.remove(stale)
    if emulator is not None:
        for element in clone.iterfind("devices/emulator"):
            element.text = emulator
    return etree.tostring(clone, encoding="unicode")


@dataclass(frozen=True)
class Verdict:
    accepted: bool
    judge: str
    """``test driver`` or ``QEMU driver``: which step decided (the QEMU driver only for x86 domains)."""
    reason: str = ""


def libvirt_verdict(root: etree._Element) -> Verdict:
    """libvirt's own verdict on a domain, computed live (see the module's docstring)."""
    from xmlgen.libvirt_check import generic_refusal, qemu_driver_refusal

    refusal = generic_refusal(_fresh(root, None))
    if refusal is not None:
        return Verdict(False, "test driver", refusal)
    if arch_of(root) not in X86:
        return Verdict(True, "test driver")
    refusal = qemu_driver_refusal(_fresh(root, HOST_EMULATOR))
    if refusal is not None:
        return Verdict(False, "QEMU driver", refusal)
    return Verdict(True, "QEMU driver")
