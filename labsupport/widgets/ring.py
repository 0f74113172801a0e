"""The ring-attention stepper: watch the K/V blocks go round a ring of cp ranks for causal attention.

What it draws is the schedule of `labsupport.parallel.context`, on names instead of tensors:

    ring_walkthrough(cp, balanced)   which K/V block each rank holds at each step, and which blocks of
                                     the score matrix it computes (whole, causal inside) or skips
    online_softmax_trace(...)        one query row per rank: the running max m and sum l of the online
                                     softmax (Milakov & Gimelshein 2018) as each block is merged in
    ring_figure(cp, balanced, step)  the picture as a static Figure
    RingWidget(cp, balanced)         ranks and split menus; step / back / play / reset

The score matrix is cut on the split's grid of chunks: cp chunks for the plain split (rank r holds
chunk r), 2 cp for the balanced one (rank r holds chunks r and 2 cp - 1 - r). A chunk of keys is
all before a chunk of queries (every score visible), the same chunk (causal inside it) or all
after it (hidden by the mask: skipped, as the library skips it). The per-rank counts of computed
chunk pairs times the chunk's positions squared are the scores `ring_attention` counts.

The running max and sum use made-up scores (a seeded random number per query and key position):
the merge rule is what is shown, not a model's values. m = max(m, m_b), l = l e^(m - m') + l_b
e^(m_b - m'), and at the end m + log l is the log-sum-exp of every visible score.
"""
from __future__ import annotations

import html
import math
import random
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import Polygon, Rectangle
from matplotlib.ticker import PercentFormatter

from .collectives import RANK_COLORS, wrap_words
from .figure import NotebookFigure, Stepper, figure_png

UI_SIZES = (2, 3, 4, 5, 6, 8)  # ranks offered in the menu
FONT = 9  # points: 12.5 px at DPI 100, readable at 4 ranks
DPI = 100
# JupyterLab's output area is 848 px wide in a 1280-px window with the file browser open (JupyterLab 4, Chromium;
# measured): at 4 ranks the picture is drawn narrower than that, either split, so it is shown at its own size.
# Wider pictures (the balanced split on 5 ranks or more) are scaled down to the output area, never cut.
WIDTH_IN = 8.2      # inches at DPI: 820 px, room for the state lines of the static figure
PANEL_IN = 3.8      # beside the score matrix: the load panel and the margins around it
SKIPPED = "#eeeeee"  # a block the causal mask hides


@dataclass(frozen=True)
class Block:
    """One chunk of queries against one chunk of keys, computed by `rank` at `step`."""
    rank: int
    step: int
    q_chunk: int
    k_chunk: int
    causal: bool  # the same chunk: causal inside it


@dataclass(frozen=True)
class RingWalk:
    """Ring attention's schedule on cp ranks: chunks held, blocks computed per step."""
    cp: int
    balanced: bool
    chunks: list[list[int]]      # chunks[r]: the chunks rank r holds (queries, and its own K/V)
    held: list[list[int]]        # held[step][r]: whose K/V block rank r holds at that step
    blocks: list[list[Block]]    # blocks[step]: every block computed at that step
    skipped: list[list[int]]     # skipped[step][r]: chunk pairs rank r skips at that step (hidden)

    @property
    def n_chunks(self) -> int:
        return len(self.chunks) * len(self.chunks[0])

    def computed(self, rank: int, upto: int | None = None) -> int:
        """Chunk pairs rank `rank` computes in steps 0..upto (all steps: None)."""
        last = self.cp - 1 if upto is None else upto
        return sum(b.rank == rank for step in self.blocks[:last + 1] for b in step)

    def share(self, rank: int, upto: int | None = None) -> float:
        """The part of the s x s score matrix rank `rank` computes in steps 0..upto (a causal block whole),
        comparable between the splits."""
        return self.computed(rank, upto) / self.n_chunks ** 2


def chunks_of(rank: int, cp: int, balanced: bool) -> list[int]:
    """The chunks of the split's grid that rank `rank` holds."""
    return [rank, 2 * cp - 1 - rank] if balanced else [rank]


def ring_walkthrough(cp: int, balanced: bool = True) -> RingWalk:
    """The schedule of ring attention with a causal mask: at step t rank r holds rank (r - t)'s block."""
    if cp < 2:
        raise ValueError(f"a ring needs at least 2 ranks, got {cp}")
    chunks = [chunks_of(r, cp, balanced) for r in range(cp)]
    held, blocks, skipped = [], [], []
    for step in range(cp):
        owners = [(r - step) % cp for r in range(cp)]
        held.append(owners)
        pairs = [(r, q, k) for r in range(cp) for q in chunks[r] for k in chunks[owners[r]]]
        blocks.append([Block(r, step, q, k, q == k) for r, q, k in pairs if k <= q])
        skipped.append([sum(k > q for rr, q, k in pairs if rr == r) for r in range(cp)])
    return RingWalk(cp, balanced, chunks, held, blocks, skipped)


