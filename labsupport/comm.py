"""The single door to torch.distributed: every collective and message, counted and optionally timed.

Each parallel strategy is explained by what it communicates, so every call it makes goes
through here and is tallied per process group and per op:

* `calls`;
* `payload_bytes`: the logical buffer of the call (for all-gather and reduce-scatter the
  full, unsharded buffer);
* `wire_bytes`: what this rank sends under the ring algorithm (the nccl-tests "bus
  bandwidth" factors): all-reduce 2(n-1)/n x payload; all-gather, reduce-scatter, scatter,
  gather and all-to-all (n-1)/n x payload; broadcast, reduce and send 1 x payload.

With `timing(True)` each call also records its start and end (for async calls, the end is
when `wait()` returns), so a step can be drawn as a timeline. Ops are spelled as in
torch.distributed and reductions are named by strings: "sum", "avg", "max", "min", "product".

A call keeps nothing of the communication it starts: counters are keyed by group *names*, and a
collective on a gloo group is over and its work freed when the call returns (async: when its
`wait()` returns), see `_until_freed`. So nothing of comm's is left for interpreter shutdown.
"""
from __future__ import annotations

import time
import warnings
import weakref
from collections import defaultdict
from contextlib import contextmanager

import torch
import torch.distributed as dist

from .estimate.comm_cost import BUS_FACTOR

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}
REDUCE_OPS = (*_OPS, "avg")

# op -> bytes this rank puts on the wire per payload byte, as a function of group size n
WIRE_FACTOR = BUS_FACTOR


class CommStats:
    """Counters per (group, op), and the timeline of calls when timing is on."""

    def __init__(self):
        self.counts = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "wire_bytes": 0})
        self.events: list[dict] = []
        self.timing = False
        self._t0 = time.perf_counter()

    def add(self, group: str, op: str, payload: int, n: int):
        c = self.counts[(group, op)]
        c["calls"] += 1
        c["payload_bytes"] += int(payload)
        c["wire_bytes"] += int(round(WIRE_FACTOR[op](n) * payload))

    def by_op(self) -> dict:
        """{op: {calls, payload_bytes, wire_bytes}} summed over groups (the `comm` JSON key)."""
        out = defaultdict(lambda: {"calls": 0, "payload_bytes": 0, "wire_bytes": 0})
        for (_, op), c in self.counts.items():
            for k, v in c.items():
                out[op][k] += v
        return {op: dict(v) for op, v in sorted(out.items())}

    def by_group(self) -> dict:
        out: dict = defaultdict(dict)
        for (group, op), c in sorted(self.counts.items()):
            out[group][op] = dict(c)
        return dict(out)

    def reset(self):
        self.counts.clear()
        self.events.clear()


STATS = CommStats()
_GROUP_NAMES = weakref.WeakKeyDictionary()  # weak: a name must not keep a destroyed group's threads alive


def reset():
    STATS.reset()


def counts() -> dict:
    """{op: {calls, payload_bytes, wire_bytes}} since the last reset, all groups together."""
    return STATS.by_op()


def group_counts() -> dict:
    """{group name: {op: {calls, payload_bytes, wire_bytes}}}: the same calls split by group (dp, tp, pp, world)."""
    return STATS.by_group()


@contextmanager
def timing(enabled: bool = True):
    """Record start/end of every call made inside the block (see STATS.events)."""
    old, STATS.timing = STATS.timing, enabled
    try:
        yield STATS.events
    finally:
        STATS.timing = old


@contextmanager
def phase(name: str):
    """Mark a stretch of this rank's work (forward, backward, ...) on the timeline.

    Any code can open one (the loop, a pipeline schedule, a ZeRO hook); it records an event
    only while `timing` is on, so it costs nothing otherwise.
    """
    if not STATS.timing:
        yield
        return
    event = {"op": name, "start": now()}
    STATS.events.append(event)
    try:
        yield
    finally:
        event["end"] = now()


def now() -> float:
    """Seconds since this process's comm clock started (the timeline's time axis)."""
    return time.perf_counter() - STATS._t0


# ---------------------------------------------------------------- groups

def new_group(ranks, name: str):
    """A process group with a name the counters can show (every rank must call this)."""
    group = dist.new_group(ranks=list(ranks))
    if isinstance(group, dist.ProcessGroup):  # non-members get a placeholder, not a group
        name_group(group, name)
    return group


