"""Notebook 07's exercises: the online-softmax merge of two partial attention results (in one
process), one step of ring attention on real ranks, a find-the-bug lab (a causal ring attention
whose loss is a plausible number, yet neither it nor the gradients are dense attention's), and the
dispatch of a mixture-of-experts layer's all-to-all on real ranks.

The checks hold each answer to the dense computation on one process: softmax attention over the
whole sequence (`torch.nn.functional.scaled_dot_product_attention`), and for the dispatch each
token through its own expert. The ring exercises use the plain split (rank r holds the r-th of cp
contiguous pieces), the simplest to follow; the library's balanced split
(`labsupport.parallel.context`) changes which pieces, not the mechanism.

`attend`, `merge` and `pass_on` are the pieces the bug lab's ring is written with: a block's
attention under any mask, the merge, and the hop to the next rank (with its backward, the hop back).
"""
from __future__ import annotations

import ast
import re

from . import on_ranks
from .exercise import Exercise, Unsolved, Wrong, attempt, register
from .ring_pieces import attend, merge, pass_on

RANKS = 2
HANG = "Every rank must post its send and its receive; on two ranks the next rank is also the previous one"


def _case(batch=1, heads=2, seq=8, head_dim=4, seed=0):
    """q, k, v of the whole sequence, the same on every rank."""
    import torch
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, heads, seq, head_dim, generator=g) for _ in range(3)]


def _dense(q, k, v):
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _mine(t, rank, cp):
    return t.chunk(cp, dim=-2)[rank].clone()


# ---------------------------------------------------------------- one process: the merge

def _merge_case(seed, scale):
    """Attention of 3 query rows over 10 keys, split at key 4: the two partial results and the whole."""
    import torch
    g = torch.Generator().manual_seed(seed)
    q, k, v = torch.randn(3, 4, generator=g), torch.randn(10, 4, generator=g), torch.randn(10, 4, generator=g)
    s = (q @ k.T) * scale
    whole = (torch.softmax(s, -1) @ v, torch.logsumexp(s, -1))
    parts = []
    for cols in (slice(0, 4), slice(4, 10)):
        part = s[:, cols]
        parts.append((torch.softmax(part, -1) @ v[cols], torch.logsumexp(part, -1)))
    return parts, whole


def grade_merge(fn, source) -> str:
    import torch
    for seed, scale, what in ((0, 1.0, "scores of about 1"), (1, 60.0, "scores in the hundreds")):
        ((o1, l1), (o2, l2)), (o_want, l_want) = _merge_case(seed, scale)
        try:
            got = attempt(fn, o1.clone(), l1.clone(), o2.clone(), l2.clone())
        except Unsolved:
            raise
        except Exception as e:
            shapes = ("" if "must match the size" not in str(e) else
                      f". out has one row per query {tuple(o1.shape)}, lse one number per query {tuple(l1.shape)}: "
                      "a weight computed from lse needs [..., None] to scale out's rows")
            raise Wrong(f"online_softmax_merge raised {type(e).__name__}: {e}{shapes}") from None
        if not (isinstance(got, tuple) and len(got) == 2):
            raise Wrong("online_softmax_merge should return (out, lse): the merged output and its log-sum-exp")
        out, lse = got
        if tuple(lse.shape) != tuple(l_want.shape) or tuple(out.shape) != tuple(o_want.shape):
            raise Wrong(f"out should have shape {tuple(o_want.shape)} and lse {tuple(l_want.shape)}, like the inputs; "
                        f"got {tuple(out.shape)} and {tuple(lse.shape)}")
        if not torch.isfinite(lse).all() or not torch.isfinite(out).all():
            raise Wrong(f"with {what} your lse or out holds inf or nan: exp of a score in the hundreds overflows "
                        "fp32 (exp(89) does). Subtract the larger lse before exponentiating, as torch.logaddexp does")
        if not torch.allclose(lse, l_want, atol=1e-4, rtol=1e-5):
            if torch.allclose(lse, torch.maximum(l1, l2), atol=1e-4):
                why = "that is the larger of the two: the merged sum of exponentials holds both parts' sums"
            elif torch.allclose(lse, l1 + l2, atol=1e-4):
                why = "that is lse1 + lse2, the log of the product of the two sums; the softmax needs their sum"
            else:
                why = f"it differs by up to {(lse - l_want).abs().max().item():.3g}"
            raise Wrong(f"with {what} the merged lse is not the log-sum-exp of all ten scores: {why}")
        if not torch.allclose(out, o_want, atol=1e-4, rtol=1e-4):
            if torch.allclose(out, (o1 + o2) / 2, atol=1e-4):
                why = ("it is the plain mean of the two outputs; each must be weighted by the share of the softmax's "
                       "sum its keys hold, exp(lse_i - lse)")
            elif torch.allclose(out, o1 + o2, atol=1e-4):
                why = "it is o1 + o2; each output is normalised by its own sum: reweight it by exp(lse_i - lse)"
            else:
                why = f"it differs by up to {(out - o_want).abs().max().item():.3g}"
            raise Wrong(f"with {what} the lse is right but the merged output is not softmax(all scores) @ v: {why}")
    return ("two partial results (4 keys and 6 keys) merge into attention over all ten, with scores of about 1 and "
            "in the hundreds")


