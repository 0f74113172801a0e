"""`torch-pp`: the reference pipeline, torch.distributed.pipelining running our stages.

The stage modules are `pp`'s (the composition's pipeline split, `split_stage`), each wrapped in
torch's `PipelineStage` (stage index c p + s, as in our layout); torch's `ScheduleGPipe`,
`Schedule1F1B` or, with --chunks > 1, `ScheduleInterleaved1F1B` runs them in place of our
executor. Everything around the schedule is `pp`'s: the tied embedding's sync, the gradient norm,
the loss broadcast, evaluation, sampling and checkpoints. The loss is scaled as in `pp` (each micro-batch's loss
divided by m, torch's own scaling off), so both give `single`'s gradients.

torch's sends and receives go over the mesh's PP group, but with its own calls: comm does not
count them. Under --dtype bf16 the whole schedule runs inside autocast (torch gives no hook
around each forward alone); backward under autocast runs in the dtypes its forward recorded.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from ..estimate.schedules import model_chunk
from .compose import Parallel

SCHEDULE_CLASSES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}


class TorchPP(Parallel):
    name = "torch-pp"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        if microbatches is not None and config.schedule != "gpipe" and microbatches < config.pp:
            return [f"torch's {config.schedule} schedule needs at least --pp {config.pp} micro-batches per step, "
                    f"but a step has {microbatches}; use --microbatches {config.pp} or more"]
        return []

    def parallelize(self, model):
        model = super().parallelize(model)
        p, v = self.config.pp, self.config.chunks
        self.stages = [PipelineStage(part, model_chunk(self.mesh.pp_rank, c, p), p * v, self.rt.device,
                                     group=self.mesh.pp_group) for c, part in enumerate(self.parts)]
        self.schedules = {}  # by micro-batch count: a schedule infers the shapes between stages on its first step
        return model

    def _schedule(self, m: int):
        if m not in self.schedules:
            cls = SCHEDULE_CLASSES[self.config.schedule]
            stages = self.stages if cls is ScheduleInterleaved1F1B else self.stages[0]
            self.schedules[m] = cls(stages, m, loss_fn=lambda logits, y: self.loss_fn(logits, y) / m,
                                    scale_grads=False)
        return self.schedules[m]

    def forward_backward(self, model, batches, autocast=None):
        """torch splits the whole batch into the same m micro-batches again; the first stage gives
        it the tokens, the last the targets and gets the (scaled) losses back."""
        m, losses = len(batches), []
        x, y = (torch.cat(t) for t in zip(*batches))
        inputs = (x,) if self.mesh.is_first_stage else ()
        outputs = {"target": y, "losses": losses} if self.mesh.is_last_stage else {}
        with autocast or nullcontext():
            self._schedule(m).step(*inputs, **outputs)
        return torch.stack(losses).sum().detach().float() if losses else self.no_loss()

    def close(self, model):
        """Drop torch's stages and schedules: they hold the PP group."""
        self.stages, self.schedules = [], {}
        super().close(model)
