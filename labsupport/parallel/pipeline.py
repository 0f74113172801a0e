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
import math
from contextlib import nullcontext

import torch
import torch.nn as nn

from .. import comm
from ..estimate.schedules import model_chunk, peer, schedule
from .strategy import Strategy, clip_grad_norm_


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


class PipelineParallel(Strategy):
    """`--strategy pp --pp P [--schedule gpipe|1f1b|interleaved --chunks V] [--microbatches M]`.

    The model this strategy returns is the stage's chunks (an `nn.ModuleList`); every stage reads
    the same micro-batches (the first uses the tokens, the last the targets). `events` holds the
    last step's actions on this stage as (start_s, end_s, op, microbatch, chunk), seconds from
    the start of `forward_backward`, for a measured Gantt chart.
    """

    name = "pp"

    def __init__(self, rt, config=None):
        super().__init__(rt, config)
        self.events: list[tuple[float, float, str, int, int]] = []

    # ------------------------------------------------------------ placement

    def parallelize(self, model):
        self._cfg, self._dtype = model.cfg, next(model.parameters()).dtype  # what travels between stages
        model = split_stage(model.to(self.rt.device), self.mesh.pp_rank, self.config.pp, self.config.chunks)
        tied = self._tied_weight(model)
        if tied is not None:  # both copies start from the first stage's values
            with torch.no_grad():
                comm.broadcast(tied, self.mesh.stage_rank(0), group=self.mesh.embedding_group)
        return model

    def _tied_weight(self, model):
        """This rank's copy of the embedding / LM head matrix when the two are on different stages."""
        if self.config.pp == 1:
            return None  # one stage: the tie is the model's own shared Parameter
        if self.mesh.is_first_stage:
            return model[0].tok_emb.weight
        return model[-1].lm_head.weight if self.mesh.is_last_stage else None

    # ------------------------------------------------------------ a step

    def forward_backward(self, model, batches, autocast=None):
        """Run this stage's actions of the schedule. Returns the mean loss of the micro-batches on
        the last stage; the other stages compute no loss and return NaN (`reduce_loss` sends
        every stage the last one's)."""
        p, v, m, s = self.config.pp, self.config.chunks, len(batches), self.mesh.pp_rank
        last = p * v - 1
        inputs, outputs, grads, pending, sent, losses = {}, {}, {}, [], [], []
        self.events = []
        start = comm.now()
        for action in self.stage_actions(m):
            began, key = comm.now(), (action.microbatch, action.chunk)
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
                        out = model[action.chunk](x if k == 0 else inputs[key])
                        if k == last:
                            loss = self.loss_fn(out, y)
                            losses.append(loss.detach().float())
                            out = loss / m  # this micro-batch's share of the mean loss
                    outputs[key] = out
                else:  # data parallelism syncs in each chunk's last backward only (`no_sync` before)
                    with comm.phase("backward"), self.no_sync(model) if action.microbatch < m - 1 else nullcontext():
                        torch.autograd.backward(outputs.pop(key), grads.pop(key, None))
            self.events.append((began - start, comm.now() - start, action.op, action.microbatch, action.chunk))
        sent += self._post(pending, m)
        for work, _ in sent:  # the tensors stay alive until their sends are done
            work.wait()
        return torch.stack(losses).mean() if losses else self._no_loss()

    def stage_actions(self, m: int) -> list:
        """This stage's actions for a step of m micro-batches: the configured schedule's (notebook
        05's exercise puts an attendee's own list here)."""
        return schedule(self.config.schedule, self.config.pp, m, self.config.chunks)[self.mesh.pp_rank]

    def _post(self, pending: list, m: int, receive=None) -> list:
        """Post the pending sends, and the receive that follows them if any, as one group; wait for
        the receive. In 1F1B's steady state both neighbours send, then receive from each other:
        gloo copes with sends that are merely non-blocking, NCCL only with the four in one group
        (Megatron-LM's send_forward_recv_backward). Returns the sends' (work, tensor) to wait for."""
        ops = [("send", tensor, *self._channel(action, m)) for action, tensor in pending]
        if receive is not None:
            action, buf = receive
            ops.append(("recv", buf, *self._channel(action, m)))
        works = comm.batch_isend_irecv(ops, group=self.mesh.pp_group)
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
        return torch.empty((*tokens_shape, self._cfg.hidden), dtype=self._dtype, device=self.rt.device)

    def _no_loss(self):
        return torch.tensor(float("nan"), device=self.rt.device)

    def finish_backward(self, model):
        """Sum the tied matrix's two gradients: the embedding's (first stage) and the head's (last)."""
        tied = self._tied_weight(model)
        if tied is not None:
            comm.all_reduce(tied.grad, "sum", group=self.mesh.embedding_group)

    def clip_grad_norm_(self, model, max_norm):
        """Squares summed over the pipeline, the tied matrix counted on the first stage only; then
        every gradient scaled alike (both copies of the tied one, or they would drift apart)."""
        tied = self._tied_weight(model) if self.mesh.is_last_stage else None
        mine = [p for p in model.parameters() if p is not tied]
        groups = (self.mesh.pp_group,) if self.config.pp > 1 else ()
        norm = clip_grad_norm_(mine, math.inf, groups=groups, device=self.rt.device)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, torch.tensor(norm), foreach=False)
        return norm

    def reduce_loss(self, loss):
        """The last stage's loss, broadcast to every stage of the pipeline, then averaged over DP."""
        loss = loss.detach().double().reshape(1)
        if self.config.pp > 1:
            comm.broadcast(loss, self.mesh.stage_rank(self.config.pp - 1), group=self.mesh.pp_group)
        return super().reduce_loss(loss)

    # ------------------------------------------------------------ around the steps

    def _forward_only(self, model, idx):
        """Forward through the model chunks in order, without a schedule: each waits for the one
        before. The last stage returns the output, the others None."""
        p, s = self.config.pp, self.mesh.pp_rank
        h = idx
        for c, part in enumerate(model):
            k = model_chunk(s, c, p)
            if k > 0:
                h = self._hidden_buffer(idx.shape)
                comm.recv(h, self.mesh.stage_rank((s - 1) % p), group=self.mesh.pp_group)
            h = part(h)
            if k < p * self.config.chunks - 1:
                comm.send(h, self.mesh.stage_rank((s + 1) % p), group=self.mesh.pp_group)
        return h if self.mesh.is_last_stage else None

    @torch.no_grad()
    def evaluate_loss(self, model, x, y):
        """The loss on the last stage, NaN on the others (`reduce_loss` follows)."""
        logits = self._forward_only(model, x)
        return self.loss_fn(logits, y) if logits is not None else self._no_loss()

    def _last_stage_logits(self, model, idx):
        """The full logits on the last stage, None on the others (3d gathers its vocabulary shards here)."""
        return self._forward_only(model, idx)

    @torch.no_grad()
    def logits(self, model, idx):
        """Full logits on every rank: the last stage's, broadcast over the pipeline."""
        out = self._last_stage_logits(model, idx)
        if self.config.pp > 1:
            if out is None:
                out = torch.empty((*idx.shape, self._cfg.padded_vocab), device=self.rt.device)
            comm.broadcast(out, self.mesh.stage_rank(self.config.pp - 1), group=self.mesh.pp_group)
        return out

    def model_state(self, model):
        """This stage's weights under the whole model's names (its chunks hold different layers)."""
        return {name: t for part in model for name, t in part.state_dict().items()}

    def load_model_state(self, model, state):
        for part in model:
            part.load_state_dict({name: state[name] for name in part.state_dict()})
