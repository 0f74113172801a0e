"""Notebook 06's exercises: choose a 3D layout for the workshop's three hands-on models, with their
scripts' global batches on other node counts, from the rules (graded by the planner: it must fit,
and run within 1.2x of the planner's best step time), and a find-the-bug lab (a rank order with
tensor-parallel groups straddling nodes).

Both grade against `labsupport.estimate`: `planner.evaluate` and `planner.plan` for the layout,
`widgets.rank_grid.layout`'s notion of a group crossing nodes (node k holds ranks k G .. k G + G - 1)
for the rank order. Nothing here needs ranks: a layout of a thousand GPUs is graded by the model.
"""
from __future__ import annotations

from contextlib import contextmanager

from ..estimate.memory import RECOMPUTE
from ..estimate.workshop import HANDS_ON, PLANNER_PRECISION
from .exercise import Exercise, Unsolved, Wrong, attempt, locked, register, unlocked

# (model preset, Frontier GCDs, global batch): each hands-on script's --global-batch-size on a node count
# the notebook prints no layout for (22B on 6 nodes, 175B on 32, 1T on 256; the scripts run 2, 16 and 128),
# so the scripts' layouts printed above it are no answer: their TP x PP does not split 48 GCDs into
# replicas that divide 640 sequences, and the 175B one runs 1.24x the best on 256 GCDs.
NODE_COUNTS = {"22b": 6, "175b": 32, "1t": 256}
LAYOUT_CASES = tuple((model, NODE_COUNTS[model] * 8, s.global_batch) for model, s in HANDS_ON.items())
WITHIN = 1.2              # slower than the planner's best by at most this factor
KEYS = ("dp", "tp", "pp", "micro_batch", "zero")
SOLVERS = ("plan", "search", "evaluate", "layouts")   # the planner's: an answer must not call them


def _frontier():
    from ..estimate.planner import MACHINE_NAMES
    return MACHINE_NAMES["frontier"]


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


PARTS = ("compute", "tp_comm", "pp_comm", "dp_comm", "bubble")
PART_NAMES = dict(compute="compute", tp_comm="TP", pp_comm="PP", dp_comm="DP", bubble="bubble")


def _parts(c) -> str:
    """Where a layout's step goes, in seconds: what to compare with the best one."""
    return ", ".join(f"{PART_NAMES[p]} {getattr(c, p + '_s'):.3g}" for p in PARTS)


_RECOMPUTE_WORDS = dict(none="no recomputation", selective="selective recomputation", full="full recomputation")


def _difference(mine, best) -> str:
    """The parts of the step where an answer loses (or wins) time against the planner's best."""
    deltas = sorted(((getattr(mine, p + "_s") - getattr(best, p + "_s"), p) for p in PARTS), reverse=True)
    shown = [f"{PART_NAMES[p]} {d:+.3g} s" + (f" ({_RECOMPUTE_WORDS[mine.recompute]} against {_RECOMPUTE_WORDS[best.recompute]})"
                                              if p == "compute" and mine.recompute != best.recompute else "")
             for d, p in deltas if abs(d) >= 0.01 * best.step_time_s]
    return ", ".join(shown) if shown else "no part more than 1% of the step apart"


@contextmanager
def _without_planner(fn):
    """While `fn` runs, the planner's solvers refuse: the answer must come from the rules. They are
    swapped in the planner module and wherever `fn`'s globals name them (a notebook imports them)."""
    from ..estimate import planner

    def refuse(name):
        def refused(*args, **kwargs):
            raise Wrong(f"choose_layout called the planner's `{name}`: the exercise is to choose as the planner "
                        "would, from the rules (estimate_memory, the bubble (p - 1)/m, the cost of TP's and DP's "
                        "collectives), and let the check compare with the planner")
        return refused

    originals = {name: getattr(planner, name) for name in SOLVERS}
    space = getattr(fn, "__globals__", {})
    aliases = {k: v for k, v in space.items() if any(v is o for o in originals.values())}
    by_id = {id(o): name for name, o in originals.items()}
    try:
        for name in SOLVERS:
            setattr(planner, name, refuse(name))
        for k, v in aliases.items():
            space[k] = refuse(by_id[id(v)])
        yield
    finally:
        for name, o in originals.items():
            setattr(planner, name, o)
        space.update(aliases)


