"""What tensor parallelism communicates per optimizer step, predicted from the model's shape.

Shoeybi et al. 2019 ("Megatron-LM", Sec. 3 and Fig. 4): a transformer layer cut by columns then
rows needs two all-reduces in the forward pass (g, after attention's and the MLP's row-parallel
output) and two in the backward pass (f, before their column-parallel inputs), each over the
b x s x h activations of a micro-batch: four per layer per micro-batch.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models",
Sec. 4.2.2): with sequence parallelism each g becomes a reduce-scatter in forward (an all-gather
in backward) and each f an all-gather in forward (a reduce-scatter in backward): four all-gathers
and four reduce-scatters per layer, of the same b x s x h buffer. A ring all-reduce is a
reduce-scatter followed by an all-gather, so the bytes on the wire are the same. To store only
s/T positions of a column-parallel layer's input (what Table 2's 34 s b h / t assumes), the
input is all-gathered again in backward, as Megatron-LM does: two more all-gathers per layer.

Around the layers (labsupport.parallel.tensor's TinyGPT): the vocab-parallel embedding sums its
rows with one all-reduce in forward (and, under sequence parallelism, the scatter into the
sequence-parallel region all-gathers its gradient in backward); the LM head's input enters
through f (or the all-gather); the vocab-parallel cross-entropy all-reduces the softmax's
maximum and, together, the target logits and the denominators: b s and 2 b s fp32 numbers,
never the b s V logits. Per step, sequence parallelism adds one all-reduce of the LayerNorm
and row-parallel bias gradients, and the gradient norm one float64.

The Llama family (RMSNorm, SwiGLU, RoPE, grouped-query attention) moves the same bytes. Every
collective above is of a layer's input or output, b x s x h activations on the residual stream
(Shoeybi et al. Fig. 4: f before attention's and the MLP's first matrices, g after their last;
Korthikanti et al. Sec. 4.2.2 the same places under sequence parallelism); inside the parallel regions
nothing is sent. So neither the MLP's width nor its number of matrices, nor the number of
key/value heads, appears in the count: SwiGLU's gate and up read one input, which enters once
(Megatron-LM fuses the two into one `linear_fc1`; parallel/tensor.py's `ParallelSwiGLU` multiplies
their shards as one matrix), and grouped-query attention shrinks the qkv matrix, not its input or
proj's output. RoPE has no parameters and rotates the local heads, nothing sent. One count does
change, and only under sequence parallelism: an RMSNorm has one gain and no bias (Zhang & Sennrich
2019, eq. 4), so the "finish" all-reduce sums h numbers per norm where LayerNorm sums 2h (`norm`).
(Grouped-query attention does change context parallelism's traffic, whose ring passes K and V:
estimate/context.py.)

Full activation recomputation (Megatron's `--checkpoint-activations`, what Part II's 22B hands-on
passes): Korthikanti et al. 2022, Sec. 5, keep only each layer's input and recompute the rest "using an
extra forward pass during back-propagation". That pass runs the layer's forward collectives again, in
the backward pass, before the layer's own backward ones: without sequence parallelism 2 forward + 2
recomputed + 2 backward = 6 all-reduces per layer and micro-batch, 3/2 of the bytes (the phase
"recompute"). The embedding, the LM head and the loss are not recomputed (DeepSpeed's pipeline module,
as Megatron-DeepSpeed builds it, checkpoints only the transformer layers). Selective recomputation
(Sec. 5) reruns only the attention core, which communicates nothing.

Sizes are `payload_bytes` as labsupport.comm counts them (for all-gather and reduce-scatter the
full, unsharded buffer); `total` adds the wire bytes with nccl-tests' bus factors. `step_cost`
prices one step's collectives on a machine (alpha-beta, ring) beside the step's compute.
"""
from __future__ import annotations

from collections import defaultdict

from .comm_cost import BUS_FACTOR, collective_time
from .flops import TYPICAL_MFU, training_flops_per_token
from .machines import MACHINES, link
from .memory import RECOMPUTE
from .shapes import preset_shape, tensor_parallel_problems

LOSS_BYTES = 4   # the loss reduces fp32 numbers whatever the compute dtype
NORM_BYTES = 8   # the squared gradient norm is summed in float64


def _check_recompute(recompute: str) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")


