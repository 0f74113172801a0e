"""The rank-grid widget: its default order is grid.py's (Mesh's); a bad order puts TP across nodes. No browser needed."""
import base64

import matplotlib
import pytest

matplotlib.use("Agg")

from labsupport.grid import AXES, THREE_D, coordinates, groups_along, rank_of  # noqa: E402
from labsupport.widgets import rank_grid as rg  # noqa: E402
from labsupport.widgets import show as sh  # noqa: E402
from figures import cut_off_controls, figure_defects  # noqa: E402

BAD_ORDER = ("dp", "pp", "tp")  # DP fastest: notebook 06's find-the-bug lab


def counts(wire_bytes: int) -> dict:
    return {"all_reduce": {"calls": 1, "payload_bytes": wire_bytes, "wire_bytes": wire_bytes}}


def outlined(fig) -> int:
    """How many cells carry the red outline of a crossing group."""
    return sum(1 for p in fig.axes[0].patches if p.get_linewidth() == 3)


@pytest.mark.parametrize("dp,tp,pp", [(1, 1, 1), (2, 2, 2), (4, 2, 1), (1, 4, 2), (3, 2, 4)])
def test_the_default_order_is_meshs(dp, tp, pp):
    lay = rg.layout(dp, tp, pp, devices_per_node=4)
    degrees = {"dp": dp, "pp": pp, "tp": tp}
    assert lay.axes == THREE_D
    for rank in range(dp * tp * pp):
        assert lay.coords[rank] == tuple(coordinates(rank, degrees)[a] for a in THREE_D)
        assert lay.node(rank) == rank // 4
    for axis in THREE_D:
        assert [list(g.ranks) for g in lay.groups[axis]] == groups_along(axis, degrees)


def test_dp_fastest_puts_every_tp_group_across_nodes():
    good = rg.layout(dp=2, tp=2, pp=1, devices_per_node=2)
    assert [g.ranks for g in good.groups["tp"]] == [(0, 1), (2, 3)] and not good.crossing("tp")
    assert [g.ranks for g in good.crossing("dp")] == [(0, 2), (1, 3)]
    bad = rg.layout(dp=2, tp=2, pp=1, devices_per_node=2, order=BAD_ORDER)
    assert bad.coords == ((0, 0, 0), (1, 0, 0), (0, 0, 1), (1, 0, 1))
    assert bad.groups["tp"] == [rg.Group((0, 2), True), rg.Group((1, 3), True)]
    assert not bad.crossing("dp") and bad.rank_at((1, 0, 1)) == 3 and bad.nodes == 2
    assert "TP groups cross nodes: 2 of 2 (e.g. ranks 0, 2)" in rg.describe(bad)
    assert "TP groups stay inside a node (2 groups of 2)." in rg.describe(good)
    with pytest.raises(ValueError, match="each of tp, pp and dp once"):
        rg.layout(2, 2, 1, 2, order=("tp", "tp", "dp"))
    with pytest.raises(ValueError, match="tp = 0"):
        rg.layout(2, 0, 1, 2)


def test_traffic_follows_the_coordinates_to_their_new_place():
    """pp 3 x tp 2 on nodes of 4: Mesh's order keeps TP inside; with PP fastest the TP groups
    are (0, 3), (1, 4), (2, 5), and two of them cross. Rank r of the run sends 10^r bytes in its
    TP group, so the split shows which coordinates moved where."""
    run = [{"tp": counts(10**rank), "pp": counts(7), "embedding": counts(1)} for rank in range(6)]
    mesh_order = rg.layout(1, 2, 3, 4)
    assert rg.traffic_split(mesh_order, run) == {"tp": {"inside": 111111, "across": 0},
                                                 "pp": {"inside": 0, "across": 42},
                                                 "embedding": {"inside": 0, "across": 6}}
    pp_fastest = rg.layout(1, 2, 3, 4, order=("pp", "tp", "dp"))
    assert [g.crosses for g in pp_fastest.groups["tp"]] == [False, True, True]
    # the crossing groups hold (p, t) = (1, 0), (1, 1), (2, 0), (2, 1): the run's ranks 2 to 5
    assert rg.traffic_split(pp_fastest, run)["tp"] == {"inside": 1 + 10, "across": 10**2 + 10**3 + 10**4 + 10**5}
    one_node = rg.layout(1, 2, 3, 8)
    assert rg.traffic_split(one_node, [{"world": counts(5)}] * 6) == {"world": {"inside": 30, "across": 0}}
    assert rg.traffic_split(mesh_order, [{"world": counts(5)}] * 6) == {"world": {"inside": 0, "across": 30}}
    with pytest.raises(ValueError, match="of 2 ranks, the grid has 6"):
        rg.traffic_split(mesh_order, run[:2])
    with pytest.raises(ValueError, match="group 'group42'"):
        rg.traffic_split(mesh_order, [{"group42": counts(1)}] * 6)


