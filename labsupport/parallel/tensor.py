"""Tensor parallelism as in Megatron-LM: each layer's matrices cut over a group of T ranks.

Shoeybi et al. 2019 ("Megatron-LM", Sec. 3) cut a transformer layer so that it needs two
all-reduces in forward and two in backward:

* the MLP's first matrix by columns (`ColumnParallelLinear`: each rank computes 4h/T of the
  hidden units, and GELU applies to them without any communication), its second by rows
  (`RowParallelLinear`: each rank multiplies its 4h/T inputs and the partial sums are added by
  an all-reduce; the bias is added once, after it);
* attention the same way, by whole heads (`ParallelAttention`): q, k, v by columns (TinyGPT lays
  them out head by head, so a block of rows is a set of heads), the output projection by rows;
* the embedding by vocabulary rows (`VocabParallelEmbedding`), the tied LM head by the same
  rows, and the loss computed on the vocabulary shards (`vocab_parallel_cross_entropy`): the
  full b x s x V logits are never on one rank.

The communication is two conjugate autograd functions: f (`copy_to_tensor_parallel_region`) is
the identity in forward and an all-reduce in backward, g (`reduce_from_tensor_parallel_region`)
an all-reduce in forward and the identity in backward. f enters a parallel region, g leaves it.

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", Sec. 4.2.2): between the parallel regions, LayerNorm and dropout are
replicated on every rank; instead each rank keeps s/T of the positions there. g becomes a
reduce-scatter along the sequence (`reduce_scatter_to_sequence_parallel_region`) and f an
all-gather, inside the column-parallel linear (`_SequenceParallelLinear`), which gathers again in
backward rather than keep the whole sequence. A ring all-reduce *is* a reduce-scatter then an
all-gather, so the traffic is the same (plus that second all-gather) and the activations there
are divided by T.
Each rank's LayerNorm (and row-parallel bias) then sees only its positions: their gradients
are partial sums that must be all-reduced over the group (`allreduce_sequence_parallel_gradients`).

The Llama family (model.py's options) is cut by the same two functions, with no new collective:

* SwiGLU's `gate` and `up` are column-parallel and `down` row-parallel (`ParallelSwiGLU`): unit i's
  column of gate and of up and row i of down belong to that unit alone, so a rank's ffn/T units
  need nothing from the others, and the MLP still has one g (one all-reduce) in forward. gate and up
  read the same input, so it enters the parallel region once (one f; under sequence parallelism one
  all-gather, gate's and up's shards multiplied as one matrix), as the GELU MLP's `fc` does.
  Megatron-LM stores the two as one `linear_fc1` of 2 ffn outputs (`gated_linear_unit`); torchtitan
  keeps w1 and w3 apart, ColwiseParallel each, behind one PrepareModuleInput that gathers their input.
* grouped-query attention (Ainslie et al. 2023): qkv's rows go by query group (model.py), so rank i's
  block of rows is kv_heads/T whole key/value heads with the heads/T query heads that read them,
  and proj's block of columns is those query heads' output. T must divide kv_heads, a choice of
  this module: every rank then holds whole groups, weights and activations, and attention needs no
  communication. Megatron-LM required the same up to Megatron Core 0.15 (its TransformerConfig raises
  ValueError, and `divide(num_query_groups, tp)` in its Attention asserts it); since 0.16 (PR #2565) it also takes a T that kv_heads divides: each rank
  all-gathers qkv's output and keeps the block of its group (rank // (T/kv_heads)), so a group's
  K/V activations are held on T/kv_heads ranks, no weight copied, for one more all-gather per
  layer (a reduce-scatter in backward). vLLM (inference) instead copies a key/value head's weights
  onto tp/kv_heads ranks (`num_kv_head_replicas` in its QKVParallelLinear) when tp >= kv_heads;
  training would then have to sum those copies' gradients. Such a T is refused here
  (`ParallelAttention` raises ValueError; the step names the numbers).
* RoPE rotates q and k inside the attention, after qkv, by the positions the model gives every block.
  Without sequence parallelism every rank holds every position; with it, qkv has just all-gathered
  them, so the rotation always sees the whole sequence and its global positions 0..t-1, as on one
  device: no rank ever rotates by its local index.
* RMSNorm under sequence parallelism is LayerNorm's case: its gain sees this rank's positions only,
  and its gradient is summed over the group with theirs (`sequence_parallel_parameters`).
* an untied LM head is a column-parallel matrix of its own (vocabulary rows), the embedding another.

`apply_tensor_parallel(model, group)` cuts a TinyGPT in place, slicing the dense weights, so a
dense model and its parallel version start identical; `TensorParallelStep` is the step of the
composition (compose.py) that applies it to each model chunk.
All communication goes through `comm`.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..model import MLP, CausalSelfAttention, SwiGLU
from .clip import count_once
from .step import Step

SEQ_DIM = 1  # activations are (batch, sequence, hidden)


# ====================================================================== splitting and joining along a dimension

def _shard(t: torch.Tensor, dim: int, group, what: str = "the sequence positions") -> torch.Tensor:
    """This rank's contiguous 1/T of `t` along `dim`, a copy: a view (which `contiguous()` returns
    for a cut along dim 0) would keep the whole dense tensor alive behind the shard. T must divide
    the size: every rank finds its rows at rank x size / T, and the other layers assume it."""
    n = comm.get_world_size(group)
    if t.shape[dim] % n:
        raise ValueError(f"{what}: {t.shape[dim]} do not split evenly over {n} tensor-parallel ranks; pad them to "
                         f"a multiple of {n} or use a group size that divides {t.shape[dim]}")
    return t.chunk(n, dim=dim)[comm.get_rank(group)].clone(memory_format=torch.contiguous_format)


def _all_gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `t` along `dim` (one all-gather into a flat buffer, then reorder)."""
    n = comm.get_world_size(group)
    out = torch.empty((n * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)  # ranks stacked on dim 0
    comm.all_gather_into_tensor(out, t.contiguous(), group=group)
    return out.view(n, *t.shape).movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum `t` over the ranks and keep this rank's 1/T along `dim`."""
    chunks = [c.contiguous() for c in t.chunk(comm.get_world_size(group), dim=dim)]
    out = torch.empty_like(chunks[0])
    comm.reduce_scatter(out, chunks, "sum", group=group)
    return out


def _all_reduce(t: torch.Tensor, group) -> torch.Tensor:
    out = t.contiguous().clone()  # never in place: the caller may still hold the tensor
    comm.all_reduce(out, "sum", group=group)
    return out


# ====================================================================== the conjugate functions (f and g)

class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: every rank needs the whole input; each computes a different part of the output, so the
    input's gradient is the sum of the ranks' contributions."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: the ranks' partial sums become the output; its gradient is the same on every rank."""

    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """g under sequence parallelism: sum the partial outputs, keep this rank's positions;
    backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Enter the sequence-parallel region from a replicated tensor: keep this rank's positions
    (no communication); backward all-gathers the positions' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _shard(x, SEQ_DIM, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, SEQ_DIM, ctx.group), None


class _SequenceParallelLinear(torch.autograd.Function):
    """The column-parallel linear under sequence parallelism: all-gather the positions (f), then
    multiply. Backward needs the gathered input for the weight's gradient; keeping it would store
    s positions where sequence parallelism promises s/T (Korthikanti et al. 2022, Table 2, counts
    the LayerNorm output once, sharded). So only this rank's positions are saved and the input is
    all-gathered again in backward, as Megatron-LM does: one more all-gather for 1/T the memory."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(_all_gather(x, SEQ_DIM, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        gathered = _all_gather(x, SEQ_DIM, ctx.group).to(grad.dtype)  # under autocast, grad is bf16
        grad_x = _reduce_scatter(grad @ weight.to(grad.dtype), SEQ_DIM, ctx.group).to(x.dtype)
        grad_weight = (grad.flatten(0, -2).t() @ gathered.flatten(0, -2)).to(weight.dtype)
        grad_bias = grad.flatten(0, -2).sum(0).to(weight.dtype) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


def copy_to_tensor_parallel_region(x, group=None):
    return _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group=None):
    return _ReduceFromTensorParallelRegion.apply(x, group)


