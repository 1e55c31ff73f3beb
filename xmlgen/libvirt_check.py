"""Asking real libvirt what it makes of a domain: the test driver, the RNG schema and the QEMU driver.

Our own validator explains problems; this module gets libvirt's verdict: does the test driver define the
domain and keep our aliases and sources, do the hostdevs alone pass ``VIR_DOMAIN_DEFINE_VALIDATE``, and
which ``-device vfio-pci`` arguments would QEMU get (``domxml-to-native``, needs a running libvirtd).
libvirt-python is imported lazily: it is a dev/check dependency, not needed to render.

Every libvirt call runs in a worker thread with a deadline (libvirt-python blocks in C, where no signal
reaches it): a libvirtd that accepts and never answers (e.g. one stuck re-probing QEMU because libvirt-qemu
cannot open /dev/kvm) makes the call fail with :class:`LibvirtTimeout` naming the call, the URI and the
likely cause instead of hanging. The stuck thread is abandoned (a daemon thread), and later calls to the
same URI fail at once with the same message. ``$XMLGEN_LIBVIRT_TIMEOUT`` (seconds, default 30) sets the
deadline, ``$XMLGEN_LIBVIRT_QEMU_URI`` the QEMU driver's URI (default ``qemu:///system``).
"""

from __future__ import annotations

import copy
import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from lxml import etree

from launcher_hook.domain import hostdev_source_key, parse_domain
from launcher_hook.hostdevs import model_for_type
from launcher_hook.validate import SchemaNotFound, hostdev_schema, validate_domain
from schemas.limits import DEFAULT_MAX_INPUT_BYTES

QEMU_URI = "qemu:///system"
TEST_URI = "test:///default"
_DEVICE_ARG = re.compile(r"-device\s+'?(\{.*?\})'?(?=\s+-|\s*$)")
_lock = threading.Lock()
DEFAULT_TIMEOUT_S = 30.0
TIMEOUT_ENV = "XMLGEN_LIBVIRT_TIMEOUT"
QEMU_URI_ENV = "XMLGEN_LIBVIRT_QEMU_URI"
_T = TypeVar("_T")
_stuck: dict[str, str] = {}  # URI → the message of the call that timed out on it


class LibvirtUnavailable(RuntimeError):
    """A piece of libvirt needed for the check is missing; the message says which and how to get it."""


class LibvirtTimeout(RuntimeError):
    """libvirt did not answer a call within its deadline; the message names the call, the URI and the likely
    cause. Not a :class:`LibvirtUnavailable`: a hung libvirtd is broken, not missing, so tests fail on it."""


def libvirt_timeout() -> float:
    """The deadline of one libvirt call, from ``$XMLGEN_LIBVIRT_TIMEOUT`` (seconds) or 30 s."""
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 86400:  # also refuses nan and inf
        raise LibvirtUnavailable(f"${TIMEOUT_ENV} must be a number of seconds in (0, 86400), not {raw!r}")
    return value


def qemu_uri() -> str:
    """The QEMU driver's URI: ``$XMLGEN_LIBVIRT_QEMU_URI`` or ``qemu:///system``."""
    return os.environ.get(QEMU_URI_ENV) or QEMU_URI


def _hint(uri: str) -> str:
    if uri.startswith("test:"):
        return "libvirt's in-process test driver should never wait"
    return "is libvirtd running, and is /dev/kvm usable by libvirt-qemu? see scripts/ensure-system.sh"


def call_with_deadline(
    what: str, uri: str, function: Callable[..., _T], *args: Any, timeout: float | None = None
) -> _T:
    """``function(*args)`` in a worker thread; :class:`LibvirtTimeout` if it has not returned in ``timeout``.

    ``what`` names the call (``domainXMLToNative``) and ``uri`` the connection, for the message. Exceptions of
    the call are raised here as they are.
    """
    if uri in _stuck:
        raise LibvirtTimeout(f"{_stuck[uri]} (an earlier call timed out; not waiting again)")
    deadline = libvirt_timeout() if timeout is None else timeout
    outcome: list[_T] = []
    failure: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            outcome.append(function(*args))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, name=f"libvirt {what}", daemon=True).start()
    if not done.wait(deadline):
        who = "libvirt's test driver" if uri.startswith("test:") else "libvirtd"
        message = f"{who} did not answer {what} on {uri} within {deadline:g} s; {_hint(uri)}"
        _stuck[uri] = message
        raise LibvirtTimeout(message)
    if failure:
        raise failure[0]
    return outcome[0]


class LibvirtRejected(AssertionError):
    """libvirt refused or changed the domain; the message says how."""


@dataclass
class LibvirtReport:
    hostdevs: dict[str, tuple[str, str]]
    """alias → (kind, source) as libvirt's test driver read them back."""
    qemu_unavailable: str | None = None
    """Why QEMU's argv was not asked for (libvirtd not reachable), when the QEMU check was optional."""
    qemu_devices: list[dict[str, Any]] = field(default_factory=list)
    """The ``vfio-pci`` (PCI) and ``vfio-pci-nohotplug`` (mdev) ``-device`` arguments of QEMU's command line
    (empty when not asked)."""

    def qemu_lines(self) -> list[str]:
        return [f"-device {json.dumps(device, separators=(',', ':'))}" for device in self.qemu_devices]


