"""Gradient clipping by the global norm, for any way of splitting the model.

The global norm is that of the whole model's gradient, as one device would compute it. Split
over ranks, each rank holds some gradients that are its own (a TP shard, a ZeRO shard, a pipeline
stage's layers) and some that other ranks hold too (a TP-replicated LayerNorm, the tied embedding
on the first and the last stage, everything under DDP after the average). The norm must count
each gradient exactly once, and the scale must apply to every copy, or the copies drift apart.
So the two lists are separate: `counted`, whose squares this rank adds, summed over `groups`;
`scaled`, every gradient this rank holds. The composition (compose.py) builds both from its
steps, each removing what another rank of its axis counts instead, by one rule (`count_once`):
a gradient every rank of a group holds alike is counted on the group's rank 0 only.
"""
from __future__ import annotations

import math

import torch

from .. import comm


def count_once(params, own, group=None) -> list:
    """Of `params`, those whose gradients this rank counts in a norm summed over `group`: those of
    `own` (this rank's alone: a shard, its experts, its stage's layers) on every rank; the others,
    which every rank of the group holds alike (replicated), on the group's rank 0 only, so that
    each counts once (Megatron-LM's `param_is_not_tensor_parallel_duplicate`)."""
    if comm.get_rank(group) == 0:
        return list(params)
    mine = {id(p) for p in own}
    return [p for p in params if id(p) in mine]


def global_grad_norm(counted, groups=(), device=None) -> float:
    """sqrt of the sum of squares of the `counted` gradients over every rank of `groups`. The sum is
    kept in float64 on `device` (NCCL reduces GPU tensors only)."""
    grads = [p.grad for p in counted if p.grad is not None]
    device = device or (grads[0].device if grads else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
    for group in groups:
        comm.all_reduce(total, "sum", group=group)
    return math.sqrt(total.item())


def clip_grad_norm_(counted, max_norm: float, groups=(), scaled=None, device=None) -> float:
    """Scale the gradients of `scaled` (default: `counted`) so that the global norm is at most
    `max_norm`; return the norm before. With no groups the norm is local: right when every rank
    holds the same, complete gradients (DDP after its all-reduce) or there is one rank."""
    counted = list(counted)
    norm = global_grad_norm(counted, groups, device)
    scale = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s epsilon
    if scale < 1:
        for p in (counted if scaled is None else scaled):
            if p.grad is not None:
                p.grad.mul_(scale)
    return norm