def reduce_scatter_to_sequence_parallel_region(x, group=None):
    return _ReduceScatterToSequenceParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group=None):
    return _ScatterToSequenceParallelRegion.apply(x, group)


# ====================================================================== layers, each cut from its dense twin

class ColumnParallelLinear(nn.Module):
    """Y = X A with A = [A_1 ... A_T] cut by output columns: rank i keeps A_i (rows of the torch
    weight) and its slice of the bias, and computes Y_i. Its input enters through f (or, under
    sequence parallelism, the all-gather of the positions, done again in backward)."""

    def __init__(self, linear: nn.Linear, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        what = f"ColumnParallelLinear({linear.in_features}, {linear.out_features}) output features"
        self.weight = nn.Parameter(_shard(linear.weight.detach(), 0, group, what))
        self.bias = None if linear.bias is None else nn.Parameter(_shard(linear.bias.detach(), 0, group, what))

    def forward(self, x):
        if self.sequence_parallel:
            return _SequenceParallelLinear.apply(x, self.weight, self.bias, self.group)
        return F.linear(copy_to_tensor_parallel_region(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Y = X A with A cut by input rows, X already cut by columns (a column-parallel layer's
    output): rank i computes X_i A_i, g sums them (or reduce-scatters them along the sequence).
    The bias is replicated and added after the sum: added before it, it would count T times."""

    def __init__(self, linear: nn.Linear, group=None, *, sequence_parallel: bool = False):
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        what = f"RowParallelLinear({linear.in_features}, {linear.out_features}) input features"
        self.weight = nn.Parameter(_shard(linear.weight.detach(), 1, group, what))
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding cut by vocabulary rows: rank i holds tokens [i V/T, (i+1) V/T). Each rank
    looks up the ids it holds, zeros for the others, and g sums the ranks' rows."""

    def __init__(self, embedding: nn.Embedding, group=None):
        super().__init__()
        self.group = group
        what = f"VocabParallelEmbedding({embedding.num_embeddings}, {embedding.embedding_dim}) vocabulary rows"
        self.weight = nn.Parameter(_shard(embedding.weight.detach(), 0, group, what))
        self.vocab_start = comm.get_rank(group) * self.weight.shape[0]

    def forward(self, ids):
        local = ids - self.vocab_start
        elsewhere = (local < 0) | (local >= self.weight.shape[0])
        rows = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        return reduce_from_tensor_parallel_region(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)


class SequenceParallelScatter(nn.Module):
    """Put in front of the embeddings' dropout: from here on each rank holds s/T positions."""

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def forward(self, x):
        return scatter_to_sequence_parallel_region(x, self.group)


class ParallelAttention(CausalSelfAttention):
    """Causal self-attention on this rank's H/T heads: q, k, v column-parallel, the output
    projection row-parallel. The dense module's own forward runs unchanged: it reads the number
    of heads off qkv's output. Attention itself needs no communication: heads are independent.

    With grouped-query attention the rank's block of qkv rows is kv_heads/T query groups (each its
    r query heads, then its key and value head), so r = heads / kv_heads is the same on every rank
    and the forward finds kv_heads/T groups in its rows. T must divide kv_heads (ValueError
    otherwise, by this module's choice: every rank holds whole groups; see the module docstring)."""

    def __init__(self, attn: CausalSelfAttention, group=None, *, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.head_dim, self.dropout = attn.head_dim, attn.dropout
        self.q_per_kv, self.rope_theta = attn.q_per_kv, attn.rope_theta
        kv_heads, ranks = attn.qkv.out_features // (attn.head_dim * (attn.q_per_kv + 2)), comm.get_world_size(group)
        if kv_heads % ranks:
            raise ValueError(f"ParallelAttention: {kv_heads} key/value heads (query groups) do not split over {ranks} "
                             f"tensor-parallel ranks; use a group size that divides {kv_heads} (this library keeps "
                             "whole query groups on each rank)")
        self.qkv = ColumnParallelLinear(attn.qkv, group, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(attn.proj, group, sequence_parallel=sequence_parallel)


class ParallelMLP(MLP):
    """h -> 4h/T (column-parallel; GELU on this rank's units) -> h (row-parallel, one reduction),
    with the dense module's forward."""

    def __init__(self, mlp: MLP, group=None, *, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.fc = ColumnParallelLinear(mlp.fc, group, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(mlp.proj, group, sequence_parallel=sequence_parallel)


class ParallelSwiGLU(SwiGLU):
    """down(SiLU(gate(x)) * up(x)) on this rank's ffn/T units: gate and up column-parallel (the
    same units of each), down row-parallel, so the gating is local and one g sums down's partial
    outputs. x enters once for both: f (or the sequence-parallel all-gather) is applied to it a
    single time and the two shards multiply it as one [gate; up] matrix, so the MLP communicates
    what the GELU MLP does (estimate/tp_comm.py counts the same collectives for both)."""

    def __init__(self, mlp: SwiGLU, group=None, *, sequence_parallel: bool = False):
        nn.Module.__init__(self)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gate = ColumnParallelLinear(mlp.gate, group, sequence_parallel=sequence_parallel)
        self.up = ColumnParallelLinear(mlp.up, group, sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear(mlp.down, group, sequence_parallel=sequence_parallel)

    def forward(self, x):
        if self.sequence_parallel:
            both = [self.gate, self.up]
            bias = None if self.gate.bias is None else torch.cat([m.bias for m in both])
            y = _SequenceParallelLinear.apply(x, torch.cat([m.weight for m in both]), bias, self.group)
            gate, up = y.split(self.gate.weight.shape[0], dim=-1)
        else:
            x = copy_to_tensor_parallel_region(x, self.group)
            gate, up = F.linear(x, self.gate.weight, self.gate.bias), F.linear(x, self.up.weight, self.up.bias)
        return self.down(F.silu(gate) * up)


def parallel_mlp(mlp: nn.Module, group=None, *, sequence_parallel: bool = False) -> nn.Module:
    """The block's MLP cut over `group`: GELU's (`ParallelMLP`) or SwiGLU's (`ParallelSwiGLU`)."""
    for dense, parallel in ((SwiGLU, ParallelSwiGLU), (MLP, ParallelMLP)):
        if isinstance(mlp, dense):
            return parallel(mlp, group, sequence_parallel=sequence_parallel)
    raise ValueError(f"tensor parallelism cuts a GELU MLP or a SwiGLU, not a {type(mlp).__name__} (a mixture of "
                     "experts is expert parallelism's)")


# ====================================================================== the loss on vocabulary shards

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy from this rank's V/T columns of the logits, per token: the softmax's max and
    denominator and the target's logit are reduced over the group (b s numbers each), never the
    logits. Backward is local: softmax minus the one-hot of the target, on this rank's columns."""

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, group):
        ctx.dtype, logits = logits.dtype, logits.float()
        top = logits.max(dim=-1).values
        comm.all_reduce(top, "max", group=group)
        shifted = logits - top.unsqueeze(-1)  # exp cannot overflow; the loss does not change
        local = targets - vocab_start
        elsewhere = (local < 0) | (local >= logits.shape[-1])
        local = local.masked_fill(elsewhere, 0)
        target_logit = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(elsewhere, 0.0)
        exp = shifted.exp()
        sums = torch.stack([target_logit, exp.sum(dim=-1)])  # the two sums travel together
        comm.all_reduce(sums, "sum", group=group)
        target_logit, denominator = sums
        ctx.save_for_backward(exp / denominator.unsqueeze(-1), local, elsewhere)
        return denominator.log() - target_logit

    @staticmethod
    def backward(ctx, grad):
        softmax, local, elsewhere = ctx.saved_tensors
        mine = (~elsewhere).to(softmax.dtype).unsqueeze(-1)  # 1 where the target is in this rank's columns
        one_hot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1), mine)
        return ((softmax - one_hot) * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group=None) -> torch.Tensor:
    """Per-token cross-entropy (shape of `targets`, the same on every rank) from logits whose
    last dimension is this rank's contiguous 1/T of the vocabulary: equal shards, rank i's starting
    at i x its width, as a `ColumnParallelLinear` head makes them (it refuses a vocabulary T does
    not divide)."""
    vocab_start = comm.get_rank(group) * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), vocab_start,
                                            group).view_as(targets)


def gather_vocabulary(logits: torch.Tensor, group=None) -> torch.Tensor:
    """The full logits from the vocabulary shards (for sampling; not differentiable)."""
    return _all_gather(logits, logits.dim() - 1, group)


# ====================================================================== applying it to TinyGPT

def apply_tensor_parallel(model: nn.Module, group=None, *, sequence_parallel: bool = False) -> nn.Module:
    """Cut a TinyGPT (or a pipeline stage of one) over `group`, in place.

    The group's first rank's dense weights are broadcast, then every rank keeps its slices:
    the parallel model computes what the dense one does. The tied LM head and the embedding
    share their vocabulary shard (an untied head is cut by the same rows, a matrix of its own);
    the -inf padding of the logits is sliced with them. Under
    sequence parallelism the residual stream between the parallel regions holds s/T positions
    from the embeddings' dropout to the LM head's input.
    """
    for tensor in [*model.parameters(), *model.buffers()]:
        comm.broadcast(tensor.data, src=comm.global_rank(group, 0), group=group)
    for block in model.blocks.values():
        block.attn = ParallelAttention(block.attn, group, sequence_parallel=sequence_parallel)
        block.mlp = parallel_mlp(block.mlp, group, sequence_parallel=sequence_parallel)
    tied = model.tok_emb is not None and model.lm_head is not None and model.lm_head.weight is model.tok_emb.weight
    if model.tok_emb is not None:
        model.tok_emb = VocabParallelEmbedding(model.tok_emb, group)
        if sequence_parallel:
            model.drop = nn.Sequential(SequenceParallelScatter(group), model.drop)
    if model.lm_head is not None:
        model.lm_head = ColumnParallelLinear(model.lm_head, group, sequence_parallel=sequence_parallel)
        if tied:
            model.lm_head.weight = model.tok_emb.weight
        model.vocab_padding = _shard(model.vocab_padding, 0, group, "the logits' padded vocabulary entries")
    return model


def sharded_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters cut over the group (each rank holds a different part of them)."""
    out = {}
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, VocabParallelEmbedding)):
            out |= {id(p): p for p in m.parameters(recurse=False)}
        elif isinstance(m, RowParallelLinear):
            out[id(m.weight)] = m.weight
    return list(out.values())


def sequence_parallel_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Replicated parameters that see only this rank's positions under sequence parallelism, so
    that each rank's gradient is a partial sum: the norms (LayerNorm's weight and bias, RMSNorm's
    gain) and the row-parallel biases."""
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear) and m.sequence_parallel]
    if not rows:
        return []
    norms = [p for m in model.modules() if isinstance(m, (nn.LayerNorm, nn.RMSNorm)) for p in m.parameters()]
    return norms + [m.bias for m in rows if m.bias is not None]


def allreduce_sequence_parallel_gradients(model: nn.Module, group=None) -> None:
    """Sum the partial gradients of `sequence_parallel_parameters` over the group, in one
    all-reduce (Megatron-LM's all-reduce of the LayerNorm gradients). Once per optimizer step."""
    params = [p for p in sequence_parallel_parameters(model) if p.grad is not None]
    if params:
        flat = _all_reduce(torch.cat([p.grad.reshape(-1) for p in params]), group)
        for p, g in zip(params, flat.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p.grad))