def name_group(group, name: str) -> None:
    """Show a group a library made itself (DeepSpeed's data-parallel group) by this name."""
    _GROUP_NAMES[group] = name


def count(op: str, payload: int, group=None) -> None:
    """Count a call a library makes through its own door (DeepSpeed's deepspeed.comm), as if made here."""
    STATS.add(group_name(group), op, payload, get_world_size(group))


def group_name(group) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return _GROUP_NAMES.get(group, f"group{id(group) % 10000}")


def get_rank(group=None) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def global_rank(group, group_rank: int) -> int:
    """The world rank of the member `group_rank` of `group` (None: the world)."""
    return group_rank if group is None or not dist.is_initialized() else dist.get_global_rank(group, group_rank)


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]):
    """torch's DeviceMesh over the world (for the torch references). Its process groups are
    torch's own: traffic on them is not counted here."""
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh(device_type, shape, mesh_dim_names=names)


# ---------------------------------------------------------------- the recording wrapper
#
# gloo runs each collective on a worker thread of its process group, which holds the work until
# just after it has woken the waiter. If the caller's reference is dropped first, the worker thread
# frees the work, and freeing a gloo work takes the GIL: it keeps the thread-local state of its
# launch, which inside `loss.backward()` holds a Python object (torch stashes the autograd context
# there), so every bucket DataParallel sends from a gradient hook carries one; and a tensor whose
# Python object died while the work held it is freed through that object. While Python runs,
# that costs the thread a moment. If the interpreter is already shutting down (the script returned
# right after its last step, and the group's threads outlive destroy_process_group() because
# torch.distributed.nn.functional, which the first optimizer imports, holds group.WORLD), the thread
# is ended inside the destructor and the process aborts with "terminate called without an active
# exception", after all the work succeeded. So a gloo call returns (an async one: its `wait()`)
# only once the work is freed, here or by its thread, while Python still runs.

_FREE_WAIT_S = 2.0  # the worker thread lets go microseconds after the data arrives; beyond this, stop waiting
_SETTLED_S = 0.05  # a count that stays put this long, below the one we dropped our handle at, is settled
_use_count = getattr(torch.Tensor, "_use_count", None)  # references to a tensor held in C++, works included
_waits_for_free = _use_count is not None


def _watch(tensor, group):
    """The tensor whose references tell when a work on it is freed, if the work must be: gloo's."""
    if not _waits_for_free or tensor is None or tensor.device.type != "cpu":
        return None
    return tensor if "gloo" in str(dist.get_backend(group)) else None


def _until_freed(tensor, before: int, held: int) -> None:
    """Return once the work that held `tensor` is freed: its references to it are gone.

    `before`: C++ references to `tensor` just before the work started; `held`: just before our
    handle was dropped. The work lets go of them one member at a time, the thread-local state
    (the part that takes the GIL) between the first and the last, so only a count back at
    `before` says it is done. If the caller took references of its own since the launch, the
    count settles above that: a count below `held` that stays put for `_SETTLED_S` says it too.
    That wait must outlast the worker thread being descheduled between two members (a loaded
    machine, CI's two workers on two cores, did it for over a millisecond); it costs nothing
    otherwise, as the count reaches `before` first.

    Each poll releases the GIL, which the worker thread may need; after half a millisecond the
    polls sleep in between, so that it takes the GIL at once rather than after the interpreter's
    switch interval.
    """
    global _waits_for_free
    start = last_change = time.monotonic()
    last = held
    while (count := _use_count(tensor)) > before:
        now_ = time.monotonic()
        if count != last:
            last, last_change = count, now_
        elif count < held and now_ - last_change > _SETTLED_S:
            return
        if now_ - start > _FREE_WAIT_S:  # the worker thread never let go: do not wait again
            _waits_for_free = False
            warnings.warn("labsupport.comm: a finished gloo work was not freed within "
                          f"{_FREE_WAIT_S:g} s; no longer waiting for works to be freed", RuntimeWarning)
            return
        time.sleep(0 if now_ - start < 5e-4 else 1e-4)


class _Work:
    """Wraps an async handle so the timeline gets the moment the op was waited for."""

    def __init__(self, work, event, after_wait=None, watch=None, before=0):
        self._work, self._event, self._after_wait = work, event, after_wait
        self._watch, self._before = watch, before

    def wait(self):
        if self._work is not None:
            self._work.wait()
            if self._watch is None:
                self._work = None
            else:
                held = _use_count(self._watch)
                self._work = None  # the last reference, unless the worker thread still holds it
                _until_freed(self._watch, self._before, held)
        if self._after_wait is not None:
            self._after_wait()
            self._after_wait = None
        if self._event is not None and "end" not in self._event:
            self._event["end"] = now()
        return True

    def is_completed(self):
        return self._work is None or self._work.is_completed()