register(Exercise(
    name="online_softmax_merge", notebook="07", title="The online-softmax merge of two partial results",
    grade=grade_merge,
    hints=("Partial result i is o_i = sum_j exp(s_j - lse_i) v_j over its keys, with lse_i = log sum_j exp(s_j). "
           "The whole softmax's sum of exponentials is the sum of the two parts' sums.",
           "lse = log(exp(lse1) + exp(lse2)) (torch.logaddexp computes it without overflow); then "
           "o = o1 exp(lse1 - lse) + o2 exp(lse2 - lse), each weight broadcast over the last dimension."),
    solution='''
import torch


def online_softmax_merge(out1, lse1, out2, lse2):
    lse = torch.logaddexp(lse1, lse2)                 # log(exp(lse1) + exp(lse2)), without overflow
    out = out1 * torch.exp(lse1 - lse)[..., None] + out2 * torch.exp(lse2 - lse)[..., None]
    return out, lse
'''))


# ---------------------------------------------------------------- on ranks: one ring step

def check_ring_step(ring_step) -> dict:
    """cp steps of the attendee's ring_step on this rank's share (plain split): the output and lse
    must be dense causal attention's rows; after the first step the block held is the previous rank's."""
    import torch

    from .. import comm
    rank, cp = comm.get_rank(), comm.get_world_size()
    q, k, v = _case()
    c = q.shape[-2] // cp
    mine_q, k_cur, v_cur = _mine(q, rank, cp), _mine(k, rank, cp), _mine(v, rank, cp)
    out, lse = torch.zeros_like(mine_q), torch.full(mine_q.shape[:-1], float("-inf"))
    q_pos = torch.arange(rank * c, (rank + 1) * c)
    for step in range(cp):
        owner = (rank - step) % cp
        k_pos = torch.arange(owner * c, (owner + 1) * c)

        def attend_block(q_, k_, v_, visible=k_pos[None, :] <= q_pos[:, None]):
            return attend(q_, k_, v_, visible)
        before = comm.counts()
        result = on_ranks.on_rank(ring_step, mine_q, k_cur, v_cur, out, lse, attend_block)
        sent = {op: comm.counts().get(op, {}).get("calls", 0) - before.get(op, {}).get("calls", 0)
                for op in ("send", "recv")}
        if result["status"] != "ok":
            return result
        got = result["value"]
        if not (isinstance(got, tuple) and len(got) == 4):
            return {"status": "wrong", "message": "ring_step should return (out, lse, k, v): the merged result and "
                                                  "the K/V block received from the previous rank"}
        held = (k_cur, v_cur)
        out_before, lse_before = out, lse
        out, lse, k_cur, v_cur = got
        prev = (rank - step - 1) % cp
        if sent["send"] == 0 or sent["recv"] == 0:
            return {"status": "wrong", "message": f"in step {step} rank {rank} made {sent['send']} sends and "
                                                  f"{sent['recv']} receives through comm: pass the block on with "
                                                  "comm.isend to the next rank and comm.irecv from the previous"}
        if not (torch.equal(k_cur, _mine(k, prev, cp)) and torch.equal(v_cur, _mine(v, prev, cp))):
            held = next((r for r in range(cp) if torch.equal(k_cur, _mine(k, r, cp))), None)
            what = f"rank {held}'s K block" if held is not None else "a K block that is no rank's"
            return {"status": "wrong", "message": f"after step {step} rank {rank} holds {what}; it should hold rank "
                                                  f"{prev}'s, received from the previous rank (return the buffers "
                                                  "irecv filled, after waiting for them)"}
        # the block held must be attended, not the one received (which is next step's): recognise that mistake
        # by what attending the received block, merged into the result before the step, would have given
        right = merge(out_before, lse_before, *attend_block(mine_q, *held))
        if not (_close(out, right[0]) and _close(lse, right[1])):
            arrived = merge(out_before, lse_before, *attend_block(mine_q, k_cur, v_cur))
            if _close(out, arrived[0]) and _close(lse, arrived[1]):
                return {"status": "wrong", "message": f"in step {step} rank {rank}'s result is what attending rank "
                                                      f"{prev}'s block, the one it received, gives: a step computes "
                                                      f"with the block it holds at the start (rank {owner}'s), "
                                                      "while that block travels on; the block received is attended "
                                                      "at the next step"}
    whole = q.shape[-2]
    want, lse_want = attend(q, k, v, torch.ones(whole, whole, dtype=torch.bool).tril())
    want, lse_want = _mine(want, rank, cp), lse_want.chunk(cp, dim=-1)[rank]
    if not torch.allclose(lse, lse_want, atol=1e-5):
        gap = (lse - lse_want).abs().max()
        how = (f"by up to {gap:.3g}: merge each block's lse with logaddexp" if torch.isfinite(gap) else
               "by inf: some row's lse is infinite (-inf: that row lost the keys of earlier steps); merge each "
               "block's (out, lse) into the running ones, do not replace them")
        return {"status": "wrong", "message": f"after {cp} steps rank {rank}'s lse differs from the log-sum-exp of "
                                              f"its rows' visible scores {how}"}
    if not torch.allclose(out, want, atol=1e-5):
        return {"status": "wrong", "message": f"after {cp} steps rank {rank}'s output differs from dense causal "
                                              f"attention's rows by up to {(out - want).abs().max():.3g} "
                                              "(the lse is right: check how the outputs are weighted)"}
    return {"status": "ok"}


