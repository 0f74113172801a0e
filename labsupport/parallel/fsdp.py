"""TEMPORARY: ZeRO-3 until fully_shard lands."""
from __future__ import annotations

import torch

from .. import comm
from .ddp import first_rank
from .optim import adamw
from .step import Step
from .zero import Partition


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


class FullyShardStep(Step):
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

    axis = "dp"
    zero_stages = (3,)

    @classmethod
    def applies(cls, config):
        return config.zero == 3

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        if config.zero == 3 and (config.tp > 1 or config.pp > 1):
            return ["ZeRO-3 shards whole units over the DP group; it does not compose with --tp or --pp here: "
                    "use --zero 0 or 1"]
        return []

    def apply(self, parts, shared):
        (model,) = parts
        group = self.group
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
        return parts

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

    def make_optimizer(self, parts, lr, weight_decay):
        return adamw(parts[0].parameters(), lr, weight_decay, self.dims)

    def finish_backward(self):
        for unit in self.units:
            if unit.pending:  # some parameter got no gradient: still take part in the reduce-scatter
                unit.gather()
                unit.reduce_gradients()
            unit.attach_gradients()

    def norm(self, counted, scaled):
        return counted, scaled, self.group

    def reduce_loss(self, loss):
        comm.all_reduce(loss, "avg", group=self.group)
        return loss

    def close(self):
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        for unit in self.units:
            unit.unshard()
