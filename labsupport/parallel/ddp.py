"""Data parallelism from scratch, in three steps of increasing quality.

Every rank of a data-parallel group holds a full replica and computes gradients on its own
slice of the global batch; averaging the gradients over the group makes every replica take
the same optimizer step, as if one device had seen the whole batch.

* `naive`: after backward, one all-reduce per parameter. Many small messages: latency-bound.
* `flat`: after backward, all gradients copied into one buffer and all-reduced at once.
  One big message, but communication starts only when backward has finished.
* `bucketed` (the default, what torch's DistributedDataParallel does): a hook on each
  parameter fires when its gradient is complete; gradients fill buckets in reverse parameter
  order (roughly the order backward produces them), and a full bucket is all-reduced
  asynchronously at once, so communication overlaps the rest of backward.

`DataParallel` is a library object, like torch's DDP: wrap any module for any process group
(the world, or one DP group of a larger grid), call it, `loss.backward()`, then
`finish_gradient_synchronization()`; `close()` removes its hooks. `DataParallelStep` is the
step of the composition (compose.py) that puts it on the model chunks.

The hook is `register_post_accumulate_grad_hook`, which receives the *parameter* (read
`param.grad`), not the gradient. Like torch DDP, we assume every rank has gradients for the
same parameters; with `find_unused_parameters` (bucketed mode) a parameter may also get a
gradient on some ranks only (a data-dependent branch): forward then walks the autograd graph
from the output, as torch's does, and one small all-reduce per step agrees on what was used.
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

import torch

from .. import comm
from .step import Step

MODES = ("naive", "flat", "bucketed")


def parameters_in_graph(output: torch.Tensor) -> set[int]:
    """ids of the leaf parameters that backward from `output` will reach (its AccumulateGrad nodes)."""
    seen, todo, reached = set(), [output.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if hasattr(node, "variable"):
            reached.add(id(node.variable))
        todo.extend(next_fn for next_fn, _ in node.next_functions)
    return reached


def first_rank(group) -> int:
    """Global rank of the group's first member: the one whose initial values everyone takes."""
    return comm.global_rank(group, 0)


def check_replicas(model, group=None) -> None:
    """Raise if the group's ranks' parameters differ (e.g. seeded differently and never broadcast).

    Compares a fingerprint per parameter (sum and sum of squares, in float64): the largest and
    the smallest value over the group's ranks must agree.
    """
    names = [name for name, _ in model.named_parameters()]
    prints = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                          for p in model.parameters()])
    high, low = prints.clone(), prints.clone()
    comm.all_reduce(high, "max", group=group)
    comm.all_reduce(low, "min", group=group)
    differ = (high != low).any(dim=1).nonzero()
    if len(differ):
        raise ValueError(f"model parameters differ between ranks ({len(differ)} tensors, first: "
                         f"{names[differ[0].item()]}); broadcast rank {first_rank(group)}'s values or "
                         "seed every rank alike")


class Bucket:
    """A group of parameters whose gradients travel in one all-reduce."""

    def __init__(self, params: list[torch.nn.Parameter], index: int, group=None):
        self.params, self.index, self.group = params, index, group
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
        """Copy the gradients in and start averaging them over the group, without waiting."""
        for p, view in self._views():
            view.copy_(p.grad.view(-1)) if p.grad is not None else view.zero_()
        self.work = comm.all_reduce(self.buffer, "avg", group=self.group, async_op=True, bucket=self.index)

    def finish(self) -> None:
        """Wait for the all-reduce and copy the averaged gradients back."""
        if self.work is not None:
            self.work.wait()
            for p, view in self._views():
                if p.grad is not None:
                    p.grad.view(-1).copy_(view)
        self.work = None
        self.ready.clear()


