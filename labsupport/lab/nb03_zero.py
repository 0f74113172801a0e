"""Notebook 03's exercises: ZeRO-1's step (which shard a rank owns, the update, the all-gather),
and two find-the-bug labs (clipping a sharded gradient: the ranks scale their shards by different
factors and the run drifts from DDP's; a ZeRO-3 block that stays gathered after an evaluation
forward pass, so memory does not drop).

Every check runs on 2 real ranks and computes its reference on each rank itself: the
single-device AdamW step on the whole batch, the whole gradient's norm, the unsharded model.
"""
from __future__ import annotations

from . import on_ranks
from .exercise import Exercise, register

RANKS = 2
LR = 1e-2
MAX_NORM = 1.0
HANG = "Every rank must make the same collective calls, on tensors of the same shapes"


def _owned(numel: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, end, padded): rank's contiguous piece of a flat buffer padded to a multiple of world."""
    shard = -(-numel // world)
    return rank * shard, (rank + 1) * shard, shard * world


# ---------------------------------------------------------------- ZeRO-1's step

SHARD_CASES = ((10, 4), (8, 2), (63, 2), (3, 4))


def _check_shard_range(shard_range) -> dict | None:
    """shard_range for every rank of a few sizes; None if all are right, else the feedback."""
    for numel, world in SHARD_CASES:
        out = on_ranks.on_rank(lambda: [tuple(shard_range(numel, r, world)) for r in range(world)])
        if out["status"] != "ok":
            return out
        got, want = out["value"], [_owned(numel, r, world) for r in range(world)]
        if got == want:
            continue
        r = next(i for i in range(world) if got[i] != want[i])
        message = f"shard_range({numel}, {r}, {world}) returned {got[r]}, expected {want[r]}"
        covered = set()
        for item in got:
            if len(item) == 3:
                covered |= set(range(item[0], item[1]))
        lost = sorted(set(range(numel)) - covered)
        if lost:
            message += (f": elements {lost[0]}..{lost[-1]} of {numel} belong to no rank. Pad the buffer to a "
                        f"multiple of the world size ({want[0][2]}), so every rank owns "
                        f"ceil({numel} / {world}) = {want[0][1]} elements and all-gather can use equal pieces")
        elif sorted(got) == sorted(want):
            message += (f": that is rank {want.index(got[r])}'s piece. Rank r owns the r-th contiguous piece, "
                        "[r * shard, (r + 1) * shard)")
        elif all(g[:2] == w[:2] for g, w in zip(got, want)):
            message += f": `padded` is the buffer's length after padding, world x shard = {want[0][2]}"
        return {"status": "wrong", "message": message}
    return None


class ShardAdamW:
    """The inner optimizer ZeRO-1 wraps: an AdamW whose moments exist for this rank's shard only.

    `adamw(shard)` steps `shard` in place with `shard.grad` and keeps Adam's moments between
    calls. It also notes where in the flat buffer the shard was and which gradient it got, so
    the check can say what went wrong.
    """

    def __init__(self, flat):
        self.flat, self.calls, self.param, self.optimizer = flat, [], None, None

    def locate(self, shard) -> int | None:
        """The offset in `flat` whose values the shard holds (a view or a copy of it), or None."""
        import torch
        n = shard.numel()
        for offset in range(self.flat.numel() - n + 1):
            if torch.equal(self.flat[offset:offset + n], shard.detach()):
                return offset
        return None

    def __call__(self, shard) -> None:
        import torch
        if shard.grad is None:
            raise ValueError("adamw(shard) needs shard.grad: set it to this rank's slice of the averaged "
                             "gradients first")
        self.calls.append((self.locate(shard), shard.numel(), shard.grad.detach().clone()))
        if self.param is None or self.param.shape != shard.shape:
            self.param = torch.nn.Parameter(shard.detach().clone())
            self.optimizer = torch.optim.AdamW([self.param], lr=LR)
        with torch.no_grad():
            self.param.copy_(shard)
        self.param.grad = shard.grad.detach().clone()
        self.optimizer.step()
        with torch.no_grad():
            shard.copy_(self.param)


def _zero1_setup():
    """A small model with an odd number of elements (63: 2 ranks need padding), a copy of it for
    the single-device reference, the global batch and this rank's half of it."""
    import copy

    import torch

    from .. import comm
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3, bias=False))
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
    share = 8 // comm.get_world_size()
    lo = comm.get_rank() * share
    return model, reference, (x, y), (x[lo:lo + share], y[lo:lo + share])


