"""Images for the cluster without any registry: the pod sandbox's pause image, a Debian 12 Python base image
made from Debian's packages, and the project's own image built from its ``Dockerfile`` by BuildKit.

Why: the machines reach no container registry, so nothing can be pulled. The pause and base images are written
here as OCI image layouts and imported into the cluster's containerd (``ctr images import``); the project's
image is built by a real builder, BuildKit's ``buildkitd`` with its containerd worker, straight into the
``k8s.io`` namespace the kubelet's CRI reads, under the name ``deploy/`` uses, so the manifests run unchanged.
The Dockerfile's base (``PYTHON_IMAGE``) is the local base image here; elsewhere it stays Docker Hub's
``python:3.11-slim-bookworm``.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.cluster import kit

PROJECT_IMAGE = "registry.example.com/kubevirt-gpu-passthrough:0.1.0"
BASE_REPOSITORY = "localhost/kgp-python"
# What the Dockerfile's stages run besides Python: python -m venv (python3-venv), `python` (python-is-python3),
# TLS to PyPI and Debian (ca-certificates); apt-get comes with every Debian root.
BASE_PACKAGES = ("python3", "python3-venv", "python-is-python3", "ca-certificates")
DEBIAN_MIRROR = "http://deb.debian.org/debian"
CACHE = Path(os.environ.get("KGP_IMAGES_CACHE", Path.home() / ".cache/kubevirt-gpu-passthrough/images"))


class ImageError(kit.ClusterError):
    """An image could not be made, imported or built; the message names it."""


def _run(argv: list[str], what: str, *, timeout: float, stdin: bytes | None = None) -> str:
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ImageError(f"{what}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or b"").decode(errors="replace").strip()[-1500:]
        raise ImageError(f"{what}: {argv[0]} exited {done.returncode}: {tail}")
    return (done.stdout or b"").decode(errors="replace")


def _blob(layout: Path, data: bytes) -> str:
    digest = hashlib.sha256(data).hexdigest()
    path = layout / "blobs" / "sha256" / digest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return f"sha256:{digest}"


def write_oci_archive(archive: Path, name: str, layer_tar: Path, config: dict[str, object]) -> None:
    """An OCI image layout with one uncompressed layer, as a tar ``ctr images import`` takes."""
    with tempfile.TemporaryDirectory(dir=archive.parent) as scratch:
        layout = Path(scratch)
        (layout / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
        layer = layer_tar.read_bytes()
        layer_digest = _blob(layout, layer)
        image_config = {
            "architecture": "amd64",
            "os": "linux",
            "config": config,
            "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        }
        config_bytes = json.dumps(image_config).encode()
        config_digest = _blob(layout, config_bytes)
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": config_digest,
                    "size": len(config_bytes),
                },
                "layers": [
                    {"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(layer)}
                ],
            }
        ).encode()
        manifest_digest = _blob(layout, manifest)
        (layout / "index.json").write_text(
            json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.oci.image.index.v1+json",
                    "manifests": [
                        {
                            "mediaType": "application/vnd.oci.image.manifest.v1+json",
                            "digest": manifest_digest,
                            "size": len(manifest),
                            "platform": {"architecture": "amd64", "os": "linux"},
                            "annotations": {
                                "io.containerd.image.name": name,
                                "org.opencontainers.image.ref.name": name.rpartition(":")[2],
                            },
                        }
                    ],
                }
            )
        )
        partial = archive.with_suffix(".partial")
        with tarfile.open(partial, "w") as out:
            for path in sorted(layout.rglob("*")):
                out.add(path, arcname=str(path.relative_to(layout)), recursive=False)
        partial.replace(archive)


def ctr(peers: kit.Peers, *args: str, timeout: float = 300) -> str:
    sock = kit.RUN / "containerd" / "containerd.sock"
    return _run(
        [str(peers.binary("containerd", "ctr")), "--address", str(sock), "--namespace", "k8s.io", *args],
        f"ctr {' '.join(args[:2])}",
        timeout=timeout,
    )


def has_image(peers: kit.Peers, name: str) -> bool:
    return name in ctr(peers, "images", "list", "--quiet").split()


def _import(peers: kit.Peers, archive: Path, name: str) -> None:
    ctr(peers, "images", "import", "--no-unpack=false", str(archive), timeout=600)
    if not has_image(peers, name):
        raise ImageError(f"ctr images import {archive} did not make {name}")


def ensure_pause(peers: kit.Peers) -> None:
    """The sandbox image containerd's CRI pins (``kit.PAUSE_IMAGE``): tests/cluster/pause.c, static."""
    if has_image(peers, kit.PAUSE_IMAGE):
        return
    CACHE.mkdir(parents=True, exist_ok=True)
    source = Path(__file__).with_name("pause.c")
    key = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    archive = CACHE / f"pause-{key}.tar"
    if not archive.exists():
        with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
            binary = Path(scratch) / "pause"
            _run(["gcc", "-static", "-Os", "-o", str(binary), str(source)], "compiling pause.c", timeout=120)
            layer = Path(scratch) / "layer.tar"
            with tarfile.open(layer, "w") as out:
                info = out.gettarinfo(str(binary), arcname="pause")
                info.uid = info.gid = 0
                info.uname = info.gname = "root"
                with binary.open("rb") as data:
                    out.addfile(info, data)
            write_oci_archive(archive, kit.PAUSE_IMAGE, layer, {"Entrypoint": ["/pause"], "User": "65535:65535"})
    _import(peers, archive, kit.PAUSE_IMAGE)


