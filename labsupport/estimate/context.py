"""What context parallelism costs: the split's rules, the memory per rank and the ring's traffic.

Context parallelism (CP) cuts the sequence over `cp` ranks; ring attention (Liu et al. 2023,
"Ring Attention with Blockwise Transformers for Near-Infinite Context") passes the key/value
blocks around the ring so that every query still sees every earlier key. With a causal mask the
balanced split gives each rank one chunk from the front and one from the back of the sequence
(2 cp chunks of s / (2 cp) positions), as Llama 3 (Dubey et al. 2024, Sec 3.3.2) and Megatron-LM's
context parallelism do, so every rank computes the same number of scores. (Striped Attention,
Brandon et al. 2023, balances the same work with another assignment: rank r holds the positions
r, r + cp, r + 2 cp, ...)

Grouped-query attention (Ainslie et al. 2023; the Llama family) gives K and V kv_heads heads of
head_dim features, h_kv = kv_heads head_dim = h kv_heads / heads wide: the ring passes them grouped
(parallel/context.py), so its bytes shrink by heads / kv_heads (`kv_hidden` below; 4 for Llama 3 8B,
32 query heads on 8 key/value heads). The queries, the output and the log-sum-exp keep every head.

Sizes are bytes per rank, for one layer and one micro-batch: b = micro_batch, c = seq_len / cp (the
block each rank holds), h = the hidden size of the heads this rank computes (hidden / tp), h_kv the
width of its K (and V) heads (h under multi-head attention), except
`long_sequence_memory`: what a device holds at the peak of a training step on long sequences, model
states, activations, the sequence-parallel gather, and the larger of the working set of the layer in
its backward and the logits.
"""
from __future__ import annotations

from .memory import RECOMPUTE, activation_bytes_per_layer, model_state_bytes
from .params import count_params

GRAD_BYTES = 4  # the travelling dK and dV sums are kept in fp32, whatever the compute dtype
LSE_BYTES = 4   # the log-sum-exp of each query row, fp32


def split_problems(seq_len: int, cp: int, balanced: bool = True) -> list[str]:
    """What is wrong with cutting `seq_len` positions over `cp` ranks, one line each (none: fine)."""
    if cp < 1:
        return [f"--cp {cp} must be at least 1"]
    chunks = 2 * cp if balanced else cp
    if seq_len % chunks:
        how = f"2 x cp = {chunks} chunks (the balanced split)" if balanced else f"{cp} ranks"
        return [f"the sequence length {seq_len} does not split into {how}; use a multiple of {chunks}"]
    return []