def _score(query: int, key: int) -> float:
    """A made-up score for a query and a key position (the same on every call)."""
    return random.Random(f"{query},{key}").gauss(0.0, 1.5)


def online_softmax_trace(walk: RingWalk, rank: int, seq_len: int | None = None) -> list[dict]:
    """The online softmax of rank `rank`'s last query position, step by step: per step the block's
    max and sum over the keys it may see (`block_m`, `block_l`, None when it sees none), and the
    merged `m`, `l` after it (None before any key). `seq_len` defaults to 2 positions a chunk."""
    per_chunk = (seq_len or 2 * walk.n_chunks) // walk.n_chunks
    query = (walk.chunks[rank][-1] + 1) * per_chunk - 1
    m = l = None
    trace = []
    for step in range(walk.cp):
        keys = [c * per_chunk + i for c in walk.chunks[walk.held[step][rank]] for i in range(per_chunk)]
        scores = [_score(query, key) for key in keys if key <= query]
        block_m = max(scores) if scores else None
        block_l = sum(math.exp(s - block_m) for s in scores) if scores else None
        if block_m is not None:
            new_m = block_m if m is None else max(m, block_m)
            l = block_l * math.exp(block_m - new_m) + (0.0 if m is None else l * math.exp(m - new_m))
            m = new_m
        trace.append({"query": query, "keys": len(scores), "block_m": block_m, "block_l": block_l, "m": m, "l": l})
    return trace


def state_lines(walk: RingWalk, k: int) -> list[str]:
    """One line per rank after step k: the block it holds, what it computed, the running max and sum."""
    lines = []
    for r in range(walk.cp):
        owner = walk.held[k][r]
        mine = [b for b in walk.blocks[k] if b.rank == r]
        t = online_softmax_trace(walk, r)[k]
        work = f"{len(mine)} block{'s' if len(mine) != 1 else ''}" if mine else "idle"
        skip = f", {walk.skipped[k][r]} skipped" if walk.skipped[k][r] else ""
        if t["block_m"] is None:
            merge = f"row {t['query']}: sees no key here"
        else:
            merge = (f"row {t['query']}: block m {t['block_m']:+.2f} l {t['block_l']:.2f} -> "
                     f"m {t['m']:+.2f} l {t['l']:.2f}")
        held = "own K/V" if owner == r else f"K/V of rank {owner}"
        lines.append(f"rank {r}: {held:<14} {work}{skip}; total {walk.computed(r, k)}.  {merge}")
    return lines


# ---------------------------------------------------------------- drawing

def _draw_matrix(ax, walk: RingWalk, k: int, fontsize: float) -> None:
    """The score matrix on the chunk grid: queries down, keys across; blocks computed up to step k
    in their rank's colour (this step's solid, earlier ones pale), the masked half grey."""
    n = walk.n_chunks
    done = {(b.q_chunk, b.k_chunk): b for step in walk.blocks[:k + 1] for b in step}
    for q in range(n):
        for key in range(n):
            b = done.get((q, key))
            if key > q:
                ax.add_patch(Rectangle((key, q), 1, 1, facecolor=SKIPPED, edgecolor="white", lw=1))
                continue
            if b is None:
                ax.add_patch(Rectangle((key, q), 1, 1, facecolor="white", edgecolor="#cccccc", lw=0.8))
                continue
            color, alpha = RANK_COLORS[b.rank % len(RANK_COLORS)], 1.0 if b.step == k else 0.4
            if b.causal:  # causal inside the block: only its lower triangle is computed
                ax.add_patch(Rectangle((key, q), 1, 1, facecolor="white", edgecolor="#cccccc", lw=0.8))
                ax.add_patch(Polygon([(key, q), (key, q + 1), (key + 1, q + 1)], facecolor=color, alpha=alpha,
                                     edgecolor="#555555" if b.step == k else "none", lw=0.8))
            else:
                ax.add_patch(Rectangle((key, q), 1, 1, facecolor=color, alpha=alpha, edgecolor="white", lw=1))
            if b.step == k:
                ax.text(key + (0.3 if b.causal else 0.5), q + (0.72 if b.causal else 0.5), f"r{b.rank}",
                        ha="center", va="center", fontsize=fontsize)
    ax.set_xlim(0, n)
    ax.set_ylim(n, 0)
    ax.set_aspect("equal")
    ticks = [c + 0.5 for c in range(n)]
    owner = {c: r for r, cs in enumerate(walk.chunks) for c in cs}
    labels = [f"{c}\nr{owner[c]}" for c in range(n)]
    ax.set_xticks(ticks, labels, fontsize=fontsize)
    ax.set_yticks(ticks, [f"{c} r{owner[c]}" for c in range(n)], fontsize=fontsize)
    ax.xaxis.tick_top()
    ax.tick_params(length=0, pad=2)
    ax.set_xlabel("key chunk (owner)", fontsize=fontsize)
    ax.xaxis.set_label_position("top")
    ax.set_ylabel("query chunk (rank)", fontsize=fontsize)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _draw_load(ax, walk: RingWalk, k: int, fontsize: float) -> None:
    """Each rank's share of the score matrix computed up to step k (this step's part solid). The axis
    is the plain split's largest share, 1 / cp, whichever split is shown, so the two compare."""
    for r in range(walk.cp):
        before, now = walk.share(r, k - 1) if k else 0.0, walk.share(r, k)
        color = RANK_COLORS[r % len(RANK_COLORS)]
        ax.barh(r, before, color=color, alpha=0.4, edgecolor="white")
        ax.barh(r, now - before, left=before, color=color, edgecolor="#555555", lw=0.8)
        ax.text(now + 0.01 / walk.cp, r, f"{now:.1%}" + ("  idle this step" if now == before else ""), va="center",
                fontsize=fontsize)
    ax.set_xlim(0, 1.6 / walk.cp)
    ax.set_ylim(walk.cp - 0.5, -0.5)
    ax.set_yticks(range(walk.cp), [f"rank {r}" for r in range(walk.cp)], fontsize=fontsize)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0, decimals=0))
    ax.tick_params(axis="x", labelsize=fontsize)
    ax.set_xlabel("share of the s x s scores computed so far\n(a block on the diagonal counts whole)",
                  fontsize=fontsize)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