LOCAL_CAS = Path("/usr/local/share/ca-certificates")
"""The machine's own certificate authorities (Debian's place for them). Where a proxy between this machine and
PyPI or Debian re-signs TLS, the Dockerfile's pip and apt steps need them; the local base carries them, as a base
image made for this machine's builds, and tells pip (which otherwise trusts only its bundled list) to use the
system store. Docker Hub's python image, the Dockerfile's default, needs none of this."""


def _local_cas() -> list[Path]:
    return sorted(LOCAL_CAS.glob("*.crt")) if LOCAL_CAS.is_dir() else []


def _base_key() -> str:
    digest = hashlib.sha256(("bookworm minbase " + " ".join(BASE_PACKAGES)).encode())
    for ca in _local_cas():
        digest.update(ca.name.encode() + ca.read_bytes())
    return digest.hexdigest()[:16]


def base_image() -> str:
    """The local base's name; its tag is the key of what went into it (packages, the machine's CAs)."""
    return f"{BASE_REPOSITORY}:3.11-bookworm-{_base_key()}"


def ensure_base(peers: kit.Peers) -> str:
    """Debian 12 (minbase) with Python 3.11 from Debian's packages, by debootstrap; returns its name."""
    name = base_image()
    if has_image(peers, name):
        return name
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"base-{_base_key()}.tar"
    if not archive.exists():
        with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
            rootfs = Path(scratch) / "rootfs"
            kit.say(f"making {name} from Debian's packages (debootstrap, ~2 min)")
            _run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(BASE_PACKAGES)}",
                    "bookworm",
                    str(rootfs),
                    DEBIAN_MIRROR,
                ],
                "debootstrap of the base image",
                timeout=1200,
            )
            cas = _local_cas()
            if cas:
                for ca in cas:
                    (rootfs / "usr/local/share/ca-certificates" / ca.name).write_bytes(ca.read_bytes())
                _run(["chroot", str(rootfs), "update-ca-certificates"], "the base's certificate store", timeout=120)
            for leftover in ("var/cache/apt/archives", "var/lib/apt/lists"):
                _run(["find", str(rootfs / leftover), "-mindepth", "1", "-delete"], "cleaning the base", timeout=120)
            layer = Path(scratch) / "layer.tar"
            # /dev, /proc and /sys are the runtime's; the rest as debootstrap left it, owners by number.
            _run(
                [
                    "tar",
                    "--numeric-owner",
                    "--xattrs",
                    "-C",
                    str(rootfs),
                    "--exclude=./dev/*",
                    "--exclude=./proc/*",
                    "--exclude=./sys/*",
                    "-cf",
                    str(layer),
                    ".",
                ],
                "packing the base image",
                timeout=600,
            )
            write_oci_archive(
                archive,
                name,
                layer,
                {
                    "Env": [
                        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                        "LANG=C.UTF-8",
                        *(["PIP_CERT=/etc/ssl/certs/ca-certificates.crt"] if cas else []),
                    ],
                    "Cmd": ["python3"],
                },
            )
    _import(peers, archive, name)
    return name


