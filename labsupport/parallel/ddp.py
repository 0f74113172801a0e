"""Data parallelism from scratch, in three steps of increasing quality.

Every rank holds a full replica and computes gradients on its own slice of the global batch;
averaging the gradients over ranks makes every replica take the same optimizer step, as if
one device had seen the whole batch.

* `naive`: after backward, one all-reduce per parameter. Many small messages: latency-bound.
* `flat`: after backward, all gradients copied into one buffer and all-reduced at once.
  One big message, but communication starts only when backward has finished.
* `bucketed` (the default, what torch's DistributedDataParallel does): a hook on each
  parameter fires when its gradient is complete; gradients fill buckets in reverse parameter
  order (roughly the order backward produces them), and a full bucket is all-reduced
  asynchronously at once, so communication overlaps the rest of backward.

The hook is `register_post_accumulate_grad_hook`, which receives the *parameter* (read
`param.grad`), not the gradient. `naive` and `flat` assume every rank has gradients for the
same parameters (as torch DDP does without find_unused_parameters); `bucketed` also handles
parameters that get no gradient on some ranks.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import comm
from .strategy import Strategy

MODES = ("naive", "flat", "bucketed")


class Bucket:
    """A group of parameters whose gradients travel in one all-reduce."""

    def __init__(self, params: list[torch.nn.Parameter], index: int):
        self.params, self.index = params, index
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
        self.ready: set[int] = set()
        self.work = None

    def _views(self):
        offset = 0
        for p in self.params:
            yield p, self.buffer[offset:offset + p.numel()]
            offset += p.numel()

    def launch(self) -> None:
        """Copy the gradients in and start averaging them over the ranks, without waiting."""
        for p, view in self._views():
            view.copy_(p.grad.view(-1)) if p.grad is not None else view.zero_()
        self.work = comm.all_reduce(self.buffer, "avg", async_op=True, bucket=self.index)

    def finish(self) -> None:
        """Wait for the all-reduce and copy the averaged gradients back."""
        if self.work is not None:
            self.work.wait()
            for p, view in self._views():
                if p.grad is not None:
                    p.grad.view(-1).copy_(view)
        self.work = None
        self.ready.clear()


class DataParallel(Strategy):
    name = "ddp"

    def __init__(self, rt, args):
        super().__init__(rt, args)
        self.mode = getattr(args, "ddp_mode", "bucketed")
        self.bucket_bytes = int(getattr(args, "bucket_mb", 25.0) * 2**20)
        if self.mode not in MODES:
            raise ValueError(f"unknown --ddp-mode {self.mode!r}; choose one of {', '.join(MODES)}")
        if self.bucket_bytes <= 0:
            raise ValueError("--bucket-mb must be > 0")
        self.sync = True
        self.buckets: list[Bucket] = []

    def data_rank(self):
        return self.rt.rank, self.rt.world_size

    def setup(self, model):
        model = model.to(self.rt.device)
        # Replicas must start identical: rank 0's initial values win.
        for tensor in [*model.parameters(), *model.buffers()]:
            comm.broadcast(tensor.data, src=0)
        if self.mode == "bucketed":
            self._make_buckets(model)
        return model

    def _trainable(self, model):
        return [p for p in model.parameters() if p.requires_grad]  # frozen ones never communicate

    def _make_buckets(self, model):
        current, size = [], 0
        for p in reversed(self._trainable(model)):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= self.bucket_bytes:
                self.buckets.append(Bucket(current, len(self.buckets)))
                current, size = [], 0
        if current:
            self.buckets.append(Bucket(current, len(self.buckets)))
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._hook(bucket, id(p)))

    def _hook(self, bucket: Bucket, key: int):
        def on_grad_ready(param):  # the parameter, whose .grad is now complete
            if not self.sync:
                return
            bucket.ready.add(key)
            if len(bucket.ready) == len(bucket.params):
                bucket.launch()
        return on_grad_ready

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-batches before the last): no communication."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def finish_backward(self, model):
        if self.mode == "naive":
            for p in self._trainable(model):
                if p.grad is not None:
                    comm.all_reduce(p.grad, "avg")
        elif self.mode == "flat":
            grads = [p.grad for p in self._trainable(model) if p.grad is not None]
            flat = torch.cat([g.view(-1) for g in grads])
            comm.all_reduce(flat, "avg")
            offset = 0
            for g in grads:
                g.view(-1).copy_(flat[offset:offset + g.numel()])
                offset += g.numel()
        else:
            for bucket in self.buckets:
                if bucket.work is None:
                    self._launch_incomplete(bucket)
            for bucket in self.buckets:
                bucket.finish()

    def _launch_incomplete(self, bucket: Bucket):
        """A bucket whose hooks did not all fire: some parameter got no gradient on this rank.

        Whether a parameter was used can differ between ranks (data-dependent branches), so
        the ranks first agree on which parameters got a gradient anywhere; those are averaged
        (as zero where missing), and the ones used nowhere keep no gradient, as on one device.
        """
        used = torch.tensor([float(p.grad is not None) for p in bucket.params])
        comm.all_reduce(used, "max")
        if not used.any():
            return
        for p, u in zip(bucket.params, used.tolist()):
            if u and p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket.launch()