def _layout(got, call: str) -> dict:
    if not isinstance(got, dict):
        raise Wrong(f"{call} should return a dict with keys {', '.join(KEYS)} (and optionally recompute), "
                    f"it returned {type(got).__name__}")
    missing = [k for k in KEYS if k not in got]
    extra = sorted(set(got) - set(KEYS) - {"recompute"})
    if missing or extra:
        raise Wrong(f"{call} returned keys {sorted(got)}: " + (f"{', '.join(missing)} missing" if missing else
                                                              f"{', '.join(extra)} unknown"))
    return got


def graded_config(cfg, gpus: int, global_batch: int, layout: dict):
    """The planner's verdict on an attendee's layout: its Config, with the fastest recomputation
    that fits when the layout does not name one (or the leanest, when none fits)."""
    from ..estimate.planner import evaluate
    machine = _frontier()
    fixed = {k: layout[k] for k in KEYS}
    choices = [layout["recompute"]] if layout.get("recompute") is not None else list(RECOMPUTE)
    configs = [evaluate(cfg, machine, gpus, global_batch, **fixed, recompute=r, precision=PLANNER_PRECISION)
               for r in choices]
    fitting = [c for c in configs if c.fits]
    if fitting:
        return min(fitting, key=lambda c: c.step_time_s)
    return min(configs, key=lambda c: c.memory_per_gpu)


def _shrink_advice(c) -> str:
    """What would shrink a layout that does not fit: only what the layout does not use yet."""
    advice = ["a smaller micro-batch"] if c.micro_batch > 1 else []
    if c.dp > 1:
        advice.append("more model parallelism (tp x pp)")
    if c.dp > 1 and c.zero == 0:
        advice.append("ZeRO-1 over the DP ranks")
    if c.recompute != "full":
        advice.append("heavier activation recomputation")
    if not advice:
        return "Nothing in the layout shrinks it further on these GPUs"
    text = ", ".join(advice[:-1]) + (" or " if len(advice) > 1 else "") + advice[-1] + " would shrink it"
    return text[0].upper() + text[1:]


def grade_choose_layout(fn, source) -> str:
    from ..estimate.memory import estimate_memory
    from ..estimate.planner import describe, plan, usable_bytes
    from ..model import get_preset
    machine = _frontier()
    verdicts = []
    for model, gpus, batch in LAYOUT_CASES:
        call = f"choose_layout({model!r}, {gpus}, {batch})"
        try:
            with _without_planner(fn):
                got = attempt(fn, model, gpus, batch)
        except (Wrong, Unsolved):
            raise
        except Exception as e:
            raise Wrong(f"{call} raised {type(e).__name__}: {e}") from None
        layout = _layout(got, call)
        cfg = get_preset(model)
        try:
            mine = graded_config(cfg, gpus, batch, layout)
        except ValueError as e:
            raise Wrong(f"{call}: {e}") from None
        where = f"{model} on {gpus} Frontier GCDs (global batch {batch})"
        if not mine.fits:
            m = estimate_memory(cfg, micro_batch=mine.micro_batch, precision=PLANNER_PRECISION, dp=mine.dp,
                                tp=mine.tp, pp=mine.pp, zero=mine.zero, recompute=mine.recompute)
            states = m["params"] + m["grads"] + m["optimizer"]
            raise Wrong(f"{where}: {describe(mine)} needs {_gb(mine.memory_per_gpu)} per GCD (model states "
                        f"{_gb(states)}, activations {_gb(m['activations'])}), more than the "
                        f"{_gb(usable_bytes(machine))} usable of 64 GB. {_shrink_advice(mine)}")
        best = plan(cfg, machine, gpus, batch, precision=PLANNER_PRECISION)[0]
        ratio = mine.step_time_s / best.step_time_s
        if ratio > WITHIN:
            raise Wrong(f"{where}: {describe(mine)} fits but takes {mine.step_time_s:.3g} s a step, {ratio:.2f}x the "
                        f"planner's best ({describe(best)}, {best.step_time_s:.3g} s). Yours against the best: "
                        f"{_difference(mine, best)}. Where the time goes, yours: {_parts(mine)}; the best: "
                        f"{_parts(best)}")
        same = describe(mine) == describe(best)
        verdicts.append(f"{model} {ratio:.2f}x" + (" (the planner's best itself)" if same else
                                                   f" (the best: {describe(best)}; yours against it: "
                                                   f"{_difference(mine, best)})"))
    return (f"every layout fits and runs within {WITHIN}x of the planner's best step time on Frontier: "
            + "; ".join(verdicts))


