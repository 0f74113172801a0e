"""The 3D-parallel planner: how to lay out a model's training over a machine's GPUs.

For a model shape, a machine and a number of GPUs, `plan` enumerates every layout
(dp, tp, pp, cp, micro-batch, ZeRO stage, recomputation) that splits the model evenly, drops those
that do not fit in a GPU's memory (`memory.estimate_memory`), predicts each one's step time,
and ranks the rest, fastest first. `why` says in words why the best ones win; `explain_no_fit`
says why a model fits nowhere; `search` samples layouts at random, as the workshop's DeepHyper
search did, and records its trajectory.

The step time is an additive model, the analysis of Narayanan et al. 2021 ("Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Sec. 3):

    step = compute + TP all-reduces + CP ring sends + PP sends + DP gradient sync + pipeline bubble

each term priced on the link its group crosses. Ranks are laid out as labsupport's Mesh lays
them out (grid.py), TP fastest, then CP, then PP, then DP: a TP group is tp consecutive ranks, a
CP group spans tp x cp ranks (Megatron-LM's context parallelism pairs each GPU with "its
counterparts in other TP groups"), a pipeline tp x cp x pp ranks, a DP group all of them. A
group whose ranks fit in one node talks over the node's links, else over the network
(`group_link`). So TP beyond a node pays the network for its four all-reduces per layer and
micro-batch (six with full recomputation), and the planner reproduces Narayanan's guidance
(Sec. 3.2 and 3.3, takeaways #1 and #2): TP up to the GPUs of a node, PP across nodes, model parallelism
only as large as memory needs, data parallelism for the rest; and (Sec. 2.2.1) many more
micro-batches than stages. `plan` proposes the 1F1B schedule with nothing overlapping
communication and compute; `evaluate` also prices the interleaved schedule (`virtual` chunks per
stage) and a framework's overlaps (`step_time.Framework`), which the published runs of
`validation.py` used. Stages hold whole layers, the fullest setting the pace; the LM head runs on
the last stage beside the layers left over (the embedding is not placed).

Context parallelism (CP, estimate/context.py) cuts each sequence over cp ranks with ring
attention (Liu et al. 2023) and the balanced causal split: each rank holds s / cp positions'
activations, and the ring passes K and V blocks between them. It is the axis for long sequences:
at 128k tokens the activations alone outgrow a GPU whatever TP and PP do (as this planner models
TP, without sequence parallelism), and Llama 3 trained its 128k stage with CP 16 next to TP 8
and PP 16 (Dubey et al. 2024, Sec. 3.3.2 and Table 4).
"""
from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import NamedTuple

from ..ds_config import ds_config
from .comm_cost import all_gather_ring, all_reduce_ring, reduce_scatter_ring
from .context import min_block_for_overlap, ring_traffic, split_problems, stage_activation_bytes
from .flops import training_flops_per_token
from .machines import DGX_A100, DGX_H100, FRONTIER, Machine
from .memory import BYTES_PER_PARAM, RECOMPUTE, estimate_memory, stage_layers
from .params import count_params
from .shapes import tensor_parallel_problems
from .simulator import bubble_over_ideal
from .step_time import Framework, head_s, layer_s, optimizer_s
from .tp_comm import layer_comm

# The names `labsupport plan --machine` takes.
MACHINE_NAMES = {"frontier": FRONTIER, "dgx-a100": DGX_A100, "dgx-h100": DGX_H100}

# The share of step_time's rates (each kernel at the device's best measured rate) that a whole training
# step reaches: a residual, fitted once to Narayanan et al. 2021's Table 1 (the median over its ten A100
# runs of measured over predicted with a share of 1; the ten lie between 0.80 and 0.87; a test re-derives
# it). Whatever the model misses on those runs (launch gaps, synchronization, clocks under sustained load,
# and its own errors in communication and the bubble) is folded into the compute. It is taken for every
# device; validation.py holds the result against 17 runs it was not fitted to, on A100, H100 and MI250X.
EFFICIENCY = 0.835
# The share of a GPU's memory the estimate may fill: an assumption. estimate_memory leaves out the
# allocator's fragmentation, communication buffers, the embedding's and logits' activations.
USABLE_MEMORY = 0.9
MICRO_BATCHES = (1, 2, 4, 8)
ZERO_STAGES = (0, 1)
ACTIVATION_BYTES = 2   # 16-bit activations cross TP and PP links


class NoFit(ValueError):
    """No layout fits: the message says what the leanest one needs."""


@dataclass(frozen=True)
class Config:
    """One layout and what the model predicts for it; times are seconds per optimizer step."""

    dp: int
    tp: int
    pp: int
    cp: int
    micro_batch: int
    zero: int
    recompute: str
    microbatches: int        # m: micro-batches per step through each pipeline
    memory_per_gpu: int      # bytes, estimate_memory's total
    fits: bool               # memory_per_gpu <= USABLE_MEMORY x the GPU's memory
    compute_s: float
    tp_comm_s: float
    cp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float
    bubble_s: float
    virtual: int = 1         # v: model chunks per stage (Narayanan et al. 2021's interleaved schedule)

    @property
    def step_time_s(self) -> float:
        return self.compute_s + self.tp_comm_s + self.cp_comm_s + self.pp_comm_s + self.dp_comm_s + self.bubble_s

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    def to_json(self) -> dict:
        return {**asdict(self), "step_time_s": self.step_time_s}


