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
* ZeRO-3, P_os+g+p (`ShardedUnit`): the parameters too. A rank stores only its shard of every
  unit (a transformer block, and the root: embeddings and final LayerNorm); a unit's full
  parameters are all-gathered just before its forward, freed after it, gathered again for its
  backward and freed once its gradients are reduce-scattered. 1.5x DDP's traffic.

A `Partition` is the layout all three share: some parameters flattened into one buffer,
padded to a multiple of N (so any size splits evenly, even a tensor with fewer elements than
ranks), rank r owning the r-th contiguous 1/N. Every communication goes through `comm`.
"""
from __future__ import annotations

from contextlib import nullcontext

import torch

from .. import comm
from .ddp import Bucket, DataParallel, DDPStrategy, first_rank
from .strategy import Strategy, clip_grad_norm_

BETAS = (0.9, 0.95)  # the loop's AdamW (strategy.adamw)


def decay_groups(named_dims, weight_decay: float, params) -> list[dict]:
    """The loop's weight-decay recipe as parameter groups: decay on matrices and embeddings
    (dim >= 2), none on biases and LayerNorm. `named_dims` maps id(param) -> its original dim."""
    decay = [p for p in params if named_dims[id(p)] >= 2]
    no_decay = [p for p in params if named_dims[id(p)] < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


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
        loss.backward(); <average the gradients>; opt.shard_gradients(); opt.step()

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
        the matching slice of the averaged full gradient (ZeRO-1). Views: nothing is copied."""
        for part, p, lo, hi, at, piece in self._pieces:
            if part.grad_shard is not None:
                piece.grad = part.grad_shard[at:at + hi - lo]
            elif p.grad is not None:
                piece.grad = p.grad.view(-1)[lo:hi]

    @torch.no_grad()
    def step(self, closure=None):
        """Update this rank's shard, then all-gather the updated parameters of every partition."""
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
    """ZeRO-1's optimizer: the loop's AdamW on this rank's shard, whose partitions are the
    wrapper's buckets (so the shard a bucket delivers is the shard the rank updates)."""
    params = [p for p in model.module.parameters() if p.requires_grad]
    groups = decay_groups({id(p): p.dim() for p in params}, weight_decay, params)
    return ShardedOptimizer(groups, torch.optim.AdamW, model.group,
                            partitions=[bucket.partition for bucket in model.buckets], lr=lr, betas=BETAS, foreach=False)


class ZeRO1(DDPStrategy):
    """`--strategy zero1`: reduce-scattering buckets that keep the full gradients, then a
    ShardedOptimizer over the DP group whose partitions are the buckets (so the shard a bucket
    delivers is the shard the rank updates). Under gradient accumulation (`no_sync`) the full
    gradients accumulate locally as in DDP and are reduce-scattered once, in the last
    micro-batch's backward."""

    name = "zero1"
    keep_gradients = True

    def parallelize(self, model):
        c = self.config
        return ShardedGradientDataParallel(model.to(self.rt.device), self.mesh.dp_group,
                                           keep_gradients=self.keep_gradients, bucket_mb=c.bucket_mb,
                                           find_unused_parameters=c.find_unused_parameters)

    def make_optimizer(self, model, lr, weight_decay):
        self.optimizer = sharded_adamw(model, lr, weight_decay)
        return self.optimizer

    def finish_backward(self, model):
        model.finish_gradient_synchronization()
        self.optimizer.shard_gradients()

    def clip_grad_norm_(self, model, max_norm):
        """Each rank holds the gradients of its shard: sum their squares over the DP group."""
        return clip_grad_norm_(self.optimizer.pieces(), max_norm, groups=(self.mesh.dp_group,), device=self.rt.device)


class ZeRO2(ZeRO1):
    """`--strategy zero2`: ZeRO-1 whose buckets free the full gradients once reduce-scattered."""

    name = "zero2"
    keep_gradients = False


# ====================================================================== ZeRO-3