register(Exercise(
    name="choose_layout", notebook="06",
    title="Choose the 3D layouts of the workshop's hands-on models on other node counts",
    grade=grade_choose_layout,
    hints=("Start from memory: `estimate_memory(get_preset(model), dp=..., tp=..., pp=..., zero=1, "
           "recompute=...)['total']` must stay under 90% of a GCD's 64 GB. tp must divide the heads, pp the "
           "layers, and dp = gpus / (tp x pp) the global batch.",
           "Among the layouts that fit, the rules weigh three costs against the compute: the bubble, (p - 1)/m "
           "of it with m = global batch / dp micro-batches of 1; TP's 4 all-reduces of b s h 16-bit values per "
           "layer and micro-batch (6 with full recomputation, whose extra forward also costs a third more "
           "compute), on the node's 50 GB/s if tp <= 8; DP's sync of the 2-byte gradients of a tp x pp share, "
           "once a step over the network. `all_reduce_ring(nbytes, p, alpha, beta)` from "
           "labsupport.estimate.comm_cost prices a collective.",
           "Put the costs into one estimate of the step in seconds (compute: 24 s h^2 FLOPs per layer and "
           "sequence forward, x3 with backward, at about 64% of a GCD's 191.5 TFLOP/s, section 5's 0.77 x 0.835; "
           "the last stage also runs the LM head, 2 s h V FLOPs forward, x3, about two thirds of a 22B layer: it "
           "weighs most with a layer or two a stage) and take the fastest layout that fits, with ZeRO-1 whenever dp > 1."),
    solution='''
from labsupport.estimate.comm_cost import all_reduce_ring
from labsupport.estimate.memory import estimate_memory
from labsupport.estimate.params import count_params
from labsupport.model import get_preset

USABLE = 0.9 * 64e9                 # bytes of a GCD's 64 GB a run can count on
SPEED = 0.64 * 191.5e12             # FLOP/s a GCD's matmuls reach in a step: 0.77 x 0.835 of its bf16 peak
NODE, NETWORK = 50e9, 12.5e9        # bytes/s per GCD: Infinity Fabric, and a bound for Slingshot


def step_estimate(cfg, dp, tp, pp, m, recompute):
    """Seconds per step: the last stage's compute, its layers and the LM head (4/3 of the layers' with full
    recomputation), TP's all-reduces (4 per layer and micro-batch, 6 with full recomputation), both
    stretched by the bubble (p - 1)/m, and DP's once-a-step gradient sync over the network."""
    layers = m * cfg.n_layers // pp                                # layer passes per GCD per step
    layer_flops = 24 * cfg.seq_len * cfg.hidden ** 2 * (4 if recompute == "full" else 3)
    head_flops = 6 * cfg.seq_len * cfg.hidden * cfg.vocab          # forward and backward, on the last stage
    compute = (layers * layer_flops + m * head_flops) / tp / SPEED
    activation = 2 * cfg.seq_len * cfg.hidden                        # b s h 16-bit values, b = 1
    tp_s = layers * (6 if recompute == "full" else 4) * all_reduce_ring(activation, tp, 5e-6, 1 / NODE)
    dp_s = all_reduce_ring(2 * count_params(cfg) / (tp * pp), dp, 10e-6, 1 / NETWORK)
    return (compute + tp_s) * (1 + (pp - 1) / m) + dp_s


def choose_layout(model, gpus, global_batch):
    """TP inside a node, micro-batch 1, ZeRO-1 over the data-parallel copies; for each split the
    lightest recomputation that fits; of those, the fastest by the estimate."""
    cfg = get_preset(model)
    best = None
    for tp in (1, 2, 4, 8):
        for pp in range(1, cfg.n_layers + 1):
            if cfg.heads % tp or cfg.n_layers % pp or gpus % (tp * pp) or global_batch % (gpus // (tp * pp)):
                continue
            dp = gpus // (tp * pp)
            zero = 1 if dp > 1 else 0
            for recompute in ("none", "selective", "full"):
                if estimate_memory(cfg, dp=dp, tp=tp, pp=pp, zero=zero, recompute=recompute)["total"] <= USABLE:
                    seconds = step_estimate(cfg, dp, tp, pp, global_batch // dp, recompute)
                    if best is None or seconds < best[0]:
                        best = (seconds, dict(dp=dp, tp=tp, pp=pp, micro_batch=1, zero=zero, recompute=recompute))
                    break
    return best[1]
'''))


