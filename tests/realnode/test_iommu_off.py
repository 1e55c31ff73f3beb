"""The project's programs on a real kernel without an IOMMU (one guest boot, tests/realnode/inguest.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.realnode.scenarios import Scenario
from tests.realnode.test_node import checks, seen

pytestmark = pytest.mark.realnode


def test_no_iommu_groups_and_no_group_nodes(iommu_off: Scenario) -> None:
    facts = seen(iommu_off, "facts")
    assert "intel_iommu=off" in facts["cmdline"]
    assert facts["iommu_groups"] == []
    (gpu,) = facts["functions"]["1234:1111"]
    assert gpu["iommu_group"] is None
    assert gpu["group_members"] == []
    # vfio is loaded, so the container node exists even without an IOMMU.
    assert facts["dev_vfio"] == ["vfio"]


def test_doctor_fails_on_the_iommu_and_discover_offers_nothing(iommu_off: Scenario) -> None:
    doctor: dict[str, dict[str, Any]] = checks(seen(iommu_off, "doctor_off", "doctor off"))
    assert doctor["IOMMU"]["status"] == "FAIL"
    assert "intel_iommu=on" in doctor["IOMMU"]["fix"]
    assert doctor["vfio-pci driver"]["status"] == "OK"
    assert seen(iommu_off, "doctor_off")["rc"] == 1
    assert seen(iommu_off, "discover_off", "discover off")["json"]["resources"] == []


def test_vfio_pci_refuses_a_function_without_an_iommu_group(iommu_off: Scenario) -> None:
    bound = seen(iommu_off, "bind_off", "bind without an IOMMU")
    # The write to drivers_probe succeeds although vfio-pci's probe fails: only the driver link tells.
    assert bound["error"] is None
    assert bound["state"]["driver"] is None
    assert bound["state"]["driver_override"] == "vfio-pci"
    assert bound["dev_vfio"] == ["vfio"]
    assert seen(iommu_off, "discover_off_bound")["json"]["resources"] == []
    doctor = checks(seen(iommu_off, "doctor_off_bound", "doctor off_bound"))
    gpu = bound["state"]["address"]
    assert doctor[f"GPU {gpu}"]["status"] == "WARN"
    assert "bound to no driver" in doctor[f"GPU {gpu}"]["detail"]