def kv_block_bytes(seq_len: int, micro_batch: int, hidden: int, cp: int, dtype_bytes: int = 2) -> int:
    """One rank's block of b c `hidden` elements: its K (or V) block with `hidden` = h_kv, its queries
    or output with h."""
    return micro_batch * (seq_len // cp) * hidden * dtype_bytes


def attention_memory(seq_len: int, micro_batch: int, hidden: int, heads: int, cp: int = 1,
                     dtype_bytes: int = 2, *, kv_hidden: int | None = None) -> dict[str, int]:
    """Bytes of one ring attention per rank: `saved` for backward, `in_flight` K/V blocks, `total`.
    `kv_hidden`: the width h_kv of K and V, kv_heads x head_dim (default `hidden`: multi-head attention).

    Liu et al. 2023, Sec 3 and Table 1: ring attention keeps 6 b c h per layer: the query, the
    output, the key and value block it computes with, and the key and value block it receives
    meanwhile. Here `saved` is what the backward needs: q, k, v and the output (2 b c h + 2 b c h_kv)
    and the log-sum-exp of each query row (b c heads in fp32), as FlashAttention keeps (Dao et al.
    2022); no c x c scores. `in_flight` are the received K/V blocks alive at once in the forward pass:
    with cp = 2 one pair arrives (2 b c h_kv, so 6 b c h with `saved` under multi-head attention, the
    paper's figure); with more ranks the next pair arrives while the last received one is computed
    with (4 b c h_kv). Grouped K/V are never repeated over the query heads (parallel/context.py), so
    they and their blocks in flight are heads / kv_heads smaller than multi-head attention's.
    """
    c = seq_len // cp
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    block = kv_block_bytes(seq_len, micro_batch, hidden, cp, dtype_bytes)
    kv_block = kv_block_bytes(seq_len, micro_batch, kv_hidden, cp, dtype_bytes)
    saved = 2 * block + 2 * kv_block + micro_batch * c * heads * LSE_BYTES
    in_flight = 2 * kv_block * min(cp - 1, 2)
    return {"saved": saved, "in_flight": in_flight, "total": saved + in_flight}


def activation_bytes(seq_len: int, micro_batch: int, hidden: int, heads: int, cp: int = 1, tp: int = 1,
                     sequence_parallel: bool = False, dtype_bytes: int = 2, *, kv_hidden: int | None = None) -> int:
    """One transformer layer's activations per rank under CP: the layer's activations divided by cp,
    plus the K/V blocks in flight.

    Every activation Korthikanti et al. 2022 count (memory.activation_bytes_per_layer) belongs to
    one position, so each rank keeps them for its s / cp positions. Ring attention stores no
    scores (the 5 a s^2 b term), as with selective recomputation. In flight: `attention_memory`, of K/V
    `kv_hidden` wide (kv_heads x head_dim, all TP ranks' together; default `hidden`).
    """
    per_rank = activation_bytes_per_layer(seq_len // cp, micro_batch, hidden, heads, tp=tp,
                                          sequence_parallel=sequence_parallel, recompute="selective")
    local_hidden, kv_hidden = hidden // tp, (hidden if kv_hidden is None else kv_hidden) // tp
    return per_rank + attention_memory(seq_len, micro_batch, local_hidden, heads // tp, cp, dtype_bytes,
                                       kv_hidden=kv_hidden)["in_flight"]


def stage_activation_bytes(n_layers: int, seq_len: int, micro_batch: int, hidden: int, heads: int, cp: int,
                           tp: int = 1, recompute: str = "none", dtype_bytes: int = 2, *,
                           sequence_parallel: bool = False, kv_hidden: int | None = None) -> int:
    """What the first pipeline stage keeps under CP: `n_layers` layers' activations for s / cp
    positions, plus the K/V blocks in flight once.

    As `memory.estimate_memory` counts a stage (L layers' worth under 1F1B, Korthikanti et al. 2022,
    Sec 4.2.3), each layer divided by cp as in `activation_bytes`, without scores (ring attention
    stores none, so "none" keeps what "selective" keeps); full recomputation keeps each layer's
    input only. The received blocks live while one layer's attention runs, so they count once; they are
    `kv_hidden` wide (grouped-query attention's kv_heads x head_dim over all TP ranks; default `hidden`).
    `sequence_parallel` shards what plain TP leaves replicated (Korthikanti Sec 4.2.2).
    """
    kept = "full" if recompute == "full" else "selective"
    per_layer = activation_bytes_per_layer(seq_len // cp, micro_batch, hidden, heads, tp=tp,
                                           sequence_parallel=sequence_parallel, recompute=kept)
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    in_flight = attention_memory(seq_len, micro_batch, hidden // tp, heads // tp, cp, dtype_bytes,
                                 kv_hidden=kv_hidden // tp)["in_flight"]
    return n_layers * per_layer + in_flight


LOGIT_BYTES = 4  # the loss is computed on fp32 logits
ACTIVATION_BYTES = 2  # the 16-bit activations Korthikanti et al. count, and the logits before their fp32 copy


def long_sequence_memory(cfg, seq_len: int, *, tp: int = 1, cp: int = 1, pp: int = 1, dp: int = 1, zero: int = 0,
                         microbatches: int = 1, micro_batch: int = 1, recompute: str = "selective",
                         precision: str = "mixed", sequence_parallel: bool = True) -> dict:
    """Bytes per device at the peak of a training step on sequences of `seq_len` positions:
    {"params", "grads", "optimizer", "states" (their sum), "activations", "gathered", "working",
    "logits", "total", "stage", "stages"}.

    Model states (Rajbhandari et al. 2020, "ZeRO", Sec 3.1 and 5.1; `memory.model_state_bytes`):
    the parameters of `cfg` as it is (its own learned positions: the count does not grow with
    `seq_len`; a long-context model's rotary positions hold no parameters either), split evenly
    over tp x pp. ZeRO shards them over the dp x cp ranks, which all hold the same weights:
    Megatron-LM builds its distributed optimizer on that group
    (`get_data_parallel_group(with_context_parallel=True)`).

    Activations kept for the backward (Korthikanti et al. 2022, "Reducing Activation Recomputation
    in Large Transformer Models", Sec 4 and Table 2; `memory.activation_bytes_per_layer`, 16-bit,
    sequence-parallel with tp unless told otherwise): each layer's for this rank's s / cp
    positions. No scores: "selective" is a kernel that stores none (FlashAttention, ring attention);
    "none" keeps them, and only without CP (ring attention never forms them whole); "full" keeps
    each layer's input only. A pipeline stage holds its L / pp layers once for every micro-batch in
    flight: under 1F1B the first stage has min(m, pp) of them (Narayanan et al. 2021, Sec 2.2.1;
    with m >= pp, L layers' worth, as Korthikanti Sec 4.2.3 counts it), the last stage one.

    Gathered: under sequence parallelism a rank keeps its s / (cp tp) positions of each linear's
    input and all-gathers the s / cp of them before the linear runs, forward and again backward
    (Korthikanti Sec 4.2.2): 2 b (s / cp) h bytes alive whenever a layer or the output layer runs.
    Megatron-LM gathers into one buffer it keeps and reuses (`get_global_memory_buffer()`, "mpu").
    None without sequence parallelism (the inputs are then replicated and counted as kept) or tp 1.

    Working set of the one layer whose backward runs: with full recomputation that layer's
    activations, rematerialised (what "selective" keeps of one layer); under CP the K/V blocks in
    flight (`attention_memory`: kv_heads key/value heads, grouped), once and not once per layer, as
    `stage_activation_bytes` counts them.

    Logits, on the last stage, at the loss: the 16-bit logits 2 b (s / cp) V / tp (V the padded
    vocabulary) beside their fp32 copy, 4 b (s / cp) V / tp. Megatron-LM computes the loss on
    `logits.float()` unless `--fp16-lm-cross-entropy` is given, and keeps that copy for the backward
    (Korthikanti et al. 2022 count the same 4 s b v / t); the 16-bit tensor lives until the loss
    returns, and the loss's backward casts its fp32 gradient back to 16 bits, 6 bytes again.

    `total` is the peak, for the fuller of the first and the last pipeline stage (`stage`; "only"
    without PP; `stages` gives each one's): states + kept activations + gathered + the larger of the
    working set and the logits. Those two are never alive together: the logits and their gradient
    are freed once the output layer's backward has run, before the last layer is recomputed, and
    the K/V blocks travel only while a layer's attention runs. It leaves out the gradients a
    layer's backward allocates, the loss's own temporaries, the embedding's dropout mask, the
    allocator's fragmentation and the communication libraries' buffers.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    if recompute == "none" and cp > 1:
        raise ValueError("ring attention stores no scores: under CP use recompute='selective' or 'full'")
    if cfg.n_layers % pp or cfg.heads % tp or seq_len % (cp * tp if sequence_parallel else cp):
        raise ValueError(f"{cfg.n_layers} layers, {cfg.heads} heads and {seq_len} positions must split over "
                         f"pp {pp}, tp {tp} and cp {cp}"
                         + (" x tp (sequence parallelism)" if sequence_parallel else ""))
    local = seq_len // cp
    states = model_state_bytes(count_params(cfg, padded=True), precision, dp=dp * cp, zero=zero, model_parallel=tp * pp)
    states["states"] = states["params"] + states["grads"] + states["optimizer"]

    def layer(kept: str) -> int:
        return activation_bytes_per_layer(local, micro_batch, cfg.hidden, cfg.heads, tp, sequence_parallel, kept)

    per_layer = layer(recompute)
    in_flight = attention_memory(seq_len, micro_batch, cfg.hidden // tp, cfg.heads // tp, cp,
                                 kv_hidden=cfg.n_kv_heads * cfg.head_dim // tp)["in_flight"]  # grouped K/V travel
    working = in_flight + (layer("selective") if recompute == "full" else 0)
    gathered = ACTIVATION_BYTES * micro_batch * local * cfg.hidden if sequence_parallel and tp > 1 else 0
    logits = -(-(ACTIVATION_BYTES + LOGIT_BYTES) * micro_batch * local * cfg.padded_vocab // tp)
    layers = cfg.n_layers // pp
    kept = {"only": (layers * per_layer, logits)} if pp == 1 else {
        "first": (min(microbatches, pp) * layers * per_layer, 0), "last": (layers * per_layer, logits)}
    stages = {name: states["states"] + activations + gathered + max(working, stage_logits)
              for name, (activations, stage_logits) in kept.items()}
    stage = max(stages, key=stages.get)
    activations, stage_logits = kept[stage]
    return {**states, "activations": activations, "gathered": gathered, "working": working, "logits": stage_logits,
            "total": stages[stage], "stage": stage, "stages": stages}


def ring_traffic(seq_len: int, micro_batch: int, hidden: int, cp: int, dtype_bytes: int = 2, *,
                 kv_hidden: int | None = None) -> dict:
    """What one rank sends in one layer's ring attention: {"forward"|"backward": {"calls", "payload_bytes"}}.
    `kv_hidden`: the width h_kv of K and V, kv_heads x head_dim (default `hidden`: multi-head attention).

    Liu et al. 2023, Sec 3: in each of the cp steps a rank computes with one K/V block while it
    sends that block on; a block needs cp - 1 hops to have visited every rank, so the forward
    sends K and V cp - 1 times each, 2 (cp - 1) b c h_kv elements. The backward passes K and V the
    same way, and beside them the sums of dK and dV for each block, which collect each rank's
    contribution and reach the block's owner after cp - 1 hops (2 (cp - 1) more sends, in fp32).
    Each send has its receive on the neighbour: the receives are the same calls and bytes. Only K
    and V travel, so under grouped-query attention every byte is kv_heads / heads of multi-head
    attention's (the calls are the same).
    """
    hops = cp - 1
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    kv = kv_block_bytes(seq_len, micro_batch, kv_hidden, cp, dtype_bytes)
    grads = kv_block_bytes(seq_len, micro_batch, kv_hidden, cp, GRAD_BYTES)
    return {"forward": {"calls": 2 * hops, "payload_bytes": 2 * hops * kv},
            "backward": {"calls": 4 * hops, "payload_bytes": 2 * hops * (kv + grads)}}


def min_block_for_overlap(peak_flops: float, link_bytes_per_s: float) -> float:
    """The smallest block c (positions per rank) for which computing with a K/V block takes at least
    as long as sending it, so the ring's communication hides behind compute: c >= F / B.

    Liu et al. 2023, Sec 3: a block costs 4 d c^2 FLOPs (q k^T and the product with v) and its K
    and V 4 c d bytes in 16 bits, so 4 d c^2 / F >= 4 c d / B. Their table of minimal block sizes:
    about 1K positions for an A100 (312 TFLOPS bf16) over NVLink (300 GB/s).
    """
    return peak_flops / link_bytes_per_s
