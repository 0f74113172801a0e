"""TinyGPT: a GPT-2-style decoder small enough to train on a laptop, built from a ModelConfig.

By default the architecture follows GPT-2 (Radford et al., 2019): token + learned position
embeddings, pre-LayerNorm blocks of causal self-attention and a GELU MLP (4x hidden), a final
LayerNorm, and an LM head tied to the token embedding. The same model is the Llama family's
through the config's options (estimate/shapes.py, ModelConfig): RMSNorm, a SwiGLU MLP of its own
width, rotary position embeddings, grouped-query attention, an untied head, no biases; each
option's default is GPT-2's, so a GPT shape builds the same parameters, in the same order, from
the same random draws as before the options existed. Every parallelism (DDP, ZeRO, TP, PP) is applied
to this one model from outside, so it knows nothing of them; it is only laid out so that they
can cut it without rewriting it (ARCHITECTURE.md, "The model"):

* `forward` returns logits; the loss is a separate function (`lm_loss`), so a strategy can
  supply another one (tensor parallelism's vocab-parallel loss).
* q, k and v weights are laid out head by head (with grouped-query attention, key/value head by
  key/value head, each with its query heads), and attention reads its head count off its weight,
  so a block of rows is a set of whole heads that one rank can own.
* blocks are keyed by their layer index and `forward` skips absent parts, so a pipeline
  stage is this model with the other stages' parts removed, parameter names unchanged.
* the vocabulary is padded to a multiple of 64 (divisible by any tensor-parallel degree up to
  64); the padded logits are -inf, so they never win and the mathematics is unchanged.
* `forward` takes the positions of its tokens where they are not 0..t-1 (context parallelism
  gives a rank some positions of the sequence; attention reads them for its causal mask). Learned
  position embeddings and rotary embeddings both take these global positions, so a rank holding
  positions 96..127 rotates its queries and keys by those positions, not by 0..31: ring attention
  and sampling then compute what one device computes.
* `cfg.experts > 0` makes every block's MLP a mixture of experts (`MoE`, below). Its load-balancing
  loss is recorded by the forward, not returned with the logits, so `model(x)` is the logits for
  every strategy alike (a pipeline stage's, a tensor-parallel rank's, sampling's); the training loss
  adds `model.aux_loss()` to `lm_loss`, as HF's Mixtral adds the `aux_loss` it returns beside its
  logits. Expert parallelism (parallel/experts.py) replaces only where the layer's rows go.

The shapes (ModelConfig, the presets, the padding rule) are torch-free data in
`estimate/shapes.py`, so that sizing a model never imports torch; they are re-exported here.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .estimate.shapes import CPU_PRESETS, DEFAULT_PRESET, GPT2_VOCAB, PRESETS, ModelConfig, get_preset  # noqa: F401


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (Su et al. 2021, "RoFormer", Sec. 3.2, eq. 15, computed elementwise as
    their eq. 34) of `x`, shaped (..., t, head_dim), for the `positions` (t,) of its t rows.

    Features 2i and 2i + 1 of a row at position m are turned by the angle m theta_i, with
    theta_i = theta^(-2i / head_dim), i = 0 .. head_dim / 2 - 1:
        (x_2i, x_2i+1) -> (x_2i cos - x_2i+1 sin,  x_2i sin + x_2i+1 cos).
    A query at m and a key at n rotated so have a dot product that depends on m - n only (their eq. 16),
    which is what makes the global positions enough: nothing else about the sequence is needed.
    Adjacent features make a pair, as in the paper and Meta's reference code (which rotates them as
    complex numbers); Hugging Face's Llama pairs feature i with i + head_dim / 2 and permutes the
    checkpoints' q and k rows to match. The angles and the rotation are computed in fp32 and the
    result cast back to x's dtype (as Meta's code does under bf16)."""
    half = torch.arange(0, x.shape[-1], 2, device=x.device, dtype=torch.float32) / x.shape[-1]
    angles = positions.to(torch.float32).unsqueeze(-1) * theta ** -half     # (t, head_dim / 2)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class CausalSelfAttention(nn.Module):
    """Multi-head attention where position t only attends to positions <= t; grouped-query attention
    (Ainslie et al. 2023) when `cfg.kv_heads` < `cfg.heads`.

    One matrix computes q, k and v. Its rows are laid out by key/value head (a "query group", as
    Megatron-LM calls it): for each of the kv_heads groups g, the r = heads / kv_heads query heads
    that read it, then its key head, then its value head, head_dim rows each:

        [q_(g0,0) .. q_(g0,r-1) k_g0 v_g0 | q_(g1,0) .. q_(g1,r-1) k_g1 v_g1 | ...]

    (Megatron-LM's `linear_qkv` layout; query head g r + j reads key/value head g, as torch's
    `enable_gqa` pairs them). With multi-head attention (r = 1) this is [q_0 k_0 v_0 | q_1 k_1 v_1 | ...].
    A contiguous block of whole groups is then a set of key/value heads with every query head that
    reads them, and the matching block of columns of `proj` reads just their output: a
    tensor-parallel rank keeps its block and runs this same code on fewer heads, which it reads off
    the weight's shape (r stays the same on every rank).

    With `cfg.positions == "rope"`, q and k are rotated (`rotate`) by the global positions the forward
    is given (default 0..t-1), after the split into heads and before the scores.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.q_per_kv = cfg.heads // cfg.n_kv_heads      # r: query heads per key/value head
        self.rope_theta = cfg.rope_theta if cfg.positions == "rope" else None
        self.qkv = nn.Linear(cfg.hidden, (cfg.heads + 2 * cfg.n_kv_heads) * cfg.head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x, positions=None):
        """`positions`: the global position of each of the t rows (1-D), for RoPE; default 0..t-1."""
        qkv = self.qkv(x)
        b, t, _ = qkv.shape  # from qkv, not x: under sequence parallelism qkv gathers all t positions
        r = self.q_per_kv
        groups = qkv.view(b, t, -1, r + 2, self.head_dim).transpose(1, 2)  # -1: this module's key/value heads
        q, k, v = groups.split([r, 1, 1], dim=3)                           # (b, kv heads, t, r | 1, head_dim)
        q, k, v = q.transpose(2, 3).flatten(1, 2), k.squeeze(3), v.squeeze(3)
        if self.rope_theta is not None:
            positions = torch.arange(t, device=x.device) if positions is None else positions
            q, k = rotate(q, positions, self.rope_theta), rotate(k, positions, self.rope_theta)
        grouped = {"enable_gqa": True} if r > 1 else {}  # each key/value head read by its r query heads
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, **grouped
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """hidden -> ffn (GELU) -> hidden: GPT-2's MLP (ffn = 4 hidden), and each expert of a GPT mixture."""

    def __init__(self, hidden: int, ffn: int, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(hidden, ffn, bias=bias)
        self.proj = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class SwiGLU(nn.Module):
    """hidden -> ffn -> hidden through a gated linear unit with a Swish gate (Shazeer 2020, "GLU Variants
    Improve Transformer", eq. 6): down(SiLU(gate(x)) * up(x)), SiLU being Swish with beta = 1. Three
    matrices, where the GELU MLP has two: the Llama family's MLP (its w1, w3, w2; Hugging Face's gate_proj,
    up_proj, down_proj) and each of Mixtral's experts. Column i of `gate` and `up` and row i of `down`
    belong to unit i alone, so a block of units is cut as the GELU MLP's `fc` and `proj` are."""

    def __init__(self, hidden: int, ffn: int, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(hidden, ffn, bias=bias)
        self.up = nn.Linear(hidden, ffn, bias=bias)
        self.down = nn.Linear(ffn, hidden, bias=bias)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def make_mlp(hidden: int, ffn: int, kind: str = "gelu", bias: bool = True) -> nn.Module:
    """The block's MLP, or one expert: `kind` "gelu" (MLP) or "swiglu" (SwiGLU)."""
    return SwiGLU(hidden, ffn, bias) if kind == "swiglu" else MLP(hidden, ffn, bias)


def make_norm(cfg: ModelConfig) -> nn.Module:
    """The block's and the final normalization: LayerNorm (Ba et al. 2016; a bias when cfg.bias) or
    RMSNorm (Zhang & Sennrich 2019, eq. 4: x / sqrt(mean(x^2) + eps) times a gain, no mean subtracted,
    no bias), with eps `cfg.norm_eps`. RMSNorm is torch's `nn.RMSNorm` (torch >= 2.4): the same formula
    as Llama's reference module, one parameter named `weight` as LayerNorm's, and a fused kernel where
    the device has one; a module of our own would add nothing to read."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=cfg.bias)


# ====================================================================== a mixture of experts

def moe_problems(n_experts: int, top_k: int, capacity_factor: float | None) -> list[str]:
    """What is wrong with this mixture of experts, one line per mistake."""
    out = []
    if not 1 <= top_k <= n_experts:
        out.append(f"top_k {top_k}: each token chooses between 1 and n_experts ({n_experts}) experts")
    if capacity_factor is not None and capacity_factor <= 0:
        out.append(f"capacity_factor {capacity_factor}: it must be above 0 (1.0 holds a balanced load; "
                   "None sets no capacity)")
    return out


class LocalDispatch:
    """Where a mixture of experts' rows go: on one rank every expert is here, and nothing moves.

    Expert parallelism puts an all-to-all in its place (parallel/experts.py), as Megatron-LM swaps
    its token dispatchers. `ranks`: how many ranks route the layer's tokens together; `rank`: this
    one among them; `all_gather(counts)` stacks every rank's counts; `all_to_all(rows, send, recv)`
    sends send[i] rows to rank i and returns the recv[i] rows from each rank i, in rank order.
    """

    ranks, rank = 1, 0

    def all_gather(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.unsqueeze(0)

    def all_to_all(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        return rows


class MoE(nn.Module):
    """Token rows (..., hidden) in, the same shape out: each token's top_k experts' outputs, gated.

    As Switch Transformer (Fedus et al. 2021) and Mixtral (Jiang et al. 2024) build it:

    * the router is a linear map to one logit per expert; their softmax p gives each token's
      probability for every expert, and the token goes to its `top_k` most probable experts with
      those probabilities renormalised over the top_k as gates (Mixtral's softmax over the chosen
      logits; GShard does the same for its top 2). `renormalize=False` keeps p itself, as Switch
      does with top_k = 1, where the renormalised gate would always be 1 and teach the router nothing.
    * each expert is the block's MLP (hidden -> ffn -> hidden, TinyGPT's init): GELU's `MLP`, or with
      `mlp="swiglu"` a `SwiGLU` as each of Mixtral's experts is (Jiang et al. 2024, Sec. 2.1), so the
      layer takes the place of `Block.mlp`. Experts are keyed by their global index
      (`experts.3.fc.weight`, `experts.3.gate.weight`): on one rank all of them, under expert
      parallelism this rank's.
    * capacity: an expert takes at most C = ceil(capacity_factor x top_k x T / n_experts) of the
      top_k x T assignments of T tokens (Switch's expert capacity, Sec. 2.2, times top_k as in
      GShard's top-2 capacity 2T/E); the rest are dropped: they add nothing, the token goes on
      through the residual. An expert's queue is filled as GShard's top-2 gating (Algorithm 1)
      fills it, without its random second choice: every token's first choice before any token's
      second, and within a choice by the token's position in the batch. The position is global
      (rank r's tokens come after rank r-1's), so the same assignments are dropped whatever the
      expert-parallel degree. `capacity_factor=None`: no capacity, nothing dropped (Mixtral).
    * an expert no assignment reaches is not run: its parameters get no gradient (None), as any
      unused parameter, and AdamW leaves them alone (no weight decay).
    * the load-balancing loss, Switch eq. 4 without its alpha (`cfg.aux_loss_coef`, 1e-2 in
      Switch): n_experts x sum_i f_i P_i, with f_i the fraction of assignments the router gave
      expert i (before drops) and P_i its mean probability; 1 when the load is balanced. After each
      forward, `aux_loss` holds it and `load` each expert's count of assignments routed to it and
      dropped (plain ints, for a widget and the run's records), and the capacity.

    One forward: route the tokens and count them per (choice, expert) on every rank (`dispatch.
    all_gather`), from which each assignment's place in its expert's queue (hence whether it is
    kept); sort the kept assignments by expert and send each its token's row (`dispatch.all_to_all`);
    run each expert on its rows; send the outputs back the same way, and add each, scaled by its
    gate, to the row of its token, which undoes the sort.
    """

    def __init__(self, hidden: int, ffn: int, n_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25,
                 *, bias: bool = True, renormalize: bool = True, mlp: str = "gelu"):
        super().__init__()
        found = moe_problems(n_experts, top_k, capacity_factor)
        if found:
            raise ValueError("; ".join(found))
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.renormalize = renormalize
        self.router = nn.Linear(hidden, n_experts, bias=False)  # Switch and Mixtral: no bias
        self.experts = nn.ModuleDict({str(e): make_mlp(hidden, ffn, mlp, bias) for e in range(n_experts)})
        for m in self.modules():  # TinyGPT's init; built inside it, its proj weights are rescaled as the MLP's
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.dispatch = LocalDispatch()
        self.aux_loss: torch.Tensor | None = None
        self.load: dict | None = None

    def capacity(self, tokens: int) -> int:
        """How many assignments one expert takes of `tokens` tokens' (all ranks' together)."""
        if self.capacity_factor is None:
            return tokens  # an expert is at most once among a token's choices
        return math.ceil(self.capacity_factor * self.top_k * tokens / self.n_experts)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        k, n_experts, ep, me = self.top_k, self.n_experts, self.dispatch.ranks, self.dispatch.rank
        local = [int(e) for e in self.experts]  # this rank's experts, ascending

        # route: gate[t, j] weighs token t's j-th choice, expert choice[t, j]
        probs = F.softmax(self.router(tokens), dim=-1)
        gate, choice = probs.topk(k, dim=-1)
        if self.renormalize:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        chosen = F.one_hot(choice, n_experts)                     # (T, k, E)
        counts = self.dispatch.all_gather(chosen.sum(dim=0))      # (ep, k, E): every rank's counts

        # each assignment's place in its expert's queue: after all earlier choices of every rank,
        # then after the earlier ranks' same choice, then after this rank's earlier tokens
        per_choice = counts.sum(dim=0)
        starts = (per_choice.cumsum(0) - per_choice) + (counts.cumsum(0) - counts)   # (ep, k, E)
        before_me = (chosen.cumsum(0) - chosen).gather(2, choice.unsqueeze(2)).squeeze(2)
        position = starts[me].gather(1, choice.t()).t() + before_me              # (T, k)
        capacity = self.capacity(int(counts.sum()) // k)
        kept = torch.minimum((capacity - starts).clamp(min=0), counts).sum(dim=1)  # (ep, E) rows kept

        routed = counts.sum(dim=(0, 1))
        self.aux_loss = n_experts * (routed / routed.sum() * probs.mean(dim=0)).sum()
        self.load = {"routed": routed.tolist(), "dropped": (routed - kept.sum(dim=0)).tolist(), "capacity": capacity}

        # dispatch: the kept assignments (index t k + j) sorted by expert, each sent as its token's row
        assignment = (position < capacity).flatten().nonzero().squeeze(1)
        order = assignment[choice.flatten()[assignment].argsort(stable=True)]
        token = order // k
        mine = kept[:, local]                                     # (ep, local experts): rows from each rank
        send, recv = kept[me].view(ep, -1).sum(dim=1).tolist(), mine.sum(dim=1).tolist()
        rows = self.dispatch.all_to_all(tokens[token], send, recv)

        expert_of_row = torch.tensor(local, device=x.device).repeat(ep).repeat_interleave(mine.flatten())
        out = self._run_experts(rows, expert_of_row, mine.sum(dim=0).tolist())

        # combine: back in the order sent, gated, added to each assignment's token
        out = self.dispatch.all_to_all(out, recv, send)
        gated = out * gate.flatten()[order].unsqueeze(1)
        return gated.new_zeros(tokens.shape).index_add(0, token, gated).view(x.shape)

    def _run_experts(self, rows, expert_of_row, sizes):
        """Each local expert on its rows (`sizes[i]` of them for the i-th); outputs in the rows' order.
        An expert without rows is not run (it gets no gradient); its empty share of the rows stands in
        for its output, in the dtype the experts compute in, so that the output still comes from the
        rows: under expert parallelism every rank's backward then joins the all-to-alls, rows or not."""
        by_expert = expert_of_row.argsort(stable=True)
        device = rows.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else rows.dtype
        out = torch.cat([expert(chunk) if len(chunk) else chunk.to(dtype)
                         for expert, chunk in zip(self.experts.values(), rows[by_expert].split(sizes))])
        return torch.zeros_like(out).index_copy(0, by_expert, out)


def moe_layers(module: nn.Module) -> list[MoE]:
    """The mixture-of-experts layers in `module` (none in the dense model)."""
    return [m for m in module.modules() if isinstance(m, MoE)]


def forward_stats(module: nn.Module) -> dict:
    """What `module`'s layers recorded about its last forward, for a run's records: `expert_load`, each
    mixture-of-experts layer's assignments routed to and dropped by each expert, and its capacity;
    nothing for the dense model. Any module holding the model will do (a strategy's wrapper)."""
    loads = [moe.load for moe in moe_layers(module) if moe.load is not None]
    return {"expert_load": loads} if loads else {}


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)). The norms keep GPT-2's
    names `ln1`, `ln2` whether they are LayerNorms or RMSNorms (`make_norm`); the MLP is `cfg.mlp`'s, or
    a mixture of `cfg.experts` of them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = make_norm(cfg)
        if cfg.experts:
            self.mlp = MoE(cfg.hidden, cfg.ffn, cfg.experts, cfg.top_k, cfg.capacity_factor, bias=cfg.bias,
                           mlp=cfg.mlp)
        else:
            self.mlp = make_mlp(cfg.hidden, cfg.ffn, cfg.mlp, cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, positions=None):
        """`positions`: the global positions of x's rows, for RoPE (None: 0..t-1). A keyword for the
        attention, so hooks that see a module's positional inputs (DTensor's PrepareModuleInput) see x alone."""
        x = x + self.drop(self.attn(self.ln1(x), positions=positions))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyGPT(nn.Module):
    """Token ids in, logits out. Parts set to None (a pipeline stage's missing ones) are skipped.

    `pos_emb` is the learned position table (`cfg.positions == "learned"`), None with RoPE, which has
    no parameters. `lm_head.weight` is `tok_emb.weight` when `cfg.tied`, a matrix of its own otherwise
    (its padding rows zero too: the -inf logits give them no gradient)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab is None:
            raise ValueError("ModelConfig.vocab is not set: use cfg.with_vocab(tokenizer.vocab_size)")
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.padded_vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.positions == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden, cfg.padded_vocab, bias=False)
        if cfg.tied:
            self.lm_head.weight = self.tok_emb.weight  # tied: one matrix embeds and un-embeds
        # 0 for real tokens, -inf for the padding: added to the logits, the padding never wins
        # and gets no probability (so no gradient). Not a parameter, not saved in checkpoints.
        padding = torch.zeros(cfg.padded_vocab)
        padding[cfg.vocab:] = float("-inf")
        self.register_buffer("vocab_padding", padding, persistent=False)
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2L) so the residual stream stays O(1): the
        # matrices that write into it, attention's and the MLP's last (proj; SwiGLU's down), the experts' too.
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "down.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layers))
        with torch.no_grad():
            self.tok_emb.weight[cfg.vocab:].zero_()  # padding rows: zero, and they stay zero
            self.lm_head.weight[cfg.vocab:].zero_()  # the same rows when tied; the head's own when not

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        """The model's parameters as `estimate.params.count_params` counts them: the tied head
        once, the vocabulary padding not at all (in the embedding, and in an untied head)."""
        padding = (self.cfg.padded_vocab - self.cfg.vocab) * self.cfg.hidden * (1 if self.cfg.tied else 2)
        return sum(p.numel() for p in self.parameters()) - padding

    def forward(self, x, positions=None):
        """`positions`: the global position of each of x's tokens (1-D, default 0..t-1), which the
        learned position table (first stage) and RoPE (every block) read."""
        if self.tok_emb is not None:  # the first stage: token ids -> hidden states
            t = x.shape[1]
            if t > self.cfg.seq_len:
                raise ValueError(f"sequence of length {t} is longer than the model's seq_len {self.cfg.seq_len}")
            positions = torch.arange(t, device=x.device) if positions is None else positions
            x = self.tok_emb(x)
            if self.pos_emb is not None:
                x = x + self.pos_emb(positions)
            x = self.drop(x)
        for block in self.blocks.values():
            x = block(x, positions=positions)
        if self.ln_f is not None:
            x = self.ln_f(x)
        if self.lm_head is not None:  # the last stage: hidden states -> logits
            x = self.lm_head(x) + self.vocab_padding.to(x.dtype)
        return x

    def aux_loss(self) -> torch.Tensor | None:
        """The term the training loss adds to `lm_loss`, from the last forward: the load-balancing losses
        of the mixture-of-experts layers, summed over the layers (as Switch Transformer sums them), times
        `cfg.aux_loss_coef`; None for the dense model. Validation reports `lm_loss` alone."""
        losses = [moe.aux_loss for moe in moe_layers(self) if moe.aux_loss is not None]
        return self.cfg.aux_loss_coef * torch.stack(losses).sum() if losses else None

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
