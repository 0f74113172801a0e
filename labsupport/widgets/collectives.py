"""The collectives stepper: watch a collective move chunks between ranks, one step at a time.

Everything drawn here comes from `labsupport.estimate.collective_steps`, the same schedules that
`labsupport.algorithms` executes with real messages. This module only names the data, plays
`simulate()` on those names and draws the states:

    CollectivesWidget(...)      pick a collective and a world size, then step / back / play / reset
    collectives_figure(...)     the same pictures as a static matplotlib Figure (all steps, or one)
    walkthrough(...)            the schedule and its states, with symbolic chunk values
    format_state(...)           a state as the text the widget shows under the picture

Naming: rank 0's data is `a`, rank 1's is `b`, and so on; `c2` is rank 2's chunk 2. A chunk that
holds "a1+b1+c1" has received rank 0's, rank 1's and rank 2's chunk 1 and added them up. Terms
are listed in rank order. The ring adds them in a different order on every chunk, which is why a
ring all-reduce of floating-point numbers can differ in the last bits from a tree all-reduce.

The figures are figure.py's `NotebookFigure`s (not pyplot's), which show themselves in a notebook.
"""
from __future__ import annotations

import html
import string
from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch
from matplotlib.path import Path

from .figure import NotebookFigure, Stepper, figure_png
from ..estimate.collective_steps import COLLECTIVES, Transfer, initial_state, schedule, simulate

ROOTED = ("broadcast", "reduce", "scatter", "gather")  # the collectives where `root` matters
UI_SIZES = tuple(range(2, 9))  # world sizes offered in the widget's menu
EMPTY = "·"  # a chunk the rank does not hold (yet)

REDUCE_COLOR = "#c0392b"  # a transfer that is added into the receiver's chunk
COPY_COLOR = "#1f5f99"  # a transfer that overwrites (stores into) the receiver's chunk
RANK_COLORS = ("#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d",
               "#9edae5", "#c7c7c7")  # pastel tab20: the colour of data that came from one rank only
FULL_SUM_COLOR = "#3c7d5a"  # a chunk summed over every rank
DPI = 100  # of the widget's picture: 500 to 860 pixels wide for 2 to 8 ranks
FONT = 9  # points, every text in the widget's picture: 12.5 px at DPI, readable at 8 ranks
PARTIAL_SUM_COLORS = ("#e8e1f2", "#d5c8e8", "#c1aedd", "#ad95d2", "#9a7dc6", "#8866ba", "#7652ad")


# ---------------------------------------------------------------- symbolic values

def rank_letter(rank: int) -> str:
    """Rank 0 -> 'a', rank 1 -> 'b', ...; the letter that names a rank's original data."""
    return string.ascii_lowercase[rank] if rank < 26 else f"r{rank}_"


def symbolic_initial(collective: str, n: int, root: int = 0) -> list[list[str | None]]:
    """`initial_state` with every chunk a rank holds named by rank letter and chunk index ('b3')."""
    start = initial_state(collective, n, root)
    return [[None if value is None else f"{rank_letter(r)}{c}" for c, value in enumerate(row)]
            for r, row in enumerate(start)]


def terms(value: str | None) -> list[str]:
    """The named contributions in a chunk value, in rank order: 'c1+a1' -> ['a1', 'c1']."""
    if value is None:
        return []
    return sorted(str(value).split("+"), key=lambda t: (len(t.rstrip(string.digits)), t.rstrip(string.digits)))


def format_value(value: str | None) -> str:
    """A chunk value as text: its terms in rank order joined by '+', or EMPTY when not held."""
    return "+".join(terms(value)) if value is not None else EMPTY


def format_state(state: list[list]) -> str:
    """One line per rank with its chunks in columns: what the widget's readout shows, verbatim."""
    cells = [[format_value(v) for v in row] for row in state]
    widths = [max(len(row[c]) for row in cells) for c in range(len(cells[0]))] if cells else []
    return "\n".join(f"rank {r}: " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for r, row in enumerate(cells))