def _close(got, want) -> bool:
    """Equal within rounding, -inf where the other is -inf (a row that sees no key yet)."""
    import torch
    return isinstance(got, torch.Tensor) and got.shape == want.shape and torch.allclose(got, want, atol=1e-5, equal_nan=True)


def grade_ring_step(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_ring_step(ring_step)", RANKS,
                          f"{RANKS} ring steps on each of {RANKS} ranks: every rank's rows equal dense causal "
                          "attention's, output and log-sum-exp, and each block went round the ring", HANG, timeout=30)


register(Exercise(
    name="ring_step", notebook="07", ranks=RANKS, title="One step of ring attention on real ranks",
    grade=grade_ring_step,
    hints=("Post the exchange first, compute while it travels: comm.isend(k, next) and comm.irecv(buffer, prev) "
           "for K and for V (4 calls; give K and V different tags), then attend and merge, then wait for the works.",
           "next = (rank + 1) % world, prev = (rank - 1) % world; the buffers are torch.empty_like(k) and "
           "torch.empty_like(v); block_out, block_lse = attend(q, k, v); merge as in the exercise above."),
    solution='''
def ring_step(q, k, v, out, lse, attend):
    rank, world = comm.get_rank(), comm.get_world_size()
    k_next, v_next = torch.empty_like(k), torch.empty_like(v)
    works = [comm.isend(k.contiguous(), (rank + 1) % world, tag=0), comm.isend(v.contiguous(), (rank + 1) % world, tag=1),
             comm.irecv(k_next, (rank - 1) % world, tag=0), comm.irecv(v_next, (rank - 1) % world, tag=1)]
    block_out, block_lse = attend(q, k, v)             # computed while the block travels on
    merged = torch.logaddexp(lse, block_lse)
    out = (out * torch.exp(lse - merged).nan_to_num(0.0)[..., None]
           + block_out * torch.exp(block_lse - merged).nan_to_num(0.0)[..., None])
    for work in works:
        work.wait()
    return out, merged, k_next, v_next
'''))


# ---------------------------------------------------------------- find the bug: a ring attention whose loss looks fine

def _toy_loss(out, head, targets, n_tokens):
    """A language model's loss in miniature: the attention output through a fixed head to 8 logits,
    cross-entropy against fixed targets, summed here and divided by every rank's tokens."""
    import torch.nn.functional as F
    logits = out @ head
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="sum") / n_tokens


def _as_shipped_loss(q, k, v, head, targets, n_tokens, cp) -> float:
    """The loss the cell gives as shipped, for every rank's rows, computed in this process: the
    check compares an attempt's loss with it, so that a partial fix says whether it moved closer."""
    import torch
    c = q.shape[-2] // cp
    same = torch.ones(c, c, dtype=torch.bool).tril()
    total = 0.0
    for rank in range(cp):
        mine = _mine(q, rank, cp)
        out, lse = torch.zeros_like(mine), torch.full(mine.shape[:-1], float("-inf"))
        for step in range(cp):
            held = (rank - step) % cp
            out, lse = merge(out, lse, *attend(mine, _mine(k, held, cp), _mine(v, held, cp), same))
        total += _toy_loss(out, head, targets.chunk(cp, dim=-1)[rank], n_tokens).item()
    return total


def _loss_line(now: float, dense: float, shipped: float) -> tuple[str, str]:
    """What the symptom says about the loss, and the word that joins the gradients' line to it:
    as shipped, the loss beside dense attention's; after a change, how far it is now against how far
    it was as shipped."""
    if abs(now - shipped) <= 1e-5:
        return f"the loss is {now:.4f} (dense attention's: {dense:.4f})", ", and"
    if abs(now - dense) <= 1e-5:
        return f"the loss is now dense attention's, {dense:.4f} (as shipped: {shipped:.4f})", ", but"
    gap, gap_shipped = abs(now - dense), abs(shipped - dense)
    moved = "closer to" if gap < gap_shipped else "further from"
    return (f"the loss is {now:.4f}, {gap:.4f} from dense attention's {dense:.4f} (as shipped: {shipped:.4f}, "
            f"{gap_shipped:.4f} from it): your change moved it {moved} dense attention's", ". Still,")


