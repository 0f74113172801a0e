"""Expert parallelism: the experts of a mixture (model.py's `MoE`) spread over the ranks of a group.

As GShard (Lepikhin et al. 2021, Sec. 3.2) shards experts: of E experts over ep ranks, rank r keeps
experts r E/ep to (r+1) E/ep - 1, the router is replicated, and each rank routes its own share of the
tokens. `apply_expert_parallel` keeps this rank's experts and replaces the layer's `LocalDispatch` by
an all-to-all over the group (`AllToAllDispatch`); the layer's forward is otherwise the one-rank code:

1. route the local tokens; all-gather every rank's counts per (choice, expert), k x E integers
   a rank, from which each rank computes the global queue position of its assignments (hence
   which it keeps) and how many rows it sends to and receives from every rank;
2. dispatch: sort the kept assignments by expert (one rank's experts are then contiguous) and
   send each rank its rows with one all-to-all;
3. each local expert runs on the rows it received;
4. combine: the outputs come back by the reverse all-to-all, in the order they were sent; each
   is scaled by its gate and added to the row of its token, which undoes the sort.

Backward runs the two all-to-alls the other way.

Training with each rank's loss a mean over its tokens and the replicated gradients averaged over
the ranks (data parallelism): the layer's `aux_loss` on a rank uses the global f and its local P, so
its mean over the ranks is the one-rank loss (global-batch balancing: Qiu et al. 2025 synchronise f
the same way), and the gradient an expert gets on its rank is the sum of every rank's
contributions: divide it by ep where the replicated ones are averaged (Megatron-LM's DDP scales
its expert gradients by 1/dp, not by 1/expert-dp, for this reason).
All communication goes through `comm`.

In the training loop, `ExpertParallelStep` is the step of the composition (compose.py), with the
rank layout of Megatron-LM and torchtitan: expert parallelism borrows the data-parallel ranks.
The dp ranks are cut into groups of ep consecutive ones (mesh.py's "ep" group), each rank holding
E/ep experts. The step names the experts' parameters to the later steps (`owned_parameters`), so
data parallelism neither broadcasts nor averages them, and it sums their gradients over the ranks
holding the same experts ("edp", expert data parallel) and divides by dp, which is single's
gradient. An expert that no token of any edp rank's group reached keeps no gradient, as on one rank.
An MoE layer routes the tokens of one micro-batch of its ep group together (capacity and the
balancing loss see them all): one rank's micro-batch of ep x B sequences is the reference.
With a capacity, evaluation (each rank's whole share routed at once) and sampling (every rank
routing the same tokens) drop other tokens than one rank would; without one, nothing differs.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .. import comm
from ..model import LocalDispatch, moe_layers, moe_problems
from .clip import count_once
from .step import Step


def problems(ep: int, *, dp: int | None = None, n_experts: int | None = None) -> list[str]:
    """What expert parallelism of degree `ep` needs, one line per mistake: ep dividing the `dp` ranks
    it cuts into groups, and `n_experts` splitting evenly over a group."""
    out = []
    if dp is not None and dp % ep:
        out.append(f"--ep {ep} must divide --dp {dp}: expert parallelism spreads the experts over data-parallel "
                   "ranks")
    if n_experts is not None and n_experts % ep:
        out.append(f"{n_experts} experts do not split evenly over {ep} expert-parallel ranks; "
                   f"use an ep degree that divides {n_experts}")
    return out


class _AllToAll(torch.autograd.Function):
    """Rows to the ranks in blocks, `send[i]` rows to rank i, `recv[i]` rows from rank i; the
    gradients travel back the same way."""

    @staticmethod
    def forward(ctx, rows, send, recv, group):
        ctx.send, ctx.recv, ctx.group = send, recv, group
        return _exchange(rows, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group), None, None, None


def _exchange(rows, send, recv, group):
    out = rows.new_empty((sum(recv), rows.shape[1]))
    comm.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


class AllToAllDispatch(LocalDispatch):
    """A mixture of experts' rows sent to the ranks of `group` that hold their experts, and back."""

    def __init__(self, group):
        self.group, self.ranks, self.rank = group, comm.get_world_size(group), comm.get_rank(group)

    def all_gather(self, counts):
        out = counts.new_empty((self.ranks * counts.shape[0], counts.shape[1]))
        comm.all_gather_into_tensor(out, counts.contiguous(), group=self.group)
        return out.view(-1, *counts.shape)

    def all_to_all(self, rows, send, recv):
        return _AllToAll.apply(rows, send, recv, self.group)


