"""How many parameters a TinyGPT shape has.

`count_params` is exact for `labsupport.model.TinyGPT` (a test builds the model and compares);
`rule_of_thumb` is the 12 L d^2 approximation the scaling-law papers use. For large models they
agree to well under 1%: the embeddings, biases and LayerNorms are what the rule leaves out.
"""
from __future__ import annotations

from .experts import expert_params


def params_per_layer(cfg) -> int:
    """Parameters of one transformer block: 12 d^2 weights plus the vectors.

    Weights: attention 4 d^2 (Q, K, V: 3 d^2 in one matrix, output projection: d^2) and MLP 8 d^2
    (d -> 4d -> d). So one layer is 12 d^2, not the "11 d^2" of the workshop deck.
    Vectors: two LayerNorm weights (2d), and with `cfg.bias` the two LayerNorm biases (2d) and
    the biases of qkv (3d), attention projection (d), fc (4d) and MLP projection (d): 13d in all.
    Narayanan et al. 2021 (Megatron-LM on GPU clusters), Sec 5.1, count the same 12 d^2 + 13 d.
    With `cfg.experts` = E, the MLP is E of them plus a bias-free d x E router (Fedus et al. 2021, Sec 2.1).
    """
    d = cfg.hidden
    vectors = 13 * d if cfg.bias else 2 * d
    if cfg.experts:  # a mixture of experts in place of the MLP: E MLPs and the router's d x E (model.py's MoE)
        return 12 * d * d + vectors + (cfg.experts - 1) * expert_params(d, 4 * d, bias=cfg.bias) + d * cfg.experts
    return 12 * d * d + vectors


def count_params(cfg, position_embeddings: bool = True, padded: bool = False) -> int:
    """Exact parameter count of TinyGPT(cfg); the tied LM head shares the token embedding.

    Token embedding V d (also the LM head), learned positions s d, L blocks, final LayerNorm.
    `position_embeddings=False` leaves out the s d position table, which takes part in no
    matmul: that is the N of the FLOP count (see `flops.training_flops_per_token`), as in
    nanoGPT's `get_num_params(non_embedding=True)`.
    V is the vocabulary, as published counts use it (GPT-2: 124,439,808 with V = 50,257);
    `padded=True` counts the rows the model allocates (V rounded up to a multiple of 64),
    which is what memory holds.
    """
    if cfg.vocab is None:
        raise ValueError("cfg.vocab is not set: use cfg.with_vocab(vocab_size) first")
    d = cfg.hidden
    vocab = cfg.padded_vocab if padded else cfg.vocab
    final_norm = 2 * d if cfg.bias else d
    positions = cfg.seq_len * d if position_embeddings else 0
    return vocab * d + positions + cfg.n_layers * params_per_layer(cfg) + final_norm


def rule_of_thumb(cfg) -> int:
    """N ~ 12 L d^2: the non-embedding parameters of a GPT with a 4x MLP.

    Kaplan et al. 2020, "Scaling Laws for Neural Language Models", Sec 2.1 (Table 1):
    N = 2 d_model n_layer (2 d_attn + d_ff) = 12 n_layer d_model^2 when d_attn = d_model
    and d_ff = 4 d_model.
    """
    return 12 * cfg.n_layers * cfg.hidden**2
