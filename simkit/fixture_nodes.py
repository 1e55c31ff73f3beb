"""Three example nodes for :mod:`simkit.sysfs_fixture`: what tests, the benchmark and ``xmlgen simulate`` run on.

- :data:`NODE01`: node01 of the seed write-up (``000_5ea2f63f8723ccb0``): four TU106 RTX 2060 Rev. A cards,
  each a VGA ``1f08`` + audio ``10f9`` + USB ``1ada`` + UCSI ``1adb`` in one IOMMU group, all on vfio-pci
  (two per socket; ``0000:86:00.0`` and ``0000:af:00.0`` as in the seed), plus an X710 NIC and a Tesla T4
  left on the ``nvidia`` driver.
- :data:`VGPU_NODE`: two Tesla T4 on ``nvidia`` with vGPU mdevs: two ``GRID T4-1Q`` and one ``GRID T4-2Q``.
- :data:`MIXED_NODE`: two A10, a GPU whose ID (``10de:2fff``) pci.ids lacks, and an RTX 3090 whose audio
  function is still on ``snd_hda_intel`` (a group that is not viable).
- :data:`SRIOV_VGPU_NODE`: two L40S (``10de:26b9``) on ``nvidia`` split into SR-IOV vGPU VFs (vGPU 17+): two
  ``NVIDIA L40S-1Q`` on the first, one ``NVIDIA L40S-1B`` on the second, the other VFs free.
- :data:`A100_NODE`: two A100 80GB PCIe (``10de:20b5``) on vfio-pci, each with its 128 GiB BAR1: the large-BAR
  case (docs/large-bar.md).

The GPUs' BARs (the ``resource`` files) have the sizes public ``lspci`` listings show (docs/large-bar.md, "BAR
sizes"): TU106 16 MiB + 256 MiB + 32 MiB + 128 B of I/O; A100 80GB 16 MiB + 128 GiB + 32 MiB; L40S 16 MiB +
64 GiB + 32 MiB. Other functions have none.

Each node carries :data:`PCI_IDS_EXCERPT`, real lines of pci.ids 2023.04.10 for its devices; the builder
writes it to ``usr/share/misc/pci.ids`` of the tree, where discovery looks first. Topology follows a
two-socket Xeon Scalable: a root port per PCIe stack (``0000:85:00.0``), the card right below it.
"""

from __future__ import annotations

from simkit.sysfs_fixture import (
    BAR_IO,
    BAR_MEM32,
    BAR_MEM64,
    BAR_MEM64_PREFETCH,
    BarSpec,
    Function,
    Mdev,
    MdevType,
    Node,
    SriovVgpuGpu,
    sriov_vfs,
)

NVIDIA = 0x10DE
INTEL = 0x8086

CLASS_VGA = 0x030000
CLASS_3D = 0x030200
CLASS_AUDIO = 0x040300
CLASS_USB_XHCI = 0x0C0330
CLASS_SERIAL_BUS = 0x0C8000
CLASS_ETHERNET = 0x020000
CLASS_PCI_BRIDGE = 0x060400

PCI_IDS_EXCERPT = """\
#
#\tList of PCI ID's
#
#\tVersion: 2023.04.10
#\tExcerpt for the test nodes: real lines, most devices and all subsystems left out.
#
8086  Intel Corporation
\t1572  Ethernet Controller X710 for 10GbE SFP+
\t2030  Sky Lake-E PCI Express Root Port A
10de  NVIDIA Corporation
\t10f9  TU106 High Definition Audio Controller
\t1ada  TU106 USB 3.1 Host Controller
\t1adb  TU106 USB Type-C UCSI Controller
\t1aef  GA102 High Definition Audio Controller
\t1eb8  TU104GL [Tesla T4]
\t1f08  TU106 [GeForce RTX 2060 Rev. A]
\t20b5  GA100 [A100 PCIe 80GB]
\t2204  GA102 [GeForce RTX 3090]
\t2236  GA102GL [A10]
"""

# Each PCIe stack: (root bus, numa node, root port group). The card sits on bus root+1.
_STACKS = {0x17: (0, 18), 0x3A: (0, 28), 0x5D: (0, 48), 0x85: (1, 72), 0xAE: (1, 94), 0xD7: (1, 116)}


def root_port(root_bus: int) -> Function:
    numa, group = _STACKS[root_bus]
    return Function(
        f"0000:{root_bus:02x}:00.0", INTEL, 0x2030, CLASS_PCI_BRIDGE, "pcieport", group, numa, revision=0x04
    )


