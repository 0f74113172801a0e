"""Notebook 04's exercises: one linear layer split by columns and by rows (in one process), a
find-the-bug lab (a row-parallel layer whose output differs from the dense layer's: a
tensor-parallel model drifts from the dense one after step 0, faster at T = 4 than at T = 2), the
Megatron MLP's forward on real ranks and the backward of the conjugate operators f and g.

The row-parallel exercise is kept to what it teaches, so that nothing before the bug lab answers
the lab.

The one-process checks compare with `torch.nn.functional.linear` on the whole matrix. The checks
on ranks build the dense layer on every rank from the same seed, hand each rank its slices, and
compare with the dense result there (the bug lab and the backward exercise compare the gradients
too: a layer can be right in its output and wrong in what it learns); they also count the
collectives (labsupport.comm), since a right value bought with a needless all-reduce is a lesson too.
"""
from __future__ import annotations

import re
import warnings

from . import on_ranks
from .exercise import EXERCISES, Exercise, Unsolved, Wrong, attempt, register

RANKS = 2
HANG = "Every rank must make the same collective calls, on tensors of the same shapes"
CASES = ((4, 6, 8, 2), (3, 8, 12, 4), (2, 5, 6, 3))   # (tokens, in features, out features, T)


def _linear_case(tokens, d_in, d_out, seed):
    import torch
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, d_in, generator=gen)
    w = torch.randn(d_out, d_in, generator=gen)
    b = torch.randn(d_out, generator=gen)
    return x, w, b


def _shape(t) -> str:
    return "(" + ", ".join(str(d) for d in t.shape) + ")"


def _try(name, fn, advice, **args):
    """The attendee's function on one case; an exception becomes feedback naming the shapes. `advice` is a
    string, or a function of the exception that returns one."""
    try:
        return attempt(fn, *args.values())
    except (Wrong, Unsolved):
        raise
    except Exception as e:
        shown = ", ".join(f"{k} {_shape(v)}" if hasattr(v, "shape") else str(v) for k, v in args.items())
        raise Wrong(f"{name}({shown}) raised {type(e).__name__}: {e}. "
                    f"{advice(e) if callable(advice) else advice}") from None


def _multiplied(error) -> list[tuple[int, int]]:
    """The two shapes a failed matrix product names ("mat1 and mat2 shapes cannot be multiplied (4x3 and 8x3)")."""
    m = re.search(r"\((\d+)x(\d+) and (\d+)x(\d+)\)", str(error))
    return [(int(m[1]), int(m[2])), (int(m[3]), int(m[4]))] if m else []


# ---------------------------------------------------------------- one process: split by columns

def grade_column_parallel(fn, source) -> str:
    import torch
    import torch.nn.functional as F
    for seed, (tokens, d_in, d_out, world) in enumerate(CASES):
        x, w, b = _linear_case(tokens, d_in, d_out, seed)
        want = F.linear(x, w, b)
        got = _try("column_parallel_forward", fn,
                   "A torch Linear's weight is (out, in): A's columns are weight's rows, so cut weight along dim 0",
                   x=x, weight=w, bias=b, world=world)
        if not isinstance(got, (list, tuple)) or len(got) != world:
            raise Wrong(f"column_parallel_forward(x, weight, bias, {world}) should return a list of {world} outputs, "
                        f"one per rank; it returned {type(got).__name__}"
                        + (f" of length {len(got)}" if isinstance(got, (list, tuple)) else ""))
        wanted = want.chunk(world, dim=-1)
        for i, (y, y_want) in enumerate(zip(got, wanted)):
            if not isinstance(y, torch.Tensor):
                raise Wrong(f"rank {i}'s output is a {type(y).__name__}, not a tensor")
            if y.shape != y_want.shape:
                hint = ""
                if y.shape == want.shape:
                    hint = (": that is the whole output. Rank i computes only its own out/T columns of Y, from "
                            "its own rows of weight")
                else:
                    hint = (". A torch Linear's weight is (out, in): the columns of A = weight.T are the rows of "
                            "weight, so cut weight along dim 0")
                raise Wrong(f"with x {_shape(x)}, weight {_shape(w)} and T = {world}, rank {i}'s output has shape "
                            f"{_shape(y)}, expected {_shape(y_want)}{hint}")
            if not torch.allclose(y, y_want, atol=1e-5):
                no_bias = F.linear(x, w, None).chunk(world, dim=-1)[i]
                if torch.allclose(y, no_bias, atol=1e-5):
                    raise Wrong(f"rank {i}'s output lacks the bias: each rank adds its own slice of the bias, "
                                "bias.chunk(T)[i]")
                if torch.allclose(y, no_bias + b[:y.shape[-1]], atol=1e-5) and i > 0:
                    raise Wrong(f"rank {i} added the first slice of the bias; it needs its own, bias.chunk(T)[{i}]")
                raise Wrong(f"with T = {world}, rank {i}'s output differs from columns "
                            f"{i * y_want.shape[-1]}..{(i + 1) * y_want.shape[-1] - 1} of F.linear(x, weight, bias) "
                            f"by up to {(y - y_want).abs().max().item():.3g}")
    return (f"{len(CASES)} layers split over T = 2, 4 and 3 ranks: each rank's columns equal the dense layer's, "
            "and no rank needed another's data")