class ShardedUnit:
    """ZeRO-3's unit of sharding: the parameters of one module (or of the model's root parts).

    Between uses each parameter's `.data` is its piece of this rank's shard (1-D, possibly
    empty), so the optimizer, the memory count and a checkpoint see 1/N of the unit. `gather()`
    all-gathers the full flat buffer and points the parameters at their full views; `free()`
    points them back at the shard and releases the buffer's storage (resize to 0), so tensors
    autograd saved from it stay valid views that the next `gather()` refills in place.
    """

    def __init__(self, params, group=None, name: str = ""):
        self.partition = part = Partition(params, group)
        self.name, self.group = name, group
        self.shapes = [p.shape for p in part.params]
        p0 = part.params[0]
        self.full = torch.zeros(part.padded, dtype=p0.dtype, device=p0.device)
        for p, off in zip(part.params, part.offsets):
            self.full[off:off + p.numel()].copy_(p.data.reshape(-1))
        self.shard = self.full[part.start:part.start + part.shard_size].clone()
        where = {id(p): (lo, hi, at) for p, lo, hi, at in part.pieces()}
        self.spans = [where.get(id(p), (0, 0, 0)) for p in part.params]  # (lo, hi, at) of each piece
        self.gathered, self.work = True, None  # work: a prefetch in flight
        self.pending: set[int] = set()  # parameters whose gradient backward has yet to deliver
        self.free()

    def _piece(self, i: int) -> torch.Tensor:
        lo, hi, at = self.spans[i]
        return self.shard[at:at + hi - lo]

    def prefetch(self) -> None:
        """Start the all-gather without waiting, so it overlaps the computation before `gather()`."""
        if self.gathered or self.work is not None:
            return
        self.full.untyped_storage().resize_(self.partition.padded * self.full.element_size())
        self.work = comm.all_gather_into_tensor(self.full, self.shard, group=self.group, async_op=True)

    def gather(self) -> None:
        if self.gathered:
            return
        self.prefetch()
        self.work.wait()
        self.work = None
        part = self.partition
        for p, off, shape in zip(part.params, part.offsets, self.shapes):
            p.data = self.full[off:off + shape.numel()].view(shape)
        self.gathered = True

    def free(self) -> None:
        if not self.gathered:
            return
        for i, p in enumerate(self.partition.params):
            p.data = self._piece(i)
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def expect_gradients(self) -> None:
        self.pending = {id(p) for p in self.partition.params if p.requires_grad}

    def on_gradient(self, param) -> None:
        """Post-accumulate hook: once the unit's last gradient has arrived, reduce-scatter and free."""
        self.pending.discard(id(param))
        if not self.pending and self.gathered:
            self.reduce_gradients()

    def reduce_gradients(self) -> None:
        """Average the full gradients over the group into this rank's shard (accumulating over
        micro-batches), drop the full gradients and the full parameters."""
        part = self.partition
        flat = part.flat_gradients()
        for p in part.params:
            p.grad = None
        shard = torch.empty(part.shard_size, dtype=flat.dtype, device=flat.device)
        comm.reduce_scatter_tensor(shard, flat, "avg", group=self.group)
        part.grad_shard = shard if part.grad_shard is None else part.grad_shard.add_(shard)
        self.pending = set()
        self.free()

    def attach_gradients(self) -> None:
        """After the step's last backward: each parameter's `.grad` is its piece of the shard."""
        part = self.partition
        if part.grad_shard is not None:
            for (lo, hi, at), p in zip(self.spans, part.params):
                if p.requires_grad:
                    p.grad = part.grad_shard[at:at + hi - lo]
        part.grad_shard = None  # from now on the parameters own it (zero_grad frees it)

    def unshard(self) -> None:
        """Make the parameters whole, full copies again (when the strategy lets go of the model)."""
        if self.full is None:
            return
        self.gather()
        for p in self.partition.params:
            p.data = p.data.clone()
        self.full, self.gathered = None, False