def test_controls_update_the_readout_and_the_figure():
    w = rg.RankGridWidget(dp=2, tp=2, pp=2, devices_per_node=4)
    assert w.layout == rg.layout(2, 2, 2, 4) and w.text == rg.describe(w.layout)
    assert "DP groups cross nodes: 4 of 4" in w.text and "TP groups cross" not in w.text
    pngs = {w.png}
    w.controls["order"].value = BAD_ORDER
    assert "TP groups cross nodes: 4 of 4 (e.g. ranks 0, 4)" in w.text and w.png not in pngs
    assert "<b style='color:#b00'>TP groups cross nodes" in w.readout.value
    pngs.add(w.png)
    for name, value in [("colour_by", "all"), ("devices_per_node", 8), ("pp", 1), ("dp", 4)]:
        w.controls[name].value = value
        assert w.png not in pngs, f"{name} = {value} did not redraw"
        pngs.add(w.png)
    assert w.layout == rg.layout(4, 2, 1, 8, BAD_ORDER) and "TP groups stay inside a node" in w.text
    assert [label for label, _ in w.controls["order"].options][0] == "tp, pp, dp (Mesh's)"

    w.controls["dp"].value = 64  # 128 ranks: said, not raised
    assert w.layout is None and "too many to draw: at most 64" in w.error
    assert w.text.startswith("Not a grid to draw") and "color:#b00" in w.readout.value
    assert w.image.layout.display == "none"
    w.controls["dp"].value = 2
    assert w.error is None and w.image.layout.display is None


def test_a_runs_counters_are_split_while_the_grid_is_theirs():
    comm_groups = [{"tp": counts(1000), "dp": counts(100)} for _ in range(4)]
    summary = {"parallel": {"dp": 2, "tp": 2, "pp": 1}, "comm_groups": comm_groups}
    w = rg.RankGridWidget(devices_per_node=2, traffic=summary)
    assert (w.controls["dp"].value, w.controls["tp"].value, w.controls["pp"].value) == (2, 2, 1)
    assert w.split == {"tp": {"inside": 4000, "across": 0}, "dp": {"inside": 0, "across": 400}}
    assert "sends 4.40 kB on the wire; 400 B of it in groups that cross nodes (dp 400 B)." in w.text
    w.controls["order"].value = BAD_ORDER
    assert w.split == {"tp": {"inside": 0, "across": 4000}, "dp": {"inside": 400, "across": 0}}
    bytes_ax = w.figure().axes[1]
    assert [p.get_height() for p in bytes_ax.patches] == [0, 400, 4000, 0]  # inside bars, then across on top
    assert bytes_ax.get_title() == "4.00 kB of 4.40 kB\ncross nodes"
    w.controls["pp"].value = 2
    assert w.split is None and len(w.figure().axes) == 1
    assert w.text.endswith("(The counters are of dp 2 x pp 1 x tp 2: set those back to see them.)")
    bare = rg.RankGridWidget(dp=2, tp=2, pp=1, devices_per_node=2, traffic=comm_groups)
    assert bare.split == {"tp": {"inside": 4000, "across": 0}, "dp": {"inside": 0, "across": 400}}


def test_static_figure_stands_in_for_the_widget(monkeypatch):
    w = rg.RankGridWidget(dp=2, tp=2, pp=1, devices_per_node=2, order=BAD_ORDER)
    fig = w.figure()
    assert fig.axes[0].get_title() == "2 of 2 TP groups cross nodes" and outlined(fig) == 4
    assert fig.get_suptitle().startswith("dp 2 x pp 1 x tp 2, rank order dp, pp, tp (fastest first)")
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels[:3] == ["node 0", "0", "(0,0,0)"] and "(1,0,1)" in labels
    good = rg.rank_grid_figure(2, 2, 1, 2, colour_by="dp")
    assert good.axes[0].get_title() == "2 of 2 DP groups cross nodes" and outlined(good) == 4
    assert outlined(rg.rank_grid_figure(2, 2, 1, 2)) == 0
    everything = rg.rank_grid_figure(2, 2, 1, 2, order=BAD_ORDER, colour_by="all")
    assert everything.axes[0].get_title().startswith("groups that cross nodes: TP 2 of 2, PP 0 of 4, DP 0 of 2")
    with pytest.raises(ValueError, match="colour_by is one of"):
        rg.rank_grid_figure(colour_by="sp")
    assert w.png.startswith(b"\x89PNG") and w.image.value == w.png

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append(obj))
    sh.show(w, w.figure())
    (bundle,) = shown
    assert sh.WIDGET_VIEW in bundle and base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")


