"""KubeVirt's plugin API (``MutateDomain``, the ``Plugins`` feature gate) calls the hook from KubeVirt's own
plugin pipeline (``pkg/virt-launcher/virtwrap/plugins/pipeline.go``), run by ``launcher-harness``.

The pipeline first converts virt-launcher's domain into libvirt's Go XML types (``translate.ToLibvirtDomain``,
libvirt.org/go/libvirtxml), whose ``DomainHostdev.UnmarshalXML`` refuses a hostdev without ``mode``; and
virt-launcher 1.9 writes every PCI hostdev without it. So at the pinned KubeVirt every PCI passthrough GPU
(device plugin, ``hostDevices[]``, DRA) fails inside KubeVirt before any plugin is called, whatever the plugin
does; vGPUs (mdevs, written with ``mode``) get through. With the hook also serving the hook sidecar API, which
``SetDomainSpecStrWithHooks`` calls first, the hook's ``mode='subsystem'`` reaches the pipeline and the plugin
call succeeds. docs/kubevirt-harness.md, "The plugin API's PCI failure", says what a user can do.

``test_the_plugin_pipeline_refuses_pci_hostdevs_before_the_hook`` is the regression test of KubeVirt's side:
the day it fails, the pinned KubeVirt converts PCI hostdevs without ``mode``, and the docs above, the README's
plugin-API passage and deploy/plugin-api/ must say so.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.kubevirt_harness_support import aliases, hostdevs, run_harness
from tests.test_kubevirt_launcher import (
    DRA_A10,
    NIC,
    NIC_VAR,
    SEED_ENV,
    SEED_GPUS,
    T4,
    T4_VAR,
    VGPU_UUID,
    assert_sound,
    seed_vmi,
)

pytestmark = [pytest.mark.libvirt, pytest.mark.kubevirt]

MISSING_MODE = "Missing 'mode' attribute on domain hostdev"


def _pci_cases() -> dict[str, tuple[dict[str, Any], dict[str, str], dict[tuple[str, str], str] | None]]:
    gpus = seed_vmi()
    host_devices = seed_vmi()
    host_devices["spec"]["domain"]["devices"]["gpus"] = []
    host_devices["spec"]["domain"]["devices"]["hostDevices"] = [{"name": "nic", "deviceName": NIC}]
    dra = seed_vmi()
    dra["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimName": "rc"}]
    dra["spec"]["domain"]["devices"]["gpus"] = [{"name": "g", "claimName": "gpu", "requestName": "req"}]
    return {
        "device-plugin gpus": (gpus, SEED_ENV, None),
        "hostDevices": (host_devices, {NIC_VAR: "0000:3b:00.0"}, None),
        "DRA gpus": (dra, {}, {("gpu", "req"): DRA_A10}),
    }


PCI_CASES = _pci_cases()


@pytest.mark.parametrize("case", list(PCI_CASES), ids=list(PCI_CASES))
def test_the_plugin_pipeline_refuses_pci_hostdevs_before_the_hook(case: str) -> None:
    vmi, env, dra = PCI_CASES[case]
    run = run_harness(vmi, env, api="plugins", dra_devices=dra)
    report = run.report
    assert (report["stage"], run.returncode) == ("define", 1), (report["stage"], report.get("error"))
    assert MISSING_MODE in report["error"]
    assert "converting DomainSpec to libvirtxml" in report["error"]  # pipeline.go, before any plugin
    assert report["defines"] == []  # nothing reached libvirt
    assert run.hook_events("MutateDomain") == []  # the hook was never called
    # what virt-launcher handed the pipeline: its own PCI hostdev, without mode=
    (first,) = report["hookCalls"][:1]
    pci = [hostdev for hostdev in hostdevs(first["output"]) if hostdev.get("type") == "pci"]
    assert pci and all(hostdev.get("mode") is None for hostdev in pci)


def test_a_vgpu_gets_through_the_plugin_pipeline() -> None:
    vmi = seed_vmi()
    vmi["spec"]["domain"]["devices"]["gpus"] = [{"name": "desk", "deviceName": T4}]
    run = run_harness(vmi, {T4_VAR: VGPU_UUID}, api="plugins")
    final = assert_sound(run, {"ua-gpu-desk": VGPU_UUID}, events=("MutateDomain",))
    assert len(hostdevs(final)) == 1


def test_with_the_sidecar_api_first_pci_gpus_get_through_the_plugin_pipeline_too() -> None:
    """The workaround the docs give for the plugin API (``--api both`` and the hook sidecar annotation): the
    sidecar call writes mode='subsystem', the pipeline converts the domain and calls MutateDomain, which
    changes nothing more."""
    run = run_harness(seed_vmi(), SEED_ENV, api="both")
    final = assert_sound(run, SEED_GPUS, events=("OnDefineDomain", "MutateDomain"))
    assert aliases(final) == SEED_GPUS