class ZeRO3(Strategy):
    """`--strategy zero3`: every block a ShardedUnit, the root (token and position embeddings,
    final LayerNorm; the LM head is tied to the token embedding, so gathered once) one more.

    Hooks drive it: a unit's forward pre-hook gathers it and its forward hook frees it; a hook on
    its output's gradient gathers it again just before its backward; the post-accumulate hooks
    of its parameters reduce-scatter the gradients once the last one has arrived. The root is
    gathered around the whole forward (it is used first and last) and again when the logits'
    gradient arrives. Evaluation and sampling go through the same hooks, so they just work.
    With `prefetch` (the default; `--no-prefetch` turns it off) gathering a unit also starts the
    all-gather of the unit that comes next, forward (root, block 0, 1, ...) or backward (root,
    the last block, ..., block 0), so it travels while this one computes: at most two units
    are whole at a time.

    The parameters *are* the shards, so a plain AdamW over them is already the sharded step
    (stage 1 comes with stage 3); nothing is gathered after it: the next forward gathers.
    Gradient accumulation reduce-scatters every micro-batch into the shard (keeping full
    gradients between micro-batches would undo the sharding), so `no_sync` saves nothing here.
    """

    name = "zero3"

    def parallelize(self, model):
        model = model.to(self.rt.device)
        group = self.mesh.dp_group
        for tensor in [*model.parameters(), *model.buffers()]:  # replicas start identical, then are cut
            comm.broadcast(tensor.data, src=first_rank(group), group=group)
        self.dims = {id(p): p.dim() for p in model.parameters()}
        self.units, self._hooks = [], []
        inner = set()
        for index, block in model.blocks.items():
            params = list(block.parameters())
            inner |= {id(p) for p in params}
            self._shard(block, ShardedUnit(params, group, f"blocks.{index}"))
        root = [p for p in model.parameters() if id(p) not in inner]  # parameters() lists a tied one once
        self._shard(model, ShardedUnit(root, group, "root"))
        blocks, root = self.units[:-1], self.units[-1]
        forward, backward = [root, *blocks], [root, *reversed(blocks)]
        self.next_forward = dict(zip(forward, forward[1:])) if self.config.prefetch else {}
        self.next_backward = dict(zip(backward, backward[1:])) if self.config.prefetch else {}
        return model

    def _shard(self, module, unit: ShardedUnit) -> None:
        self.units.append(unit)

        def before_forward(_module, _args):
            unit.gather()
            if unit in self.next_forward:
                self.next_forward[unit].prefetch()

        def before_backward(_grad):
            unit.gather()
            if unit in self.next_backward:
                self.next_backward[unit].prefetch()

        def after_forward(_module, _args, output):
            if torch.is_grad_enabled() and output.requires_grad:
                unit.expect_gradients()
                output.register_hook(before_backward)
            unit.free()

        self._hooks += [module.register_forward_pre_hook(before_forward),
                        module.register_forward_hook(after_forward)]
        self._hooks += [p.register_post_accumulate_grad_hook(unit.on_gradient)
                        for p in unit.partition.params if p.requires_grad]

    def make_optimizer(self, model, lr, weight_decay):
        params = [p for p in model.parameters() if p.requires_grad]
        return torch.optim.AdamW(decay_groups(self.dims, weight_decay, params), lr=lr, betas=BETAS, foreach=False)

    def no_sync(self, model):
        return nullcontext()

    def finish_backward(self, model):
        for unit in self.units:
            if unit.pending:  # some parameter got no gradient: still take part in the reduce-scatter
                unit.gather()
                unit.reduce_gradients()
            unit.attach_gradients()

    def clip_grad_norm_(self, model, max_norm):
        return clip_grad_norm_(model.parameters(), max_norm, groups=(self.mesh.dp_group,), device=self.rt.device)

    def model_state(self, model) -> dict:
        """This rank's shard: each parameter's piece (a checkpoint resumes on the same DP size only)."""
        return {k: v.clone() for k, v in model.state_dict().items()}

    def close(self, model):
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for unit in self.units:
            unit.unshard()
