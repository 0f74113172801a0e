"""What the training loop asks of a parallel strategy, and the single-device answers.

The loop in train.py is the same for every strategy (ARCHITECTURE.md, "The strategy
interface"). A strategy

1. places the model, in a fixed order: the pipeline split, then tensor parallel on each stage's
   chunks, then data parallel / ZeRO (`parallelize`), and makes the optimizer for what this
   rank holds;
2. runs a step's micro-batches forward and backward (`forward_backward`, which a pipeline
   schedule replaces) with the loss it supplies (`loss_fn`), then makes the gradients global
   (`finish_backward`), clips them by their true global norm (`clip_grad_norm_`) and turns this
   rank's loss into the step's loss, known on every rank (`reduce_loss`);
3. evaluates, samples and checkpoints with every rank taking part.

This base class is the single-device strategy; the others override what differs.
"""
from __future__ import annotations

import math
from contextlib import nullcontext

import torch

from .. import comm
from ..model import lm_loss
from .config import ParallelConfig
from .mesh import Mesh


def clip_grad_norm_(params, max_norm: float, groups=(), device=None) -> float:
    """Scale gradients so that their global L2 norm is at most `max_norm`; return the norm before.

    `params` are the gradients this rank is responsible for, each counted on exactly one rank
    of each group in `groups` (a shard of a sharded gradient, one TP rank's copy of a
    replicated one); their squared norms are summed over those groups. With no groups the
    norm is local, which is right when every rank holds the same, complete gradients (DDP
    after its all-reduce). The sum is kept in float64 on `device` (NCCL reduces GPU tensors only).
    """
    grads = [p.grad for p in params if p.grad is not None]
    device = device or (grads[0].device if grads else torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in grads:
        total += torch.linalg.vector_norm(g, dtype=torch.float64) ** 2
    for group in groups:
        comm.all_reduce(total, "sum", group=group)
    norm = math.sqrt(total.item())
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for g in grads:
            g.mul_(scale)
    return norm


def adamw(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The loop's optimizer: weight decay on matrices and embeddings, none on biases and LayerNorm (as in GPT-2)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=False)


class Strategy:
    name = "single"

    def __init__(self, rt, config: ParallelConfig | None = None):
        self.rt = rt
        self.config = config or ParallelConfig(strategy=self.name)
        self.mesh = Mesh(self.config.dp, self.config.pp, self.config.tp, rank=rt.rank)

    # ------------------------------------------------------------ placement

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Put the model on this rank's device and cut it as the strategy says (TP -> PP -> DP)."""
        return model.to(self.rt.device)

    def make_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float):
        return adamw(model, lr, weight_decay)

    def data_rank(self) -> tuple[int, int]:
        """(index, count) of this rank among those that split the global batch: its DP coordinate."""
        return self.mesh.dp_rank, self.mesh.dp

    # ------------------------------------------------------------ a step

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)

    def no_sync(self, model):
        """Context for micro-batches before the last one: accumulate locally, communicate nothing."""
        return nullcontext()

    def forward_backward(self, model, batches, autocast=None) -> torch.Tensor:
        """Forward and backward over this rank's micro-batches; return their mean loss (detached).

        Each micro-batch's loss is divided by their number, so the accumulated gradient is the
        gradient of the mean, as one big batch would give. A pipeline strategy replaces this
        with its schedule.
        """
        losses = []
        for i, (x, y) in enumerate(batches):
            with self.no_sync(model) if i < len(batches) - 1 else nullcontext():
                with comm.phase("forward"), autocast or nullcontext():
                    loss = self.loss_fn(model(x), y)
                with comm.phase("backward"):
                    self.backward(loss / len(batches))
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_backward(self, model) -> None:
        """Called once per optimizer step after the last backward: make gradients global."""

    def clip_grad_norm_(self, model, max_norm: float) -> float:
        return clip_grad_norm_(model.parameters(), max_norm, device=self.rt.device)

    def reduce_loss(self, loss: torch.Tensor) -> float:
        """The step's loss (mean over the global batch) from this rank's mean, on every rank."""
        loss = loss.detach().double().reshape(1)
        if self.mesh.dp > 1:
            comm.all_reduce(loss, "avg", group=self.mesh.dp_group)
        return loss.item()

    # ------------------------------------------------------------ around the steps

    @torch.no_grad()
    def evaluate_loss(self, model, x, y) -> torch.Tensor:
        """This rank's mean loss on (x, y), without gradients (every rank calls it)."""
        return self.loss_fn(model(x), y)

    @torch.no_grad()
    def logits(self, model, idx) -> torch.Tensor:
        """Full logits for `idx` on every rank (for sampling)."""
        return model(idx)

    def model_state(self, model) -> dict:
        """This rank's part of the model's weights, as saved in its checkpoint file.

        Wrappers (our DataParallel, torch's DDP) keep the model as `.module`; saving that keeps
        the parameter names of the bare model, so any rank's file loads into `single`.
        """
        return getattr(model, "module", model).state_dict()

    def load_model_state(self, model, state: dict) -> None:
        getattr(model, "module", model).load_state_dict(state)

    def optimizer_state(self, optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def close(self, model) -> None:
        """Remove the hooks the strategy put on the model (a notebook may train it again)."""
