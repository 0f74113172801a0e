"""The rank order: where each rank sits in a dp x pp x cp x tp grid, and which ranks form each group.

Ranks are laid out as in picotron's process-group manager and Megatron-LM: tensor parallel
varies fastest, so the ranks of a TP group are neighbours, i.e. on the same node (TP talks
after every layer and needs NVLink); then context parallel (its ring passes K/V blocks every
layer, the next-heaviest traffic); then the pipeline stage; data parallel varies slowest:

    rank = ((d * pp + p) * cp + c) * tp + t        for coordinates (d, p, c, t)

A rank's group along one axis is the ranks that differ from it in that axis' coordinate only.
Without context parallelism (cp = 1) this is Megatron-LM's 3D grid rank = (d * pp + p) * tp + t.
Expert parallelism is no axis of its own: it borrows the data-parallel ranks (parallel/mesh.py).

Degrees and coordinates are mappings by axis name ({"dp": 2, "tp": 2}; an axis left out has
degree 1 and coordinate 0), so a new axis is one more name in AXES, not one more argument.

Plain arithmetic, no torch: parallel/mesh.py builds the process groups from it, and the rank-grid
widget and the notebooks draw and reason about the same order.
"""
from __future__ import annotations

from itertools import product
from typing import Mapping

AXES = ("dp", "pp", "cp", "tp")  # the grid's axes, slowest to fastest
THREE_D = tuple(a for a in AXES if a != "cp")  # Megatron-LM's 3D grid: the axes every grid spans, even at degree 1
# The process groups of a rank (beyond a pipeline's embedding group): one per axis, then Megatron-LM's
# DP-CP group and expert parallelism's EP and expert-data-parallel groups (parallel/mesh.py).
GROUPS = (*AXES, "dp_cp", "ep", "edp")


def axes_of(degrees: Mapping[str, int]) -> tuple[str, ...]:
    """The axes a grid of `degrees` spans, slowest first: the 3D grid's always (their groups exist
    even at degree 1, the rank-grid widget always draws them), any other only when above 1."""
    return tuple(a for a in AXES if a in THREE_D or degrees.get(a, 1) > 1)


def _checked(mapping: Mapping[str, int], what: str) -> Mapping[str, int]:
    unknown = [a for a in mapping if a not in AXES]
    if unknown:
        raise ValueError(f"{what} name {', '.join(map(repr, unknown))}; the grid's axes are {', '.join(AXES)}")
    return mapping


def rank_of(coords: Mapping[str, int], degrees: Mapping[str, int]) -> int:
    """The rank at `coords` in a grid of `degrees`."""
    coords, degrees = _checked(coords, "the coordinates"), _checked(degrees, "the degrees")
    rank = 0
    for axis in AXES:
        rank = rank * degrees.get(axis, 1) + coords.get(axis, 0)
    return rank


def coordinates(rank: int, degrees: Mapping[str, int]) -> dict[str, int]:
    """{axis: coordinate} of `rank` for every axis, slowest first: the inverse of rank_of."""
    degrees = _checked(degrees, "the degrees")
    out = {}
    for axis in reversed(AXES):
        rank, out[axis] = divmod(rank, degrees.get(axis, 1))
    return {axis: out[axis] for axis in AXES}


def groups_along(axis: str, degrees: Mapping[str, int]) -> list[list[int]]:
    """Every group of one axis, each a list of ranks in order of that axis' coordinate."""
    degrees = _checked({**degrees, axis: degrees.get(axis, 1)}, "the degrees")
    others = [a for a in AXES if a != axis]
    return [[rank_of({**dict(zip(others, fixed)), axis: k}, degrees) for k in range(degrees[axis])]
            for fixed in product(*(range(degrees.get(a, 1)) for a in others))]
