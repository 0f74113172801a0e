"""The rank order: where each rank sits in a dp x pp x cp x tp grid, and which ranks form each group.

Ranks are laid out as in picotron's process-group manager and Megatron-LM: tensor parallel
varies fastest, so the ranks of a TP group are neighbours, i.e. on the same node (TP talks
after every layer and needs NVLink); then context parallel (its ring passes K/V blocks every
layer, the next-heaviest traffic); then the pipeline stage; data parallel varies slowest:

    rank = ((d * pp + p) * cp + c) * tp + t        for coordinates (d, p, c, t)

A rank's group along one axis is the ranks that differ from it in that axis' coordinate only.
Without context parallelism (cp = 1, the default) this is the 3D grid rank = (d * pp + p) * tp + t.
Expert parallelism is no axis of its own: it borrows the data-parallel ranks (parallel/mesh.py).

Plain arithmetic, no torch: parallel/mesh.py builds the process groups from it, and the rank-grid
widget and the notebooks draw and reason about the same order.
"""
from __future__ import annotations

from itertools import product

MESH_AXES = ("dp", "pp", "cp", "tp")  # slowest to fastest
AXES = ("dp", "pp", "tp")  # the 3D grid (cp = 1) that the rank-grid widget draws


def rank_of(d: int, p: int, t: int, pp: int, tp: int, c: int = 0, cp: int = 1) -> int:
    return ((d * pp + p) * cp + c) * tp + t


def coordinates(rank: int, pp: int, tp: int, cp: int = 1) -> tuple[int, int, int]:
    """(d, p, t) of `rank`: the inverse of rank_of (`cp_coordinate` gives c)."""
    return rank // (pp * cp * tp), rank // (cp * tp) % pp, rank % tp


def cp_coordinate(rank: int, tp: int, cp: int) -> int:
    """c of `rank`: its place in its context-parallel ring."""
    return rank // tp % cp


def groups_along(axis: str, dp: int, pp: int, tp: int, cp: int = 1) -> list[list[int]]:
    """Every group of one axis, each a list of ranks in order of that axis' coordinate."""
    sizes = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    others = [a for a in MESH_AXES if a != axis]
    out = []
    for fixed in product(*(range(sizes[a]) for a in others)):
        members = []
        for k in range(sizes[axis]):
            c = {**dict(zip(others, fixed)), axis: k}
            members.append(rank_of(c["dp"], c["pp"], c["tp"], pp, tp, c["cp"], cp))
        out.append(members)
    return out
