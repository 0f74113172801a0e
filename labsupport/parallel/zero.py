"""ZeRO: data parallelism that partitions the model states instead of replicating them.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models") observe that DDP keeps N identical copies of everything a rank needs for the update.
Each data-parallel rank only has to *own* 1/N of it, in three stages:

* ZeRO-1, P_os (`ShardedOptimizer`): the optimizer states. DDP's buckets reduce-scatter
  instead of all-reduce, so each rank receives the averaged gradients of the shard it updates
  (the rest of its full-size gradient buffer is left as it was: it is never read); it updates
  its 1/N of the parameters with its 1/N of the Adam moments, then an all-gather gives everyone
  the updated parameters. A reduce-scatter plus an all-gather cost what one all-reduce costs
  (the ring all-reduce *is* a reduce-scatter followed by an all-gather): the memory is saved
  for free.
* ZeRO-2, P_os+g: the gradients too. The same reduce-scatter, but each bucket's full
  gradients are freed once they are sent, and only the shard is kept. Same traffic again.
* ZeRO-3, P_os+g+p (`ShardedUnit`, fsdp.py): the parameters too. A rank stores only its shard of every
  unit (a transformer block, and the root: embeddings and final LayerNorm); a unit's full
  parameters are all-gathered just before its forward, freed after it, gathered again for its
  backward and freed once its gradients are reduce-scattered. 1.5x DDP's traffic.

A `Partition` is the layout all three share: some parameters flattened into one buffer,
padded to a multiple of N (so any size splits evenly, even a tensor with fewer elements than
ranks), rank r owning the r-th contiguous 1/N. Every communication goes through `comm`.
"""
from __future__ import annotations

import torch

from .. import comm
from .ddp import Bucket, DataParallel, DataParallelStep
from .optim import BETAS, decay_groups

