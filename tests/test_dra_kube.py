"""plugin.dra.kube through the official kubernetes client over real HTTP, against simkit.fake_apiserver.

Publishing is checked by what ends up on the server and by the requests the client sent: the first publish
creates the pool, an unchanged inventory writes nothing, a change updates in place at a new pool generation,
a pool that shrinks deletes its surplus slices only after the rest carry the new generation, other nodes'
and other drivers' slices are never touched, and a failed call is a clear error after which the next publish
repairs the pool. KubeClaims reads a claim's allocation and refuses a re-created claim.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from plugin.dra.claims import AllocatedDevice, ClaimError, ClaimRef, claim_object
from plugin.dra.kube import FIELD_MANAGER, KubeApi, KubeClaims, KubeError, SlicePublisher, cluster_side
from plugin.dra.slices import build_slices
from schemas.dra import DRIVER_NAME
from simkit.fake_apiserver import FakeApiServer, running
from simkit.fixture_nodes import NODE01, VGPU_NODE
from tests.dra_cluster_support import DRA_OLDEST_KUBERNETES, many_gpus, node_inventory, validate_strictly

NODE = "node01"
NODE_UID = "7c0b2f40-0000-4000-8000-000000000001"
SELECTOR = f"spec.nodeName={NODE},spec.driver={DRIVER_NAME}"


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    with running() as fake:
        fake.add_node(NODE, NODE_UID)
        yield fake


@pytest.fixture
def api(server: FakeApiServer) -> Iterator[KubeApi]:
    client = KubeApi.for_host(server.url, timeout=(2.0, 5.0))
    yield client
    client.close()


def ours(server: FakeApiServer, node: str = NODE) -> list[dict[str, Any]]:
    return [obj for obj in server.slices() if obj["spec"]["nodeName"] == node and obj["spec"]["driver"] == DRIVER_NAME]


def writes(server: FakeApiServer) -> list[tuple[str, str]]:
    return [(request.method, request.path) for request in server.requests() if request.method != "GET"]


def test_first_publish_creates_the_pool_owned_by_the_node(server: FakeApiServer, api: KubeApi, tmp_path: Path) -> None:
    inventory, pci_ids = node_inventory(NODE01, tmp_path)
    result = SlicePublisher(api, NODE).sync(inventory)
    assert (result.generation, result.created, result.updated, result.deleted) == (1, 1, 0, 0)
    (obj,) = ours(server)
    assert obj["metadata"]["name"].startswith(f"{NODE}-{DRIVER_NAME}-")
    assert obj["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE_UID, "controller": True}
    ]
    assert obj["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert pci_ids is not None
    expected = build_slices(inventory, NODE, product_names=pci_ids.device_name)[0]["spec"]["devices"]
    assert obj["spec"]["devices"] == expected  # productName came from the inventory's pci.ids
    list_request = server.requests()[0]
    assert (list_request.method, list_request.query["fieldSelector"]) == ("GET", [SELECTOR])
    (create,) = [request for request in server.requests() if request.method == "POST"]
    assert create.query["fieldManager"] == [FIELD_MANAGER]
    sent = create.body
    assert sent is not None
    validate_strictly(sent, DRA_OLDEST_KUBERNETES)  # what the client put on the wire is a valid v1 object


def test_an_unchanged_inventory_writes_nothing(server: FakeApiServer, api: KubeApi, tmp_path: Path) -> None:
    inventory, _ = node_inventory(NODE01, tmp_path)
    publisher = SlicePublisher(api, NODE)
    publisher.sync(inventory)
    server.clear_requests()
    again = SlicePublisher(api, NODE).sync(inventory)  # a restarted plugin too
    assert not again.changed and again.generation == 1
    assert writes(server) == []


def test_slices_whose_random_names_sort_against_their_order_are_still_up_to_date(
    server: FakeApiServer, api: KubeApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    # generateName appends random characters, so the created slices' name order is not the order their device
    # runs were written in; the pool is the same all the same, and rewriting it bumps the generation for nothing.
    suffixes = iter(["ffffff", "aaaaaa", "555555"])
    monkeypatch.setattr("simkit.fake_apiserver.secrets.token_hex", lambda _: next(suffixes))
    publisher = SlicePublisher(api, NODE)
    assert publisher.sync(many_gpus(300)).created == 3
    server.clear_requests()
    again = publisher.sync(many_gpus(300))
    assert not again.changed and again.generation == 1
    assert writes(server) == []


def test_a_change_updates_in_place_at_a_new_generation(server: FakeApiServer, api: KubeApi, tmp_path: Path) -> None:
    inventory, _ = node_inventory(NODE01, tmp_path)
    publisher = SlicePublisher(api, NODE)
    publisher.sync(inventory)
    (before,) = ours(server)
    (resource,) = inventory.resources
    fewer = type(inventory)((type(resource)(resource.name, resource.kind, resource.devices[:2], resource.selectors),))
    result = publisher.sync(fewer)
    assert (result.generation, result.created, result.updated, result.deleted) == (2, 0, 1, 0)
    (after,) = ours(server)
    assert after["metadata"]["name"] == before["metadata"]["name"]
    assert after["spec"]["pool"]["generation"] == 2
    assert [device["name"] for device in after["spec"]["devices"]] == ["pci-0000-3b-00-0", "pci-0000-5e-00-0"]


def test_a_pool_grows_and_shrinks_across_slices(server: FakeApiServer, api: KubeApi) -> None:
    publisher = SlicePublisher(api, NODE)
    assert publisher.sync(many_gpus(300)).created == 3
    slices = ours(server)
    assert sorted(len(obj["spec"]["devices"]) for obj in slices) == [44, 128, 128]
    assert {obj["spec"]["pool"]["resourceSliceCount"] for obj in slices} == {3}
    server.clear_requests()
    result = publisher.sync(many_gpus(4))
    assert (result.generation, result.created, result.updated, result.deleted) == (2, 0, 1, 2)
    methods = [method for method, _ in writes(server)]
    assert methods == ["PUT", "DELETE", "DELETE"]  # the new generation is in place before the old slices go
    (left,) = ours(server)
    assert left["spec"]["pool"] == {"name": NODE, "generation": 2, "resourceSliceCount": 1}
    assert publisher.sync(many_gpus(0)).deleted == 1  # nothing to offer: no slices at all
    assert ours(server) == []
    assert not publisher.sync(many_gpus(0)).changed


def test_other_nodes_and_drivers_are_left_alone(server: FakeApiServer, api: KubeApi) -> None:
    other_node = build_slices(many_gpus(2), "node02")[0]
    other_driver = build_slices(many_gpus(2), NODE)[0]
    other_driver["spec"]["driver"] = "gpu.example.com"
    server.add_slice(other_node)
    server.add_slice(other_driver)
    before = {obj["metadata"]["name"]: obj for obj in server.slices()}
    publisher = SlicePublisher(api, NODE)
    publisher.sync(many_gpus(3))
    publisher.sync(many_gpus(0))
    after = {obj["metadata"]["name"]: obj for obj in server.slices()}
    assert after == before


def test_a_slice_of_ours_in_another_pool_is_deleted_not_reused(server: FakeApiServer, api: KubeApi) -> None:
    """The pool name is immutable: a leftover slice naming another pool cannot be updated into ours."""
    stray = build_slices(many_gpus(1), NODE)[0]
    stray["spec"]["pool"]["name"] = "old-pool"
    server.add_slice(stray)
    result = SlicePublisher(api, NODE).sync(many_gpus(2))
    assert (result.created, result.updated, result.deleted) == (1, 0, 1)
    (obj,) = ours(server)
    assert obj["spec"]["pool"]["name"] == NODE


def test_a_failed_call_is_a_clear_error_and_the_next_publish_repairs(server: FakeApiServer, api: KubeApi) -> None:
    publisher = SlicePublisher(api, NODE)
    publisher.sync(many_gpus(300))
    # The list and the first PUT succeed, the second PUT fails: the pool is half at generation 2.
    calls = {"count": 0}
    original = api.replace_slice

    def failing_second(name: str, obj: dict[str, Any]) -> dict[str, Any]:
        calls["count"] += 1
        if calls["count"] == 2:
            server.fail_next(1, 500, "InternalError")
        return original(name, obj)

    api.replace_slice = failing_second  # type: ignore[method-assign]
    with pytest.raises(KubeError, match=r"update ResourceSlice node01-.*: HTTP 500 from http://127\.0\.0\.1:\d+: "):
        publisher.sync(many_gpus(200))
    api.replace_slice = original  # type: ignore[method-assign]
    generations = sorted(obj["spec"]["pool"]["generation"] for obj in ours(server))
    assert generations == [1, 1, 2]
    result = publisher.sync(many_gpus(200))
    assert result.generation == 3
    slices = ours(server)
    assert {obj["spec"]["pool"]["generation"] for obj in slices} == {3}
    assert sorted(len(obj["spec"]["devices"]) for obj in slices) == [72, 128]


def test_a_conflicting_writer_is_an_error_then_repaired(server: FakeApiServer, api: KubeApi) -> None:
    publisher = SlicePublisher(api, NODE)
    publisher.sync(many_gpus(2))
    (obj,) = ours(server)
    original = api.list_slices

    def list_then_someone_writes(node_name: str, driver: str = DRIVER_NAME) -> list[dict[str, Any]]:
        found = original(node_name, driver)
        changed = dict(obj, spec=dict(obj["spec"], devices=obj["spec"]["devices"][:1]))
        server.handle("PUT", f"/apis/resource.k8s.io/v1/resourceslices/{obj['metadata']['name']}", _json(changed))
        return found

    api.list_slices = list_then_someone_writes  # type: ignore[method-assign]
    with pytest.raises(KubeError, match=r"HTTP 409 .*the object has been modified"):
        publisher.sync(many_gpus(3))
    api.list_slices = original  # type: ignore[method-assign]
    assert publisher.sync(many_gpus(3)).updated == 1
    (fixed,) = ours(server)
    assert len(fixed["spec"]["devices"]) == 3


def _json(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj).encode()


def test_a_missing_node_is_named(server: FakeApiServer, api: KubeApi) -> None:
    with pytest.raises(KubeError, match=r"read Node node-x: HTTP 404 .*nodes \"node-x\" not found"):
        SlicePublisher(api, "node-x").sync(many_gpus(1))
    assert server.slices() == []


def test_an_unreachable_server_fails_within_the_timeout() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        api = KubeApi.for_host(f"http://127.0.0.1:{port}", timeout=(1.0, 1.0))
        started = time.monotonic()
        with pytest.raises(
            KubeError, match=rf"list ResourceSlices of node node01 .*: no answer from http://127\.0\.0\.1:{port}"
        ):
            SlicePublisher(api, NODE).sync(many_gpus(1))
        assert time.monotonic() - started < 10


def test_a_silent_server_times_out() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)  # accepts, never answers
        api = KubeApi.for_host(f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=(1.0, 0.5))
        started = time.monotonic()
        with pytest.raises(KubeError, match="no answer from"):
            api.list_slices(NODE)
        assert time.monotonic() - started < 10


def test_an_answer_nested_too_deep_is_a_kube_error_naming_the_call() -> None:
    body = b"[" * 100_000 + b"]" * 100_000

    class Deep(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with ThreadingHTTPServer(("127.0.0.1", 0), Deep) as httpd:
        thread = threading.Thread(target=httpd.serve_forever, daemon=True)
        thread.start()
        try:
            api = KubeApi.for_host(f"http://127.0.0.1:{httpd.server_address[1]}", timeout=(2.0, 5.0))
            with pytest.raises(KubeError, match=r"read ResourceClaim vms/c: the answer .* is not JSON"):
                api.read_claim("vms", "c")
        finally:
            httpd.shutdown()


def test_the_fake_api_server_refuses_field_selectors_kubernetes_does_not_support(server: FakeApiServer) -> None:
    # Kubernetes converts only metadata.name, spec.nodeName and spec.driver for ResourceSlices; a fake that
    # also filtered on spec.pool.name would let a query pass here that a real API server refuses.
    response = urllib.request.urlopen
    with pytest.raises(urllib.error.HTTPError) as refused:
        response(f"{server.url}/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.pool.name%3Dnode01")
    assert refused.value.code == 400
    assert "field label not supported" in refused.value.read().decode()
    with response(f"{server.url}/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dn") as ok:
        assert ok.status == 200


def test_too_many_slices_of_ours_is_refused(server: FakeApiServer, api: KubeApi) -> None:
    for _ in range(65):
        server.add_slice(build_slices(many_gpus(1), NODE)[0])
    with pytest.raises(KubeError, match=r"65 ResourceSlices .* over the 64"):
        SlicePublisher(api, NODE).sync(many_gpus(1))


def test_withdraw_deletes_every_slice_of_ours(server: FakeApiServer, api: KubeApi) -> None:
    publisher = SlicePublisher(api, NODE)
    publisher.sync(many_gpus(200))
    assert publisher.withdraw() == 2
    assert ours(server) == []


def test_from_environment_reads_a_kubeconfig(server: FakeApiServer, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
                "users": [{"name": "dev", "user": {"token": "not-a-secret"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "dev"}}],
                "current-context": "fake",
            }
        )
    )
    api = KubeApi.from_environment(kubeconfig)
    assert SlicePublisher(api, NODE).sync(many_gpus(1)).created == 1
    with pytest.raises(KubeError, match="cannot configure the Kubernetes client from kubeconfig"):
        KubeApi.from_environment(tmp_path / "missing")


# -- KubeClaims ------------------------------------------------------------------------------------------------

REF = ClaimRef("gpu-vms", "vm-with-dra-gpus-gpus-x7k2p", "0b6f6c52-0000-4000-8000-000000000002")
RESULTS = [
    AllocatedDevice("gpu0", DRIVER_NAME, NODE, "pci-0000-86-00-0"),
    AllocatedDevice("gpu1", DRIVER_NAME, NODE, "pci-0000-af-00-0"),
]


def test_claims_are_read_from_the_api(server: FakeApiServer, api: KubeApi) -> None:
    server.add_claim(claim_object(REF, RESULTS))
    assert KubeClaims(api).allocated(REF) == RESULTS
    (request,) = server.requests()
    assert request.path == f"/apis/resource.k8s.io/v1/namespaces/{REF.namespace}/resourceclaims/{REF.name}"


def test_a_recreated_or_missing_claim_is_refused(server: FakeApiServer, api: KubeApi) -> None:
    server.add_claim(claim_object(ClaimRef(REF.namespace, REF.name, "another-uid"), RESULTS))
    with pytest.raises(ClaimError, match="re-created"):
        KubeClaims(api).allocated(REF)
    with pytest.raises(ClaimError, match=r"gpu-vms/nothing .*HTTP 404 .*not found"):
        KubeClaims(api).allocated(ClaimRef(REF.namespace, "nothing", REF.uid))
    with pytest.raises(ClaimError, match="not a DNS label"):
        KubeClaims(api).allocated(ClaimRef("../x", "y", "z"))
    assert all(request.path.endswith(("/nothing", REF.name)) for request in server.requests())


def test_slices_published_for_a_vgpu_node_validate(server: FakeApiServer, api: KubeApi, tmp_path: Path) -> None:
    server.add_node(VGPU_NODE.name)
    inventory, _ = node_inventory(VGPU_NODE, tmp_path)
    SlicePublisher(api, VGPU_NODE.name).sync(inventory)
    (obj,) = ours(server, VGPU_NODE.name)
    for field in ("uid", "resourceVersion", "creationTimestamp", "generation"):
        obj["metadata"].pop(field)
    validate_strictly(obj, DRA_OLDEST_KUBERNETES)
    assert len(obj["spec"]["devices"]) == 3


def test_cluster_side_gives_the_claims_and_the_publisher_on_one_client(server: FakeApiServer, tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
                "users": [{"name": "dev", "user": {}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "dev"}}],
                "current-context": "fake",
            }
        )
    )
    claims, publisher = cluster_side(NODE, kubeconfig)
    publisher.publish(many_gpus(2))  # the serve loop's sink: nothing returned, the slices are there
    assert len(ours(server)) == 1
    server.add_claim(claim_object(REF, RESULTS))
    assert claims.allocated(REF) == RESULTS


def test_a_recreated_node_owns_the_slices_written_after_it(server: FakeApiServer, api: KubeApi) -> None:
    publisher = SlicePublisher(api, NODE)
    publisher.sync(many_gpus(2))
    server.add_node(NODE, "11111111-0000-4000-8000-000000000009")  # deleted and registered again
    publisher.sync(many_gpus(3))
    (obj,) = ours(server)
    assert obj["metadata"]["ownerReferences"][0]["uid"] == "11111111-0000-4000-8000-000000000009"
    server.clear_requests()
    publisher.sync(many_gpus(3))  # unchanged: one LIST, no Node read, no write
    assert [(request.method, request.path) for request in server.requests()] == [
        ("GET", "/apis/resource.k8s.io/v1/resourceslices")
    ]


def test_the_device_plugin_path_never_loads_the_kubernetes_client() -> None:
    """The client costs ~55 MiB resident: only serve --dra without --claims-dir may import it."""
    code = (
        "import sys, plugin.cli, plugin.dra.serve, xmlgen.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'kubernetes'))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "[]"