def _call(op, payload, group, fn, async_op=False, after=None, watch=None, **meta):
    """Count, time and run one communication; `after` runs once the data has arrived.

    `fn(async_op)` starts it; `watch` is a tensor the backend's work holds (see `_until_freed`).
    """
    n = get_world_size(group)
    STATS.add(group_name(group), op, payload, n)
    event = None
    if STATS.timing:
        event = {"op": op, "group": group_name(group), "payload_bytes": int(payload), "start": now(), **meta}
        STATS.events.append(event)
    watch = _watch(watch, group)
    if async_op or watch is not None:  # a synchronous gloo call too: waited for here, then freed
        before = _use_count(watch) if watch is not None else 0
        work = _Work(fn(True), event, after, watch, before)
        if async_op:
            if event is not None:  # the end is when the data has arrived, not when someone waits for it
                try:
                    work._work.get_future().add_done_callback(lambda _: event.setdefault("end", now()))
                except RuntimeError:  # gloo's reduce_scatter has no future: the end is when it is waited for
                    pass
            return work
        work.wait()
        return None
    fn(False)
    if after is not None:
        after()
    if event is not None:
        event["end"] = now()
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reduce_op(op: str):
    if op not in REDUCE_OPS:
        raise ValueError(f"unsupported reduction {op!r}; choose one of {', '.join(REDUCE_OPS)}")
    return _OPS.get(op, dist.ReduceOp.SUM)  # avg = sum, then divide (gloo has no AVG)


def _divide_if_avg(op, tensors, group):
    if op != "avg":
        return None
    n = get_world_size(group)

    def divide():
        for t in tensors:
            t.div_(n)
    return divide


# ---------------------------------------------------------------- collectives

def all_reduce(tensor, op="sum", group=None, async_op=False, **meta):
    red = _reduce_op(op)
    return _call("all_reduce", _nbytes(tensor), group,
                 lambda a: dist.all_reduce(tensor, red, group=group, async_op=a),
                 async_op, _divide_if_avg(op, [tensor], group), watch=tensor, **meta)


def reduce(tensor, dst, op="sum", group=None, async_op=False):
    red = _reduce_op(op)
    after = _divide_if_avg(op, [tensor], group) if get_rank() == dst else None
    return _call("reduce", _nbytes(tensor), group,
                 lambda a: dist.reduce(tensor, dst, red, group=group, async_op=a), async_op, after, watch=tensor)


def broadcast(tensor, src, group=None, async_op=False):
    return _call("broadcast", _nbytes(tensor), group,
                 lambda a: dist.broadcast(tensor, src, group=group, async_op=a), async_op, watch=tensor)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    return _call("all_gather", _nbytes(tensor) * get_world_size(group), group,
                 lambda a: dist.all_gather(tensor_list, tensor, group=group, async_op=a), async_op, watch=tensor)


# torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only the first
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather_into_tensor(output, input, group=None, async_op=False):
    return _call("all_gather", _nbytes(output), group,
                 lambda a: _all_gather_single(output, input, group=group, async_op=a), async_op, watch=input)


def reduce_scatter(output, input_list, op="sum", group=None, async_op=False):
    red = _reduce_op(op)
    if not _native_reduce_scatter(group):  # gloo before torch 2.6: all-reduce, keep our shard
        return _gloo_reduce_scatter(output, list(input_list), op, group, async_op)
    return _call("reduce_scatter", sum(_nbytes(t) for t in input_list), group,
                 lambda a: dist.reduce_scatter(output, list(input_list), red, group=group, async_op=a),
                 async_op, _divide_if_avg(op, [output], group), watch=output)


def reduce_scatter_tensor(output, input, op="sum", group=None, async_op=False):
    n = get_world_size(group)
    return reduce_scatter(output, list(input.chunk(n)), op=op, group=group, async_op=async_op)


_HAS_REDUCE_SCATTER: dict = {}