class Partition:
    """Parameters laid end to end in one flat buffer padded to a multiple of the group size N;
    this rank owns elements [rank * shard_size, (rank + 1) * shard_size)."""

    def __init__(self, params, group=None):
        self.params, self.group = list(params), group
        self.world, self.rank = comm.get_world_size(group), comm.get_rank(group)
        self.offsets, total = [], 0
        for p in self.params:
            self.offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_size = -(-total // self.world)  # ceil: the padding is at most N - 1 elements
        self.padded = self.shard_size * self.world
        self.start = self.rank * self.shard_size
        self.grad_shard: torch.Tensor | None = None  # this rank's averaged gradients (ZeRO-2, ZeRO-3)

    def pieces(self):
        """(param, lo, hi, at): elements lo:hi of the flattened param are this rank's, at
        position `at` of its shard. A parameter may be cut between ranks, or not be here at all."""
        end = self.start + self.shard_size
        for p, off in zip(self.params, self.offsets):
            lo, hi = max(off, self.start), min(off + p.numel(), end)
            if lo < hi:
                yield p, lo - off, hi - off, lo - self.start

    def flat_gradients(self) -> torch.Tensor:
        """The full gradients in the flat layout, zero where a parameter has none and in the padding."""
        p0 = self.params[0]
        flat = torch.zeros(self.padded, dtype=p0.dtype, device=p0.device)
        for p, off in zip(self.params, self.offsets):
            if p.grad is not None:
                flat[off:off + p.numel()].copy_(p.grad.reshape(-1))
        return flat


# ====================================================================== the sharded optimizer (ZeRO-1 and ZeRO-2)

class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1: each rank runs `optimizer_cls` on its 1/N of the parameters, then all-gathers them.

        opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, group, lr=1e-3)
        loss.backward(); <average the gradients, e.g. DataParallel>; opt.step()

    The parameters become views of one flat buffer per partition (`partitions`, lists of
    parameters; default all in one), so the all-gather after the step writes them in place.
    The wrapped optimizer sees one tensor per *piece* (the part of a parameter inside this
    rank's shard), in the same parameter groups as the parameters, so per-parameter settings
    such as weight decay stay exact whatever the cut. Adam's moments exist for the pieces only:
    1/N of them per rank. It is a real `torch.optim.Optimizer`: `param_groups` (for an LR
    schedule), `state` and `state_dict()` are the wrapped optimizer's, this rank's shard only.
    """

    def __init__(self, params, optimizer_cls, group=None, *, partitions=None, **kwargs):
        groups = list(params)
        if groups and isinstance(groups[0], torch.Tensor):
            groups = [{"params": groups}]
        members = [p for g in groups for p in g["params"]]
        self.group = group
        self.partitions = [part if isinstance(part, Partition) else Partition(part, group)
                           for part in (partitions or [members])]
        placed = {id(p) for part in self.partitions for p in part.params}
        if placed != {id(p) for p in members}:
            raise ValueError("ShardedOptimizer: the partitions must hold exactly the optimized parameters")
        which = {id(p): i for i, g in enumerate(groups) for p in g["params"]}
        shard_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": []} for g in groups]
        self._pieces = []  # (partition, param, lo, hi, at, piece)
        for part in self.partitions:
            self._flatten(part)
            for p, lo, hi, at in part.pieces():
                piece = p.data.view(-1)[lo:hi]  # a view: the update lands in the parameter itself
                shard_groups[which[id(p)]]["params"].append(piece)
                self._pieces.append((part, p, lo, hi, at, piece))
        self.optim = optimizer_cls(shard_groups, **kwargs)
        super().__init__(self.optim.param_groups, self.optim.defaults)
        self.state = self.optim.state  # one state, the wrapped optimizer's (optimizer_bytes reads it)

    @staticmethod
    def _flatten(part: Partition) -> None:
        p0 = part.params[0]
        part.flat = torch.zeros(part.padded, dtype=p0.dtype, device=p0.device)
        for p, off in zip(part.params, part.offsets):
            part.flat[off:off + p.numel()].copy_(p.data.reshape(-1))
            p.data = part.flat[off:off + p.numel()].view_as(p)

    def pieces(self, of=None) -> list[torch.Tensor]:
        """This rank's pieces of the parameters, or of the parameters in `of` only (their `.grad`
        is the shard's gradient)."""
        keep = None if of is None else {id(p) for p in of}
        return [piece for _, p, *_, piece in self._pieces if keep is None or id(p) in keep]

    def shard_gradients(self) -> None:
        """Give each piece its gradient: from the partition's reduce-scattered shard (ZeRO-2), or
        the matching slice of the averaged full gradient (ZeRO-1). Views: nothing is copied, so
        calling it again (`step` does) is free, and a clip that scaled the pieces stays applied."""
        for part, p, lo, hi, at, piece in self._pieces:
            if part.grad_shard is not None:
                piece.grad = part.grad_shard[at:at + hi - lo]
            elif p.grad is not None:
                piece.grad = p.grad.view(-1)[lo:hi]

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard from the gradients (`shard_gradients`), then all-gather the
        updated parameters of every partition. Like torch's ZeroRedundancyOptimizer it takes the
        gradients as they are: averaging them over the group is the caller's (DataParallel's)."""
        self.shard_gradients()
        loss = self.optim.step(closure)
        for part in self.partitions:
            mine = part.flat[part.start:part.start + part.shard_size]  # this rank's own slice: the in-place form
            comm.all_gather_into_tensor(part.flat, mine, group=self.group)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the pieces' gradients, the shards, and the full gradients of the parameters."""
        self.optim.zero_grad(set_to_none=set_to_none)
        for part in self.partitions:
            part.grad_shard = None
            for p in part.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_dict(self) -> dict:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optim.load_state_dict(state_dict)
        self.param_groups, self.state = self.optim.param_groups, self.optim.state


# ====================================================================== ZeRO-1 and ZeRO-2: reduce-scattering buckets