def describe_transfer(t: Transfer, how: bool = True) -> str:
    """'rank 0 sends chunk 2 to rank 1, which adds it in (reduce)' and the like; `how=False` leaves
    out what the receiver does, for a list of sends whose heading has said it."""
    what = "its whole buffer" if t.chunk is None else f"chunk {t.chunk}"
    where = f" as chunk {t.into}" if t.chunk is not None and t.into != t.chunk else ""
    if not how:
        return f"rank {t.src} sends {what} to rank {t.dst}{where}"
    receiver = "adds it in (reduce)" if t.reduce else "stores it"
    return f"rank {t.src} sends {what} to rank {t.dst}, which {receiver}{where}"


def describe_step(steps: list[list[Transfer]], k: int, numbered: bool = True) -> str:
    """A one-line caption for state k (0 = before the first step), saying what happens once.

    `numbered=False` leaves out "Step k of K: ", for the widget, whose step label shows it.
    """
    if k == 0:
        return "Before the first step: each rank's data is named by its rank letter and chunk index."
    step = steps[k - 1]
    head = f"Step {k} of {len(steps)}: " if numbered else ""
    if len(step) == 1:
        text = describe_transfer(step[0]) + "."
        return head + (text if numbered else text[0].upper() + text[1:])
    kinds = {t.reduce for t in step}
    how = ("each receiver adds what it gets" if kinds == {True} else
           "each receiver stores what it gets" if kinds == {False} else "some add, some store")
    return head + f"{len(step)} sends at the same time; {how}."


# ---------------------------------------------------------------- the schedule, played on names

@dataclass(frozen=True)
class Walkthrough:
    """A collective's schedule on n ranks and the state before and after each of its steps."""

    collective: str
    n: int
    root: int
    steps: list[list[Transfer]]
    states: list[list[list]]  # states[0] before the first step, states[k] after step k

    def __len__(self) -> int:
        return len(self.states)


def walkthrough(collective: str, n: int, root: int = 0) -> Walkthrough:
    """Play `collective` on symbolic data; raises ValueError for what the schedule module rejects."""
    steps = schedule(collective, n, root)
    states = simulate(collective, n, root, initial=symbolic_initial(collective, n, root))
    return Walkthrough(collective, n, root, steps, states)


# ---------------------------------------------------------------- drawing

def _box_text(value, n: int) -> str:
    """What fits in a box at a readable size: up to 3 terms two to a line ('a2+b2\n+c2'); beyond
    that, on more than 4 ranks, 'Σ2' for chunk 2 summed over all ranks and 'Σ2\n5 ranks' over
    some (the readout under the widget lists every term)."""
    parts = terms(value)
    if not parts:
        return ""
    if n > 4 and len(parts) > 3:
        sigma = "Σ" + parts[0].lstrip(string.ascii_lowercase + "_r")
        return sigma if len(parts) == n else f"{sigma}\n{len(parts)} ranks"
    return "\n+".join("+".join(parts[i:i + 2]) for i in range(0, len(parts), 2))


def _box_colors(value, n: int) -> tuple[str, str]:
    """(face colour, text colour): data from one rank in that rank's colour; sums darker as they grow."""
    parts = terms(value)
    if not parts:
        return "white", "black"
    if len(parts) == 1:
        letter = parts[0].rstrip(string.digits)
        index = string.ascii_lowercase.index(letter) if len(letter) == 1 else 0
        return RANK_COLORS[index % len(RANK_COLORS)], "black"
    if len(parts) >= n:
        return FULL_SUM_COLOR, "white"
    shade = PARTIAL_SUM_COLORS[min(len(parts) - 2, len(PARTIAL_SUM_COLORS) - 1)]
    return shade, "black"


