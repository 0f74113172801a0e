"""Bytes per device for training: model states (ZeRO) and activations (Korthikanti et al.).

Model states are parameters, gradients and optimizer states; they scale with the parameter
count and are what ZeRO shards over data-parallel ranks. Activations are what the forward
pass keeps for the backward pass; they scale with batch and sequence and are what sequence
parallelism and recomputation shrink. Tensor and pipeline parallelism split both.
ZeRO-Offload moves the optimizer states to the host (offload.py); `largest_model_that_fits`
turns the estimate around: the largest model a device holds.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import replace

from .offload import offloaded_states
from .params import count_params

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


def activation_bytes_per_layer(seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                               sequence_parallel: bool = False, recompute: str = "none") -> int:
    """Bytes one transformer layer keeps for backward, 16-bit activations, on one of `tp` devices.

    Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    Sec 4 and Table 2, with s = seq_len, b = micro_batch, h = hidden, a = heads, t = tp:
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
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    sbh = seq_len * micro_batch * hidden
    scores = 5 * heads * seq_len * seq_len * micro_batch  # s b h * 5 a s / h
    if recompute == "full":
        return _ceil_div(2 * sbh, tp) if sequence_parallel else 2 * sbh
    if recompute == "selective":
        scores = 0
    if sequence_parallel:
        return _ceil_div(34 * sbh + scores, tp)
    return 10 * sbh + _ceil_div(24 * sbh + scores, tp)


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
    Only the transformer layers are counted, not the embedding or the logits. The paper counts
    16-bit activations; we scale by the weights' bytes: x2 in fp32, a slight overestimate since
    the 1-byte dropout masks do not grow.
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
        if cfg.n_layers % pp:
            raise ValueError(f"layers ({cfg.n_layers}) must be divisible by pp ({pp})")
        if sequence_parallel and cfg.seq_len % tp:
            raise ValueError(f"seq_len ({cfg.seq_len}) must be divisible by tp ({tp}) for sequence parallelism")
        n_params = count_params(cfg)
        held = count_params(cfg, padded=True)  # memory also holds the vocabulary padding
        per_layer = activation_bytes_per_layer(cfg.seq_len, micro_batch, cfg.hidden, cfg.heads, tp,
                                               sequence_parallel, recompute)
        activations = cfg.n_layers * per_layer
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
    """Exact bytes TinyGPT(cfg) saves for backward at full context, parameters excluded.

    Read off what each op keeps (dropout 0, CPU, PyTorch 2.x) with N = micro_batch * seq_len
    tokens and d = hidden; it is what `metrics.ActivationMeter` measures, to the byte:
      embeddings       the token ids (N int64) and position ids (seq_len int64)
      each layer       LayerNorm 1: input, mean, rstd (N d + 2N); qkv linear: its input (N d);
                       attention (CPU flash kernel): q, k, v, which share the qkv output (3 N d),
                       the output (N d), which the projection then saves as a view, and the
                       logsumexp (N heads, fp32 even for bf16); LayerNorm 2: residual, mean,
                       rstd (N d + 2N); fc: its input (N d); GELU: its input (4 N d);
                       MLP projection: its input (4 N d). In all 16 N d + 4 N floats + N heads fp32.
      head             final LayerNorm (N d + 2N); LM head input (N d); log-softmax output (N V, V padded);
                       the loss's targets (N int64) and its total_weight, a 0-d tensor (one float).
    Unlike Korthikanti's 34 s b h + 5 a s^2 b, no s^2 term: the attention scores are not stored.
    Assumes the ids and targets own their storage (a view into a larger tensor counts it all).
    """
    n, d = micro_batch * cfg.seq_len, cfg.hidden
    per_layer = (16 * n * d + 4 * n) * dtype_bytes + n * cfg.heads * 4
    head = (2 * n * d + 2 * n + n * cfg.padded_vocab + 1) * dtype_bytes
    ids = (2 * n + cfg.seq_len) * 8
    return cfg.n_layers * per_layer + head + ids


def scaled_shape(base, k: int):
    """The k-th shape of the family d = 128 L with heads of dimension 128 (so k layers and k heads),
    the rest (vocabulary, sequence, biases) as `base`, a ModelConfig. The 22B and 175B presets lie on it
    (48 x 6144, 96 x 12288), as do Narayanan et al. 2021's Table 1 shapes up to 145.6B."""
    return replace(base, name=f"{k} x {128 * k}", n_layers=k, hidden=128 * k, heads=k)


def largest_model_that_fits(capacity_bytes: float, base=None, **options) -> dict | None:
    """The largest model whose training step fits in `capacity_bytes` per device, or None.

    `options` are estimate_memory's (micro_batch, precision, dp, tp, pp, zero, offload, ...).
    With a `base` shape (a ModelConfig) the search walks the family `scaled_shape(base, k)`,
    k a multiple of lcm(tp, pp) so that heads and layers split; memory, activations included,
    grows with k, so bisection finds the largest k that fits. Without a shape it solves for the
    parameter count, model states only (they grow linearly with it), again by bisection.
    Returns estimate_memory's dict for it, with `shape` (the ModelConfig, or None) added.
    """
    def fits(est):
        return est["total"] <= capacity_bytes

    if base is None:
        def at(n):
            return {**estimate_memory(n_params=n, **options), "shape": None}
    else:
        step = math.lcm(options.get("tp", 1), options.get("pp", 1))

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
