"""Bytes per device for training: model states (ZeRO) and activations (Korthikanti et al.).

Model states are parameters, gradients and optimizer states; they scale with the parameter
count and are what ZeRO shards over data-parallel ranks. Activations are what the forward
pass keeps for the backward pass; they scale with batch and sequence and are what sequence
parallelism and recomputation shrink. Tensor and pipeline parallelism split both.
Activations are counted twice over: `activation_terms` is Korthikanti et al.'s per-layer count
of what Megatron-LM's kernels keep, for the GPT shape and rederived for the Llama family (what
`estimate_memory` and the planner use); `tinygpt_activation_bytes` is what our eager CPU model
keeps, to the byte, which the activation meter measures.
ZeRO-Offload moves the optimizer states to the host (offload.py); `largest_model_that_fits`
turns the estimate around: the largest model a device holds.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import replace

from .offload import offloaded_states
from .params import count_params
from .shapes import family_options, tensor_parallel_problems

# Bytes per parameter of model states under Adam, by recipe: {params, grads, optimizer}.
#
# fp32 and "mixed" follow Rajbhandari et al. 2020 ("ZeRO", Sec 3.1), DeepSpeed's accounting:
# mixed precision keeps fp16/bf16 weights (2) and gradients (2) for the forward and backward
# passes, and for the update an fp32 master copy of the weights, Adam's momentum and its
# variance (4 + 4 + 4 = 12, ZeRO's K): 16 bytes. Plain fp32 needs no master copy: 4 + 4 + 8 = 16.
#
# Megatron-LM counts 18 and 20 (its README, "Distributed optimizer", the table of theoretical
# bytes per parameter: fp32 16 = 8 + 8/d sharded, bf16 params with fp32 gradients 18 = 6 + 12/d,
# fp16 params with fp16 gradients 20 = 4 + 16/d). With bf16 it accumulates gradients in fp32
# (2 + 4 + 12); with fp16 the optimizer also keeps an fp32 copy of the gradients (2 + 2 + 16).
# The workshop deck's table ("weights 6x, gradients 4x, optimizer 8x") is Megatron's 18, booked
# with the master copy under weights; only its "total 20x" is a slip.
BYTES_PER_PARAM: dict[str, dict[str, int]] = {
    "fp32": dict(params=4, grads=4, optimizer=8),
    "mixed": dict(params=2, grads=2, optimizer=12),
    "megatron-bf16": dict(params=2, grads=4, optimizer=12),
    "megatron-fp16": dict(params=2, grads=2, optimizer=16),
}

# Where each recipe comes from, for menus and help texts that name them.
RECIPE_SOURCES = {"fp32": "fp32 Adam", "mixed": "ZeRO / DeepSpeed mixed precision",
                  "megatron-bf16": "Megatron-LM bf16", "megatron-fp16": "Megatron-LM fp16"}

RECOMPUTE = ("none", "selective", "full")


def recipe_label(recipe: str) -> str:
    """'mixed' -> 'mixed: 2 + 2 + 12 = 16 B/param (ZeRO / DeepSpeed mixed precision)'."""
    per = BYTES_PER_PARAM[recipe]
    return (f"{recipe}: {per['params']} + {per['grads']} + {per['optimizer']} = {sum(per.values())} B/param "
            f"({RECIPE_SOURCES[recipe]})")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _bytes_per_param(precision: str, bytes_override: dict | None) -> dict[str, int]:
    if bytes_override is None:
        if precision not in BYTES_PER_PARAM:
            raise ValueError(f"unknown precision {precision!r}; choose one of: {', '.join(BYTES_PER_PARAM)}")
        return BYTES_PER_PARAM[precision]
    missing = [k for k in ("params", "grads", "optimizer") if bytes_override.get(k) is None]
    if missing:
        raise ValueError(f"bytes per parameter need all three of params, grads and optimizer; "
                         f"missing {' and '.join(missing)}")
    values = {}
    for k in ("params", "grads", "optimizer"):
        v = bytes_override[k]
        # Whole bytes keep every count an exact integer (DESIGN.md 4); 2.0, as the command line
        # or a slider gives it, is 2. Sub-byte formats (4-bit weights) are not modelled.
        if not (isinstance(v, numbers.Real) and float(v).is_integer() and v >= 0):
            raise ValueError(f"bytes per parameter must be whole numbers >= 0, got {k}={v!r}")
        values[k] = int(v)
    return values


def model_state_bytes(n_params: int, precision: str = "mixed", dp: int = 1, zero: int = 0,
                      model_parallel: int = 1, bytes_override: dict | None = None,
                      offload: bool = False) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer states on one device.

    ZeRO (Rajbhandari et al. 2020, Sec 5.1, Figure 1) partitions over the N_d data-parallel
    ranks: stage 1 (P_os) the optimizer states, stage 2 (P_os+g) also the gradients, stage 3
    (P_os+g+p) also the parameters. `model_parallel` = tp * pp devices first split the model;
    we assume an even split (in reality embeddings and LayerNorms are not split evenly).
    `offload=True` puts the optimizer on the host (ZeRO-Offload, `offload.offloaded_states`)
    and adds the keys `host`, `pcie_to_host` and `pcie_to_device`.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if dp < 1 or model_parallel < 1:
        raise ValueError(f"dp and model_parallel must be >= 1, got {dp} and {model_parallel}")
    per = _bytes_per_param(precision, bytes_override)
    psi = _ceil_div(n_params, model_parallel)
    if offload:
        return offloaded_states(psi, per, dp, zero)
    sharded_from = {"optimizer": 1, "grads": 2, "params": 3}  # the ZeRO stage that shards each
    return {k: _ceil_div(psi * per[k], dp if zero >= sharded_from[k] else 1) for k in ("params", "grads", "optimizer")}


def activation_terms(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                     sequence_parallel: bool = False, *, kv_heads: int | None = None, ffn: int | None = None,
                     mlp: str = "gelu", dropout: bool = True) -> dict[str, int]:
    """One transformer layer's 16-bit activations by tensor, in bytes, on one of `tp` ranks (no recomputation).

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models", Sec 4.1, count
    each tensor a layer keeps for backward in Megatron-LM's implementation: 2 bytes an element, 1 for a
    dropout mask, s = seq_len, b = micro_batch, h = hidden, a = heads. Rederived here for the Llama family
    with g = kv_heads, e = h / a (the head dimension) and f = ffn (the MLP's inner width):

      norms        2 x 2sbh      each norm's input. LayerNorm also keeps a mean and a 1/std per row and
                                 RMSNorm (Zhang & Sennrich 2019, eq. 4: no mean) only the 1/rms, fp32 in
                                 Megatron's fused kernels: O(sb), which the paper leaves out, as do we.
      qkv_input    2sbh          the first attention linear's input (the norm's output)
      q            2sbh          Q, for Q K^T
      kv           4sbh g / a    K (for Q K^T) and V (for the product with the probabilities): g heads of
                                 e each, g e = h g / a wide (Ainslie et al. 2023, Sec 2.2). At g = a,
                                 q + kv is the paper's 4sbh of Q and K (for Q K^T) and 2sbh of V.
      proj_input   2sbh          the attention's output, the output projection's input
      mlp_input    2sbh          the first MLP linear's input (the norm's output); SwiGLU's gate and up
                                 read the same tensor, kept once
      mlp_inner    GELU 4sbf     its input and output (f = 4h: the paper's 8sbh + 8sbh)
                   SwiGLU 6sbf   gate and up outputs (4sbf), the input of Megatron-LM's fused SwiGLU
                                 (`SwiGLUFunction` in megatron/core/fusions/fused_bias_swiglu.py saves
                                 only its input and recomputes SiLU in backward), and their product, the
                                 down projection's input (2sbf). Run unfused, as PyTorch's eager autograd
                                 runs Shazeer's eq. 6 (torchtitan's and our model's `w2(silu(w1 x) * w3 x)`),
                                 the SiLU's output is kept too: 8sbf (`tinygpt_activation_bytes`).
      dropout      2sbh          the masks of the dropouts after attention and after the MLP (sbh each)
      scores       5as^2b        softmax output 2as^2b, attention-dropout mask as^2b and output 2as^2b;
                                 without dropout the softmax output alone, 2as^2b. Every one of the a
                                 query heads forms its s x s scores: grouped-query attention does not
                                 shrink them. A kernel that stores no scores (FlashAttention, PyTorch's
                                 SDPA) drops this term, as selective recomputation does.

    The GPT shape (g = a, f = 4h, dropout) gives the paper's 34sbh + 5as^2b. The Llama family trains
    without dropout (LLaMA's, Mistral's and Llama 3's reference code have none; `dropout=False` drops
    the masks and 3as^2b of the scores): 12sbh + 4sbh g / a + 6sbf + 2as^2b. Llama 3 8B
    (h 4096, a 32, g 8, f 14336): 12 + 1 + 21 = 34sbh again, the GQA saving spent on the wider MLP.
    Two options change no term. RoPE (Su et al. 2021) rotates q and k before Q K^T, which keeps the
    rotated ones: they are the Q and K above (the unrotated q and k, views of the qkv output, are saved
    by nothing); its cos and sin tables hold s e numbers, not an activation of b s h. An untied LM head
    (Llama) reads the same final norm's output as a tied one; it adds parameters, not activations.

    Tensor parallelism (Sec 4.2.1: s b h (10 + 24/t + 5as/(ht)) for the GPT shape) splits every term
    computed on a rank's own heads or units: q, kv (a tp dividing g gives each rank g / t whole
    key/value heads, as Megatron-LM's `num_query_groups` split does), proj_input, mlp_inner, scores;
    the norms, the two linears' inputs and the dropout masks stay replicated on every rank. Sequence
    parallelism (Sec 4.2.2) splits those too, along the sequence: every term over t.
    Each value is rounded up to whole bytes; `activation_bytes_per_layer` sums them.
    """
    kv_heads = heads if kv_heads is None else kv_heads
    ffn = 4 * hidden if ffn is None else ffn
    if mlp not in ("gelu", "swiglu"):
        raise ValueError(f"mlp {mlp!r} is not one of: gelu, swiglu")
    sb = seq_len * micro_batch
    sbh = sb * hidden
    whole = {"norms": 4 * sbh, "qkv_input": 2 * sbh, "mlp_input": 2 * sbh, "dropout": 2 * sbh if dropout else 0}
    split = {"q": 2 * sbh, "kv": 4 * sb * kv_heads * (hidden // heads), "proj_input": 2 * sbh,
             "mlp_inner": (6 if mlp == "swiglu" else 4) * sb * ffn,
             "scores": (5 if dropout else 2) * heads * seq_len * seq_len * micro_batch}
    if sequence_parallel:
        whole = {k: _ceil_div(v, tp) for k, v in whole.items()}
    return {**whole, **{k: _ceil_div(v, tp) for k, v in split.items()}}


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none", *,
                               kv_heads: int | None = None, ffn: int | None = None, mlp: str = "gelu",
                               dropout: bool = True) -> int:
    """Bytes one transformer layer keeps for backward, 16-bit activations, on one of `tp` devices.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    Sec 4 and Table 2, with s = seq_len, b = micro_batch, h = hidden, a = heads, t = tp, for the
    GPT shape (the defaults):
      no parallelism                  s b h (34 + 5 a s / h)            (Sec 4.1)
      tensor parallel                 s b h (10 + 24/t + 5 a s / (h t)) (Sec 4.2.1)
      tensor + sequence parallel      s b h / t (34 + 5 a s / h)        (Sec 4.2.2)
      selective recompute             s b h (10 + 24/t), or 34 s b h / t with sequence parallel
      full recompute                  2 s b h, the layer's input only
    The 5 a s / h term is the attention scores (softmax output, dropout mask, dropout output).
    The 10 are what plain tensor parallelism leaves replicated on every rank: the two LayerNorm
    inputs (4), the inputs of the first attention and MLP linears (4), two dropout masks (2).
    With sequence parallelism the input kept by full recompute is sharded too (2 s b h / t);
    Table 2 lists only the 2 s b h of the replicated case.
    Kernels that never store the scores (FlashAttention, PyTorch's SDPA) drop the 5 a s / h term.

    `kv_heads` (grouped-query attention), `ffn` (the MLP's width, default 4h), `mlp` ("swiglu") and
    `dropout` (False: no masks, as the Llama family trains) give the Llama family's layer: the terms,
    their sources and the reasoning are `activation_terms`'s. The sum is rounded up once, per group of
    terms, as the GPT-shape formulas above are.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    sbh = seq_len * micro_batch * hidden
    if recompute == "full":
        return _ceil_div(2 * sbh, tp) if sequence_parallel else 2 * sbh
    # the terms unsplit, summed, then split once: the rounding of the formulas in the paper's form
    terms = activation_terms(seq_len, micro_batch, hidden, heads, kv_heads=kv_heads, ffn=ffn, mlp=mlp,
                             dropout=dropout)
    if recompute == "selective":
        terms["scores"] = 0
    whole = sum(terms[k] for k in ("norms", "qkv_input", "mlp_input", "dropout"))
    split = sum(terms.values()) - whole
    if sequence_parallel:
        return _ceil_div(whole + split, tp)
    return whole + _ceil_div(split, tp)


def trains_with_dropout(cfg) -> bool:
    """Whether the activation formula counts dropout's masks for this shape: the GPT shape as Korthikanti
    et al. count it (Megatron-LM's GPT-3 runs, attention and hidden dropout 0.1), whatever `cfg.dropout`
    says (the CPU presets train at 0); a shape with any of the Llama family's layer options only when
    `cfg.dropout` > 0, as LLaMA, Mistral and Llama 3 train without dropout. An untied head alone leaves
    the layers GPT's."""
    return cfg.dropout > 0 or not [o for o in family_options(cfg) if o != "an untied LM head"]


def layer_activation_bytes(cfg, micro_batch: int = 1, tp: int = 1, sequence_parallel: bool = False,
                           recompute: str = "none", seq_len: int | None = None) -> int:
    """`activation_bytes_per_layer` for a ModelConfig (its kv_heads, ffn, MLP and dropout; `seq_len`
    positions, default the shape's): 16-bit bytes of one of its layers on one of `tp` ranks.
    With experts each MLP is counted as one dense MLP of the experts' width: the routing's tensors
    and the top_k copies of each token's row are not counted."""
    return activation_bytes_per_layer(cfg.seq_len if seq_len is None else seq_len, micro_batch, cfg.hidden,
                                      cfg.heads, tp, sequence_parallel, recompute, kv_heads=cfg.n_kv_heads,
                                      ffn=cfg.ffn, mlp=cfg.mlp, dropout=trains_with_dropout(cfg))


def stage_layers(n_layers: int, pp: int) -> int:
    """The layers of a pipeline's fullest stage: L / pp when pp divides L, else ceil(L / pp). Megatron-DeepSpeed's
    pipeline (DeepSpeed's `PipelineModule`, partition "type:transformer") balances the layers as evenly as it can
    when pp does not divide them, as for BLOOM-176B's 70 layers on 12 stages (Le Scao et al. 2022, Sec. 3.4); the
    fullest stage holds the most and sets the pipeline's pace."""
    if not 1 <= pp <= n_layers:
        raise ValueError(f"pp ({pp}) must be between 1 and the {n_layers} layers: each stage holds at least one")
    return -(-n_layers // pp)


def estimate_memory(cfg=None, micro_batch: int = 1, precision: str = "mixed", dp: int = 1, tp: int = 1,
                    pp: int = 1, zero: int = 0, sequence_parallel: bool = False, recompute: str = "none",
                    bytes_override: dict | None = None, n_params: int | None = None,
                    offload: bool = False) -> dict[str, int]:
    """Bytes per device of a training step: the `labsupport memory` contract (DESIGN.md Sec 4).

    Returns integer bytes: `n_params` (the whole model, as published counts give it), and per device `params`, `grads`,
    `optimizer`, `activations`, `total`. With `offload=True` (ZeRO-Offload: the optimizer states
    and step on the host, see offload.py) also `host` (host memory for this device's share) and
    the PCIe bytes of one step: `pcie_to_host`, `pcie_to_device` and their sum `pcie`.
    Give a model shape `cfg`, or only `n_params`, in which case activations are unknown and
    reported as 0. A shape's model states include the rows that pad its vocabulary to a
    multiple of 64, as TinyGPT allocates them.

    Activations are those of the first pipeline stage, the fullest: under 1F1B it holds pp
    micro-batches in flight, each through L/pp layers, so L layers' worth whatever pp is
    (Korthikanti et al. 2022, Sec 4.2.3); this assumes at least pp micro-batches per step.
    A pp that does not divide the layers counts the fullest stage (`stage_layers`): its share of the
    model states, and pp micro-batches through its layers.
    Only the transformer layers are counted, not the embedding or the logits. The paper counts
    16-bit activations; we scale by the weights' bytes: x2 in fp32, a slight overestimate since
    the 1-byte dropout masks do not grow. The layer is the shape's own (`layer_activation_bytes`):
    Korthikanti's terms for the GPT shape, rederived for the Llama family's grouped-query attention,
    SwiGLU, RMSNorm and RoPE (`activation_terms`). A tp that does not split the heads, the key/value
    heads and the MLP's width into whole pieces is refused (`shapes.tensor_parallel_problems`).
    """
    if (cfg is None) == (n_params is None):
        raise ValueError("give either a model shape or a parameter count, not both or neither")
    if micro_batch < 1:
        raise ValueError(f"micro batch must be >= 1, got {micro_batch}")
    if min(dp, tp, pp) < 1:
        raise ValueError(f"dp, tp and pp must all be >= 1, got dp={dp} tp={tp} pp={pp}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    activations = 0
    if cfg is not None:
        if cfg.heads % tp:
            raise ValueError(f"heads ({cfg.heads}) must be divisible by tp ({tp})")
        if tensor_parallel_problems(cfg, tp):  # the key/value heads, the MLP's width
            raise ValueError(tensor_parallel_problems(cfg, tp)[0])
        fullest = stage_layers(cfg.n_layers, pp)
        if sequence_parallel and cfg.seq_len % tp:
            raise ValueError(f"seq_len ({cfg.seq_len}) must be divisible by tp ({tp}) for sequence parallelism")
        n_params = count_params(cfg)
        # memory also holds the vocabulary padding; the fullest stage pp x its layers' share of the model
        held = -(-count_params(cfg, padded=True) * fullest * pp // cfg.n_layers)
        per_layer = layer_activation_bytes(cfg, micro_batch, tp, sequence_parallel, recompute)
        activations = pp * fullest * per_layer
    n_params = int(n_params)
    states = model_state_bytes(held if cfg is not None else n_params, precision, dp, zero, tp * pp, bytes_override,
                               offload)
    activations = activations * _bytes_per_param(precision, bytes_override)["params"] // 2
    device = {k: states[k] for k in ("params", "grads", "optimizer")}
    est = {"n_params": n_params, **device, "activations": activations, "total": sum(device.values()) + activations}
    if offload:
        est.update({k: states[k] for k in ("host", "pcie_to_host", "pcie_to_device")},
                   pcie=states["pcie_to_host"] + states["pcie_to_device"])
    return est


def tinygpt_activation_bytes(cfg, micro_batch: int, dtype_bytes: int = 4) -> int:
    """Exact bytes TinyGPT(cfg) saves for backward at full context, parameters excluded: the GPT shape
    and the Llama family's options.

    Read off what each op's backward keeps (dropout 0, CPU, PyTorch 2.x eager autograd), with
    N = micro_batch * seq_len tokens, d = hidden, a = heads, g = kv_heads, e = d / a, f = the MLP's
    width, D = dtype_bytes; it is what `metrics.ActivationMeter` measures, to the byte. The meter
    counts storages: a saved view keeps, and counts, all of the tensor it views.
      embeddings     the token ids (N int64); with learned positions the position ids (seq_len int64)
      each norm      LayerNorm: its input, mean and rstd ((N d + 2N) D).
                     RMSNorm (torch's `rms_norm`, which on CPU runs as elementwise ops, in fp32 for
                     16-bit inputs): the fp32 input (a copy under bf16; the input itself in fp32), the
                     fp32 1/rms per row, and the fp32 normalized rows before the gain: (2 N d + N) x 4,
                     whatever D is. No mean: the one statistic is the 1/rms.
      attention      the qkv linear's input (N d D); the saved tensors of SDPA's CPU flash kernel: q,
                     k, v, the output (N d D) and the logsumexp (N a, fp32 even for bf16). v is a view
                     of the qkv output, so all of it is kept (N (a + 2g) e D); q and k are views of it
                     too, unless made anew: RoPE rotates q and k into new tensors (N d and N g e),
                     and with 1 < g < a, without RoPE, the query heads are gathered from their groups
                     into a copy (N d); multi-query (g = 1) and multi-head attention (g = a) read q as
                     a view. The kernel lays its output out as q is laid out: a view of qkv gives
                     the (b, t, a, e) layout the output projection reads as a view, a new q gives
                     (b, a, t, e), which the projection's input copies (N d D more).
                     RoPE: each of the two `rotate` calls keeps its fp32 cos and sin (seq_len x e / 2
                     each): 8 seq_len e bytes a layer, whatever the micro-batch.
      MLP            its input (N d D); GELU: the GELU's input and output, the projection's input
                     (2 N f D); SwiGLU: gate's output (the SiLU's input), the SiLU's output, up's output
                     (the product keeps both factors) and the product (down's input): 4 N f D.
      head           the final norm; the LM head's input (N d D), tied or untied alike; the
                     log-softmax output (N V D, V padded); the loss's targets (N int64) and its
                     total_weight, a 0-d tensor (D).
    The GPT shape: (16 N d + 4 N) D + 4 N a a layer. Unlike Korthikanti's 34 s b h + 5 a s^2 b
    (`activation_terms`), no s^2 term: the attention scores are not stored. The Llama family keeps
    more here than that formula's Megatron-LM kernels do: the SiLU's output (fused away in Megatron), the
    whole qkv output behind v, the projection's input copy, and RMSNorm's fp32 rows.
    Assumes the ids and targets own their storage (a view into a larger tensor counts it all).
    A mixture of experts (data-dependent rows per expert) is not counted: ValueError.
    """
    if cfg.experts:
        raise ValueError("tinygpt_activation_bytes counts the dense model: a mixture of experts keeps "
                         "data-dependent rows per expert")
    n, d, s, size = micro_batch * cfg.seq_len, cfg.hidden, cfg.seq_len, dtype_bytes
    a, g, e, f = cfg.heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn
    rope = cfg.positions == "rope"
    norm = (2 * n * d + n) * 4 if cfg.norm == "rmsnorm" else (n * d + 2 * n) * size
    q_made_anew = rope or 1 < g < a  # RoPE's rotation; the gather of several groups of several query heads
    attention = (n * d + n * (a + 2 * g) * e + n * d + (n * d if q_made_anew else 0) + (n * g * e if rope else 0)
                 + (n * d if q_made_anew else 0)) * size + n * a * 4 + (8 * s * e if rope else 0)
    mlp = (n * d + (4 if cfg.mlp == "swiglu" else 2) * n * f) * size
    per_layer = 2 * norm + attention + mlp
    head = norm + (n * d + n * cfg.padded_vocab + 1) * size
    ids = (2 * n + (s if cfg.positions == "learned" else 0)) * 8
    return cfg.n_layers * per_layer + head + ids


def scaled_shape(base, k: int):
    """The k-th shape of the family d = 128 L with heads of dimension 128 (so k layers and k heads),
    the rest (vocabulary, sequence, biases, the Llama family's options) as `base`, a ModelConfig. The
    22B and 175B presets lie on it (48 x 6144, 96 x 12288), as do Narayanan et al. 2021's Table 1 shapes
    up to 145.6B. A base with key/value heads of its own keeps its group size r = heads / kv_heads
    (k / r key/value heads, so r must divide k), and one with an MLP width of its own keeps its ratio
    ffn / hidden, rounded up to a multiple of 64 so that tp splits it (Llama 3's 3.5 and 3.25 x 128 k need
    no rounding): without them a Llama base's 8 key/value heads or 14,336 units would not fit k heads."""
    changes = dict(name=f"{k} x {128 * k}", n_layers=k, hidden=128 * k, heads=k)
    if base.kv_heads is not None:
        changes["kv_heads"] = k // (base.heads // base.n_kv_heads)
    if base.ffn_hidden is not None:
        changes["ffn_hidden"] = -(-base.ffn_hidden * 128 * k // (base.hidden * 64)) * 64
    return replace(base, **changes)


def largest_model_that_fits(capacity_bytes: float, base=None, **options) -> dict | None:
    """The largest model whose training step fits in `capacity_bytes` per device, or None.

    `options` are estimate_memory's (micro_batch, precision, dp, tp, pp, zero, offload, ...).
    With a `base` shape (a ModelConfig) the search walks the family `scaled_shape(base, k)`,
    k a multiple of lcm(tp r, pp) so that heads, key/value heads (r query heads each) and layers
    split; memory, activations included, grows with k, so bisection finds the largest k that fits.
    Without a shape it solves for the parameter count, model states only (they grow linearly with
    it), again by bisection.
    Returns estimate_memory's dict for it, with `shape` (the ModelConfig, or None) added.
    """
    def fits(est):
        return est["total"] <= capacity_bytes

    if base is None:
        def at(n):
            return {**estimate_memory(n_params=n, **options), "shape": None}
    else:
        group = base.heads // base.n_kv_heads if base.kv_heads is not None else 1  # query heads per key/value head
        step = math.lcm(options.get("tp", 1) * group, options.get("pp", 1))

        def at(n):
            cfg = scaled_shape(base, n * step)
            return {**estimate_memory(cfg, **options), "shape": cfg}
    lo, hi = 0, 1
    while fits(at(hi)):  # grow until it does not fit: the answer lies in [lo, hi)
        lo, hi = hi, 2 * hi
        if hi > 2**60:
            raise ValueError("every size fits: are the bytes per parameter all 0?")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(at(mid)) else (lo, mid)
    return at(lo) if lo else None