register(Exercise(
    name="column_parallel_forward", notebook="04", title="A linear layer split by columns, in one process",
    grade=grade_column_parallel,
    hints=("torch stores a Linear's weight as (out, in): Y = x @ weight.T + bias. The columns of Y come from the "
           "rows of weight.",
           "weight.chunk(world, dim=0)[i] and bias.chunk(world)[i] are rank i's pieces; "
           "torch.nn.functional.linear(x, w_i, b_i) is its output."),
    solution='''
import torch


def column_parallel_forward(x, weight, bias, world):
    w_parts = weight.chunk(world, dim=0)           # A's columns are weight's rows
    b_parts = bias.chunk(world)
    return [torch.nn.functional.linear(x, w_parts[i], b_parts[i]) for i in range(world)]
'''))


# ---------------------------------------------------------------- one process: split by rows

def grade_row_parallel(fn, source) -> str:
    import torch
    import torch.nn.functional as F
    for seed, (tokens, d_in, d_out, world) in enumerate(CASES):
        if d_in % world:
            d_in = world * (d_in // world + 1)
        x, w, _ = _linear_case(tokens, d_in, d_out, 10 + seed)
        want = F.linear(x, w)
        partial_want = [F.linear(xi, wi) for xi, wi in zip(x.chunk(world, dim=-1), w.chunk(world, dim=1))]
        k = d_in // world

        def advice(error, tokens=tokens, d_out=d_out, k=k):
            if _multiplied(error) in ([(tokens, k), (d_out, k)], [(d_out, k), (tokens, k)]):
                # the slices are right; the product meets them along the wrong dimensions
                return (f"Your slices have the right shapes, x_i ({tokens}, {k}) and weight_i ({d_out}, {k}), and rank "
                        f"i's partial output should be ({tokens}, {d_out}), tokens by out features. For that the "
                        f"product adds over the {k} inputs, dim 1 of x_i and dim 1 of weight_i (torch stores a "
                        f"Linear's weight as (out, in)); yours pairs dimensions of different sizes")
            return ("Rank i's inputs are a slice of x's last dimension; the weight's matching piece is the same "
                    "slice of its dim 1 (a torch Linear's weight is (out, in))")
        got = _try("row_parallel_forward", fn, advice, x=x, weight=w, world=world)
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], (list, tuple))):
            raise Wrong("row_parallel_forward should return (partials, y): the list of the ranks' partial outputs "
                        "and their sum")
        partials, y = got
        if len(partials) != world:
            raise Wrong(f"with T = {world} there are {world} partial outputs, one per rank; got {len(partials)}")
        for i, (p, p_want) in enumerate(zip(partials, partial_want)):
            if p.shape != p_want.shape:
                hint = ""
                if p.shape == p_want.shape[::-1] and torch.allclose(p.T, p_want, atol=1e-5):
                    hint = (": it holds the right numbers, transposed (out features by tokens); like F.linear's, a "
                            "partial output keeps the tokens first")
                elif p.shape[-1] != d_out:
                    hint = (": a row-parallel rank produces all out features, as a partial sum. Cut weight along "
                            "dim 1 (its inputs) and x along its last dimension, the same way")
                raise Wrong(f"rank {i}'s partial output has shape {_shape(p)}, expected {_shape(p_want)}{hint}")
            if not torch.allclose(p, p_want, atol=1e-5):
                raise Wrong(f"with T = {world}, rank {i}'s partial output differs from x_i @ weight_i.T (its "
                            f"inputs {i * (d_in // world)}..{(i + 1) * (d_in // world) - 1}) by up to "
                            f"{(p - p_want).abs().max().item():.3g}")
        if not torch.allclose(y, want, atol=1e-4):
            raise Wrong(f"with T = {world}, y differs from x @ weight.T by up to "
                        f"{(y - want).abs().max().item():.3g}: it is the sum of all the partials")
    return (f"{len(CASES)} layers split over T = 2, 4 and 3 ranks: every partial output has the full width, and "
            "their sum is the dense layer")


