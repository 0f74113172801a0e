"""Where each rank of a dp x pp x cp x tp grid sits: the rank-grid widget and its static figure.

A job's ranks fill its nodes in order: node k holds ranks k*G to k*G + G - 1 (torchrun numbers
them node by node). Which ranks form a TP, CP, PP or DP group is decided by the rank order, the
order in which the coordinates vary. Mesh's order (labsupport/grid.py) varies TP fastest, then CP,
so a TP group is G-aligned neighbours on one node and a CP ring the next-closest ranks; vary DP
fastest and every TP group straddles nodes, and the all-reduces tensor parallelism runs after
every layer go over the network. Expert parallelism (ep) is no axis of its own: it cuts each DP
group into groups of ep consecutive DP ranks (Mesh's "ep" groups), drawn as one more colour.

    layout(dp, tp, pp, G, order, cp, ep)
                                   each rank's coordinates ((d, p, t), or (d, p, c, t) with cp > 1)
                                   and node, each group and whether it crosses nodes (pure: no
                                   torch, no ipywidgets)
    traffic_split(layout, counts)  a recorded run's per-group wire bytes, inside and across nodes
    describe(layout, split)        the readout's sentences
    rank_grid_figure(...)          nodes as boxes of G slots, ranks coloured by group (a legend names
                                   each group's ranks; "all": a band per axis, EP's below DP's),
                                   crossing groups outlined in red; with traffic, bytes per group beside it
    RankGridWidget(...)            controls -> the readout and the figure; .figure() for show()
"""
from __future__ import annotations

import html
from itertools import permutations
from typing import NamedTuple

from matplotlib import colormaps
from matplotlib.patches import FancyBboxPatch, Patch, Rectangle

from ..grid import AXES, GROUPS, THREE_D, axes_of, coordinates
from ..units import format_bytes
from .figure import NotebookFigure, bytes_axis, figure_png

ORDER = THREE_D[::-1]  # fastest to slowest: Mesh's order, rank = (d * pp + p) * tp + t (grid.py); cp goes next to tp
ORDERS = [ORDER] + [o for o in permutations(ORDER) if o != ORDER]
DRAWN = ("tp", "cp", "pp", "dp", "ep")  # what a figure can colour, in Mesh's order, fastest first, then EP within DP
COLOUR_BY = (*DRAWN, "all")
MAX_RANKS = 64  # more cells than this no longer read as a picture
# The process groups a run counts (comm.group_counts) and the group of the grid whose placement
# decides theirs: the embedding group is a pipeline's first and last stage (so it crosses nodes
# when its pipeline does); None is every rank.
GROUP_AXIS = {"tp": "tp", "cp": "cp", "pp": "pp", "embedding": "pp", "dp": "dp", "dp_cp": "dp_cp", "ep": "ep",
              "edp": "edp", "world": None}
# A group's colour. One axis: a hue per group. "All": the axis' hue, so that no band can be taken
# for another axis' group, a shade per group. No reds: red marks crossings.
PALETTE = [c for i, c in enumerate(colormaps["tab10"].colors) if i != 3]
HUES = {"tp": "Blues", "cp": "YlOrBr", "pp": "Greens", "dp": "Purples", "ep": "Greys"}
# What each axis' groups carry, for the sentence that says they cross nodes.
CROSSING_COST = {"tp": "the all-reduces after every layer", "cp": "the ring's K/V blocks at every layer",
                 "ep": "the all-to-all dispatch and combine at every MoE layer"}
LEGEND_GROUPS = 8  # per axis; more are summed up in one entry
CROSSING = "#d62728"


class Group(NamedTuple):
    ranks: tuple[int, ...]  # in order of the axis' coordinate
    crosses: bool           # its ranks sit on more than one node


