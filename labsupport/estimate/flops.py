"""Training FLOPs per token and the peak FLOP/s of accelerators, the two halves of MFU.

Model FLOPs utilization (Chowdhery et al. 2022, "PaLM", Appendix B) is the FLOP/s the model
needs at the observed tokens/s, divided by the hardware's peak. It counts the model's FLOPs,
not what the implementation executes (activation recomputation does not raise it), so it
compares runs across codes and machines.
"""
from __future__ import annotations

from .params import matmul_params

# The MFU a well-tuned large training run reaches, end to end: an assumption, to turn a step's
# FLOPs into the seconds a real run spends on it, everything that slows it included. Published
# runs: GPT-3 21.3%, Gopher 32.5%, Megatron-Turing NLG 30.2%, PaLM 46.2% (Chowdhery et al. 2022,
# Table 3). The comm counter (`tp_comm.step_cost`) and the offload check (`offload.offload_pays`)
# set a transfer against such a step. The planner's EFFICIENCY (planner.py) is another quantity:
# it builds a step's time up from its parts (step_time.py's kernels at their best measured rates),
# takes the share of those rates a whole step reaches, and adds communication and the bubble itself.
TYPICAL_MFU = 0.4


def model_flops_per_token(n_params: int, n_layers: int, heads: int, head_dim: int, seq_len: int) -> int:
    """Training FLOPs per token, forward and backward: 6N + 12 L H Q T.

    Chowdhery et al. 2022 (PaLM), Appendix B. The 6N is Kaplan et al. 2020, Sec 2.1: each
    parameter costs a multiply and an add (2 FLOPs) per token in the forward pass and twice
    that in the backward pass. The 12 L H Q T adds the attention matmuls Q K^T and A V that
    involve no parameters: 2 x 2 T H Q per token and layer forward, times 3 for training.
    (Kaplan's Table 1 lists half of that attention term, 2 n_layer n_ctx d_attn forward.)
    """
    return 6 * n_params + 12 * n_layers * heads * head_dim * seq_len


def training_flops_per_token(cfg, causal: bool = False) -> int:
    """6N + 12 L s d for TinyGPT(cfg) at its full context `cfg.seq_len`, the GPT shape and the Llama family.

    N is `params.matmul_params(cfg)`: every parameter a token multiplies by. For the GPT shape that is
    every parameter but the position table: the tied embedding counts once and stands for the LM
    head, the biggest matmul of a small model (nanoGPT's N, `get_num_params(non_embedding=True)`, and
    PaLM's, which has no learned positions), so our MFU compares with theirs. Kaplan's non-embedding N
    would leave out the LM head's 2 V d. The family changes only N: SwiGLU's three matrices (3 d f),
    grouped-query attention's smaller k and v projections (2 d kv_heads head_dim), an untied head (V d;
    the untied input embedding is a lookup and is left out), and with experts only top_k of them
    (Mixtral: 12.9B active of 46.7B). The attention term does not change with grouped-query attention:
    every one of the heads query heads still scores every key (a key/value head is read by several).
    RMSNorm, RoPE, SiLU and the gating product are elementwise and not counted, as LayerNorm and GELU are not.

    `causal`: the 12 L s d of the convention (PaLM, Appendix B; Narayanan et al. 2021's formula, Sec. 5.1,
    counts the same full s x s scores) is every score of the s x s matrix, though a causal model uses
    s (s + 1) / 2 of them. A causal kernel that skips the masked blocks (FlashAttention's, the CPU flash
    kernel, our ring attention's `_visible_blocks`) computes about those only: the query at position
    i (from 0) against i + 1 keys, 2 d (i + 1) FLOPs for Q K^T and as many for A V, forward, so
    2 d (s + 1) per token on average and 6 L d (s + 1) for training, about half. `causal=True` counts
    that. The default is the convention, which the MFU figures in the papers use: with a causal kernel,
    it credits the run with attention FLOPs the kernel never executed.

    What the conventions count for the family. PaLM's own model has SwiGLU and multi-query attention
    (Chowdhery et al. 2022, Sec. 2), and its 6N + 12 L H Q T (Appendix B) takes them the way we do: the
    MLP's three matrices and the single K/V head are in N, and the attention term has H, the query
    heads, so grouped-query attention saves FLOPs only through N. torchtitan, Meta's PyTorch trainer for
    Llama 3, counts the same in `get_dense_model_nparams_and_flops` (torchtitan/models/utils.py):
    6 x (every parameter but the nn.Embedding's: its untied output layer stays in) + 12 L H Q T, its comment
    saying it follows the convention and does not count causal sparsity. The Llama 3 paper (Dubey et al.
    2024, Table 4) reports 38-43% BF16 MFU for the 405B run without stating its FLOP count.
    """
    n_params = matmul_params(cfg)
    if causal:
        return 6 * n_params + 6 * cfg.n_layers * cfg.hidden * (cfg.seq_len + 1)
    return model_flops_per_token(n_params, cfg.n_layers, cfg.heads, cfg.head_dim, cfg.seq_len)