register(Exercise(
    name="row_parallel_forward", notebook="04", title="A linear layer split by rows, in one process",
    grade=grade_row_parallel,
    hints=("Rank i holds inputs [i in/T, (i+1) in/T): its slice of x's last dimension and the same slice of "
           "weight's dim 1.",
           "Each rank's x_i @ weight_i.T is a partial sum of full width; y is the sum of them (in a real run, "
           "the all-reduce)."),
    solution='''
import torch


def row_parallel_forward(x, weight, world):
    x_parts = x.chunk(world, dim=-1)               # rank i's inputs ...
    w_parts = weight.chunk(world, dim=1)           # ... and the weight's matching columns (A's rows)
    partials = [torch.nn.functional.linear(x_parts[i], w_parts[i]) for i in range(world)]
    return partials, sum(partials)                 # the sum is what the all-reduce computes
'''))


# ---------------------------------------------------------------- find the bug: the bias before the all-reduce

def _as_shipped(x, w, b, world):
    """What the cell as shipped returns on every rank: each rank's F.linear(x_shard, w_shard, bias), summed by
    the all-reduce. A changed cell's output is compared with it, so that a partial fix says what it moved."""
    import torch.nn.functional as F
    return sum(F.linear(xi, wi, b) for xi, wi in zip(x.chunk(world, -1), w.chunk(world, 1)))


def _output_line(y, want, shipped, where: str, changed: bool) -> str:
    """How the output differs from the dense layer's: its size; after a change, also against the cell as shipped
    (unmoved, a multiple of the shipped difference, or another difference)."""
    import torch
    diff, diff_shipped = y - want, shipped - want

    def size(d):
        return f"{d.abs().mean().item():.3g} on average, up to {d.abs().max().item():.3g}"
    if not changed:
        return f"{where} the output differs from the dense layer's by {size(diff)}"
    if torch.allclose(y, shipped, atol=1e-4):
        return (f"{where} the output is still the one the cell as shipped gives: it differs from the dense layer's "
                f"by {size(diff)}")
    c = ((diff * diff_shipped).sum() / (diff_shipped * diff_shipped).sum()).item()
    if torch.allclose(diff, c * diff_shipped, atol=1e-4):
        if abs(c + 1) < 1e-3:
            return (f"the output moved: {where} its difference from the dense layer's is now the negative of the "
                    f"shipped cell's, the same size ({size(diff)}) with the opposite sign")
        return (f"the output moved: {where} its difference from the dense layer's is now {c:.2f} times the shipped "
                f"cell's ({size(diff)}; as shipped: {size(diff_shipped)})")
    return (f"the output moved: {where} it now differs from the dense layer's by {size(diff)} (as shipped: "
            f"{size(diff_shipped)})")