class Layout(NamedTuple):
    """The rank grid placed on nodes (what `layout` returns): node k holds ranks k*G to k*G + G - 1."""

    dp: int
    tp: int
    pp: int
    devices_per_node: int
    order: tuple[str, ...]  # fastest to slowest; cp (when above 1) among them
    coords: tuple[tuple[int, ...], ...]  # of each rank, in `axes` order: (d, p, t), or (d, p, c, t)
    groups: dict  # "tp", "cp", "pp", "dp", "ep", and Mesh's "dp_cp" and "edp" -> [Group, ...]
    cp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def degrees(self) -> dict[str, int]:
        """{axis: degree}, as grid.py takes them."""
        return {axis: getattr(self, axis) for axis in AXES}

    @property
    def axes(self) -> tuple[str, ...]:
        """The coordinates of `coords`, slowest first: grid.THREE_D, with cp when it is above 1."""
        return axes_of(self.degrees)

    @property
    def drawn(self) -> tuple[str, ...]:
        """The groups a figure shows, fastest first: TP, CP (cp > 1), PP, DP, EP (ep > 1)."""
        return tuple(a for a in DRAWN if a not in ("cp", "ep") or getattr(self, a) > 1)

    @property
    def nodes(self) -> int:
        return -(-self.world_size // self.devices_per_node)

    def node(self, rank: int) -> int:
        return rank // self.devices_per_node

    def rank_at(self, coords: tuple[int, int, int]) -> int:
        return self.coords.index(tuple(coords))

    def group_of(self, axis: str, rank: int) -> Group:
        return next(g for g in self.groups[axis] if rank in g.ranks)

    def crossing(self, axis: str) -> list[Group]:
        return [g for g in self.groups[axis] if g.crosses]


def _group_key(name: str, c: dict, ep: int) -> tuple:
    """What the ranks of one group of `name` share: the coordinates that do not vary in it."""
    if name in AXES:
        return tuple(c[a] for a in AXES if a != name)
    if name == "dp_cp":  # the ranks that hold the same parameters under CP (Megatron-LM's DP-CP group)
        return c["pp"], c["tp"]
    split = c["dp"] // ep if name == "ep" else c["dp"] % ep  # "ep": ep consecutive d; "edp": the same d mod ep
    return c["pp"], c["cp"], c["tp"], split


def layout(dp: int, tp: int, pp: int, devices_per_node: int, order: tuple[str, ...] = ORDER, cp: int = 1,
           ep: int = 1) -> Layout:
    """The grid with the axes varying in `order` (fastest first) over nodes of `devices_per_node`.

    `order` names tp, pp and dp; with cp > 1 it may name cp too, else cp varies right after tp, as
    in Mesh's order. `ep` cuts each DP group into groups of ep consecutive DP ranks.
    """
    sizes = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "devices per node": devices_per_node}
    bad = [f"{name} = {n}" for name, n in sizes.items() if not (isinstance(n, int) and n >= 1)]
    if bad:
        raise ValueError(f"{', '.join(bad)}: each must be a whole number of at least 1")
    if dp % ep:
        raise ValueError(f"ep {ep} must divide dp {dp}: expert parallelism splits the data-parallel ranks")
    order = tuple(order)
    axes = axes_of({"cp": cp})
    if sorted(order) == sorted(THREE_D) and cp > 1:
        order = order[:order.index("tp") + 1] + ("cp",) + order[order.index("tp") + 1:]
    elif sorted(order) == sorted(AXES) and cp == 1:
        order = tuple(a for a in order if a != "cp")
    if sorted(order) != sorted(axes):
        raise ValueError(f"the rank order {order} must name each of tp, pp and dp once "
                         f"(and cp, or leave it next to tp)")
    coords = []
    for rank in range(dp * pp * cp * tp):
        c, rest = {"cp": 0}, rank
        for axis in order:
            c[axis], rest = rest % sizes[axis], rest // sizes[axis]
        coords.append(c)
    groups = {}
    for name in GROUPS:
        members = {}  # the shared coordinates -> ranks, ascending (along an axis, ranks ascend with it)
        for rank, c in enumerate(coords):
            members.setdefault(_group_key(name, c, ep), []).append(rank)
        # Nodes hold consecutive ranks, so a group crosses nodes when its first and last rank do.
        groups[name] = [Group(tuple(r), r[0] // devices_per_node != r[-1] // devices_per_node)
                        for _, r in sorted(members.items())]
    return Layout(dp, tp, pp, devices_per_node, order, tuple(tuple(c[a] for a in axes) for c in coords), groups, cp, ep)


def traffic_split(lay: Layout, comm_groups: list[dict]) -> dict:
    """{group name: {"inside": wire bytes, "across": wire bytes}} of one step of a recorded run,
    summed over ranks, if its ranks had been placed by `lay`.

    `comm_groups` is a `labsupport.train.run(...)` summary's list, rank by rank, of {group: {op:
    {calls, payload_bytes, wire_bytes}}}. The run's ranks were placed by Mesh, so rank r did the
    work of the coordinates grid.coordinates(r, degrees); the same coordinates send the same bytes
    wherever they sit. A group that spans nodes counts all its bytes as across:
    its ring's slowest hop, the network, sets its pace.
    """
    if len(comm_groups) != lay.world_size:
        raise ValueError(f"the counters are of {len(comm_groups)} ranks, the grid has {lay.world_size}")
    split = {}
    for rank, groups in enumerate(comm_groups):
        mesh = coordinates(rank, lay.degrees)
        here = lay.rank_at(tuple(mesh[a] for a in lay.axes))
        for name, ops in groups.items():
            if name not in GROUP_AXIS:
                raise ValueError(f"the counters name a group {name!r}; the grid knows {', '.join(GROUP_AXIS)}")
            axis = GROUP_AXIS[name]
            crosses = lay.nodes > 1 if axis is None else lay.group_of(axis, here).crosses
            side = split.setdefault(name, {"inside": 0, "across": 0})
            side["across" if crosses else "inside"] += sum(c["wire_bytes"] for c in ops.values())
    return {name: split[name] for name in GROUP_AXIS if name in split}


def _crossing_sentence(lay: Layout, axis: str) -> str:
    groups, crossing = lay.groups[axis], lay.crossing(axis)
    what = f"{axis.upper()} groups" + (f" ({lay.ep} consecutive DP ranks each, the experts spread over them)"
                                       if axis == "ep" else "")
    if not crossing:
        n = len(groups)
        return f"{what} stay inside a node ({n} group{'s' * (n > 1)} of {len(groups[0].ranks)})."
    example = ", ".join(map(str, crossing[0].ranks))
    sentence = f"{what} cross nodes: {len(crossing)} of {len(groups)} (e.g. ranks {example})"
    if axis in CROSSING_COST:
        sentence += f", so {CROSSING_COST[axis]} run at the network's speed"
    return sentence + "."


def describe(lay: Layout, split: dict | None = None) -> str:
    """What the layout does: where each axis' groups sit and, with a traffic split, what crosses nodes."""
    nodes = f"{lay.nodes} node{'s' if lay.nodes > 1 else ''}"
    text = (f"{lay.world_size} ranks on {nodes} of {lay.devices_per_node} devices, rank order "
            f"{', '.join(lay.order)} ({lay.order[0]} varies fastest). "
            + " ".join(_crossing_sentence(lay, axis) for axis in lay.drawn))
    if split is not None:
        total = sum(s["inside"] + s["across"] for s in split.values())
        across = {name: s["across"] for name, s in split.items() if s["across"]}
        text += (f" The run's step sends {format_bytes(total)} on the wire; {format_bytes(sum(across.values()))} "
                 "of it in groups that cross nodes"
                 + (f" ({', '.join(f'{name} {format_bytes(b)}' for name, b in across.items())})." if across else "."))
    return text


def group_colour(lay: Layout, axis: str, index: int, colour_by: str):
    """The colour of the axis' group number `index` when the grid is coloured by `colour_by`."""
    if colour_by != "all":
        return PALETTE[index % len(PALETTE)]
    return colormaps[HUES[axis]](0.3 + 0.6 * index / max(len(lay.groups[axis]) - 1, 1))


def _grid_name(dp: int, pp: int, cp: int, tp: int) -> str:
    """'dp 2 x pp 2 x tp 2', with 'cp 2 x ' before tp when there is context parallelism."""
    return f"dp {dp} x pp {pp} x " + (f"cp {cp} x " if cp > 1 else "") + f"tp {tp}"


def _coordinate_names(lay: Layout) -> str:
    return "(" + ",".join(a[0] for a in lay.axes) + ")"   # (d,p,t) or (d,p,c,t)


def _draw_cell(ax, lay: Layout, rank: int, x: float, y: float, colour_by: str, outlined: bool) -> None:
    """One rank: filled by its group's colour (with "all", a band per drawn axis: TP, CP, PP, DP, EP),
    labelled rank and coordinates."""
    axes = lay.drawn if colour_by == "all" else (colour_by,)
    band = 0.9 / len(axes)
    for k, axis in enumerate(axes):
        group = lay.groups[axis].index(lay.group_of(axis, rank))
        ax.add_patch(Rectangle((x, y + 0.9 - (k + 1) * band), 0.9, band,
                               facecolor=group_colour(lay, axis, group, colour_by), alpha=0.6, linewidth=0))
    ax.add_patch(Rectangle((x, y), 0.9, 0.9, fill=False, edgecolor=CROSSING if outlined else "dimgray",
                           linewidth=3 if outlined else 0.8))
    ax.text(x + 0.45, y + 0.58, str(rank), ha="center", va="center", fontsize=11, fontweight="bold")
    ax.text(x + 0.45, y + 0.25, "(" + ",".join(map(str, lay.coords[rank])) + ")", ha="center", va="center", fontsize=7)


def _ranks(ranks: tuple[int, ...]) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 4 else f"{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}"


def _legend_columns(lay: Layout, colour_by: str) -> list[list[Patch]]:
    """Which colour is which group: one column per axis coloured, each group with its ranks."""
    columns = []
    for axis in lay.drawn if colour_by == "all" else (colour_by,):
        groups = lay.groups[axis]
        column = [Patch(facecolor=group_colour(lay, axis, i, colour_by), alpha=0.6, edgecolor="dimgray",
                        label=f"{axis.upper()} group {i}: rank{'s' * (len(g.ranks) > 1)} {_ranks(g.ranks)}")
                  for i, g in enumerate(groups[:LEGEND_GROUPS])]
        if len(groups) > LEGEND_GROUPS:
            column.append(Patch(visible=False, label=f"... {len(groups) - LEGEND_GROUPS} more {axis.upper()} groups"))
        columns.append(column)
    return columns


def _draw_traffic(ax, split: dict) -> None:
    names = list(split)
    inside = [split[n]["inside"] for n in names]
    across = [split[n]["across"] for n in names]
    ax.bar(names, inside, color="#4C72B0", label="inside a node")
    ax.bar(names, across, bottom=inside, color="white", hatch="//", label="across nodes",
           edgecolor=[CROSSING if a else "none" for a in across])  # no red line on a group with nothing across
    bytes_axis(ax.yaxis)
    ax.set_ylabel("wire bytes per step, all ranks")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncols=2, fontsize=8, frameon=False)  # off the bars
    total = sum(inside) + sum(across)
    ax.set_title(f"{format_bytes(sum(across))} of {format_bytes(total)}\ncross nodes", fontsize=10,
                 color=CROSSING if sum(across) else "black")