MIB = 1 << 20
GIB = 1 << 30
TU106_BARS = (
    BarSpec(0, 16 * MIB, BAR_MEM32),
    BarSpec(1, 256 * MIB, BAR_MEM64_PREFETCH),
    BarSpec(3, 32 * MIB, BAR_MEM64_PREFETCH),
    BarSpec(5, 128, BAR_IO),
)
"""The RTX 2060's display function: registers, the 256 MiB VRAM aperture, a 32 MiB one, an I/O range."""
A100_80GB_BARS = (
    BarSpec(0, 16 * MIB, BAR_MEM32),
    BarSpec(1, 128 * GIB, BAR_MEM64_PREFETCH),
    BarSpec(3, 32 * MIB, BAR_MEM64_PREFETCH),
)
"""GA100 with 80 GB: BAR1 maps the whole memory (128 GiB, the next power of two)."""
L40S_BARS = (
    BarSpec(0, 16 * MIB, BAR_MEM32),
    BarSpec(1, 64 * GIB, BAR_MEM64_PREFETCH),
    BarSpec(3, 32 * MIB, BAR_MEM64_PREFETCH),
)
A100_80GB_PCIE = 0x20B5


def _below(
    root_bus: int,
    function: int,
    vendor: int,
    device: int,
    pci_class: int,
    driver: str | None,
    bars: tuple[BarSpec, ...] = (),
) -> Function:
    numa, group = _STACKS[root_bus]
    return Function(
        f"0000:{root_bus + 1:02x}:00.{function}",
        vendor,
        device,
        pci_class,
        driver,
        group + 2,
        numa,
        parent=f"0000:{root_bus:02x}:00.0",
        bars=bars,
    )


def tu106_card(root_bus: int, driver: str = "vfio-pci", audio_driver: str | None = None) -> tuple[Function, ...]:
    """An RTX 2060 Rev. A: four functions, one IOMMU group, below the root port on ``root_bus``."""
    return (
        root_port(root_bus),
        _below(root_bus, 0, NVIDIA, 0x1F08, CLASS_VGA, driver, TU106_BARS),
        _below(root_bus, 1, NVIDIA, 0x10F9, CLASS_AUDIO, audio_driver or driver),
        _below(root_bus, 2, NVIDIA, 0x1ADA, CLASS_USB_XHCI, driver),
        _below(root_bus, 3, NVIDIA, 0x1ADB, CLASS_SERIAL_BUS, driver),
    )


NODE01 = Node(
    name="node01",
    functions=(
        root_port(0x17),
        _below(0x17, 0, INTEL, 0x1572, CLASS_ETHERNET, "i40e"),
        Function("0000:18:00.1", INTEL, 0x1572, CLASS_ETHERNET, "i40e", 21, 0, parent="0000:17:00.0"),
        *tu106_card(0x3A),
        *tu106_card(0x5D),
        *tu106_card(0x85),
        *tu106_card(0xAE),
        root_port(0xD7),
        _below(0xD7, 0, NVIDIA, 0x1EB8, CLASS_3D, "nvidia"),
    ),
    pci_ids=PCI_IDS_EXCERPT,
)
"""The seed's node01: ``nvidia.com/TU106_GEFORCE_RTX_2060_REV__A`` x4; the T4 on ``nvidia`` is not offered."""

T4_1Q_A = "4b20d080-1b54-4048-85b3-a6a62d165c01"
T4_1Q_B = "6c2c2f1e-9d57-4f4a-8a0b-3f5e0b8f2a11"
T4_2Q = "a297db4a-f4c2-11e6-90f6-d3b88d6c9525"

_T4_TYPES = (("nvidia-222", "GRID T4-1B"), ("nvidia-230", "GRID T4-1Q"), ("nvidia-231", "GRID T4-2Q"))

VGPU_NODE = Node(
    name="gpu-vgpu01",
    functions=(
        root_port(0x3A),
        _below(0x3A, 0, NVIDIA, 0x1EB8, CLASS_3D, "nvidia"),
        root_port(0xD7),
        _below(0xD7, 0, NVIDIA, 0x1EB8, CLASS_3D, "nvidia"),
    ),
    mdev_types=tuple(
        MdevType(parent, type_id, name, available_instances=0 if type_id != "nvidia-222" else 16)
        for parent in ("0000:3b:00.0", "0000:d8:00.0")
        for type_id, name in _T4_TYPES
    ),
    mdevs=(
        Mdev(T4_1Q_A, "0000:3b:00.0", "nvidia-230", 140),
        Mdev(T4_1Q_B, "0000:3b:00.0", "nvidia-230", 141),
        Mdev(T4_2Q, "0000:d8:00.0", "nvidia-231", 142),
    ),
    pci_ids=PCI_IDS_EXCERPT,
)
"""vGPU: ``nvidia.com/GRID_T4-1Q`` x2 on the first T4, ``nvidia.com/GRID_T4-2Q`` x1 on the second."""