def check_causal_ring(causal_ring_attention) -> dict:
    """The attendee's ring attention against dense causal attention on this rank's rows: the loss
    (`_toy_loss`, summed over the ranks) and the gradients of q, k and v. A wrong attempt's message
    gives its loss beside dense attention's and, once it differs from the cell as shipped, beside that."""
    import torch

    from .. import comm
    rank, cp = comm.get_rank(), comm.get_world_size()
    q, k, v = _case(seed=3)
    g = torch.Generator().manual_seed(4)
    head, targets = torch.randn(q.shape[-1], 8, generator=g), torch.randint(0, 8, q.shape[:-1], generator=g)
    n_tokens = targets.numel()
    dense = [t.clone().requires_grad_() for t in (q, k, v)]
    dense_loss = _toy_loss(_dense(*dense), head, targets, n_tokens)
    dense_loss.backward()
    mine = [_mine(t, rank, cp).requires_grad_() for t in (q, k, v)]
    result = on_ranks.on_rank(causal_ring_attention, *mine)
    if result["status"] != "ok":
        return result
    out = result["value"]
    if not isinstance(out, torch.Tensor) or out.shape != mine[0].shape:
        return {"status": "wrong", "message": f"on rank {rank} the output is not a tensor of this rank's shape "
                                              f"{tuple(mine[0].shape)}"}
    loss = _toy_loss(out, head, targets.chunk(cp, dim=-1)[rank], n_tokens)
    loss.backward()
    total = loss.detach().clone()
    comm.all_reduce(total, "sum")
    errors = torch.tensor([((g.grad - _mine(d.grad, rank, cp)).norm() / _mine(d.grad, rank, cp).norm()).item()
                           for g, d in zip(mine, dense)])
    everyone = torch.zeros(cp, 3)
    comm.all_gather_into_tensor(everyone, errors[None])
    worst = everyone.max().item()
    if worst > 1e-4:
        r, which = divmod(int(everyone.argmax()), 3)
        shipped = _as_shipped_loss(q, k, v, head, targets, n_tokens, cp)
        loss_line, join = _loss_line(total.item(), dense_loss.item(), shipped)
        return {"status": "wrong", "message": f"{loss_line}{join} the gradients are not the dense ones: "
                                              f"d{'qkv'[which]} on rank {r} is {worst:.0%} off in norm (relative)"}
    return {"status": "ok"}


def grade_causal_ring(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_causal_ring(causal_ring_attention)", RANKS,
                          f"on {RANKS} ranks the loss and the gradients of q, k and v equal dense causal attention's",
                          HANG, timeout=30)


register(Exercise(
    name="causal_ring_attention", notebook="07", ranks=RANKS, bug_lab=True,
    title="Find the bug: a ring attention whose loss looks fine",
    grade=grade_causal_ring,
    hints=("The gradients are wrong, so some query saw keys it should not, or missed keys it should see. Which "
           "keys may a query see under a causal mask, and how does the cell decide which ones those are?",
           "The mask compares positions. Print `positions` and `k_positions` on rank 1 at step 1: which positions of "
           "the sequence do its queries and the block it holds have?",
           "Rank r's queries are positions r c ... r c + c - 1 of the sequence. At step t it holds the block of rank "
           "owner = (r - t) mod cp, whose keys are positions owner c ... owner c + c - 1. Compare those."),
    lesson=("The mask compared local indices, 0 ... c - 1, for the queries and for every block of keys alike, so each "
            "rank treated every block it held as its own diagonal block. On two ranks, rank 0's queries saw part of "
            "rank 1's block, keys that come after them in the sequence, and rank 1's queries saw only part of rank "
            "0's block, which lies wholly before them. A causal mask compares global positions: rank x c + i for this "
            "rank's queries, owner x c + j for the keys of the block held at a step, owner = (rank - step) mod cp.\n"
            "Why the loss looked like a loss: every query still attended to some keys and its softmax still summed "
            "to one, so each output was a weighted mean of values and the loss a plausible number; nothing in a "
            "forward pass says which keys were used. A mask that lets a query see later positions can even make "
            "training look better than it is: the model can copy the token it should predict. Only a comparison "
            "with the dense computation, outputs and gradients, catches such a bug, which is why every mechanism "
            "in this workbook is held to one."),
    cause=("local index", "local indices", "local position", "global position", "rank * c", "owner * c",
           "(rank - step)"),
    solution='''
from labsupport.lab.ring_pieces import attend, merge, pass_on


def causal_ring_attention(q, k, v):
    """Causal attention of this rank's positions (plain split) against the whole sequence, by the ring."""
    rank, cp = comm.get_rank(), comm.get_world_size()
    c = q.shape[-2]
    positions = rank * c + torch.arange(c)            # my queries' places in the whole sequence
    out, lse = torch.zeros_like(q), torch.full(q.shape[:-1], float("-inf"))
    for step in range(cp):
        owner = (rank - step) % cp                      # whose K/V block I hold now
        k_positions = owner * c + torch.arange(c)
        visible = k_positions[None, :] <= positions[:, None]   # the causal mask
        block_out, block_lse = attend(q, k, v, visible)
        out, lse = merge(out, lse, block_out, block_lse)
        if step < cp - 1:
            k, v = pass_on(k, v)
    return out
'''))


