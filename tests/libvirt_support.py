"""libvirt checks for tests: real libvirt's verdict, skipped only outside CI when a piece is missing.

Under ``CI=true`` a missing libvirt piece fails the test (the test command installs and starts them as
root, so missing means broken); elsewhere it skips with the reason, which names the missing piece.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import pytest

from xmlgen.libvirt_check import (
    LibvirtReport,
    LibvirtUnavailable,
    assert_qemu_matches,
    check_domain,
    qemu_argv_for_host,
)


def missing(reason: str, what: str = "libvirt piece missing") -> None:
    """Fail under CI (``<what> under CI=true: <reason>``), skip elsewhere: the project's one such rule."""
    if os.environ.get("CI") == "true":
        pytest.fail(f"{what} under CI=true: {reason}")
    pytest.skip(reason)


def qemu_argv(domain_xml: bytes) -> str:
    """QEMU's command line for ``domain_xml`` from libvirt's QEMU driver (``domxml-to-native``) on this host."""
    try:
        return qemu_argv_for_host(domain_xml)
    except LibvirtUnavailable as exc:
        missing(str(exc))
        raise  # unreachable


def libvirt_verdict(domain_xml: bytes, expected: Mapping[str, str] | None = None) -> LibvirtReport:
    """Check ``domain_xml`` with the RNG schema, the test driver and QEMU's argv.

    ``expected`` maps alias → PCI address or mdev UUID; each must reach QEMU as a vfio device with that
    ``id=`` (``host=`` for PCI, ``sysfsdev=`` for mdev).
    """
    try:
        report = check_domain(domain_xml, qemu=bool(expected))
    except LibvirtUnavailable as exc:
        missing(str(exc))
        raise  # unreachable
    if expected:
        assert_qemu_matches(report, expected)
    return report
