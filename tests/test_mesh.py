"""The rank grid: the layout as arithmetic, and the real process groups on real ranks."""
import textwrap

import pytest

from labsupport.launch import launch
from labsupport.parallel.mesh import coordinates, groups_along, rank_of


@pytest.mark.parametrize("dp, pp, tp", [(2, 2, 2), (1, 2, 2), (2, 1, 2), (2, 2, 1), (8, 1, 1), (1, 1, 8), (2, 3, 2)])
def test_every_rank_is_in_exactly_one_group_per_axis(dp, pp, tp):
    world = dp * pp * tp
    for axis, size in (("dp", dp), ("pp", pp), ("tp", tp)):
        groups = groups_along(axis, dp, pp, tp)
        assert len(groups) == world // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:  # members differ in this axis' coordinate only, listed in its order
            coords = [coordinates(r, pp, tp) for r in g]
            position = ("dp", "pp", "tp").index(axis)
            assert [c[position] for c in coords] == list(range(size))
            assert len({c[:position] + c[position + 1:] for c in coords}) == 1
    for r in range(world):
        assert rank_of(*coordinates(r, pp, tp), pp, tp) == r


def test_tensor_parallel_varies_fastest():
    """TP groups are neighbouring ranks (one node), DP groups the farthest apart (Megatron's order)."""
    assert groups_along("tp", 2, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups_along("pp", 2, 2, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_along("dp", 2, 2, 2) == [[0, 4], [1, 5], [2, 6], [3, 7]]


MESHES = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from labsupport import comm, init, report
    from labsupport.parallel.mesh import Mesh, groups_along

    layouts = [tuple(map(int, arg.split("x"))) for arg in sys.argv[1:]]
    with init() as rt:
        results = {}
        for dp, pp, tp in layouts:
            mesh = Mesh(dp, pp, tp, rank=rt.rank)
            comm.reset()
            members = {}
            for axis in ("dp", "pp", "tp"):
                group = mesh.groups[axis]
                ranks = torch.zeros(rt.world_size)
                ranks[rt.rank] = 1
                comm.all_reduce(ranks, group=group)  # who is in my group, as the group itself says
                members[axis] = [r for r in range(rt.world_size) if ranks[r]]
            torch_mesh = mesh.device_mesh("cpu")
            results[f"{dp}x{pp}x{tp}"] = {
                "members": members, "coords": [mesh.dp_rank, mesh.pp_rank, mesh.tp_rank],
                "first": mesh.is_first_stage, "last": mesh.is_last_stage,
                "prev": mesh.prev_stage_rank, "next": mesh.next_stage_rank,
                "counted": {g: c["all_reduce"]["calls"] for g, c in comm.group_counts().items()},
                "torch": {axis: dist.get_process_group_ranks(torch_mesh.get_group(axis)) for axis in ("dp", "pp", "tp")},
            }
        report(**results)
""")


def run_meshes(tmp_path, nproc, layouts):
    script = tmp_path / "meshes.py"
    script.write_text(MESHES)
    res = launch(str(script), *[f"{dp}x{pp}x{tp}" for dp, pp, tp in layouts], nproc=nproc, timeout=180,
                 run_dir=tmp_path / "run")
    return [res.report(r) for r in range(nproc)]


def check(reports, dp, pp, tp):
    key = f"{dp}x{pp}x{tp}"
    for rank, rep in enumerate(reports):
        got = rep[key]
        d, p, t = got["coords"]
        assert rank == (d * pp + p) * tp + t
        for axis in ("dp", "pp", "tp"):
            expected = next(g for g in groups_along(axis, dp, pp, tp) if rank in g)
            assert got["members"][axis] == sorted(expected), (rank, axis)
            assert got["torch"][axis] == sorted(expected), f"torch's DeviceMesh disagrees on rank {rank} {axis}"
        assert got["counted"] == {"dp": 1, "pp": 1, "tp": 1}, "each call is counted under its group's name"
        assert got["first"] == (p == 0) and got["last"] == (p == pp - 1)
        assert got["prev"] == (None if p == 0 else rank - tp)
        assert got["next"] == (None if p == pp - 1 else rank + tp)


@pytest.mark.multiprocess
def test_mesh_groups_on_four_ranks(tmp_path):
    layouts = [(1, 2, 2), (2, 1, 2), (2, 2, 1)]
    reports = run_meshes(tmp_path, 4, layouts)
    for layout in layouts:
        check(reports, *layout)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mesh_groups_on_eight_ranks(tmp_path):
    reports = run_meshes(tmp_path, 8, [(2, 2, 2)])
    check(reports, 2, 2, 2)