# ---------------------------------------------------------------- one process: the positions RoPE needs on a rank

# (s, rank, cp), the first the notebook's question: rank 1's two chunks there, [4 .. 7] and [16 .. 19], lie apart,
# so a contiguous window of s / cp positions fails it on its second chunk
ROPE_CASES = ((24, 1, 3), (16, 1, 2), (16, 0, 2), (32, 2, 4))


def _balanced(seq_len: int, rank: int, cp: int) -> list[int]:
    """The places in the whole sequence of the tokens rank `rank` holds under the balanced split, in its order."""
    c = seq_len // (2 * cp)
    return list(range(rank * c, (rank + 1) * c)) + list(range((2 * cp - 1 - rank) * c, (2 * cp - rank) * c))


def _as_ints(got) -> list[int] | None:
    """The attendee's answer as a list of ints (a list, tuple, range or 1-D tensor of whole numbers), or None."""
    try:
        values = got.tolist() if hasattr(got, "tolist") else list(got)
        return [int(x) for x in values] if all(float(x) == int(x) for x in values) else None
    except (TypeError, ValueError):
        return None


def _calls_the_split(source) -> bool:
    """Whether the source imports from labsupport and calls positions(...) or shard_sequence(...), the library's
    own answer (by its syntax tree, so that a comment or docstring naming "positions (...)" is no call; by the text
    where it does not parse). An attendee's own helper named positions, with no labsupport import, is theirs."""
    if "labsupport" not in (source or ""):
        return False
    try:
        tree = ast.parse(source or "")
    except SyntaxError:
        return bool(re.search(r"\bpositions\s*\(|shard_sequence\s*\(", source or ""))
    return any(isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None))
               in ("positions", "shard_sequence") for node in ast.walk(tree))


def grade_rope_positions(fn, source) -> str:
    if _calls_the_split(source):
        raise Wrong("your rope_positions calls positions(...) or shard_sequence(...), the library's own split: "
                    "write the positions from the balanced split's chunks yourself (the exercise is the positions, "
                    "not a call)")
    for s, rank, cp in ROPE_CASES:
        case = f"s = {s}, rank {rank} of cp = {cp}"
        got = _as_ints(attempt(fn, s, rank, cp))
        want = _balanced(s, rank, cp)
        c = s // (2 * cp)
        if got is None:
            raise Wrong(f"{case}: return the positions as a list of whole numbers (or a 1-D integer tensor)")
        if got == want:
            continue
        if len(got) != len(want):
            raise Wrong(f"{case}: the rank holds s / cp = {len(want)} tokens, so {len(want)} positions, one per token "
                        f"in the order it holds them; you returned {len(got)}")
        if got == list(range(len(want))) and rank != 0:
            raise Wrong(f"{case}: {got} would be the same positions on every rank; RoPE turns a token by its place in "
                        "the whole sequence, and this rank's tokens sit elsewhere in it")
        plain = list(range(rank * 2 * c, (rank + 1) * 2 * c))
        if got == plain:
            raise Wrong(f"{case}: {got} is the plain split's piece (the rank's r-th of cp contiguous pieces); the "
                        f"balanced split cuts the sequence into 2 cp = {2 * cp} chunks of {c} and gives the rank two")
        if got[:c] == want[:c]:
            raise Wrong(f"{case}: the first chunk, {got[:c]}, is right; the second is {got[c:]}, but it should be the "
                        "chunk as far from the end of the sequence as the first is from its start")
        if sorted(got) == want:
            raise Wrong(f"{case}: the right positions in another order; give them in the order the rank holds its "
                        "tokens: its front chunk, then its back chunk")
        raise Wrong(f"{case}: you returned {got}; the sequence has {2 * cp} chunks of {c} positions, and the rank holds "
                    f"two of them")
    return ("the positions of every rank's tokens under the balanced split, checked at " +
            ", ".join(f"s = {s}, cp = {cp}, rank {rank}" for s, rank, cp in ROPE_CASES))