# ====================================================================== the step of the composition

class TensorParallelStep(Step):
    """`--tp T [--sequence-parallel]`: each model chunk cut over the mesh's TP group; every rank of
    the group reads the same micro-batches. The loss is the vocab-parallel one; after backward,
    sequence parallelism's partial gradients are summed; the norm counts each gradient once over
    the group, and every rank scales all of them (or the replicas would drift apart)."""

    axis = "tp"
    title = "tensor parallelism"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        out = []
        if model is not None:
            for what, size in (("heads", model.heads), ("hidden size", model.hidden),
                               ("padded vocabulary", model.padded_vocab)):
                if size % config.tp:
                    out.append(f"--tp {config.tp} must divide the model's {what} ({size})")
            if model.n_kv_heads != model.heads and model.n_kv_heads % config.tp:
                out.append(f"--tp {config.tp} must divide the model's key/value heads ({model.n_kv_heads}): each rank "
                           f"keeps whole key/value heads with their query heads (this library's choice; Megatron "
                           f"Core 0.16+ also takes a --tp they divide); use a --tp that divides {model.n_kv_heads}")
            if model.ffn % config.tp and model.ffn != 4 * model.hidden:  # 4 hidden: the hidden size's line says it
                out.append(f"--tp {config.tp} must divide the model's MLP width (ffn_hidden {model.ffn})")
            if config.sequence_parallel and model.seq_len % config.tp:
                out.append(f"--sequence-parallel needs --tp {config.tp} to divide the sequence length "
                           f"({model.seq_len})")
        if config.sequence_parallel and config.pp > 1:
            out.append("--sequence-parallel does not combine with --pp yet (activations between stages would "
                       "hold s/T positions); leave it out, or use --pp 1")
        return out

    def apply(self, parts, shared, owned):
        for part in parts:
            apply_tensor_parallel(part, self.group, sequence_parallel=self.config.sequence_parallel)
        self.parts = parts
        return parts

    def loss(self, logits, targets):
        return vocab_parallel_cross_entropy(logits, targets, self.group)

    def finish_backward(self):
        for part in self.parts:
            allreduce_sequence_parallel_gradients(part, self.group)

    def norm(self, counted, scaled):
        """The shards counted on every rank, the replicated parameters once (clip.count_once)."""
        shards = [p for part in self.parts for p in sharded_parameters(part)]
        return count_once(counted, shards, self.group), scaled, self.group

    def sampling(self, forward):
        """The whole vocabulary's logits, gathered from the shards. Sequence parallelism needs a length
        T divides: the prompt is padded at its end, which causal attention never lets earlier
        positions see, and the padding's logits are dropped."""
        def whole(idx):
            t = idx.shape[1]
            out = forward(F.pad(idx, (0, -t % self.config.tp if self.config.sequence_parallel else 0)))
            return None if out is None else gather_vocabulary(out, self.group)[:, :t]
        return whole
