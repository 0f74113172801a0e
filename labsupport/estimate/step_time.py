"""The compute time of a training step's parts on one GPU, each from what the GPU does for it.

What is here is the time one GPU computes for one layer and one micro-batch, for the LM head, and for
the optimizer step; a step adds communication and the pipeline bubble to them (the planner's terms).

* **Matmuls** from their shapes (`gemm_s`): a roofline, the slower of the FLOPs at the device's best
  measured matmul rate and the bytes the matmul reads and writes at its memory bandwidth, with the
  FLOPs slowed by wave quantization: cuBLAS cuts the m x n output into tiles, one per streaming
  multiprocessor at a time, so a last, partly filled wave of tiles takes a whole wave's time (NVIDIA,
  "Matrix Multiplication Background User's Guide", Sec. 3.2, "Wave Quantization"). That is the
  efficiency curve for small shapes: a tensor-parallel rank's narrow slice of a small micro-batch
  fills few waves. Each matmul of the forward has two in the backward (the input's and the weight's
  gradients), as many FLOPs each.
* **Elementwise operations** from the bytes they move at the measured memory bandwidth: the norms,
  the fused bias-dropout-residual adds, the MLP's activation, the cross-entropy over the vocabulary,
  and the optimizer's update of every parameter this GPU keeps.
* **Attention** as its kernel computes it. A fused kernel (FlashAttention, Dao 2023) skips the masked
  half of a causal score matrix and runs at its own measured rate, which grows with the key length
  (`flash_attention_s`); unfused, as Megatron-LM ran it until 2022, the scores are two batched
  matmuls over the whole s x s matrix, and the scale, mask, softmax and dropout between them read and
  write it (`unfused_attention_s`).

Every device constant is the same for every run on that device (devices.py, with its sources).
"""
from __future__ import annotations

import math
from typing import NamedTuple

from .devices import Device

TILE = (256, 128)   # cuBLAS' largest common output tile, rows x columns (the guide's Sec. 2.3 lists 256x128 first)
ACTIVATION_BYTES = 2   # 16-bit activations and weights in the matmuls
FLASH_HALF_KEYS = 550  # keys at which FlashAttention-2 runs at half its asymptotic rate (flash_attention_s)
# The mixed-precision optimizer step, bytes per parameter it updates (Megatron-LM's fp16/bf16 optimizer with
# fp32 gradients): unscale the gradient and check it for inf (read and write 4), its norm for clipping
# (read 4), AdamW (read weight, gradient, m, v: 16; write weight, m, v: 12), the 16-bit copy of the weight
# (read 4, write 2), and zeroing the gradient for the next step (write 4).
OPTIMIZER_BYTES_PER_PARAM = 8 + 4 + 28 + 6 + 4


class Framework(NamedTuple):
    """What the training code does that changes the time, not the FLOPs.

    flash_attention: a fused attention kernel (FlashAttention or cuDNN's); else Megatron-LM's unfused one.
    sequence_parallel: the norms and dropouts cut over the TP ranks (Korthikanti et al. 2022, Sec. 4.2.2).
    overlap_dp: gradient reduction runs during the backward (DDP's buckets, FSDP, Megatron-Core's
      --overlap-grad-reduce): the planner exposes only what outlasts the last micro-batch's backward.
    overlap_tp: TP's collectives run during the matmuls (Megatron-Core's --tp-comm-overlap).
    The default is Megatron-LM as Narayanan et al. 2021 ran it at scale: none of them.
    """

    flash_attention: bool = False
    sequence_parallel: bool = False
    overlap_dp: bool = False
    overlap_tp: bool = False


def gemm_s(m: int, n: int, k: int, device: Device, count: int = 1) -> float:
    """Seconds for `count` independent (m x k) @ (k x n) matmuls in 16 bits on one device (the roofline above).

    FLOPs 2 m n k each at the device's best measured rate, peak x gemm_efficiency, slowed by the
    unfilled share of the last wave of TILE-sized output tiles over the device's compute units;
    bytes: A, B and C once each. Whichever takes longer sets the time.
    """
    tiles = count * math.ceil(m / TILE[0]) * math.ceil(n / TILE[1])
    waves = math.ceil(tiles / device.compute_units)
    filled = tiles / (waves * device.compute_units)
    compute = count * 2 * m * n * k / (device.peak_tflops_bf16 * 1e12 * device.gemm_efficiency * filled)
    memory = count * ACTIVATION_BYTES * (m * k + k * n + m * n) / (device.hbm_gbps * 1e9)
    return max(compute, memory)


def memory_s(nbytes: float, device: Device) -> float:
    """Seconds to move `nbytes` through the device's memory at its measured bandwidth."""
    return nbytes / (device.hbm_gbps * 1e9)