def test_the_legend_says_which_colour_is_which_group():
    """Issue 18: with colour_by="all" the three bands shared one palette and nothing said which
    group a colour was. Each axis now has its own hue, and the legend has a column per axis that
    names every group's ranks in the colour its cells carry."""
    lay = rg.layout(2, 2, 2, 4)
    fig = rg.rank_grid_figure(2, 2, 2, 4, colour_by="all")
    (legend,) = fig.legends
    entries = [(t.get_text(), h.get_facecolor()) for t, h in zip(legend.get_texts(), legend.legend_handles)]
    assert legend._ncols == 3 and len(entries) == 12  # 4 groups per axis, one column each
    cells = {}  # (band's lower edge, colour) of every band, by rank
    for patch in fig.axes[0].patches:
        if patch.get_linewidth() == 0:  # a band, not a cell's outline or a node's box
            x, y = patch.get_xy()
            cells.setdefault(round(x) + 4 * round(-y / 1.3), []).append((y, patch.get_facecolor()))
    for k, axis in enumerate(rg.ORDER):
        for i, group in enumerate(lay.groups[axis]):
            text, colour = entries[4 * k + i]
            assert text == f"{axis.upper()} group {i}: ranks {', '.join(map(str, group.ranks))}"
            for rank in group.ranks:  # the band k from the top of each of its cells
                assert sorted(cells[rank], key=lambda band: -band[0])[k][1] == colour, (axis, i, rank)
    hues = {axis: {entries[4 * k + i][1][:3] for i in range(4)} for k, axis in enumerate(rg.ORDER)}
    assert not (hues["tp"] & hues["pp"] or hues["pp"] & hues["dp"] or hues["tp"] & hues["dp"])
    (one_axis,) = rg.rank_grid_figure(2, 2, 2, 4, order=BAD_ORDER).legends
    assert [t.get_text() for t in one_axis.get_texts()] == [
        f"TP group {i}: ranks {a}, {b}" for i, (a, b) in enumerate([(0, 4), (2, 6), (1, 5), (3, 7)])]
    many = [t.get_text() for t in rg.rank_grid_figure(32, 2, 1, 8, colour_by="tp").legends[0].get_texts()]
    assert len(many) == rg.LEGEND_GROUPS + 1 and many[-1] == f"... {32 - rg.LEGEND_GROUPS} more TP groups"


@pytest.mark.parametrize("grid", [dict(colour_by="all"), dict(order=BAD_ORDER),
                                  dict(dp=4, tp=2, pp=1, devices_per_node=8),
                                  dict(dp=8, tp=4, pp=2, devices_per_node=8, colour_by="all"),
                                  dict(dp=1, tp=1, pp=1, devices_per_node=1, colour_by="dp"),
                                  dict(dp=2, tp=2, pp=2, cp=2, devices_per_node=8, colour_by="all"),
                                  dict(dp=4, tp=2, pp=1, cp=2, ep=2, devices_per_node=8, colour_by="all"),
                                  dict(dp=4, tp=2, pp=1, ep=2, devices_per_node=4, colour_by="ep")])
def test_nothing_in_the_figure_is_cut_off_covered_or_on_top_of_another(grid):
    assert figure_defects(rg.rank_grid_figure(**grid)) == []
    traffic = [{"tp": counts(10**6), "pp": counts(10**4), "embedding": counts(10), "dp": counts(10**5)}] * 8
    assert figure_defects(rg.rank_grid_figure(2, 2, 2, 4, order=BAD_ORDER, traffic=traffic)) == []


def test_the_controls_show_their_whole_labels():
    """Issue 18: "rank order, fastest first" was cut to "rank order, fastes..." in JupyterLab."""
    assert cut_off_controls(rg.RankGridWidget().controls) == []


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_real_runs_counters_read_back():
    """`labsupport.train.run` on 2 TP ranks, one device per node: all of its traffic crosses nodes."""
    from labsupport.train import run

    res = run(strategy="tp", nproc=2, tp=2, model="nano", steps=1, global_batch=2, micro_batch=1,
              sample_chars=0, eval_batches=0)
    w = rg.RankGridWidget(devices_per_node=1, traffic=res)
    assert w.layout == rg.layout(1, 2, 1, 1)
    sent = sum(c["wire_bytes"] for rank in res["comm_groups"] for c in rank["tp"].values())
    assert sent > 0 and w.split == {"tp": {"inside": 0, "across": sent}}
    w.controls["devices_per_node"].value = 2
    assert w.split == {"tp": {"inside": sent, "across": 0}}



