"""The rank grid: data x pipeline x tensor parallel, and every rank's process groups.

Ranks are laid out as in picotron's process-group manager and Megatron-LM: tensor parallel
varies fastest, so the ranks of a TP group are neighbours, i.e. on the same node (TP talks
after every layer and needs NVLink); then the pipeline stage; data parallel varies slowest:

    rank = (d * pp + p) * tp + t        for coordinates (d, p, t)

A rank's TP group is the ranks that differ from it in t only, its PP group those that differ
in p only, its DP group those that differ in d only. Creating a group is a collective over
the whole world, so every rank creates every group, in the same order, member or not.
With a pipeline, each pipeline's first and last stage also form an embedding group (they
hold the two copies of the tied embedding / LM head matrix; parallel/pipeline.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..grid import AXES, coordinates, groups_along, rank_of


@dataclass
class Mesh:
    """This rank's place in a dp x pp x tp grid and its three process groups.

    On one process (or before torch.distributed is initialized) the groups are None, which
    comm treats as the world of one rank.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    rank: int = 0

    def __post_init__(self):
        from .. import comm
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a grid of {self.world_size} ranks")
        self.dp_rank, self.pp_rank, self.tp_rank = coordinates(self.rank, self.pp, self.tp)
        self.groups = {axis: None for axis in AXES}
        self.embedding_group = None
        if comm.get_world_size() > 1:
            for axis in ("tp", "pp", "dp"):  # the same order on every rank
                for members in groups_along(axis, self.dp, self.pp, self.tp):
                    group = comm.new_group(members, name=axis)
                    if self.rank in members:
                        self.groups[axis] = group
            if self.pp > 1:  # Megatron-LM's embedding group: the first and last stage share the tied matrix
                for members in groups_along("pp", self.dp, self.pp, self.tp):
                    group = comm.new_group([members[0], members[-1]], name="embedding")
                    if self.rank in (members[0], members[-1]):
                        self.embedding_group = group

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    dp_group = property(lambda self: self.groups["dp"])
    pp_group = property(lambda self: self.groups["pp"])
    tp_group = property(lambda self: self.groups["tp"])

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` in this rank's pipeline (same d and t)."""
        return rank_of(self.dp_rank, stage, self.tp_rank, self.pp, self.tp)

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same d and t), None on the first stage."""
        return None if self.is_first_stage else rank_of(self.dp_rank, self.pp_rank - 1, self.tp_rank, self.pp, self.tp)

    @property
    def next_stage_rank(self) -> int | None:
        return None if self.is_last_stage else rank_of(self.dp_rank, self.pp_rank + 1, self.tp_rank, self.pp, self.tp)

    def describe(self) -> str:
        return (f"rank {self.rank}: dp {self.dp_rank}/{self.dp}, pp {self.pp_rank}/{self.pp}, "
                f"tp {self.tp_rank}/{self.tp}")

    def device_mesh(self, device_type: str = "cpu"):
        """The same grid as torch's DeviceMesh (dims named dp, pp, tp), for the torch references."""
        from .. import comm
        return comm.device_mesh(device_type, (self.dp, self.pp, self.tp), AXES)
