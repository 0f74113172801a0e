"""The loop's optimizer recipe, in one place: AdamW as GPT-2 / GPT-3 train it.

Weight decay applies to matrices and embeddings, not to biases and LayerNorm parameters (decaying
a gain towards 0 only fights the normalization); betas (0.9, 0.95) as in GPT-3 (Brown et al. 2020,
Appendix B). Every strategy, ours and the references, builds its optimizer from these two
functions, so a difference between two runs is never a difference of recipe.
"""
from __future__ import annotations

import torch

BETAS = (0.9, 0.95)


def decay_groups(params, weight_decay: float, dims: dict[int, int] | None = None) -> list[dict]:
    """`params` as two parameter groups, decayed (dim >= 2) and not. `dims` maps id(param) to the
    parameter's original number of dimensions, where sharding has flattened it (ZeRO-3, FSDP)."""
    params = [p for p in params if p.requires_grad]
    dim = (lambda p: dims[id(p)]) if dims is not None else (lambda p: p.dim())
    return [{"params": [p for p in params if dim(p) >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if dim(p) < 2], "weight_decay": 0.0}]


def adamw(params, lr: float, weight_decay: float, dims: dict[int, int] | None = None) -> torch.optim.AdamW:
    """The loop's AdamW over `params` (a module's parameters, or the shards this rank holds).
    `foreach=False`: the plain per-tensor loop, one code path for whole parameters and ZeRO's pieces."""
    return torch.optim.AdamW(decay_groups(params, weight_decay, dims), lr=lr, betas=BETAS, foreach=False)
