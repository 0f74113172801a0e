"""The rank grid: the layout as arithmetic, and the real process groups on real ranks."""
import textwrap

import pytest

from labsupport.launch import launch
from labsupport.grid import AXES, coordinates, groups_along, rank_of


def degrees(dp, pp, tp, cp=1):
    return {"dp": dp, "pp": pp, "cp": cp, "tp": tp}


@pytest.mark.parametrize("dp, pp, tp, cp", [(2, 2, 2, 1), (1, 2, 2, 1), (2, 1, 2, 1), (2, 2, 1, 1), (8, 1, 1, 1),
                                            (1, 1, 8, 1), (2, 3, 2, 1), (2, 1, 1, 2), (1, 2, 2, 2), (2, 2, 2, 3)])
def test_every_rank_is_in_exactly_one_group_per_axis(dp, pp, tp, cp):
    world, sizes = dp * pp * cp * tp, degrees(dp, pp, tp, cp)
    for axis, size in sizes.items():
        groups = groups_along(axis, sizes)
        assert len(groups) == world // size and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))
        for g in groups:  # members differ in this axis' coordinate only, listed in its order
            coords = [coordinates(r, sizes) for r in g]
            assert [c[axis] for c in coords] == list(range(size))
            assert len({tuple(v for a, v in c.items() if a != axis) for c in coords}) == 1
    for r in range(world):
        c = coordinates(r, sizes)
        assert tuple(c) == AXES  # slowest first
        assert rank_of(c, sizes) == r == ((c["dp"] * pp + c["pp"]) * cp + c["cp"]) * tp + c["tp"]


def test_an_axis_left_out_is_of_degree_1_and_an_unknown_one_is_refused():
    assert coordinates(5, {"tp": 2, "dp": 3}) == {"dp": 2, "pp": 0, "cp": 0, "tp": 1}
    assert rank_of({"dp": 2, "tp": 1}, {"tp": 2, "dp": 3}) == 5
    assert groups_along("tp", {}) == [[0]]
    with pytest.raises(ValueError, match="'ep'; the grid's axes are dp, pp, cp, tp"):
        groups_along("ep", {"dp": 4})
    with pytest.raises(ValueError, match="the coordinates name 'tpp'"):
        rank_of({"tpp": 1}, {"tp": 2})