def _native_reduce_scatter(group) -> bool:
    """Whether the backend implements reduce_scatter (NCCL does; gloo only in newer torch).

    Probed once per backend with an empty call: an unsupported op fails locally, on every
    rank alike, before anything is sent.
    """
    backend = dist.get_backend(group)
    if backend not in _HAS_REDUCE_SCATTER:
        empty = torch.empty(0)
        try:
            dist.reduce_scatter(empty, [empty] * get_world_size(group), group=group)
            _HAS_REDUCE_SCATTER[backend] = True
        except RuntimeError:
            _HAS_REDUCE_SCATTER[backend] = False
    return _HAS_REDUCE_SCATTER[backend]


def _gloo_reduce_scatter(output, input_list, op, group, async_op):
    """Same result as reduce_scatter; costs an all-reduce on the wire, but counted as what it means."""
    flat = torch.cat([t.reshape(-1) for t in input_list])
    red = _reduce_op(op)
    me = get_rank(group)
    offset = sum(t.numel() for t in input_list[:me])

    def after():
        output.copy_(flat[offset:offset + output.numel()].view_as(output))
        if op == "avg":
            output.div_(get_world_size(group))
    return _call("reduce_scatter", _nbytes(flat), group,
                 lambda a: dist.all_reduce(flat, red, group=group, async_op=a), async_op, after, watch=flat)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    return _call("scatter", _nbytes(tensor) * get_world_size(group), group,
                 lambda a: dist.scatter(tensor, scatter_list, src=src, group=group, async_op=a), async_op,
                 watch=tensor)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    return _call("gather", _nbytes(tensor) * get_world_size(group), group,
                 lambda a: dist.gather(tensor, gather_list, dst=dst, group=group, async_op=a), async_op,
                 watch=tensor)


def all_to_all(output_list, input_list, group=None, async_op=False):
    return _call("all_to_all", sum(_nbytes(t) for t in input_list), group,
                 lambda a: dist.all_to_all(output_list, input_list, group=group, async_op=a), async_op,
                 watch=input_list[0] if input_list else None)


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
    """Rows of `input` in blocks of `input_split_sizes`, block i to rank i; `output` gets rank i's
    block for this rank in its `output_split_sizes[i]` rows (None: equal blocks). Counted as
    "all_to_all", its payload the input this rank sends, its own block included."""
    return _call("all_to_all", _nbytes(input), group,
                 lambda a: dist.all_to_all_single(output, input, output_split_sizes, input_split_sizes, group=group,
                                                  async_op=a), async_op, watch=input)


def barrier(group=None):
    return _call("barrier", 0, group, lambda a: dist.barrier(group=group))


# ---------------------------------------------------------------- point to point
# `dst`/`src` are world ranks. A `tag` tells apart messages that travel between the same two
# ranks in the same direction (a pipeline's activations and gradients: gloo matches a receive
# to a send by peer and tag; NCCL ignores tags and matches by order).

def send(tensor, dst, group=None, tag=0):
    return _call("send", _nbytes(tensor), group, lambda a: dist.send(tensor, dst, group=group, tag=tag), peer=dst)


def recv(tensor, src, group=None, tag=0):
    return _call("recv", _nbytes(tensor), group, lambda a: dist.recv(tensor, src, group=group, tag=tag), peer=src)


def isend(tensor, dst, group=None, tag=0):
    return _call("send", _nbytes(tensor), group, lambda a: dist.isend(tensor, dst, group=group, tag=tag), True,
                 peer=dst)


def irecv(tensor, src, group=None, tag=0):
    return _call("recv", _nbytes(tensor), group, lambda a: dist.irecv(tensor, src, group=group, tag=tag), True,
                 peer=src)


def batch_isend_irecv(ops, group=None) -> list:
    """Post sends and receives together: `ops` are ("send" | "recv", tensor, peer, tag); returns
    their works, in order. NCCL runs one pair of ranks' messages in order on one stream, so two
    neighbours that each send to the other before receiving wait for each other forever; posted
    as one group (`torch.distributed.batch_isend_irecv`), they proceed. gloo needs no group."""
    if not ops:
        return []
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend if kind == "send" else dist.irecv, tensor, peer, group, tag)
                                    for kind, tensor, peer, tag in ops])
    if len(works) != len(ops):  # NCCL coalesces the group into one work, done when all of it is
        works = [works[-1]] * len(ops)
    return [_call(kind, _nbytes(tensor), group, lambda a, work=work: work, True, peer=peer)
            for (kind, tensor, peer, _), work in zip(ops, works)]