register(Exercise(
    name="rope_positions", notebook="07", title="The positions a rank rotates by, balanced split",
    grade=grade_rope_positions,
    hints=("The balanced split cuts the s positions into 2 cp chunks of c = s / (2 cp) and gives rank r chunk r "
           "and chunk 2 cp - 1 - r, in that order. A chunk j holds positions j c ... j c + c - 1.",
           "c = seq_len // (2 * cp); return list(range(r * c, (r + 1) * c)) followed by the positions of chunk "
           "2 cp - 1 - r, built the same way."),
    lesson=("A rank's tokens keep their places in the sequence wherever they are computed: rank r of the balanced "
            "split holds chunk r and chunk 2 cp - 1 - r, and rotates their queries and keys by those places. The keys "
            "are rotated before they travel, so a block "
            "arriving from another rank already carries its tokens' angles: the ring passes K and V and nothing "
            "else."),
    solution='''
def rope_positions(seq_len, rank, cp):
    """The positions in the whole sequence of the tokens this rank holds (balanced split), in its order."""
    c = seq_len // (2 * cp)                           # 2 cp chunks of c positions
    front, back = rank, 2 * cp - 1 - rank             # one chunk from the front, one from the back
    return list(range(front * c, (front + 1) * c)) + list(range(back * c, (back + 1) * c))
'''))


ROPE_TURNED_BY = ("positions in the sequence", "rows 0 .. s/cp - 1")