def draw_state(ax, walk: Walkthrough, k: int, *, fontsize: float = FONT, label: str | None = None) -> None:
    """Draw state k of `walk` on `ax`: one row per rank, one box per chunk, this step's transfers as arrows.

    No arrow covers a label: a chunk moving within its column runs through the gap right of the
    boxes and ends at the receiving box's edge; a whole buffer arcs through the left margin. Only
    all-to-all arrows must cross boxes, so labels sit above the arrows on their box's colour.
    `label` goes under the panel (the small multiples say "start", "step 1", ...).
    """
    n = walk.n
    state = walk.states[k]
    step = walk.steps[k - 1] if k > 0 else []
    received = {}
    for t in step:
        for c in (range(n) if t.chunk is None else [t.into]):
            received[(t.dst, c)] = t.reduce

    for r in range(n):
        for c in range(n):
            value = state[r][c]
            face, ink = _box_colors(value, n)
            hit = received.get((r, c))
            edge = "#bbbbbb" if hit is None else REDUCE_COLOR if hit else COPY_COLOR
            ax.add_patch(FancyBboxPatch((c + 0.08, r + 0.12), 0.84, 0.76, boxstyle="round,pad=0,rounding_size=0.08",
                                        facecolor=face, edgecolor=edge, linewidth=0.8 if hit is None else 2.2,
                                        linestyle="--" if value is None else "-", zorder=1))
            text = _box_text(value, n)
            if text:  # above the arrows (zorder 3), on the box's own colour
                ax.text(c + 0.5, r + 0.5, text, ha="center", va="center", fontsize=fontsize, color=ink, zorder=4,
                        linespacing=0.95, bbox=dict(boxstyle="square,pad=0.05", facecolor=face, edgecolor="none"))

    head = 0.9 * fontsize  # arrowhead size, in points
    for t in step:
        color = REDUCE_COLOR if t.reduce else COPY_COLOR
        props = dict(arrowstyle="-|>", color=color, lw=1.3, alpha=0.85, mutation_scale=head, zorder=3)
        if t.chunk is None:  # the whole buffer: one arc in the left margin, from row to row
            span = abs(t.dst - t.src)
            rad = 0.45 / max(span, 1) ** 0.5 * (1 if t.dst > t.src else -1)
            ax.add_patch(FancyArrowPatch((0.04, t.src + 0.5), (0.04, t.dst + 0.5), shrinkA=1, shrinkB=1,
                                         connectionstyle=f"arc3,rad={rad}", **props))
        elif t.into == t.chunk:  # same column: from the box's right edge into the gap, along it, and back
            edge, gap = t.chunk + 0.92, t.chunk + 1.0
            route = Path([(edge, t.src + 0.5), (gap, t.src + 0.5), (gap, t.dst + 0.5), (edge, t.dst + 0.5)])
            ax.add_patch(FancyArrowPatch(path=route, **props))
        else:  # a chunk that changes position (all-to-all): straight from box to box, under the labels
            ax.add_patch(FancyArrowPatch((t.chunk + 0.5, t.src + 0.5), (t.into + 0.5, t.dst + 0.5),
                                         shrinkA=1.3 * fontsize, shrinkB=1.3 * fontsize,
                                         **{**props, "lw": 0.9, "alpha": 0.55}))

    ax.set_xlim(-0.6, n + 0.1)
    ax.set_ylim(n + 0.02, -0.02)  # rank 0 on top
    ax.set_yticks([r + 0.5 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=fontsize)
    ax.set_xticks([c + 0.5 for c in range(n)], [f"chunk {c}" if n <= 5 else f"c{c}" for c in range(n)],
                  fontsize=fontsize)
    ax.xaxis.tick_top()
    ax.tick_params(length=0, pad=2)
    for spine in ax.spines.values():
        spine.set_visible(False)
    if label:
        ax.set_xlabel(label, fontsize=fontsize + 1)


def wrap_words(text: str, width: int) -> str:
    """Break a caption into lines of at most `width` characters, at spaces."""
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + 1 + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join(lines + [line])


def _legend_text(walk: Walkthrough, sep: str = "   ") -> str:
    uses_sigma = any("Σ" in _box_text(v, walk.n) for state in walk.states for row in state for v in row)
    keys = ["red: added in (reduce)", "blue: stored", "dashed: not held"]
    if uses_sigma:
        keys.append("Σ2: chunk 2 summed over all ranks, or over as many as written under it")
    return sep.join(keys)


def draw_single(fig: Figure, walk: Walkthrough, k: int, caption: bool = True) -> None:
    """Clear `fig` and draw state k of `walk` on it: title, the ranks' boxes, a caption and the legend.

    Every text is FONT points. The widget leaves the caption out (`caption=False`): its own text
    under the picture says what the step does, and one explanation is enough.
    """
    n = walk.n
    width, row = max(5.5, 0.9 * n + 1.4), 0.5 if n <= 4 else 0.6
    chars = int(width * 72 / (0.56 * FONT)) - 4  # characters per line of wrapped text
    lines = wrap_words(describe_step(walk.steps, k), chars) if caption else ""
    legend = wrap_words(_legend_text(walk, sep=";  "), chars)
    line = FONT * 1.3 / 72  # inches
    top = 0.6
    bottom = 0.4 + line * (legend.count("\n") + 1) + (line * (lines.count("\n") + 1) + 0.08 if lines else 0)
    height = n * row + top + bottom
    fig.clear()
    fig.set_size_inches(width, height)
    ax = fig.add_subplot()
    draw_state(ax, walk, k)
    root = f", root {walk.root}" if walk.collective in ROOTED else ""
    fig.suptitle(f"{walk.collective} on {n} ranks{root}", fontsize=FONT + 1, x=0.02, y=1 - 0.06 / height,
                 ha="left", va="top")
    fig.text(0.02, 0.06 / height, legend, fontsize=FONT, color="#555555", ha="left", va="bottom", linespacing=1.2)
    if lines:
        fig.text(0.02, (0.14 + line * (legend.count("\n") + 1)) / height, lines, fontsize=FONT,
                 ha="left", va="bottom", linespacing=1.2)
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.08 / width, top=1 - top / height, bottom=bottom / height)