def _diagnose_local(adamw, grad, numel, rank, world) -> str | None:
    """What is wrong with this rank's own update (which shard, which gradient), or None."""
    import torch
    start, end, padded = _owned(numel, rank, world)
    if not adamw.calls:
        return f"on rank {rank} adamw was never called: run the inner optimizer on this rank's shard"
    if len(adamw.calls) > 1:
        return f"on rank {rank} adamw was called {len(adamw.calls)} times: once per step, on the rank's whole shard"
    offset, n, shard_grad = adamw.calls[0]
    if offset is None:
        return (f"on rank {rank} the shard given to adamw is not a piece of flat: take flat[start:end] for this "
                "rank's (start, end)")
    if (offset, n) != (start, end - start):
        owner = offset // (end - start) if n == end - start and offset % n == 0 else None
        whose = f" (rank {owner}'s)" if owner is not None else ""
        return (f"on rank {rank} adamw updated elements [{offset}, {offset + n}){whose} of the padded buffer of "
                f"{padded}, but rank {rank} owns [{start}, {end}), as shard_range(numel, comm.get_rank(), "
                "comm.get_world_size()) says")
    if not torch.equal(shard_grad, grad[start:end]):
        return (f"on rank {rank} shard.grad is not this rank's slice of the averaged gradients: "
                f"use grad[{start}:{end}]")
    return None


def _diagnose_result(flat, want, numel, rank, world, gathers) -> str | None:
    """What is wrong with the parameters this rank holds after the step, or None."""
    start, end, _ = _owned(numel, rank, world)
    close = (flat[:numel] - want).abs() <= 1e-6 * (1 + want.abs())
    mine = slice(start, min(end, numel))
    if not bool(close[mine].all()):
        return (f"on rank {rank} its own shard [{start}, {end}) of flat was not updated: give adamw a view, "
                "flat[start:end], or all-gather the updated copy into flat")
    if not bool(close.all()):
        if gathers == 0:
            return (f"on rank {rank} the other ranks' parameters are still those before the step: each rank "
                    "updated only its own shard. All-gather the updated shards into flat "
                    "(comm.all_gather_into_tensor) so that every rank holds all of them")
        return (f"on rank {rank} all-gather was called, but the other ranks' parameters are still those before "
                "the step: gather the updated parameter shard into flat, not the gradients")
    return None