def rope_blocks(q, k, theta: float) -> dict:
    """One head's queries and keys (s x head_dim, before RoPE) split over cp = 2 ranks, plain and balanced: the
    largest |score - one device's| of rank r's queries against rank o's keys, turned on their ranks as RoPE turns
    them, in the two ways of ROPE_TURNED_BY; keys (split, turned_by, r, o); and, keyed (split, r, o), whether the
    causal mask lets any of the block's queries see any of its keys. Prints the table of the first way; the
    second's lines and their reading only once causal_ring_attention is unlocked (they bear on that bug
    lab), a locked line before. Returns (errors, used)."""
    import torch

    from ..model import rotate
    from ..parallel.context import positions
    from . import exercise

    s, whole = q.shape[0], torch.arange(q.shape[0])
    one_device = rotate(q, whole, theta) @ rotate(k, whole, theta).T
    errors, used = {}, {}
    for split, balanced in (("plain", False), ("balanced", True)):
        for r in range(2):
            for o in range(2):
                q_pos, k_pos = positions(s, r, 2, balanced), positions(s, o, 2, balanced)
                used[split, r, o] = bool((k_pos[None, :] <= q_pos[:, None]).any())
                for turned_by, (q_at, k_at) in zip(ROPE_TURNED_BY, ((q_pos, k_pos),
                                                                    (torch.arange(s // 2), torch.arange(s // 2)))):
                    scores = rotate(q[q_pos], q_at, theta) @ rotate(k[k_pos], k_at, theta).T
                    errors[split, turned_by, r, o] = (scores - one_device[q_pos][:, k_pos]).abs().max().item()
    shown = ROPE_TURNED_BY if exercise.unlocked("causal_ring_attention") else ROPE_TURNED_BY[:1]
    print("largest |score - one device's|, rank r's queries against rank o's keys, cp = 2:")
    print(f"{'':>45}" + "".join(f"{f'q{r} . k{o}':>10}" for r in range(2) for o in range(2)))
    for split in ("plain", "balanced"):
        for turned_by in shown:
            print(f"{split:>8}, turned by {turned_by:<25}"
                  + "".join(f"{errors[split, turned_by, r, o]:>10.1e}" for r in range(2) for o in range(2)))
    if len(shown) == 1:
        exercise.locked("causal_ring_attention", "The rest of this table, and what it shows,")
    else:
        print(exercise.wrap(
            "The rows of a rank's tensors are numbered 0 .. s/cp - 1 on every rank. Turned by their rows, a block "
            "stays right only where both sides are shifted by the same amount, since a shift changes no m - n: with "
            "the plain split a rank's queries against its own keys; with the balanced split at cp = 2 rank 1's own "
            "block (its chunks 1 and 2 are adjacent), but not rank 0's (chunks 0 and 3). Every block that crossed "
            "the ring is wrong. (Under the causal mask the plain split's rank 0 never uses rank 1's keys; the "
            "balanced split uses every pair.) Section 13 asserts each of these."))
    return errors, used


# ---------------------------------------------------------------- on ranks: the all-to-all's dispatch

EXPERTS = (4, 8)  # 2 experts a rank, then 4: where experts per rank and ranks differ, e // ep is not the rank


def _dispatch_problem(got, choice, n_tokens: int, rank: int, ep: int, n_experts: int) -> str | None:
    """What is wrong with the attendee's (order, send_counts) on this rank, before any row is sent."""
    import torch
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"checked on rank {rank}: dispatch should return a pair (order, send_counts); it returned {got!r:.80}"
    order, send = torch.as_tensor(got[0]), [int(n) for n in got[1]]
    per_rank = n_experts // ep
    experts = f"{n_experts} experts, {per_rank} a rank: expert e lives on rank e // {per_rank}"
    if sorted(order.tolist()) != list(range(n_tokens)):
        return (f"checked on rank {rank}, {n_tokens} tokens: order should hold each token index 0 ... {n_tokens - 1} "
                f"once, in the order the rows are sent; yours is {order.tolist()}")
    if len(send) != ep or sum(send) != n_tokens:
        return (f"checked on rank {rank} with choice = {choice.tolist()} ({experts}): send_counts should hold {ep} "
                f"counts, one per rank, adding up to the {n_tokens} rows sent; yours is {send}")
    want = [int((choice // per_rank == r).sum()) for r in range(ep)]
    if send != want:
        return (f"checked on rank {rank} with choice = {choice.tolist()} ({experts}): send_counts should be {want}, "
                f"yours is {send}")
    dest = (choice[order] // per_rank).tolist()
    if dest != sorted(dest):
        return (f"checked on rank {rank}: your send_counts {send} are right, but all_to_all_single sends the first "
                "send_counts[0] rows to rank 0, the next send_counts[1] to rank 1, and so on, so the rows of "
                f"tokens[order] should go to ranks {sorted(dest)} in that order; yours go to {dest}")
    return None


def _agree(result: dict) -> dict | None:
    """The verdict of this rank once every rank has told whether its answer failed: its own failure, ok
    if another rank failed (that rank's message is the verdict), None if every rank may go on. So a rank
    whose answer is wrong never leaves the others waiting in an all-to-all."""
    import torch

    from .. import comm
    failed = torch.tensor([float(result["status"] != "ok")])
    comm.all_reduce(failed, "sum")
    if result["status"] != "ok":
        return result
    return {"status": "ok"} if failed.item() else None


def check_dispatch(dispatch) -> dict:
    """Each rank routes 12 tokens (top-1) to 4 experts, 2 per rank, then to 8 experts, 4 per rank (so
    that an answer which takes the ranks for the experts per rank is caught). With the attendee's
    (order, send_counts) the rows go out by comm.all_to_all_single; each rank's experts scale their
    rows by expert + 1 (each rank also sends the rows' expert numbers, so that a wrong rank is named);
    the rows come back by the reverse all-to-all and are added to the tokens at `order`. The ranks
    agree after each part that every rank's answer passed, so that none waits in an all-to-all."""
    import torch

    from .. import comm
    rank, ep = comm.get_rank(), comm.get_world_size()
    g = torch.Generator().manual_seed(11 + rank)
    for n_experts in EXPERTS:
        tokens = torch.randn(12, 3, generator=g)
        choice = torch.randint(0, n_experts, (12,), generator=g)
        result = on_ranks.on_rank(dispatch, choice.clone(), n_experts, ep)
        if result["status"] == "ok":
            problem = _dispatch_problem(result["value"], choice, len(tokens), rank, ep, n_experts)
            if problem is not None:
                result = {"status": "wrong", "message": problem}
        verdict = _agree(result)
        if verdict is not None:
            return verdict
        order, send = torch.as_tensor(result["value"][0]), [int(n) for n in result["value"][1]]
        per_rank = n_experts // ep
        counts = torch.tensor(send)
        recv = torch.empty_like(counts)
        comm.all_to_all_single(recv, counts)
        rows = torch.empty(int(recv.sum()), tokens.shape[1])
        comm.all_to_all_single(rows, tokens[order], recv.tolist(), send)
        experts = torch.empty(int(recv.sum()), dtype=torch.long)
        comm.all_to_all_single(experts, choice[order], recv.tolist(), send)
        own = list(range(rank * per_rank, (rank + 1) * per_rank))
        result = {"status": "ok"}
        if not all(int(e) in own for e in experts):
            result = {"status": "wrong", "message": f"checked on rank {rank} with {n_experts} experts: the rows it "
                                                    f"receives should all be for its experts {own}; they were for "
                                                    f"experts {experts.tolist()}"}
        back = torch.empty(len(tokens), tokens.shape[1])
        comm.all_to_all_single(back, rows * (experts[:, None] + 1), send, recv.tolist())
        out = torch.zeros_like(tokens).index_add(0, order, back)
        bad = [i for i in range(len(tokens)) if not torch.allclose(out[i], tokens[i] * (choice[i] + 1))]
        if bad and result["status"] == "ok":
            result = {"status": "wrong", "message": f"checked on rank {rank} with {n_experts} experts: after the "
                                                    "round trip token i should be back at place i, times its expert "
                                                    f"+ 1; tokens {bad} are not"}
        verdict = _agree(result)
        if verdict is not None:
            return verdict
    return {"status": "ok"}


def grade_dispatch(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_dispatch(dispatch)", RANKS,
                          f"checked on {RANKS} ranks, 12 tokens each, with {EXPERTS[0]} experts and with {EXPERTS[1]}: with your "
                          "order and "
                          "send_counts every token's row reached its expert's rank in one all-to-all and came back "
                          "to its own place",
                          "Every rank must make the same all-to-all calls", timeout=30)


register(Exercise(
    name="dispatch", notebook="07", ranks=RANKS, title="The dispatch of an all-to-all on real ranks",
    grade=grade_dispatch,
    hints=("all_to_all_single sends its input in consecutive blocks: the first send_counts[0] rows to rank 0, "
           "the next send_counts[1] to rank 1, and so on. So the rows must be ordered by destination rank.",
           "Expert e lives on rank e // (n_experts // ep). choice.argsort(stable=True) orders the tokens by expert "
           "(hence by rank); torch.bincount(choice // (n_experts // ep), minlength=ep) counts the rows per rank."),
    solution='''
def dispatch(choice, n_experts, ep):
    """(order, send_counts): the tokens in the order their rows are sent, and how many go to each rank."""
    order = choice.argsort(stable=True)               # by expert, so by the expert's rank
    send_counts = torch.bincount(choice // (n_experts // ep), minlength=ep).tolist()
    return order, send_counts
'''))


# Predict, then run: what `lab.reveal(guess_NAME, ..., why="NAME")` prints after the answer, kept here
# and not in the notebook's cell, which the attendee reads before predicting.
WHY = {
    "scores_share": ("Per position the layer keeps 34 s b h bytes of single-position activations and 5 a s^2 b of "
                     "s^2 terms (the softmax's output, its dropout mask and the dropout's output), so their share is "
                     "5 a s / h over 34 + 5 a s / h: 5 x 48 x 131,072 / 6144 = 5,120 against 34. Already at 2,048 "
                     "tokens they are the larger part; at 128k they are nearly all of it."),
    "plain_ratio": ("Rank 0 holds the first half of the sequence: its queries see only its own keys, one block, on "
                    "the diagonal; rank 1's block, all later, is hidden and skipped. Rank 1's queries see all of rank "
                    "0's keys (a whole block) and their own (the diagonal block): two. These are blocks as this "
                    "library counts them, the one on the diagonal as a whole one. Of the scores the mask keeps, rank 1 "
                    "computes nearly three times rank 0's (c^2 + c(c+1)/2 against c(c+1)/2), which is what a kernel "
                    "that skips the tiles above the diagonal would see. On cp ranks the plain split's rank r computes "
                    "r + 1 blocks: the last rank cp, the first one. The step time is the slowest rank's, so as cp "
                    "grows the plain split leaves nearly half of the machine idle."),
    "balanced_share": ("Two ranks cut the sequence into 2 cp = 4 chunks of s/4 positions: rank 0 holds chunks 0 and "
                       "3, rank 1 chunks 1 and 2. Of the 4 x 5 / 2 = 10 chunk pairs the mask leaves visible (those on "
                       "the diagonal counted whole), each rank computes 5 of (s/4)^2 scores: 10 s^2/16 in all. The "
                       "plain split's chunks are s/2 long: 3 pairs of (s/2)^2, 12 s^2/16. So the balanced split "
                       "computes 10/12 = 5/6 of it: its blocks on the diagonal, counted whole though the mask hides "
                       "half of each, are smaller. On cp ranks the share is (2 cp + 1) / (2 cp + 2). The answer rests "
                       "on counting a diagonal block whole: a kernel that skips the tiles above the diagonal "
                       "(FlashAttention's causal kernels) computes about the s^2/2 scores the mask keeps with either "
                       "split, so there the share is about 1, and what the balanced split gains is the balance "
                       "alone: every rank computes the same, so none waits for the last."),
    "ring_sends": ("Forward: rank 0 sends its K and V blocks once, to its neighbour (cp - 1 = 1 hop): 2 blocks. "
                   "Backward: K and V travel again, and beside them the sums of dK and dV for the block, which collect "
                   "each rank's contribution on their way back to its owner: 4 blocks. 6 blocks of "
                   "b x s/2 x h x 4 bytes = {block:,} bytes each; the receives are the same bytes the other way."),
    "llama_ring_bytes": ("Only K and V travel, and a Llama's are kv_heads x head_dim = {kv_heads} x {head_dim} = "
                         "{kv_width:,} numbers wide, not the hidden size {hidden:,}: its {heads} query heads read "
                         "{kv_heads} key/value heads. Rank 0 holds b x s/cp = {positions:,} positions, so a K block is "
                         "{positions:,} x {kv_width:,} x 2 bytes = {block:,}, and with cp = 2 it sends K and V once: "
                         "{sent:,} bytes. With multi-head attention (as many K/V heads as query heads) the same ring "
                         "would send {mha:,}, heads / kv_heads = {ratio:g} times as many; the backward's K, V and dK, "
                         "dV sums shrink by the same factor, and the number of sends does not change. A ring placed "
                         "after the K/V heads have been repeated over the query heads pays the multi-head bytes."),
    "dropped": ("At factor 1.0 an expert's capacity is its balanced share of the assignments, C = ceil(1.0 x 2 x "
                "128 / 4) = {capacity}. The router's choices do not depend on the capacity: the experts got {routed} "
                "assignments, and each drops what it got beyond {capacity}: {dropped} in all. At factor 1.25, C = "
                "{capacity_125}, and {dropped_125} are dropped. A balanced share is a mean, here a whole number, so at "
                "factor 1.0 any imbalance at all drops assignments: that is why capacities carry a factor above 1."),
}