def test_a_group_with_nothing_across_nodes_draws_no_red_edge():
    """Issue 18 follow-up: with DP fastest the figure said 0 DP bytes cross nodes, yet DP's bar had a red
    edge: a zero-height "across" bar outlined in red. Only a group with bytes across is outlined."""
    traffic = [{"tp": counts(10**6), "pp": counts(10**4), "dp": counts(10**5)}] * 8
    fig = rg.rank_grid_figure(2, 2, 2, 4, order=BAD_ORDER, traffic=traffic)
    split = rg.traffic_split(rg.layout(2, 2, 2, 4, order=BAD_ORDER), traffic)
    across = [bar for bar in fig.axes[-1].patches if bar.get_hatch()]
    assert len(across) == len(split) and any(s["across"] == 0 for s in split.values())
    for bar, side in zip(across, split.values()):
        assert (bar.get_edgecolor()[3] > 0) == (side["across"] > 0), (side, bar.get_edgecolor())


# ---------------------------------------------------------------- context and expert parallelism

@pytest.mark.parametrize("dp,pp,cp,tp", [(1, 1, 2, 1), (2, 1, 2, 2), (1, 2, 4, 2), (2, 2, 2, 2), (3, 1, 2, 1)])
def test_cp_varies_between_pp_and_tp_as_in_mesh(dp, pp, cp, tp):
    """grid.py: rank = ((d pp + p) cp + c) tp + t. Each rank's (d, p, c, t), each axis' groups, and the ranks that
    hold the same parameters (Mesh's dp_cp group: every d and c for one p and t) are grid.py's."""
    lay = rg.layout(dp, tp, pp, devices_per_node=4, cp=cp)
    degrees = {"dp": dp, "pp": pp, "cp": cp, "tp": tp}
    assert lay.axes == AXES and lay.order == ("tp", "cp", "pp", "dp") and lay.world_size == dp * pp * cp * tp
    for rank in range(lay.world_size):
        assert lay.coords[rank] == tuple(coordinates(rank, degrees).values())
    for axis in AXES:
        assert [list(g.ranks) for g in lay.groups[axis]] == groups_along(axis, degrees), axis
    assert sorted(g.ranks for g in lay.groups["dp_cp"]) == sorted(
        tuple(sorted(rank_of({"dp": d, "pp": p, "cp": c, "tp": t}, degrees) for d in range(dp) for c in range(cp)))
        for p in range(pp) for t in range(tp))


def test_cp_stays_next_to_tp_and_crosses_nodes_when_dp_varies_fastest():
    """dp 2 x cp 2 x tp 2 on nodes of 4: Mesh's order keeps each CP ring (0, 2), (1, 3), ... on a node; with DP
    fastest, cp one step slower than tp, the rings are (0, 4), ...: every one crosses."""
    good = rg.layout(2, 2, 1, 4, cp=2)
    assert [g.ranks for g in good.groups["cp"]] == [(0, 2), (1, 3), (4, 6), (5, 7)] and not good.crossing("cp")
    assert "CP groups stay inside a node (4 groups of 2)." in rg.describe(good)
    bad = rg.layout(2, 2, 1, 4, order=BAD_ORDER, cp=2)
    assert bad.order == ("dp", "pp", "tp", "cp") and bad.coords[1] == (1, 0, 0, 0) and bad.coords[4] == (0, 0, 1, 0)
    assert [g.ranks for g in bad.groups["cp"]] == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert ("CP groups cross nodes: 4 of 4 (e.g. ranks 0, 4), so the ring's K/V blocks at every layer run at the "
            "network's speed.") in rg.describe(bad)
    assert rg.layout(2, 2, 1, 4, order=("cp", "tp", "pp", "dp"), cp=2).groups["cp"][0].ranks == (0, 1)
    assert rg.layout(2, 2, 1, 4, order=("tp", "cp", "pp", "dp")) == rg.layout(2, 2, 1, 4)  # cp 1: no axis
    with pytest.raises(ValueError, match=r"must name each of tp, pp and dp once \(and cp"):
        rg.layout(2, 2, 1, 4, order=("tp", "cp", "cp", "dp"), cp=2)


