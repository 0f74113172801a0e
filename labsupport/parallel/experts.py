"""A mixture-of-experts MLP, and expert parallelism: its experts spread over the ranks of a group.

The layer (`MoE`), as Switch Transformer (Fedus et al. 2021) and Mixtral (Jiang et al. 2024) build it:

* the router is a linear map to one logit per expert; their softmax p gives each token's
  probability for every expert, and the token goes to its `top_k` most probable experts with
  those probabilities renormalised over the top_k as gates (Mixtral's softmax over the chosen
  logits; GShard does the same for its top 2). `renormalize=False` keeps p itself, as Switch does
  with top_k = 1, where the renormalised gate would always be 1 and teach the router nothing.
* each expert is TinyGPT's MLP (hidden -> ffn -> hidden, GELU, same init), so the layer takes the
  place of `Block.mlp`.
* capacity: an expert takes at most C = ceil(capacity_factor x top_k x T / n_experts) of the top_k x T
  assignments of T tokens (Switch's expert capacity, Sec. 2.2, times top_k as in GShard's top-2
  capacity 2T/E); the rest are dropped: they add nothing, the token goes on through the residual.
  An expert's queue is filled as GShard's top-2 gating (Algorithm 1) fills it, without its random
  second choice: every token's first choice before any token's second, and within a choice by
  the token's position in the batch. The
  position is global (rank r's tokens come after rank r-1's), so the same assignments are
  dropped whatever the EP degree. `capacity_factor=None`: no capacity, nothing dropped (Mixtral).
* the load-balancing loss, Switch eq. 4 without its alpha (the trainer's, 1e-2 in Switch):
  n_experts x sum_i f_i P_i, with f_i the fraction of assignments the router gave expert i (before
  drops) and P_i its mean probability; 1 when the load is balanced. After each forward,
  `moe.aux_loss` holds it and `moe.load` each expert's count of assignments routed to it and
  dropped (plain ints, for a widget), and the capacity.

Expert parallelism (`apply_expert_parallel`), as GShard (Lepikhin et al. 2021, Sec. 3.2) shards
experts: of E experts over ep ranks, rank r keeps experts r E/ep to (r+1) E/ep - 1, the router
is replicated, and each rank routes its own share of the tokens. One forward:

1. route the local tokens; all-gather every rank's counts per (choice, expert), k x E integers
   a rank, from which each rank computes the global queue position of its assignments (hence
   which it keeps) and how many rows it sends to and receives from every rank;
2. dispatch: sort the kept assignments by expert (one rank's experts are then contiguous) and
   send each rank its rows with one all-to-all;
3. each local expert runs on the rows it received;
4. combine: the outputs come back by the reverse all-to-all, in the order they were sent; each
   is scaled by its gate and added to the row of its token, which undoes the sort.

Backward runs the two all-to-alls the other way. The one-rank MoE is the same code, the
all-to-alls being the identity there.

Training with each rank's loss a mean over its tokens and the replicated gradients averaged over
the ranks (data parallelism): `aux_loss` on a rank uses the global f and its local P, so its mean
over the ranks is the one-rank loss (global-batch balancing: Qiu et al. 2025 synchronise f the
same way), and the gradient an expert gets on its rank is the sum of every rank's
contributions: divide it by ep where the replicated ones are averaged (Megatron-LM's DDP scales
its expert gradients by 1/dp, not by 1/expert-dp, for this reason).
All communication goes through `comm`.

In the training loop, `ExpertParallelStep` is the step of the composition (compose.py), with the
rank layout of Megatron-LM and torchtitan: expert parallelism borrows the data-parallel ranks.
The dp ranks are cut into groups of ep consecutive ones (mesh.py's "ep" group), each rank holding
E/ep experts; the experts' parameters are marked `allreduce = False` (Megatron-LM's mark), so data
parallelism neither broadcasts nor averages them, and the step sums their gradients over the ranks
holding the same experts ("edp", expert data parallel) and divides by dp, which is single's
gradient. An MoE layer routes the tokens of one micro-batch of its ep group together (capacity
and the balancing loss see them all): one rank's micro-batch of ep x B sequences is the reference.
With a capacity, evaluation (each rank's whole share routed at once) and sampling (every rank
routing the same tokens) drop other tokens than one rank would; without one, nothing differs.
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import comm
from ..model import MLP
from .clip import count_once
from .step import Step


def problems(n_experts: int, top_k: int, capacity_factor: float | None, ep: int = 1) -> list[str]:
    """What is wrong with this mixture of experts on `ep` ranks, one line per mistake."""
    out = []
    if not 1 <= top_k <= n_experts:
        out.append(f"top_k {top_k}: each token chooses between 1 and n_experts ({n_experts}) experts")
    if capacity_factor is not None and capacity_factor <= 0:
        out.append(f"capacity_factor {capacity_factor}: it must be above 0 (1.0 holds a balanced load; "
                   "None sets no capacity)")
    if n_experts % ep:
        out.append(f"{n_experts} experts do not split evenly over {ep} expert-parallel ranks; "
                   f"use an ep degree that divides {n_experts}")
    return out


def _check(*args) -> None:
    found = problems(*args)
    if found:
        raise ValueError("; ".join(found))


class Expert(MLP):
    """One expert: TinyGPT's MLP (its forward, its GELU) with a width of its own."""

    def __init__(self, hidden: int, ffn: int, bias: bool = True):
        nn.Module.__init__(self)
        self.fc = nn.Linear(hidden, ffn, bias=bias)
        self.proj = nn.Linear(ffn, hidden, bias=bias)


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


