"""How many parameters a TinyGPT shape has: the GPT shape and the Llama family alike.

`count_params` is exact for `labsupport.model.TinyGPT` (a test builds the model and compares) and
matches the published counts of the released checkpoints it has shapes for (GPT-2, Llama 3, Mistral
7B, Mixtral 8x7B: tests/test_estimate.py); `active_params` is what one token uses of a mixture of
experts; `matmul_params` is the N of the FLOP count. `rule_of_thumb` is the 12 L d^2 approximation
the scaling-law papers use. For large GPT shapes they agree to well under 1%: the embeddings, biases
and LayerNorms are what the rule leaves out.

The family's differences, one term each (ModelConfig's options; d = hidden, f = the MLP's width
`cfg.ffn`, h = heads, g = kv_heads, e = head_dim = d / h):
  attention   q and the output projection d x h e = d^2 each; k and v d x g e each (grouped-query
              attention, Ainslie et al. 2023, Sec. 2.2): 2 d^2 + 2 d g e, which is 4 d^2 when g = h
  MLP         GELU: two matrices, 2 d f; SwiGLU: three (gate, up, down), 3 d f (Shazeer 2020, eq. 6)
  norms       LayerNorm: a gain and, with biases, a bias (2 d); RMSNorm: a gain only (d) (Zhang &
              Sennrich 2019, eq. 4)
  positions   learned: a table of s d; RoPE: none (Su et al. 2021: a fixed rotation)
  head        tied: the embedding's matrix, counted once; untied: V d more
"""
from __future__ import annotations

from .experts import expert_params


def _norm_params(cfg) -> int:
    """One normalization: LayerNorm's gain and bias (gain only without biases), RMSNorm's gain."""
    return 2 * cfg.hidden if cfg.norm == "layernorm" and cfg.bias else cfg.hidden


def _mlp_params(cfg) -> int:
    """One dense MLP, or one expert (`experts.expert_params`): GELU 2 d f, SwiGLU 3 d f, and biases."""
    return expert_params(cfg.hidden, cfg.ffn, gated=cfg.mlp == "swiglu", bias=cfg.bias)


def attention_params(cfg) -> int:
    """One attention layer: q, k, v in one matrix of (h + 2 g) e rows and the d x d output projection,
    with their biases ((h + 2 g) e + d) when `cfg.bias`."""
    d, qkv_rows = cfg.hidden, (cfg.heads + 2 * cfg.n_kv_heads) * cfg.head_dim
    return d * qkv_rows + d * d + ((qkv_rows + d) if cfg.bias else 0)


def params_per_layer(cfg) -> int:
    """Parameters of one transformer block: attention, MLP (or its experts and router), two norms.

    For the GPT shape this is 12 d^2 + 13 d. Weights: attention 4 d^2 (Q, K, V: 3 d^2 in one matrix,
    output projection: d^2) and MLP 8 d^2 (d -> 4d -> d). So one layer is 12 d^2, not the "11 d^2"
    of the workshop deck. Vectors: two LayerNorm weights (2d), and with `cfg.bias` the two LayerNorm
    biases (2d) and the biases of qkv (3d), attention projection (d), fc (4d) and MLP projection (d):
    13d in all. Narayanan et al. 2021 (Megatron-LM on GPU clusters), Sec 5.1, count the same 12 d^2 + 13 d.
    The Llama family's terms are in the module docstring (Mistral 7B's layer: 218,112,000).
    With `cfg.experts` = E, the MLP is E of them plus a bias-free d x E router (Fedus et al. 2021, Sec 2.1).
    """
    mlp = cfg.experts * _mlp_params(cfg) + cfg.hidden * cfg.experts if cfg.experts else _mlp_params(cfg)
    return attention_params(cfg) + mlp + 2 * _norm_params(cfg)


def count_params(cfg, position_embeddings: bool = True, padded: bool = False) -> int:
    """Exact parameter count of TinyGPT(cfg); a tied LM head shares the token embedding.

    Token embedding V d (also the LM head when tied; an untied head adds its own V d), learned
    positions s d (none with RoPE), L blocks, final norm. `position_embeddings=False` leaves out the
    s d position table, which takes part in no matmul (see `matmul_params`).
    V is the vocabulary, as published counts use it (GPT-2: 124,439,808 with V = 50,257; Llama 3's
    128,256 and Mistral's 32,000 need no padding); `padded=True` counts the rows the model allocates
    (V rounded up to a multiple of 64, in the embedding and an untied head), which is what memory holds.
    Every expert counts: `active_params` is what a token uses.
    """
    if cfg.vocab is None:
        raise ValueError("cfg.vocab is not set: use cfg.with_vocab(vocab_size) first")
    d = cfg.hidden
    vocab = cfg.padded_vocab if padded else cfg.vocab
    embeddings = vocab * d * (1 if cfg.tied else 2)
    positions = cfg.seq_len * d if position_embeddings and cfg.positions == "learned" else 0
    return embeddings + positions + cfg.n_layers * params_per_layer(cfg) + _norm_params(cfg)


def active_params(cfg, padded: bool = False) -> int:
    """The parameters one token uses: `count_params` with only `cfg.top_k` of each layer's experts (the
    router whole), as Fedus et al. 2021 (Sec. 2) and Jiang et al. 2024 count them: Mixtral 8x7B 12.9B
    of 46.7B. The dense model's are all of them."""
    unused = cfg.n_layers * (cfg.experts - cfg.top_k) * _mlp_params(cfg) if cfg.experts else 0
    return count_params(cfg, padded=padded) - unused


def matmul_params(cfg) -> int:
    """N of the FLOP count (`flops.training_flops_per_token`): the parameters a token multiplies by.

    Every active parameter (`active_params`: top_k experts of each layer) but the tables that are
    looked up, not multiplied: the learned positions and, when the head is untied, the input
    embedding. A tied embedding counts once, standing for the LM head, the biggest matmul of a small
    model: nanoGPT's N (`get_num_params(non_embedding=True)`) and PaLM's (tied, no learned
    positions), so our MFU compares with theirs. The norms' gains and the biases stay in, as in
    those counts: under 0.1% of a large model."""
    lookups = cfg.seq_len * cfg.hidden if cfg.positions == "learned" else 0
    if not cfg.tied:
        lookups += cfg.vocab * cfg.hidden
    return active_params(cfg) - lookups


def rule_of_thumb(cfg) -> int:
    """N ~ 12 L d^2: the non-embedding parameters of a GPT with a 4x MLP.

    Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Sec 2.1 (Table 1):
    N = 2 d_model n_layer (2 d_attn + d_ff) = 12 n_layer d_model^2 when d_attn = d_model
    and d_ff = 4 d_model.
    """
    return 12 * cfg.n_layers * cfg.hidden**2
