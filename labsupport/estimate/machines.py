"""Node presets for communication costs: how many devices share a node, how fast they talk inside
it and across the network, how fast they compute, how much memory each has.

A ring collective is as fast as the slowest link it crosses. A group that fits in one node talks
over the node's own links (NVLink, Infinity Fabric); a larger group fills whole nodes (labsupport's
Mesh gives a group consecutive ranks), its ring leaves the node, and every step waits for the
network. `link(machine, group_size)` picks one or the other, as (alpha, GB/s), for
`comm_cost.collective_time(..., alpha, 1 / (gbps * 1e9))`.

Bandwidths are GB/s (10^9 bytes per second) per device and per direction. Between nodes the
figure is a pessimistic bound: each device's share of its node's network links when every
device of the node sends across at once, node injection bandwidth / devices per node. A ring
over two nodes leaves each node only at its boundary hops, and NCCL and RCCL spread a group's
channels over all of the node's network cards, so such a ring gets more per hop than this: the
bandwidth terms priced with it are upper bounds. The same kind of bound for every machine.

Alphas (the latency of one message) are order-of-magnitude assumptions, not datasheet numbers:
about 5 us inside a node and 10 us across the network. Fit your own to measured times with
`comm_cost.fit_alpha_beta` (`labsupport bench collectives` does).
"""
from __future__ import annotations

from dataclasses import dataclass

from .devices import A100_80GB, H100_SXM, MI250X_GCD, Device

INTRA_ALPHA_S = 5e-6   # assumption: one message between devices of a node, order of magnitude
INTER_ALPHA_S = 10e-6  # assumption: one message across the network between nodes


@dataclass(frozen=True)
class Machine:
    """One kind of node: devices per node, (alpha in s, GB/s per direction) inside a node and
    between nodes, and its device's constants (`devices.Device`'s fields: peak, memory, measured rates)."""

    name: str
    devices_per_node: int
    intra_alpha_s: float
    intra_gbps: float
    inter_alpha_s: float
    inter_gbps: float
    peak_tflops_bf16: float
    memory_gb: float
    hbm_gbps: float
    compute_units: int
    gemm_efficiency: float
    attention_efficiency: float

    @property
    def device(self) -> Device:
        """The device's constants, for step_time.py."""
        return Device(*(getattr(self, name) for name in Device._fields))


# OLCF Frontier User Guide, "System Overview": "Frontier Compute Nodes" and "System Interconnect".
# A node has 4 MI250X of 2 GCDs each, 8 GCDs that software sees as 8 GPUs with 64 GB of HBM2E each.
# Inside a node: GCDs of different MI250X are joined by Infinity Fabric at 50-100 GB/s, depending
# on how many links join the pair. We take 50, one link: a ring through all 8 GCDs crosses
# single-link hops. 50 GB/s is per direction: AMD ROCm documentation, "AMD Instinct MI250
# microarchitecture": a 16-wide Infinity Fabric link at 25 GT/s moves 2 bytes per transfer.
# Between nodes: 4 HPE Slingshot-11 NICs of 200 Gb/s = 25 GB/s per direction, node injection
# 100 GB/s. The workshop decks' "25+25 GB/s" is one NIC, 25 each way; there is one NIC per MI250X,
# so its 2 GCDs share it: 12.5 GB/s per GCD when all 8 send at once. That is the bound of the
# docstring, not what a TP ring over two nodes gets per hop (its inner hops stay on Infinity
# Fabric, and RCCL spreads its channels over the 4 NICs). The DGX figures below are one NIC per
# GPU, so all three are the same kind of bound.
FRONTIER = Machine("Frontier (MI250X GCD)", devices_per_node=8,
                   intra_alpha_s=INTRA_ALPHA_S, intra_gbps=50,
                   inter_alpha_s=INTER_ALPHA_S, inter_gbps=4 * 25 / 8, **MI250X_GCD._asdict())

# NVIDIA DGX H100 User Guide, "Introduction to the NVIDIA DGX H100 System", hardware overview, and
# the NVIDIA H100 Tensor Core GPU datasheet (SXM): 8 H100 of 80 GB; fourth-generation NVLink
# through NVSwitch, 900 GB/s per GPU counting both directions = 450 per direction; 8 ConnectX-7
# at 400 Gb/s, one per GPU = 50 GB/s per GPU per direction.
DGX_H100 = Machine("DGX H100", devices_per_node=8,
                   intra_alpha_s=INTRA_ALPHA_S, intra_gbps=900 / 2,
                   inter_alpha_s=INTER_ALPHA_S, inter_gbps=400 / 8, **H100_SXM._asdict())

# NVIDIA DGX A100 User Guide, "Introduction to the NVIDIA DGX A100 System", hardware overview, and
# the NVIDIA A100 Tensor Core GPU datasheet (SXM, 80 GB): 8 A100 of 80 GB; third-generation NVLink
# through NVSwitch, 600 GB/s per GPU counting both directions = 300 per direction; 8 ConnectX-6
# HDR InfiniBand at 200 Gb/s, one per GPU = 25 GB/s per GPU per direction.
DGX_A100 = Machine("DGX A100", devices_per_node=8,
                   intra_alpha_s=INTRA_ALPHA_S, intra_gbps=600 / 2,
                   inter_alpha_s=INTER_ALPHA_S, inter_gbps=200 / 8, **A100_80GB._asdict())

# A cluster of published runs only (estimate/published.py), not one of the presets above:
# BigScience's BLOOM-176B ran on Jean Zay's A100 80GB nodes (bigscience-workshop/bigscience,
# train/tr11-176B-ml/README.md, "Hardware"): 8 GPUs joined by NVLink, "4 OmniPath links" per node.
# Jean Zay's Omni-Path runs at 100 Gb/s a link (LMI MAG no. 2, March 2020, p. 27, said of the machine
# before its A100 extension, so an inference for these nodes): 4 x 12.5 GB/s for 8 GPUs, 6.25 each.
JEAN_ZAY_A100 = Machine("Jean Zay (A100 80GB)", devices_per_node=8,
                        intra_alpha_s=INTRA_ALPHA_S, intra_gbps=600 / 2,
                        inter_alpha_s=INTER_ALPHA_S, inter_gbps=4 * 100 / 8 / 8, **A100_80GB._asdict())

MACHINES: dict[str, Machine] = {m.name: m for m in (FRONTIER, DGX_H100, DGX_A100)}


def link(machine: Machine | str, group_size: int) -> tuple[float, float]:
    """(alpha in s, GB/s per direction) of the slowest link a ring of `group_size` devices crosses:
    the node's own links when the group fits in one node, else the network between nodes (its
    pessimistic bound, every device of the node sending across at once)."""
    if isinstance(machine, str):
        if machine not in MACHINES:
            raise ValueError(f"unknown machine {machine!r}; choose one of: {', '.join(MACHINES)}")
        machine = MACHINES[machine]
    if group_size < 1 or int(group_size) != group_size:
        raise ValueError(f"group_size must be a whole number of devices >= 1, got {group_size!r}")
    if group_size <= machine.devices_per_node:
        return machine.intra_alpha_s, machine.intra_gbps
    return machine.inter_alpha_s, machine.inter_gbps