class ReduceScatterBucket(Bucket):
    """DDP's bucket, reduce-scattered: each rank receives the averaged gradients of its shard of
    the bucket (a `Partition`). ZeRO-1 (`keep_gradients`) writes them back into the full-size
    gradients, which stay allocated as in DDP; ZeRO-2 frees the full gradients as soon as they
    are sent and keeps only the shard. The flat send buffer exists only while in flight."""

    def __init__(self, params, index: int, group=None, keep_gradients: bool = False):  # no persistent buffer
        self.params, self.index, self.group = params, index, group
        self.partition = Partition(params, group)
        self.keep_gradients = keep_gradients
        self.buffer = self.shard = self.work = None
        self.ready: set[int] = set()

    def launch(self) -> None:
        self.buffer = self.partition.flat_gradients()
        if not self.keep_gradients:
            for p in self.params:
                p.grad = None  # in the buffer now; only the shard will be kept
        self.shard = torch.empty(self.partition.shard_size, dtype=self.buffer.dtype, device=self.buffer.device)
        self.work = comm.reduce_scatter_tensor(self.shard, self.buffer, "avg", group=self.group, async_op=True)

    def finish(self) -> None:
        if self.work is not None:
            self.work.wait()
            if self.keep_gradients:  # the owned slices of the full gradients become the averages
                for p, lo, hi, at in self.partition.pieces():
                    if p.grad is not None:
                        p.grad.view(-1)[lo:hi].copy_(self.shard[at:at + hi - lo])
            else:
                self.partition.grad_shard = self.shard
        self.work, self.buffer, self.shard = None, None, None
        self.ready.clear()


class ShardedGradientDataParallel(DataParallel):
    """DataParallel whose buckets reduce-scatter: the same hooks, order and overlap as DDP."""

    def __init__(self, module, group=None, *, keep_gradients: bool = False, **options):
        self.keep_gradients = keep_gradients
        super().__init__(module, group, mode="bucketed", **options)

    def _new_bucket(self, params, index):
        return ReduceScatterBucket(params, index, self.group, self.keep_gradients)


def sharded_adamw(model: ShardedGradientDataParallel, lr: float, weight_decay: float) -> ShardedOptimizer:
    """ZeRO-1's optimizer: the loop's AdamW (optim.py) on this rank's shard, whose partitions are the
    wrapper's buckets (so the shard a bucket delivers is the shard the rank updates)."""
    groups = decay_groups(model.module.parameters(), weight_decay)
    return ShardedOptimizer(groups, torch.optim.AdamW, model.group,
                            partitions=[bucket.partition for bucket in model.buckets], lr=lr, betas=BETAS, foreach=False)


class ZeROStep(DataParallelStep):
    """`--zero 1` and `--zero 2` over the DP group: DDP's step with reduce-scattering buckets (ZeRO-1
    keeps the full gradients, ZeRO-2 frees them once sent) and a ShardedOptimizer whose partitions
    are the buckets. Under gradient accumulation (`no_sync`) the full gradients accumulate locally
    as in DDP and are reduce-scattered once, in the last micro-batch's backward. The norm sums the
    squares of this rank's pieces over the DP group: each element is owned by one rank."""

    zero_stages = (1, 2)
    title = "ZeRO-1/2"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        if config.zero not in cls.zero_stages:
            return []
        out = cls.bucket_problems(config) + cls.shard_problems(config)
        if config.ddp_mode != "bucketed":
            out.append(f"ZeRO reduce-scatters DDP's buckets, so --ddp-mode must be bucketed (got {config.ddp_mode})")
        if config.zero == 2 and (config.tp > 1 or config.pp > 1):
            out.append("ZeRO-2 frees the full gradients the tensor- and pipeline-parallel steps still reduce; with "
                       "--tp or --pp above 1 use --zero 0 or 1")
        return out

    def wrap(self, module, shared, replicas):
        c = self.config
        return ShardedGradientDataParallel(module, self.group, keep_gradients=c.zero == 1, bucket_mb=c.bucket_mb,
                                           find_unused_parameters=c.find_unused_parameters, own_bucket=shared,
                                           params=replicas)

    def make_optimizer(self, parts, lr, weight_decay):
        self.optimizer = sharded_adamw(self.wrapper, lr, weight_decay)
        return self.optimizer

    def finish_backward(self):
        super().finish_backward()
        self.optimizer.shard_gradients()

    def norm(self, counted, scaled):
        return self.optimizer.pieces(of=counted), self.optimizer.pieces(), self.group