def _buildkitd_socket() -> Path:
    return kit.RUN / "buildkit" / "buildkitd.sock"


def ensure_buildkitd(peers: kit.Peers) -> None:
    """``buildkitd`` with only its containerd worker, on the cluster's containerd, namespace ``k8s.io``."""
    (kit.RUN / "buildkit").mkdir(parents=True, exist_ok=True)
    kit.start(
        "buildkitd",
        [
            str(peers.binary("buildkit", "buildkitd")),
            f"--root={kit.STATE / 'buildkit'}",
            f"--addr=unix://{_buildkitd_socket()}",
            "--oci-worker=false",
            "--containerd-worker=true",
            f"--containerd-worker-addr={kit.RUN / 'containerd' / 'containerd.sock'}",
            "--containerd-worker-namespace=k8s.io",
            "--containerd-worker-snapshotter=overlayfs",
            # The Dockerfile's RUN steps reach PyPI and Debian (pip's hash-pinned locks, apt's pinned versions).
            "--containerd-worker-net=host",
        ],
        peers,
    )
    buildctl = str(peers.binary("buildkit", "buildctl"))

    def answers() -> bool:
        done = subprocess.run(
            [buildctl, f"--addr=unix://{_buildkitd_socket()}", "debug", "workers"],
            capture_output=True,
            timeout=30,
            check=False,
        )
        return done.returncode == 0 and bool(done.stdout.strip())

    kit.wait_for("buildkitd's containerd worker", answers, component="buildkitd", deadline=120)


def build_project_image(peers: kit.Peers, *, context: Path = kit.REPO, name: str = PROJECT_IMAGE) -> float:
    """Build ``context``'s Dockerfile into containerd as ``name``; returns the seconds it took."""
    ensure_pause(peers)
    base = ensure_base(peers)
    ensure_buildkitd(peers)
    started = time.monotonic()
    kit.say(f"building {name} from {context / 'Dockerfile'} with BuildKit (a cold build takes a few minutes)")
    _run(
        [
            str(peers.binary("buildkit", "buildctl")),
            f"--addr=unix://{_buildkitd_socket()}",
            "build",
            "--frontend=dockerfile.v0",
            f"--local=context={context}",
            f"--local=dockerfile={context}",
            f"--opt=build-arg:PYTHON_IMAGE={base}",
            # FROM the local base: BuildKit looks in the worker's image store (containerd) before any registry.
            "--opt=image-resolve-mode=local",
            f"--output=type=image,name={name},unpack=true",
            "--progress=plain",
        ],
        f"buildctl build of {context / 'Dockerfile'}",
        timeout=1800,
    )
    if not has_image(peers, name):
        raise ImageError(f"BuildKit finished but containerd has no {name}")
    return time.monotonic() - started


def image_config(peers: kit.Peers, name: str) -> dict[str, Any]:
    """The image's OCI config (user, env, entrypoint), read back from containerd's content store."""
    listing = ctr(peers, "images", "list", f"name=={name}")
    digest = next(
        (word for line in listing.splitlines()[1:] for word in line.split() if word.startswith("sha256:")), None
    )
    if digest is None:
        raise ImageError(f"containerd has no {name}")
    manifest = json.loads(ctr(peers, "content", "get", digest))
    if "manifests" in manifest:  # an index: the amd64 manifest
        entry = next(m for m in manifest["manifests"] if m.get("platform", {}).get("architecture") == "amd64")
        manifest = json.loads(ctr(peers, "content", "get", entry["digest"]))
    config = json.loads(ctr(peers, "content", "get", manifest["config"]["digest"]))
    return dict(config)
