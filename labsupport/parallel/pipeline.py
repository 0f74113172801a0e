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

The schedules are data (`labsupport.estimate.schedules`: one list of actions per stage, the
same lists the widget draws); `PipelineParallel.forward_backward` runs this stage's list top to
bottom: F and B compute; a SEND is non-blocking, posted together with the RECV right after it
(`_post` says why) or else before the next compute; a RECV blocks. Each micro-batch's loss is
divided by m, so the accumulated gradients are those of the mean loss, as `single`'s.

A stage is TinyGPT with the other stages' parts removed (`split_stage`, torchtitan's manual
split): parameter names stay those of the whole model. The LM head is tied to the token
embedding, which live on the first and the last stage: each keeps its copy (equal at the
start), and after backward the two gradients are summed over an embedding group of those two
ranks (Megatron-LM's `embedding_group`), so both copies take the same step. The gradient norm
counts that matrix once, on the first stage.
"""
from __future__ import annotations

import copy
from contextlib import nullcontext
import time

import torch
import torch.nn as nn

from .. import comm
from ..estimate.schedules import SCHEDULES, model_chunk, peer, schedule
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
    first uses the tokens, the last the targets). `events` holds the last step's actions on this
    stage as (start_s, end_s, op, microbatch, chunk), seconds from the start of `forward_backward`,
    for a measured Gantt chart; `events_origin` is that start on `time.perf_counter()`, whose clock
    (CLOCK_MONOTONIC) the processes of one host share, so that a run's report can put every stage
    on one time axis (`train.shared_clock` shifts each stage by its origin minus the earliest).
    """

    axis = "pp"

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

    def __init__(self, mesh, config):
        super().__init__(mesh, config)
        self.events: list[tuple[float, float, str, int, int]] = []

    # ------------------------------------------------------------ placement

    def apply(self, parts, shared):
        (model,) = parts
        p0 = next(model.parameters())
        self.hidden, self.vocab, self.dtype, self.device = model.cfg.hidden, model.cfg.padded_vocab, p0.dtype, p0.device
        self.parts = list(split_stage(model, self.mesh.pp_rank, self.config.pp, self.config.chunks))
        if self.tied is not None:  # both copies start from the first stage's values
            with torch.no_grad():
                comm.broadcast(self.tied, self.mesh.stage_rank(0), group=self.mesh.embedding_group)
        return self.parts

    @property
    def tied(self):
        """This rank's copy of the embedding / LM head matrix (None on the middle stages). Looked up
        each time: tensor parallelism replaces the layers that hold it."""
        if self.mesh.is_first_stage:
            return self.parts[0].tok_emb.weight
        return self.parts[-1].lm_head.weight if self.mesh.is_last_stage else None

    def shared_parameters(self):
        """The tied embedding / LM head matrix: the first and the last stage each hold a copy."""
        return [self.tied] if self.tied is not None else []

    # ------------------------------------------------------------ a step

    def actions(self, m: int) -> list:
        """This stage's actions of the configured schedule for a step of m micro-batches."""
        return schedule(self.config.schedule, self.config.pp, m, self.config.chunks)[self.mesh.pp_rank]

    def forward_backward(self, parts, batches, actions, loss_fn, no_sync, autocast=None, scale_loss=None):
        """Run this stage's `actions`. Returns the mean loss of the micro-batches on the last stage;
        the other stages compute no loss and return NaN (`reduce_loss` sends every stage the last one's).
        Every backward but each chunk's last runs under `no_sync()`: data parallelism communicates in
        the last one only (Megatron-LM syncs the last micro-batch of each model chunk)."""
        p, v, m, s = self.config.pp, self.config.chunks, len(batches), self.mesh.pp_rank
        last = p * v - 1
        inputs, outputs, grads, pending, sent, losses = {}, {}, {}, [], [], []
        self.events = []
        self.events_origin = start = time.perf_counter()  # one host's processes share this clock
        for action in actions:
            began, key = time.perf_counter(), (action.microbatch, action.chunk)
            k = model_chunk(s, action.chunk, p)
            x, y = batches[action.microbatch]
            if action.op == "SEND_F":  # this chunk's output, for the next chunk
                pending.append((action, outputs[key].detach()))
            elif action.op == "SEND_B":  # the gradient of this chunk's input, for the chunk before it
                pending.append((action, inputs.pop(key).grad))
            elif action.op in ("RECV_F", "RECV_B"):
                buf = self._hidden_buffer(x.shape)
                sent += self._post(pending, m, receive=(action, buf))
                if action.op == "RECV_F":
                    inputs[key] = buf.requires_grad_()
                else:
                    grads[key] = buf
            else:
                sent += self._post(pending, m)  # before computing: a neighbour may be waiting for them
                if action.op == "F":
                    with comm.phase("forward"), autocast or nullcontext():
                        out = parts[action.chunk](x if k == 0 else inputs[key])
                        if k == last:
                            loss = loss_fn(out, y)
                            losses.append(loss.detach().float())
                            out = loss / m  # this micro-batch's share of the mean loss
                            if scale_loss is not None:  # fp16: backward starts from the scaled loss
                                out = scale_loss(out)
                    outputs[key] = out
                else:
                    with comm.phase("backward"), no_sync() if action.microbatch < m - 1 else nullcontext():
                        torch.autograd.backward(outputs.pop(key), grads.pop(key, None))
            self.events.append((began - start, time.perf_counter() - start, action.op, action.microbatch, action.chunk))
        sent += self._post(pending, m)
        for work, _ in sent:  # the tensors stay alive until their sends are done
            work.wait()
        return torch.stack(losses).mean() if losses else self.no_loss()

    def _post(self, pending: list, m: int, receive=None) -> list:
        """Post the pending sends, and the receive that follows them if any, as one group; wait for
        the receive. In 1F1B's steady state both neighbours send, then receive from each other:
        gloo copes with sends that are merely non-blocking, NCCL only with the four in one group
        (Megatron-LM's send_forward_recv_backward). Returns the sends' (work, tensor) to wait for."""
        ops = [("send", tensor, *self._channel(action, m)) for action, tensor in pending]
        if receive is not None:
            action, buf = receive
            ops.append(("recv", buf, *self._channel(action, m)))
        works = comm.batch_isend_irecv(ops, group=self.group)
        if receive is not None:
            works.pop().wait()
        sent = [(work, tensor) for work, (_, tensor) in zip(works, pending)]
        pending.clear()
        return sent

    def _channel(self, action, m: int) -> tuple[int, int]:
        """The peer's world rank and the message's tag. Messages between two ranks in one direction
        (interleaved: activations and gradients alike) are told apart by the tag: which boundary
        between model chunks, which micro-batch, activation or gradient."""
        p, s = self.config.pp, self.mesh.pp_rank
        stage, there = peer(s, action, p, self.config.chunks)
        boundary = min(model_chunk(s, action.chunk, p), model_chunk(stage, there.chunk, p))
        return self.mesh.stage_rank(stage), 2 * (boundary * m + action.microbatch) + action.op.endswith("_B")

    def _hidden_buffer(self, tokens_shape):
        """Activations and their gradients are (micro-batch, sequence, hidden), in the parameters'
        dtype: TinyGPT's residual stream is not autocast (embeddings and residual sums stay fp32)."""
        return torch.empty((*tokens_shape, self.hidden), dtype=self.dtype, device=self.device)

    def no_loss(self):
        return torch.tensor(float("nan"), device=self.device)

    def finish_backward(self):
        """Sum the tied matrix's two gradients: the embedding's (first stage) and the head's (last)."""
        if self.tied is not None:
            comm.all_reduce(self.tied.grad, "sum", group=self.mesh.embedding_group)

    def norm(self, counted, scaled):
        """Squares summed over the pipeline, the tied matrix counted on the first stage only; every
        gradient scaled alike (both copies of the tied one, or they would drift apart)."""
        if self.mesh.is_last_stage and self.tied is not None:
            counted = [p for p in counted if p is not self.tied]
        return counted, scaled, self.group

    def reduce_loss(self, loss):
        """The last stage's loss, broadcast to every stage of the pipeline."""
        comm.broadcast(loss, self.mesh.stage_rank(self.config.pp - 1), group=self.group)
        return loss

    # ------------------------------------------------------------ around the steps

    def forward_only(self, parts, idx):
        """Forward through the model chunks in order, without a schedule: each waits for the one
        before. The last stage returns the output, the others None."""
        p, s = self.config.pp, self.mesh.pp_rank
        h = idx
        for c, part in enumerate(parts):
            k = model_chunk(s, c, p)
            if k > 0:
                h = self._hidden_buffer(idx.shape)
                comm.recv(h, self.mesh.stage_rank((s - 1) % p), group=self.group)
            h = part(h)
            if k < p * self.config.chunks - 1:
                comm.send(h, self.mesh.stage_rank((s + 1) % p), group=self.group)
        return h if self.mesh.is_last_stage else None

    def broadcast_logits(self, out, idx):
        """The last stage's full logits, sent to every stage of the pipeline."""
        if out is None:
            out = torch.empty((*idx.shape, self.vocab), device=self.device)
        comm.broadcast(out, self.mesh.stage_rank(self.config.pp - 1), group=self.group)
        return out