def collectives_figure(collective: str = "all_reduce", n: int = 4, step: int | None = None,
                       root: int = 0) -> NotebookFigure:
    """A static Figure of `collective` on n ranks: every state as small multiples, or only state `step`.

    `step=None` draws one panel per state (the start and each step, so len(schedule) + 1 axes);
    `step=k` draws the widget's picture after step k (0 = before the first step). Raises
    ValueError for a collective, size or root the schedule module does not support.
    """
    walk = walkthrough(collective, n, root)
    fig = NotebookFigure()
    if step is not None:
        if not 0 <= step < len(walk):
            raise ValueError(f"step must be from 0 to {len(walk) - 1} for {collective} on {n} ranks, got {step}")
        draw_single(fig, walk, step)
        return fig
    cols = min(4 if n <= 4 else 3 if n <= 6 else 2, len(walk))
    rows = -(-len(walk) // cols)
    panel = (0.5 if n <= 4 else 0.6) * n + 0.9  # inches; wide enough for two terms per line
    fig.set_size_inches(cols * panel + 0.4, rows * (panel * 0.8 + 0.3) + 0.7)
    for k in range(len(walk)):
        ax = fig.add_subplot(rows, cols, k + 1)
        draw_state(ax, walk, k, fontsize=6.5, label="start" if k == 0 else f"step {k}")
    root_note = f", root {root}" if collective in ROOTED else ""
    steps = f"{len(walk.steps)} step" + ("s" if len(walk.steps) != 1 else "")
    fig.suptitle(f"{collective} on {n} ranks{root_note}: {steps}", fontsize=10)
    fig.text(0.01, 0.005, _legend_text(walk), fontsize=7, color="#555555", ha="left", va="bottom")
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))
    return fig


# ---------------------------------------------------------------- the widget