def layer_comm(tokens: int, hidden: int, sequence_parallel: bool = False, bytes_per_element: int = 2,
               recompute: str = "none") -> dict:
    """{"forward": {op: (calls, payload_bytes)}, "backward": ...} of one transformer layer for
    one micro-batch of `tokens` = b x s positions (Shoeybi et al. Fig. 4; Korthikanti Sec. 4.2.2).

    `recompute` is "none", "selective" or "full" (memory.RECOMPUTE). Under "full" the forward pass
    runs a second time in backward (Korthikanti et al. 2022, Sec. 5: full activation recomputation,
    "an extra forward pass"), collectives included: a phase "recompute", between "forward" and
    "backward", holds the same ops as "forward". "selective" recomputes only the attention core
    (Q K^T, softmax, dropout, attention over V), inside the parallel region: no collective."""
    _check_recompute(recompute)
    size = tokens * hidden * bytes_per_element
    if sequence_parallel:
        forward = {"all_gather": (2, 2 * size), "reduce_scatter": (2, 2 * size)}
        backward = {"all_gather": (2 + 2, (2 + 2) * size),  # g's backward, then the inputs again
                    "reduce_scatter": (2, 2 * size)}
    else:
        forward = {"all_reduce": (2, 2 * size)}
        backward = {"all_reduce": (2, 2 * size)}
    if recompute == "full":
        return {"forward": forward, "recompute": dict(forward), "backward": backward}
    return {"forward": forward, "backward": backward}


PHASES = ("forward", "recompute", "backward", "finish", "clip")  # in the order a step runs them


def tp_comm(n_layers: int, hidden: int, seq_len: int, micro_batch: int, *, microbatches: int = 1,
            sequence_parallel: bool = False, bias: bool = True, bytes_per_element: int = 4,
            grad_bytes: int = 4, embedding: bool = True, head: bool = True, recompute: str = "none",
            norm: str = "layernorm") -> dict:
    """{phase: {op: {"calls", "payload_bytes"}}} one rank of a TP group sends per optimizer step,
    phases "forward", "recompute" (full recomputation's second forward pass of the layers, in
    backward: `layer_comm`) and "backward" (all micro-batches), "finish" (sequence parallelism's
    summed LayerNorm and bias gradients) and "clip" (the gradient norm). `bytes_per_element` is the
    activations' (2 under bf16 autocast), `grad_bytes` the gradients'. A pipeline stage holds
    `n_layers` of the layers, the embedding only on the first stage, the LM head and the loss only
    on the last (`embedding`, `head`); only the layers are recomputed. `norm` ("layernorm",
    "rmsnorm") and `bias` size the norms' and row-parallel biases' gradients that "finish" sums."""
    tokens = micro_batch * seq_len
    size = tokens * hidden * bytes_per_element
    phases = {name: defaultdict(lambda: {"calls": 0, "payload_bytes": 0}) for name in PHASES}

    def add(phase, op, calls, payload):
        phases[phase][op]["calls"] += calls
        phases[phase][op]["payload_bytes"] += payload

    for phase, ops in layer_comm(tokens, hidden, sequence_parallel, bytes_per_element, recompute).items():
        for op, (calls, payload) in ops.items():
            add(phase, op, n_layers * calls * microbatches, n_layers * payload * microbatches)
    for _ in range(microbatches):
        if embedding:
            add("forward", "all_reduce", 1, size)                    # the embedding's rows summed (g)
            if sequence_parallel:
                add("backward", "all_gather", 1, size)               # the scatter after the embedding
        if head:
            add("forward", "all_reduce", 2, 3 * tokens * LOSS_BYTES)  # the loss: max, then target logit + denominator
            if sequence_parallel:
                add("forward", "all_gather", 1, size)                # the LM head's input,
                add("backward", "all_gather", 1, size)               # again in backward
                add("backward", "reduce_scatter", 1, size)
            else:
                add("backward", "all_reduce", 1, size)               # the LM head's f
    if sequence_parallel:
        norm_size = 2 * hidden if bias and norm == "layernorm" else hidden  # a LayerNorm's weight (and bias);
        per_layer = 2 * norm_size + (2 * hidden if bias else 0)      # an RMSNorm's gain; two norms, two row biases
        add("finish", "all_reduce", 1, (n_layers * per_layer + (norm_size if head else 0)) * grad_bytes)
    add("clip", "all_reduce", 1, NORM_BYTES)
    return {name: {op: dict(c) for op, c in ops.items()} for name, ops in phases.items() if ops}


