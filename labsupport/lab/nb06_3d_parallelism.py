"""Notebook 06's exercises: choose a 3D layout for the workshop's three models (graded by the
planner: it must fit, and run within 1.3x of the planner's best step time), and a find-the-bug
lab (a rank order with data parallelism varying fastest, so tensor-parallel groups straddle nodes).

Both grade against `labsupport.estimate`: `planner.evaluate` and `planner.plan` for the layout,
`widgets.rank_grid.layout`'s notion of a group crossing nodes (node k holds ranks k G .. k G + G - 1)
for the rank order. Nothing here needs ranks: a layout of a thousand GPUs is graded by the model.
"""
from __future__ import annotations

from ..estimate.memory import RECOMPUTE
from .exercise import Exercise, Unsolved, Wrong, attempt, register

# (model preset, Frontier GCDs, global batch): the workshop's hands-on runs on 2, 16 and 128 nodes.
LAYOUT_CASES = (("22b", 16, 64), ("175b", 128, 640), ("1t", 1024, 1600))
WITHIN = 1.3              # slower than the planner's best by at most this factor
KEYS = ("dp", "tp", "pp", "micro_batch", "zero")


def _frontier():
    from ..estimate.planner import MACHINE_NAMES
    return MACHINE_NAMES["frontier"]


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def _parts(c) -> str:
    """Where a layout's step goes, in seconds: what to compare with the best one."""
    return (f"compute {c.compute_s:.3g}, TP {c.tp_comm_s:.3g}, PP {c.pp_comm_s:.3g}, DP {c.dp_comm_s:.3g}, "
            f"bubble {c.bubble_s:.3g}")


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
    configs = [evaluate(cfg, machine, gpus, global_batch, **fixed, recompute=r) for r in choices]
    fitting = [c for c in configs if c.fits]
    if fitting:
        return min(fitting, key=lambda c: c.step_time_s)
    return min(configs, key=lambda c: c.memory_per_gpu)


def grade_choose_layout(fn, source) -> str:
    from ..estimate.planner import describe, plan, usable_bytes
    from ..model import get_preset
    machine = _frontier()
    verdicts = []
    for model, gpus, batch in LAYOUT_CASES:
        call = f"choose_layout({model!r}, {gpus}, {batch})"
        try:
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
            raise Wrong(f"{where}: {describe(mine)} needs {_gb(mine.memory_per_gpu)} per GCD, more than the "
                        f"{_gb(usable_bytes(machine))} usable of 64 GB. More model parallelism (tp x pp), ZeRO-1 "
                        "over the DP ranks, or activation recomputation shrink it")
        best = plan(cfg, machine, gpus, batch)[0]
        ratio = mine.step_time_s / best.step_time_s
        if ratio > WITHIN:
            raise Wrong(f"{where}: {describe(mine)} fits but takes {mine.step_time_s:.3g} s a step, {ratio:.2f}x the "
                        f"planner's best ({describe(best)}, {best.step_time_s:.3g} s). Where the time goes, yours: "
                        f"{_parts(mine)}; the best: {_parts(best)}")
        verdicts.append(f"{model} {ratio:.2f}x")
    return (f"every layout fits and runs within {WITHIN}x of the planner's best step time on Frontier "
            f"({', '.join(verdicts)})")


register(Exercise(
    name="choose_layout", notebook="06", title="Choose the 3D layout of the workshop's runs",
    grade=grade_choose_layout,
    hints=("Start from memory: `estimate_memory(get_preset(model), micro_batch=1, dp=..., tp=..., pp=..., zero=1, "
           "recompute=...)['total']` must stay under 90% of a GCD's 64 GB. The model-parallel size tp x pp is "
           "what divides the weights; dp = gpus / (tp x pp) must divide the global batch.",
           "Narayanan et al.'s takeaways: TP inside a node (at most 8 on Frontier), pipeline stages across nodes, "
           "model parallelism only as large as memory needs, the rest data parallel with ZeRO-1, micro-batch 1 so "
           "that the pipeline gets many micro-batches. Recomputation costs compute: use the lightest that fits.",
           "Run `plan(get_preset(model), MACHINE_NAMES['frontier'], gpus, batch)[:5]` and read `why(...)` for the "
           "best: then ask which of its choices you would have made yourself, and why."),
    solution='''
from labsupport.estimate.memory import estimate_memory
from labsupport.model import get_preset


def choose_layout(model, gpus, global_batch):
    """The lightest recomputation that lets anything fit; then the smallest model-parallel group
    tp x pp that fits, trying TP 4 first (on Frontier's 50 GB/s Infinity Fabric TP 8's
    all-reduces cost more than a deeper pipeline), ZeRO-1 over the rest, micro-batch 1."""
    cfg = get_preset(model)
    usable = 0.9 * 64e9
    for recompute in ("none", "selective", "full"):
        for size in range(1, gpus + 1):                      # tp x pp, smallest first
            for tp in (4, 8, 2, 1):
                pp = size // tp
                if tp * pp != size or cfg.heads % tp or cfg.n_layers % pp or gpus % size:
                    continue
                dp = gpus // size
                if global_batch % dp:
                    continue
                zero = 1 if dp > 1 else 0
                need = estimate_memory(cfg, micro_batch=1, dp=dp, tp=tp, pp=pp, zero=zero, recompute=recompute)
                if need["total"] <= usable:
                    return dict(dp=dp, tp=tp, pp=pp, micro_batch=1, zero=zero, recompute=recompute)
'''))


# ---------------------------------------------------------------- find the bug: DP varies fastest

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
    return ("on every grid each TP group is tp neighbouring ranks on one node. Mesh numbers (tp, pp, dp), "
            "fastest first; Megatron-LM's default is (tp, dp, pp): both keep TP on the node's links")


register(Exercise(
    name="place_rank", notebook="06", bug_lab=True,
    title="Find the bug: a rank order with data parallelism fastest",
    grade=grade_place_rank,
    hints=("A job's ranks fill its nodes in order: node k holds ranks k G to k G + G - 1. Which coordinate should "
           "change between rank r and rank r + 1?",
           "The coordinate that varies fastest is the one multiplied by nothing: here it is d. Make it t, so the "
           "tp ranks of a TP group are consecutive: rank = (d * pp + p) * tp + t."),
    solution='''
def place_rank(d, p, t, dp, pp, tp):
    """TP fastest, then the pipeline stage, DP slowest (Mesh's order)."""
    return (d * pp + p) * tp + t
'''))