LEGEND = ("solid: computed at this step (r2: by rank 2); pale: at an earlier step; grey: hidden by the causal "
          "mask, skipped. Each line below follows its rank's last query row (made-up scores): the block's max m and "
          "sum l of exp(score - m), then -> the running m and l after the merge")


def draw(fig: Figure, walk: RingWalk, k: int, text: bool = True) -> None:
    """Clear `fig` and draw step k: the score matrix, the load per rank, the legend and (`text`) the state lines."""
    n = walk.n_chunks
    lines = state_lines(walk, k) if text else []
    matrix = 0.42 * n + 1.0
    width = max(WIDTH_IN, matrix + PANEL_IN)
    line = FONT * 1.35 / 72
    legend = wrap_words(LEGEND, int(width * 72 / (0.56 * FONT)) - 4)
    below = 0.3 + line * (len(lines) + legend.count("\n") + 1.5)
    height = matrix + 0.45 + below
    fig.clear()
    fig.set_size_inches(width, height)
    split = "balanced" if walk.balanced else "plain"
    fig.suptitle(f"ring attention, causal, {walk.cp} ranks, {split} split: step {k + 1} of {walk.cp}",
                 fontsize=FONT + 1, x=0.02, y=1 - 0.05 / height, ha="left", va="top")
    top, bottom = 1 - 0.75 / height, below / height
    left_ax = fig.add_axes((0.7 / width, bottom, (matrix - 0.7) / width, top - bottom))
    _draw_matrix(left_ax, walk, k, FONT)
    load_ax = fig.add_axes(((matrix + 0.9) / width, bottom + 0.35 * (top - bottom), (width - matrix - 1.2) / width,
                            0.5 * (top - bottom)))
    _draw_load(load_ax, walk, k, FONT)
    fig.text(0.02, (0.1 + line * (len(lines) + 0.4)) / height, legend, fontsize=FONT, color="#555555",
             ha="left", va="bottom")
    if lines:
        fig.text(0.02, 0.1 / height, "\n".join(lines), fontsize=FONT, family="monospace", ha="left", va="bottom",
                 linespacing=1.25)


def ring_figure(cp: int = 4, balanced: bool = False, step: int | None = None) -> NotebookFigure:
    """A static Figure of ring attention on cp ranks after step `step` (None: the last step)."""
    walk = ring_walkthrough(cp, balanced)
    k = cp - 1 if step is None else step
    if not 0 <= k < cp:
        raise ValueError(f"step must be from 0 to {cp - 1} on {cp} ranks, got {step}")
    fig = NotebookFigure()
    draw(fig, walk, k)
    return fig


# ---------------------------------------------------------------- the widget