def apply_expert_parallel(module: nn.Module, group) -> nn.Module:
    """Spread the experts of every MoE in `module` over `group`, in place: the group's first rank's
    router and experts are broadcast, then each rank keeps its E/ep experts. The same computation
    as before, on each rank's share of the tokens."""
    ep, me = comm.get_world_size(group), comm.get_rank(group)
    for moe in moe_layers(module):
        found = problems(ep, n_experts=moe.n_experts)
        if found:
            raise ValueError(found[0])
        for p in moe.parameters():
            comm.broadcast(p.data, src=comm.global_rank(group, 0), group=group)
        per_rank = moe.n_experts // ep
        moe.experts = nn.ModuleDict({e: expert for e, expert in moe.experts.items()
                                     if int(e) // per_rank == me})
        moe.dispatch = AllToAllDispatch(group)
    return module


def remove_expert_parallel(module: nn.Module) -> nn.Module:
    """Undo `apply_expert_parallel`: every rank gets every expert again, from the rank that held it."""
    for moe in moe_layers(module):
        if not isinstance(moe.dispatch, AllToAllDispatch):
            continue
        group, per_rank = moe.dispatch.group, moe.n_experts // moe.dispatch.ranks
        template = next(iter(moe.experts.values()))
        experts = {}
        for e in range(moe.n_experts):
            expert = moe.experts[str(e)] if str(e) in moe.experts else copy.deepcopy(template)
            for p in expert.parameters():
                comm.broadcast(p.data, src=comm.global_rank(group, e // per_rank), group=group)
            experts[str(e)] = expert
        moe.experts, moe.dispatch = nn.ModuleDict(experts), LocalDispatch()
    return module


class ExpertParallelStep(Step):
    """`--ep E` with `--experts`: the experts spread over groups of E data-parallel ranks; the expert
    gradients summed over the ranks holding the same experts and divided by dp (module docstring).
    It also owns the checks of the mixture-of-experts options, whether it applies or not."""

    axis = "ep"
    title = "expert parallelism"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        out = problems(config.ep, dp=config.dp)
        if model is None:
            return out
        if not model.experts:
            return out + ([f"--ep {config.ep} spreads experts over ranks, but the model has none: add --experts E"]
                          if config.ep > 1 else [])
        out += moe_problems(model.experts, model.top_k, model.capacity_factor)
        out += problems(config.ep, n_experts=model.experts)
        if max(config.tp, config.pp, config.cp) > 1:
            out.append("--experts runs with --dp and --ep only, not with --tp, --pp or --cp")
        if config.zero:
            out.append("--experts runs with --zero 0 only (ZeRO's shards would cut across the experts that "
                       "expert parallelism spreads): use --strategy ddp, or --zero 0")
        return out

    def apply(self, parts, shared, owned):
        for part in parts:
            apply_expert_parallel(part, self.group)
        self.experts = [p for part in parts for moe in moe_layers(part) for p in moe.experts.parameters()]
        self.edp = self.mesh.group("edp") if self.mesh.dp > self.mesh.ep else None
        return parts

    def owned_parameters(self):
        """The experts: each rank of a data-parallel group holds others."""
        return self.experts

    def finish_backward(self):
        """Sum each expert's gradient over edp and divide by dp. A rank whose group's tokens did not
        reach an expert holds no gradient for it: it sends zeros, and one more number per parameter,
        1 where it holds a gradient, in the same all-reduce; a parameter no rank holds one for keeps
        None, as on one rank."""
        held = torch.tensor([float(p.grad is not None) for p in self.experts], device=self.experts[0].device)
        flat = torch.cat([*(p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                            for p in self.experts), held])
        if self.edp is not None:
            comm.all_reduce(flat, "sum", group=self.edp)
        pieces = flat.split([p.numel() for p in self.experts] + [len(self.experts)])
        for p, piece, anywhere in zip(self.experts, pieces, pieces[-1].tolist()):
            if anywhere:
                p.grad = piece.view_as(p) / self.mesh.dp

    def norm(self, counted, scaled):
        """Every rank of the ep group counts its own experts, the replicated rest once (clip.count_once)."""
        return count_once(counted, self.experts, self.group), scaled, self.group

