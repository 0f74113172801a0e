"""Context parallelism: the sequence cut over a group of ranks, causal attention by ring attention.

Each of the cp ranks of a group holds s / cp positions of every sequence: its queries, keys and
values. Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers") computes
exact causal attention without ever gathering the sequence: in each of cp steps a rank computes
its queries against the K/V block it holds while it passes that block to the next rank of the
ring and receives the previous rank's (isend/irecv through comm). The partial results of the
steps are merged with the online-softmax rule (Milakov & Gimelshein 2018): a partial result is
an output o and the log-sum-exp l of each query row's scores, and two of them merge as

    l = log(exp(l1) + exp(l2)),    o = o1 exp(l1 - l) + o2 exp(l2 - l).

The causal mask compares *global* positions: a query at position p sees the keys at positions
<= p, wherever they live. With the plain split (rank r holds the r-th of cp contiguous pieces)
the last rank computes scores with every block and the first with its own only. The balanced
split cuts the sequence into 2 cp chunks and gives rank r chunks r and 2 cp - 1 - r, one from
the front and one from the back (the "zigzag" of Llama 3 and Megatron-LM's context
parallelism): blocks that the mask hides entirely are skipped, and every rank computes the
same number of scores.

The backward pass is the same ring (`_RingAttention`, an autograd Function with its own
backward; autograd never sees the communication): K and V travel again, and beside them the sums
of dK and dV of each block, which collect every rank's contribution on their way back to the
block's owner. Scores are recomputed from the saved log-sum-exp (as FlashAttention's backward
does), so a rank keeps q, k, v, the output and the log-sum-exp of its own positions only.

Use: `shard_sequence` gives a rank its share of a batch's positions (and `positions` their
global indices, for position embeddings); `apply_context_parallel(module, group)` makes every
causal `scaled_dot_product_attention` that `module`'s forward calls a ring attention over the
group, until `.remove()`. Attention dropout is not supported (it would need the same random
mask on every rank's share of the scores).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import comm
from ..estimate.context import split_problems


def check_split(seq_len: int, cp: int, balanced: bool) -> None:
    """Raise one clear ValueError when `seq_len` positions cannot be cut over `cp` ranks."""
    problems = split_problems(seq_len, cp, balanced)
    if problems:
        raise ValueError(problems[0])


def positions(seq_len: int, rank: int, cp: int, balanced: bool = True, device=None) -> torch.Tensor:
    """The global positions rank `rank` of `cp` holds, in the order it holds them."""
    check_split(seq_len, cp, balanced)
    if not balanced:
        c = seq_len // cp
        return torch.arange(rank * c, (rank + 1) * c, device=device)
    c = seq_len // (2 * cp)
    front, back = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(front, front + c, device=device), torch.arange(back, back + c, device=device)])


def shard_sequence(x: torch.Tensor, rank: int, cp: int, balanced: bool = True, dim: int = 1) -> torch.Tensor:
    """This rank's positions of `x` along `dim` (token ids, targets, hidden states)."""
    return x.index_select(dim, positions(x.shape[dim], rank, cp, balanced, device=x.device))


def _chunks(pos: torch.Tensor, balanced: bool) -> list[tuple[slice, torch.Tensor]]:
    """A rank's positions as its contiguous chunks: (rows in the local tensor, their positions)."""
    n = 2 if balanced else 1
    c = len(pos) // n
    return [(slice(i * c, (i + 1) * c), pos[i * c:(i + 1) * c]) for i in range(n)]


def _visible_blocks(q_pos, k_pos, balanced):
    """The (query rows, key rows, mask) pairs of chunks that share at least one visible score:
    a chunk of keys that starts after a chunk of queries ends is hidden by the mask, and skipped."""
    return [(qr, kr, qp[:, None] >= kp[None, :])
            for qr, qp in _chunks(q_pos, balanced) for kr, kp in _chunks(k_pos, balanced) if kp[0] <= qp[-1]]


def _scores(q, k, mask, scale):
    return (q @ k.transpose(-2, -1) * scale).masked_fill(~mask, float("-inf"))


