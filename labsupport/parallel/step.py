"""A step of the composition (compose.py): one way of splitting training, on one axis of the mesh.

A new parallelism is a subclass in a file of its own that overrides the hooks its mechanism
changes; every default below does nothing, so the step is invisible where it is not needed.

The micro-batches of a step are run by a *runner* (`Runner` below): the plain loop (each
micro-batch forward, then backward), unless a step brings its own (`Step.runner`: the pipeline's
schedule, which pipeline_schedule.py executes).
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Protocol

import torch

from .strategy import micro_batch_loop


class Step:
    """One way of splitting training, on one axis of the mesh. Override what the mechanism changes."""

    axis = ""  # the mesh axis it splits over: "pp", "tp", "cp", "dp", or "ep" (the dp ranks' expert groups)
    title = ""  # what it is called in a refusal: "pipeline parallelism: ..."

    def __init__(self, mesh, config):
        self.mesh, self.config = mesh, config
        self.group = mesh.group(self.axis)

    @classmethod
    def applies(cls, config) -> bool:
        """Whether the composition of `config` has this step: by default, when its axis' degree is above 1."""
        return getattr(config, cls.axis) > 1

    @classmethod
    def problems(cls, config, model=None, microbatches: int | None = None) -> list[str]:
        """What the step needs of the configuration and of the model's shape (a ModelConfig), one
        line per mistake; `microbatches` is the number a step runs, where the batch is known."""
        return []

    def apply(self, parts: list[torch.nn.Module], shared: list, owned: list) -> list[torch.nn.Module]:
        """Do the step to this rank's model chunks (one without a pipeline); return them. `shared`:
        the parameters earlier steps said other ranks also hold (`shared_parameters`); `owned`: those
        they said are this rank's own (`owned_parameters`)."""
        return parts

    def shared_parameters(self) -> list:
        """Parameters that ranks outside this step's group also hold and update alike (a tied matrix
        on two pipeline stages): a later step that shards gradients must cut them the same way there."""
        return []

    def owned_parameters(self) -> list:
        """Parameters this step gave each rank of its own, whose gradients it makes whole itself (the
        experts under expert parallelism): not replicas, so data parallelism leaves them alone."""
        return []

    def make_optimizer(self, parts, lr: float, weight_decay: float):
        """The optimizer, where the step changes what it updates (ZeRO); None: the loop's AdamW."""
        return None

    def loss(self, logits, targets):
        """Per-token loss, where the step holds the logits differently (TP: vocabulary shards)."""
        return None

    def local_batch(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of a micro-batch's tokens and targets (context parallelism: its positions)."""
        return x, y

    def runner(self) -> "Runner | None":
        """What drives a step's micro-batches forward and backward, where the step changes how they
        run (a pipeline's schedule; it also runs forward alone). None: the plain loop, `PlainLoop`."""
        return None

    def no_sync(self):
        """Context for backwards before a step's last: accumulate locally, communicate nothing."""
        return nullcontext()

    def finish_backward(self) -> None:
        """After the last backward of a step: make this axis' gradients whole."""

    def norm(self, counted: list, scaled: list):
        """(counted, scaled, group): the gradients this rank counts in the global norm once this axis
        is taken into account, those it scales, and the group to sum the squares over (None: none)."""
        return counted, scaled, None

    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """This rank's mean loss -> the mean over this axis (the same on every rank of it)."""
        return loss

    def sampling(self, forward):
        """`forward` (tokens -> logits, None on a rank that computes none) wrapped so that it takes
        whole sequences and gives the whole vocabulary's logits, as sampling needs: a step that cuts
        the sequence or the vocabulary undoes its cut around it."""
        return forward

    def close(self) -> None:
        """Remove what the step put on the model (hooks)."""


class Runner(Protocol):
    """What drives a step's micro-batches: the one role the composition gives a single step."""

    events: list          # the last step's actions, (start_s, end_s, op, microbatch, chunk); [] if none
    events_origin: float  # when that step began, on `time.perf_counter()`

    def forward_backward(self, parts, batches, loss_fn, no_sync, autocast=None, scale_loss=None):
        """Forward and backward of `batches` on this rank's chunks: the mean loss, None where none is computed."""

    def forward(self, parts, idx):
        """Forward alone (validation, sampling): the logits, None on a rank that computes none."""

    def share_logits(self, out, idx):
        """Every rank the logits (a pipeline's first stages have none)."""


class PlainLoop:
    """The runner without a pipeline: the model is one chunk, each micro-batch forward then backward."""

    events: list = []  # no actions to record: only a pipeline's schedule has a Gantt chart
    events_origin = 0.0

    def forward_backward(self, parts, batches, loss_fn, no_sync, autocast=None, scale_loss=None):
        (model,) = parts
        return micro_batch_loop(model, batches, loss_fn, no_sync, autocast, scale_loss)

    def forward(self, parts, idx):
        return parts[0](idx)

    def share_logits(self, out, idx):
        return out
