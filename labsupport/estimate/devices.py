"""What the step-time model (step_time.py) knows of each accelerator: one set of constants per device,
the same for every run on it, each from a datasheet or a cited measurement, or an assumption where none
was found (H100's and the MI250X's memory bandwidth, the MI250X's attention rate: said below).

`machines.py` holds the nodes (how devices talk); this file holds how fast one device computes and
moves its memory. Peaks are `flops.PEAK_TFLOPS`' dense 16-bit figures.
"""
from __future__ import annotations

from typing import NamedTuple

from .flops import PEAK_TFLOPS


class Device(NamedTuple):
    """peak_tflops_bf16: dense 16-bit matrix peak (no sparsity); memory_gb: HBM, 10^9 bytes; hbm_gbps: measured
    memory bandwidth (a STREAM-like triad), GB/s; compute_units: streaming multiprocessors or compute units,
    over which a matmul's output tiles are spread; gemm_efficiency: the best measured 16-bit matmul rate
    over peak; attention_efficiency: FlashAttention-2's asymptotic forward + backward rate (causal, head
    size 128) over peak (`step_time.flash_attention_s`)."""

    peak_tflops_bf16: float
    memory_gb: float
    hbm_gbps: float
    compute_units: int
    gemm_efficiency: float
    attention_efficiency: float


# Matmul rates: S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, "Maximum Achievable
# Matmul FLOPS" (mamf-finder.py: torch.mm over a sweep of shapes): A100 SXM 271.2 TFLOP/s of 312 (bf16 table,
# commit 744d01e), H100 SXM 794.5 of 989, one MI250X GCD 147.0 of 191.5 (ROCm 6.2; in the table until
# commit e695968, from its first version, which did not flush the cache between iterations as the second does). Memory bandwidth: BabelStream's triad, A100 SXM 80GB 1,724.8 GB/s of the datasheet's
# 2,039 (0.846), A100 SXM 40GB 1,377.5 of 1,555 (0.886, ALCF Polaris). No measurement of H100 SXM's or an
# MI250X GCD's was found: 0.85 of their datasheets' 3,350 and 1,638.4 GB/s (half of the module's 3,276.8),
# an assumption between the two A100 figures. Attention: FlashAttention-2 (Dao 2023, Fig. 4 and Fig. 8)
# forward + backward, causal, head size 128, fit to rate x k / (k + FLASH_HALF_KEYS): 195 TFLOP/s on A100,
# 340 on H100 (FlashAttention-2 as it is, without Hopper's instructions). No such figure was found for
# MI250X: its value assumes A100's ratio of attention rate to matmul rate (195 / 271.2), an assumption.
# Compute units: A100 108 SMs and H100 SXM 132 (NVIDIA's Ampere and Hopper architecture whitepapers); an
# MI250X GCD 110 CUs (AMD's CDNA2 whitepaper: 220 per MI250X).
A100_80GB = Device(PEAK_TFLOPS["A100"][1], 80, 1724.8, 108, 271.2 / 312, 195 / 312)
A100_40GB = A100_80GB._replace(memory_gb=40, hbm_gbps=1377.5)
H100_SXM = Device(PEAK_TFLOPS["H100"][1], 80, 0.85 * 3350, 132, 794.5 / 989, 340 / 989)
MI250X_GCD = Device(PEAK_TFLOPS["MI250X"][1], 64, 0.85 * 1638.4, 110, 147.0 / 191.5, 147.0 / 191.5 * 195 / 271.2)
# The names `labsupport plan --device` takes.
DEVICES: dict[str, Device] = {"a100-80gb": A100_80GB, "a100-40gb": A100_40GB, "h100-sxm": H100_SXM,
                              "mi250x-gcd": MI250X_GCD}
