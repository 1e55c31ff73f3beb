"""``xmlgen simulate --dra``: the DRA plugin, its slices, the scheduler stand-in, prepare, the hook, unprepare."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from lxml import etree

from simkit.dra_scheduler import AllocationError, Scheduler, cel_compiler, device_class_objects
from simkit.fixture_nodes import NODE01
from simkit.sysfs_fixture import build
from tests.conftest import EXAMPLES
from tests.dra_support import validate_cdi_spec
from tests.test_deploy import kubernetes_validate
from tests.test_xmlgen_simulate import hostdevs, qemu_devices, simulate
from xmlgen.simulate_dra import default_dra_claims, default_dra_domain, default_dra_vmi, simulate_dra

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "dra"
STEPS = (
    "1. node node01",
    "2. DRA kubelet plugin",
    "3. ResourceSlices",
    "4. scheduler",
    "5. kubelet: NodePrepareResources",
    "6. hook sidecar",
    "7. kubelet: the pod is gone",
    "8. libvirt",
)


@pytest.mark.libvirt
def test_node01_claims_two_tu106_on_numa_node_1_and_the_hook_renders_them() -> None:
    done = simulate("--dra", "--check")
    assert done.returncode == 0, done.stderr
    positions = [done.stderr.index(step) for step in STEPS]
    assert positions == sorted(positions)
    # the registration as the kubelet saw it
    assert "type DRAPlugin, name gpu-passthrough.kubevirt.io, endpoint /" in done.stderr
    assert "/plugin/dra.sock, versions v1.DRAPlugin, v1beta1.DRAPlugin" in done.stderr
    assert "it speaks v1.DRAPlugin at" in done.stderr
    # the slices, then the template's CEL: TU106 on NUMA node 1, one NUMA node for both
    assert (
        "pci-0000-3b-00-0 [0000:3b:00.0]: kind=passthrough, productName=TU106 [GeForce RTX 2060 Rev. A], numaNode=0, "
        "healthy=true"
    ) in done.stderr
    assert "(made from ResourceClaimTemplate tu106-pair; pod claim gpus, uid " in done.stderr
    assert "results: gpu0 → node01/pci-0000-86-00-0 (0000:86:00.0)" in done.stderr
    assert "results: gpu1 → node01/pci-0000-af-00-0 (0000:af:00.0)" in done.stderr
    # prepare: CDI IDs, the metadata where virt-launcher reads it
    assert "CDI devices gpu-passthrough.kubevirt.io/claim=" in done.stderr
    assert "device nodes /dev/vfio/vfio, /dev/vfio/74" in done.stderr
    assert (
        "mounted at /var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpus/gpu0/"
        "gpu-passthrough.kubevirt.io-metadata.json: resource.kubernetes.io/pciBusID 0000:86:00.0"
    ) in done.stderr
    # the hook renders what virt-launcher did not: its own aliases, managed='no'
    written = hostdevs(done.stdout)
    # each card with its audio, USB and UCSI functions in its guest slot, read from sysfs (no variable names a
    # claimed GPU's companions)
    assert written == {"ua-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0", **COMPANIONS}
    assert qemu_devices(done.stderr) == written
    root = etree.fromstring(done.stdout.encode())
    assert {h.get("managed") for h in root.iterfind("devices/hostdev")} == {"no"}
    assert "GPUs with their companion functions, one guest slot each" in done.stderr
    assert "not passed" not in done.stderr
    assert "  mmio64: not an OVMF (x86 EFI) guest: nothing written" in done.stderr
    assert "claims unprepared; removed 3 files (CDI specs and metadata)" in done.stderr


@pytest.mark.libvirt
def test_vgpu_node_mdevs_through_a_claim_and_a_template() -> None:
    done = simulate("--dra", "--node", "vgpu", "--check")
    assert done.returncode == 0, done.stderr
    assert "ResourceClaim tenant-a/t4-desktop (existing; pod claim desktop" in done.stderr
    assert "resourceclaims/t4-desktop/vgpu/gpu-passthrough.kubevirt.io-metadata.json: mdevUUID " in done.stderr
    assert "resourceclaimtemplates/compute/vgpu/" in done.stderr
    written = hostdevs(done.stdout)
    assert written == {
        "ua-gpu0": "4b20d080-1b54-4048-85b3-a6a62d165c01",  # nvidia-230: GRID T4-1Q
        "ua-gpu1": "a297db4a-f4c2-11e6-90f6-d3b88d6c9525",  # GRID T4-2Q
    }
    assert qemu_devices(done.stderr) == written
    root = etree.fromstring(done.stdout.encode())
    desktop = next(h for h in root.iterfind("devices/hostdev") if h.find("alias[@name='ua-gpu0']") is not None)
    assert (desktop.get("type"), desktop.get("display"), desktop.get("ramfb")) == ("mdev", "on", "on")
    assert "removed 4 files" in done.stderr


@pytest.mark.libvirt
def test_sriov_vgpu_node_vfs_through_one_claim() -> None:
    done = simulate("--dra", "--node", "sriov-vgpu", "--check")
    assert done.returncode == 0, done.stderr
    written = hostdevs(done.stdout)
    assert written == {"ua-gpu0": "0000:3b:00.4", "ua-gpu1": "0000:d8:00.4"}
    assert qemu_devices(done.stderr) == written


def _run(node: str = "node01", **kwargs: Any) -> tuple[Any, list[str]]:
    lines: list[str] = []
    result = simulate_dra(
        node,
        kwargs.pop("vmi", default_dra_vmi(node)),
        kwargs.pop("domain", default_dra_domain(node)),
        kwargs.pop("claims", default_dra_claims(node)),
        lines.append,
        **kwargs,
    )
    return result, lines


def test_the_files_prepare_wrote_are_valid_and_gone_after_unprepare(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[Path, bytes] = {}
    import xmlgen.simulate_dra as module

    real = module._unprepare

    def unprepare(standin: Any, refs: Any, files: list[Path], log: Any) -> None:
        seen.update((path, path.read_bytes()) for path in files)  # what the compute container had
        real(standin, refs, files, log)

    monkeypatch.setattr(module, "_unprepare", unprepare)
    result, _ = _run()
    (claim,) = result.claims
    assert claim["apiVersion"] == "resource.k8s.io/v1" and claim["kind"] == "ResourceClaim"
    assert claim["metadata"]["annotations"] == {"resource.kubernetes.io/pod-claim-name": "gpus"}
    assert [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]] == [
        "pci-0000-86-00-0",
        "pci-0000-af-00-0",
    ]
    assert len(seen) == 3 and not any(path.exists() for path in seen)
    specs = [json.loads(data) for path, data in seen.items() if path.parent.name == "cdi"]
    assert len(specs) == 1
    validate_cdi_spec(specs[0])
    (ids,) = result.cdi_ids.values()
    assert ids == [f"{specs[0]['kind']}={device['name']}" for device in specs[0]["devices"]]


COMPANIONS = {
    f"ua-gpu{index}-fn{fn}": f"0000:{bus}:00.{fn}" for index, bus in enumerate(("86", "af")) for fn in (1, 2, 3)
}
"""node01's two TU106 cards' other functions, as the hook places them beside claimed GPUs."""


def test_a_domain_where_virt_launcher_rendered_a_dra_gpu_keeps_its_alias() -> None:
    domain = default_dra_domain("node01").replace(
        b"</devices>",
        b'<hostdev mode="subsystem" type="pci" managed="no"><source><address domain="0x0000" bus="0x86" '
        b'slot="0x00" function="0x0"/></source><alias name="ua-dra-gpu-gpu0"/></hostdev></devices>',
    )
    result, _ = _run(domain=domain)
    written = hostdevs(result.domain_xml.decode())
    assert written == {"ua-dra-gpu-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0", **COMPANIONS}


def test_without_cel_the_class_kind_and_health_decide_and_the_account_says_so() -> None:
    result, lines = _run(use_cel=False)
    assert not result.cel
    assert any("the requests' own selectors are NOT evaluated" in line for line in lines)
    # the template's NUMA-node-1 selector is not evaluated: the first two healthy GPUs on one NUMA node
    gpus = {alias: source for alias, source in hostdevs(result.domain_xml.decode()).items() if "-fn" not in alias}
    assert sorted(gpus.values()) == ["0000:3b:00.0", "0000:5e:00.0"]


def test_a_directory_node(tmp_path: Path) -> None:
    root = build(NODE01, tmp_path / "node")
    result, lines = _run(str(root))
    assert hostdevs(result.domain_xml.decode()) == {"ua-gpu0": "0000:86:00.0", "ua-gpu1": "0000:af:00.0", **COMPANIONS}
    assert any("pool simulated-node" in line for line in lines)


def _claims_with(expression: str) -> bytes:
    template = yaml.safe_load(default_dra_claims("node01"))
    template["spec"]["spec"]["devices"]["requests"][1]["exactly"]["selectors"][0]["cel"]["expression"] = expression
    return yaml.safe_dump(template).encode()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--dra", "--vmi", str(EXAMPLES / "seed-node01" / "vmi.json")],
            "error: the VMI has no DRA entry (a gpus[]/hostDevices[] entry with claimName and requestName",
        ),
        (["--claims", "x.yaml"], "error: --claims is for --dra"),
        (
            ["--dra", "--node", "mixed"],
            "error: the scheduler cannot allocate claim 'gpus': ResourceClaim gpu-vms/virt-launcher-vm-with-dra-gpus-"
            "abcde-gpus-x7k2q: request 'gpu0' wants 1 (gpu0), but node gpu-mixed01 has 0 matching device(s)",
        ),
    ],
)
def test_failures_name_the_step_and_print_nothing_on_stdout(args: list[str], message: str) -> None:
    done = simulate(*args)
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_a_request_the_scheduler_cannot_satisfy(tmp_path: Path) -> None:
    claims = tmp_path / "claims.yaml"
    claims.write_bytes(_claims_with('device.attributes["gpu-passthrough.kubevirt.io"].numaNode == 7'))
    done = simulate("--dra", "--claims", str(claims))
    assert (done.returncode, done.stdout) == (1, "")
    assert (
        "request 'gpu1' wants 1 (gpu1), but node node01 has 0 matching device(s) not already allocated: "
        "the pod would stay Pending"
    ) in done.stderr
    assert "4. scheduler" in done.stderr and "5. kubelet" not in done.stderr


def test_a_claim_or_request_the_vmi_names_but_the_claims_do_not_hold(tmp_path: Path) -> None:
    vmi = json.loads(default_dra_vmi("node01"))
    vmi["spec"]["domain"]["devices"]["gpus"][1]["requestName"] = "gpu9"
    with pytest.raises(Exception, match=r"gpus\[1\] 'gpu1' asks for request 'gpu9' of claim 'gpus'"):
        _run(vmi=json.dumps(vmi).encode())
    vmi["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = "nothing"
    with pytest.raises(Exception, match="names ResourceClaimTemplate 'nothing', which the claims file does not hold"):
        _run(vmi=json.dumps(vmi).encode())


# -- the scheduler stand-in -------------------------------------------------------------------------------


def test_the_device_classes_are_deploys() -> None:
    assert {
        doc["metadata"]["name"]: doc for doc in yaml.safe_load_all((DEPLOY / "deviceclasses.yaml").read_text())
    } == (device_class_objects())


def _slices(*devices: tuple[str, dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "spec": {
                "driver": "gpu-passthrough.kubevirt.io",
                "pool": {"name": "n"},
                "devices": [{"name": name, "attributes": attributes} for name, attributes in devices],
            }
        }
    ]


def _gpu(numa: int, healthy: bool = True) -> dict[str, Any]:
    return {"kind": {"string": "passthrough"}, "healthy": {"bool": healthy}, "numaNode": {"int": numa}}


def _claim(requests: list[dict[str, Any]], constraints: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "c", "namespace": "ns"},
        "spec": {"devices": {"requests": requests, **({"constraints": constraints} if constraints else {})}},
    }


PASSTHROUGH = "passthrough.gpu-passthrough.kubevirt.io"


def test_match_attribute_backtracks_and_unhealthy_devices_are_never_given() -> None:
    scheduler = Scheduler("n", _slices(("a", _gpu(0)), ("b", _gpu(1)), ("c", _gpu(1)), ("d", _gpu(0, healthy=False))))
    one = {"exactly": {"deviceClassName": PASSTHROUGH}}
    allocation = scheduler.allocate(
        _claim(
            [{"name": "x", **one}, {"name": "y", **one}], [{"matchAttribute": "gpu-passthrough.kubevirt.io/numaNode"}]
        )
    )
    assert [(request, device.name) for request, device in allocation.results] == [("x", "b"), ("y", "c")]
    together = r"requests 'z', 'w' cannot be met together on node n: 2 device\(s\) wanted, 1 matching"
    with pytest.raises(AllocationError, match=together):
        scheduler.allocate(_claim([{"name": "z", **one}, {"name": "w", **one}]))


def test_first_available_names_the_subrequest_and_all_takes_every_match() -> None:
    scheduler = Scheduler("n", _slices(("a", _gpu(0)), ("b", _gpu(1))))
    allocation = scheduler.allocate(
        _claim(
            [
                {
                    "name": "gpu",
                    "firstAvailable": [
                        {"name": "three", "deviceClassName": PASSTHROUGH, "count": 3},
                        {"name": "one", "deviceClassName": PASSTHROUGH},
                    ],
                }
            ]
        )
    )
    assert [(r, d.name) for r, d in allocation.results] == [("gpu/one", "a")]
    rest = scheduler.allocate(
        _claim([{"name": "all", "exactly": {"deviceClassName": PASSTHROUGH, "allocationMode": "All"}}])
    )
    assert [d.name for _, d in rest.results] == ["b"]


def test_a_selector_error_on_any_device_fails_the_allocation() -> None:
    scheduler = Scheduler(
        "n", _slices(("a", _gpu(0)), ("b", {"kind": {"string": "passthrough"}, "healthy": {"bool": True}}))
    )
    selector = {"cel": {"expression": 'device.attributes["gpu-passthrough.kubevirt.io"].numaNode == 0'}}
    with pytest.raises(AllocationError, match="fails on a device"):
        scheduler.allocate(
            _claim([{"name": "x", "exactly": {"deviceClassName": PASSTHROUGH, "selectors": [selector]}}])
        )
    with pytest.raises(AllocationError, match="DeviceClass 'nope' does not exist"):
        scheduler.allocate(_claim([{"name": "x", "exactly": {"deviceClassName": "nope"}}]))


@pytest.mark.parametrize("node", ["node01", "vgpu", "sriov-vgpu"])
def test_the_example_claims_and_the_allocated_claims_are_valid_kubernetes_objects(node: str, tmp_path: Path) -> None:
    result, _ = _run(node)
    examples = [doc for doc in yaml.safe_load_all(default_dra_claims(node)) if doc]
    path = tmp_path / "objects.yaml"
    path.write_text(yaml.safe_dump_all([*examples, *result.claims]))
    for version in ("1.34", None):
        lines = kubernetes_validate([path], version)
        assert set(lines) <= {"INFO", "WARN"}, lines
        passed = " ".join(lines.get("INFO", []))
        for doc in [*examples, *result.claims]:
            assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in passed


def test_without_cel_python_installed_the_scheduler_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "celpy", None)  # as in the image: no dev dependencies
    assert cel_compiler() is None
    result, lines = _run()
    assert not result.cel
    assert any("cel-python is not installed" in line for line in lines)


@pytest.mark.parametrize(
    ("claims", "message"),
    [
        (b"a: &x [1]\nb: *x\n", "YAML aliases (*name) are not accepted in a claims file"),
        (
            b"kind: Pod\nmetadata: {name: p}\n",
            "claims file object 0 is not a named ResourceClaim or ResourceClaimTemplate",
        ),
        (
            b"kind: ResourceClaimTemplate\nmetadata: {name: tu106-pair}\nspec: {spec: {devices: {requests: [7]}}}\n",
            "is malformed (not the resource.k8s.io/v1 shape): AttributeError",
        ),
        (
            b"kind: ResourceClaimTemplate\nmetadata: {name: tu106-pair}\n"
            b"spec: {spec: {devices: {requests: [{name: gpu0, exactly: 3}, {name: gpu1}]}}}\n",
            "error: the scheduler cannot allocate claim 'gpus': "
            "ResourceClaim 'virt-launcher-vm-with-dra-gpus-abcde-gpus-x7k2q' is malformed",
        ),
    ],
)
def test_a_bad_claims_file_is_a_clear_error(claims: bytes, message: str, tmp_path: Path) -> None:
    (tmp_path / "claims.yaml").write_bytes(claims)
    done = simulate("--dra", "--claims", str(tmp_path / "claims.yaml"))
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr


def test_simulate_dra_never_loads_the_kubernetes_client() -> None:
    """It runs serve --dra with a claims directory, as the CLI does: the API client stays unloaded."""
    code = (
        "import sys\n"
        "from xmlgen.simulate_dra import *\n"
        "simulate_dra('node01', default_dra_vmi('node01'), default_dra_domain('node01'), "
        "default_dra_claims('node01'), lambda line: None)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr
