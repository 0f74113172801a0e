"""Data parallelism from scratch, in three steps of increasing quality.

Every rank of a data-parallel group holds a full replica and computes gradients on its own
slice of the global batch; averaging the gradients over the group makes every replica take
the same optimizer step, as if one device had seen the whole batch.

* `naive`: after backward, one all-reduce per parameter. Many small messages: latency-bound.
* `flat`: after backward, all gradients copied into one buffer and all-reduced at once.
  One big message, but communication starts only when backward has finished.
* `bucketed` (the default, what torch's DistributedDataParallel does): a hook on each
  parameter fires when its gradient is complete; gradients fill buckets of `bucket_mb` in
  reverse parameter order (roughly the order backward produces them), and a full bucket is
  all-reduced asynchronously at once, so communication overlaps the rest of backward.
  `bucket_mb=0` gives every parameter a bucket of its own (naive's messages, each sent as soon
  as its gradient is complete); `bucket_mb=None` (or `math.inf`) one bucket for all, sent
  when backward has produced the last gradient (flat's message, through the hooks).

`DataParallel` is a library object, like torch's DDP: wrap any module for any process group
(the world, or one DP group of a larger grid), call it, `loss.backward()`, then
`finish_gradient_synchronization()`; `close()` removes its hooks. `DataParallelStep` is the
step of the composition (compose.py) that puts it on the model chunks. As with torch's DDP, the
script keeps the wrapper while it trains: the module and the gradient hooks hold it only weakly,
so dropping it frees it, with its buckets and its reference to the group, by reference counting
alone (and removes its hooks). Nothing is left for the cycle collector, or for interpreter
shutdown: `finish_gradient_synchronization()` returns once the group's backend has let go of the
step's communication too (see `comm`).

`params` names the parameters the group's ranks hold alike (default: all of the module's). One
left out is not a replica (under expert parallelism each rank of the group holds other experts):
it is neither broadcast nor averaged here; whoever gave it to this rank reduces its gradient
(experts.py). Megatron-LM marks such a parameter on the tensor (`allreduce = False`); here the
composition passes the list (compose.py).

The hook is `register_post_accumulate_grad_hook`, which receives the *parameter* (read
`param.grad`), not the gradient. Like torch DDP, we assume every rank has gradients for the
same parameters; with `find_unused_parameters` (bucketed mode) a parameter may also get a
gradient on some ranks only (a data-dependent branch): forward then walks the autograd graph
from the output, as torch's does, and one small all-reduce per step agrees on what was used.
"""
from __future__ import annotations

import math
import numbers
import warnings
import weakref
from contextlib import contextmanager

import torch

from .. import comm
from .config import DDP_MODES as MODES
from .step import Step


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


def check_replicas(model, group=None, params=None) -> None:
    """Raise if the group's ranks' parameters differ (e.g. seeded differently and never broadcast).
    `params`: those to compare, held alike by every rank of the group (default: all of the model's).

    Compares a fingerprint per parameter (sum and sum of squares, in float64): the largest and
    the smallest value over the group's ranks must agree.
    """
    replicas = {id(p) for p in (model.parameters() if params is None else params)}
    named = [(name, p) for name, p in model.named_parameters() if id(p) in replicas]
    prints = torch.stack([torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
                          for _, p in named])
    high, low = prints.clone(), prints.clone()
    comm.all_reduce(high, "max", group=group)
    comm.all_reduce(low, "min", group=group)
    differ = (high != low).any(dim=1).nonzero()
    if len(differ):
        raise ValueError(f"model parameters differ between ranks ({len(differ)} tensors, first: "
                         f"{named[differ[0].item()][0]}); broadcast rank {first_rank(group)}'s values or "
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
        self._copy_in()
        self.work = comm.all_reduce(self.buffer, "avg", group=self.group, async_op=True, bucket=self.index)

    def _copy_in(self) -> None:  # (no view of the buffer outlives it: comm counts the buffer's references)
        for p, view in self._views():
            view.copy_(p.grad.view(-1)) if p.grad is not None else view.zero_()

    def finish(self) -> None:
        """Wait for the all-reduce (comm returns once gloo has freed it) and copy the averaged gradients back."""
        if self.work is not None:
            self.work.wait()
            for p, view in self._views():
                if p.grad is not None:
                    p.grad.view(-1).copy_(view)
        self.work = None
        self.ready.clear()


def bucket_bytes(bucket_mb) -> float:
    """A bucket's size limit in bytes: a bucket closes once it holds at least this many.

    `bucket_mb=0`: every parameter in a bucket of its own, so each gradient is all-reduced as soon
    as it is complete (naive's messages, overlapped with backward); `None` or `math.inf`: one
    bucket holding every gradient, sent when backward has produced the last of them.
    """
    if bucket_mb is None:
        return math.inf
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real) or not bucket_mb >= 0:
        raise ValueError("DataParallel(bucket_mb=...) must be a size in MB >= 0 (0: a bucket per parameter), "
                         f"or None or math.inf for one bucket holding every gradient; got {bucket_mb!r}")
    return math.inf if math.isinf(bucket_mb) else int(bucket_mb * 2**20)


