"""The rank order: where each rank sits in a dp x pp x tp grid, and which ranks form each group.

Ranks are laid out as in picotron's process-group manager and Megatron-LM: tensor parallel
varies fastest, so the ranks of a TP group are neighbours, i.e. on the same node (TP talks
after every layer and needs NVLink); then the pipeline stage; data parallel varies slowest:

    rank = (d * pp + p) * tp + t        for coordinates (d, p, t)

A rank's TP group is the ranks that differ from it in t only, its PP group those that differ
in p only, its DP group those that differ in d only.

Plain arithmetic, no torch: parallel/mesh.py builds the process groups from it, and the rank-grid
widget and the notebooks draw and reason about the same order.
"""
from __future__ import annotations

AXES = ("dp", "pp", "tp")  # slowest to fastest


def rank_of(d: int, p: int, t: int, pp: int, tp: int) -> int:
    return (d * pp + p) * tp + t


def coordinates(rank: int, pp: int, tp: int) -> tuple[int, int, int]:
    """(d, p, t) of `rank`: the inverse of rank_of."""
    return rank // (pp * tp), rank // tp % pp, rank % tp


def groups_along(axis: str, dp: int, pp: int, tp: int) -> list[list[int]]:
    """Every group of one axis, each a list of ranks in order of that axis' coordinate."""
    sizes = {"dp": dp, "pp": pp, "tp": tp}
    others = [a for a in AXES if a != axis]
    out = []
    for i in range(sizes[others[0]]):
        for j in range(sizes[others[1]]):
            members = []
            for k in range(sizes[axis]):
                c = {others[0]: i, others[1]: j, axis: k}
                members.append(rank_of(c["dp"], c["pp"], c["tp"], pp, tp))
            out.append(members)
    return out