def rank_grid_figure(dp: int = 2, tp: int = 2, pp: int = 2, devices_per_node: int = 4, order: tuple[str, ...] = ORDER,
                     colour_by: str = "tp", traffic: list[dict] | None = None, cp: int = 1, ep: int = 1):
    """A static Figure of the layout: one row of `devices_per_node` slots per node, each rank
    coloured by its group along `colour_by` ("all": a band per axis, TP, CP, PP, DP, then EP, each
    in its own hue), a legend column per axis naming each group's ranks, the ranks of groups that cross nodes
    outlined in red (with "all", TP's, the ones that must not). With
    `traffic` (a run summary's `comm_groups`), a bar panel: wire bytes per group, hatched across nodes."""
    if colour_by not in COLOUR_BY:
        raise ValueError(f"colour_by is one of {', '.join(COLOUR_BY)}, not {colour_by!r}")
    lay = layout(dp, tp, pp, devices_per_node, order, cp, ep)
    if lay.world_size > MAX_RANKS:
        raise ValueError(f"{lay.world_size} ranks are too many to draw: at most {MAX_RANKS}")
    split = None if traffic is None else traffic_split(lay, traffic)
    g = devices_per_node
    columns = _legend_columns(lay, colour_by)
    width = max(5.5, 0.9 * g + 1.2, 2.0 * len(columns))  # the legend's columns side by side under the nodes
    rows = max(map(len, columns))
    fig = NotebookFigure(figsize=(width + (3.2 if split else 0), 0.95 * lay.nodes + 1.6 + 0.2 * rows),
                         layout="constrained")
    fig.get_layout_engine().set(h_pad=0.08)  # the default 0.04 in lets the two-line titles touch
    if split:
        ax, bytes_ax = fig.subplots(1, 2, width_ratios=[width, 3.2])
        _draw_traffic(bytes_ax, split)
    else:
        ax = fig.subplots()
    marked = "tp" if colour_by == "all" else colour_by
    for node in range(lay.nodes):
        y = -1.3 * node
        ax.add_patch(FancyBboxPatch((-0.05, y - 0.05), g, 1.0, boxstyle="round,pad=0.08", facecolor="#f2f2f2",
                                    edgecolor="gray"))
        ax.text(-0.25, y + 0.45, f"node {node}", ha="right", va="center", fontsize=9)
        for slot, rank in enumerate(range(node * g, min(node * g + g, lay.world_size))):
            _draw_cell(ax, lay, rank, slot, y, colour_by, lay.group_of(marked, rank).crosses)
    ax.set_xlim(-1.3, g + 0.1)
    ax.set_ylim(-1.3 * (lay.nodes - 1) - 0.25, 1.1)
    ax.set_aspect("equal")
    ax.axis("off")
    if colour_by == "all":
        counts = ", ".join(f"{a.upper()} {len(lay.crossing(a))} of {len(lay.groups[a])}" for a in lay.drawn)
        bands = ", ".join(a.upper() for a in lay.drawn)
        title = f"groups that cross nodes: {counts}\nbands, top to bottom: {bands} group"
    else:
        title = f"{len(lay.crossing(marked))} of {len(lay.groups[marked])} {marked.upper()} groups cross nodes"
    ax.set_title(title, fontsize=10, color=CROSSING if lay.crossing(marked) else "black")
    grid = _grid_name(dp, pp, cp, tp) + (f", ep {ep} within dp" if ep > 1 else "")
    fig.suptitle(f"{grid}, rank order {', '.join(lay.order)} (fastest first)\neach cell: rank and "
                 f"{_coordinate_names(lay)}; outlined in red: its {marked.upper()} group crosses nodes", fontsize=10)
    blank = Patch(visible=False, label="")  # pads the shorter columns: the legend fills column by column
    fig.legend(handles=[h for column in columns for h in column + [blank] * (rows - len(column))],
               loc="outside lower center", ncols=len(columns), frameon=False, fontsize=8)
    return fig


