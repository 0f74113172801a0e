"""ZeRO-Offload: the optimizer step runs on the host, so its states leave the device.

Ren et al. 2021, "ZeRO-Offload: Democratizing Billion-Scale Model Training". Forward and
backward, O(tokens x parameters) FLOPs, stay on the accelerator with the 16-bit weights; the
update, O(parameters) FLOPs but 12 of the 16 bytes per parameter (fp32 master weights, Adam's
momentum and variance), moves to the host's CPU and memory. Each step the gradients travel to
the host and the updated weights come back over PCIe: 2 Psi + 2 Psi bytes under mixed
precision, the least traffic of any split that leaves the forward and backward on the device
(Sec 3). With data parallelism it builds on ZeRO-2 (Sec 4.2): each rank offloads only its
1/N_d partition, so memory, traffic and CPU work per rank all divide by N_d.

Which bytes move, per recipe of `memory.BYTES_PER_PARAM` (bytes per parameter):

    recipe           device keeps          host holds                          to host  to device
    fp32             weights 4             weights' copy 4 + m, v 8 + grads 4   4        4
    mixed            16-bit weights 2      master 4 + m, v 8 + grads 2          2        2
    megatron-bf16    bf16 weights 2        master 4 + m, v 8 + fp32 grads 4     4        2
    megatron-fp16    fp16 weights 2        master 4 + m, v 8 + fp32 grads' copy 4
                                           + fp16 grads 2                       2        2

In the 16-bit recipes the fp32 master copy is one of the optimizer's bytes and moves with it.
fp32 weights are their own master, so the host keeps a copy of them to update. Gradients stay
on the device only while nothing shards them (ZeRO-0 and ZeRO-1 average them whole, and then
hand this rank's partition over); with ZeRO-2 and 3 each bucket is reduce-scattered and its
partition goes straight to the host (Sec 4.2), so the device holds none between steps (the
bucket in flight is not counted). So the host holds 12 + 2 = 14 bytes per parameter under mixed
precision (Ren et al., Sec 3.3). Offloading the parameters as well, or any state to NVMe
(ZeRO-Infinity, Rajbhandari et al. 2021), is not modelled.
"""
from __future__ import annotations

from .flops import TYPICAL_MFU

# PCIe x16, one direction, GB/s (10^9 bytes): 8, 16 and 32 GT/s per lane, 128b/130b encoding.
# An A100 reaches its host over PCIe 4.0 x16, an H100 over PCIe 5.0 x16 (SXM boards included).
PCIE_GBPS = {"gen3": 15.75, "gen4": 31.5, "gen5": 63.0}
# A Frontier MI250X GCD has no PCIe link to its CPU: Infinity Fabric, 36 GB/s each way (OLCF,
# Frontier User Guide, "Frontier Compute Nodes": "a peak host-to-device (H2D) and device-to-host
# (D2H) bandwidth of 36+36 GB/s").
FRONTIER_GCD_HOST_GBPS = 36.0
# Every host link, by the name the memory widget and notebook 03 use, one direction, GB/s.
HOST_LINK_GBPS = {**{f"PCIe {gen} x16": gbps for gen, gbps in PCIE_GBPS.items()},
                  "Infinity Fabric (Frontier GCD)": FRONTIER_GCD_HOST_GBPS}
DEVICE_HOST_LINK = {"A100 80 GB": "PCIe gen4 x16", "H100 80 GB": "PCIe gen5 x16",
                    "MI250X GCD 64 GB": "Infinity Fabric (Frontier GCD)"}  # each accelerator's link to its CPU


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def offloaded_states(psi: int, per: dict[str, int], dp: int = 1, zero: int = 2) -> dict[str, int]:
    """Bytes of model states with the optimizer on the host, for one of `dp` ranks.

    `psi` parameters on this rank's model-parallel slice, `per` its bytes per parameter
    ({params, grads, optimizer}). Returns the device's `params`, `grads`, `optimizer` (0), the
    host's `host` bytes for this rank, and the PCIe bytes of one step, `pcie_to_host`
    (gradients) and `pcie_to_device` (updated weights). Ren et al. 2021: device memory 2 Psi, one eighth of
    16 Psi (Table 1), and 4 Psi of traffic (Sec 3.3) for one GPU; with ZeRO-2 every rank
    moves its 1/N_d share (Sec 4.2). ZeRO-0 shards nothing: every rank offloads everything.
    """
    shards = dp if zero >= 1 else 1
    master_copy = per["params"] if per["params"] >= 4 else 0  # fp32 weights: the host needs their copy
    return {
        "params": _ceil_div(psi * per["params"], dp if zero >= 3 else 1),
        "grads": 0 if zero >= 2 else psi * per["grads"],
        "optimizer": 0,
        "host": _ceil_div(psi * (per["optimizer"] + master_copy + per["grads"]), shards),
        "pcie_to_host": _ceil_div(psi * per["grads"], shards),
        "pcie_to_device": _ceil_div(psi * per["params"], shards),
    }


def pcie_seconds(n_bytes: int, gbps: float = PCIE_GBPS["gen4"]) -> float:
    """Seconds to move `n_bytes` over a link of `gbps` GB/s (10^9 bytes/s), bandwidth-bound.

    The two directions run at different times of the step (gradients during backward, weights
    after the host's update), so one step's offload traffic costs its sum at one direction's rate.
    """
    if gbps <= 0:
        raise ValueError(f"PCIe bandwidth must be > 0 GB/s, got {gbps}")
    return n_bytes / (gbps * 1e9)


def offload_pays(pcie_bytes: int, step_flops: float, peak_flops: float, mfu: float = TYPICAL_MFU,
                 pcie_gbps: float = PCIE_GBPS["gen4"]) -> dict:
    """Whether a step's offload traffic hides behind its compute: transfer time <= compute time.

    Ren et al. 2021 overlap the gradient transfer with the backward pass (Sec 4.1) and, with
    the one-step delayed parameter update, the host's update and the weights' return with the
    next step (Sec 5.2); either way the step is no slower when the transfer takes no longer
    than the compute. `step_flops` is what this device computes in one step (6 N per token
    and more, `flops.training_flops_per_token`, times its tokens), at `mfu` of `peak_flops`.
    The traffic per step is fixed while the compute grows with the tokens per step, so
    `break_even_tokens_factor` says by how much to multiply the tokens per step (larger
    micro-batches or more gradient accumulation) to hide it; <= 1 means it is hidden already.
    The host's own Adam step (Sec 5.1) is assumed to keep up.
    """
    if min(step_flops, peak_flops, mfu) <= 0:
        raise ValueError("step FLOPs, peak FLOP/s and MFU must all be > 0")
    transfer = pcie_seconds(pcie_bytes, pcie_gbps)
    compute = step_flops / (peak_flops * mfu)
    return {"transfer_s": transfer, "compute_s": compute, "hidden": transfer <= compute,
            "break_even_tokens_factor": transfer / compute}
