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

In low precision (`--dtype bf16` or `fp16`: q, k, v come out of autocast's matmuls in that dtype) a
block computes in that dtype, as a single device's attention computes the whole sequence, but the
merge does not: the output and the log-sum-exp accumulate in fp32 (the kernels return the log-sum-exp
in fp32), so the ring rounds each block's output once and the sum once, and the backward's dq, dk, dv
sums are fp32 too. An fp16 or bf16 merge would round exp(l1 - l) and the running sum at every step and
compound it over cp steps; so ring attention runs under both dtypes, held to single within their
tolerance (tests/test_train_cp_ep.py).

Each block (a chunk of queries against a chunk of keys) is computed by a kernel that returns the
block's output and log-sum-exp: torch's fused CPU FlashAttention kernel ("flash", the default on
CPU), or the same formulas in plain tensor operations ("math": any device, easy to read, but it
holds a block's scores at once and is several times slower).

Grouped-query attention (Ainslie et al. 2023) and rotary positions, the Llama family's: K and V
have kv_heads heads, each read by r = heads / kv_heads query heads (query head g r + j reads key/value
head g, as SDPA's `enable_gqa` pairs them). The ring passes K and V as they are, grouped, so its
bytes (and the dK, dV sums of the backward) are kv_heads / heads of multi-head attention's
(estimate/context.py, `ring_traffic`'s `kv_hidden`); each block's kernel reads the grouped heads
itself (torch's fused CPU kernel does; "math" groups the queries by their key/value head), so no
rank ever holds K or V repeated over the query heads. Repeating them before the ring computes the same
and sends r times the bytes: torchtitan's Llama 3 (torchtitan/models/llama3/model/model.py) up to its
release v0.2.1 called `repeat_kv` before its SDPA, so torch's `context_parallel`, which replaces that SDPA
by its ring, moved r times the grouped bytes; since v0.2.2 (PR #2259, "GQA without kv repeats") it passes
the kv_heads heads with `enable_gqa=True`. Megatron-LM's context parallelism (Transformer Engine's P2P ring) passes the K/V of the
`num_query_groups` heads, as here.
RoPE rotates q and k by their *global* positions before the scores (model.py's `rotate`), so a K
block carries its rotation with it around the ring and every score is single's: the positions
are the rank's chunks' (`positions`: with the balanced split, chunk r and chunk 2 cp - 1 - r), which
`ContextParallelStep` hands the model, as Megatron-LM cuts its rotary table by the same two chunks
per rank (`get_pos_emb_on_this_cp_rank`). RoPE from the local indices 0 .. s / cp - 1 would rotate
every rank's keys as if they stood at the start of the sequence.

Use: `shard_sequence` gives a rank its share of a batch's positions (and `positions` their
global indices, for position embeddings); `apply_context_parallel(module, group)` makes every
causal `scaled_dot_product_attention` that `module`'s forward calls a ring attention over the
group, until `.remove()` (or, for a while, `paused()`). Attention dropout is not supported (it
would need the same random mask on every rank's share of the scores).

In the training loop, `ContextParallelStep` is the step of the composition (compose.py): each of
the cp ranks of one data-parallel index gets the same micro-batch and keeps its positions of it,
tokens and targets alike; the model embeds them at their global positions; each rank's loss is the
mean over its tokens. The parameters are replicated over the cp ranks, so data parallelism
averages their gradients over dp x cp (mesh.py's DP-CP group, as Megatron-LM's): the mean of
the cp ranks' mean losses is the mean over the sequence, their shares being equal. Sampling runs
the whole sequence on every rank, with the ring paused.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from contextlib import ExitStack, contextmanager

from .. import comm
from ..estimate.context import split_problems
from .step import Step


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


def _visible_blocks(q_pos, k_pos, balanced) -> list[tuple[slice, slice, bool]]:
    """The pairs of chunks (query rows, key rows, causal) the mask does not hide entirely.

    Chunks are cut on one grid, so a chunk of keys is all before a chunk of queries (every score
    visible), the same chunk (causal inside it), or all after it (hidden: skipped)."""
    return [(qr, kr, bool(kp[0] == qp[0]))
            for qr, qp in _chunks(q_pos, balanced) for kr, kp in _chunks(k_pos, balanced) if kp[0] <= qp[-1]]


def _causal_mask(n: int, device) -> torch.Tensor:
    return torch.ones(n, n, dtype=torch.bool, device=device).tril()


def _by_group(t, kv_heads):
    """A tensor of query heads (dim -3) as (kv_heads, r): the r query heads that read each key/value head
    side by side (query head g r + j reads key/value head g); with r = 1 plain multi-head attention."""
    return t.unflatten(-3, (kv_heads, -1))


def _block_math(q, k, v, causal, scale):
    """One block's attention output and the log-sum-exp of each query row's scores (in fp32).
    k and v may have fewer heads than q (grouped-query attention): each is read by its query group."""
    kv = k.shape[-3]
    q, k, v = _by_group(q.float(), kv), k.float().unsqueeze(-3), v.float().unsqueeze(-3)  # k, v broadcast over r
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(s.shape[-1], s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    return (torch.exp(s - lse[..., None]) @ v).flatten(-4, -3), lse.flatten(-3, -2)


def _block_backward_math(d_out, q, k, v, out, lse, causal, scale):
    """One block's dq, dk, dv from the *final* output and log-sum-exp of the query rows
    (FlashAttention's backward, Dao et al. 2022, Alg. 2): P = exp(S - lse) are the final
    probabilities, dS = P (dO V^T - D) with D = rowsum(dO O). In fp32, as the forward. Under
    grouped-query attention a key/value head's dk and dv are summed over the query heads that read it."""
    kv = k.shape[-3]
    q, d_out, out = (_by_group(t.float(), kv) for t in (q, d_out, out))
    k, v, lse = k.float().unsqueeze(-3), v.float().unsqueeze(-3), _by_group(lse.unsqueeze(-1), kv)
    s = q @ k.transpose(-2, -1) * scale
    if causal:
        s = s.masked_fill(~_causal_mask(s.shape[-1], s.device), float("-inf"))
    p = torch.exp(s - lse)
    ds = p * (d_out @ v.transpose(-2, -1) - (d_out * out).sum(-1, keepdim=True))
    return ((ds @ k * scale).flatten(-4, -3), (ds.transpose(-2, -1) @ q * scale).sum(-3),
            (p.transpose(-2, -1) @ d_out).sum(-3))


def _block_flash(q, k, v, causal, scale):
    """`_block_math` by torch's fused CPU FlashAttention kernel, which also returns the log-sum-exp. It reads
    grouped K/V itself (query head h reads key/value head h // r) and its backward returns dk, dv of the
    key/value heads, summed over each one's query heads."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _block_backward_flash(d_out, q, k, v, out, lse, causal, scale):
    """`_block_backward_math` by the fused kernel's backward (it takes the final output and lse too)."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        d_out, q, k, v, out, lse, 0.0, causal, scale=scale)


KERNELS = {"math": (_block_math, _block_backward_math), "flash": (_block_flash, _block_backward_flash)}


def start_pass_on(tensors, group, tag=0):
    """Start sending `tensors` to the next rank of the ring and receiving the previous rank's into new
    buffers. Returns a function that waits for both and gives the received tensors."""
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
    def forward(ctx, q, k, v, group, balanced, scale, kernel, counts):
        attend = KERNELS[kernel][0]
        rank, cp = comm.get_rank(group), comm.get_world_size(group)
        seq_len = q.shape[-2] * cp
        q_pos = positions(seq_len, rank, cp, balanced, q.device)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()  # views of one qkv matrix cannot be sent as they are
        for step in range(cp):
            if step < cp - 1:
                arrived = start_pass_on([k_cur, v_cur], group)
            k_pos = positions(seq_len, (rank - step) % cp, cp, balanced, q.device)
            for qr, kr, causal in _visible_blocks(q_pos, k_pos, balanced):
                block_out, block_lse = attend(q[..., qr, :], k_cur[..., kr, :], v_cur[..., kr, :], causal, scale)
                merged = torch.logaddexp(lse[..., qr], block_lse)  # the online-softmax merge
                out[..., qr, :] = (out[..., qr, :] * torch.exp(lse[..., qr] - merged)[..., None]
                                   + block_out.float() * torch.exp(block_lse - merged)[..., None])
                lse[..., qr] = merged
                counts["forward"] += (qr.stop - qr.start) * (kr.stop - kr.start)
            if step < cp - 1:
                k_cur, v_cur = arrived()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.balanced, ctx.scale, ctx.kernel, ctx.counts = group, balanced, scale, kernel, counts
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, balanced, scale, counts = ctx.group, ctx.balanced, ctx.scale, ctx.counts
        attend_backward = KERNELS[ctx.kernel][1]
        rank, cp = comm.get_rank(group), comm.get_world_size(group)
        seq_len = q.shape[-2] * cp
        q_pos = positions(seq_len, rank, cp, balanced, q.device)
        d_out = d_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        k_cur, v_cur = k.contiguous(), v.contiguous()
        for step in range(cp):
            if step < cp - 1:
                arrived = start_pass_on([k_cur, v_cur], group)
            k_pos = positions(seq_len, (rank - step) % cp, cp, balanced, q.device)
            dk_block = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
            dv_block = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
            for qr, kr, causal in _visible_blocks(q_pos, k_pos, balanced):
                dq_b, dk_b, dv_b = attend_backward(d_out[..., qr, :], q[..., qr, :], k_cur[..., kr, :],
                                                   v_cur[..., kr, :], out[..., qr, :], lse[..., qr], causal, scale)
                dq[..., qr, :] += dq_b
                dk_block[..., kr, :] += dk_b
                dv_block[..., kr, :] += dv_b
                counts["backward"] += (qr.stop - qr.start) * (kr.stop - kr.start)
            if step == 0:  # this rank's own block: its sums from the other ranks arrive at the end
                dk, dv = dk_block, dv_block
            else:  # another rank's block: add to the sums the previous ranks made, pass them on
                if step > 1:
                    dk_sum, dv_sum = sums_arrived()
                    dk_block, dv_block = dk_block + dk_sum, dv_block + dv_sum
                sums_arrived = start_pass_on([dk_block, dv_block], group, tag=2)
            if step < cp - 1:
                k_cur, v_cur = arrived()
        if cp > 1:  # after cp - 1 hops, the sums for this rank's block are home
            dk_sum, dv_sum = sums_arrived()
            dk, dv = dk + dk_sum, dv + dv_sum
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, group=None, balanced: bool = True, scale: float | None = None,
                   kernel: str | None = None, counts=None):
    """Causal attention of this rank's share of the sequence, q `(batch, heads, s / cp, head_dim)`,
    against the whole sequence held by the ranks of `group`; the share is `shard_sequence`'s. k and v
    are `(batch, kv_heads, s / cp, head_dim)` with kv_heads dividing heads: grouped-query attention,
    query head h reading key/value head h // (heads / kv_heads) as SDPA's `enable_gqa`; they travel
    the ring grouped (kv_heads heads), as do their gradients' sums.

    `kernel` computes each block: "flash", torch's fused CPU FlashAttention kernel (the default
    on CPU), or "math", the same formulas in plain tensor operations (any device; it holds a
    block's scores at once). `counts` (a dict with "forward" and "backward") adds up the
    scores this rank computes, per sequence and head."""
    kernel = kernel or ("flash" if q.device.type == "cpu" else "math")
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if q.shape[-3] % k.shape[-3] or k.shape != v.shape:
        raise ValueError(f"ring attention: key and value must have the same shape with a number of heads that "
                         f"divides the queries' (got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)})")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    check_split(q.shape[-2] * comm.get_world_size(group), comm.get_world_size(group), balanced)
    counts = {"forward": 0, "backward": 0} if counts is None else counts
    return _RingAttention.apply(q, k, v, group, balanced, scale, kernel, counts)


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
        if not call.get("is_causal") or call.get("attn_mask") is not None:
            raise ValueError("context parallelism computes causal attention: call scaled_dot_product_attention "
                             "with is_causal=True and no attn_mask")
        if call["key"].shape[-3] != call["query"].shape[-3] and not call.get("enable_gqa"):
            raise ValueError("scaled_dot_product_attention: keys with fewer heads than the queries need "
                             "enable_gqa=True (grouped-query attention)")
        if call.get("dropout_p", 0.0) > 0:
            raise ValueError("context parallelism has no attention dropout: set the model's dropout to 0")
        o = self.owner
        return ring_attention(call["query"], call["key"], call["value"], o.group, o.balanced, call.get("scale"),
                              o.kernel, o.counts)


class ContextParallel:
    """Ring attention on `module`: while its forward runs, its causal scaled_dot_product_attention
    calls are ring attentions over `group` (as torch's own `context_parallel` replaces SDPA inside its context).
    Its inputs must be this rank's share of the sequence (`shard_sequence`). `counts` adds up the
    scores this rank computes, forward and backward; `remove()` gives the module back as it was."""

    def __init__(self, module: torch.nn.Module, group=None, balanced: bool = True, kernel: str | None = None):
        self.module, self.group, self.balanced, self.kernel = module, group, balanced, kernel
        self.counts = {"forward": 0, "backward": 0}
        self._mode = None
        self.active = True
        self._hooks = [module.register_forward_pre_hook(self._enter),
                       module.register_forward_hook(self._leave, always_call=True)]

    def _enter(self, module, args):
        if self.active:
            self._mode = _SDPAAsRing(self)
            self._mode.__enter__()

    def _leave(self, module, args, output):
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None

    @contextmanager
    def paused(self):
        """Forwards inside run the module's own attention, on whole sequences (sampling)."""
        self.active = False
        try:
            yield
        finally:
            self.active = True

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def apply_context_parallel(module: torch.nn.Module, group=None, balanced: bool = True,
                           kernel: str | None = None) -> ContextParallel:
    """Context parallelism on `module` (one attention, a block or a whole model) over `group`."""
    return ContextParallel(module, group, balanced, kernel)


class ContextParallelStep(Step):
    """`--cp C`: the sequence cut over the cp ranks of each data-parallel index (balanced split),
    attention by the ring. See the module docstring; data parallelism does the gradient average."""

    axis = "cp"
    title = "context parallelism"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        if config.cp == 1:
            return []
        out = []
        if config.pp > 1:
            out.append(f"--cp {config.cp} does not combine with --pp (a pipeline stage would have to pass on its "
                       "share of the sequence); use --pp 1")
        if config.zero:
            out.append(f"--cp {config.cp} runs with --zero 0 only (its gradients are averaged by DDP's buckets over "
                       "dp x cp): leave --zero out, or give --zero 0")
        if config.sequence_parallel:
            out.append("--sequence-parallel cuts the sequence over the TP ranks, --cp over the CP ranks; use one")
        if model is not None:
            out += split_problems(model.seq_len, config.cp)
            if model.dropout:
                out.append(f"--cp {config.cp} has no attention dropout (every rank would need the same mask): "
                           "use --dropout 0")
        return out

    def apply(self, parts, shared, owned):
        self.rank, self.cp = comm.get_rank(self.group), comm.get_world_size(self.group)
        self.rings = [apply_context_parallel(part, self.group) for part in parts]
        self._hooks = [part.register_forward_pre_hook(self._global_positions, with_kwargs=True) for part in parts]
        return parts

    def _global_positions(self, module, args, kwargs):
        """Embed this rank's tokens at their places in the whole sequence."""
        if not self.rings[0].active:
            return None
        x = args[0]
        return args, {**kwargs, "positions": positions(x.shape[1] * self.cp, self.rank, self.cp, device=x.device)}

    def local_batch(self, x, y):
        return shard_sequence(x, self.rank, self.cp), shard_sequence(y, self.rank, self.cp)

    def sampling(self, forward):
        """Sampling runs whole sequences on every rank: the ring paused, attention as on one device."""
        def whole(idx):
            with ExitStack() as stack:
                for ring in self.rings:
                    stack.enter_context(ring.paused())
                return forward(idx)
        return whole

    def close(self):
        for handle in self._hooks:
            handle.remove()
        for ring in self.rings:
            ring.remove()

