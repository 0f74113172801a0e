"""Notebook 02's exercises: the bucketed DDP hook and bucket launch, and two find-the-bug labs
(a DDP hook from one version of picotron whose synchronized gradients differ from one device's;
a gradient sync whose losses agree with one device's while its gradients do not).

Every check runs on 2 real ranks. Each rank computes the single-device reference itself (the
whole global batch on its own copy of the model), so "equal to one device" is checked on every
rank, on the gradients, before any optimizer step.
"""
from __future__ import annotations

from . import on_ranks
from .exercise import Exercise, register

RANKS = 2
GLOBAL_BATCH = 8
HANG = "Every rank must make the same collective calls, on tensors of the same shapes"


def _setup():
    """The same model on every rank, the global batch, and this rank's half of it."""
    import torch

    from .. import comm
    from ..model import TinyGPT, get_preset
    torch.manual_seed(0)
    model = TinyGPT(get_preset("nano").with_vocab(57))
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 57, (GLOBAL_BATCH, 16), generator=gen)
    y = torch.roll(x, -1, dims=1)
    share = GLOBAL_BATCH // comm.get_world_size()
    lo = comm.get_rank() * share
    return model, (x, y), (x[lo:lo + share], y[lo:lo + share])


def _single_device_grads(model, batch) -> dict:
    import copy

    from ..model import lm_loss
    reference = copy.deepcopy(model)
    lm_loss(reference(batch[0]), batch[1]).backward()
    return {name: p.grad.clone() for name, p in reference.named_parameters()}


def _compare_grads(model, want: dict, rank: int, advise: bool = True) -> dict:
    """The first gradient that differs from one device's, with what it looks like (and, for an
    exercise, what to do; a find-the-bug lab shows the symptom only)."""
    for name, p in model.named_parameters():
        if p.grad is None:
            return {"status": "wrong", "message": f"on rank {rank} {name} has no gradient after synchronization"}
        if not bool((p.grad - want[name]).abs().max() <= 1e-5 * (1 + want[name].abs().max())):
            ratio = (p.grad.norm() / want[name].norm()).item()
            why = ""
            if abs(ratio - RANKS) < 1e-3 and advise:  # a bug lab shows the symptom, not its cause
                why = f": {RANKS}x, the sum over the ranks; average them (op='avg')"
            elif bool((p.grad - p.detach()).abs().max() < 1e-6):
                why = ": it equals the weights" + (
                    ". The hook receives the parameter, not its gradient: read param.grad" if advise else "")
            return {"status": "wrong", "message": f"on rank {rank} the synchronized gradient of {name} is "
                                                  f"{ratio:.3g}x the single-device one in norm{why}"}
    return {"status": "ok"}


# ---------------------------------------------------------------- the bucketed hook

def check_bucketed_hook(on_grad_ready, finish_bucket) -> dict:
    from .. import comm
    from ..model import lm_loss
    from ..parallel.ddp import Bucket
    model, whole, (x, y) = _setup()
    want = _single_device_grads(model, whole)
    params = list(reversed(list(model.parameters())))  # backward produces gradients roughly in reverse
    buckets = [Bucket(params[i:i + 4], index, group=None) for index, i in enumerate(range(0, len(params), 4))]
    handles = [p.register_post_accumulate_grad_hook(lambda p, b=b: on_grad_ready(p, b))
               for b in buckets for p in b.params]
    rank = comm.get_rank()
    try:
        out = on_ranks.on_rank(lambda: lm_loss(model(x), y).backward())
        if out["status"] != "ok":
            return out
        waiting = [b.index for b in buckets if b.work is None]
        if waiting:
            return {"status": "wrong", "message": f"after backward bucket {waiting[0]} (of {len(buckets)}) was never "
                                                  f"launched on rank {rank}: launch a bucket's all-reduce from the hook "
                                                  "as soon as it is full, so it overlaps the rest of backward"}
        for b in buckets:
            out = on_ranks.on_rank(finish_bucket, b)
            if out["status"] != "ok":
                return out
        return _compare_grads(model, want, rank)
    finally:
        for h in handles:
            h.remove()


def grade_bucketed_hook(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_bucketed_hook(on_grad_ready, finish_bucket)", RANKS,
                          "gradients equal to one device's on both ranks, every bucket launched during backward",
                          "Every rank must launch the same buckets in the same order, and wait for each before "
                          "reading its buffer", timeout=30)


register(Exercise(
    name="on_grad_ready", notebook="02", ranks=RANKS, title="The bucketed DDP hook and the bucket launch",
    grade=grade_bucketed_hook,
    hints=("The hook gets the parameter: its gradient is param.grad. Mark it ready with bucket.ready.add(id(param)).",
           "When len(bucket.ready) == len(bucket.params) the bucket is full: copy each p.grad into its slice of "
           "bucket.buffer, then bucket.work = comm.all_reduce(bucket.buffer, 'avg', async_op=True).",
           "finish_bucket: bucket.work.wait(), then copy each slice back into p.grad and clear bucket.ready."),
    solution='''
def on_grad_ready(param, bucket):
    bucket.ready.add(id(param))
    if len(bucket.ready) == len(bucket.params):           # the bucket is full: send it now
        offset = 0
        for p in bucket.params:
            bucket.buffer[offset:offset + p.numel()].copy_(p.grad.view(-1))
            offset += p.numel()
        bucket.work = comm.all_reduce(bucket.buffer, "avg", async_op=True)


def finish_bucket(bucket):
    bucket.work.wait()                                    # the average has arrived
    offset = 0
    for p in bucket.params:
        p.grad.view(-1).copy_(bucket.buffer[offset:offset + p.numel()])
        offset += p.numel()
    bucket.ready.clear()
'''))


