"""What the benchmarks share: a KubeVirt-sized domain, a VM asking for 16 GPUs, and a timer."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from importlib import resources

RESOURCE = "nvidia.com/GA100_A100SXM464GB"
VARIABLE = "PCI_RESOURCE_NVIDIA_COM_GA100_A100SXM464GB"


def kubevirt_sized_domain() -> bytes:
    """The seed domain grown to a busy VM's size: 16 more disks and 8 more interfaces (about 10 KiB)."""
    text = resources.files("xmlgen").joinpath("examples", "seed-node01", "domain.xml").read_text()
    disk = text[text.index("\t\t<disk ") : text.index("</disk>") + len("</disk>\n")]
    interface = text[text.index("\t\t<interface ") : text.index("</interface>") + len("</interface>\n")]
    extra = "".join(
        disk.replace("ua-containerdisk", f"ua-data{i}").replace('dev="vda"', f'dev="vd{chr(ord("c") + i)}"')
        for i in range(16)
    )
    extra += "".join(interface.replace("ua-default", f"ua-net{i}").replace("tap0", f"tap{i + 1}") for i in range(8))
    return text.replace("\t</devices>", extra + "\t</devices>").encode()


def sixteen_addresses() -> list[str]:
    return [f"0000:{bus:02x}:00.0" for bus in range(0x10, 0x90, 8)]


def kubevirt_rendered_domain() -> bytes:
    """``kubevirt_sized_domain`` with the 16 GPUs as virt-launcher renders them itself (alias
    ``ua-gpu-gpuN``, ``type="pci"`` on the source address, Go's attribute order): the hook merges with these."""
    hostdevs = "".join(
        '\t\t<hostdev type="pci" managed="no">\n\t\t\t<source>\n\t\t\t\t<address type="pci" '
        f'domain="0x0000" bus="0x{address[5:7]}" slot="0x00" function="0x0"></address>\n\t\t\t</source>\n'
        f'\t\t\t<alias name="ua-gpu-gpu{index}"></alias>\n\t\t</hostdev>\n'
        for index, address in enumerate(sixteen_addresses())
    )
    return kubevirt_sized_domain().replace(b"\t</devices>", hostdevs.encode() + b"\t</devices>")


def sixteen_gpus() -> tuple[bytes, dict[str, str]]:
    """A VMI asking for 16 GPUs of one resource, and the allocation env the device plugin would give."""
    addresses = sixteen_addresses()
    gpus = [{"name": f"gpu{i}", "deviceName": RESOURCE} for i in range(16)]
    vmi = {"metadata": {"name": "big", "namespace": "ml"}, "spec": {"domain": {"devices": {"gpus": gpus}}}}
    return json.dumps(vmi).encode(), {VARIABLE: ",".join(addresses)}


def median_seconds(action: Callable[[], object], rounds: int) -> float:
    """The median wall time of ``rounds`` calls of ``action``."""
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


# ---- the hook sidecar's paths at any size (bench/hook_sidecar.py) ----------------------------------------

CARD_RESOURCE = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"
CARD_VARIABLE = "PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"
CARD_COMPANIONS_VARIABLE = "PCI_COMPANIONS_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A"


def gpu_addresses(count: int) -> list[str]:
    """``count`` GPUs, function 0 of their own bus each (at most 200)."""
    return [f"0000:{bus:02x}:00.0" for bus in range(0x10, 0x10 + count)]


def gpu_vmi(count: int, *, dra: bool = False) -> bytes:
    """A VMI asking for ``count`` GPUs of :data:`CARD_RESOURCE` (``dra``: each from its own ResourceClaim)."""
    if dra:
        gpus: list[dict[str, str]] = [
            {"name": f"gpu{i}", "claimName": f"c{i}", "requestName": "gpu"} for i in range(count)
        ]
        claims = [{"name": f"c{i}", "resourceClaimName": f"claim{i}"} for i in range(count)]
        spec: dict[str, object] = {"resourceClaims": claims, "domain": {"devices": {"gpus": gpus}}}
    else:
        gpus = [{"name": f"gpu{i}", "deviceName": CARD_RESOURCE} for i in range(count)]
        spec = {"domain": {"devices": {"gpus": gpus}}}
    return json.dumps({"metadata": {"name": "big", "namespace": "ml"}, "spec": spec}).encode()


def rendered_domain(addresses: list[str], alias_prefix: str = "ua-gpu-gpu") -> bytes:
    """``kubevirt_sized_domain`` with the GPUs at ``addresses`` as virt-launcher renders them."""
    hostdevs = "".join(
        '\t\t<hostdev type="pci" managed="no">\n\t\t\t<source>\n\t\t\t\t<address type="pci" '
        f'domain="0x0000" bus="0x{address[5:7]}" slot="0x00" function="0x0"></address>\n\t\t\t</source>\n'
        f'\t\t\t<alias name="{alias_prefix}{index}"></alias>\n\t\t</hostdev>\n'
        for index, address in enumerate(addresses)
    )
    return kubevirt_sized_domain().replace(b"\t</devices>", hostdevs.encode() + b"\t</devices>")


def efi_domain() -> bytes:
    """``kubevirt_sized_domain`` booting OVMF, as KubeVirt writes an EFI guest's ``<os>``."""
    loader = (
        b'\t\t<loader readonly="yes" secure="no" type="pflash">/usr/share/OVMF/OVMF_CODE.fd</loader>\n'
        b"\t\t<nvram>/var/run/kubevirt-private/libvirt/qemu/nvram/big_VARS.fd</nvram>\n\t</os>"
    )
    return kubevirt_sized_domain().replace(b"\t</os>", loader, 1)


def companions_value(addresses: list[str]) -> str:
    """The plugin's companion variable for TU106 cards at ``addresses`` (audio, USB, UCSI: functions 1-3)."""
    return ",".join(f"{a}={'+'.join(a[:-1] + str(f) for f in (1, 2, 3))}" for a in addresses)