MIXED_NODE = Node(
    name="gpu-mixed01",
    functions=(
        root_port(0x3A),
        _below(0x3A, 0, NVIDIA, 0x2236, CLASS_3D, "vfio-pci"),
        root_port(0xD7),
        _below(0xD7, 0, NVIDIA, 0x2236, CLASS_3D, "vfio-pci"),
        root_port(0x5D),
        Function("0000:5e:00.0", NVIDIA, 0x2FFF, CLASS_3D, "vfio-pci", 50, -1, parent="0000:5d:00.0"),
        root_port(0x85),
        _below(0x85, 0, NVIDIA, 0x2204, CLASS_VGA, "vfio-pci"),
        _below(0x85, 1, NVIDIA, 0x1AEF, CLASS_AUDIO, "snd_hda_intel"),
    ),
    pci_ids=PCI_IDS_EXCERPT,
)
"""Mixed: ``GA102GL_A10`` x2 healthy; ``nvidia.com/2fff`` (not in pci.ids, NUMA unknown); the RTX 3090 at
``0000:86:00.0`` unhealthy because ``0000:86:00.1`` is on ``snd_hda_intel``."""

L40S = 0x26B9
L40S_1B = (1145, "NVIDIA L40S-1B")
L40S_1Q = (1147, "NVIDIA L40S-1Q")
"""Two vGPU types as an L40S host with vGPU Manager 580 lists them (docs/node.md, "SR-IOV vGPUs")."""
L40S_TOTAL_VFS = 32
L40S_FIXTURE_VFS = 4
"""VFs enabled per L40S here (``sriov_numvfs``; NVIDIA's ``sriov-manage -e`` enables all 32): enough for the
cases, small enough for fast trees."""


def l40s_sriov(root_bus: int) -> tuple[Function, ...]:
    """An L40S on ``nvidia`` below the root port on ``root_bus``, and its first VFs (``…:00.4`` on)."""
    _, group = _STACKS[root_bus]
    pf = _below(root_bus, 0, NVIDIA, L40S, CLASS_3D, "nvidia", L40S_BARS)
    return (root_port(root_bus), pf, *sriov_vfs(pf, L40S_FIXTURE_VFS, group + 3))


_L40S_A = l40s_sriov(0x3A)
_L40S_B = l40s_sriov(0xD7)

SRIOV_VGPU_NODE = Node(
    name="gpu-sriov-vgpu01",
    functions=(*_L40S_A, *_L40S_B),
    sriov_vgpus=(
        # Time-sliced vGPUs of one GPU share a type unless heterogeneous mode is on: with 1Q created, the free
        # VFs of the first GPU list only 1Q, those of the second only 1B.
        SriovVgpuGpu(
            _L40S_A[1].address,
            tuple(vf.address for vf in _L40S_A[2:]),
            L40S_TOTAL_VFS,
            types=(L40S_1Q,),
            current=(L40S_1Q[0], L40S_1Q[0]),
        ),
        SriovVgpuGpu(
            _L40S_B[1].address,
            tuple(vf.address for vf in _L40S_B[2:]),
            L40S_TOTAL_VFS,
            types=(L40S_1B,),
            current=(L40S_1B[0],),
        ),
    ),
    pci_ids=PCI_IDS_EXCERPT,
)
"""SR-IOV vGPUs: ``nvidia.com/NVIDIA_L40S-1Q`` x2 (``0000:3b:00.4``, ``0000:3b:00.5``) and
``nvidia.com/NVIDIA_L40S-1B`` x1 (``0000:d8:00.4``); the PFs and free VFs are not offered."""

A100_NODE = Node(
    name="gpu-a100-01",
    functions=(
        root_port(0x3A),
        _below(0x3A, 0, NVIDIA, A100_80GB_PCIE, CLASS_3D, "vfio-pci", A100_80GB_BARS),
        root_port(0xD7),
        _below(0xD7, 0, NVIDIA, A100_80GB_PCIE, CLASS_3D, "vfio-pci", A100_80GB_BARS),
    ),
    pci_ids=PCI_IDS_EXCERPT,
)
"""Large BARs: ``nvidia.com/GA100_A100_PCIE_80GB`` x2 (``0000:3b:00.0`` on NUMA 0, ``0000:d8:00.0`` on NUMA 1)."""

