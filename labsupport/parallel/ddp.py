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
`param.grad`), not the gradient. Like torch DDP, we assume every rank has gradients for the
same parameters; with `find_unused_parameters` (bucketed mode) a parameter may also get a
gradient on some ranks only (a data-dependent branch), at the price of a graph walk and one
small all-reduce per step.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .. import comm
from .strategy import Strategy

MODES = ("naive", "flat", "bucketed")


def parameters_in_graph(loss: torch.Tensor) -> set[int]:
    """ids of the leaf parameters that backward from `loss` will reach (its AccumulateGrad nodes)."""
    seen, todo, reached = set(), [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            reached.add(id(node.variable))
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return reached


def check_replicas(model) -> None:
    """Raise if the ranks' parameters differ (e.g. seeded differently and never broadcast).

    Compares a fingerprint per parameter (sum and sum of squares, in float64): the largest and
    the smallest value over the ranks must agree.
    """
    names = [name for name, _ in model.named_parameters()]
    prints = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                          for p in model.parameters()])
    high, low = prints.clone(), prints.clone()
    comm.all_reduce(high, "max")
    comm.all_reduce(low, "min")
    differ = (high != low).any(dim=1).nonzero()
    if len(differ):
        raise ValueError(f"model parameters differ between ranks ({len(differ)} tensors, first: "
                         f"{names[differ[0].item()]}); broadcast rank 0's values or seed every rank alike")


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

    def full(self) -> bool:
        return len(self.ready) == len(self.params)

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
        self.broadcast_init = getattr(args, "broadcast_init", True)
        self.find_unused_parameters = getattr(args, "find_unused_parameters", False)
        self.next_bucket = 0

    def data_rank(self):
        return self.rt.rank, self.rt.world_size

    def setup(self, model):
        model = model.to(self.rt.device)
        if self.broadcast_init:  # replicas must start identical: rank 0's initial values win
            for tensor in [*model.parameters(), *model.buffers()]:
                comm.broadcast(tensor.data, src=0)
        else:
            check_replicas(model)
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
            if self.sync:
                self._mark_ready(bucket, key)
        return on_grad_ready

    def _mark_ready(self, bucket: Bucket, key: int):
        """Launch full buckets strictly in bucket order: every rank then issues the same
        all-reduces in the same sequence, even if its gradients became ready in another order."""
        bucket.ready.add(key)
        while self.next_bucket < len(self.buckets) and self.buckets[self.next_bucket].full():
            self.buckets[self.next_bucket].launch()
            self.next_bucket += 1

    def backward(self, loss):
        if self.sync and self.find_unused_parameters and self.mode == "bucketed":
            # Parameters this rank's graph never reaches get no hook call: mark them ready now
            # (they travel as zeros), so no rank waits for a bucket that cannot fill.
            reached = parameters_in_graph(loss)
            for bucket in self.buckets:
                for p in bucket.params:
                    if id(p) not in reached:
                        self._mark_ready(bucket, id(p))
        loss.backward()

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
        elif self.mode == "flat":  # one bucket holding every gradient, sent after backward
            bucket = Bucket([p for p in self._trainable(model) if p.grad is not None], 0)
            bucket.launch()
            bucket.finish()
        else:
            if self.find_unused_parameters:
                self._agree_on_used(self._trainable(model))
            for bucket in self.buckets[self.next_bucket:]:  # held back behind an incomplete one
                bucket.launch() if bucket.full() else self._launch_incomplete(bucket)
            for bucket in self.buckets:
                bucket.finish()
            self.next_bucket = 0

    def _agree_on_used(self, params):
        """Which parameters got a gradient on any rank: those are averaged (zero where missing),
        the ones used nowhere keep no gradient, exactly as on one device."""
        used = torch.tensor([float(p.grad is not None) for p in params])
        comm.all_reduce(used, "max")
        for p, u in zip(params, used.tolist()):
            if u and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _launch_incomplete(self, bucket: Bucket):
        """A bucket whose hooks did not all fire: a parameter got no gradient in this step.

        Without find_unused_parameters that must be so on every rank alike (e.g. a layer
        skipped on some steps); the ranks still check which parameters anyone used.
        """
        self._agree_on_used(bucket.params)
        if any(p.grad is not None for p in bucket.params):
            bucket.launch()
