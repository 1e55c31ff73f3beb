"""The KEP 5304 metadata file: paths, the writer's exact shape, the strict bounded parser, the device lookup.

The shapes are the ones KubeVirt's reader decodes (pkg/dra/utils.go, pkg/dra/metadata/types.go at
kubevirt/kubevirt d923fdb); docs/dra.md, "Hook side".
"""

from __future__ import annotations

import json

import pytest

from schemas.dra import ATTR_MDEV_UUID, ATTR_PCI_BUS_ID, DRIVER_NAME
from schemas.dra_metadata import (
    API_VERSION,
    DEFAULT_ROOT,
    MAX_FILE_BYTES,
    MAX_STREAM_OBJECTS,
    Attribute,
    DeviceMetadata,
    MetadataDevice,
    MetadataRequest,
    claim_directory,
    claimed_device,
    device_attributes,
    metadata_path,
    parse_metadata,
    render_metadata,
    request_dir,
)
from schemas.errors import InputError

UUID = "4b20d080-1b54-4048-85b3-a6a62d165c01"


def _metadata(**attrs: Attribute) -> DeviceMetadata:
    device = MetadataDevice(DRIVER_NAME, "node01", "pci-0000-86-00-0", dict(attrs))
    return DeviceMetadata("gpu-claim", "default", "uid-1", None, (MetadataRequest("gpu", (device,)),))


def test_paths_are_the_ones_virt_launcher_reads_for_direct_and_template_claims() -> None:
    assert str(metadata_path(DEFAULT_ROOT, "claim", "my-claim", "gpu", DRIVER_NAME)) == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaims/my-claim/gpu/"
        "gpu-passthrough.kubevirt.io-metadata.json"
    )
    assert str(request_dir("/r", "template", "vgpu", "req")) == "/r/resourceclaimtemplates/vgpu/req"


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "x" * 254, "a\0b"])
def test_a_name_that_is_not_one_path_component_is_refused(name: str) -> None:
    with pytest.raises(InputError, match="path component"):
        request_dir("/r", "claim", name, "gpu")
    with pytest.raises(InputError, match="path component"):
        metadata_path("/r", "claim", "c", "gpu", name)


def test_writer_produces_the_kubevirt_shape_and_parses_back() -> None:
    md = DeviceMetadata(
        "virt-launcher-vm-gpu-x7k2",
        "default",
        "uid-1",
        "gpu",
        (
            MetadataRequest(
                "vgpu",
                (MetadataDevice(DRIVER_NAME, "node01", f"mdev-{UUID}", device_attributes(mdev_uuid=UUID.upper())),),
            ),
        ),
    )
    data = render_metadata(md)
    assert data.endswith(b"\n")
    assert json.loads(data) == {
        "apiVersion": "metadata.resource.k8s.io/v1alpha1",
        "kind": "DeviceMetadata",
        "metadata": {"name": "virt-launcher-vm-gpu-x7k2", "namespace": "default", "uid": "uid-1", "generation": 1},
        "podClaimName": "gpu",
        "requests": [
            {
                "name": "vgpu",
                "devices": [
                    {
                        "driver": DRIVER_NAME,
                        "pool": "node01",
                        "name": f"mdev-{UUID}",
                        "attributes": {"mdevUUID": {"string": UUID}},
                    }
                ],
            }
        ],
    }
    assert parse_metadata(data, "f") == md


def test_direct_claim_has_no_pod_claim_name_and_attributes_keep_their_types() -> None:
    md = _metadata(
        **{
            ATTR_PCI_BUS_ID: Attribute.string("0000:86:00.0"),
            "numaNode": Attribute("int", 1),
            "healthy": Attribute("bool", True),
            "driverVersion": Attribute("version", "1.2.3"),
        }
    )
    data = render_metadata(md)
    assert "podClaimName" not in json.loads(data)
    assert parse_metadata(data, "f") == md


def test_lookup_prefers_the_mdev_uuid_like_virt_launcher_then_the_pci_bus_id() -> None:
    both = _metadata(**device_attributes(pci_bus_id="0000:86:00.0", mdev_uuid=UUID))
    found = claimed_device(both, "gpu", "f")
    assert (found.kind, found.id) == ("mdev", UUID)
    pci = _metadata(**device_attributes(pci_bus_id="0000:86:00.0"))
    found = claimed_device(pci, "gpu", "f")
    assert (found.kind, found.id) == ("pci", "0000:86:00.0")


def test_lookup_errors_name_the_file_request_and_reason() -> None:
    none = _metadata()
    with pytest.raises(InputError, match=r"file /m: device 'pci-0000-86-00-0' of request 'gpu' has neither"):
        claimed_device(none, "gpu", "/m")
    with pytest.raises(InputError, match=r"/m has no request 'other' for claim 'gpu-claim' \(requests: 'gpu'\)"):
        claimed_device(none, "other", "/m")
    empty = DeviceMetadata("c", requests=(MetadataRequest("gpu"),))
    with pytest.raises(InputError, match="has 0 devices"):
        claimed_device(empty, "gpu", "/m")
    dev = _metadata(**device_attributes(pci_bus_id="0000:86:00.0")).requests[0].devices[0]
    two = DeviceMetadata("c", requests=(MetadataRequest("gpu", (dev, dev)),))
    with pytest.raises(InputError, match="has 2 devices; KubeVirt takes exactly one"):
        claimed_device(two, "gpu", "/m")
    bad = _metadata(**{ATTR_PCI_BUS_ID: Attribute.string("86:00.0")})
    with pytest.raises(InputError, match=r"/m: attribute 'resource.kubernetes.io/pciBusID': malformed PCI"):
        claimed_device(bad, "gpu", "/m")
    bad_uuid = _metadata(**{ATTR_MDEV_UUID: Attribute.string("nope")})
    with pytest.raises(InputError, match="malformed mdev UUID"):
        claimed_device(bad_uuid, "gpu", "/m")