def check_zero1_step(shard_range, zero1_step) -> dict:
    import torch

    from .. import comm
    wrong = _check_shard_range(shard_range)
    if wrong:
        return wrong
    rank, world = comm.get_rank(), comm.get_world_size()
    model, reference, (x, y), (x_mine, y_mine) = _zero1_setup()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    flat = torch.zeros(_owned(numel, rank, world)[2])
    grad = torch.zeros_like(flat)
    offset = 0
    for p in params:  # the parameters become views of the padded flat buffer, as in ZeRO-1
        flat[offset:offset + p.numel()].copy_(p.data.view(-1))
        p.data = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    adamw = ShardAdamW(flat)
    loss = torch.nn.functional.mse_loss
    for step in range(3):
        loss(reference(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        want = torch.cat([p.detach().view(-1) for p in reference.parameters()])
        for p in params:
            p.grad = None
        loss(model(x_mine), y_mine).backward()  # what DDP did before the step: averaged gradients everywhere
        grad.zero_()
        grad[:numel].copy_(torch.cat([p.grad.view(-1) for p in params]))
        comm.all_reduce(grad, "avg")
        adamw.calls.clear()
        gathers = comm.counts().get("all_gather", {}).get("calls", 0)
        out = on_ranks.on_rank(zero1_step, flat, grad, numel, adamw)
        gathers = comm.counts().get("all_gather", {}).get("calls", 0) - gathers
        if out["status"] == "ok":
            local = _diagnose_local(adamw, grad, numel, rank, world)
            out = {"status": "wrong", "message": f"step {step}: {local}"} if local else out
        # A rank's own mistake explains the others' wrong parameters: report it, not theirs.
        failed = torch.tensor([float(out["status"] != "ok")])
        comm.all_reduce(failed, "max")
        if out["status"] != "ok" or failed.item():
            return out
        problem = _diagnose_result(flat, want, numel, rank, world, gathers)
        if problem:
            return {"status": "wrong", "message": f"step {step}: {problem}"}
    return {"status": "ok"}


def grade_zero1_step(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_zero1_step(shard_range, zero1_step)", RANKS,
                          f"the padded shards are right, and 3 steps on {RANKS} ranks give the single-device "
                          "AdamW's parameters on every rank", HANG, timeout=30)


register(Exercise(
    name="zero1_step", notebook="03", ranks=RANKS, title="ZeRO-1's step: own a shard, update it, all-gather",
    grade=grade_zero1_step,
    hints=("shard = ceil(numel / world), i.e. -(-numel // world); padded = shard * world; rank r owns "
           "[r * shard, (r + 1) * shard).",
           "In zero1_step: start, end, _ = shard_range(numel, comm.get_rank(), comm.get_world_size()); "
           "shard = flat[start:end] is a view, so the update lands in the parameters.",
           "shard.grad = grad[start:end]; adamw(shard); then comm.all_gather_into_tensor(flat, shard). The input "
           "may be this rank's own slice of the output: each rank's piece then lands where it already is (the "
           "in-place all-gather that NCCL documents, and gloo does the same), so no copy is needed."),
    solution='''
def shard_range(numel, rank, world):
    shard = -(-numel // world)                      # ceil: pad so that every rank owns as many
    return rank * shard, (rank + 1) * shard, shard * world


def zero1_step(flat, grad, numel, adamw):
    start, end, _ = shard_range(numel, comm.get_rank(), comm.get_world_size())
    shard = flat[start:end]                         # a view: updating it updates the parameters
    shard.grad = grad[start:end]                    # this rank's slice of the averaged gradients
    adamw(shard)                                    # Adam's moments exist for this slice only
    comm.all_gather_into_tensor(flat, shard)        # in place: everyone receives every updated shard
'''))


# ---------------------------------------------------------------- find the bug: clipping a shard by its own norm

def check_clip_sharded(clip_sharded_) -> dict:
    """The averaged gradient has a quiet half and a loud half, so the shards' norms differ a lot."""
    import torch

    from .. import comm
    rank, world = comm.get_rank(), comm.get_world_size()
    gen = torch.Generator().manual_seed(2)
    whole = torch.cat([0.05 * torch.randn(500, generator=gen), torch.randn(500, generator=gen)])
    start, end, _ = _owned(whole.numel(), rank, world)
    shard = whole[start:end].clone()
    out = on_ranks.on_rank(clip_sharded_, shard, MAX_NORM)
    if out["status"] != "ok":
        return out
    norm = whole.double().norm().item()
    scale = min(1.0, MAX_NORM / (norm + 1e-6))
    applied = torch.tensor([(shard.double().norm() / whole[start:end].double().norm()).item()])
    scales = torch.zeros(world, dtype=applied.dtype)
    comm.all_gather_into_tensor(scales, applied)
    returned = out["value"]
    returned = float(returned) if returned is not None else float("nan")
    if not torch.allclose(shard, whole[start:end] * scale, rtol=1e-5, atol=1e-8):
        each = [f"{s:.3g}x on rank {r}" for r, s in enumerate(scales.tolist())]
        listed = ", ".join(each[:-1]) + f" and {each[-1]}"
        return {"status": "wrong", "message": f"the ranks changed their shards' norms by {listed}; "
                                              f"clipping the whole gradient (norm {norm:.3g}) to {MAX_NORM:g} "
                                              f"scales every element by {scale:.3g}. Rank {rank} returned the "
                                              f"norm {returned:.3g}"}
    if abs(returned - norm) > 1e-4 * norm:
        return {"status": "wrong", "message": f"the shards are scaled right, but rank {rank} returned the norm "
                                              f"{returned:.4g}; the whole gradient's is {norm:.4g}"}
    return {"status": "ok"}


def grade_clip_sharded(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_clip_sharded(clip_sharded_)", RANKS,
                          "every rank scales its shard by the whole gradient's norm, and returns that norm",
                          HANG, timeout=30)


register(Exercise(
    name="clip_sharded_", notebook="03", ranks=RANKS, title="Find the bug: clipping a sharded gradient",
    grade=grade_clip_sharded, bug_lab=True,
    cause=("norm of whatever", "shard's norm", "its own norm", "squared gradient norm", "single number",
           "local norm", "sum of the shards' squared", "8 bytes", "8-byte"),
    hints=("Look at the norm: compare the one rank 0 returns with the whole gradient's, which the message prints.",
           "Each rank measures only its shard, so each clips by a factor of its own: the update no longer points "
           "along the gradient, and its norm is not max_norm.",
           "The whole gradient's squared norm is the sum of the shards' squared norms: all-reduce the sum of "
           "squares (comm.all_reduce(total, 'sum')), then take the root. Every rank then uses the same scale."),
    lesson=("Each rank measured the norm of its own shard only and clipped by a factor of its own. Nothing crashes and "
            "the loss still goes down, so this bug survives for a long time: the update no longer points along the "
            "gradient (each shard is scaled by its own factor), and the clipped gradient's norm is not `max_norm`: "
            "each rank brings its shard down to norm 1, so here the whole clipped gradient has norm sqrt(2). With a "
            "large `max_norm` nothing is clipped and the bug cannot show, which is why the colleague's port passed. "
            "The fix costs one all-reduce of a single number: the whole gradient's squared norm is the sum of the "
            "shards' squared norms. That is the 8-byte all-reduce (one float64) that the traffic table of section 6 "
            "lists for zero1, zero2 and zero3, and what `clip_grad_norm_` in labsupport/parallel/clip.py does with "
            "its `groups` argument."),
    solution='''
def clip_sharded_(shard, max_norm):
    total = shard.double().pow(2).sum()          # this shard's share of the squared norm
    comm.all_reduce(total, "sum")                # + the other shards': the whole gradient's
    norm = total.sqrt().item()
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        shard.mul_(scale)
    return norm
'''))


# ---------------------------------------------------------------- find the bug: ZeRO-3 that keeps the gathered block

def check_shard_block(shard_block) -> dict:
    """A nano TinyGPT whose blocks are ZeRO-3 units (the root stays whole): the output must be the
    unsharded model's, and after a forward pass, training or evaluation, no block may stay gathered."""
    import copy

    import torch

    from .. import comm
    from ..model import TinyGPT, get_preset
    from ..parallel.fsdp import ShardedUnit
    torch.manual_seed(0)
    model = TinyGPT(get_preset("nano").with_vocab(57))
    whole = copy.deepcopy(model)
    units = [ShardedUnit(list(block.parameters()), name=f"blocks.{i}") for i, block in model.blocks.items()]
    shard_bytes = sum(u.shard.nbytes for u in units)
    for block, unit in zip(model.blocks.values(), units):
        out = on_ranks.on_rank(shard_block, block, unit)
        if out["status"] != "ok":
            return out
    x = torch.randint(0, 57, (2, 16), generator=torch.Generator().manual_seed(1))
    rank = comm.get_rank()
    for mode, context in (("training", torch.enable_grad), ("evaluation", torch.no_grad)):
        with context():
            out = on_ranks.on_rank(model, x)
            if out["status"] != "ok":
                return out
            want = whole(x)
        if not torch.allclose(out["value"], want, atol=1e-5):
            return {"status": "wrong", "message": f"in {mode} rank {rank}'s logits differ from the unsharded "
                                                  "model's: gather each block before its forward"}
        kept = [u for u in units if u.gathered]
        if kept:
            full = sum(u.full.nbytes for u in kept)
            return {"status": "wrong", "message": f"after a forward pass in {mode}, {len(kept)} of {len(units)} "
                                                  f"blocks are still gathered on rank {rank}: {full:,} bytes of full "
                                                  f"parameters beside its {shard_bytes:,}-byte shard. The memory "
                                                  "ZeRO-3 promises does not drop"}
    return {"status": "ok"}


def grade_shard_block(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_shard_block(shard_block)", RANKS,
                          "the logits are the unsharded model's, and every block is freed after its forward, "
                          "in training and in evaluation", HANG, timeout=30)


register(Exercise(
    name="shard_block", notebook="03", ranks=RANKS, title="Find the bug: a ZeRO-3 block that stays gathered",
    grade=grade_shard_block, bug_lab=True,
    cause=("no_grad", "requires_grad", "out of the if", "which line"),
    hints=("Compare what after_forward does in the two passes the check runs, the training one and the "
           "evaluation one.",
           "Evaluation runs under torch.no_grad(): no output requires grad, so everything under "
           "`if output.requires_grad:` is skipped, unit.free() included.",
           "Only the re-gather for backward belongs under the if (backward needs the parameters again only in "
           "training); free the block after every forward: move unit.free() out of the if."),
    lesson=("Evaluation runs under torch.no_grad(): no output requires grad, so everything under "
            "`if output.requires_grad:` was skipped, unit.free() with it, and every block stayed gathered after its "
            "forward. After one evaluation pass a rank holds all the units' full parameters at once, the memory "
            "ZeRO-3's sharding was to remove, and the next evaluation of a large model runs out of it. The training "
            "pass could not show the bug, since there every output requires grad. Only the re-gather for backward "
            "belongs under the if (backward needs the parameters again only in training); the free belongs after "
            "every forward."),
    solution='''
def shard_block(block, unit):
    def before_forward(module, args):
        unit.gather()                              # all-gather the block's full parameters

    def after_forward(module, args, output):
        if output.requires_grad:                   # training: backward will need them again
            output.register_hook(lambda grad: unit.gather())
        unit.free()                                # in training and in evaluation

    block.register_forward_pre_hook(before_forward)
    block.register_forward_hook(after_forward)
'''))


# Predict, then run: what `lab.reveal(guess_NAME, ..., why="NAME")` prints after the answer, kept here
# and not in the notebook's cell, which the attendee reads before predicting.
WHY = {
    "optimizer": ("Adam's two fp32 moments, 8 bytes per parameter, for the 408,960 elements this rank owns: half of "
                  "DDP's 6.5 MB. The extra hundred bytes are Adam's step counters, one 4-byte tensor per parameter "
                  "piece."),
    "gathers": ("ZeRO-3 gathers each unit's parameters twice per step, before its forward and again before its "
                "backward, and the micro model has 5 units: its 4 blocks and the root (the embeddings and the final "
                "LayerNorm). Section 8 looks inside."),
    "ds_more": ("DeepSpeed's ZeRO-1 keeps the full parameters, as ours does, but its optimizer updates an fp32 copy of "
                "this rank's partition of them (DeepSpeed keeps that master copy of mixed precision even when it "
                "trains in fp32), so its optimizer states are {ratio:.2f} times ours: the moments' 8Ψ/N plus the "
                "copy's 4Ψ/N. Of gradients it holds fewer, not more: none between steps, where the loop measures "
                "(the grads column of the table below reads 0, for its ZeRO-3 too)."),
    "pcie_s": ("2 bytes per parameter each way, 30 GB in all, at 31.5 GB/s. ✔ means the transfer takes no longer "
               "than the step's compute, so it can hide behind it."),
}
