# One image for every role of kubevirt-gpu-passthrough:
#   - the device plugin DaemonSet:  gpu-device-plugin serve --host-root /host   (deploy/device-plugin/)
#   - the KubeVirt hook sidecar:    launcher-hook serve …                       (deploy/hook-sidecar/)
#   - the node agent:               gpu-node-agent bind|vgpu apply|validate …   (docs/node-agent.md)
# plus `onDefineDomain` (for KubeVirt's sidecar-shim) and `xmlgen`, all on PATH from the venv /opt/venv.
#
#   docker build -t registry.example.com/kubevirt-gpu-passthrough:0.1.0 .
#
# The image runs as a non-root user by default; the DaemonSet asks for uid 0 in its securityContext (it must
# create sockets in the kubelet's root-owned device-plugins directory), the hook sidecar stays non-root.
# tests/test_dockerfile.py lints this file with hadolint and runs the builder stage's steps outside Docker:
# keep every path in the builder's RUN lines behind $VIRTUAL_ENV or relative to the WORKDIR.

# No `# syntax=` line: it would make BuildKit fetch the Dockerfile frontend image from Docker Hub first, which a
# builder without a registry cannot do (the real-cluster suite builds this file that way, docs/real-cluster.md);
# BuildKit's built-in frontend, and Docker 23+'s, has everything used here (RUN --mount=type=cache).
# PYTHON_IMAGE: any Debian 12 Python 3.11 image with `python` on PATH; the suite uses one made by debootstrap.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS builder
ENV VIRTUAL_ENV=/opt/venv \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
RUN python -m venv "$VIRTUAL_ENV"
# The dependencies from the hash-pinned locks (scripts/lock.sh) first, in their own layer: the build backend
# (setuptools) and the runtime pins, every file checked against its hash.
COPY requirements/build.txt requirements/runtime.txt requirements/
RUN --mount=type=cache,target=/root/.cache/pip \
    "$VIRTUAL_ENV/bin/pip" install --require-hashes -r requirements/build.txt -r requirements/runtime.txt
COPY pyproject.toml README.md ./
COPY schemas/ schemas/
COPY runtime/ runtime/
COPY plugin/ plugin/
COPY launcher_hook/ launcher_hook/
COPY node_agent/ node_agent/
COPY simkit/ simkit/
COPY xmlgen/ xmlgen/
# A wheel (what pip would publish, built with the locked setuptools), installed without resolving anything
# more; then the build backend leaves: no source tree, no editable install, no build tools in the image.
RUN --mount=type=cache,target=/root/.cache/pip \
    "$VIRTUAL_ENV/bin/pip" wheel --no-deps --no-build-isolation --wheel-dir dist . \
    && "$VIRTUAL_ENV/bin/pip" install --no-deps dist/*.whl \
    && "$VIRTUAL_ENV/bin/pip" check \
    && "$VIRTUAL_ENV/bin/pip" uninstall -y setuptools

FROM ${PYTHON_IMAGE} AS runtime
# Debian's pci.ids: device names (and so resource names, docs/protocols.md, "Resource names") do not depend
# on the node's own file, which the DaemonSet does not mount. Pinned so that a rebuild cannot rename resources; bump it on purpose.
ARG PCI_IDS_VERSION=0.0~2023.04.11-1
# kmod: the node agent's modprobe, loading the VFIO driver from the host's modules (modprobe -d /host).
ARG KMOD_VERSION=30+20221128-1
RUN apt-get update \
    && apt-get install -y --no-install-recommends "pci.ids=${PCI_IDS_VERSION}" "kmod=${KMOD_VERSION}" \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --system --gid 10001 gpu-passthrough \
    && useradd --system --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin gpu-passthrough
COPY --from=builder /opt/venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# Every entry point starts, and the image has its own pci.ids.
RUN gpu-device-plugin --help > /dev/null \
    && launcher-hook --help > /dev/null \
    && gpu-node-agent --help > /dev/null \
    && onDefineDomain --help > /dev/null \
    && xmlgen --help > /dev/null \
    && test -s /usr/share/misc/pci.ids \
    && modprobe --version > /dev/null
LABEL org.opencontainers.image.title="kubevirt-gpu-passthrough" \
      org.opencontainers.image.description="NVIDIA GPUs for KubeVirt VMs: device plugin, hook sidecar, xmlgen" \
      org.opencontainers.image.licenses="Apache-2.0"
USER 10001:10001
CMD ["xmlgen", "--help"]