def _hook(wrapper: DataParallel, index: int, key: int):
    """The gradient hook of the parameter `key` of bucket `index`, which holds its wrapper weakly.

    autograd keeps a parameter's hooks in C++, where the cycle collector cannot see them: a hook
    that held the wrapper (or a bucket, or the module), all of which hold the parameter, would keep
    them alive until the process ends, the group the wrapper uses with them.
    """
    wrapper = weakref.ref(wrapper)

    def on_grad_ready(param):  # the parameter, whose .grad is now complete
        ddp = wrapper()
        if ddp is not None and ddp.sync:
            ddp._mark_ready(ddp.buckets[index], key)
    return on_grad_ready


def _remove_hooks(module_ref, hooks) -> None:
    """Remove a wrapper's hooks, and the module's (now dead) reference to it (close, or the wrapper freed)."""
    for handle in hooks:
        handle.remove()
    hooks.clear()
    module = module_ref()
    wrapper = module.__dict__.get("_data_parallel") if module is not None else None
    if wrapper is not None and wrapper() is None:
        del module.__dict__["_data_parallel"]


class DataParallel(torch.nn.Module):
    """Average gradients over `group` (None: the world) for any module.

        ddp = DataParallel(model, group, mode="bucketed", bucket_mb=25)
        loss_fn(ddp(x), y).backward()
        ddp.finish_gradient_synchronization()
        ddp.close()          # or use it as a context manager

    On construction the group's first rank's parameters and buffers are broadcast, so the
    replicas start identical (`broadcast_init=False` checks that they already are instead).
    `bucket_mb`: 0 for a bucket per parameter, None (or math.inf) for one bucket (see the
    module docstring). Wrapping a module again replaces the earlier wrapper and removes its
    hooks, so a notebook cell run twice does not all-reduce twice; so does dropping the
    wrapper, which nothing else keeps alive. `own_bucket` parameters travel in a bucket of their
    own: two wrappers on different modules then cut a parameter they share alike (a pipeline's
    tied embedding on its first and last stage, whose ZeRO shards must be the same elements).
    `params`: the parameters to average, which every rank of the group holds alike (default: all of
    the module's); the module's others are left alone (see the module docstring).
    """

    def __init__(self, module: torch.nn.Module, group=None, *, mode: str = "bucketed",
                 bucket_mb: float | None = 25.0, find_unused_parameters: bool = False, broadcast_init: bool = True,
                 own_bucket=(), params=None):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"DataParallel(mode=...) must be one of {', '.join(MODES)}, got {mode!r}")
        self.bucket_bytes = bucket_bytes(bucket_mb)
        if find_unused_parameters and mode != "bucketed":
            raise ValueError("DataParallel(find_unused_parameters=True) needs mode='bucketed'")
        self.module, self.group, self.mode = module, group, mode
        self.params = list(module.parameters() if params is None else params)
        self.find_unused_parameters = find_unused_parameters
        self.own_bucket = {id(p) for p in own_bucket}
        self.sync = True
        self.buckets: list[Bucket] = []
        self.next_bucket = 0
        self._hooks = []
        self._warned = False
        self._names = {id(p): name for name, p in module.named_parameters()}
        previous = module.__dict__.get("_data_parallel")
        previous = previous() if previous is not None else None
        if previous is not None and previous.module is module:  # (a deep copy of a wrapped module copies the reference)
            previous.close()
        # Weak, like the hooks' references (see _hook): the wrapper holds the module, never the
        # reverse, so dropping the wrapper frees it (and its group) at once; this removes its hooks.
        module.__dict__["_data_parallel"] = weakref.ref(self)  # not a submodule: no cycle in state_dict
        self._unhook = weakref.finalize(self, _remove_hooks, weakref.ref(module), self._hooks)
        self._unhook.atexit = False
        if broadcast_init:  # replicas must start identical: the group's first rank's values win
            for tensor in [*self.params, *module.buffers()]:
                comm.broadcast(tensor.data, src=first_rank(group), group=group)
        else:
            check_replicas(module, group, self.params)
        if mode == "bucketed":
            self._make_buckets()

    def _trainable(self):
        return [p for p in self.params if p.requires_grad]  # frozen ones never communicate

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
                self._hooks.append(p.register_post_accumulate_grad_hook(_hook(self, bucket.index, id(p))))

    def _new_bucket(self, params, index: int) -> Bucket:
        """A bucket of this wrapper (ZeRO-2 makes ones that reduce-scatter instead)."""
        return Bucket(params, index, self.group)

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
            params = [p for p in self._trainable() if p.grad is not None]
            if params:
                bucket = Bucket(params, 0, self.group)
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
        if not params:
            return
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
        """Remove the gradient hooks; the module trains alone again. Dropping the wrapper does the same."""
        wrapper = self.module.__dict__.get("_data_parallel")
        if wrapper is not None and wrapper() is self:
            del self.module.__dict__["_data_parallel"]
        self._unhook()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class DataParallelStep(Step):
    """`--dp D` with --zero 0 (`--ddp-mode`, `--bucket-mb`, `--find-unused-parameters`): the model
    chunks averaged over the mesh's DP group by one DataParallel (with --cp, over the DP-CP group:
    the parameters are replicated over both, mesh.py). The chunks are called directly
    (the pipeline's executor calls each one), so the wrapper only holds the gradient hooks. The
    parameters other ranks also hold (`shared`: the tied matrix on two pipeline stages) get buckets
    of their own, so that a flavour that shards buckets (ZeRO) cuts them alike on both stages; those
    an earlier step gave each rank of its own (`owned`: the experts under expert parallelism) are
    not replicas, and are left to that step."""

    axis = "dp"
    title = "DDP"
    zero_stages = (0,)  # the --zero values this flavour is

    def __init__(self, mesh, config):
        super().__init__(mesh, config)
        self.group = mesh.replica_group

    @classmethod
    def applies(cls, config):
        return config.zero in cls.zero_stages and (config.dp * config.cp > 1 or config.zero > 0)

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

    @classmethod
    def shard_problems(cls, config) -> list[str]:
        """A flavour that shards (ZeRO, any stage) needs data-parallel ranks to shard over."""
        if config.zero in cls.zero_stages and config.zero and config.dp < 2:
            return [f"stage {config.zero} shards over the data-parallel ranks, but this grid has --dp {config.dp} "
                    "(one rank owning everything is no sharding): give it --dp 2 or more (more ranks, or lower --tp, "
                    "--pp or --cp)"]
        return []

    def apply(self, parts, shared, owned):
        module, not_replicas = torch.nn.ModuleList(parts), {id(p) for p in owned}
        self.wrapper = self.wrap(module, shared, [p for p in module.parameters() if id(p) not in not_replicas])
        self._hooks = [part.register_forward_hook(lambda _module, _args, out: self.wrapper.mark_unused(out))
                       for part in parts] if self.config.find_unused_parameters else []
        return parts

    def wrap(self, module, shared, replicas) -> DataParallel:
        c = self.config
        return DataParallel(module, self.group, mode=c.ddp_mode, bucket_mb=c.bucket_mb,
                            find_unused_parameters=c.find_unused_parameters, own_bucket=shared, params=replicas)

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
