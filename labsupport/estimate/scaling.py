"""Weak and strong scaling, predicted by the planner's step-time model.

Both keep a layout's model-parallel part (tp x pp GPUs: one replica) and add data-parallel
replicas. Weak scaling keeps each replica's batch, so the global batch grows with the replicas;
strong scaling keeps the global batch, so each replica gets fewer micro-batches and its pipeline
bubble, (p - 1)/m, grows. Efficiency is tokens/s per GPU against the first point: 1.0 is perfect.

The workshop's scaling runs (Dash et al. 2023, Fig. 12 and 13; `workshop.TABLE_VI` and
`workshop.STRONG_SCALING`) used Table VI's layouts: weak scaling at Table VI's batch per replica,
strong scaling at a fixed total batch. The smallest GPU count each efficiency is measured against
is not printed; we take one replica (tp x pp GPUs).
"""
from __future__ import annotations

from typing import NamedTuple

from .planner import EFFICIENCY, evaluate
from .workshop import STRONG_SCALING, TABLE_VI, WEAK_SCALING_EFFICIENCY

# workshop.py's scaling facts per model, as the curves below take them.
WORKSHOP = {model: dict(layout=row.layout(), per_replica_batch=row.per_replica_batch,
                        weak_efficiency=WEAK_SCALING_EFFICIENCY, strong_batch=STRONG_SCALING[model].global_batch,
                        strong_gpus=STRONG_SCALING[model].gpus, strong_efficiency=STRONG_SCALING[model].efficiency)
            for model, row in TABLE_VI.items()}


class Point(NamedTuple):
    """One point of a scaling curve."""

    gpus: int
    global_batch: int
    step_time_s: float
    tokens_per_s: float
    efficiency: float     # tokens/s per GPU over that of the curve's first point
    fits: bool


def _curve(cfg, machine, layout: dict, batches: list[tuple[int, int]], precision, efficiency) -> list[Point]:
    points = []
    for dp, global_batch in batches:
        replica = layout["tp"] * layout["pp"]
        zero = layout["zero"] if dp > 1 else 0   # one replica has nothing to shard over
        c = evaluate(cfg, machine, dp * replica, global_batch, dp, **{**layout, "zero": zero},
                     precision=precision, efficiency=efficiency)
        tokens_per_s = global_batch * cfg.seq_len / c.step_time_s
        per_gpu = tokens_per_s / c.gpus
        first = points[0].tokens_per_s / points[0].gpus if points else per_gpu
        points.append(Point(c.gpus, global_batch, c.step_time_s, tokens_per_s, per_gpu / first, c.fits))
    return points


def _check_replicas(replicas) -> list[int]:
    replicas = list(replicas)
    if not replicas or any(not isinstance(r, int) or r < 1 for r in replicas):
        raise ValueError(f"replicas must be whole numbers >= 1, got {replicas!r}")
    return replicas


def weak_scaling(cfg, machine, layout: dict, per_replica_batch: int, replicas, precision: str = "mixed",
                 efficiency: float = EFFICIENCY) -> list[Point]:
    """Points for dp in `replicas`, each replica keeping `per_replica_batch` sequences per step.

    `layout` holds tp, pp, micro_batch, zero, recompute (as `WORKSHOP`'s entries' "layout").
    """
    return _curve(cfg, machine, layout, [(r, r * per_replica_batch) for r in _check_replicas(replicas)],
                  precision, efficiency)


def strong_scaling(cfg, machine, layout: dict, global_batch: int, replicas, precision: str = "mixed",
                   efficiency: float = EFFICIENCY) -> list[Point]:
    """Points for dp in `replicas`, all sharing the same `global_batch` sequences per step."""
    return _curve(cfg, machine, layout, [(r, global_batch) for r in _check_replicas(replicas)],
                  precision, efficiency)
