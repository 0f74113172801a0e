"""The rank grid: data x pipeline x context x tensor parallel, and every rank's process groups.

Ranks are laid out as in picotron's process-group manager and Megatron-LM (labsupport/grid.py):
tensor parallel varies fastest, so the ranks of a TP group are neighbours, i.e. on the same node
(TP talks after every layer and needs NVLink); then context parallel; then the pipeline stage;
data parallel varies slowest:

    rank = ((d * pp + p) * cp + c) * tp + t        for coordinates (d, p, c, t)

A rank's group along an axis is the ranks that differ from it in that coordinate only. Creating a
group is a collective over the whole world, so every rank creates every group, in the same order,
member or not. Beyond the four axes:

* with a pipeline, each pipeline's first and last stage form an embedding group (they hold the
  two copies of the tied embedding / LM head matrix; parallel/pipeline.py);
* with context parallelism, the ranks that differ in d or c form the "dp_cp" group: the
  parameters are replicated over both, so data parallelism averages their gradients over it
  (Megatron-LM's DP-CP group);
* expert parallelism is no axis of its own: as in Megatron-LM and torchtitan it borrows the
  data-parallel ranks. A DP group's ranks are cut into groups of `ep` consecutive d: the "ep"
  group, over which the experts are spread; the ranks holding the same experts (same d mod ep)
  form the "edp" group (expert data parallel), over which those experts' gradients are reduced.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..grid import AXES, GROUPS, axes_of, coordinates, groups_along, rank_of


@dataclass
class Mesh:
    """This rank's place in a dp x pp x cp x tp grid and its process groups.

    On one process (or before torch.distributed is initialized) the groups are None, which
    comm treats as the world of one rank. The cp, dp_cp, ep and edp groups exist only where
    their degree is above 1. `group(name)` gives this rank's group of any name of GROUPS.
    """

    dp: int = 1
    pp: int = 1
    tp: int = 1
    rank: int = 0
    cp: int = 1
    ep: int = 1

    def __post_init__(self):
        from .. import comm
        from .experts import problems  # expert parallelism's rule on the grid, stated there once
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a grid of {self.world_size} ranks")
        found = problems(self.ep, dp=self.dp)
        if found:
            raise ValueError(found[0])
        self.coords = coordinates(self.rank, self.degrees)  # {axis: this rank's coordinate}
        self.dp_rank, self.pp_rank, self.cp_rank, self.tp_rank = (self.coords[a] for a in AXES)
        self.ep_rank = self.dp_rank % self.ep
        self._groups = dict.fromkeys(GROUPS)
        self.embedding_group = None
        if comm.get_world_size() > 1:
            for axis in reversed(axes_of(self.degrees)):  # the same order on every rank, fastest axis first
                self._groups[axis] = self._create(axis, groups_along(axis, self.degrees))
            if self.cp > 1:
                self._groups["dp_cp"] = self._create("dp_cp", [
                    [rank_of({"dp": d, "pp": p, "cp": c, "tp": t}, self.degrees) for d in range(self.dp) for c in range(self.cp)]
                    for p in range(self.pp) for t in range(self.tp)])
            if self.ep > 1:
                self._groups["ep"], self._groups["edp"] = self.split_dp(self.ep, name=("ep", "edp"))
            if self.pp > 1:  # Megatron-LM's embedding group: the first and last stage share the tied matrix
                self.embedding_group = self._create("embedding", [[members[0], members[-1]]
                                                                  for members in groups_along("pp", self.degrees)])

    def _create(self, name: str, groups: list[list[int]]):
        """Create every group of `groups` (a collective: every rank creates all of them); this rank's."""
        from .. import comm
        mine = None
        for members in groups:
            group = comm.new_group(members, name=name)
            if self.rank in members:
                mine = group
        return mine

    def split_dp(self, size: int, name: tuple[str, str]) -> tuple:
        """Each DP group cut into groups of `size` consecutive DP ranks: (this rank's group of them, and
        the group of the ranks at its place in the other cuts). Expert parallelism's ep and edp groups;
        hybrid sharding's shard and replicate groups. A collective: every rank calls it, in the same
        order; on one process both are None."""
        from .. import comm
        if comm.get_world_size() == 1:
            return None, None
        dp_groups = groups_along("dp", self.degrees)
        inside = self._create(name[0], [g[i:i + size] for g in dp_groups for i in range(0, self.dp, size)])
        across = self._create(name[1], [g[k::size] for g in dp_groups for k in range(size)])
        return inside, across

    def group(self, name: str):
        """This rank's group `name` (one of GROUPS); None where it is the world of one rank, or absent."""
        if name not in GROUPS:
            raise ValueError(f"the mesh has no group {name!r}; it has {', '.join(GROUPS)}")
        return self._groups[name]

    @property
    def degrees(self) -> dict[str, int]:
        """{axis: degree} of the grid, for grid.py."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    dp_group = property(lambda self: self.group("dp"))
    pp_group = property(lambda self: self.group("pp"))
    tp_group = property(lambda self: self.group("tp"))
    cp_group = property(lambda self: self.group("cp"))

    @property
    def replica_group(self):
        """The ranks holding the same replicated (dense) parameters, whose gradients data parallelism
        averages: the DP group, or with context parallelism the DP-CP group."""
        return self.group("dp_cp" if self.cp > 1 else "dp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of pipeline stage `stage` in this rank's pipeline (same d, c and t)."""
        return rank_of({**self.coords, "pp": stage}, self.degrees)

    @property
    def prev_stage_rank(self) -> int | None:
        """Global rank of the previous pipeline stage (same d, c and t), None on the first stage."""
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    @property
    def next_stage_rank(self) -> int | None:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    def describe(self) -> str:
        cp = f", cp {self.cp_rank}/{self.cp}" if self.cp > 1 else ""
        ep = f", ep {self.ep_rank}/{self.ep}" if self.ep > 1 else ""
        return (f"rank {self.rank}: dp {self.dp_rank}/{self.dp}, pp {self.pp_rank}/{self.pp}{cp}, "
                f"tp {self.tp_rank}/{self.tp}{ep}")

    def device_mesh(self, device_type: str = "cpu"):
        """The same grid as torch's DeviceMesh (dims named dp, pp, tp; cp between them when above 1),
        for the torch references."""
        from .. import comm
        axes = axes_of(self.degrees)
        return comm.device_mesh(device_type, tuple(getattr(self, a) for a in axes), axes)
