"""Ring and tree collectives built from point-to-point messages, to see what NCCL and gloo do inside.

Each function executes a schedule from `labsupport.estimate.collective_steps` (the one the
collectives widget draws): at every step a rank posts its send and its receive at the same time
(isend + irecv), so no rank waits for a neighbour that is itself waiting to send. Messages go
through `comm`, so the counters show what each algorithm puts on the wire.

The tensor is treated as one flat buffer cut into world-size chunks with `torch.tensor_split`:
any length works, including lengths that the world size does not divide (the first chunks are one
element longer) and empty tensors. Rank r's chunk is chunk r, as in torch.distributed.

Only the world group is supported: send and receive address peers by global rank, and a
sub-group's ranks would need translating (`torch.distributed.get_global_rank`) first.
"""
from __future__ import annotations

import torch

from . import comm
from .estimate import collective_steps

# How a received chunk is folded into ours, in place; "avg" sums and divides once at the end.
_COMBINE = {
    "sum": lambda mine, incoming: mine.add_(incoming),
    "avg": lambda mine, incoming: mine.add_(incoming),
    "product": lambda mine, incoming: mine.mul_(incoming),
    "max": lambda mine, incoming: torch.maximum(mine, incoming, out=mine),
    "min": lambda mine, incoming: torch.minimum(mine, incoming, out=mine),
}


def _check_op(op: str, tensor: torch.Tensor) -> None:
    if op not in _COMBINE:
        raise ValueError(f"unsupported reduction {op!r}; choose one of {', '.join(_COMBINE)}")
    if op == "avg" and not tensor.is_floating_point():
        raise ValueError(f"op='avg' needs a floating-point tensor, got {tensor.dtype}; use 'sum' and divide")


_SCRATCH: dict = {}


def _scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A receive buffer kept between calls: allocating (and page-faulting) megabytes on every
    call costs as much as the reduction itself. These functions run one at a time (each returns
    when its data is complete), so one buffer, for the last size asked, is enough."""
    key = (numel, like.dtype, like.device)
    if key not in _SCRATCH:
        _SCRATCH.clear()
        _SCRATCH[key] = torch.empty(numel, dtype=like.dtype, device=like.device)
    return _SCRATCH[key]


def run_steps(steps, chunks: list[torch.Tensor], op: str | None = None) -> None:
    """Execute this rank's part of ring steps on `chunks`, views of one flat buffer.

    A reduced chunk is received into a scratch buffer (reused at every step and call) and then
    folded into ours; a stored chunk is received straight into its place.
    """
    me = comm.get_rank()
    scratch = _scratch(max(c.numel() for c in chunks), chunks[0])
    for step in steps:
        send = next(t for t in step if t.src == me)  # in a ring, one of each per rank and step
        recv = next(t for t in step if t.dst == me)
        target = chunks[recv.into]
        incoming = scratch[:target.numel()] if recv.reduce else target
        sending = comm.isend(chunks[send.chunk], send.dst)
        receiving = comm.irecv(incoming, recv.src)
        sending.wait()
        receiving.wait()
        if recv.reduce:
            _COMBINE[op](target, incoming)


def _flat_chunks(flat: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.tensor_split(flat, comm.get_world_size()))


def ring_reduce_scatter(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's chunk of the result (flat, 1-D).

    Rank r gets chunk r of `torch.tensor_split(result.reshape(-1), world_size)`. `tensor` itself
    is left unchanged (the ring works on a copy). Each rank sends (n-1)/n of the buffer.
    """
    _check_op(op, tensor)
    chunks = _flat_chunks(tensor.reshape(-1).clone())
    run_steps(collective_steps.ring_reduce_scatter(len(chunks)), chunks, op)
    mine = chunks[comm.get_rank()]
    if op == "avg":
        mine.div_(len(chunks))
    return mine.clone()  # not a view: don't keep the whole buffer alive


def ring_all_gather(output: torch.Tensor, input: torch.Tensor) -> torch.Tensor:
    """Fill `output` with every rank's `input`: the inverse of `ring_reduce_scatter`.

    Like `all_gather_into_tensor(output, input)`: rank r's `input` becomes chunk r of the flat,
    contiguous `output`, chunks cut by `torch.tensor_split`, so `input` must have that chunk's size.
    """
    if not output.is_contiguous():
        raise ValueError("output must be contiguous: the chunks are views of it")
    chunks = _flat_chunks(output.view(-1))
    mine = chunks[comm.get_rank()]
    if input.numel() != mine.numel():
        raise ValueError(f"input has {input.numel()} elements but this rank's chunk of output has {mine.numel()}")
    mine.copy_(input.reshape(-1))
    run_steps(collective_steps.ring_all_gather(len(chunks)), chunks)
    return output


def ring_all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce `tensor` over all ranks in place: ring reduce-scatter, then ring all-gather.

    Each rank sends 2(n-1) messages of 1/n of the buffer, whatever the number of ranks n
    (Patarasuk & Yuan 2009). Returns `tensor`.
    """
    _check_op(op, tensor)
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    chunks = _flat_chunks(work.view(-1))
    n = len(chunks)
    run_steps(collective_steps.ring_reduce_scatter(n), chunks, op)
    if op == "avg":
        chunks[comm.get_rank()].div_(n)  # only our chunk: the all-gather spreads it
    run_steps(collective_steps.ring_all_gather(n), chunks)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def tree_broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Copy rank `src`'s `tensor` into every rank's `tensor` in place, along a binomial tree.

    ceil(log2 n) rounds, each sending the whole buffer: fewer steps than a ring (good for small,
    latency-bound messages), but every hop carries all of it. Returns `tensor`.
    """
    me, n = comm.get_rank(), comm.get_world_size()
    if not 0 <= src < n:
        raise ValueError(f"src must be a rank from 0 to {n - 1}, got {src}")
    work = tensor if tensor.is_contiguous() else tensor.contiguous()
    for step in collective_steps.binomial_tree_broadcast(n, root=src):
        for t in step:  # a rank sends or receives in a round, never both: blocking calls can't deadlock
            if t.src == me:
                comm.send(work, t.dst)
            elif t.dst == me:
                comm.recv(work, t.src)
    if work is not tensor:
        tensor.copy_(work)
    return tensor