DIRECTIONS = ("above", "below")   # the answers section 5's Llama 3 prediction offers


def direction(ratios) -> str:
    """"above" when every predicted / measured ratio is above 1, "below" when every one is below, else "both"."""
    ratios = list(ratios)
    return DIRECTIONS[0] if all(r > 1 for r in ratios) else DIRECTIONS[1] if all(r < 1 for r in ratios) else "both"


# ---------------------------------------------------------------- find the bug: tensor parallelism over the network

# (dp, pp, tp, devices per node): grids whose TP groups fit in a node.
PLACE_CASES = ((2, 2, 2, 4), (2, 2, 2, 8), (4, 2, 2, 8), (2, 4, 4, 8), (3, 2, 2, 4))


def _places(fn, dp, pp, tp) -> list[tuple[int, int, int]]:
    """coords[rank] = (d, p, t): the attendee's mapping, inverted, checked to be a numbering of the ranks."""
    world = dp * pp * tp
    coords: dict[int, tuple] = {}
    for d in range(dp):
        for p in range(pp):
            for t in range(tp):
                call = f"place_rank({d}, {p}, {t}, dp={dp}, pp={pp}, tp={tp})"
                try:
                    rank = attempt(fn, d, p, t, dp, pp, tp)
                except (Wrong, Unsolved):
                    raise
                except Exception as e:
                    raise Wrong(f"{call} raised {type(e).__name__}: {e}") from None
                if not isinstance(rank, int) or not 0 <= rank < world:
                    raise Wrong(f"{call} returned {rank!r}: a rank is a whole number from 0 to {world - 1}")
                if rank in coords:
                    raise Wrong(f"{call} returned {rank}, which (d, p, t) = {coords[rank]} has already: every rank "
                                "holds exactly one coordinate")
                coords[rank] = (d, p, t)
    return [coords[r] for r in range(world)]