class CollectivesWidget(Stepper):
    """Step through a collective: menus for the collective, the world size and the root; step, back, play, reset.

    Display `.widget` (or the object itself) in a notebook. The same controls work from Python:
    `step()`, `back()`, `reset()`, `goto(k)`, `select(collective=..., n=..., root=...)`;
    `state_text()` is the per-rank readout shown under the picture. A size or root that the
    schedule module rejects shows its message in the widget (`error`) instead of raising.

    CSS classes for browser tests: labsupport-collectives (the whole widget),
    labsupport-collectives-state (the readout), labsupport-collectives-step (the step label),
    labsupport-collectives-figure, labsupport-collectives-transfers, labsupport-collectives-error,
    and on the controls labsupport-step, labsupport-back, labsupport-reset, labsupport-play,
    labsupport-collective, labsupport-ranks, labsupport-root.
    """

    def __init__(self, collective: str = "all_reduce", n: int = 4, root: int = 0, *, interval_ms: int = 1200):
        import ipywidgets as W

        self.walk: Walkthrough | None = None
        self.error: str | None = None
        self._fig = Figure()
        self._png: dict[int, bytes] = {}  # state index -> picture, for the current selection
        self._quiet = False  # set while one control updates another, so only one redraw happens

        sizes = list(UI_SIZES) + ([n] if n not in UI_SIZES else [])
        self.collective_menu = W.Dropdown(options=list(COLLECTIVES) + ([collective] if collective not in COLLECTIVES
                                                                       else []),
                                          value=collective, description="collective",
                                          layout=W.Layout(width="230px"))
        self.ranks_menu = W.Dropdown(options=[(str(s), s) for s in sizes], value=n, description="ranks",
                                     layout=W.Layout(width="150px"))
        self.root_menu = W.Dropdown(options=[root], value=root, description="root",
                                    layout=W.Layout(width="140px"))
        self.position = W.IntSlider(value=0, min=0, max=0, description="step", readout=False,
                                    continuous_update=True, layout=W.Layout(width="260px"))
        self.play = W.Play(value=0, min=0, max=0, interval=interval_ms, description="play",
                           show_repeat=False)
        W.link((self.play, "value"), (self.position, "value"))
        W.link((self.play, "max"), (self.position, "max"))
        self.back_button = W.Button(description="back", icon="step-backward", tooltip="one step back",
                                    layout=W.Layout(width="90px"))
        self.step_button = W.Button(description="step", icon="step-forward", tooltip="one step forward",
                                    button_style="primary", layout=W.Layout(width="90px"))
        self.reset_button = W.Button(description="reset", icon="fast-backward", tooltip="back to the start",
                                     layout=W.Layout(width="90px"))
        self.step_label = W.Label()
        self.image = W.Image(format="png", layout=W.Layout(max_width="100%"))
        self.transfers = W.HTML()
        self.readout = W.HTML()
        self.error_box = W.HTML(layout=W.Layout(display="none"))

        for widget, css in ((self.collective_menu, "labsupport-collective"), (self.ranks_menu, "labsupport-ranks"),
                            (self.root_menu, "labsupport-root"), (self.play, "labsupport-play"),
                            (self.position, "labsupport-position"), (self.back_button, "labsupport-back"),
                            (self.step_button, "labsupport-step"), (self.reset_button, "labsupport-reset"),
                            (self.step_label, "labsupport-collectives-step"),
                            (self.image, "labsupport-collectives-figure"),
                            (self.transfers, "labsupport-collectives-transfers"),
                            (self.readout, "labsupport-collectives-state"),
                            (self.error_box, "labsupport-collectives-error")):
            widget.add_class(css)

        self.step_button.on_click(lambda _: self.step())
        self.back_button.on_click(lambda _: self.back())
        self.reset_button.on_click(lambda _: self.reset())
        self.position.observe(lambda _: self._show(), names="value")
        for menu in (self.collective_menu, self.ranks_menu, self.root_menu):
            menu.observe(lambda _: self._rebuild(), names="value")

        self.widget = W.VBox([
            W.HBox([self.collective_menu, self.ranks_menu, self.root_menu]),
            W.HBox([self.reset_button, self.back_button, self.step_button, self.play, self.position,
                    self.step_label]),
            self.error_box, self.image, self.transfers, self.readout,
        ])
        self.widget.add_class("labsupport-collectives")
        self._rebuild(keep_root=True)

    # -- Python controls ------------------------------------------------------------------

    @property
    def last(self) -> int:
        """Index of the final state (the number of steps; state 0 is before the first)."""
        return len(self.walk) - 1 if self.walk else 0

    def select(self, collective: str | None = None, n: int | None = None, root: int | None = None) -> None:
        """Change what is shown, as the menus do; starts again at step 0."""
        self._quiet = True
        try:
            if n is not None:
                if n not in [v for _, v in self.ranks_menu.options]:
                    self.ranks_menu.options = [*self.ranks_menu.options, (str(n), n)]
                self.ranks_menu.value = n
            if root is not None:
                if root not in self.root_menu.options:
                    self.root_menu.options = [*self.root_menu.options, root]
                self.root_menu.value = root
            if collective is not None:
                if collective not in self.collective_menu.options:
                    self.collective_menu.options = [*self.collective_menu.options, collective]
                self.collective_menu.value = collective
        finally:
            self._quiet = False
        self._rebuild(keep_root=True)

    def state_text(self) -> str:
        """The readout: what each rank holds in the state shown (empty while an error is shown)."""
        return format_state(self.walk.states[self.k]) if self.walk else ""

    def step_text(self) -> str:
        """The step label: 'start of 6 steps' or 'step 2 of 6'."""
        if not self.walk:
            return ""
        total = len(self.walk.steps)
        return f"start ({total} steps)" if self.k == 0 else f"step {self.k} of {total}"

    # -- internals -------------------------------------------------------------------------

    def _rebuild(self, keep_root: bool = False) -> None:
        """Recompute the walkthrough for the menus' values and show its start.

        When the world size changes from the menu, a root that no longer exists falls back to 0;
        a root given in Python (`keep_root`) is kept, so an impossible one shows its error.
        """
        if self._quiet:
            return
        collective, n, root = self.collective_menu.value, self.ranks_menu.value, self.root_menu.value
        ranks = list(range(n)) if isinstance(n, int) and n > 0 else []
        if not keep_root and ranks and root not in ranks:
            root = 0
        self._quiet = True
        try:
            options = ranks + ([root] if root not in ranks else [])
            if list(self.root_menu.options) != options:
                self.root_menu.options = options
            self.root_menu.value = root
            self.root_menu.disabled = collective not in ROOTED
            try:
                self.walk, self.error = walkthrough(collective, n, root if collective in ROOTED else 0), None
            except ValueError as exc:
                self.walk, self.error = None, str(exc)
            self._png = {}
            self.rewind()
        finally:
            self._quiet = False
        self._show()

    def _show(self) -> None:
        if self._quiet:
            return
        broken = self.walk is None
        self.error_box.layout.display = None if broken else "none"
        self.image.layout.display = "none" if broken else None
        self.error_box.value = (f'<div style="color:#b00020;font-weight:bold">Cannot show this: '
                                f'{html.escape(self.error)}</div>' if broken else "")
        for button in (self.step_button, self.back_button, self.reset_button, self.play, self.position):
            button.disabled = broken
        if broken:
            self.step_label.value = ""
            self.transfers.value = ""
            self.readout.value = ""
            return
        k = self.k
        self.step_button.disabled = k >= self.last
        self.back_button.disabled = k <= 0
        self.step_label.value = self.step_text()
        if k not in self._png:
            draw_single(self._fig, self.walk, k, caption=False)
            self._png[k] = figure_png(self._fig)
        self.image.value = self._png[k]
        self.image.layout.width = f"{round(self._fig.get_figwidth() * DPI)}px"  # natural size, not stretched
        self.transfers.value = self._transfers_html(k)
        self.readout.value = ('<pre style="margin:0;font-size:12px;line-height:1.35">'
                              + html.escape(self.state_text()) + "</pre>")

    def _transfers_html(self, k: int, limit: int = 8) -> str:
        """The one explanation of the step shown: what happens, then each send (the first `limit`)."""
        caption = html.escape(describe_step(self.walk.steps, k, numbered=False))
        if k == 0:
            return f'<div style="line-height:1.35"><i>{caption} Press step.</i></div>'
        step = self.walk.steps[k - 1]
        if len(step) == 1:
            return f'<div style="line-height:1.35">{caption}</div>'
        said = len({t.reduce for t in step}) == 1  # the caption said how every receiver combines
        lines = [html.escape(describe_transfer(t, how=not said)) for t in step[:limit]]
        if len(step) > limit:
            lines.append(f"… and {len(step) - limit} more sends in this step")
        return f'<div style="line-height:1.35">{caption}<br>' + "<br>".join(lines) + "</div>"

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