def check_row_parallel_linear(row_parallel_linear, changed=False) -> dict:
    """The attendee's layer on this rank's slices against the dense layer: the output, then the gradients of
    x_shard, w_shard and the bias under a loss that weighs every output differently (a bias added T times, or
    divided by T before the sum, or on one rank only, shows in one or the other). The all-reduce is not
    differentiable to autograd, which passes the gradient through it unchanged: Megatron's g does the same."""
    import torch
    import torch.nn.functional as F

    from .. import comm
    rank, world = comm.get_rank(), comm.get_world_size()
    gen = torch.Generator().manual_seed(7)
    x, w, b = torch.randn(5, 8, generator=gen), torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen) + 2
    mine = [x.chunk(world, -1)[rank].clone().requires_grad_(), w.chunk(world, 1)[rank].clone().requires_grad_(),
            b.clone().requires_grad_()]
    out = on_ranks.on_rank(row_parallel_linear, *mine)
    if out["status"] != "ok":
        return out
    y, want = out["value"], F.linear(x, w, b)
    where = f"on rank {rank} of {world}"
    if not isinstance(y, torch.Tensor) or y.shape != want.shape:
        return {"status": "wrong", "message": f"on rank {rank} the output is not a {_shape(want)} tensor"}
    if not torch.allclose(y.detach(), want, atol=1e-4):
        return {"status": "wrong",
                "message": _output_line(y.detach(), want, _as_shipped(x, w, b, world), where, changed)}
    if not y.requires_grad:
        return {"status": "wrong", "message": f"the output equals the dense layer's, but {where} it carries no "
                                              "gradient back to x_shard, w_shard or the bias (no requires_grad)"}
    target = torch.linspace(-1, 1, y.numel()).view_as(y)
    with warnings.catch_warnings():  # torch warns that c10d's all-reduce has no backward; the identity is meant
        warnings.filterwarnings("ignore", message=r"c10d::allreduce_")
        back = on_ranks.on_rank(lambda: (y * target).sum().backward())
    if back["status"] != "ok":
        return back
    dense = [t.clone().requires_grad_() for t in (x, w, b)]
    (F.linear(*dense) * target).sum().backward()
    wanted = (("x_shard", dense[0].grad.chunk(world, -1)[rank]), ("w_shard", dense[1].grad.chunk(world, 1)[rank]),
              ("the bias", dense[2].grad))
    for (name, grad_want), t in zip(wanted, mine):
        if t.grad is None:
            return {"status": "wrong", "message": f"the output equals the dense layer's, but {where} {name} gets no "
                                                  "gradient"}
        if not torch.allclose(t.grad, grad_want, atol=1e-4):
            ratio = (t.grad.norm() / grad_want.norm()).item()
            whose = "the dense layer's" if name == "the bias" else "the dense layer's (its slice)"
            return {"status": "wrong", "message": f"the output equals the dense layer's, but {where} the gradient of "
                                                  f"{name} is {ratio:.2f}x {whose} in norm"}
    return {"status": "ok"}


def grade_row_parallel_linear(fn, source) -> str:
    shipped = EXERCISES["row_parallel_linear"].shipped   # set by exercise.grade before it calls this
    changed = shipped is not None and source != shipped
    return on_ranks.grade(source, __name__, f"check_row_parallel_linear(row_parallel_linear, changed={changed})",
                          RANKS, "on both ranks the output and the gradients of x_shard, w_shard and the bias equal "
                          "the dense layer's: the bias counts once, in the output and in its gradient", HANG,
                          timeout=30)


