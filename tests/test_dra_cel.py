"""The CEL selectors of deploy/dra run on the devices our ResourceSlices publish, as Kubernetes runs them.

Kubernetes gives a selector one variable, ``device``: ``device.driver``, and ``device.attributes`` keyed by
domain, each holding that domain's attributes by their short name; a driver's unqualified attributes belong to
its own domain (k8s.io/api/resource/v1 ``CELDeviceSelector``; the scheduler's structured allocator). A selector
that is not exactly ``true`` or ``false`` for a device (an unknown attribute is an error) aborts the whole
allocation, so every selector here must give a bool for every device of every fixture node, not only match the
right ones. cel-python (``celpy``) evaluates them; it lacks ``cel.bind`` and optionals, which our selectors
therefore do not use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import celpy
import celpy.adapter
import celpy.evaluation
import pytest
import yaml

from schemas.dra import DEVICE_CLASSES, DRIVER_NAME, KIND_VALUES
from schemas.kinds import ResourceKind
from simkit.fixture_nodes import NODE01
from tests.dra_cluster_support import all_fixture_slices

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "dra"

STANDARD_DOMAIN = "resource.kubernetes.io"
Device = tuple[str, str]
"""(node, device name)."""


def cel_device(driver: str, attributes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The ``device`` variable Kubernetes builds: attributes grouped by domain, unqualified ones in the driver's."""
    # An unknown domain is an empty map to Kubernetes: the two our selectors index are always there.
    grouped: dict[str, dict[str, Any]] = {DRIVER_NAME: {}, STANDARD_DOMAIN: {}}
    for name, value in attributes.items():
        domain, _, short = name.rpartition("/")
        ((kind, plain),) = value.items()
        assert kind in {"string", "int", "bool", "version"}
        grouped.setdefault(domain or driver, {})[short] = plain
    return {"driver": driver, "attributes": grouped, "capacity": {}}


class Selector:
    def __init__(self, expression: str) -> None:
        environment = celpy.Environment()
        self.expression = expression
        self.program = environment.program(environment.compile(expression))

    def __call__(self, device: dict[str, Any]) -> bool:
        result = self.program.evaluate({"device": celpy.adapter.json_to_cel(device)})
        assert isinstance(result, celpy.celtypes.BoolType), f"{self.expression!r} gave {result!r}, not a bool"
        return bool(result)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> dict[Device, dict[str, Any]]:
    """Every device of every fixture node as the selector sees it, plus another driver's device."""
    devices = {
        (node, device["name"]): cel_device(obj["spec"]["driver"], device["attributes"])
        for node, slices in all_fixture_slices(tmp_path_factory.mktemp("nodes")).items()
        for obj in slices
        for device in obj["spec"]["devices"]
    }
    devices[("node01", "gpu-0")] = cel_device(  # another driver's GPU, with a "kind" of the same value
        "gpu.example.com", {"kind": {"string": "passthrough"}, "healthy": {"bool": True}}
    )
    return devices


def selectors(doc: dict[str, Any]) -> list[Selector]:
    return [Selector(item["cel"]["expression"]) for item in doc["spec"]["selectors"]]


def matching(fleet: dict[Device, dict[str, Any]], chain: list[Selector]) -> set[Device]:
    """Devices every selector accepts, each evaluated on every device (an error anywhere fails the test)."""
    found = set()
    for key, device in fleet.items():
        results = [selector(device) for selector in chain]  # no short cut: each must give a bool on each device
        if all(results):
            found.add(key)
    return found


def device_classes() -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all((DEPLOY / "deviceclasses.yaml").read_text()))
    return {doc["metadata"]["name"]: doc for doc in docs}


def test_there_is_one_device_class_per_kind() -> None:
    assert sorted(device_classes()) == sorted(DEVICE_CLASSES.values())


@pytest.mark.parametrize("kind", list(ResourceKind))
def test_each_device_class_selects_exactly_the_healthy_devices_of_its_kind(
    fleet: dict[Device, dict[str, Any]], kind: ResourceKind
) -> None:
    doc = device_classes()[DEVICE_CLASSES[kind]]
    found = matching(fleet, selectors(doc))
    expected = {
        key
        for key, device in fleet.items()
        if device["driver"] == DRIVER_NAME
        and device["attributes"][DRIVER_NAME]["kind"] == KIND_VALUES[kind]
        and device["attributes"][DRIVER_NAME]["healthy"]
    }
    assert found == expected
    assert found  # every kind has devices on some fixture node
    assert ("gpu-mixed01", "pci-0000-86-00-0") not in found  # unhealthy: its audio function is on the host


def test_the_sample_claim_picks_healthy_tu106_gpus_on_numa_node_1(fleet: dict[Device, dict[str, Any]]) -> None:
    (template,) = yaml.safe_load_all((DEPLOY / "example" / "resourceclaimtemplate.yaml").read_text())
    requests = template["spec"]["spec"]["devices"]["requests"]
    assert [request["name"] for request in requests] == ["gpu0", "gpu1"]
    classes = device_classes()
    for request in requests:
        exact = request["exactly"]
        chain = [
            *selectors(classes[exact["deviceClassName"]]),
            *(Selector(s["cel"]["expression"]) for s in exact["selectors"]),
        ]
        # node01's two TU106 on NUMA node 1; not those on node 0, not the A10s, T4 vGPUs or L40S VFs on node 1,
        # and no error on the GPU without a pci.ids name or a NUMA node (gpu-mixed01's 2fff).
        assert matching(fleet, chain) == {(NODE01.name, "pci-0000-86-00-0"), (NODE01.name, "pci-0000-af-00-0")}


def test_an_unguarded_selector_would_abort_on_a_device_without_the_attribute(
    fleet: dict[Device, dict[str, Any]],
) -> None:
    """Why the sample claim says has(...): without it, gpu-mixed01's unnamed GPU is a CEL error."""
    unguarded = Selector(f'device.attributes["{DRIVER_NAME}"].numaNode == 1')
    with pytest.raises(celpy.evaluation.CELEvalError):
        matching(fleet, [unguarded])


def test_the_standard_attributes_are_in_the_kubernetes_domain(fleet: dict[Device, dict[str, Any]]) -> None:
    selector = Selector(
        f'has(device.attributes["{STANDARD_DOMAIN}"].pciBusID) && '
        f'device.attributes["{STANDARD_DOMAIN}"].pciBusID == "0000:86:00.0"'
    )
    assert matching(fleet, [selector]) == {(NODE01.name, "pci-0000-86-00-0"), ("gpu-mixed01", "pci-0000-86-00-0")}
