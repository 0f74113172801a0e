"""Gradient clipping by the global norm, for any way of splitting the model.

The global norm is that of the whole model's gradient, as one device would compute it. Split
over ranks, each rank holds some gradients that are its own (a TP shard, a ZeRO shard, a pipeline
stage's layers) and some that other ranks hold too (a TP-replicated LayerNorm, the tied embedding
on the first and the last stage, everything under DDP after the average). The norm must count
each gradient exactly once, and the scale must apply to every copy, or the copies drift apart.
So the two lists are separate: `counted`, whose squares this rank adds, summed over `groups`;
`scaled`, every gradient this rank holds. The composition (compose.py) builds both from its
steps, each removing what another rank of its axis counts instead.
"""
from __future__ import annotations

import math

import torch

from .. import comm


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