def grade_place_rank(fn, source) -> str:
    for dp, pp, tp, g in PLACE_CASES:
        coords = _places(fn, dp, pp, tp)
        groups: dict[tuple, list[int]] = {}
        for rank, (d, p, t) in enumerate(coords):
            groups.setdefault((d, p), []).append(rank)
        for (d, p), ranks in sorted(groups.items()):
            nodes = sorted({r // g for r in ranks})
            if len(nodes) > 1:
                raise Wrong(f"with dp {dp} x pp {pp} x tp {tp} on nodes of {g} GPUs, the TP group of (d, p) = "
                            f"({d}, {p}) is ranks {', '.join(map(str, ranks))}, on nodes "
                            f"{', '.join(map(str, nodes))}: its all-reduces, four per layer and micro-batch, "
                            "cross the network")
    return (f"on each of the {len(PLACE_CASES)} grids every TP group sits on one node: its all-reduces stay on the "
            "node's links")


# The order the shipped `place_rank`, (t * pp + p) * dp + d, numbers the grid in, fastest coordinate first: what
# the notebook's widget re-places the run's counters by (tests/test_lab.py holds it to the notebook's cell).
SHIPPED_ORDER = ("dp", "pp", "tp")

register(Exercise(
    name="place_rank", notebook="06", bug_lab=True,
    title="Find the bug: a rank placement that sends tensor parallelism over the network",
    grade=grade_place_rank,
    cause=("varies fastest", "varying fastest", "vary fastest", "TP fastest", "DP fastest", "data parallelism fastest",
           "tensor parallelism fastest", "neighbouring ranks", "innermost", "(d * pp + p) * tp + t",
           r"(d \cdot pp + p) \cdot tp + t"),
    lesson=("Why it matters: torchrun and Slurm number a job's ranks node by node, so with G GPUs per node, node k "
            "holds ranks k G to k G + G - 1, and which ranks share a node is decided by the placement formula alone. "
            "The colleague's formula, (t * pp + p) * dp + d, makes d the coordinate that changes from one rank to the "
            "next: neighbouring ranks are different data-parallel copies, and the tp members of a TP group sit dp x pp "
            "ranks apart, on different nodes as soon as dp x pp reaches G. Mesh numbers the grid the other way round, "
            "t varying fastest, then the pipeline stage, d slowest: rank = (d * pp + p) * tp + t. A TP group is then tp "
            "neighbouring ranks, on one node whenever tp divides G, and its four all-reduces per layer and micro-batch "
            "stay on NVLink or Infinity Fabric; a pipeline's stages are tp ranks apart and its sends cross nodes once "
            "its pp x tp ranks outgrow a node; the DP groups, farthest apart, talk once per step. Megatron-LM's "
            "default order, tp then dp then pp, is right too: TP still varies fastest, the DP sync comes closer and "
            "the pipeline's sends go farther. Nothing fails with the wrong order, the losses are the same; every step "
            "is only slower, which is why a rank-grid picture and per-group traffic counters are worth a look before "
            "a large run."),
    hints=("A job's ranks fill its nodes in order: node k holds ranks k G to k G + G - 1. Which coordinate should "
           "change between rank r and rank r + 1?",
           "The coordinate that varies fastest is the one multiplied by nothing: here it is d. Make it t, so the "
           "tp ranks of a TP group are consecutive: rank = (d * pp + p) * tp + t."),
    solution='''
def place_rank(d, p, t, dp, pp, tp):
    """TP fastest, then the pipeline stage, DP slowest (Mesh's order)."""
    return (d * pp + p) * tp + t
'''))


def rank_grid(traffic: dict, devices_per_node: int = 4) -> None:
    """What place_rank's lab shows once it is `unlocked` (solved, its solution shown, or the stored copy): Mesh's
    dp 2 x pp 2 x tp 2 grid rank by rank with each rank's three groups, its figure on nodes of `devices_per_node`,
    the bytes of the run `traffic` (a `labsupport.train.run` summary of that grid) that would cross nodes in Mesh's
    order and in SHIPPED_ORDER, and the rank-grid widget, set to SHIPPED_ORDER. Every one of them shows the order
    the lab asks for, so until then one locked line stands in for them. The run's counters are checked either way:
    in the shipped order all of TP's traffic crosses the nodes and none of the DP sync's."""
    from IPython.display import display

    from ..parallel.mesh import Mesh
    from ..widgets.rank_grid import RankGridWidget, layout, rank_grid_figure, traffic_split
    from ..widgets.show import show

    mesh_order = layout(2, 2, 2, devices_per_node).order
    splits = {order: traffic_split(layout(2, 2, 2, devices_per_node, order), traffic["comm_groups"])
              for order in (mesh_order, SHIPPED_ORDER)}
    shipped = splits[SHIPPED_ORDER]
    assert shipped["tp"]["across"] > 0 and shipped["tp"]["inside"] == 0 and shipped["dp"]["across"] == 0, shipped
    if not unlocked("place_rank"):
        locked("place_rank", "The grid in Mesh's order, its figure, this run's traffic in both orders and the widget")
        return
    groups = layout(2, 2, 2, devices_per_node)
    print("Mesh's 2 x 2 x 2 grid, rank by rank, with each rank's three groups:")
    print(f"{'rank':>4}  (d, p, t)   {'TP group':<10}{'pipeline':<10}{'DP group':<10}")
    for r in range(8):
        mesh = Mesh(2, 2, 2, r)
        print(f"{r:>4}  {str((mesh.dp_rank, mesh.pp_rank, mesh.tp_rank)):<11} "
              + "".join(f"{str(list(groups.group_of(axis, r).ranks)):<10}" for axis in ("tp", "pp", "dp")))
    print(f"\nThe same grid on two nodes of {devices_per_node} devices, each rank in three bands, the colours of its TP, "
          "PP and DP groups:")
    display(rank_grid_figure(dp=2, tp=2, pp=2, devices_per_node=devices_per_node, colour_by="all"))
    print("This run's counters re-placed: the same coordinates send the same bytes wherever they sit, only whether "
          "they cross a node changes.")
    for order, split in splits.items():
        print(f"order {', '.join(order):<11}(fastest first): bytes crossing nodes per step: "
              + ", ".join(f"{name} {s['across']:,}" for name, s in split.items()))
    print("In the colleague's order every TP group straddles the two nodes and all of tensor parallelism's traffic "
          "crosses them, while the DP sync, which could cross once a step, stays inside. The widget, set to the "
          "colleague's order, compares any other:")
    widget = RankGridWidget(traffic=traffic, devices_per_node=devices_per_node, order=SHIPPED_ORDER)
    show(widget, widget.figure())


# Predict, then run: what `lab.reveal(guess_NAME, ..., why="NAME")` prints after the answer, kept here
# and not in the notebook's cell, which the attendee reads before predicting.
WHY = {
    "tp_calls": ("Per micro-batch, the stage's one layer needs Megatron's 4 (g after attention and after the MLP "
                 "forward, f before them backward) and the vocab-parallel embedding 1 (its rows summed): 5 x m = 10, "
                 "and the gradient norm's float64 sum makes 11. The last stage has 15: the LM head's f and the "
                 "loss's two reductions instead of the embedding."),
    "pp_bytes": ("One activation per micro-batch, b x s x h x 4 bytes = 2 x 64 x 64 x 4 = 32,768, m = 2 times. Stage "
                 "1 sends as much back: the activations' gradients."),
    "dp_ratio": ("A ring all-reduce is a reduce-scatter followed by an all-gather. ZeRO-1 does the same two halves "
                 "with the optimizer step in between, on the shard each rank owns (Rajbhandari et al. 2020, Sec. "
                 "7.2.1): the same bytes, and half of the optimizer memory saved here, (d - 1)/d of it in general."),
    "llama_side": ("Below: the planner gives {low:.2f}x to {high:.2f}x of Meta's TFLOP/s. With one stage per GPU, a "
                   "pipeline of 16 stages idles (p - 1) / m of its compute and TP time, 15/32 on 8,192 GPUs and 15/16 on "
                   "16,384 (section 5's bubble): a third to half of the predicted step. The interleaved schedule "
                   "divides that by its stages per GPU, v (Narayanan et al. 2021, Sec. 2.2.2), which Meta's paper "
                   "names but does not size."),
}
