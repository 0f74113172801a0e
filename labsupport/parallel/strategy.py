"""What the training loop asks of a parallel strategy, and the single-device answers.

The loop in train.py is the same for every strategy; a strategy decides how the model is
placed (`setup`), which data this rank sees (`data_rank`), how gradients are combined
after backward (`finish_backward`), how micro-batches skip communication (`no_sync`), and
how the optimizer and the gradient norm are computed when state is sharded. The base class
is the single-device strategy: every hook is the identity.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch


class Strategy:
    name = "single"

    def __init__(self, rt, args):
        self.rt = rt
        self.args = args
        if self.name == "single" and rt.world_size != 1:
            raise ValueError(f"strategy 'single' runs on one rank, but world size is {rt.world_size}; use --nproc 1")

    def setup(self, model: torch.nn.Module) -> torch.nn.Module:
        """Place the model on this rank (and make the replicas identical, for data parallelism)."""
        return model.to(self.rt.device)

    def data_rank(self) -> tuple[int, int]:
        """(index, count) of this rank among those that split the global batch."""
        return 0, 1

    def module(self, model: torch.nn.Module) -> torch.nn.Module:
        """The TinyGPT inside whatever wrapper the strategy put around it (for eval and sampling)."""
        return model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def no_sync(self):
        """Context for micro-batches before the last one: accumulate locally, communicate nothing."""
        return nullcontext()

    def finish_backward(self, model: torch.nn.Module) -> None:
        """Called once per optimizer step after the last backward: make gradients global."""

    def make_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float):
        """AdamW; weight decay on matrices and embeddings, none on biases and LayerNorm (as in GPT-2)."""
        decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
        groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), foreach=False)

    def clip_grad_norm_(self, model: torch.nn.Module, max_norm: float) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=False))

    def model_state(self, model: torch.nn.Module) -> dict:
        return model.state_dict()

    def load_model_state(self, model: torch.nn.Module, state: dict) -> None:
        model.load_state_dict(state)

    def dp_group(self):
        """The process group over which per-rank losses are averaged (None: the world)."""
        return None
