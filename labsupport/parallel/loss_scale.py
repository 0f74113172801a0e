"""Dynamic loss scaling for fp16, the same decision on every rank.

fp16 has 5 exponent bits: its largest value is 65,504, its smallest normal 2^-14 (6.1e-5) and its
smallest subnormal 2^-24 (6.0e-8). Many of a network's gradients are smaller than that and would
flush to zero in an fp16 backward. Micikevicius et al. 2018 ("Mixed Precision Training",
section 3.2, loss scaling) multiply the loss by a scale S before backward: by the chain rule every
gradient is S times larger and lands inside fp16's range; the fp32 gradients are divided by S
again before anything reads them. A fixed S risks the other end, an overflow to inf. The dynamic
rule: when a gradient is inf or NaN, skip the step and halve S; after N steps without one, double
it. torch.amp.GradScaler implements that rule (S = 2^16, N = 2000) for the gradients of one
optimizer.

Why a subclass: split over ranks, an optimizer holds this rank's gradients only (a TP shard, a
ZeRO piece, a pipeline stage's layers), and GradScaler decides from those alone. An inf in one
rank's shard would skip the step there while every other rank stepped, and the replicas, and
their scales, would drift apart for good. `LossScaler` combines the decision: after unscaling, the
found-inf flag is all-reduced (max) over every rank, so the step is skipped everywhere or nowhere
and the scale stays the same on all ranks. (torch's FSDP does the same in its ShardedGradScaler.)

In the step (loop.train_step): backward starts from S times the loss (`Strategy.scale_loss`); the
gradients are made global; `unscale_` divides them by S and agrees on found-inf; only then the clip
measures the true global norm; `step` updates unless found-inf; `update` halves or grows S.
"""
from __future__ import annotations

import warnings

import torch

from .. import comm


class LossScaler(torch.amp.GradScaler):
    """torch's GradScaler whose skip decision is combined over `group` (default: every rank).

        scaler = LossScaler(torch.device("cpu"))
        scaler.scale(loss).backward(); <finish the gradients>
        scaler.unscale_(optimizer); <clip>; scaler.step(optimizer); scaler.update()
        scaler.skipped  # whether this step was skipped, the same on every rank
    """

    def __init__(self, device: torch.device, group=None, **options):
        super().__init__(device.type, **options)
        self.scale(torch.zeros((), device=device))  # S made now: a pipeline stage without the loss scales none
        self.group = group
        self.found_inf: torch.Tensor | None = None

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide this rank's gradients by S, then make found-inf the maximum over every rank."""
        super().unscale_(optimizer)
        per_device = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        found = torch.zeros((), dtype=torch.float32, device=self._scale.device)  # a rank may hold no gradient
        for flag in per_device.values():
            found += flag.to(found.device)
        if comm.get_world_size(self.group) > 1:
            comm.all_reduce(found, "max", group=self.group)
        per_device.clear()
        per_device[found.device] = found  # what step() and update() read
        self.found_inf = found

    @property
    def skipped(self) -> bool:
        """Whether the last unscaled step had an inf or NaN on some rank (its update is skipped)."""
        return bool(self.found_inf is not None and self.found_inf.item())


def fp16_problem(device_type: str) -> str | None:
    """Why `--dtype fp16` cannot run on `device_type` ("cpu", "cuda"), or None: torch's autocast must
    run a matrix multiply in float16 there (torch warns and disables autocast for a dtype a device
    does not support; that warning is the answer)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            a = torch.ones(2, 2, device=device_type)
            with torch.autocast(device_type, dtype=torch.float16):
                out = a @ a
    except (RuntimeError, UserWarning) as e:
        return f"--dtype fp16: torch {torch.__version__} has no float16 autocast on {device_type} ({e}); use --dtype bf16 or fp32"
    if out.dtype != torch.float16:
        return f"--dtype fp16: torch {torch.__version__}'s autocast on {device_type} computes in {out.dtype}; use --dtype bf16 or fp32"
    return None