class MoE(nn.Module):
    """Token rows (..., hidden) in, the same shape out: each token's top_k experts' outputs, gated.

    Experts are keyed by their global index (`experts.3.fc.weight`), on one rank all of them,
    under expert parallelism this rank's; `group` is the ep group (None: one rank)."""

    def __init__(self, hidden: int, ffn: int, n_experts: int, top_k: int = 2, capacity_factor: float | None = 1.25,
                 *, bias: bool = True, renormalize: bool = True):
        super().__init__()
        _check(n_experts, top_k, capacity_factor)
        self.n_experts, self.top_k, self.capacity_factor = n_experts, top_k, capacity_factor
        self.renormalize = renormalize
        self.router = nn.Linear(hidden, n_experts, bias=False)  # Switch and Mixtral: no bias
        self.experts = nn.ModuleDict({str(e): Expert(hidden, ffn, bias) for e in range(n_experts)})
        for m in self.modules():  # TinyGPT's init; built inside it, its proj weights are rescaled as the MLP's
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        self.group = None
        self.aux_loss: torch.Tensor | None = None
        self.load: dict | None = None

    def capacity(self, tokens: int) -> int:
        """How many assignments one expert takes of `tokens` tokens' (all ranks' together)."""
        if self.capacity_factor is None:
            return tokens  # an expert is at most once among a token's choices
        return math.ceil(self.capacity_factor * self.top_k * tokens / self.n_experts)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        k, n_experts = self.top_k, self.n_experts
        ep, me = (1, 0) if self.group is None else (comm.get_world_size(self.group), comm.get_rank(self.group))
        local = [int(e) for e in self.experts]  # this rank's experts, ascending

        # route: gate[t, j] weighs token t's j-th choice, expert choice[t, j]
        probs = F.softmax(self.router(tokens), dim=-1)
        gate, choice = probs.topk(k, dim=-1)
        if self.renormalize:
            gate = gate / gate.sum(dim=-1, keepdim=True)
        chosen = F.one_hot(choice, n_experts)                     # (T, k, E)
        counts = self._all_gather(chosen.sum(dim=0))              # (ep, k, E): every rank's counts

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
        rows = tokens[token]
        if self.group is not None:
            rows = _AllToAll.apply(rows, send, recv, self.group)

        expert_of_row = torch.tensor(local, device=x.device).repeat(ep).repeat_interleave(mine.flatten())
        out = self._run_experts(rows, expert_of_row, mine.sum(dim=0).tolist())

        # combine: back in the order sent, gated, added to each assignment's token
        if self.group is not None:
            out = _AllToAll.apply(out, recv, send, self.group)
        gated = out * gate.flatten()[order].unsqueeze(1)
        return gated.new_zeros(tokens.shape).index_add(0, token, gated).view(x.shape)

    def _run_experts(self, rows, expert_of_row, sizes):
        """Each local expert on its rows (`sizes[i]` of them for the i-th); outputs in the rows' order."""
        by_expert = expert_of_row.argsort(stable=True)
        out = torch.cat([expert(chunk) for expert, chunk in zip(self.experts.values(), rows[by_expert].split(sizes))])
        return torch.zeros_like(out).index_copy(0, by_expert, out)

    def _all_gather(self, counts):
        if self.group is None:
            return counts.unsqueeze(0)
        out = counts.new_empty((comm.get_world_size(self.group) * counts.shape[0], counts.shape[1]))
        comm.all_gather_into_tensor(out, counts.contiguous(), group=self.group)
        return out.view(-1, *counts.shape)