def _libvirt() -> Any:
    try:
        import libvirt  # noqa: PLC0415 - optional dependency, imported where needed
    except ImportError:
        raise LibvirtUnavailable(
            "libvirt-python is not installed (pip install libvirt-python; building it needs Debian's "
            "libvirt-dev and pkg-config)"
        ) from None
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    return libvirt


def _hostdev_map(root: etree._Element) -> dict[str, tuple[str, str]]:
    found: dict[str, tuple[str, str]] = {}
    for hostdev in root.iterfind("devices/hostdev"):
        alias = hostdev.find("alias")
        key = hostdev_source_key(hostdev)
        if alias is not None and key is not None:
            found[alias.get("name") or ""] = key
    return found


def _with_vfio_driver(root: etree._Element) -> etree._Element:
    """A copy each of whose hostdevs its model prepared for QEMU on a host without IOMMU groups (PCI ones name
    the vfio driver)."""
    clone = copy.deepcopy(root)
    for hostdev in clone.iterfind("devices/hostdev"):
        model = model_for_type(hostdev.get("type"))
        if model is not None:
            model.prepare_for_qemu(hostdev)
    if not os.path.exists("/dev/kvm"):
        clone.set("type", "qemu")
    return clone


def _renamed(root: etree._Element) -> etree._Element:
    clone = copy.deepcopy(root)
    name = clone.find("name")
    if name is None:
        name = etree.SubElement(clone, "name")
    name.text = f"check-{uuid.uuid4().hex[:12]}"
    for stale in clone.findall("uuid"):
        clone.remove(stale)
    return clone


def check_domain(domain_xml: bytes, *, qemu: bool = True, qemu_optional: bool = False) -> LibvirtReport:
    """libvirt's verdict on ``domain_xml``; raises LibvirtRejected or LibvirtUnavailable.

    With ``qemu_optional``, a libvirtd that cannot be reached is noted in the report instead of raised.
    """
    libvirt = _libvirt()
    parsed = parse_domain(domain_xml, DEFAULT_MAX_INPUT_BYTES)
    try:
        problems = validate_domain(parsed.root, hostdev_schema())
    except SchemaNotFound as exc:
        raise LibvirtUnavailable(str(exc)) from None
    if problems:
        raise LibvirtRejected("; ".join(str(problem) for problem in problems))
    wanted = _hostdev_map(parsed.root)

    with _lock:  # the test driver's default state is shared by the whole process
        test = call_with_deadline("open", TEST_URI, libvirt.open, TEST_URI)
        try:
            whole = _renamed(parsed.root)
            domain = call_with_deadline(
                "defineXML", TEST_URI, test.defineXMLFlags, etree.tostring(whole, encoding="unicode"), 0
            )
            try:
                read_back = _hostdev_map(etree.fromstring(call_with_deadline("XMLDesc", TEST_URI, domain.XMLDesc, 0)))
            finally:
                call_with_deadline("undefine", TEST_URI, domain.undefine)
            minimal = etree.fromstring(
                b'<domain type="test"><name>x</name><memory>1024</memory><os><type>hvm</type></os><devices/></domain>'
            )
            devices = minimal.find("devices")
            assert devices is not None
            for hostdev in parsed.root.iterfind("devices/hostdev"):
                devices.append(copy.deepcopy(hostdev))
            flags = libvirt.VIR_DOMAIN_DEFINE_VALIDATE
            try:
                validated = call_with_deadline(
                    "defineXML (VALIDATE)",
                    TEST_URI,
                    test.defineXMLFlags,
                    etree.tostring(_renamed(minimal), encoding="unicode"),
                    flags,
                )
                call_with_deadline("undefine", TEST_URI, validated.undefine)
            except libvirt.libvirtError as exc:
                raise LibvirtRejected(f"libvirt's schema validation refused the hostdevs: {exc}") from None
        except libvirt.libvirtError as exc:
            raise LibvirtRejected(f"libvirt's test driver refused the domain: {exc}") from None
        finally:
            call_with_deadline("close", TEST_URI, test.close)
    if read_back != wanted:
        raise LibvirtRejected(f"libvirt read the hostdevs back differently: wrote {wanted}, got {read_back}")
    report = LibvirtReport(read_back)
    if qemu and wanted:
        try:
            report.qemu_devices = qemu_vfio_devices(etree.tostring(_with_vfio_driver(parsed.root), encoding="unicode"))
        except LibvirtUnavailable as exc:
            if not qemu_optional:
                raise
            report.qemu_unavailable = str(exc)
    return report


def qemu_vfio_devices(domain_xml: str, uri: str | None = None, timeout: float | None = None) -> list[dict[str, Any]]:
    """The vfio devices of the QEMU command line libvirt would run for ``domain_xml``.

    ``uri`` defaults to :func:`qemu_uri`, ``timeout`` (per call) to :func:`libvirt_timeout`.
    """
    argv = qemu_argv(domain_xml, uri, timeout)
    devices = [json.loads(match) for match in _DEVICE_ARG.findall(argv)]
    return [device for device in devices if device.get("driver") in ("vfio-pci", "vfio-pci-nohotplug")]


