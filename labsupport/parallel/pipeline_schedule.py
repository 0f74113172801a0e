"""The pipeline's executor: one stage runs its list of actions, forward and backward, by send/recv.

The schedules are data (`labsupport.estimate.schedules`: one list of actions per stage, the same
lists the widget draws). `PipelineSchedule.forward_backward` runs this stage's list top to bottom:
F and B compute; a SEND is non-blocking, posted together with the RECV right after it (`_post`
says why) or else before the next compute; a RECV blocks. Each micro-batch's loss is divided by m,
so the accumulated gradients are those of the mean loss, as `single`'s.

It is the composition's *runner* where there is a pipeline (step.py: `Step.runner`): the object
that drives a step's micro-batches forward and backward, and forward alone for validation and
sampling. Where the model is cut (the stage's chunks, the tied matrix) is the split's business
(pipeline.py); the executor only moves activations and gradients between the chunks it is given.
"""
from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from .. import comm
from ..estimate.schedules import model_chunk, peer, schedule


class PipelineSchedule:
    """Runs this stage's actions of `config.schedule` on the stage's model chunks.

    `events` holds the last step's actions on this stage as (start_s, end_s, op, microbatch, chunk),
    seconds from the start of `forward_backward`, for a measured Gantt chart; `events_origin` is that
    start on `time.perf_counter()`, whose clock (CLOCK_MONOTONIC) the processes of one host share, so
    that a run's report can put every stage on one time axis.
    """

    def __init__(self, mesh, config, hidden: int, vocab: int, dtype, device):
        self.mesh, self.config, self.group = mesh, config, mesh.pp_group
        self.hidden, self.vocab, self.dtype, self.device = hidden, vocab, dtype, device
        self.events: list[tuple[float, float, str, int, int]] = []
        self.events_origin = 0.0

    def actions(self, m: int) -> list:
        """This stage's actions of the configured schedule for a step of m micro-batches (notebook
        05's exercise puts an attendee's own lists here)."""
        return schedule(self.config.schedule, self.config.pp, m, self.config.chunks)[self.mesh.pp_rank]

    def forward_backward(self, parts, batches, loss_fn, no_sync, autocast=None, scale_loss=None):
        """Run this stage's actions for the micro-batches `batches`. Returns the mean loss of the
        micro-batches on the last stage; the other stages compute no loss and return None (the
        split's `reduce_loss` sends every stage the last one's). Every backward but each chunk's last
        runs under `no_sync()`: data parallelism communicates in the last one only (Megatron-LM syncs
        the last micro-batch of each model chunk)."""
        p, v, m, s = self.config.pp, self.config.chunks, len(batches), self.mesh.pp_rank
        last = p * v - 1
        inputs, outputs, grads, pending, sent, losses = {}, {}, {}, [], [], []
        self.events = []
        self.events_origin = start = time.perf_counter()  # one host's processes share this clock
        for action in self.actions(m):
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
        return torch.stack(losses).mean() if losses else None

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

    def forward(self, parts, idx):
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

    def share_logits(self, out, idx):
        """The last stage's full logits, sent to every stage of the pipeline."""
        if out is None:
            out = torch.empty((*idx.shape, self.vocab), device=self.device)
        comm.broadcast(out, self.mesh.stage_rank(self.config.pp - 1), group=self.group)
        return out