def _moes(module: nn.Module) -> list[MoE]:
    return [m for m in module.modules() if isinstance(m, MoE)]


def aux_loss(module: nn.Module) -> torch.Tensor | None:
    """The load-balancing losses of `module`'s MoE layers after a forward, summed over the layers
    (as Switch Transformer sums them); None without MoE layers."""
    losses = [m.aux_loss for m in _moes(module) if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None


def load(module: nn.Module) -> list[dict]:
    """Each MoE layer's last forward: assignments routed to and dropped by each expert, and the capacity."""
    return [m.load for m in _moes(module) if m.load is not None]


def apply_expert_parallel(module: nn.Module, group) -> nn.Module:
    """Spread the experts of every MoE in `module` over `group`, in place: the group's first rank's
    router and experts are broadcast, then each rank keeps its E/ep experts. The same computation
    as before, on each rank's share of the tokens."""
    ep, me = comm.get_world_size(group), comm.get_rank(group)
    for moe in _moes(module):
        _check(moe.n_experts, moe.top_k, moe.capacity_factor, ep)
        for p in moe.parameters():
            comm.broadcast(p.data, src=comm.global_rank(group, 0), group=group)
        per_rank = moe.n_experts // ep
        moe.experts = nn.ModuleDict({e: expert for e, expert in moe.experts.items()
                                     if int(e) // per_rank == me})
        for p in moe.experts.parameters():
            p.allreduce = False  # not a replica: data parallelism leaves it to its expert group (ddp.py)
        moe.group = group
    return module


def remove_expert_parallel(module: nn.Module) -> nn.Module:
    """Undo `apply_expert_parallel`: every rank gets every expert again, from the rank that held it."""
    for moe in _moes(module):
        if moe.group is None:
            continue
        group, per_rank = moe.group, moe.n_experts // comm.get_world_size(moe.group)
        template = next(iter(moe.experts.values()))
        experts = {}
        for e in range(moe.n_experts):
            expert = moe.experts[str(e)] if str(e) in moe.experts else copy.deepcopy(template)
            for p in expert.parameters():
                comm.broadcast(p.data, src=comm.global_rank(group, e // per_rank), group=group)
                p.__dict__.pop("allreduce", None)
            experts[str(e)] = expert
        moe.experts, moe.group = nn.ModuleDict(experts), None
    return module


class ExpertParallelStep(Step):
    """`--ep E` with `--experts`: the experts spread over groups of E data-parallel ranks; the expert
    gradients summed over the ranks holding the same experts and divided by dp (module docstring).
    It also owns the checks of the mixture-of-experts options, whether it applies or not."""

    axis = "ep"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        out = []
        if config.dp % config.ep:
            out.append(f"--ep {config.ep} must divide --dp {config.dp}: expert parallelism spreads the experts "
                       "over data-parallel ranks")
        if model is None:
            return out
        if not model.experts:
            return out + ([f"--ep {config.ep} spreads experts over ranks, but the model has none: add --experts E"]
                          if config.ep > 1 else [])
        out += problems(model.experts, model.top_k, model.capacity_factor, config.ep)
        if max(config.tp, config.pp, config.cp) > 1:
            out.append("--experts runs with --dp and --ep only, not with --tp, --pp or --cp")
        if config.zero:
            out.append("--experts runs with --zero 0 only (ZeRO's shards would cut across the experts that "
                       "expert parallelism spreads): use --strategy ddp, or --zero 0")
        return out

    def apply(self, parts, shared):
        for part in parts:
            apply_expert_parallel(part, self.group)
        self.experts = [p for part in parts for p in part.parameters() if not getattr(p, "allreduce", True)]
        self.edp = self.mesh.group("edp") if self.mesh.dp > self.mesh.ep else None
        return parts

    def finish_backward(self):
        for p in self.experts:  # an expert no token of this rank's group reached: a zero gradient here
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.experts]
        flat = torch.cat([g.reshape(-1) for g in grads])
        if self.edp is not None:
            comm.all_reduce(flat, "sum", group=self.edp)
        flat /= self.mesh.dp
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))

    def norm(self, counted, scaled):
        """Every rank of the ep group counts its own experts, the replicated rest once (clip.count_once)."""
        return count_once(counted, self.experts, self.group), scaled, self.group

