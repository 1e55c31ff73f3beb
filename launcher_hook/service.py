"""What one ``OnDefineDomain`` call does, independent of how it arrived (gRPC server or sidecar-shim program).

Read the allocation from the configured source, run the builder (reading GPUs' companions from sysfs only when
the source cannot carry the plugin's companion variable), write one structured log line, and turn
every failure into a ``HookFault`` with the status the caller should see: ``INVALID_ARGUMENT`` for input the
builder refuses (with its message), ``FAILED_PRECONDITION`` for an allocation source that cannot be read,
``INTERNAL`` for anything else. There is no partial result: either the whole new domain or a fault.

A service keeps, for its own life, what its readers read of the host about the pod's devices: each reader in
its ``BuildOptions`` that can keep (``keeping()``: the sysfs companions, BARs and PCIe places per PCI address, the DRA
metadata per request directory) is replaced by one with a store of its own, so two
services, a test's and ``xmlgen``'s, share nothing. One ``launcher-hook serve`` process serves one virt-launcher
pod, whose devices are fixed while it holds them (:mod:`runtime.sysfs_paths` says why): KubeVirt's second and
third ``OnDefineDomain`` of a VM start read nothing again. Errors are never kept. The shim (a process per call)
builds a service per call and so reads every time, as before.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any, Literal, TypeVar

from launcher_hook.builder import BuildOptions, BuildResult, build_domain
from launcher_hook.document import CallInputs
from launcher_hook.sources import AllocationSource, ReadsCallInputs, SourceUnavailable
from runtime.logs import component_logger
from schemas import InputError
from schemas.logformat import log_event_on

COMPONENT = "launcher_hook"
LOGGER = component_logger(COMPONENT)

_Reader = TypeVar("_Reader")

FaultCode = Literal["INVALID_ARGUMENT", "FAILED_PRECONDITION", "INTERNAL"]
"""gRPC status code names (``grpc.StatusCode[code]``); the shim only prints them."""


class HookFault(Exception):
    """A call that must fail, with the status code to report and a message for the user."""

    def __init__(self, code: FaultCode, message: str) -> None:
        super().__init__(message)
        self.code: FaultCode = code
        self.message = message


@dataclass(frozen=True)
class DefineOutcome:
    domain_xml: bytes
    result: BuildResult
    source: str


def _vmi_label(vmi_json: bytes | None) -> str:
    """``namespace/name`` from the VMI JSON for a log line about a call whose build failed; ``-`` if unreadable."""
    try:
        document: Any = json.loads(vmi_json or b"")
        metadata = document["metadata"]
        return f"{metadata.get('namespace') or '-'}/{metadata.get('name') or '-'}"
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return "-"


MAX_LOGGED_ERROR = 4096
"""Longest error message a log line carries (a VMI with 100,000 bad GPUs makes a message of megabytes)."""


def _cut(message: str) -> str:
    return (
        message if len(message) <= MAX_LOGGED_ERROR else f"{message[:MAX_LOGGED_ERROR]}... ({len(message)} characters)"
    )


def log_call(event: str, /, *, level: int = logging.INFO, **fields: object) -> None:
    """One event per line on the ``launcher_hook`` logger (JSON or text, see :func:`runtime.logs.configure_logging`)."""
    log_event_on(LOGGER, level, event, fields)


def _keeping(reader: _Reader) -> _Reader:
    """``reader.keeping()`` (the same reader with a store of its own) where it has one, else ``reader``."""
    keeping = getattr(reader, "keeping", None)
    return keeping() if keeping is not None else reader


def keeping_options(options: BuildOptions) -> BuildOptions:
    """``options`` with each host reader that can keep what it reads replaced by one with a store of its own."""
    return replace(
        options,
        bars=_keeping(options.bars),
        claims=_keeping(options.claims),
        companion_reader=_keeping(options.companion_reader),
        topology=_keeping(options.topology),
    )


class HookService:
    """The hook's behaviour: a source, build options and the builder; thread-safe (it holds no call state but
    its readers' kept host facts, each store behind its own lock). ``keep_host_facts=False``: every call reads
    the host (the readers as given)."""

    def __init__(
        self, source: AllocationSource, options: BuildOptions | None = None, *, keep_host_facts: bool = True
    ) -> None:
        self.source = source
        options = options or BuildOptions()
        self.options = keeping_options(options) if keep_host_facts else options
        self._env_options = replace(self.options, allocation_carries_companions=True)
        """For an allocation that carries the companion variables: the plugin's variable is the one word; sysfs
        is read only for GPUs a DRA claim gave (no variable can describe theirs)."""
        self._reads_inputs = isinstance(source, ReadsCallInputs)

    def define_domain(
        self, domain_xml: bytes, vmi_json: bytes, *, via: str, event: str = "OnDefineDomain"
    ) -> DefineOutcome:
        """The new domain for ``domain_xml``, or ``HookFault``; logs one line (``event``: the RPC's name) either way."""
        started = time.perf_counter()
        source = self.source.describe()
        details: dict[str, object] = {}
        try:
            # The call's documents are parsed once, by whichever step needs them first: the source (the domain
            # source reads the allocation from the domain) or the builder.
            inputs = CallInputs(domain_xml, vmi_json, self.options.max_input_bytes)
            reader = self.source if self._reads_inputs else None
            loaded = (
                reader.load_inputs(inputs)  # type: ignore[attr-defined]
                if reader is not None
                else self.source.load(vmi_json, domain_xml)
            )
            source = loaded.source
            options = self._env_options if loaded.carries_companions else self.options
            result = build_domain(domain_xml, vmi_json, loaded.env, options, inputs=inputs)
        except InputError as exc:
            fault = HookFault("INVALID_ARGUMENT", str(exc))
        except SourceUnavailable as exc:
            fault = HookFault("FAILED_PRECONDITION", f"cannot read the GPU allocation: {exc}")
        except Exception as exc:
            details["traceback"] = traceback.format_exc()
            fault = HookFault("INTERNAL", f"internal error in the GPU hook: {type(exc).__name__}: {exc}")
        else:
            log_call(
                event,
                via=via,
                vmi=result.vmi.display_name if result.vmi else _vmi_label(vmi_json),
                gpus=result.aliases,
                source=source,
                warnings=result.warnings,
                **({"pci_mmio64_mib": result.mmio.written_mib} if result.mmio and result.mmio.written_mib else {}),
                status="OK",
                duration_ms=round((time.perf_counter() - started) * 1000, 3),
            )
            return DefineOutcome(result.domain_xml, result, source)
        log_call(
            event,
            level=logging.ERROR if fault.code == "INTERNAL" else logging.WARNING,
            via=via,
            vmi=_vmi_label(vmi_json),
            gpus={},
            source=source,
            status=fault.code,
            error=_cut(fault.message),
            duration_ms=round((time.perf_counter() - started) * 1000, 3),
            **details,
        )
        raise fault