def test_tensor_parallel_varies_fastest():
    """TP groups are neighbouring ranks (one node), DP groups the farthest apart (Megatron's order)."""
    assert groups_along("tp", degrees(2, 2, 2)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups_along("pp", degrees(2, 2, 2)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_along("dp", degrees(2, 2, 2)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # context parallel sits between them: dp 2 x cp 2 x tp 2
    assert groups_along("cp", degrees(2, 1, 2, 2)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups_along("dp", degrees(2, 1, 2, 2)) == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_a_mesh_names_its_groups_and_refuses_a_name_it_lacks():
    """On one process every group is the world of one rank (None); a misspelt name is an error, not a None."""
    from labsupport.parallel.mesh import Mesh
    mesh = Mesh(dp=2, tp=2, rank=3)
    assert (mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank) == (1, 0, 0, 1)
    assert mesh.group("tp") is None and mesh.replica_group is None
    with pytest.raises(ValueError, match="no group 'dpcp'; it has dp, pp, cp, tp, dp_cp, ep, edp"):
        mesh.group("dpcp")

MESHES = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    from labsupport import comm, init, report
    from labsupport.parallel.mesh import Mesh

    with init() as rt:
        results = {}
        for arg in sys.argv[1:]:  # dp x pp x tp [x cp x ep]
            dp, pp, tp, cp, ep = map(int, (arg + "x1x1").split("x")[:5])
            mesh = Mesh(dp, pp, tp, rank=rt.rank, cp=cp, ep=ep)
            comm.reset()
            members = {}
            for axis in ["dp", "pp", "tp"] + ["cp", "dp_cp"] * (cp > 1) + ["ep", "edp"] * (ep > 1):
                group = mesh.group(axis)
                ranks = torch.zeros(rt.world_size)
                ranks[rt.rank] = 1
                comm.all_reduce(ranks, group=group)  # who is in my group, as the group itself says
                members[axis] = [r for r in range(rt.world_size) if ranks[r]]
            torch_mesh = mesh.device_mesh("cpu")
            results[arg] = {
                "members": members, "coords": [mesh.dp_rank, mesh.pp_rank, mesh.cp_rank, mesh.tp_rank],
                "first": mesh.is_first_stage, "last": mesh.is_last_stage,
                "prev": mesh.prev_stage_rank, "next": mesh.next_stage_rank,
                "counted": {g: c["all_reduce"]["calls"] for g, c in comm.group_counts().items()},
                "torch": {axis: dist.get_process_group_ranks(torch_mesh.get_group(axis))
                          for axis in ("dp", "pp", "tp", *(("cp",) if cp > 1 else ()))},
            }
        report(**results)
""")


def run_meshes(tmp_path, nproc, layouts):
    script = tmp_path / "meshes.py"
    script.write_text(MESHES)
    res = launch(str(script), *["x".join(map(str, layout)) for layout in layouts], nproc=nproc, timeout=180,
                 run_dir=tmp_path / "run")
    return [res.report(r) for r in range(nproc)]


def check(reports, dp, pp, tp, cp=1, ep=1, expected_extra=None):
    """`expected_extra`: rank -> {group name: members} for the dp_cp, ep and edp groups, written out."""
    key = "x".join(map(str, (dp, pp, tp, cp, ep)[:3 if cp == ep == 1 else 5]))
    for rank, rep in enumerate(reports):
        got = rep[key]
        d, p, c, t = got["coords"]
        assert rank == ((d * pp + p) * cp + c) * tp + t
        axes = ("dp", "pp", "tp", *(("cp",) if cp > 1 else ()))
        for axis in axes:
            expected = next(g for g in groups_along(axis, degrees(dp, pp, tp, cp)) if rank in g)
            assert got["members"][axis] == sorted(expected), (rank, axis)
            assert got["torch"][axis] == sorted(expected), f"torch's DeviceMesh disagrees on rank {rank} {axis}"
        for name, members in (expected_extra or {}).get(rank, {}).items():
            assert got["members"][name] == members, (rank, name)
        assert set(got["members"]) == set(axes) | set((expected_extra or {}).get(rank, {}))
        assert got["counted"] == {name: 1 for name in got["members"]}, "each call is counted under its group's name"
        assert got["first"] == (p == 0) and got["last"] == (p == pp - 1)
        assert got["prev"] == (None if p == 0 else rank - tp * cp)
        assert got["next"] == (None if p == pp - 1 else rank + tp * cp)


@pytest.mark.multiprocess
def test_mesh_groups_on_four_ranks(tmp_path):
    layouts = [(1, 2, 2), (2, 1, 2), (2, 2, 1), (2, 1, 1, 2, 1), (4, 1, 1, 1, 2)]
    reports = run_meshes(tmp_path, 4, layouts)
    for layout in layouts[:3]:
        check(reports, *layout)
    # dp 2 x cp 2: rank = 2 d + c; the dense gradients are averaged over all four (DP-CP)
    check(reports, 2, 1, 1, cp=2, expected_extra={r: {"dp_cp": [0, 1, 2, 3]} for r in range(4)})
    # dp 4, ep 2: expert groups of consecutive d; the same experts (d mod 2) average their gradients
    check(reports, 4, 1, 1, ep=2, expected_extra={0: {"ep": [0, 1], "edp": [0, 2]}, 1: {"ep": [0, 1], "edp": [1, 3]},
                                                  2: {"ep": [2, 3], "edp": [0, 2]}, 3: {"ep": [2, 3], "edp": [1, 3]}})


@pytest.mark.multiprocess
@pytest.mark.slow
def test_mesh_groups_on_eight_ranks(tmp_path):
    reports = run_meshes(tmp_path, 8, [(2, 2, 2)])
    check(reports, 2, 2, 2)