NODES = {node.name: node for node in (NODE01, VGPU_NODE, MIXED_NODE, SRIOV_VGPU_NODE, A100_NODE)}

PLX = 0x10B5
PEX_8747 = 0x8747
RTX_A6000 = 0x2230
A6000_AUDIO = 0x1AEF


def _switched_card(port: str, bus: int, group: int) -> tuple[Function, ...]:
    """An RTX A6000 (display and HDMI audio, one IOMMU group) on bus ``bus`` below the switch port ``port``."""
    return (
        Function(
            f"0000:{bus:02x}:00.0", NVIDIA, RTX_A6000, CLASS_VGA, "vfio-pci", group, 0, parent=port, bars=TU106_BARS
        ),
        Function(f"0000:{bus:02x}:00.1", NVIDIA, A6000_AUDIO, CLASS_AUDIO, "vfio-pci", group, 0, parent=port),
    )


WORKSTATION_NODE = Node(
    name="gpu-ws01",
    functions=(
        Function("0000:00:01.0", INTEL, 0x1901, CLASS_PCI_BRIDGE, "pcieport", 1, 0, revision=0x07),
        # A PEX 8747 switch: its upstream port below the root port, two downstream ports, a card below each
        # (ACS on the downstream ports gives each card an IOMMU group of its own).
        Function("0000:01:00.0", PLX, PEX_8747, CLASS_PCI_BRIDGE, "pcieport", 2, 0, parent="0000:00:01.0"),
        Function("0000:02:08.0", PLX, PEX_8747, CLASS_PCI_BRIDGE, "pcieport", 3, 0, parent="0000:01:00.0"),
        Function("0000:02:10.0", PLX, PEX_8747, CLASS_PCI_BRIDGE, "pcieport", 4, 0, parent="0000:01:00.0"),
        *_switched_card("0000:02:08.0", 0x03, 5),
        *_switched_card("0000:02:10.0", 0x04, 6),
        # A third card on a root port of its own: no switch between it and the root complex.
        Function("0000:00:03.0", INTEL, 0x1905, CLASS_PCI_BRIDGE, "pcieport", 7, 0, revision=0x07),
        *_switched_card("0000:00:03.0", 0x05, 8),
    ),
    pci_ids=PCI_IDS_EXCERPT,
)
"""A PCIe workstation: RTX A6000s at ``0000:03:00.0`` and ``0000:04:00.0`` below one PEX 8747 switch (one
GPUDirect clique, docs/p2p.md), a third at ``0000:05:00.0`` on its own root port. Not in :data:`NODES`."""

BROADCOM = 0x1000
PEX_890XX = 0xC030
MELLANOX = 0x15B3
CONNECTX_7 = 0x1021
H100_SXM5_80GB = 0x2330
H100_NVSWITCH = 0x22A3
CLASS_INFINIBAND = 0x020700
CLASS_NVSWITCH = 0x068000
H100_SXM5_BARS = A100_80GB_BARS
"""GH100 with 80 GB: 16 MiB of registers, BAR1 over the whole memory (128 GiB), 32 MiB."""
NVSWITCH_BARS = (BarSpec(0, 32 * MIB, BAR_MEM64),)
"""An NVSwitch's one BAR as a public ``lspci -v`` of an HGX H100 shows it: 32 MiB, 64-bit, not prefetchable."""
PMC_SIERRA = 0x11F8
SWITCHTEC_PFX = 0x4128
"""The baseboard's management switch the NVSwitches sit behind (a Microchip Switchtec; pci.ids 2023.04.10 has the
vendor and not this device)."""

HGX_PCI_IDS = (
    PCI_IDS_EXCERPT
    + """\
\t2330  GH100[H100 SXM5 80GB]
1000  Broadcom / LSI
\tc030  PEX890xx PCIe Gen 5 Switch
15b3  Mellanox Technologies
\t1021  MT2910 Family [ConnectX-7]
"""
)
"""The excerpt with the HGX board's lines of pci.ids 2023.04.10, which has no line for the NVSwitch ``22a3``."""