def qemu_argv_for_host(domain_xml: bytes) -> str:
    """The QEMU command line for ``domain_xml`` as prepared for this host (hostdevs name the vfio driver; TCG
    without /dev/kvm), from libvirt's QEMU driver (``domxml-to-native``)."""
    root = parse_domain(domain_xml, DEFAULT_MAX_INPUT_BYTES).root
    return qemu_argv(etree.tostring(_with_vfio_driver(root), encoding="unicode"))


def qemu_argv(domain_xml: str, uri: str | None = None, timeout: float | None = None) -> str:
    """The whole QEMU command line libvirt's QEMU driver would run for ``domain_xml`` (``domxml-to-native``);
    LibvirtRejected with libvirt's reason when it refuses the domain."""
    libvirt = _libvirt()
    uri = uri or qemu_uri()
    try:
        connection = call_with_deadline("open", uri, libvirt.open, uri, timeout=timeout)
    except libvirt.libvirtError as exc:
        raise LibvirtUnavailable(
            f"libvirtd with the QEMU driver is not reachable at {uri} ({exc}); as root: scripts/ensure-system.sh"
        ) from None
    try:
        argv = call_with_deadline(
            "domainXMLToNative", uri, connection.domainXMLToNative, "qemu-argv", domain_xml, 0, timeout=timeout
        )
    except libvirt.libvirtError as exc:
        call_with_deadline("close", uri, connection.close, timeout=timeout)
        raise LibvirtRejected(f"libvirt's QEMU driver refused the domain: {exc}") from None
    call_with_deadline("close", uri, connection.close, timeout=timeout)
    return str(argv)


def qemu_sources(report: LibvirtReport) -> dict[str, str]:
    """alias → what QEMU opens: the PCI address (``host=``) or the mdev UUID (from ``sysfsdev=``)."""
    return {
        str(device.get("id")): str(device.get("host") or str(device.get("sysfsdev", "")).rpartition("/")[2])
        for device in report.qemu_devices
    }


def assert_qemu_matches(report: LibvirtReport, expected: Mapping[str, str]) -> None:
    """Every expected alias → PCI address or mdev UUID reaches QEMU as a vfio device with that ``id=``."""
    got = qemu_sources(report)
    for alias, source in expected.items():
        if got.get(alias) != source:
            raise LibvirtRejected(f"QEMU would not get {alias} = {source}: its vfio devices are {got}")


# ---- one libvirt call per function (so a timeout can wrap each): libvirt's verdict on a whole domain ------


def generic_refusal(domain_xml: str) -> str | None:
    """Why libvirt's RNG schema and generic parser (``test:///default``, ``VIR_DOMAIN_DEFINE_VALIDATE``)
    refuse ``domain_xml``, or None when they define it. Needs no daemon; the definition is removed again."""
    libvirt = _libvirt()
    with _lock:  # the test driver's default state is shared by the whole process
        connection = libvirt.open(TEST_URI)
        try:
            domain = connection.defineXMLFlags(domain_xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
            domain.undefine()
        except libvirt.libvirtError as exc:
            return str(exc)
        finally:
            connection.close()
    return None


def qemu_driver_refusal(domain_xml: str) -> str | None:
    """Why libvirt's QEMU driver (``qemu:///system``: schema, parser and qemu_validate against the emulator's
    capabilities) refuses ``domain_xml``, or None when it defines it; the definition is undefined at once.
    ``domain_xml`` should carry a name no other domain has. Raises LibvirtUnavailable without libvirtd."""
    libvirt = _libvirt()
    try:
        connection = libvirt.open(QEMU_URI)
    except libvirt.libvirtError as exc:
        raise LibvirtUnavailable(
            f"libvirtd with the QEMU driver is not reachable at {QEMU_URI} ({exc}); as root: scripts/ensure-system.sh"
        ) from None
    try:
        domain = connection.defineXMLFlags(domain_xml, libvirt.VIR_DOMAIN_DEFINE_VALIDATE)
        domain.undefine()
    except libvirt.libvirtError as exc:
        if exc.get_error_domain() in (libvirt.VIR_FROM_RPC, libvirt.VIR_FROM_REMOTE):
            raise LibvirtUnavailable(f"lost libvirtd at {QEMU_URI} while it judged a domain: {exc}") from None
        return str(exc)
    finally:
        connection.close()
    return None


def libvirt_read_back(domain_xml: str) -> str:
    """The domain as libvirt's parser read it: defined on ``test:///default``, its XML, then undefined.
    Raises LibvirtRejected when libvirt refuses it."""
    libvirt = _libvirt()
    with _lock:
        connection = libvirt.open(TEST_URI)
        try:
            domain = connection.defineXMLFlags(domain_xml, 0)
            try:
                return str(domain.XMLDesc(0))
            finally:
                domain.undefine()
        except libvirt.libvirtError as exc:
            raise LibvirtRejected(f"libvirt's test driver refused the domain: {exc}") from None
        finally:
            connection.close()