def total(phases: dict, tp: int) -> dict:
    """The phases summed into labsupport.comm's {op: {"calls", "payload_bytes", "wire_bytes"}}."""
    out = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "wire_bytes": 0})
    for ops in phases.values():
        for op, c in ops.items():
            out[op]["calls"] += c["calls"]
            out[op]["payload_bytes"] += c["payload_bytes"]
            out[op]["wire_bytes"] += int(round(BUS_FACTOR[op](tp) * c["payload_bytes"]))
    return {op: dict(c) for op, c in sorted(out.items())}


def step_cost(model: str = "22b", tp: int = 8, machine: str = "DGX H100", *, sequence_parallel: bool = False,
              micro_batch: int = 1, microbatches: int = 1, bytes_per_element: int = 2, seq_len: int | None = None,
              vocab: int | None = None, recompute: str = "none") -> dict:
    """One optimizer step of one rank of a TP group of `tp` devices on `machine`: what it sends and
    what that costs beside its compute (the comm-counter widget shows this).

    Returns a dict: `cfg` (the ModelConfig), `phases` ({phase: {op: calls, payload_bytes,
    wire_bytes}}), `total` (the same summed per op, as labsupport.comm counts a step), `alpha_s`,
    `gbps` and `crosses` (the link the ring's slowest hop uses, and whether that is the network),
    `comm_s` (the ring's alpha-beta time, `comm_cost.collective_time`), `flops` (the step's training
    FLOPs on this rank), `compute_s` (at flops.TYPICAL_MFU of the machine's bf16 peak, the pace of a
    well-tuned run) and `ratio` = comm_s / compute_s. T = 1 has no group: nothing is sent.
    `model` is a preset (a CPU preset gets `vocab`, default the shipped corpus's); `seq_len`
    replaces its context. `recompute` ("none", "selective", "full") adds the recomputed forward's
    collectives (`layer_comm`) and its FLOPs (`planner.recompute_flops_per_token`: under "full" a
    layer's forward again, 1/3 of the layer's training FLOPs, so 4/3 of its compute against 3/2 of
    its TP traffic); the recomputed FLOPs run at the same fraction of the peak as the others.
    """
    from .planner import recompute_flops_per_token  # planner imports this module

    _check_recompute(recompute)
    cfg = preset_shape(model, vocab, seq_len=seq_len)
    cannot = tensor_parallel_problems(cfg, tp)
    if cannot:
        raise ValueError(f"{cfg.name} over T = {tp} ranks: T must divide its heads, key/value heads and MLP width; "
                         + "; ".join(cannot))
    alpha, gbps = link(machine, tp)  # refuses an unknown machine
    m = MACHINES[machine]
    step = {} if tp == 1 else tp_comm(cfg.n_layers, cfg.hidden, cfg.seq_len, micro_batch, microbatches=microbatches,
                                      sequence_parallel=sequence_parallel, bias=cfg.bias, norm=cfg.norm,
                                      bytes_per_element=bytes_per_element, recompute=recompute)
    phases = {phase: total({phase: ops}, tp) for phase, ops in step.items()}
    per_op = total(step, tp)
    # The alpha-beta time is linear in the bytes, so calls of different sizes cost what as many
    # calls of their mean size cost.
    comm_s = sum(c["calls"] * collective_time(op, "ring", c["payload_bytes"] / c["calls"], tp, alpha, 1 / (gbps * 1e9))
                 for op, c in per_op.items())
    flops = ((training_flops_per_token(cfg) + recompute_flops_per_token(cfg, recompute))
             * micro_batch * cfg.seq_len * microbatches / tp)
    compute_s = flops / (m.peak_tflops_bf16 * 1e12 * TYPICAL_MFU)
    return {"cfg": cfg, "phases": phases, "total": per_op, "alpha_s": alpha, "gbps": gbps,
            "crosses": tp > m.devices_per_node, "comm_s": comm_s, "flops": flops, "compute_s": compute_s,
            "ratio": comm_s / compute_s}