def test_an_empty_or_non_string_attribute_does_not_count_as_given() -> None:
    md = _metadata(**{ATTR_MDEV_UUID: Attribute.string(""), ATTR_PCI_BUS_ID: Attribute.string("0000:86:00.0")})
    assert claimed_device(md, "gpu", "f").kind == "pci"
    md = _metadata(**{ATTR_MDEV_UUID: Attribute("version", UUID), ATTR_PCI_BUS_ID: Attribute.string("0000:86:00.0")})
    assert claimed_device(md, "gpu", "f").kind == "pci"


def _obj(version: str = API_VERSION, **extra: object) -> dict[str, object]:
    return {"apiVersion": version, "kind": "DeviceMetadata", "metadata": {"name": "c"}, **extra}


def test_stream_takes_the_first_known_version_and_skips_newer_ones() -> None:
    newer = json.dumps(_obj("metadata.resource.k8s.io/v1", requests="anything"))
    known = json.dumps(_obj(requests=[{"name": "gpu", "devices": []}]))
    parsed = parse_metadata(f"{newer}\n{known}\n{json.dumps(_obj(requests=7))}".encode(), "f")
    assert parsed.requests == (MetadataRequest("gpu"),)
    # unknown fields are ignored, as Go's decoder ignores them
    assert parse_metadata(json.dumps(_obj(extra={"x": 1})).encode(), "f").claim_name == "c"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "holds no metadata object"),
        (b"  \n", "holds no metadata object"),
        (b"{", "is not a JSON stream"),
        (b"[]", "object 1 is a list, not an object"),
        (b'{"kind": "DeviceMetadata"}', "object 1 has no apiVersion"),
        (json.dumps(_obj("v9")).encode(), r"has no object of apiVersion .* \(found: v9\)"),
        (b"\xff", "not valid UTF-8"),
        (b'{"apiVersion": "a", "apiVersion": "b"}', "duplicate key 'apiVersion'"),
        (json.dumps(_obj(kind="Pod")).encode(), "kind is 'Pod'"),
        (json.dumps(_obj(requests={})).encode(), "requests is an object, not a list"),
        (json.dumps(_obj(requests=[{"devices": []}])).encode(), r"requests\[0\].name is null, not a string"),
        (json.dumps(_obj(requests=[{"name": ""}])).encode(), r"requests\[0\].name is empty"),
        (
            json.dumps(_obj(requests=[{"name": "a"}, {"name": "a"}])).encode(),
            "request 'a' appears more than once",
        ),
        (
            json.dumps(_obj(requests=[{"name": "a", "devices": [{"attributes": {"k": {}}}]}])).encode(),
            r"attributes\['k'\] must have exactly one of string, int, bool, version; it has 0",
        ),
        (
            json.dumps(_obj(requests=[{"name": "a", "devices": [{"attributes": {"k": {"int": "1"}}}]}])).encode(),
            r"\.int is a string, not a 64-bit integer",
        ),
        (
            json.dumps(
                _obj(requests=[{"name": "a", "devices": [{"attributes": {"k": {"string": "x" * 65}}}]}])
            ).encode(),
            "string of at most 64",
        ),
        (json.dumps(_obj(metadata={"name": 5})).encode(), "metadata.name is a number, not a string"),
        (json.dumps(_obj(requests=[{"name": "a"}] * 33)).encode(), "33 entries, over the limit of 32"),
    ],
)
def test_malformed_files_are_refused_naming_the_file(data: bytes, message: str) -> None:
    with pytest.raises(InputError, match=message) as info:
        parse_metadata(data, "/var/run/x-metadata.json")
    assert "/var/run/x-metadata.json" in str(info.value)


def test_size_object_count_and_nesting_are_bounded() -> None:
    with pytest.raises(InputError, match="over the 262144-byte limit"):
        parse_metadata(b" " * (MAX_FILE_BYTES + 1), "f")
    many = b"\n".join(json.dumps(_obj("other")).encode() for _ in range(MAX_STREAM_OBJECTS + 1))
    with pytest.raises(InputError, match="more than 8 objects"):
        parse_metadata(many, "f")
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(InputError, match="file f is not a JSON stream"):
        parse_metadata(deep[:MAX_FILE_BYTES], "f")


def test_writer_refuses_what_the_reader_would_refuse() -> None:
    with pytest.raises(InputError, match="string of at most 64"):
        render_metadata(_metadata(k=Attribute.string("x" * 65)))
    with pytest.raises(InputError, match="malformed PCI address"):
        device_attributes(pci_bus_id="86:00.0")


def test_a_generated_claim_goes_under_its_pod_claim_name_any_other_under_its_own() -> None:
    assert claim_directory("virt-launcher-vm-abcde-gpu-x7k2q", "gpu") == ("template", "gpu")
    assert claim_directory("a10-claim", None) == ("claim", "a10-claim")
    assert str(metadata_path("/r", *claim_directory("c", ""), "req", DRIVER_NAME)).startswith(
        "/r/resourceclaims/c/req/"
    )
