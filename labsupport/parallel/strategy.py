"""What the training loop asks of a parallel strategy, and the single-device answers.

The loop in loop.py is the same for every strategy (ARCHITECTURE.md, "The strategy
interface"). A strategy

1. places the model (`parallelize`) and makes the optimizer for what this rank holds;
2. runs a step's micro-batches forward and backward (`forward_backward`, which a pipeline
   schedule replaces) with the loss it supplies (`loss_fn`), then makes the gradients global
   (`finish_backward`), clips them by their true global norm (`clip_grad_norm_`) and turns this
   rank's loss into the step's loss, known on every rank (`reduce_loss`);
3. evaluates, samples and checkpoints with every rank taking part.

This base class answers for one device. Our own parallelisms are all one strategy, `Parallel`
(compose.py), which asks its composed steps; the references (torch's DDP, FSDP, TP, pipelining,
Accelerate) are classes of their own that override what their library does differently.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import comm
from ..model import lm_loss
from .clip import clip_grad_norm_
from .loss_scale import LossScaler, fp16_problem
from .mesh import Mesh
from .optim import adamw


def micro_batch_loop(model, batches, loss_fn, no_sync, autocast=None, scale_loss=None, backward=None):
    """Each micro-batch forward, then backward, `no_sync()` around all but the last; their mean loss.

    Each micro-batch's loss is divided by their number, so the accumulated gradient is the
    gradient of the mean, as one big batch would give. `scale_loss`: fp16's loss scale;
    `backward`: a library's own (DeepSpeed's engine), else `Tensor.backward`.
    """
    losses = []
    for i, (x, y) in enumerate(batches):
        with no_sync() if i < len(batches) - 1 else nullcontext():
            with comm.phase("forward"), autocast or nullcontext():
                loss = loss_fn(model(x), y)
            with comm.phase("backward"):
                share = loss / len(batches)
                (backward or torch.Tensor.backward)(scale_loss(share) if scale_loss is not None else share)
        losses.append(loss.detach().float())
    return torch.stack(losses).mean()


class Strategy:
    name = "single"
    fp16 = False        # whether every backward it runs starts from a scaled loss (--dtype fp16 needs it)
    loss_scaler = None  # under fp16, what `make_loss_scaler` made

    @classmethod
    def problems(cls, config, model=None, microbatches: int | None = None) -> list[str]:
        """What this strategy cannot do beyond what the configuration and the steps check (a
        reference's own limits), one line per mistake."""
        return []

    @classmethod
    def fp16_problem(cls, device_type: str) -> str | None:
        """Why `--dtype fp16` cannot run on `device_type` ("cpu", "cuda"), asked before any rank starts:
        torch's autocast must compute in float16 there (a library with its own fp16 path adds its own)."""
        return fp16_problem(device_type)

    def __init__(self, rt, config):
        self.rt, self.config = rt, config
        self.mesh = Mesh(config.dp, config.pp, config.tp, rank=rt.rank, cp=config.cp, ep=config.ep)

    # ------------------------------------------------------------ placement

    def set_step(self, micro_batch: int, accumulation: int, grad_clip: float) -> None:
        """What a step will be, told before the model is placed: sequences per micro-batch,
        micro-batches per step, the clipping norm. A library that runs the step itself (DeepSpeed)
        is configured with them; the loop gives them to the others step by step."""

    def make_loss_scaler(self, init_scale: float | None):
        """Under fp16, told before the model is placed: the loop's LossScaler (loss_scale.py), starting
        at `init_scale` (None: GradScaler's 2^16). A library that scales the loss itself (DeepSpeed)
        answers with what the loop may read of its own scaler."""
        return LossScaler(self.rt.device, **({"init_scale": init_scale} if init_scale else {}))

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Put the model on this rank's device and split it as the strategy says."""
        return model.to(self.rt.device)

    def make_optimizer(self, model: torch.nn.Module, lr: float, weight_decay: float):
        return adamw(model.parameters(), lr, weight_decay)

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
        A pipeline strategy replaces this with its schedule."""
        return micro_batch_loop(model, batches, self.loss_fn, lambda: self.no_sync(model), autocast,
                                self.scale_loss, self.backward)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss a backward starts from: under fp16, times the loss scale (loss_scale.py)."""
        return loss if self.loss_scaler is None else self.loss_scaler.scale(loss)

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

        Wrappers (torch's DDP, Accelerate's) keep the model as `.module`; saving that keeps the
        parameter names of the bare model, so any rank's file loads into `single`.
        """
        return getattr(model, "module", model).state_dict()

    def load_model_state(self, model, state: dict) -> None:
        getattr(model, "module", model).load_state_dict(state)

    def optimizer_state(self, optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)

    def save_state(self, directory) -> None:
        """Save what a library checkpoints itself (DeepSpeed's engine) into the step's `directory`,
        before the loop writes its own files there: every rank calls it."""

    def load_state(self, directory) -> None:
        """Load what `save_state` wrote, after the loop loaded its own files."""

    def close(self, model) -> None:
        """Remove the hooks the strategy put on the model (a notebook may train it again)."""