class RankGridWidget:
    """Controls for dp, tp, pp, cp, ep, devices per node, the rank order and the colouring; shows which
    groups cross nodes (readout and figure) and, given a run's counters, the bytes that would.

    `RankGridWidget(order=("dp", "pp", "tp"))` in a notebook cell displays it. Its state is
    inspectable without a browser: set `w.controls["order"].value = ORDER` and `w.layout`,
    `w.split`, `w.text`, `w.readout.value` and `w.png` follow. `traffic=` takes a run summary
    (the controls start at its grid) or its `comm_groups` list (taken to be of the grid given);
    it is shown while dp, tp, pp, cp and ep match it, for any order and node size. Settings that cannot
    be drawn set `w.error` and say why in the readout.
    """

    def __init__(self, dp: int = 2, tp: int = 2, pp: int = 2, devices_per_node: int = 4, order: tuple = ORDER,
                 colour_by: str = "tp", traffic: list | dict | None = None, cp: int = 1, ep: int = 1):
        import ipywidgets as W

        if isinstance(traffic, dict):  # a run summary: its grid and its counters
            grid = traffic["parallel"]
            dp, tp, pp = (grid[k] for k in ("dp", "tp", "pp"))
            cp, ep = grid.get("cp", 1), grid.get("ep", 1)
            traffic = traffic["comm_groups"]
        self.traffic, self.traffic_grid = traffic, (dp, tp, pp, cp, ep)
        style = {"description_width": "160px"}
        c = self.controls = {
            "dp": W.BoundedIntText(value=dp, min=1, max=MAX_RANKS, description="data parallel", style=style),
            "tp": W.BoundedIntText(value=tp, min=1, max=MAX_RANKS, description="tensor parallel", style=style),
            "pp": W.BoundedIntText(value=pp, min=1, max=MAX_RANKS, description="pipeline stages", style=style),
            "cp": W.BoundedIntText(value=cp, min=1, max=MAX_RANKS, description="context parallel", style=style),
            "ep": W.BoundedIntText(value=ep, min=1, max=MAX_RANKS, description="expert parallel (in dp)",
                                   style=style),
            "devices_per_node": W.BoundedIntText(value=devices_per_node, min=1, max=MAX_RANKS,
                                                 description="devices per node", style=style),
            "order": W.Dropdown(options=[(", ".join(o) + (" (Mesh's)" if o == ORDER else ""), o) for o in ORDERS],
                                value=tuple(order), description="rank order, fastest first", style=style,
                                layout=W.Layout(width="380px")),
            "colour_by": W.ToggleButtons(options=list(COLOUR_BY), value=colour_by, description="colour by",
                                         style=style),
        }
        for name, control in c.items():  # so that a browser test, or a stylesheet, can find each one
            control.add_class(f"labsupport-rankgrid-{name.replace('_', '-')}")
        self.readout = W.HTML().add_class("labsupport-rankgrid-readout")
        # align_self: a VBox would otherwise stretch the picture to its width (blurred, not sharper).
        picture = W.Layout(max_width="100%", align_self="flex-start", margin="0")
        self.image = W.Image(format="png", layout=picture).add_class("labsupport-rankgrid-figure")
        self.widget = W.VBox([W.VBox(list(c.values())), self.readout, self.image])
        self.widget.add_class("labsupport-rankgrid")
        self.layout: Layout | None = None
        self.split: dict | None = None
        self.error: str | None = None
        self.text = ""
        self.png = b""
        for control in c.values():
            control.observe(lambda change: self.update(), names="value")
        self.update()

    def options(self) -> dict:
        """The current control values as keywords of `rank_grid_figure` (traffic aside)."""
        return {name: control.value for name, control in self.controls.items()}

    def counted(self) -> list | None:
        """The run's counters when the grid is theirs, else None."""
        o = self.options()
        return self.traffic if tuple(o[k] for k in ("dp", "tp", "pp", "cp", "ep")) == self.traffic_grid else None

    def update(self) -> Layout | None:
        """Redraw from the controls; returns the layout, or None (and sets `error`) if it cannot be drawn."""
        o, counted = self.options(), self.counted()
        try:
            self.png = figure_png(rank_grid_figure(**o, traffic=counted))
        except ValueError as e:
            self.layout, self.split, self.error = None, None, str(e)
            self.text = f"Not a grid to draw: {e}"
            self.readout.value = f"<span style='color:#b00'>{html.escape(self.text)}</span>"
            self.image.layout.display = "none"
            return None
        self.error = None
        lay = self.layout = layout(o["dp"], o["tp"], o["pp"], o["devices_per_node"], o["order"], o["cp"], o["ep"])
        self.split = None if counted is None else traffic_split(lay, counted)
        self.text = describe(lay, self.split)
        if self.traffic is not None and counted is None:
            dp, tp, pp, cp, ep = self.traffic_grid
            grid = _grid_name(dp, pp, cp, tp) + (f", ep {ep}" if ep > 1 else "")
            self.text += f" (The counters are of {grid}: set those back to see them.)"
        shown = html.escape(self.text)
        if lay.crossing("tp"):
            tp_sentence = html.escape(_crossing_sentence(lay, "tp"))
            shown = shown.replace(tp_sentence, f"<b style='color:#b00'>{tp_sentence}</b>", 1)
        self.readout.value = f"<div style='max-width:960px'>{shown}</div>"
        self.image.value = self.png
        self.image.layout.display = None
        return lay

    def figure(self):
        """A static Figure of what the widget shows now: the stand-in for `show(widget, figure)`."""
        return rank_grid_figure(**self.options(), traffic=self.counted())

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