def _pcie_switch(
    root_port_address: str,
    bus: int,
    numa: int,
    group: int,
    below: tuple[tuple[int, str | None, int, int, int], ...],
    switch: tuple[int, int] = (BROADCOM, PEX_890XX),
) -> tuple[Function, ...]:
    """A PCIe switch of an HGX board (``switch``: its vendor and device, a Gen 5 PEX890xx unless told): its root
    port, its upstream port on ``bus``, a downstream port per entry of ``below`` on ``bus + 1`` and each entry's
    function ``(bus, driver, vendor, device, class)`` behind it, every function in an IOMMU group of its own (ACS
    on the downstream ports)."""
    upstream = f"0000:{bus:02x}:00.0"
    functions = [
        Function(root_port_address, INTEL, 0x2030, CLASS_PCI_BRIDGE, "pcieport", group, numa, revision=0x04),
        Function(upstream, *switch, CLASS_PCI_BRIDGE, "pcieport", group + 1, numa, parent=root_port_address),
    ]
    for index, (device_bus, driver, vendor, device, pci_class) in enumerate(below):
        port = f"0000:{bus + 1:02x}:{index:02x}.0"
        functions.append(
            Function(port, *switch, CLASS_PCI_BRIDGE, "pcieport", group + 2 + 2 * index, numa, parent=upstream)
        )
        bars = H100_SXM5_BARS if device == H100_SXM5_80GB else NVSWITCH_BARS if device == H100_NVSWITCH else ()
        functions.append(
            Function(
                f"0000:{device_bus:02x}:00.0",
                vendor,
                device,
                pci_class,
                driver,
                group + 3 + 2 * index,
                numa,
                parent=port,
                bars=bars,
            )
        )
    return tuple(functions)


def hgx_h100_node(switch_driver: str | None = "vfio-pci", name: str = "gpu-hgx01") -> Node:
    """An HGX H100 8-GPU board in a two-socket server, as public listings of such servers show it (docs/nvswitch.md):

    - four Gen 5 PCIe switches (PEX890xx), two per socket, each with two H100 SXM5 GPUs and a ConnectX-7 NIC
      (the GPUDirect RDMA pairing): GPUs ``0000:13``, ``14`` and ``33``, ``34`` on NUMA 0, ``93``, ``94`` and
      ``b3``, ``b4`` on NUMA 1 (``…:00.0``), NICs ``0000:15``, ``35``, ``95``, ``b5``;
    - the four NVSwitches (``10de:22a3``, class ``0x0680``) at ``0000:07:00.0`` to ``0000:0a:00.0``, behind the
      baseboard's management switch (a Switchtec, ``11f8:4128``) on a root port of NUMA 0, on ``switch_driver``
      (``vfio-pci``: full passthrough; ``nvidia``: the host's Fabric Manager drives them, the shared NVSwitch
      model).
    """
    gpu = ("vfio-pci", NVIDIA, H100_SXM5_80GB, CLASS_3D)
    nic = ("mlx5_core", MELLANOX, CONNECTX_7, CLASS_INFINIBAND)
    nvswitch = (switch_driver, NVIDIA, H100_NVSWITCH, CLASS_NVSWITCH)
    functions = (
        *_pcie_switch(
            "0000:04:01.0",
            0x05,
            0,
            10,
            tuple((bus, *nvswitch) for bus in (0x07, 0x08, 0x09, 0x0A)),
            (PMC_SIERRA, SWITCHTEC_PFX),
        ),
        *_pcie_switch("0000:10:01.0", 0x11, 0, 30, ((0x13, *gpu), (0x14, *gpu), (0x15, *nic))),
        *_pcie_switch("0000:30:01.0", 0x31, 0, 50, ((0x33, *gpu), (0x34, *gpu), (0x35, *nic))),
        *_pcie_switch("0000:90:01.0", 0x91, 1, 70, ((0x93, *gpu), (0x94, *gpu), (0x95, *nic))),
        *_pcie_switch("0000:b0:01.0", 0xB1, 1, 90, ((0xB3, *gpu), (0xB4, *gpu), (0xB5, *nic))),
    )
    return Node(name=name, functions=functions, pci_ids=HGX_PCI_IDS)


HGX_H100_NODE = hgx_h100_node()
"""HGX H100, full passthrough: ``nvidia.com/GH100_H100_SXM5_80GB`` x8, the four NVSwitches on vfio-pci carried
by an allocation of all eight (docs/nvswitch.md). Not in :data:`NODES`."""
HGX_H100_GPUS = tuple(f"0000:{bus:02x}:00.0" for bus in (0x13, 0x14, 0x33, 0x34, 0x93, 0x94, 0xB3, 0xB4))
HGX_H100_NVSWITCHES = tuple(f"0000:{bus:02x}:00.0" for bus in (0x07, 0x08, 0x09, 0x0A))