def forward_flops_per_token(cfg, causal: bool = False) -> int:
    """2N + 4 L s d: one third of training, the backward pass costing twice the forward (Kaplan Sec 2.1)."""
    return training_flops_per_token(cfg, causal) // 3


def training_days(n_params: float, tokens: float, devices: int, peak_flops: float, mfu: float,
                  flops_per_param_token: float = 6) -> float:
    """Days to train: C = 6 N D FLOPs (Kaplan et al. 2020, Sec 2.1) at `mfu` of every device's peak.

    Narayanan et al. 2021 (Sec 5.1, eq. 4) count 8 N D with full activation recomputation (one
    more forward pass): pass `flops_per_param_token=8` to reproduce their 34 days for GPT-3
    (175B, 300B tokens, 1024 A100s at 140 TFLOP/s each) and 84 days for the 1T model (1,008B parameters).
    """
    if min(n_params, tokens, devices, peak_flops, mfu) <= 0:
        raise ValueError("parameters, tokens, devices, peak FLOP/s and MFU must all be > 0")
    seconds = flops_per_param_token * n_params * tokens / (devices * peak_flops * mfu)
    return seconds / 86400


# GPU name substring -> (fp32, bf16 dense tensor-core) peak TFLOP/s per device, from the
# vendors' datasheets. Lookup is the first key, in this order, that is a substring of the name
# torch reports (case-insensitive): so "H100 PCIe" comes before "H100" and "A100" before "A10".
#   NVIDIA H200 / H100 (SXM) / H100 PCIe / A100 / A10 / V100 Tensor Core GPU datasheets:
#     bf16 is the dense figure, half the "with sparsity" number the datasheets print first;
#     fp32 is the CUDA-core rate (PyTorch runs fp32 matmuls without TF32 by default).
#     V100 has no bf16: its entry is the fp16 tensor-core peak.
#   AMD Instinct MI300X and MI250X datasheets: fp32 is the matrix-core rate. An MI250X module is
#     two GCDs and each is its own torch device, so its entry is half the module's 95.7 / 383.
PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H200": (67.0, 989.0),
    "H100 PCIe": (51.0, 756.0),
    "H100": (67.0, 989.0),
    "A100": (19.5, 312.0),
    "A10": (31.2, 125.0),
    "V100": (15.7, 125.0),
    "MI300X": (163.4, 1307.4),
    "MI250X": (47.9, 191.5),
}


def peak_tflops(device_name: str) -> tuple[float, float] | None:
    """(fp32, bf16) peak TFLOP/s of the first PEAK_TFLOPS key found in `device_name`, else None."""
    for key, peaks in PEAK_TFLOPS.items():
        if key.lower() in device_name.lower():
            return peaks
    return None