class RingWidget(Stepper):
    """Step the K/V blocks around the ring: menus for the ranks and the split; reset, back, step, play.

    `step()`, `back()`, `reset()`, `goto(k)` and `select(cp=..., balanced=...)` work from Python;
    `goto(k)` counts the steps from 0 and the label from 1 (goto(1) shows "step 2 of cp"), so a cell
    reads more plainly with `step()` from the first. `state_text()` is the per-rank readout under the picture. CSS classes: labsupport-ring (the whole
    widget), labsupport-ring-state, labsupport-ring-step, labsupport-ring-figure.
    """

    def __init__(self, cp: int = 4, balanced: bool = False, *, interval_ms: int = 1500):
        import ipywidgets as W

        self._fig = Figure()
        self._png: dict[int, bytes] = {}
        self._quiet = False
        self.ranks_menu = W.Dropdown(options=sorted({*UI_SIZES, cp}), value=cp, description="ranks",
                                     layout=W.Layout(width="150px"))
        self.split_menu = W.ToggleButtons(options=[("plain", False), ("balanced", True)], value=balanced,
                                          style={"button_width": "90px"})
        self.position = W.IntSlider(value=0, min=0, max=0, description="step", readout=False,
                                    layout=W.Layout(width="220px"))
        self.play = W.Play(value=0, min=0, max=0, interval=interval_ms, show_repeat=False)
        W.link((self.play, "value"), (self.position, "value"))
        W.link((self.play, "max"), (self.position, "max"))
        self.back_button = W.Button(description="back", icon="step-backward", layout=W.Layout(width="90px"))
        self.step_button = W.Button(description="step", icon="step-forward", button_style="primary",
                                    layout=W.Layout(width="90px"))
        self.reset_button = W.Button(description="reset", icon="fast-backward", layout=W.Layout(width="90px"))
        self.step_label = W.Label()
        # As the planner's and the rank grid's: at most the output area's width (scaled down, not cut), no margin
        # past its edge, and not stretched by the VBox (align_self) beyond the picture's own width.
        self.image = W.Image(format="png", layout=W.Layout(max_width="100%", align_self="flex-start", margin="0"))
        self.readout = W.HTML()
        for widget, css in ((self.step_label, "labsupport-ring-step"), (self.image, "labsupport-ring-figure"),
                            (self.readout, "labsupport-ring-state")):
            widget.add_class(css)
        self.step_button.on_click(lambda _: self.step())
        self.back_button.on_click(lambda _: self.back())
        self.reset_button.on_click(lambda _: self.reset())
        self.position.observe(lambda _: self._show(), names="value")
        for menu in (self.ranks_menu, self.split_menu):
            menu.observe(lambda _: self._rebuild(), names="value")
        split_label = W.Label("split", layout=W.Layout(margin="0 6px 0 24px"))  # a description would wrap above
        self.widget = W.VBox([W.HBox([self.ranks_menu, split_label, self.split_menu]),
                              W.HBox([self.reset_button, self.back_button, self.step_button, self.play,
                                      self.position, self.step_label]),
                              self.image, self.readout])
        self.widget.add_class("labsupport-ring")
        self._rebuild()

    @property
    def last(self) -> int:
        """Index of the final state: the ring's cp steps are the states 0..cp-1."""
        return self.walk.cp - 1

    def select(self, cp: int | None = None, balanced: bool | None = None) -> None:
        """Change the ranks or the split, as the menus do; starts again at step 1."""
        self._quiet = True
        try:
            if cp is not None:
                if cp not in self.ranks_menu.options:
                    self.ranks_menu.options = sorted({*self.ranks_menu.options, cp})
                self.ranks_menu.value = cp
            if balanced is not None:
                self.split_menu.value = balanced
        finally:
            self._quiet = False
        self._rebuild()

    def state_text(self) -> str:
        return "\n".join(state_lines(self.walk, self.k))

    def figure(self) -> NotebookFigure:
        """The picture shown now, as a static Figure (the stand-in where widgets do not run)."""
        return ring_figure(self.walk.cp, self.walk.balanced, self.k)

    def _rebuild(self) -> None:
        if self._quiet:
            return
        self.walk = ring_walkthrough(self.ranks_menu.value, self.split_menu.value)
        self._png = {}
        self._quiet = True
        try:
            self.rewind()
        finally:
            self._quiet = False
        self._show()

    def _show(self) -> None:
        if self._quiet:
            return
        k = self.k
        self.step_button.disabled = k >= self.last
        self.back_button.disabled = k <= 0
        self.step_label.value = f"step {k + 1} of {self.walk.cp}"
        if k not in self._png:
            draw(self._fig, self.walk, k, text=False)
            self._png[k] = figure_png(self._fig)
        self.image.value = self._png[k]
        self.readout.value = ('<pre style="margin:0;font-size:12px;line-height:1.35">'
                              + html.escape(self.state_text()) + "</pre>")

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