# ---------------------------------------------------------------- bug lab: the hook that averages the parameter

def check_naive_ddp(register_hooks) -> dict:
    from .. import comm
    from ..model import lm_loss
    model, whole, (x, y) = _setup()
    want = _single_device_grads(model, whole)
    out = on_ranks.on_rank(register_hooks, model)
    if out["status"] != "ok":
        return out
    lm_loss(model(x), y).backward()
    return _compare_grads(model, want, comm.get_rank(), advise=False)


def grade_naive_ddp(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_naive_ddp(register_hooks)", RANKS,
                          "each gradient is averaged over the ranks as soon as it is complete", HANG, timeout=30)


register(Exercise(
    name="register_hooks", notebook="02", ranks=RANKS, title="Find the bug: a naive DDP hook (from a real code base)",
    grade=grade_naive_ddp, bug_lab=True,
    cause=("receives the parameter", "called with the parameter", "called with the *parameter*",
           "hook with the parameter", "the parameter itself", "not its gradient", "averages the weights",
           "all-reducing the parameter", "gradients stay local"),
    hints=("Print what the hook receives: its type, its shape, whether it has a .grad.",
           "register_post_accumulate_grad_hook calls the hook with the parameter, after its .grad is complete. "
           "All-reducing the parameter averages the weights, which are equal already; the gradients stay local."),
    lesson=("`register_post_accumulate_grad_hook` calls its hook with the parameter itself, once its .grad is "
            "complete (a tensor hook, `p.register_hook`, gets the gradient instead). All-reducing the parameter "
            "averages the weights, which every rank holds alike already, so nothing changes there, and the "
            "gradients stay local: each rank steps with the gradient of its own half of the batch, and the "
            "replicas drift apart from the first step on. The fix is one word: all-reduce `param.grad`. Nothing "
            "crashed because every rank still made the same all-reduces on tensors of the same shapes; only a "
            "comparison of the gradients with one device's shows the bug."),
    solution='''
def register_hooks(model):
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda param: comm.all_reduce(param.grad, "avg"))
'''))


# ---------------------------------------------------------------- bug lab: summed, not averaged

def check_sync_gradients(sync_gradients) -> dict:
    from .. import comm
    from ..model import lm_loss
    model, whole, (x, y) = _setup()
    want = _single_device_grads(model, whole)
    lm_loss(model(x), y).backward()
    out = on_ranks.on_rank(sync_gradients, model)
    if out["status"] != "ok":
        return out
    return _compare_grads(model, want, comm.get_rank(), advise=False)


def grade_sync_gradients(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_sync_gradients(sync_gradients)", RANKS,
                          "the synchronized gradients equal one device's: the losses and the gradient norms agree",
                          HANG, timeout=30)


register(Exercise(
    name="sync_gradients", notebook="02", ranks=RANKS, title="Find the bug: losses agree, gradients don't",
    grade=grade_sync_gradients, bug_lab=True,
    cause=("summed", "sum over the ranks", "sum of the ranks", "instead of averag", "rather than averag",
           "not their sum", "mean of those means", "mean of the ranks' means", '"sum"', "op='avg'"),
    hints=("Compare the gradient norms in the table above, not only the losses.",
           "Each rank's gradient is the mean over its share of the batch; the whole batch's gradient is the "
           "mean of those means, not their sum."),
    lesson=("Each rank's gradient is the mean over its own share of the batch, and the whole batch's gradient is "
            "the mean of those means (section 1): the all-reduce must average (op \"avg\", or \"sum\" followed by a "
            "division by the world size). Summed over N ranks the gradients are N times too large, here 2x. "
            "AdamW's update divides the first moment by the root of the second, so a constant factor on every "
            "gradient leaves the steps, and the losses, almost as they were (only Adam's epsilon does not "
            "scale): that is why the colleague's comparison of losses passed. Gradient clipping at a fixed norm, "
            "SGD, a learning rate tuned on this code, or the same run on 8 ranks (8x) would show it; a check of "
            "the gradients, as the runs of this notebook do, shows it at once."),
    solution='''
def sync_gradients(model):
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, "avg")
'''))


# Predict, then run: what `lab.reveal(guess_NAME, ..., why="NAME")` prints after the answer, kept here
# and not in the notebook's cell, which the attendee reads before predicting.
WHY = {
    "calls": "One per parameter tensor: every weight, bias and LayerNorm vector is its own message.",
    "bytes": ("4 bytes (fp32) for each of the {held:,} parameters the model holds (its {counted:,} and the rows that pad "
              "its vocabulary to a multiple of 64), in every mode: the modes differ in how many messages carry them "
              "and when, not in how much they carry."),
    "hidden": ("The buckets start during backward, so part of their time can lie under it; the last bucket (the first "
               "layers' gradients) cannot. But read the line above it: hidden is not the same as free."),
    "speedup": ("Ideally 2x: twice the cores. Data parallelism does use the second core; what it loses is the "
                "all-reduces, the waiting for the slower rank, and the cores shared with gloo's threads (and, on a "
                "busy machine, with every other program)."),
}