def check_machine(machine: Machine) -> None:
    """ValueError, one line, if a value of the machine is missing or not positive."""
    for field in ("devices_per_node", "intra_gbps", "inter_gbps", "peak_tflops_bf16", "memory_gb"):
        value = getattr(machine, field, None)
        if value is None:
            raise ValueError(f"machine {machine.name!r}: {field} is missing")
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"machine {machine.name!r}: {field} must be > 0, got {value!r}")
    if int(machine.devices_per_node) != machine.devices_per_node:
        raise ValueError(f"machine {machine.name!r}: devices_per_node must be a whole number, "
                         f"got {machine.devices_per_node!r}")
    for field in ("intra_alpha_s", "inter_alpha_s"):
        value = getattr(machine, field, None)
        if not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"machine {machine.name!r}: {field} must be >= 0, got {value!r}")


def recompute_flops_per_token(cfg, recompute: str) -> int:
    """FLOPs per token that recomputation adds to `flops.training_flops_per_token`.

    full: one more forward pass of every layer, 24 h^2 + 4 s h per token and layer. Narayanan et
    al. 2021, Sec. 5.1, eq. (3): 96 B s l h^2 (1 + s/6h + V/16lh) FLOPs per step with full
    recomputation against 72 B s l h^2 (1 + s/6h + V/12lh) without; the LM head is not recomputed.
    selective: only the attention core (Q K^T, softmax, dropout, attention over V) runs again,
    Korthikanti et al. 2022, Sec. 5: its matmuls are 4 s h per token and layer.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    h, s = cfg.hidden, cfg.seq_len
    per_layer = {"none": 0, "selective": 4 * s * h, "full": 24 * h * h + 4 * s * h}[recompute]
    return cfg.n_layers * per_layer


def step_flops(cfg, global_batch: int, recompute: str = "none") -> int:
    """FLOPs the GPUs execute in one optimizer step of `global_batch` sequences."""
    per_token = training_flops_per_token(cfg) + recompute_flops_per_token(cfg, recompute)
    return per_token * global_batch * cfg.seq_len


def _check_counts(gpus, global_batch) -> None:
    for name, value in (("gpus", gpus), ("global batch", global_batch)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")


def check_layout(cfg, gpus: int, global_batch: int, dp=None, tp=None, pp=None, micro_batch=None,
                 zero=None, recompute=None, cp=None) -> None:
    """ValueError, one line, for a degree that cannot work; None means "let the planner choose"
    (cp is 1 when dp, tp and pp are all given: nothing is left for it to choose)."""
    _check_counts(gpus, global_batch)
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp), ("micro batch", micro_batch)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {value!r}")
    if cp is not None and split_problems(cfg.seq_len, cp):
        raise ValueError(split_problems(cfg.seq_len, cp)[0])
    if tp is not None and cfg.heads % tp:
        raise ValueError(f"tp {tp} does not divide the {cfg.heads} attention heads; pick a divisor of {cfg.heads}")
    if tp is not None and tensor_parallel_problems(cfg, tp):  # grouped-query attention, an MLP width of its own
        raise ValueError(f"{tensor_parallel_problems(cfg, tp)[0]}: each rank holds whole key/value heads and whole "
                         f"MLP units (parallel/tensor.py)")
    if pp is not None and pp > cfg.n_layers:
        raise ValueError(f"pp {pp} is more stages than the {cfg.n_layers} layers; pick at most {cfg.n_layers}")
    given = {name: v for name, v in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)) if v is not None}
    if cp == 1:  # a factor of 1 changes no product: name it only when it splits something
        del given["cp"]
    product = math.prod(given.values())
    names = " x ".join(given)
    if None not in (dp, tp, pp) and product != gpus:
        raise ValueError(f"{names} = {' x '.join(map(str, given.values()))} = {product}, not the {gpus} GPUs; "
                         f"make their product {gpus}")
    if gpus % product:
        raise ValueError(f"{names} = {product} does not divide the {gpus} GPUs; use a multiple of {product} GPUs")
    if dp is not None and global_batch % (dp * (micro_batch or 1)):
        raise ValueError(f"global batch {global_batch} is not a multiple of dp x micro-batch = "
                         f"{dp} x {micro_batch or 1}")
    if micro_batch is not None and global_batch % micro_batch:
        raise ValueError(f"global batch {global_batch} is not a multiple of the micro-batch {micro_batch}")
    if zero is not None and zero not in ZERO_STAGES:
        raise ValueError(f"zero must be one of {', '.join(map(str, ZERO_STAGES))} for the planner, got {zero!r}")
    if zero and dp == 1 and (cp or 1) == 1:
        raise ValueError("ZeRO-1 on one data-parallel rank shards nothing; use zero 0 or more dp")
    if recompute is not None and recompute not in RECOMPUTE:
        raise ValueError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")


def group_link(machine: Machine, span: int) -> tuple[float, float]:
    """(alpha in s, GB/s) for a group whose ranks lie within `span` consecutive ranks.

    As `machines.link`, and one more condition: such blocks stay inside nodes only when `span`
    divides the devices per node (a block of 6 on nodes of 8 straddles two nodes every other time).
    """
    if machine.devices_per_node % span == 0:
        return machine.intra_alpha_s, machine.intra_gbps
    return machine.inter_alpha_s, machine.inter_gbps


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def context_degrees(seq_len: int, machine: Machine) -> list[int]:
    """The cp the planner tries: 1, and each degree the balanced split allows (2 cp divides s) whose
    block of c = s / cp positions is at least Liu et al.'s F / B for the node's links
    (`context.min_block_for_overlap`, Sec. 3). A smaller block's K/V sends take longer than its
    attention even inside a node, so the ring could never hide behind compute. The step time still
    charges the ring in full (nothing overlaps here); this only keeps out degrees that cannot pay.
    At 2048 tokens it leaves cp = 1 on all three machines (F / B is 1040 to 3830 positions).
    """
    least = min_block_for_overlap(machine.peak_tflops_bf16 * 1e12, machine.intra_gbps * 1e9)
    return [c for c in _divisors(seq_len) if c == 1 or (not split_problems(seq_len, c) and seq_len // c >= least)]


def layouts(cfg, machine: Machine, gpus: int, global_batch: int, dp=None, tp=None, pp=None,
            micro_batch=None, zero=None, recompute=None, cp=None):
    """Every valid (dp, tp, pp, micro_batch, zero, recompute, cp); given values are kept fixed.

    tp divides the heads, the key/value heads and the MLP width (`shapes.tensor_parallel_problems`) and
    either divides the devices per node or spans whole nodes, up to two nodes (so that the cost of TP
    beyond a node shows); pp divides the layers (a pp that is given need not: its fullest stage is
    priced, `memory.stage_layers`); cp is one of
    `context_degrees` (1 when dp, tp and pp are all given); dp x tp x pp x cp = gpus; the global
    batch splits into dp x micro-batch; ZeRO-1 only with dp x cp > 1 (it shards over both).
    """
    check_layout(cfg, gpus, global_batch, dp, tp, pp, micro_batch, zero, recompute, cp)
    node = machine.devices_per_node
    tps = [tp] if tp else [t for t in _divisors(cfg.heads) if not tensor_parallel_problems(cfg, t)
                           and t <= 2 * node and (node % t == 0 or t % node == 0)]
    pps = [pp] if pp else _divisors(cfg.n_layers)
    if cp:
        cps = [cp]
    else:
        cps = [1] if None not in (dp, tp, pp) else context_degrees(cfg.seq_len, machine)
    for t in tps:
        for p in pps:
            for c in cps:
                if gpus % (t * p * c) or (dp and dp * t * p * c != gpus):
                    continue
                d = gpus // (t * p * c)
                for b in [micro_batch] if micro_batch else MICRO_BATCHES:
                    if global_batch % (d * b):
                        continue
                    for z in [zero] if zero is not None else ZERO_STAGES:
                        if z and d * c == 1:
                            continue
                        for r in [recompute] if recompute else RECOMPUTE:
                            yield d, t, p, b, z, r, c


def memory_per_gpu(cfg, micro_batch: int, precision: str, dp: int, tp: int, pp: int, cp: int, zero: int,
                   recompute: str, framework: Framework = Framework()) -> int:
    """Bytes per GPU: `memory.estimate_memory`'s total, and under CP two changes.

    The framework's kernels change what a layer keeps: sequence parallelism cuts the norms' and dropouts'
    activations over the TP ranks (Korthikanti et al. 2022, Sec. 4.2.2), and a fused attention kernel keeps no
    s x s scores, as selective recomputation does not (their 34 s b h per layer).

    The activations are `context.stage_activation_bytes` (s / cp positions per rank, no scores,
    the K/V blocks in flight), scaled from 16-bit by the recipe as estimate_memory scales its own.
    ZeRO shards over the dp x cp ranks: CP ranks hold the same weights and reduce their gradients
    together, and Megatron-LM builds its distributed optimizer on that group
    (`get_data_parallel_group(with_context_parallel=True)`).
    """
    kept = "selective" if framework.flash_attention and recompute == "none" else recompute
    est = estimate_memory(cfg, micro_batch=micro_batch, precision=precision, dp=dp * cp, tp=tp, pp=pp, zero=zero,
                          recompute=kept, sequence_parallel=framework.sequence_parallel)
    if cp == 1:
        return est["total"]
    activations = stage_activation_bytes(pp * stage_layers(cfg.n_layers, pp), cfg.seq_len, micro_batch, cfg.hidden,
                                         cfg.heads, cp, tp, recompute, ACTIVATION_BYTES, kv_hidden=cfg.n_kv_heads * cfg.head_dim,
                                         sequence_parallel=framework.sequence_parallel)
    return est["total"] - est["activations"] + activations * BYTES_PER_PARAM[precision]["params"] // 2


def evaluate(cfg, machine: Machine, gpus: int, global_batch: int, dp: int, tp: int, pp: int,
             micro_batch: int = 1, zero: int = 0, recompute: str = "none", precision: str = "mixed",
             efficiency: float = EFFICIENCY, cp: int = 1, virtual: int = 1,
             framework: Framework = Framework()) -> Config:
    """Memory and step time of one layout (see the module docstring for the model).

    compute: m micro-batches through the pipeline's fullest stage, then the optimizer step over this GPU's
      parameters, as `step_time` prices them (each layer's matmuls from their shapes, attention as the
      framework's kernel computes it, the elementwise work from its bytes; forward, backward and what
      recomputation runs again; the LM head), over `efficiency`, the share of those best-kernel rates a
      whole step reaches. The fullest stage is the larger of a stage of stage_layers(L, pp) layers and the
      last stage, which holds the LM head beside the layers left over: where pp divides the layers
      (Megatron-LM) the head's stage is the fullest; a framework that splits unevenly gives the head's
      stage fewer layers (BLOOM's, Llama 3's). The framework's overlaps change what communication
      costs (TP and DP below).
    Each rank works on s / cp positions of each sequence (s = seq_len); with cp = 1 all of them.
    TP: each layer of a stage, for each of the m micro-batches, the all-reduces of
      `tp_comm.layer_comm` (Shoeybi et al. 2019, Sec. 3: 2 forward, 2 backward, of b s h / cp
      activations; full recomputation repeats the forward's 2), ring all-reduce on group_link(tp).
      With framework.overlap_tp they run during the matmuls: only what outlasts the compute is exposed.
    CP: each layer of a stage, for each micro-batch, the sends of `context.ring_traffic` (Liu et al.
      2023, Sec. 3: K and V go cp - 1 hops forward; backward K, V and the dK, dV sums; grouped-query
      attention's K and V kv_heads heads wide, as they travel), each
      alpha + bytes / bandwidth on group_link(tp x cp); full recomputation repeats the forward's.
    PP: each micro-batch sends its activations to the next stage and its gradient back,
      b s h / (tp cp) bytes per GPU (Narayanan et al. 2021, Sec. 4.1, the scatter/gather
      optimization), 2 (v m + p - 1) messages on the critical path (v m in steady state: the
      interleaved schedule's v chunks per stage send v times as often, Sec. 2.2.2; p - 1 to fill and
      drain), on group_link(tp x cp x pp).
    DP: the gradients of this GPU's tp x pp share, over the dp x cp ranks that hold it (CP ranks
      reduce their gradients with the DP ones, as Megatron-LM does); ZeRO-0 all-reduces them, ZeRO-1
      reduce-scatters the gradients and all-gathers the updated parameters, the same volume
      when both are 16-bit (Rajbhandari et al. 2020, Sec. 7.2.1), on group_link(gpus). With
      framework.overlap_dp (DDP's buckets, FSDP, Megatron-Core's --overlap-grad-reduce) the reduction
      runs during the backward; only what outlasts the last micro-batch's backward through the stage,
      when the last gradients are ready, is exposed.
    bubble: (p - 1) / (v m) of the micro-batches' compute + TP + CP time (`simulator.bubble_over_ideal`, Narayanan Sec. 2.2.1
      and 2.2.2 for the interleaved schedule's v chunks per stage).
    """
    check_machine(machine)
    check_layout(cfg, gpus, global_batch, dp, tp, pp, micro_batch, zero, recompute, cp)
    if not 0 < efficiency <= 1:
        raise ValueError(f"efficiency must be in (0, 1], got {efficiency!r}")
    if not isinstance(virtual, int) or virtual < 1 or (virtual > 1 and pp == 1):
        raise ValueError(f"virtual stages must be a whole number >= 1, and 1 without a pipeline; got {virtual!r}")
    m = global_batch // (dp * micro_batch)
    memory = memory_per_gpu(cfg, micro_batch, precision, dp, tp, pp, cp, zero, recompute, framework)
    layers = stage_layers(cfg.n_layers, pp)
    positions = micro_batch * cfg.seq_len // cp   # tokens of one micro-batch on one rank
    device = machine.device
    layer = layer_s(cfg, device, positions, tp, cp, framework)
    again = {"none": 0.0, "selective": layer["attention_forward"], "full": layer["forward"]}[recompute]
    per_layer = layer["forward"] + layer["backward"] + again
    left = cfg.n_layers - (pp - 1) * layers   # the last stage's layers
    stage = max(layers * per_layer, left * per_layer + head_s(cfg, device, positions, tp)) / efficiency
    share = -(-count_params(cfg, padded=True) * layers // (tp * cfg.n_layers))   # the fullest stage's parameters
    compute = m * stage + optimizer_s(share // (dp * cp) if zero else share, device) / efficiency
    forward_passes = {"forward": 2 if recompute == "full" else 1, "backward": 1}

    tp_comm = 0.0
    if tp > 1:
        alpha, gbps = group_link(machine, tp)
        per_layer = 0.0
        for phase, ops in layer_comm(positions, cfg.hidden, bytes_per_element=ACTIVATION_BYTES).items():
            for calls, payload in ops.values():
                per_layer += (forward_passes[phase] * calls
                              * all_reduce_ring(payload / calls, tp, alpha, 1 / (gbps * 1e9)))
        tp_comm = m * layers * per_layer
        if framework.overlap_tp:
            tp_comm = max(0.0, tp_comm - m * stage)

    cp_comm = 0.0
    if cp > 1:
        alpha, gbps = group_link(machine, tp * cp)
        sends = ring_traffic(cfg.seq_len, micro_batch, cfg.hidden // tp, cp, ACTIVATION_BYTES,
                             kv_hidden=cfg.n_kv_heads * cfg.head_dim // tp)
        per_layer = sum(forward_passes[phase] * (t["calls"] * alpha + t["payload_bytes"] / (gbps * 1e9))
                        for phase, t in sends.items())
        cp_comm = m * layers * per_layer

    pp_comm = 0.0
    if pp > 1:
        alpha, gbps = group_link(machine, tp * cp * pp)
        message = positions * cfg.hidden * ACTIVATION_BYTES / tp
        pp_comm = 2 * (virtual * m + pp - 1) * (alpha + message / (gbps * 1e9))

    dp_comm = 0.0
    replicas = dp * cp
    if replicas > 1:
        alpha, gbps = group_link(machine, gpus)
        beta = 1 / (gbps * 1e9)
        per = BYTES_PER_PARAM[precision]
        if zero:
            dp_comm = (reduce_scatter_ring(share * per["grads"], replicas, alpha, beta)
                       + all_gather_ring(share * per["params"], replicas, alpha, beta))
        else:
            dp_comm = all_reduce_ring(share * per["grads"], replicas, alpha, beta)
        if framework.overlap_dp:
            dp_comm = max(0.0, dp_comm - layers * layer["backward"] / efficiency)

    bubble = bubble_over_ideal(pp, m, virtual) * (m * stage + tp_comm + cp_comm)
    return Config(dp=dp, tp=tp, pp=pp, cp=cp, micro_batch=micro_batch, zero=zero, recompute=recompute, microbatches=m,
                  memory_per_gpu=memory, fits=memory <= usable_bytes(machine), compute_s=compute, tp_comm_s=tp_comm,
                  cp_comm_s=cp_comm, pp_comm_s=pp_comm, dp_comm_s=dp_comm, bubble_s=bubble, virtual=virtual)


def usable_bytes(machine: Machine) -> float:
    return USABLE_MEMORY * machine.memory_gb * 1e9


def _rank_key(c: Config):
    return c.step_time_s, c.memory_per_gpu   # equal times: the one that leaves more memory free


def _all(cfg, machine, gpus, global_batch, precision, efficiency, fixed) -> list[Config]:
    check_machine(machine)
    return [evaluate(cfg, machine, gpus, global_batch, d, t, p, b, z, r, precision, efficiency, cp=c)
            for d, t, p, b, z, r, c in layouts(cfg, machine, gpus, global_batch, **fixed)]


def plan(cfg, machine: Machine, gpus: int, global_batch: int, precision: str = "mixed",
         efficiency: float = EFFICIENCY, **fixed) -> list[Config]:
    """The layouts that fit, fastest first; NoFit (with the reason) when none does.

    `fixed` pins any of dp, tp, pp, cp, micro_batch, zero, recompute.
    """
    configs = _all(cfg, machine, gpus, global_batch, precision, efficiency, fixed)
    fitting = sorted((c for c in configs if c.fits), key=_rank_key)
    if not fitting:
        raise NoFit(explain_no_fit(cfg, machine, gpus, global_batch, precision, configs=configs, **fixed))
    return fitting


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def tflops_per_gpu(c: Config, cfg, global_batch: int) -> float:
    """What each GPU achieves, recomputation included, as Narayanan et al. 2021 count it (Sec. 5.1)."""
    return step_flops(cfg, global_batch, c.recompute) / c.step_time_s / c.gpus / 1e12


def rates(c: Config, cfg, machine: Machine, global_batch: int) -> dict:
    """What the plan's table prints for a layout, for tools that read `plan --json`: tokens per second, the
    TFLOP/s each GPU executes (recomputation included, as `tflops_per_gpu`), and MFU, the model's FLOPs alone
    (no recomputation) over the GPUs' peak (Chowdhery et al. 2022, "PaLM", App. B)."""
    model = step_flops(cfg, global_batch, "none") / c.step_time_s / c.gpus
    return {"tokens_per_s": global_batch * cfg.seq_len / c.step_time_s,
            "tflops_per_gpu": tflops_per_gpu(c, cfg, global_batch),
            "mfu": model / (machine.peak_tflops_bf16 * 1e12)}


def describe(c: Config) -> str:
    """'TP 4 x PP 16 x DP 2, micro-batch 1, ZeRO-1, full recomputation' ('TP 8 x CP 16 x PP 16 x DP 8, ...'
    with context parallelism), the axes in Mesh's order, fastest first."""
    recompute = "no recomputation" if c.recompute == "none" else f"{c.recompute} recomputation"
    context = f" x CP {c.cp}" if c.cp > 1 else ""
    return f"TP {c.tp}{context} x PP {c.pp} x DP {c.dp}, micro-batch {c.micro_batch}, ZeRO-{c.zero}, {recompute}"


def explain_no_fit(cfg, machine: Machine, gpus: int, global_batch: int, precision: str = "mixed",
                   configs: list[Config] | None = None, **fixed) -> str:
    """One line: why no layout fits, naming the leanest one and what it needs per GPU."""
    if configs is None:
        configs = _all(cfg, machine, gpus, global_batch, precision, EFFICIENCY, fixed)
    if not configs:
        return (f"no layout splits this model over {gpus} GPUs with global batch {global_batch}: tp must divide "
                f"the {cfg.heads} heads, pp the {cfg.n_layers} layers, dp = gpus / (tp x pp) the global batch; "
                f"try a GPU count and batch with more divisors, or give a --pp that does not divide the layers "
                f"(its fullest stage is priced)")
    lean = min(configs, key=lambda c: c.memory_per_gpu)
    context = "leave cp to the planner (context parallelism), " if fixed.get("cp") == 1 and len(
        context_degrees(cfg.seq_len, machine)) > 1 else ""
    return (f"fits nowhere on {gpus} x {machine.memory_gb:g} GB: even {describe(lean)} needs "
            f"{_gb(lean.memory_per_gpu)} per GPU > {_gb(usable_bytes(machine))} usable "
            f"({USABLE_MEMORY:.0%} of {machine.memory_gb:g} GB); {context}use more GPUs or a smaller model")


def why(c: Config, cfg, machine: Machine, gpus: int, global_batch: int, precision: str = "mixed",
        efficiency: float = EFFICIENCY) -> list[str]:
    """A few sentences on a layout: where its time goes and why each choice was made."""
    node = machine.devices_per_node
    total = c.step_time_s
    ring = f"CP ring {c.cp_comm_s / total:.0%}, " if c.cp > 1 else ""
    lines = [f"{describe(c)}: {_gb(c.memory_per_gpu)} of {_gb(usable_bytes(machine))} usable per GPU; "
             f"step {total:.3g} s (compute {c.compute_s / total:.0%}, TP {c.tp_comm_s / total:.0%}, {ring}"
             f"PP sends {c.pp_comm_s / total:.0%}, DP sync {c.dp_comm_s / total:.0%}, bubble {c.bubble_s / total:.0%})."]
    # Megatron's 2 all-reduces forward and 2 backward per layer and micro-batch; full recomputation runs the
    # forward's 2 again in the backward pass (evaluate's `forward_passes`).
    all_reduces = 6 if c.recompute == "full" else 4
    counted = f"{all_reduces} per layer and micro-batch" + (", the recomputed forward's 2 included" if c.recompute == "full"
                                                            else "")
    if node % c.tp:
        lines.append(f"TP {c.tp} crosses nodes of {node} GPUs: its all-reduces, {counted}, are priced at "
                     f"the {machine.inter_gbps:g} GB/s network figure (a pessimistic bound) instead of the node's "
                     f"{machine.intra_gbps:g} GB/s links.")
    elif c.tp > 1:
        lines.append(f"TP {c.tp} stays inside a node ({node} GPUs): its all-reduces, {counted}, use "
                     f"the node's {machine.intra_gbps:g} GB/s links (Narayanan et al. 2021, Sec. 3.2, takeaway #1).")
    if c.cp > 1:
        where = "inside a node" if node % (c.tp * c.cp) == 0 else "across nodes"
        lines.append(f"CP {c.cp} cuts each sequence of {cfg.seq_len} tokens into {2 * c.cp} chunks, two per rank (the "
                     f"balanced causal split), so each rank keeps the activations of {cfg.seq_len // c.cp} positions; "
                     f"its ring passes K and V {where} (Liu et al. 2023).")
    if c.pp > 1:
        where = "inside a node" if node % (c.tp * c.cp * c.pp) == 0 else "across nodes"
        share = "tp" if c.cp == 1 else "(tp cp)"
        lines.append(f"PP {c.pp} sends only b s h / {share} per micro-batch {where}; with m = {c.microbatches} "
                     f"micro-batches the bubble is (p - 1)/m = {bubble_over_ideal(c.pp, c.microbatches):.1%} "
                     f"of the work (Narayanan et al. 2021, Sec. 2.2.1: keep m >> p).")
    if c.dp * c.cp > 1:
        ranks = f"DP {c.dp}" if c.cp == 1 else f"DP {c.dp} x CP {c.cp}"
        lines.append(f"{ranks} syncs the gradients once per step, {c.dp_comm_s:.3g} s.")
    if c.zero:
        plain = evaluate(cfg, machine, gpus, global_batch, c.dp, c.tp, c.pp, c.micro_batch, 0, c.recompute,
                         precision, efficiency, cp=c.cp)
        over = f"{c.dp} DP ranks" if c.cp == 1 else f"{c.dp} x {c.cp} DP x CP ranks"
        lines.append(f"ZeRO-1 shards the optimizer states over the {over}, saving "
                     f"{_gb(plain.memory_per_gpu - c.memory_per_gpu)} per GPU for the same traffic.")
    lighter = RECOMPUTE[:RECOMPUTE.index(c.recompute)]
    if lighter:
        other = evaluate(cfg, machine, gpus, global_batch, c.dp, c.tp, c.pp, c.micro_batch, c.zero, lighter[-1],
                         precision, efficiency, cp=c.cp)
        instead = "without recomputation" if lighter[-1] == "none" else "with selective recomputation"
        reason = (f"{instead} this layout would need {_gb(other.memory_per_gpu)}" if not other.fits else
                  f"{instead} it fits too but is slower here ({other.step_time_s:.3g} s)")
        lines.append(f"{c.recompute.capitalize()} recomputation: {reason}.")
    return lines


class Sample(NamedTuple):
    """One step of a search: the layout tried, its step time (None: out of memory), the best so far."""

    index: int
    config: Config
    step_time_s: float | None
    best_s: float | None


def search(cfg, machine: Machine, gpus: int, global_batch: int, samples: int, seed: int = 0,
           precision: str = "mixed", efficiency: float = EFFICIENCY, **fixed) -> list[Sample]:
    """Try `samples` layouts drawn at random (no repeats, reproducible with `seed`): the trajectory.

    The workshop searched the same space with DeepHyper (Dash et al. 2023, arXiv:2312.12705,
    Fig. 9) by running each sample for real; here each "run" is `evaluate`, and a layout that does
    not fit counts as a run that failed out of memory.
    """
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a whole number >= 1, got {samples!r}")
    check_machine(machine)
    candidates = list(layouts(cfg, machine, gpus, global_batch, **fixed))
    if not candidates:
        raise NoFit(explain_no_fit(cfg, machine, gpus, global_batch, precision, configs=[]))
    rng = random.Random(seed)
    trajectory, best = [], None
    for i, (*layout, cp) in enumerate(rng.sample(candidates, min(samples, len(candidates)))):
        c = evaluate(cfg, machine, gpus, global_batch, *layout, precision=precision, efficiency=efficiency, cp=cp)
        t = c.step_time_s if c.fits else None
        if t is not None and (best is None or t < best):
            best = t
        trajectory.append(Sample(i, c, t, best))
    return trajectory


# The entry point the workshop fork's DeepSpeed launch scripts run with these arguments.
MEGATRON_SCRIPT = "pretrain_gpt_deepspeed.py"


MEGATRON_CLIP_GRAD = 1.0   # Megatron's --clip-grad default (megatron/arguments.py)


def megatron_arguments(c: Config, cfg, global_batch: int, precision: str = "mixed") -> list[str]:
    """The Megatron-DeepSpeed arguments that run layout `c`, spelled as the workshop's fork takes them.

    Source: sajal-vt/Megatron-DeepSpeed-ORNL, `megatron/arguments.py`, which defines every flag
    here but `--deepspeed` and `--deepspeed_config` (underscore): DeepSpeed's `add_config_arguments`
    adds those to the same parser. The fork's DeepSpeed runs (the hands-on `launch_gpt22b_bf16.slurm`
    and `launch_gpt175b_bf16.slurm` of its FA2 branch, the DeepHyper search's `dh_utils.py` on
    frontier-sd) pass them to `pretrain_gpt_deepspeed.py`.

    Full recomputation (Table VI's checkpoint-activations) is what those scripts pass,
    `--deepspeed-activation-checkpointing --checkpoint-activations`: the first makes the fork's
    `initialize.py` swap in DeepSpeed's checkpointing, set up for one checkpoint per
    `--checkpoint-num-layers` layers (1: each layer's input, as `memory` counts full recomputation).
    Selective is `--recompute-granularity selective`: the fork defines it (from Megatron-LM), but
    none of its scripts uses it. DeepSpeed runs the ZeRO stage of the config (`deepspeed_config`);
    `--zero-stage` (default 1 in the fork) informs Megatron's side only, so both name the same stage.
    """
    _no_context_parallel(c)
    args = ["--tensor-model-parallel-size", c.tp, "--pipeline-model-parallel-size", c.pp,
            "--num-layers", cfg.n_layers, "--hidden-size", cfg.hidden, "--num-attention-heads", cfg.heads,
            "--seq-length", cfg.seq_len, "--max-position-embeddings", cfg.seq_len,
            "--micro-batch-size", c.micro_batch, "--global-batch-size", global_batch]
    if precision != "fp32":
        args.append(f"--{_half(precision)}")
    args += ["--deepspeed", "--deepspeed_config", "ds_config.json"]
    args += {"none": [], "selective": ["--recompute-granularity", "selective"],
             "full": ["--deepspeed-activation-checkpointing", "--checkpoint-activations",
                      "--checkpoint-num-layers", 1]}[c.recompute]
    args += ["--zero-stage", c.zero]
    return [str(a) for a in args]


# The Part III deck's "Porting Megatron-DeepSpeed to Frontier": what the workshop changed to run the
# fork there, beyond its launch script. Comments, since none of it is a launch-time setting.
FRONTIER_PORTING = [
    "# Frontier: the workshop's fork (sajal-vt/Megatron-DeepSpeed-ORNL, the deck's branch frontier-sd)",
    "# has two code edits (Part III deck, \"Porting Megatron-DeepSpeed to Frontier\"):",
    "# set_jit_fusion_options() is commented out in megatron/training.py (it switches PyTorch's JIT",
    "# to nvFuser), and megatron/core/tensor_parallel/layers.py sets",
    "# config.gradient_accumulation_fusion = False (the fused kernel is APEX's CUDA extension).",
    "# DeepSpeed is installed with its ops built at install time instead of compiled at first use:",
    "# DS_BUILD_CPU_ADAM=1 DS_BUILD_FUSED_ADAM=1 DS_BUILD_FUSED_LAMB=1 DS_BUILD_TRANSFORMER=1 \\",
    "#     DS_BUILD_AIO=1 DS_BUILD_UTILS=1 pip install deepspeed",
]


def megatron_environment(c: Config, frontier: bool = False) -> list[str]:
    """The launch script's lines before Megatron-DeepSpeed runs layout `c`: comments and exports.

    CUDA_DEVICE_MAX_CONNECTIONS=1 puts all of a process's streams on one hardware queue per GPU, so
    its kernels start in the order they are issued. The Part III deck lists it among the porting steps:
    "In the launch script we had to set: export CUDA_DEVICE_MAX_CONNECTIONS=1". "Had to" holds where
    the fork requires it: it relies on that order only for its asynchronous TP all-reduce (a
    column-parallel layer's or the LM head's backward starts the all-reduce of its input's gradient
    before the weight gradient's GEMM) and for sequence parallelism, and refuses to start without the
    variable in those cases (workshop.MAX_CONNECTIONS_CHECK): runs without --deepspeed, and runs with
    --sequence-parallel at TP > 1. `megatron_arguments` passes --deepspeed and no --sequence-parallel,
    and under --deepspeed the fork turns the asynchronous all-reduce off: for this command nothing in the
    fork relies on the order, and the fork does not require the variable (where the GPU runtime honours
    it, it still puts the streams on one queue). It is exported anyway where TP > 1 and on Frontier, as
    every workshop script exports it (workshop.SCRIPTS), so that the script still starts with
    --sequence-parallel or without --deepspeed (the Part II srun scripts for 175B and 1T, which need it).
    On Frontier the comment also names HIP's own setting for hardware queues
    (workshop.ROCM_HW_QUEUES), which no workshop script sets.
    """
    from .workshop import MAX_CONNECTIONS_CHECK, ROCM_HW_QUEUES

    lines = FRONTIER_PORTING[:] if frontier else []
    if c.tp > 1 or frontier:
        lines += ["# CUDA_DEVICE_MAX_CONNECTIONS=1: all of the process's streams on one hardware queue, so its",
                  "# kernels start in the order they are issued. The Part III deck: \"In the launch script we",
                  "# had to set: export CUDA_DEVICE_MAX_CONNECTIONS=1\". The fork needs that order only for its",
                  "# asynchronous TP all-reduce and for sequence parallelism, and refuses to start without",
                  f"# the variable in those cases ({MAX_CONNECTIONS_CHECK}): runs without",
                  "# --deepspeed, and runs with --sequence-parallel at TP > 1. This command passes --deepspeed,",
                  "# under which the fork turns the asynchronous all-reduce off, and no --sequence-parallel:",
                  "# nothing in the fork relies on the order, and the fork does not require the variable",
                  "# (where the runtime honours it, it still puts the streams on one queue). It stays, as in",
                  "# every workshop script, so that the script still starts with --sequence-parallel or",
                  "# without --deepspeed."]
        if frontier:
            lines += [f"# On ROCm, HIP's own setting for its hardware queues per device is {ROCM_HW_QUEUES},",
                      "# which none of the workshop's scripts sets."]
        lines += ["export CUDA_DEVICE_MAX_CONNECTIONS=1"]
    return lines


def deepspeed_config(c: Config, global_batch: int, precision: str = "mixed") -> dict:
    """The ds_config.json that goes with `megatron_arguments`, from the one builder (labsupport/ds_config.py).

    Its batch keys agree with Megatron's: micro-batch `--micro-batch-size`, accumulation
    `--global-batch-size` / (micro-batch x DP). It clips at 1.0, Megatron's `--clip-grad` default: under
    `--deepspeed` the fork's `megatron/optimizer/__init__.py` returns the bare optimizer, so only
    DeepSpeed's `gradient_clipping` clips. No optimizer block: the fork's `megatron/training.py` hands
    Megatron's optimizer to `deepspeed.initialize`. `labsupport plan --check-config` finds no
    contradiction between the two (tests/test_ds_check.py).
    """
    _no_context_parallel(c)
    return ds_config(c.micro_batch, global_batch // (c.micro_batch * c.dp), c.dp, c.zero, grad_clip=MEGATRON_CLIP_GRAD,
                     dtype="fp32" if precision == "fp32" else _half(precision))


def _no_context_parallel(c: Config) -> None:
    """ValueError, one line: the fork predates context parallelism (Megatron-LM added `--context-parallel-size`)."""
    if c.cp > 1:
        raise ValueError(f"{describe(c)} uses context parallelism, which the workshop's Megatron-DeepSpeed fork "
                         f"does not have; pin --cp 1 to emit its arguments, or use Megatron-LM's "
                         f"--context-parallel-size")


def _half(precision: str) -> str:
    """The 16-bit format of a memory recipe: fp16 for Megatron's fp16 recipe, else bf16.

    "mixed" (ZeRO's accounting, the one that applies to these `--deepspeed` runs, whose ZeRO
    optimizer holds the fp32 states) counts the same bytes in either format; bf16 needs no loss
    scaling. The workshop ran those bytes in fp16 (Table VI; `--fp16` and `"fp16": {"enabled": true}`
    in the FA2 branch's `launch_gpt175b_bf16.slurm` and `ds_config_16N_175B.json`, despite the name).
    The same word names the fork's flag (`--fp16`, `--bf16`) and the ds_config key.
    """
    return "fp16" if precision == "megatron-fp16" else "bf16"