register(Exercise(
    name="row_parallel_linear", notebook="04", ranks=RANKS, bug_lab=True,
    title="Find the bug: a tensor-parallel layer that drifts from the dense one",
    grade=grade_row_parallel_linear,
    hints=("Look at how the output differs from the dense layer's, row by row (the symptom prints its size): "
           "does the difference depend on the input, or is it the same for every row? Which of the layer's "
           "tensors is the same for every row?",
           "The difference is (T - 1) x bias. Every rank's F.linear(x_shard, w_shard, bias) puts the bias into its "
           "partial sum, and the all-reduce adds up T partial sums.",
           "Multiply without the bias, all-reduce, then add the bias once, after the sum."),
    cause=("T times", "(T - 1)", "before the all-reduce", "after the all-reduce", "after the sum", "bias once",
           "bias (once)", "added once", "bias is added"),
    lesson=("Why it drifted: F.linear(x_shard, w_shard, bias) puts the whole bias into every rank's partial sum, "
            "and the all-reduce adds T partial sums, so the output carries the bias T times: (T - 1) x bias too "
            "much, the same in every row whatever the input. A row-parallel layer multiplies without its bias, "
            "all-reduces, and adds the bias once, after the sum; Megatron's RowParallelLinear adds it after "
            "reduce_from_tensor_model_parallel_region (or hands it back unadded, skip_bias_add, for a fused kernel "
            "to add). Two other fixes give the right output and are still wrong, which is why the check compares the "
            "gradients too: dividing the bias by T inside every rank's F.linear gives each rank's bias a gradient T "
            "times too small (with SGD the bias would learn T times slower; Adam, which divides a gradient by its "
            "own size, hides most of that, as notebook 01 showed); adding it on one rank only trains like the dense "
            "layer, but leaves the other T - 1 copies without a gradient, stale, while Megatron keeps every copy of "
            "a replicated parameter identical (a checkpoint or anything else reading another rank's copy gets the "
            "initial bias). A "
            "column-parallel layer's bias is another matter: each rank's output columns are its own, so "
            "its slice of the bias goes with them, as in the first exercise.\n"
            "Why step 0 agreed: TinyGPT, like GPT-2, starts its biases at zero, and T x 0 = 0. The error grows as the "
            "biases learn, and with T, which is why the strategy's equivalence tests start from random biases."),
    solution='''
def row_parallel_linear(x_shard, w_shard, bias):
    y = torch.nn.functional.linear(x_shard, w_shard)   # my partial sum, without the bias
    comm.all_reduce(y, "sum")                          # g
    return y + bias                                    # once, after the sum
'''))


# ---------------------------------------------------------------- on ranks: the Megatron MLP's forward

def _mlp_case(hidden=8, tokens=6):
    """The same dense MLP and input on every rank (seeded), and this rank's slices of it."""
    import torch

    from .. import comm
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=gen)
    w1, b1 = torch.randn(4 * hidden, hidden, generator=gen), torch.randn(4 * hidden, generator=gen)
    w2, b2 = torch.randn(hidden, 4 * hidden, generator=gen) / 4, torch.randn(hidden, generator=gen)
    world, rank = comm.get_world_size(), comm.get_rank()
    mine = dict(w1=w1.chunk(world, 0)[rank].clone(), b1=b1.chunk(world)[rank].clone(),
                w2=w2.chunk(world, 1)[rank].clone(), b2=b2.clone())
    return x, (w1, b1, w2, b2), mine


def _dense_mlp(x, w1, b1, w2, b2, bias=True):
    import torch.nn.functional as F
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2 if bias else None)


def check_tp_mlp(tp_mlp_forward) -> dict:
    import torch

    from .. import comm
    x, dense, mine = _mlp_case()
    rank, world = comm.get_rank(), comm.get_world_size()
    before = comm.counts()
    out = on_ranks.on_rank(tp_mlp_forward, x.clone(), mine["w1"], mine["b1"], mine["w2"], mine["b2"])
    after = comm.counts()
    calls = {op: after.get(op, {}).get("calls", 0) - before.get(op, {}).get("calls", 0) for op in after}
    calls = {op: n for op, n in calls.items() if n}
    if out["status"] != "ok":
        return out
    y, want = out["value"], _dense_mlp(x, *dense)
    if not isinstance(y, torch.Tensor) or y.shape != want.shape:
        got = _shape(y) if isinstance(y, torch.Tensor) else type(y).__name__
        return {"status": "wrong", "message": f"on rank {rank} the MLP's output is {got}, expected the full "
                                              f"{_shape(want)} on every rank (the all-reduce gives every rank all of it)"}
    if not torch.allclose(y, want, atol=1e-4):
        b2 = dense[3]
        if torch.allclose(y, want + (world - 1) * b2, atol=1e-4):
            why = (f"it holds the second bias {world} times: every rank added it before the all-reduce. Add it "
                   "after, once")
        elif torch.allclose(y, want - b2, atol=1e-4):
            why = "the second bias is missing: add it once, after the all-reduce"
        elif torch.allclose(y, (want - b2) / world + b2, atol=1e-4) or torch.allclose(y, want / world, atol=1e-4):
            why = "it is the average of the partial sums, not their sum: all-reduce with 'sum'"
        elif not calls.get("all_reduce"):
            why = "it is this rank's partial sum only: all-reduce the row-parallel outputs (comm.all_reduce)"
        else:
            why = f"it differs by up to {(y - want).abs().max().item():.3g}"
        return {"status": "wrong", "message": f"on rank {rank} the MLP's output is not the dense MLP's: {why}"}
    if calls != {"all_reduce": 1}:
        listed = ", ".join(f"{op} x{n}" for op, n in calls.items()) or "none"
        return {"status": "wrong", "message": f"the output is right, but rank {rank} made these collectives: "
                                              f"{listed}. Megatron's MLP needs one all-reduce: the column-parallel "
                                              "half and GELU work on this rank's hidden units alone"}
    return {"status": "ok"}