def test_ep_cuts_each_dp_group_into_groups_of_consecutive_dp_ranks():
    """Mesh's ep groups: each DP group, in order of d, cut into groups of ep; the edp groups hold the same experts
    (same d mod ep). dp 4 x tp 2 on nodes of 4: the DP groups are (0, 2, 4, 6) and (1, 3, 5, 7)."""
    lay = rg.layout(4, 2, 1, 4, ep=2)
    assert [g.ranks for g in lay.groups["ep"]] == [(0, 2), (4, 6), (1, 3), (5, 7)]
    assert [g.ranks for g in lay.groups["edp"]] == [(0, 4), (2, 6), (1, 5), (3, 7)]
    assert lay.drawn == ("tp", "pp", "dp", "ep") and not lay.crossing("ep")
    ep_groups = "EP groups (2 consecutive DP ranks each, the experts spread over them)"
    assert f"{ep_groups} stay inside a node" in rg.describe(lay)
    small_nodes = rg.describe(rg.layout(4, 2, 1, 2, ep=2))
    assert f"{ep_groups} cross nodes: 4 of 4" in small_nodes
    assert "so the all-to-all dispatch and combine at every MoE layer run at the network's speed" in small_nodes
    with pytest.raises(ValueError, match="ep 3 must divide dp 4"):
        rg.layout(4, 2, 1, 4, ep=3)


def test_a_cp_runs_counters_follow_their_coordinates():
    """dp 2 x cp 2 x tp 1: Mesh's CP rings are (0, 1) and (2, 3). Placed with DP fastest, rank r's coordinates move
    to where (d, p, c, t) now sit; nodes of 2 put each ring across. A rank's c counts as much as its d, p and t."""
    run = [{"cp": counts(10**rank), "dp_cp": counts(1)} for rank in range(4)]
    assert rg.traffic_split(rg.layout(2, 1, 1, 2, cp=2), run) == {"cp": {"inside": 1111, "across": 0},
                                                                  "dp_cp": {"inside": 0, "across": 4}}
    assert rg.traffic_split(rg.layout(2, 1, 1, 2, order=BAD_ORDER, cp=2), run)["cp"] == {"inside": 0, "across": 1111}
    # nodes of 3 hold ranks 0-2 and 3: DP group (0, 2) stays inside, (1, 3) crosses; rank 1 is (d, c) = (0, 1)
    dp_bytes = [{"dp": counts(10**rank)} for rank in range(4)]
    assert rg.traffic_split(rg.layout(2, 1, 1, 3, cp=2), dp_bytes) == {"dp": {"inside": 101, "across": 1010}}


def test_the_figure_draws_cp_between_pp_and_tp_and_ep_within_dp():
    fig = rg.rank_grid_figure(4, 2, 1, 8, cp=2, ep=2, colour_by="all")
    assert fig.get_suptitle().startswith("dp 4 x pp 1 x cp 2 x tp 2, ep 2 within dp, rank order tp, cp, pp, dp "
                                         "(fastest first)\neach cell: rank and (d,p,c,t)")
    assert fig.axes[0].get_title().endswith("bands, top to bottom: TP, CP, PP, DP, EP group")
    (legend,) = fig.legends
    assert legend._ncols == 5 and "CP group 0: ranks 0, 2" in [t.get_text() for t in legend.get_texts()]
    assert "EP group 0: ranks 0, 4" in [t.get_text() for t in legend.get_texts()]
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels[:3] == ["node 0", "0", "(0,0,0,0)"] and "(3,0,1,1)" in labels
    bands = [p for p in fig.axes[0].patches if p.get_linewidth() == 0]
    assert len(bands) == 16 * 5


def test_the_widget_has_cp_and_ep_controls():
    w = rg.RankGridWidget(dp=2, tp=2, pp=1, devices_per_node=4)
    w.controls["cp"].value = 2
    assert w.layout == rg.layout(2, 2, 1, 4, cp=2) and "CP groups stay inside a node" in w.text
    w.controls["ep"].value = 2
    assert w.layout.ep == 2 and "EP groups" in w.text
    w.controls["ep"].value = 3
    assert w.layout is None and "ep 3 must divide dp 2" in w.error
    summary = {"parallel": {"dp": 2, "tp": 1, "pp": 1, "cp": 2, "ep": 1},
               "comm_groups": [{"cp": counts(10**rank)} for rank in range(4)]}
    run = rg.RankGridWidget(devices_per_node=2, traffic=summary)
    assert run.options()["cp"] == 2 and run.split == {"cp": {"inside": 1111, "across": 0}}
    run.controls["cp"].value = 1
    assert run.split is None and run.text.endswith("(The counters are of dp 2 x pp 1 x cp 2 x tp 1: set those back "
                                                   "to see them.)")
