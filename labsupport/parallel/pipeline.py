"""Pipeline parallelism: the layers cut into stages, micro-batches flowing through them.

Each of the p ranks of a pipeline (a *stage*) holds a contiguous slice of the layers. A
micro-batch's activations go forward from stage to stage and its gradients come back, by
point-to-point send/recv between neighbours. While stage 1 works on micro-batch 0, stage 0 can
already start micro-batch 1; what the schedule cannot fill is the *bubble*, (p - 1) / (v m) of
the step for m micro-batches (Narayanan et al. 2021, Sec. 2.2):

* GPipe (Huang et al. 2019): all m forwards, then all m backwards; m micro-batches in flight.
* 1F1B (PipeDream-Flush): p - s - 1 warm-up forwards, then one forward and one backward in
  turn; the same bubble, at most p - s micro-batches in flight.
* interleaved 1F1B: each stage holds v model chunks (Megatron-LM's layout: stage s, chunk c
  holds model chunk c p + s), which divides the bubble by v for v times the messages.

This file is the split: which layers a stage holds and the tied matrix's two copies. The
schedules are data (`labsupport.estimate.schedules`), and the executor that runs a stage's list
of actions is `PipelineSchedule` (pipeline_schedule.py), the split's runner in the composition.

A stage is TinyGPT with the other stages' parts removed (`split_stage`, torchtitan's manual
split): parameter names stay those of the whole model. The token embedding lives on the first
stage and the LM head on the last. When they are tied (GPT-2's shape), each of the two stages
keeps its copy of the one matrix (equal at the start), and after backward the two gradients are
summed over an embedding group of those two ranks (Megatron-LM's `embedding_group`), so both
copies take the same step; the gradient norm counts that matrix once, on the first stage. When
the head is untied (the Llama family, `cfg.tied` False) they are two parameters, each a stage's
own like its blocks: nothing is broadcast or summed between the stages and the norm counts each
where it lives. Megatron-LM does the same: its embedding group's all-reduce runs only when
`share_embeddings_and_output_weights` (its `--untie-embeddings-and-output-weights` turns it off);
torchtitan's Llama is untied and its pipeline split keeps `tok_embeddings` on the first stage and
`output` on the last, with nothing between them.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from .. import comm
from ..estimate.schedules import SCHEDULES, model_chunk
from .clip import count_once
from .pipeline_schedule import PipelineSchedule
from .step import Step


def chunk_layers(n_layers: int, stages: int, chunks: int = 1) -> list[range]:
    """The layers of each model chunk 0 .. p v - 1: contiguous and balanced (p v divides the layers)."""
    per = n_layers // (stages * chunks)
    return [range(k * per, (k + 1) * per) for k in range(stages * chunks)]


def split_stage(model, stage: int, stages: int, chunks: int = 1) -> nn.ModuleList:
    """Stage `stage`'s model chunks: for each c, a copy of `model` keeping only model chunk c p + s
    (its blocks; the embeddings on model chunk 0; the final LayerNorm and the head on the last)."""
    layers = chunk_layers(len(model.blocks), stages, chunks)
    last = stages * chunks - 1
    parts = []
    for c in range(chunks):
        k = model_chunk(stage, c, stages)
        part = copy.deepcopy(model)
        for i in [i for i in part.blocks if int(i) not in layers[k]]:
            del part.blocks[i]
        if k != 0:
            part.tok_emb = part.pos_emb = None
        if k != last:
            part.ln_f = part.lm_head = None
        parts.append(part)
    return nn.ModuleList(parts)


class PipelineSplit(Step):
    """`--pp P [--schedule gpipe|1f1b|interleaved --chunks V] [--microbatches M]`: the first step.

    It turns the model into this stage's chunks; every stage reads the same micro-batches (the
    first uses the tokens, the last the targets), which its `schedule` (a `PipelineSchedule`) runs.
    """

    axis = "pp"
    title = "pipeline parallelism"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        out = []
        if config.schedule not in SCHEDULES:
            out.append(f"--schedule must be one of {', '.join(SCHEDULES)}, got {config.schedule!r}")
        if config.chunks < 1 or (config.microbatches is not None and config.microbatches < 1):
            out.append("--chunks and --microbatches must be >= 1")
        elif config.chunks > 1 and config.schedule != "interleaved":
            out.append(f"--chunks {config.chunks} needs --schedule interleaved (gpipe and 1f1b run one model chunk "
                       "per stage)")
        elif config.schedule == "interleaved" and (config.chunks < 2 or config.pp < 2):
            out.append(f"--schedule interleaved needs --pp 2 or more and --chunks 2 or more (got --pp {config.pp}, "
                       f"--chunks {config.chunks}); with one chunk per stage use --schedule 1f1b")
        stages = config.pp * config.chunks
        if model is not None and model.n_layers % stages:
            more = " (each chunk needs at least one layer)" if stages > model.n_layers else ""
            out.append(f"--pp {config.pp} x --chunks {config.chunks} = {stages} pipeline chunks must divide "
                       f"the model's {model.n_layers} layers{more}")
        if microbatches is not None and config.schedule == "interleaved" and config.pp > 1 and microbatches % config.pp:
            out.append(f"--schedule interleaved runs micro-batches in groups of --pp {config.pp}, but a step has "
                       f"{microbatches}; set --microbatches to a multiple of {config.pp}")
        return out

    # ------------------------------------------------------------ placement

    def apply(self, parts, shared, owned):
        (model,) = parts
        p0 = next(model.parameters())
        self.schedule = PipelineSchedule(self.mesh, self.config, model.cfg.hidden, model.cfg.padded_vocab, p0.dtype,
                                         p0.device)
        self.parts = list(split_stage(model, self.mesh.pp_rank, self.config.pp, self.config.chunks))
        self.tied_head = model.cfg.tied  # untied: the embedding and the head are each one stage's own
        if self.tied is not None:  # both copies start from the first stage's values
            with torch.no_grad():
                comm.broadcast(self.tied, self.mesh.stage_rank(0), group=self.mesh.embedding_group)
        return self.parts

    @property
    def tied(self):
        """This rank's copy of the embedding / LM head matrix (None on the middle stages, and on every
        stage when the head is untied). Looked up each time: tensor parallelism replaces the layers
        that hold it."""
        if not self.tied_head:
            return None
        if self.mesh.is_first_stage:
            return self.parts[0].tok_emb.weight
        return self.parts[-1].lm_head.weight if self.mesh.is_last_stage else None

    def shared_parameters(self):
        """The tied embedding / LM head matrix: the first and the last stage each hold a copy (none when untied)."""
        return [self.tied] if self.tied is not None else []

    def runner(self):
        """The executor of the schedule's action lists drives this stage's micro-batches."""
        return self.schedule

    def finish_backward(self):
        """Sum the tied matrix's two gradients: the embedding's (first stage) and the head's (last); nothing
        when the head is untied."""
        if self.tied is not None:
            comm.all_reduce(self.tied.grad, "sum", group=self.mesh.embedding_group)

    def norm(self, counted, scaled):
        """Squares summed over the pipeline, the tied matrix (on the first and the last stage) counted
        once, on the first (clip.count_once); every gradient scaled alike (both copies of the tied
        one, or they would drift apart). An untied head and embedding are each one stage's own."""
        own = [p for p in counted if p is not self.tied]
        return count_once(counted, own, self.group), scaled, self.group

    def reduce_loss(self, loss):
        """The last stage's loss, broadcast to every stage of the pipeline."""
        comm.broadcast(loss, self.mesh.stage_rank(self.config.pp - 1), group=self.group)
        return loss
