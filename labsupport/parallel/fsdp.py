"""ZeRO-3 as a library object: `fully_shard`, with FSDP2's face, on any `nn.Module` and process group.

    handle = fully_shard(model, group, units=list(model.layers))   # group None: the world
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)          # the parameters *are* the shards
    loss_fn(model(x), y).backward()                               # gradients reduce-scattered, ready
    handle.clip_grad_norm_(1.0)                                   # optional: by the true global norm
    opt.step(); opt.zero_grad()                                   # the sharded step: nothing gathered after it
    with handle.full_parameters():                                # every rank: the parameters whole inside
        model.load_state_dict(full)                               # (kept in the shards on the way out)
    state = handle.full_state_dict()                              # full tensors, the module's own names
    handle.close()                                                # hooks gone, parameters whole copies again

Each of `units` (the repeated blocks, in the order forward calls them) becomes a `ShardedUnit`;
the parameters left over (embeddings, final norm, a head) form one more, the root, gathered
around the whole forward. With no `units` the whole module is one unit, as `fully_shard(model)`
alone is in torch's FSDP2. Between uses each parameter's `.data` is its piece of this rank's 1-D
shard of its unit, so a plain optimizer over `model.parameters()` updates 1/N of everything and
keeps 1/N of the moments, and `model.state_dict()` is this rank's shard (a checkpoint that
resumes on the same group size).

Hooks drive it, as in FSDP: a unit's forward pre-hook all-gathers its parameters (and, with
`prefetch`, starts the all-gather of the unit that comes next, so it travels while this one
computes); its forward hook frees them; a hook on its output's gradient gathers them again just
before its backward (prefetching the unit backward reaches next); the post-accumulate hooks of
its parameters reduce-scatter the gradients (averaged over the group) once the last one has
arrived, and free the full parameters. A callback queued on autograd's engine at the start of
backward (`queue_callback`, as FSDP does) finishes what is left when backward ends and gives
each parameter its piece of the averaged gradient as `.grad`: after `loss.backward()` the
gradients are ready, with no extra call. A second backward before the step adds into the same
shard gradients (gradient accumulation: each backward reduce-scatters, as FSDP2 does; keeping
full gradients between micro-batches would undo the sharding). Evaluation under `no_grad` goes
through the same hooks: gathered, computed, freed.

Options, in FSDP's words where it has them:

* `replicate`: parameters that stay whole on every rank (what DeepSpeed calls persistent
  parameters), e.g. `lambda name, p: p.dim() < 2` for the norms and biases, which are tiny and
  gathered often. Their gradients are all-reduced (averaged) with their unit's reduce-scatter.
* `param_dtype` (FSDP2's `MixedPrecisionPolicy`): units are gathered and computed in this dtype
  (half the all-gather traffic for bf16), floating-point inputs of each unit are cast to it; the
  shards, which the optimizer updates, keep the parameters' own dtype (fp32), and so do the
  gradients that land in them. `reduce_dtype` is the dtype of the gradient reduction
  (default: `param_dtype`, as in FSDP2).
* `broadcast_init`: every rank starts from the group's first rank's parameters and buffers
  (`False`: check that they already agree).

Rules, as for FSDP: every rank calls the same units in the same order (the collectives pair up
by order); a parameter belongs to the unit that registers it, and one registered by two units,
or by a unit and a module outside the units (a tied embedding and LM head), joins the root,
which is whole whenever any unit computes; code outside the module's forward sees the shards
(use `full_parameters()`). A unit holding frozen parameters is freed only at the end of backward
(its frozen weights may still be needed after its last gradient arrives).
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from .. import comm
from .clip import clip_grad_norm_, count_once
from .ddp import DataParallelStep, check_replicas, first_rank
from .optim import adamw
from .zero import Partition


class ShardedUnit:
    """ZeRO-3's unit of sharding: the parameters one module gathers together.

    Between uses each parameter's `.data` is its piece of this rank's shard (1-D, possibly
    empty; a `Partition` of the unit's parameters), so the optimizer, the memory count and a
    checkpoint see 1/N of the unit. `gather()` all-gathers the full flat buffer `full` (in
    `param_dtype`, default the parameters' own) and points the parameters at their full views;
    `free()` points them back at the shard and releases the buffer's storage (resize to 0), so
    tensors autograd saved from it stay valid views that the next `gather()` refills in place.
    The `replicate` parameters are whole on every rank; they take part only to be cast to
    `param_dtype` while the unit computes, and to have their gradients all-reduced.

    Gradients: `reduce_gradients()` averages the full gradients over the group into this rank's
    shard (`partition.grad_shard`, in the shard's dtype, accumulating over backward passes);
    `attach_gradients()` hands it to the parameters as their `.grad`; `begin_backward()` takes it
    back before a further backward adds to it.
    """

    def __init__(self, params, group=None, name: str = "", *, replicate=(), param_dtype=None, reduce_dtype=None):
        self.partition = part = Partition(params, group)
        self.replicated = list(replicate)
        self.name, self.group = name, group
        members = [*part.params, *self.replicated]
        if not members:
            raise ValueError(f"ShardedUnit {name!r}: no parameters")
        dtypes = {p.dtype for p in part.params}
        if len(dtypes) > 1:
            raise ValueError(f"ShardedUnit {name!r}: its parameters share one flat buffer, so one dtype; got "
                             f"{', '.join(sorted(map(str, dtypes)))}")
        self.dtype = part.params[0].dtype if part.params else None  # the shard's: what the optimizer updates
        self.device = members[0].device
        self.cast = param_dtype  # compute dtype, None: the parameters' own
        self.reduce_dtype = reduce_dtype or param_dtype or self.dtype
        self.shapes = [p.shape for p in part.params]
        flat = torch.zeros(part.padded, dtype=self.dtype or torch.float32, device=self.device)
        for p, off in zip(part.params, part.offsets):
            flat[off:off + p.numel()].copy_(p.data.reshape(-1))
        self.shard = flat[part.start:part.start + part.shard_size].clone()
        self.full = torch.empty(part.padded, dtype=param_dtype or flat.dtype, device=self.device)
        self.full.untyped_storage().resize_(0)
        where = {id(p): (lo, hi, at) for p, lo, hi, at in part.pieces()}
        self.spans = [where.get(id(p), (0, 0, 0)) for p in part.params]  # (lo, hi, at) of each piece
        self.masters = [p.data for p in self.replicated]  # whole, in their own dtype: what the optimizer updates
        self.replicated_grads = [None] * len(self.replicated)  # their averaged gradients between backward passes
        self.frozen = any(not p.requires_grad for p in members)
        self.gathered, self.work, self._send = False, None, None  # work: an all-gather in flight
        self.pending: set[int] = set()  # parameters whose gradient backward has yet to deliver
        self.in_backward = False
        for i, p in enumerate(part.params):
            p.grad = None
            p.data = self._piece(i)

    def _piece(self, i: int) -> torch.Tensor:
        lo, hi, at = self.spans[i]
        return self.shard[at:at + hi - lo]

    def _trainable(self) -> set[int]:
        return {id(p) for p in [*self.partition.params, *self.replicated] if p.requires_grad}

    # ------------------------------------------------------------ parameters: gather and free

    def prefetch(self) -> None:
        """Start the all-gather without waiting, so it overlaps the computation before `gather()`."""
        if self.gathered or self.work is not None or not self.partition.padded:
            return
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self._send = self.shard.to(self.full.dtype)  # the shard itself unless computing in another dtype
        self.work = comm.all_gather_into_tensor(self.full, self._send, group=self.group, async_op=True)

    def gather(self) -> None:
        if self.gathered:
            return
        self.prefetch()
        if self.work is not None:
            self.work.wait()
        self.work = self._send = None
        part = self.partition
        for p, off, shape in zip(part.params, part.offsets, self.shapes):
            p.data = self.full[off:off + shape.numel()].view(shape)
        for p, master in zip(self.replicated, self.masters):
            p.data = master if self.cast is None else master.to(self.cast)
        self.gathered = True

    def free(self) -> None:
        if not self.gathered:
            return
        for i, p in enumerate(self.partition.params):
            p.data = self._piece(i)
        for p, master in zip(self.replicated, self.masters):
            p.data = master
        self.full.untyped_storage().resize_(0)
        self.gathered = False

    def settle(self) -> None:
        """Wait for an all-gather in flight and free: the unit as it is between steps."""
        if self.work is not None:
            self.gather()
        self.free()

    # ------------------------------------------------------------ gradients

    def expect_gradients(self) -> None:
        self.pending = self._trainable()

    def begin_backward(self) -> None:
        """Once per backward, before any gradient of the unit arrives: take the gradients a previous
        backward attached back into the shard (so this one adds to them), and wait for all of ours."""
        if self.in_backward:
            return
        self.in_backward = True
        self.pending = self._trainable()
        part = self.partition
        held = [(p, span) for p, span in zip(part.params, self.spans) if p.grad is not None]
        if held:
            if part.grad_shard is None:
                part.grad_shard = torch.zeros(part.shard_size, dtype=self.dtype, device=self.device)
            for p, (lo, hi, at) in held:
                part.grad_shard[at:at + hi - lo] += p.grad.reshape(-1)
                p.grad = None
        for i, p in enumerate(self.replicated):
            if p.grad is not None:
                held = self.replicated_grads[i]
                self.replicated_grads[i] = p.grad if held is None else held.add_(p.grad)
                p.grad = None

    def on_gradient(self, param) -> None:
        """Post-accumulate hook: once the unit's last gradient has arrived, reduce-scatter and free."""
        self.pending.discard(id(param))
        if not self.pending and self.gathered and self.in_backward:
            self.reduce_gradients()
            if not self.frozen:  # a frozen weight's backward may come after the last gradient
                self.free()

    def reduce_gradients(self) -> None:
        """Average the full gradients over the group into this rank's shard (accumulating over
        backward passes) and the replicated ones into their whole gradients; drop the full ones."""
        part = self.partition
        if part.padded:
            flat = torch.zeros(part.padded, dtype=self.reduce_dtype, device=self.device)
            for p, off, shape in zip(part.params, part.offsets, self.shapes):
                if p.grad is not None:
                    flat[off:off + shape.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
            shard = torch.empty(part.shard_size, dtype=self.reduce_dtype, device=self.device)
            comm.reduce_scatter_tensor(shard, flat, "avg", group=self.group)
            shard = shard.to(self.dtype)
            part.grad_shard = shard if part.grad_shard is None else part.grad_shard.add_(shard)
        trainable = [(i, p) for i, p in enumerate(self.replicated) if p.requires_grad]
        if trainable:
            flat = torch.cat([(torch.zeros(p.numel(), device=self.device) if p.grad is None else p.grad.reshape(-1))
                              .to(self.reduce_dtype or p.dtype) for _, p in trainable])
            comm.all_reduce(flat, "avg", group=self.group)
            for (i, p), g in zip(trainable, flat.split([p.numel() for _, p in trainable])):
                g = g.view(p.shape).to(self.masters[i].dtype)
                self.replicated_grads[i] = g if self.replicated_grads[i] is None else self.replicated_grads[i].add_(g)
                p.grad = None
        self.pending = set()

    def finish_backward(self) -> None:
        """At the end of backward: reduce what is still pending (a parameter that got no gradient
        takes part with zeros, so the ranks' collectives pair up), free, attach the gradients."""
        if self.pending:
            self.begin_backward()
            self.reduce_gradients()
        self.settle()
        self.attach_gradients()
        self.in_backward = False

    def attach_gradients(self) -> None:
        """Each parameter's `.grad` becomes its piece of the averaged shard (replicated: whole)."""
        part = self.partition
        if part.grad_shard is not None:
            for (lo, hi, at), p in zip(self.spans, part.params):
                if p.requires_grad:
                    p.grad = part.grad_shard[at:at + hi - lo]
        part.grad_shard = None  # from now on the parameters own it (zero_grad frees it)
        for i, p in enumerate(self.replicated):
            if self.replicated_grads[i] is not None:
                p.grad, self.replicated_grads[i] = self.replicated_grads[i], None

    # ------------------------------------------------------------ the full parameters, exactly

    def full_flat(self, grads: bool = False) -> torch.Tensor:
        """The unit's full parameters (or their averaged gradients, zero where none), all-gathered
        in the shard's own dtype: a new flat tensor on every rank."""
        part = self.partition
        mine = self.shard
        if grads:
            mine = torch.zeros_like(self.shard)
            for p, (lo, hi, at) in zip(part.params, self.spans):
                if p.grad is not None:
                    mine[at:at + hi - lo] = p.grad.reshape(-1)
        flat = torch.empty(part.padded, dtype=mine.dtype, device=mine.device)
        if part.padded:
            comm.all_gather_into_tensor(flat, mine, group=self.group)
        return flat

    def show(self, flat: torch.Tensor, grads: torch.Tensor | None = None) -> list:
        """Point the parameters at their views of `flat` (and their gradients at `grads`'); return
        the gradients they had, for `hide`."""
        part, kept = self.partition, []
        for p, off, shape in zip(part.params, part.offsets, self.shapes):
            kept.append(p.grad)
            p.grad = None
            p.data = flat[off:off + shape.numel()].view(shape)
            if grads is not None and kept[-1] is not None:
                p.grad = grads[off:off + shape.numel()].view(shape)
        return kept

    def hide(self, flat: torch.Tensor, kept: list, writeback: bool) -> None:
        """Back to the shard after `show`, keeping what was written into `flat` if `writeback`."""
        part = self.partition
        if writeback:
            self.shard.copy_(flat[part.start:part.start + part.shard_size])
        for i, (p, grad) in enumerate(zip(part.params, kept)):
            p.grad = None
            p.data = self._piece(i)
            p.grad = grad

    def unshard(self) -> None:
        """Make the parameters whole, full copies again (when the library lets go of the module);
        their gradients are dropped."""
        if self.full is None:
            return
        self.settle()
        flat = self.full_flat()
        for p, off, shape in zip(self.partition.params, self.partition.offsets, self.shapes):
            p.grad = None
            p.data = flat[off:off + shape.numel()].clone().view(shape)
        for p in self.replicated:
            p.grad = None
        self.full, self.shard, self.gathered = None, None, False


def _tensors(obj):
    """The tensors in a module's output: a tensor, or tuples, lists and dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _cast(obj, dtype):
    """`obj` (a module's inputs) with its floating-point tensors in `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast(item, dtype) for item in obj)
    if isinstance(obj, dict):
        return {k: _cast(v, dtype) for k, v in obj.items()}
    return obj


class FSDPHandle:
    """What `fully_shard` returns: the units, and the calls a user or the training loop makes.

    `units`: the `ShardedUnit`s, in forward order, the root (if it holds parameters) last;
    `root`: that one or None. `finish_gradient_synchronization()` is what the callback at the end
    of backward runs (idempotent: a training loop may call it after its last backward);
    `full_parameters()` and `full_state_dict()` give the whole parameters; `clip_grad_norm_`
    clips by the true global norm; `close()` lets go of the module.
    """

    def __init__(self, module: torch.nn.Module, group=None, *, units=None, replicate=None, param_dtype=None,
                 reduce_dtype=None, prefetch: bool = True, broadcast_init: bool = True):
        previous = module.__dict__.get("_fully_shard")
        if previous is not None:  # a notebook cell run twice: let go of the first one
            previous.close()
        self.module, self.group, self.param_dtype = module, group, param_dtype
        inner = list(units or [])
        self._check_units(module, inner)
        if broadcast_init:  # replicas start identical, then are cut
            for tensor in [*module.parameters(), *module.buffers()]:
                comm.broadcast(tensor.data, src=first_rank(group), group=group)
        else:
            check_replicas(module, group)
        owner = self._owners(module, inner)
        named = list(module.named_parameters())  # a tied parameter once, under its first name
        if replicate is None:
            whole = set()
        elif callable(replicate):
            whole = {id(p) for name, p in named if replicate(name, p)}
        else:
            whole = {id(p) for p in replicate}
        module_names = {id(m): name for name, m in module.named_modules()}
        self.units, self.root, self._hooks, self._full, self._queued = [], None, [], False, False
        options = dict(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
        for index, submodule in [*enumerate(inner), (None, module)]:
            mine = [p for _, p in named if owner[id(p)] == index]
            if mine:  # (a unit whose parameters all joined the root has nothing to gather)
                unit = ShardedUnit([p for p in mine if id(p) not in whole], group,
                                   "root" if index is None else module_names[id(submodule)],
                                   replicate=[p for p in mine if id(p) in whole], **options)
                self._shard(submodule, unit)
                if index is None:
                    self.root = unit
        blocks = [u for u in self.units if u is not self.root]
        forward = [self.root, *blocks] if self.root else blocks
        backward = [self.root, *reversed(blocks)] if self.root else blocks[::-1]
        self.next_forward = dict(zip(forward, forward[1:])) if prefetch else {}
        self.next_backward = dict(zip(backward, backward[1:])) if prefetch else {}
        module.__dict__["_fully_shard"] = self  # not a submodule: nothing added to state_dict

    @staticmethod
    def _check_units(module, inner) -> None:
        inside = {id(m) for m in module.modules()}
        for i, unit in enumerate(inner):
            if not isinstance(unit, torch.nn.Module) or id(unit) not in inside or unit is module:
                raise ValueError(f"fully_shard(units=...): units[{i}] must be a submodule of the module "
                                 "(the module itself is the root unit)")
            if type(unit).forward is torch.nn.Module.forward:
                raise ValueError(f"fully_shard(units=...): units[{i}] ({type(unit).__name__}) is never called, so its "
                                 "hooks would never gather it; pass its elements, e.g. units=list(model.layers)")
            if not any(True for _ in unit.parameters()):
                raise ValueError(f"fully_shard(units=...): units[{i}] ({type(unit).__name__}) holds no parameters")
        for i, a in enumerate(inner):
            for j, b in enumerate(inner):
                if i != j and any(m is b for m in a.modules()):
                    raise ValueError(f"fully_shard(units=...): units[{j}] is inside units[{i}]; units must not nest")

    @staticmethod
    def _owners(module, inner) -> dict:
        """id(param) -> index of the unit that holds every module registering it, or None (the root)."""
        unit_of = {}
        for i, unit in enumerate(inner):
            for m in unit.modules():
                unit_of[id(m)] = i
        holders: dict = {}
        for m in module.modules():
            for p in m.parameters(recurse=False):
                holders.setdefault(id(p), set()).add(unit_of.get(id(m)))
        return {key: next(iter(units)) if len(units) == 1 else None for key, units in holders.items()}

    def _shard(self, module, unit: ShardedUnit) -> None:
        self.units.append(unit)

        def before_forward(_module, args, kwargs):
            if self._full:
                return None
            self._queued = False  # a backward that failed part-way queued a callback that never ran
            unit.gather()
            if unit in self.next_forward:
                self.next_forward[unit].prefetch()
            if self.param_dtype is not None:  # FSDP2's cast_forward_inputs
                return _cast(args, self.param_dtype), _cast(kwargs, self.param_dtype)
            return None

        def before_backward(_grad):
            if not self._queued:  # once per backward: finish and attach when the engine is done
                self._queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
            unit.begin_backward()
            unit.gather()
            if unit in self.next_backward:
                self.next_backward[unit].prefetch()

        def after_forward(_module, _args, output):
            if self._full:
                return
            if torch.is_grad_enabled():
                outputs = [t for t in _tensors(output) if t.requires_grad]
                if outputs:
                    unit.expect_gradients()
                    for t in outputs:
                        t.register_hook(before_backward)
            unit.free()

        def on_gradient(param):
            if self._full:
                raise RuntimeError("fully_shard: backward inside full_parameters() is not supported; "
                                   "leave the context first")
            unit.on_gradient(param)

        self._hooks += [module.register_forward_pre_hook(before_forward, with_kwargs=True),
                        module.register_forward_hook(after_forward)]
        self._hooks += [p.register_post_accumulate_grad_hook(on_gradient)
                        for p in [*unit.partition.params, *unit.replicated] if p.requires_grad]

    # ------------------------------------------------------------ what a user calls

    def finish_gradient_synchronization(self) -> None:
        """Finish every unit's reduction and give the parameters their gradient shards. Runs by
        itself at the end of each backward; calling it again does nothing."""
        for unit in self.units:
            unit.finish_backward()
        self._queued = False

    @contextmanager
    def full_parameters(self, writeback: bool = True, with_grads: bool = False):
        """Inside, every parameter is whole on every rank, in its own dtype (every rank must
        enter: it all-gathers). Forward works inside (no backward); with `writeback`, changes
        made inside (the same on every rank, e.g. `load_state_dict`) are kept in the shards;
        `with_grads` also gathers the averaged gradients into `.grad` (FSDP1's
        `summon_full_params` does the same)."""
        if self._full:
            raise RuntimeError("fully_shard: full_parameters() is already open")
        shown = []
        try:
            for unit in self.units:
                unit.settle()
                flat = unit.full_flat()
                grads = unit.full_flat(grads=True) if with_grads else None
                shown.append((unit, flat, unit.show(flat, grads)))
            self._full = True
            yield self.module
        finally:
            self._full = False
            for unit, flat, kept in shown:
                unit.hide(flat, kept, writeback)

    def full_state_dict(self) -> dict:
        """The module's state_dict with every tensor whole, on every rank (same names as the
        module's own; every rank must call it)."""
        with self.full_parameters(writeback=False):
            return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale the gradients so that their global L2 norm is at most `max_norm`; return the norm
        before. Each shard is counted once, and each replicated gradient once (not once per rank)."""
        shards = [p for u in self.units for p in u.partition.params]
        counted = count_once([*shards, *(p for u in self.units for p in u.replicated)], shards, self.group)
        device = self.units[0].device if self.units else None
        return clip_grad_norm_(counted, max_norm, (self.group,), scaled=list(self.module.parameters()), device=device)

    def close(self) -> None:
        """Remove every hook; the parameters become whole, full copies again (gradients dropped)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for unit in self.units:
            unit.unshard()
        self.units, self.root = [], None  # a new list: a caller holding the old one keeps it
        if self.module.__dict__.get("_fully_shard") is self:
            del self.module.__dict__["_fully_shard"]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def fully_shard(module: torch.nn.Module, group=None, *, units=None, replicate=None, param_dtype=None,
                reduce_dtype=None, prefetch: bool = True, broadcast_init: bool = True) -> FSDPHandle:
    """ZeRO-3 (FSDP) on `module` over `group` (None: the world): see the module docstring.

    `units`: submodules that each become a unit (called by forward, none inside another; in the
    order forward calls them, which prefetch follows); the rest is the root. `replicate`: a
    predicate on (name, parameter), or the parameters, that stay whole on every rank.
    `param_dtype` / `reduce_dtype`: compute-and-gather dtype and gradient-reduction dtype; the
    shards keep the parameters' dtype. `prefetch`: gather the next unit while one computes.
    `broadcast_init`: start every rank from the group's first rank's values.
    """
    return FSDPHandle(module, group, units=units, replicate=replicate, param_dtype=param_dtype,
                      reduce_dtype=reduce_dtype, prefetch=prefetch, broadcast_init=broadcast_init)


class FullyShardStep(DataParallelStep):
    """`--zero 3` over the DP group: `fully_shard` with every block a unit and the rest (embeddings,
    the tied head, the final LayerNorm) the root. The parameters are the shards, so the loop's AdamW
    over them is the sharded step (stage 1 comes with stage 3), with the weight decay of each
    parameter's original shape. Each backward reduce-scatters into the shard, so there is nothing
    for `no_sync` to save; the squares of the shards are summed over the DP group."""

    zero_stages = (3,)
    title = "ZeRO-3"

    @classmethod
    def applies(cls, config):
        return super().applies(config) and config.dp_replicate == 1  # (replicas of shard groups: hsdp.py)

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        if config.zero == 3 and (config.tp > 1 or config.pp > 1):
            return ["ZeRO-3 shards whole units over the DP group; it does not compose with --tp or --pp here: "
                    "use --zero 0 or 1"]
        return cls.shard_problems(config)

    def __init__(self, mesh, config):
        super().__init__(mesh, config)
        self.shard_group = self.group  # the ranks each unit is sharded over: all of dp (hsdp.py: one replica)

    def apply(self, parts, shared, owned):
        (model,) = parts
        self.dims = {id(p): p.dim() for p in model.parameters()}  # before they become 1-D shards
        self.handle = fully_shard(model, self.shard_group, units=list(model.blocks.values()),
                                  prefetch=self.config.prefetch)
        return parts

    def make_optimizer(self, parts, lr, weight_decay):
        return adamw(parts[0].parameters(), lr, weight_decay, self.dims)

    def no_sync(self):
        return nullcontext()  # nothing to hold back: a full gradient kept between micro-batches would undo the sharding

    def finish_backward(self):
        self.handle.finish_gradient_synchronization()

    def norm(self, counted, scaled):
        return counted, scaled, self.shard_group

    def close(self):
        self.handle.close()