class DataParallel(torch.nn.Module):
    """Average gradients over `group` (None: the world) for any module.

        ddp = DataParallel(model, group, mode="bucketed", bucket_mb=25)
        loss_fn(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
        ddp.close()          # or use it as a context manager

    On construction the group's first rank's parameters and buffers are broadcast, so the
    replicas start identical (`broadcast_init=False` checks that they already are instead).
    Wrapping a module again replaces the earlier wrapper and removes its hooks, so a notebook
    cell run twice does not all-reduce twice. `own_bucket` parameters travel in a bucket of their
    own: two wrappers on different modules then cut a parameter they share alike (a pipeline's
    tied embedding on its first and last stage, whose ZeRO shards must be the same elements).
    """

    def __init__(self, module: torch.nn.Module, group=None, *, mode: str = "bucketed", bucket_mb: float = 25.0,
                 find_unused_parameters: bool = False, broadcast_init: bool = True, own_bucket=()):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"DataParallel(mode=...) must be one of {', '.join(MODES)}, got {mode!r}")
        if not bucket_mb > 0:
            raise ValueError(f"DataParallel(bucket_mb=...) must be > 0, got {bucket_mb!r}")
        if find_unused_parameters and mode != "bucketed":
            raise ValueError("DataParallel(find_unused_parameters=True) needs mode='bucketed'")
        self.module, self.group, self.mode = module, group, mode
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.find_unused_parameters = find_unused_parameters
        self.own_bucket = {id(p) for p in own_bucket}
        self.sync = True
        self.buckets: list[Bucket] = []
        self.next_bucket = 0
        self._hooks = []
        self._warned = False
        self._names = {id(p): name for name, p in module.named_parameters()}
        previous = module.__dict__.get("_data_parallel")
        if previous is not None:
            previous.close()
        module.__dict__["_data_parallel"] = self  # not a submodule: no cycle in state_dict
        if broadcast_init:  # replicas must start identical: the group's first rank's values win
            for tensor in [*module.parameters(), *module.buffers()]:
                comm.broadcast(tensor.data, src=first_rank(group), group=group)
        else:
            check_replicas(module, group)
        if mode == "bucketed":
            self._make_buckets()

    def _trainable(self):
        return [p for p in self.module.parameters() if p.requires_grad]  # frozen ones never communicate

    def _make_buckets(self):
        current, size = [], 0
        for p in reversed(self._trainable()):
            alone = id(p) in self.own_bucket
            if alone and current:  # close the bucket before it
                self.buckets.append(self._new_bucket(current, len(self.buckets)))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= self.bucket_bytes or alone:
                self.buckets.append(self._new_bucket(current, len(self.buckets)))
                current, size = [], 0
        if current:
            self.buckets.append(self._new_bucket(current, len(self.buckets)))
        for bucket in self.buckets:
            for p in bucket.params:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._hook(bucket, id(p))))

    def _new_bucket(self, params, index: int) -> Bucket:
        """A bucket of this wrapper (ZeRO-2 makes ones that reduce-scatter instead)."""
        return Bucket(params, index, self.group)

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

    def forward(self, *args, **kwargs):
        out = self.module(*args, **kwargs)
        self.mark_unused(out)
        return out

    def mark_unused(self, output: torch.Tensor) -> None:
        """With find_unused_parameters, mark the parameters backward from `output` will not reach
        as ready now (they travel as zeros): they get no hook call, and no rank may wait for a
        bucket that cannot fill. `forward` calls it; call it on the output of a module you call
        directly (the training loop calls the model, not the wrapper)."""
        if self.find_unused_parameters and self.sync and torch.is_grad_enabled():
            reached = parameters_in_graph(output)
            for bucket in self.buckets:
                for p in bucket.params:
                    if id(p) not in reached:
                        self._mark_ready(bucket, id(p))

    @contextmanager
    def no_sync(self):
        """Accumulate gradients locally (micro-batches before the last): no communication."""
        self.sync = False
        try:
            yield
        finally:
            self.sync = True

    def finish_gradient_synchronization(self) -> None:
        """After the last backward of a step: wait until every gradient is averaged over the group."""
        if self.mode == "naive":
            for p in self._trainable():
                if p.grad is not None:
                    comm.all_reduce(p.grad, "avg", group=self.group)
        elif self.mode == "flat":  # one bucket holding every gradient, sent after backward
            bucket = Bucket([p for p in self._trainable() if p.grad is not None], 0, self.group)
            bucket.launch()
            bucket.finish()
        else:
            if self.find_unused_parameters:
                self._agree_on_used(self._trainable())
            for bucket in self.buckets[self.next_bucket:]:  # held back behind an incomplete one
                bucket.launch() if bucket.full() else self._launch_incomplete(bucket)
            for bucket in self.buckets:
                bucket.finish()
            self.next_bucket = 0

    def _agree_on_used(self, params):
        """Which parameters got a gradient on any rank: those are averaged (zero where missing),
        the ones used nowhere keep no gradient, exactly as on one device."""
        used = torch.tensor([float(p.grad is not None) for p in params], device=params[0].device)
        comm.all_reduce(used, "max", group=self.group)
        for p, u in zip(params, used.tolist()):
            if u and p.grad is None:
                p.grad = torch.zeros_like(p)

    def _launch_incomplete(self, bucket: Bucket):
        """A bucket whose hooks did not all fire: a parameter got no gradient in this step.

        It held back every later bucket until now, so this step's communication did not
        overlap backward: say so once (torch's DDP raises instead). Without
        find_unused_parameters the ranks must agree (e.g. a layer every rank skips on some
        steps); they still check which parameters anyone used.
        """
        if not self.find_unused_parameters and not self._warned:
            self._warned = True
            missing = [self._names.get(id(p), "?") for p in bucket.params if id(p) not in bucket.ready]
            warnings.warn(f"DataParallel: {', '.join(missing)} got no gradient in backward, so bucket "
                          f"{bucket.index} and the {len(self.buckets) - bucket.index - 1} after it were sent only "
                          "after backward, without overlap. Freeze parameters that are never used "
                          "(requires_grad_(False)), or pass find_unused_parameters=True if their use depends "
                          "on the data", stacklevel=3)
        self._agree_on_used(bucket.params)
        if any(p.grad is not None for p in bucket.params):
            bucket.launch()

    def close(self) -> None:
        """Remove the gradient hooks; the module trains alone again."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self.module.__dict__.get("_data_parallel") is self:
            del self.module.__dict__["_data_parallel"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class DataParallelStep(Step):
    """`--dp D` with --zero 0 (`--ddp-mode`, `--bucket-mb`, `--find-unused-parameters`): the model
    chunks averaged over the mesh's DP group by one DataParallel. The chunks are called directly
    (the pipeline's executor calls each one), so the wrapper only holds the gradient hooks. The
    parameters other ranks also hold (`shared`: the tied matrix on two pipeline stages) get buckets
    of their own, so that a flavour that shards buckets (ZeRO) cuts them alike on both stages."""

    axis = "dp"
    zero_stages = (0,)  # the --zero values this flavour is

    @classmethod
    def applies(cls, config):
        return config.zero in cls.zero_stages and (config.dp > 1 or config.zero > 0)

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        return cls.bucket_problems(config) if config.zero in cls.zero_stages else []

    @staticmethod
    def bucket_problems(config) -> list[str]:
        """The options of DDP's buckets, which ZeRO-1/2 use too."""
        out = []
        if config.ddp_mode not in MODES:
            out.append(f"--ddp-mode must be one of {', '.join(MODES)}, got {config.ddp_mode!r}")
        if not config.bucket_mb > 0:
            out.append(f"--bucket-mb must be > 0, got {config.bucket_mb:g}")
        if config.find_unused_parameters and config.pp > 1:
            out.append("--find-unused-parameters walks the graph from the model's output, which a pipeline stage "
                       "does not see whole; use it with --pp 1")
        return out

    def apply(self, parts, shared):
        self.wrapper = self.wrap(torch.nn.ModuleList(parts), shared)
        self._hooks = [part.register_forward_hook(lambda _module, _args, out: self.wrapper.mark_unused(out))
                       for part in parts] if self.config.find_unused_parameters else []
        return parts

    def wrap(self, module, shared) -> DataParallel:
        c = self.config
        return DataParallel(module, self.group, mode=c.ddp_mode, bucket_mb=c.bucket_mb,
                            find_unused_parameters=c.find_unused_parameters, own_bucket=shared)

    def no_sync(self):
        return self.wrapper.no_sync()

    def finish_backward(self):
        self.wrapper.finish_gradient_synchronization()

    def reduce_loss(self, loss):
        comm.all_reduce(loss, "avg", group=self.group)
        return loss

    def close(self):
        for handle in self._hooks:
            handle.remove()
        self.wrapper.close()