def flash_attention_s(queries: int, keys: int, heads: int, head_dim: int, device: Device,
                      causal: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of a fused attention kernel: `queries` rows against `keys` columns.

    FLOPs as FlashAttention's papers count them (Dao 2023, Sec. 4.1; Shah et al. 2024, Sec. 4.1):
    4 q k d per head forward, half of it when causal (the kernel skips the masked blocks), and the
    backward 2.5 times the forward (it recomputes the scores: five matmuls to the forward's two).
    Rate: attention_efficiency x peak x k / (k + FLASH_HALF_KEYS). FlashAttention-2's measured
    forward + backward, causal, head size 128 (Dao 2023, Fig. 4, A100 80GB: 155, 173, 182, 189
    TFLOP/s at 2k, 4k, 8k, 16k keys; Fig. 8, H100: 265, 294, 308, 328) fit that form within 4 %,
    with 195 and 340 TFLOP/s asymptotes and a half-rate key length of 530 and 576.
    """
    forward = 4 * queries * keys * head_dim * heads * (0.5 if causal else 1)
    rate = device.peak_tflops_bf16 * 1e12 * device.attention_efficiency * keys / (keys + FLASH_HALF_KEYS)
    return forward / rate, 2.5 * forward / rate


def unfused_attention_s(queries: int, keys: int, heads: int, head_dim: int, device: Device,
                        dropout: bool = True) -> tuple[float, float]:
    """(forward, backward) seconds of attention as separate kernels (Megatron-LM before FlashAttention).

    Q K^T and A V: one matmul per head over the whole queries x keys matrix, masked half included;
    between them the fused scale-mask-softmax reads the scores and writes the probabilities (2 + 2
    bytes an element), and dropout reads them and writes its output and a 1-byte mask (2 + 2 + 1).
    The backward: twice the matmuls, and the elementwise kernels read and write as much again.
    """
    matmuls = gemm_s(queries, keys, head_dim, device, heads) + gemm_s(queries, head_dim, keys, device, heads)
    elementwise = memory_s(queries * keys * heads * (4 + (5 if dropout else 0)), device)
    return matmuls + elementwise, 2 * (matmuls + elementwise)


def layer_s(cfg, device: Device, tokens: int, tp: int, cp: int, framework: Framework) -> dict[str, float]:
    """Seconds one GPU spends on one transformer layer for `tokens` positions of one micro-batch
    (b s / cp): {"forward", "backward", "attention_forward"} (the last for selective recomputation).
    Under CP the attention is always blockwise, as ring attention computes it.

    Matmuls per TP rank (Shoeybi et al. 2019, Sec. 3): Q, K, V fused (h x (h + 2 kv) / tp), the output
    projection (h / tp x h), the MLP's first matrices (h x f / tp, two of them for SwiGLU) and its last
    (f / tp x h). Attention: each rank's queries against all s keys of the sequence (under CP the
    ring brings them); causal. Elementwise bytes per token, 16-bit: two norms (read and write h: 4 h
    each) and two bias-dropout-residual adds (read two h, write h and a 1-byte mask: 7 h each), 22 h,
    repeated on every TP rank unless sequence parallelism cuts them; the MLP's activation reads and
    writes its f / tp (GELU: 4 f / tp; SwiGLU reads two: 6 f / tp). The backward moves twice those bytes.
    """
    h, f, kv = cfg.hidden, cfg.ffn, cfg.n_kv_heads * cfg.head_dim
    gated = cfg.mlp == "swiglu"
    gemms = (gemm_s(tokens, (h + 2 * kv) // tp, h, device) + gemm_s(tokens, h, h // tp, device)
             + gemm_s(tokens, (2 if gated else 1) * f // tp, h, device) + gemm_s(tokens, h, f // tp, device))
    # ring attention computes block by block, as a fused kernel does (context.py)
    attention = flash_attention_s if framework.flash_attention or cp > 1 else unfused_attention_s
    attention_forward, attention_backward = attention(tokens, cfg.seq_len, cfg.heads // tp, cfg.head_dim, device)
    per_token = 22 * h / (tp if framework.sequence_parallel else 1) + (6 if gated else 4) * f / tp
    elementwise = memory_s(tokens * per_token, device)
    return {"forward": gemms + attention_forward + elementwise,
            "backward": 2 * gemms + attention_backward + 2 * elementwise,
            "attention_forward": attention_forward}


def head_s(cfg, device: Device, tokens: int, tp: int) -> float:
    """Seconds of the LM head for `tokens` positions, forward and backward: its matmul (h x V / tp, three
    times), and the cross-entropy, which reads the logits and writes fp32 probabilities (2 + 4 bytes a
    logit) and in the backward reads those and writes the logits' gradient (4 + 2)."""
    vocab = cfg.vocab // tp
    return 3 * gemm_s(tokens, vocab, cfg.hidden, device) + memory_s(12 * tokens * vocab, device)


def optimizer_s(params: int, device: Device) -> float:
    """Seconds of the optimizer step over `params` parameters: OPTIMIZER_BYTES_PER_PARAM each."""
    return memory_s(OPTIMIZER_BYTES_PER_PARAM * params, device)
