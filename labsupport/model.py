"""TinyGPT: a GPT-2-style decoder small enough to train on a laptop, built from a ModelConfig.

The architecture follows GPT-2 (Radford et al., 2019): token + learned position embeddings,
pre-LayerNorm blocks of causal self-attention and a GELU MLP (4x hidden), a final LayerNorm,
and an LM head tied to the token embedding. Every parallelism (DDP, ZeRO, TP, PP) is applied
to this one model from outside, so it knows nothing of them; it is only laid out so that they
can cut it without rewriting it (ARCHITECTURE.md, "The model"):

* `forward` returns logits; the loss is a separate function (`lm_loss`), so a strategy can
  supply another one (tensor parallelism's vocab-parallel loss).
* q, k and v weights are laid out head by head, and attention reads its head count off its
  weight, so a block of rows is a set of whole heads that one rank can own.
* blocks are keyed by their layer index and `forward` skips absent parts, so a pipeline
  stage is this model with the other stages' parts removed, parameter names unchanged.
* the vocabulary is padded to a multiple of 64 (divisible by any tensor-parallel degree up to
  64); the padded logits are -inf, so they never win and the mathematics is unchanged.
* `forward` takes the positions of its tokens where they are not 0..t-1 (context parallelism
  gives a rank some positions of the sequence; attention reads them for its causal mask).
* `cfg.experts > 0` makes every block's MLP a mixture of experts (parallel/experts.py's `MoE`),
  whose load-balancing loss the training loss adds (experts.aux_loss).

The shapes (ModelConfig, the presets, the padding rule) are torch-free data in
`estimate/shapes.py`, so that sizing a model never imports torch; they are re-exported here.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .estimate.shapes import CPU_PRESETS, DEFAULT_PRESET, GPT2_VOCAB, PRESETS, ModelConfig, get_preset  # noqa: F401


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t only attends to positions <= t.

    One matrix computes q, k and v, its rows laid out head by head, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]
    (head_dim rows each), as Megatron-LM lays them out. A contiguous block of rows is then a
    set of whole heads, and the matching block of columns of `proj` reads just their output:
    a tensor-parallel rank keeps its block and runs this same code on fewer heads, which it
    reads off the weight's shape.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        qkv = self.qkv(x)
        b, t, _ = qkv.shape  # from qkv, not x: under sequence parallelism qkv gathers all t positions
        q, k, v = qkv.view(b, t, -1, 3, self.head_dim).transpose(1, 2).unbind(dim=3)  # -1: this module's heads
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, 4 * cfg.hidden, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.hidden, cfg.hidden, bias=cfg.bias)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        if cfg.experts:
            from .parallel.experts import MoE  # (experts.py builds its experts from MLP, defined above)
            self.mlp = MoE(cfg.hidden, 4 * cfg.hidden, cfg.experts, cfg.top_k, cfg.capacity_factor, bias=cfg.bias)
        else:
            self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """Token ids in, logits out. Parts set to None (a pipeline stage's missing ones) are skipped."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab is None:
            raise ValueError("ModelConfig.vocab is not set: use cfg.with_vocab(tokenizer.vocab_size)")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.hidden, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.hidden, cfg.padded_vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied: one matrix embeds and un-embeds
        # 0 for real tokens, -inf for the padding: added to the logits, the padding never wins
        # and gets no probability (so no gradient). Not a parameter, not saved in checkpoints.
        padding = torch.zeros(cfg.padded_vocab)
        padding[cfg.vocab:] = float("-inf")
        self.register_buffer("vocab_padding", padding, persistent=False)
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2L) so the residual stream stays O(1).
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))
        with torch.no_grad():
            self.tok_emb.weight[cfg.vocab:].zero_()  # padding rows: zero, and they stay zero

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """The model's parameters as `estimate.params.count_params` counts them: the tied head
        once, the vocabulary padding not at all."""
        padding = (self.cfg.padded_vocab - self.cfg.vocab) * self.cfg.hidden
        return sum(p.numel() for p in self.parameters()) - padding

    def forward(self, x, positions=None):
        """`positions`: the global position of each of x's tokens (default 0..t-1)."""
        if self.tok_emb is not None:  # the first stage: token ids -> hidden states
            t = x.shape[1]
            if t > self.cfg.seq_len:
                raise ValueError(f"sequence of length {t} is longer than the model's seq_len {self.cfg.seq_len}")
            positions = torch.arange(t, device=x.device) if positions is None else positions
            x = self.drop(self.tok_emb(x) + self.pos_emb(positions))
        for block in self.blocks.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:  # the last stage: hidden states -> logits
            x = self.lm_head(x) + self.vocab_padding.to(x.dtype)
        return x

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, temperature: float = 1.0, generator=None):
        return generate(self, idx, max_new_tokens, self.cfg.seq_len, temperature, generator)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of every sequence."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@torch.no_grad()
def generate(logits_fn, idx, max_new_tokens: int, seq_len: int, temperature: float = 1.0, generator=None):
    """Sample one token at a time, feeding the last seq_len tokens back in.

    `logits_fn(idx)` gives full logits on every rank that calls it (a parallel strategy's
    `logits`); with the same generator every rank then draws the same tokens.
    """
    for _ in range(max_new_tokens):
        logits = logits_fn(idx[:, -seq_len:])[:, -1, :] / max(temperature, 1e-6)
        nxt = torch.multinomial(F.softmax(logits.float(), dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