def _pass_on(tensors, group, tag=0):
    """Send `tensors` to the next rank of the ring and receive the previous rank's into new buffers.
    Returns a function that waits for both and gives the received tensors."""
    me, n = comm.get_rank(group), comm.get_world_size(group)
    nxt, prev = comm.global_rank(group, (me + 1) % n), comm.global_rank(group, (me - 1) % n)
    received = [torch.empty_like(t) for t in tensors]
    works = comm.batch_isend_irecv([("send", t, nxt, tag + i) for i, t in enumerate(tensors)]
                                   + [("recv", r, prev, tag + i) for i, r in enumerate(received)], group)

    def wait():
        for w in works:
            w.wait()
        return received
    return wait


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against every rank's keys, by the ring."""

    @staticmethod
    def forward(ctx, q, k, v, group, balanced, scale, counts):
        rank, cp = comm.get_rank(group), comm.get_world_size(group)
        seq_len = q.shape[-2] * cp
        q_pos = positions(seq_len, rank, cp, balanced, q.device)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()  # views of one qkv matrix cannot be sent as they are
        for step in range(cp):
            if step < cp - 1:
                arrived = _pass_on([k_cur, v_cur], group)
            k_pos = positions(seq_len, (rank - step) % cp, cp, balanced, q.device)
            for qr, kr, mask in _visible_blocks(q_pos, k_pos, balanced):
                s = _scores(q[..., qr, :].float(), k_cur[..., kr, :].float(), mask, scale)
                block_lse = torch.logsumexp(s, dim=-1)
                block_out = torch.exp(s - block_lse[..., None]) @ v_cur[..., kr, :].float()
                merged = torch.logaddexp(lse[..., qr], block_lse)  # the online-softmax merge
                out[..., qr, :] = (out[..., qr, :] * torch.exp(lse[..., qr] - merged)[..., None]
                                   + block_out * torch.exp(block_lse - merged)[..., None])
                lse[..., qr] = merged
                counts["forward"] += mask.numel()
            if step < cp - 1:
                k_cur, v_cur = arrived()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced, ctx.scale, ctx.counts = group, balanced, scale, counts
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, balanced, scale, counts = ctx.group, ctx.balanced, ctx.scale, ctx.counts
        rank, cp = comm.get_rank(group), comm.get_world_size(group)
        seq_len = q.shape[-2] * cp
        q_pos = positions(seq_len, rank, cp, balanced, q.device)
        d_out = d_out.float()
        delta = (d_out * out.float()).sum(-1)  # D_i = sum_j P_ij dP_ij = dO_i . O_i
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()  # views of one qkv matrix cannot be sent as they are
        for step in range(cp):
            if step < cp - 1:
                arrived = _pass_on([k_cur, v_cur], group)
            k_pos = positions(seq_len, (rank - step) % cp, cp, balanced, q.device)
            dk_block = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv_block = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for qr, kr, mask in _visible_blocks(q_pos, k_pos, balanced):
                qb, kb = q[..., qr, :].float(), k_cur[..., kr, :].float()
                p = torch.exp(_scores(qb, kb, mask, scale) - lse[..., qr, None])  # the final probabilities
                dv_block[..., kr, :] += p.transpose(-2, -1) @ d_out[..., qr, :]
                ds = p * (d_out[..., qr, :] @ v_cur[..., kr, :].float().transpose(-2, -1) - delta[..., qr, None])
                dq[..., qr, :] += ds @ kb * scale
                dk_block[..., kr, :] += ds.transpose(-2, -1) @ qb * scale
                counts["backward"] += mask.numel()
            if step == 0:  # this rank's own block: its sums from the other ranks arrive at the end
                dk, dv = dk_block, dv_block
            else:  # another rank's block: add to the sums the previous ranks made, pass them on
                if step > 1:
                    dk_sum, dv_sum = sums_arrived()
                    dk_block, dv_block = dk_block + dk_sum, dv_block + dv_sum
                sums_arrived = _pass_on([dk_block, dv_block], group, tag=2)
            if step < cp - 1:
                k_cur, v_cur = arrived()
        if cp > 1:  # after cp - 1 hops, the sums for this rank's block are home
            dk_sum, dv_sum = sums_arrived()
            dk, dv = dk + dk_sum, dv + dv_sum
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None


def ring_attention(q, k, v, group=None, balanced: bool = True, scale: float | None = None, counts=None):
    """Causal attention of this rank's share of the sequence, `(batch, heads, s / cp, head_dim)`,
    against the whole sequence held by the ranks of `group`; the share is `shard_sequence`'s.
    `counts` (a dict with "forward" and "backward") adds up the scores this rank computes."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    check_split(q.shape[-2] * comm.get_world_size(group), comm.get_world_size(group), balanced)
    counts = {"forward": 0, "backward": 0} if counts is None else counts
    return _RingAttention.apply(q, k, v, group, balanced, scale, counts)


class _SDPAAsRing(TorchFunctionMode):
    """Inside a forward: each call of scaled_dot_product_attention becomes ring_attention."""

    def __init__(self, owner: ContextParallel):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        call = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale"), args))
        call.update(kwargs or {})
        if not call.get("is_causal") or call.get("attn_mask") is not None or call.get("enable_gqa"):
            raise ValueError("context parallelism computes causal attention: call scaled_dot_product_attention "
                             "with is_causal=True and no attn_mask")
        if call.get("dropout_p", 0.0) > 0:
            raise ValueError("context parallelism has no attention dropout: set the model's dropout to 0")
        o = self.owner
        return ring_attention(call["query"], call["key"], call["value"], o.group, o.balanced, call.get("scale"),
                              o.counts)


class ContextParallel:
    """Ring attention on `module`: while its forward runs, its causal scaled_dot_product_attention
    calls are ring attentions over `group` (torch's own `context_parallel` works the same way).
    Its inputs must be this rank's share of the sequence (`shard_sequence`). `counts` adds up the
    scores this rank computes, forward and backward; `remove()` gives the module back as it was."""

    def __init__(self, module: torch.nn.Module, group=None, balanced: bool = True):
        self.module, self.group, self.balanced = module, group, balanced
        self.counts = {"forward": 0, "backward": 0}
        self._mode = None
        self._hooks = [module.register_forward_pre_hook(self._enter),
                       module.register_forward_hook(self._leave, always_call=True)]

    def _enter(self, module, args):
        self._mode = _SDPAAsRing(self)
        self._mode.__enter__()

    def _leave(self, module, args, output):
        self._mode.__exit__(None, None, None)
        self._mode = None

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def apply_context_parallel(module: torch.nn.Module, group=None, balanced: bool = True) -> ContextParallel:
    """Context parallelism on `module` (one attention, a block or a whole model) over `group`."""
    return ContextParallel(module, group, balanced)