def grade_tp_mlp(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_tp_mlp(tp_mlp_forward)", RANKS,
                          f"on {RANKS} ranks every rank holds the dense MLP's output, after exactly one all-reduce",
                          HANG, timeout=30)


register(Exercise(
    name="tp_mlp_forward", notebook="04", ranks=RANKS, title="Megatron's MLP forward on real ranks",
    grade=grade_tp_mlp,
    hints=("fc is column-parallel: h = gelu(F.linear(x, w1, b1)) is this rank's 4h/T hidden units, no "
           "communication needed. proj is row-parallel: F.linear(h, w2) is a partial sum of the full output.",
           "comm.all_reduce(partial, 'sum') adds the ranks' partial sums in place; then add b2, once."),
    solution='''
def tp_mlp_forward(x, w1, b1, w2, b2):
    h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w1, b1))   # my 4h/T units: no communication
    y = torch.nn.functional.linear(h, w2)           # my partial sum of the full output
    comm.all_reduce(y, "sum")                       # g: every rank now holds the sum
    return y + b2                                   # the bias once, after the sum
'''))


# ---------------------------------------------------------------- on ranks: the backward of f and g

def _times(ratios) -> str:
    """The ranks' ratios to the dense gradient as a sentence: "1.13x the dense one on rank 0 and 2.10x on rank 1",
    or "2.00x the dense one on both ranks" where they agree to the digits shown."""
    shown = [f"{r:.2f}x" for r in ratios]
    if len(set(shown)) == 1:
        return f"{shown[0]} the dense one on {'both ranks' if len(shown) == 2 else 'every rank'}"
    parts = [f"{shown[0]} the dense one on rank 0"] + [f"{r} on rank {i}" for i, r in enumerate(shown[1:], 1)]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def check_conjugate_backward(conjugate_backward) -> dict:
    """Y = g(gelu(f(x) W1_i^T) W2_i^T) with the attendee's backward of f and of g: x's and the weights'
    gradients must be the dense model's (each rank its slice), with one all-reduce in backward."""
    import torch

    from .. import comm

    class F_(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return conjugate_backward("f", grad.clone())

    class G_(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            comm.all_reduce(x, "sum")
            return x

        @staticmethod
        def backward(ctx, grad):
            return conjugate_backward("g", grad.clone())

    rank, world = comm.get_rank(), comm.get_world_size()
    x0, dense, mine = _mlp_case()
    weights = [torch.nn.Parameter(t) for t in (mine["w1"], mine["b1"], mine["w2"], mine["b2"])]
    x = x0.clone().requires_grad_()
    w1, b1, w2, b2 = weights
    y = G_.apply(torch.nn.functional.linear(torch.nn.functional.gelu(torch.nn.functional.linear(F_.apply(x), w1, b1)),
                                            w2)) + b2
    target = torch.linspace(-1, 1, y.numel()).view_as(y)
    before = comm.counts().get("all_reduce", {}).get("calls", 0)
    out = on_ranks.on_rank(lambda: (y * target).sum().backward())
    extra = comm.counts().get("all_reduce", {}).get("calls", 0) - before
    if out["status"] != "ok":
        return out
    # the dense reference, and the slices this rank must hold
    xd = x0.clone().requires_grad_()
    wd = [torch.nn.Parameter(t.clone()) for t in dense]
    (_dense_mlp(xd, *wd) * target).sum().backward()
    ratio = (x.grad.norm() / xd.grad.norm()).item()
    theirs = torch.tensor([ratio])
    ratios = torch.zeros(world)
    comm.all_gather_into_tensor(ratios, theirs)
    want_w1 = wd[0].grad.chunk(world, 0)[rank]
    w_ratio = (w1.grad.norm() / want_w1.norm()).item()
    if not torch.allclose(x.grad, xd.grad, atol=1e-4):
        if abs(w_ratio - world) < 1e-3:
            why = (f", and the weights' gradients are {world}x the dense ones: g's backward summed a gradient that "
                   "every rank already holds whole")
        elif abs(w_ratio - 1 / world) < 1e-3:
            why = (", and the weights' gradients are 1/T of the dense ones: g's backward shrank a gradient that "
                   "every rank already holds whole")
        elif not torch.allclose(w1.grad, want_w1, atol=1e-4):
            why = f", and the weights' gradients are {w_ratio:.2f}x the dense ones"
        elif extra == 0:
            why = (": each rank holds only its own units' contribution to x's gradient, and your backward made no "
                   "all-reduce")
        else:
            why = (". The weights' gradients are right, so the trouble is in f's backward: it must return the sum "
                   "over the ranks of their contributions to x's gradient")
        return {"status": "wrong", "message": f"the forward is right, but x's gradient is {_times(ratios.tolist())} "
                                              f"(in norm){why}"}
    for name, p, want in (("W1", w1, want_w1), ("W2", w2, wd[2].grad.chunk(world, 1)[rank]), ("b2", b2, wd[3].grad)):
        if not torch.allclose(p.grad, want, atol=1e-4):
            return {"status": "wrong", "message": f"x's gradient is right, but on rank {rank} {name}'s gradient is "
                                                  f"{(p.grad.norm() / want.norm()).item():.2f}x the dense one's "
                                                  "(its slice) in norm"}
    if extra != 1:
        return {"status": "wrong", "message": f"the gradients are right, but backward made {extra} all-reduces on "
                                              f"rank {rank}; one is enough: f's (g's output gradient is already the "
                                              "same on every rank, so reducing it again is wasted traffic)"}
    return {"status": "ok"}


def grade_conjugate_backward(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_conjugate_backward(conjugate_backward)", RANKS,
                          "x's and every weight's gradient equal the dense MLP's on both ranks, with one all-reduce "
                          "in backward (f's)", HANG, timeout=30)


register(Exercise(
    name="conjugate_backward", notebook="04", ranks=RANKS, title="The backward of the conjugate operators f and g",
    grade=grade_conjugate_backward,
    hints=("g's forward turned partial sums into the same full output on every rank. What does each rank's "
           "output gradient look like, then: partial, or already whole?",
           "f's forward handed the same x to every rank, and each rank used it for its own units: x's gradient is "
           "the sum of the ranks' contributions. So f's backward all-reduces, g's does nothing."),
    lesson=("The two operators, forward and backward:\n"
            + "".join(f"  {op:<38}{forward:<38}{backward}\n" for op, forward, backward in (
                ("", "forward", "backward"),
                ("f, where the parallel region starts", "identity: every rank takes all of X", "all-reduce"),
                ("g, where it ends", "all-reduce: adds the partial sums", "identity")))
            + "They are conjugate: each one's backward is the other's forward. In the forward pass f hands the same X "
            "to every rank, and each rank uses it for its own hidden units; the gradient with respect to X is the sum "
            "of what every rank's units contribute, so it is added across the ranks. After g every rank holds the "
            "same whole output, so the gradient arriving at g is already the same whole gradient everywhere, and "
            "each rank passes it on to its partial sum. A second all-reduce there would add T equal copies: the "
            "weights' gradients would come out T times too large, with the loss, computed in the forward pass, "
            "exactly right."),
    solution='''
def conjugate_backward(op, grad):
    if op == "f":                       # f gave x to every rank, and each used it for its own units:
        comm.all_reduce(grad, "sum")    # x's gradient is the sum of their contributions
    return grad                         # g's output gradient is already whole, the same on every rank
'''))


def qkv_rows_per_rank(cfg, tp: int, rank: int = 0) -> int:
    """Rows of one layer's fused W_qkv that `rank` of `tp` tensor-parallel ranks holds, for the shape `cfg`:
    the model's own CausalSelfAttention built on the meta device (shapes only, no memory), its weight cut
    into `tp` contiguous blocks of rows as ColumnParallelLinear cuts it (parallel/tensor.py's `_shard`).
    Here, not in the notebook's reveal cell, whose source the attendee sees under the prediction."""
    import torch

    from ..model import CausalSelfAttention
    with torch.device("meta"):
        attn = CausalSelfAttention(cfg)
    return attn.qkv.weight.chunk(tp, dim=0)[rank].shape[0]


# Predict, then run: what `lab.reveal(guess_NAME, ..., why="NAME")` prints after the answer, kept here
# and not in the notebook's cell, which the attendee reads before predicting.
WHY = {
    "backward_op": ("f's forward copied X to every rank, so X's gradient is the sum of the ranks' contributions: an "
                    "all-reduce. g's forward made the output whole on every rank, so its gradient is already whole: "
                    "the identity."),
    "allreduces": ("The layers: 4 x (2 forward + 2 backward) = 16. The embedding, cut by vocabulary rows, adds the "
                   "ranks' rows (its g): 1. The LM head, column-parallel over the vocabulary, adds its input's "
                   "gradient in backward (its f): 1. The vocab-parallel loss: 2 (section 6 says which). The global "
                   "gradient norm, for clipping: 1."),
    "sp_wire": ("Each of the layers' all-reduces of b x s x h, and the LM head's f, became a reduce-scatter plus an "
                "all-gather of the same buffer: the same 2 (T-1)/T per byte. The embedding's did not: it still "
                "all-reduces its rows, then keeps its s/T positions (one of the five all-reduces in tp + SP's counts "
                "below; the loss's two, the gradient norm's and the one last in this list are the others). On top: in "
                "backward, each column-parallel layer (q/k/v, the MLP's first, the LM head) all-gathers its input "
                "again, half an all-reduce each, "
                "which buys storing s/T positions; the all-gather of the positions the embedding scattered; and one "
                "all-reduce per step of the LayerNorm and bias gradients (each rank saw only its positions, so each "
                "holds a partial sum)."),
    "gqa_qkv_rows": ("Each rank takes whole query groups: 8 key/value heads over 8 ranks is one group per rank, its 8 "
                     "query heads (64 / 8) with their one key head and one value head, 10 heads of 8192 / 64 = 128 "
                     "features each: 10 x 128 = 1,280 rows, an eighth of the matrix's 10,240. The key/value heads are "
                     "split like the query heads, not copied: a rank that kept all 8 of them beside its 8 query heads "
                     "would hold (8 + 2 x 8) x 128 = 3,072 rows, as many as a rank of the multi-head model (3 x 8192 "
                     "/ 8). Any cut of the rows into 8 equal blocks has this count; the order of the rows decides what "
                     "a block holds. Megatron-LM's order, group by group (below), makes it one whole group; in the "
                     "order all queries, then all keys, then all values, rank 0's block would be query heads 0 to 9 "
                     "and no key at all."),
    "cross_node": ("The bytes per rank hardly change (2 (T-1)/T goes from 1.75 to 1.875 times the message), the "
                   "bandwidth per GCD drops from 50 to the bound's 12.5 GB/s, and the ring's latency term grows (30 "
                   "steps instead of 14, each at the assumed 10 us instead of 5). The factor is an estimate: its "
                   "bandwidth term, priced at the bound, overstates what crossing costs, and its latency term rests "
                   "on assumed latencies. Meanwhile each rank's compute halves: the ratio of communication to "
                   "compute gets more than eight times worse. Recomputation changes neither factor: it adds its half "
                   "to the traffic and its third to the compute at every T alike."),
}
