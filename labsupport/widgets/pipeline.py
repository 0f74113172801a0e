"""Where a pipeline idles: the pipeline-bubble widget and its static figures.

The schedule is `labsupport.estimate.schedules.schedule` (the action lists the executor runs),
its timing `labsupport.estimate.simulator.simulate`, the formula `simulator.bubble_fraction`;
this module only chooses the inputs and draws the outputs:

    gantt_figure(timeline, measured=None)   one row per stage: forwards and backwards coloured, later
                                            chunks lighter, idle time grey; a measured run below it
    throughput_figure(schedule, p, m, v)    relative throughput (1 - bubble) against micro-batches
                                            and against stages: the workshop's two plots
    PipelineWidget(...)                     controls -> schedule -> simulate -> readout and picture;
                                            .figure(): the same as a static Figure (show(w, w.figure()));
                                            a measured run beside it while the controls match that run

A measured run is, per stage, a list of (start_s, end_s, op, microbatch, chunk) tuples: what the
executor in `labsupport.parallel.pipeline_schedule` records, and what `Timeline.spans` holds.
"""
from __future__ import annotations

import html

from matplotlib.colors import to_rgb
from matplotlib.patches import Patch
from matplotlib.text import Text

from ..estimate.schedules import SCHEDULES, check_schedule_args, schedule
from ..estimate.simulator import Timeline, bubble_fraction, simulate
from .figure import NotebookFigure, figure_png

COLORS = {"F": "#4C72B0", "B": "#55A868"}   # forward and backward, as in the overlap timeline
IDLE = "#E6E6E6"
LABELS = {"F": "forward", "B": "backward", "idle": "idle (the bubble)"}
MAX_STAGES, MAX_MICROBATCHES, MAX_CHUNKS = 16, 64, 4
DESCRIPTION_WIDTH = "150px"   # "backward / forward" whole, in JupyterLab's 13 px font
SLIDER_WIDTH = "480px"        # the description, a track of about 270 px, the readout


def chunk_color(op: str, chunk: int, chunks: int) -> tuple:
    """The op's colour, lighter for later chunks (dark: first chunk, as in Narayanan et al.'s Figure 4)."""
    lighten = 0.55 * chunk / (chunks - 1) if chunks > 1 else 0.0
    return tuple(c + (1 - c) * lighten for c in to_rgb(COLORS[op]))


def _spans(timeline) -> list[list[tuple]]:
    return timeline.spans if isinstance(timeline, Timeline) else [[tuple(s) for s in stage] for stage in timeline]


def run_shape(spans) -> tuple[int, int, int]:
    """(stages, micro-batches, chunks) of a run, read off its spans: what the widget's controls must say
    for the run to be the one they describe."""
    forwards = [s for stage in _spans(spans) for s in stage if s[2] == "F"]
    return len(spans), len({s[3] for s in forwards}), max((s[4] for s in forwards), default=0) + 1


def run_label(name: str, stages: int, microbatches: int, chunks: int = 1) -> str:
    return f"{name}, p = {stages}, m = {microbatches}" + (f", v = {chunks}" if chunks > 1 else "")


PAD_PX = 2   # bar left either side of a micro-batch number, so that it reads apart from the bar's edges
# The legend's last entry, under the colours: what the numbers are, and why a bar can have none.
NUMBERS_NOTE = "number on a bar:\nits micro-batch\n(none where the bar\nis too narrow for it)"


class BarLabel(Text):
    """A micro-batch number that is drawn only where it fits inside its bar, measured at draw time:
    a narrow bar (interleaving's chunks in a small figure, a measured forward that took a fraction of
    the others' time) stays unlabelled rather than carrying digits that run into each other or into
    its neighbours' (the legend's NUMBERS_NOTE says so). `fits` says what the last draw decided."""

    def __init__(self, start: float, stop: float, y: float, text: str, **kwargs):
        super().__init__((start + stop) / 2, y, text, ha="center", va="center", fontsize=7, **kwargs)
        self.bar = (start, stop)
        self.fits = True
        self.set_in_layout(False)

    def draw(self, renderer):
        left, right = self.axes.transData.transform([(self.bar[0], 0), (self.bar[1], 0)])[:, 0]
        self.fits = self.get_window_extent(renderer).width <= (right - left) - 2 * PAD_PX
        if self.fits:
            super().draw(renderer)


def draw_gantt(ax, spans: list[list[tuple]], title: str | None = None, unit: str = "time units") -> None:
    """One row per stage (stage 0 on top); compute bars on a grey row, so what stays grey is idle.

    Only F and B are drawn; times start at the earliest span of any stage. Each bar carries its
    micro-batch number where the number fits inside it (BarLabel)."""
    stages = len(spans)
    compute = [[s for s in stage if s[2] in COLORS] for stage in spans]
    t0 = min((s[0] for stage in compute for s in stage), default=0.0)
    end = max((s[1] for stage in compute for s in stage), default=1.0) - t0
    chunks = max((s[4] for stage in compute for s in stage), default=0) + 1
    bars = max((len(stage) for stage in compute), default=0)
    for row, stage in enumerate(compute):
        y = stages - 1 - row
        ax.broken_barh([(0, end)], (y - 0.4, 0.8), facecolors=IDLE)
        groups: dict[tuple, list] = {}
        for start, stop, op, microbatch, chunk in stage:
            groups.setdefault((op, chunk), []).append((start - t0, stop - start))
        for (op, chunk), ranges in groups.items():
            ax.broken_barh(ranges, (y - 0.4, 0.8), facecolors=chunk_color(op, chunk, chunks),
                           edgecolors="white", linewidth=0.5 if bars <= 48 else 0)
        for start, stop, op, microbatch, chunk in stage:
            ax.add_artist(BarLabel(start - t0, stop - t0, y, str(microbatch), color="white" if chunk == 0 else "black"))
    ax.set_yticks(range(stages), [f"stage {s}" for s in reversed(range(stages))])
    ax.set_ylim(-0.6, stages - 0.4)
    ax.set_xlim(0, end)
    ax.set_xlabel(unit)
    if title:
        ax.set_title(title, fontsize=10, loc="left")


def gantt_legend(chunks: int) -> list[Patch]:
    """The colours, then NUMBERS_NOTE (an entry without a swatch)."""
    handles = [Patch(facecolor=COLORS[op], label=LABELS[op] + (", chunk 0" if chunks > 1 else "")) for op in "FB"]
    if chunks > 1:
        handles += [Patch(facecolor=chunk_color(op, chunks - 1, chunks),
                          label=f"{LABELS[op]}, chunk {chunks - 1}") for op in "FB"]
    return handles + [Patch(facecolor=IDLE, label=LABELS["idle"]),
                      Patch(facecolor="none", edgecolor="none", label=NUMBERS_NOTE)]


def gantt_figure(timeline, measured=None, title: str | None = None, unit: str = "time (a forward = 1)",
                 measured_title: str = "measured", measured_unit: str = "seconds"):
    """A static Figure: the schedule's Gantt chart, and a measured run's below it when given.

    `timeline` is a `simulate(...)` Timeline or per-stage span lists; `measured` per-stage lists of
    (start_s, end_s, op, microbatch, chunk) tuples from a real run. Works without ipywidgets. With a
    measured run the two charts are stacked, each the output area's width, on one time axis when
    their units agree. A bar too narrow for its micro-batch number has none (the legend says so).
    """
    spans = _spans(timeline)
    chunks = max((s[4] for p in (spans, _spans(measured) if measured is not None else []) for stage in p
                  for s in stage), default=0) + 1
    if measured is None:
        panel_width = 5.2 if chunks == 1 else 7.2   # a chunk's bars are 1 / v wide: room for their numbers
        fig = NotebookFigure(figsize=(panel_width + 1.6, 1.2 + 0.32 * len(spans)), layout="constrained")
        draw_gantt(fig.subplots(), spans, title or "predicted (simulator)", unit)
    else:
        measured = _spans(measured)
        rows = max(len(spans), len(measured))
        fig = NotebookFigure(figsize=(9.6, 2 * (0.95 + 0.5 * rows)), layout="constrained")
        top, bottom = fig.subplots(2, 1)
        draw_gantt(top, spans, title or "predicted (simulator)", unit)
        draw_gantt(bottom, measured, measured_title, measured_unit)
        if unit == measured_unit:   # one time axis: the two steps' lengths compare at a glance
            longest = max(top.get_xlim()[1], bottom.get_xlim()[1])
            top.set_xlim(0, longest)
            bottom.set_xlim(0, longest)
    fig.legend(handles=gantt_legend(chunks), loc="outside right upper", frameon=False, fontsize=8)
    return fig


def _valid_microbatches(name: str, stages: int, most: int) -> list[int]:
    step = stages if name == "interleaved" else 1
    return list(range(step, max(most, step) + 1, step))


def draw_throughput(ax_m, ax_p, name: str, stages: int, microbatches: int, chunks: int = 1) -> None:
    """Relative throughput per stage, 1 - bubble fraction: against micro-batches at these stages, and
    against stages with the micro-batches fixed or growing with the stages (the workshop's two ways)."""
    ms = _valid_microbatches(name, stages, max(MAX_MICROBATCHES, microbatches))
    ax_m.plot(ms, [1 - bubble_fraction(stages, m, chunks) for m in ms], color=COLORS["F"],
              label=f"{name}, p = {stages}" + (f", v = {chunks}" if chunks > 1 else ""))
    if chunks > 1:
        ax_m.plot(ms, [1 - bubble_fraction(stages, m) for m in ms], color="gray", linestyle="--",
                  label=f"1f1b, p = {stages}")
    ax_m.plot([microbatches], [1 - bubble_fraction(stages, microbatches, chunks)], "o", color="black")
    ax_m.set_xlabel("micro-batches m (the global batch grows with m)")
    ax_m.set_title("more micro-batches: a smaller bubble", fontsize=10, loc="left")

    ps = range(1, max(MAX_STAGES, stages) + 1)
    ax_p.plot(ps, [1 - bubble_fraction(p, microbatches, chunks) for p in ps], color=COLORS["F"],
              label=f"m = {microbatches} fixed")
    if stages > 1:  # m grown in step with p - 1 keeps (p - 1) / (v m) where it is
        grown = ps[1:]
        ax_p.plot(grown, [1 - bubble_fraction(p, microbatches * (p - 1) / (stages - 1), chunks) for p in grown],
                  color=COLORS["B"], label=f"m = {microbatches / (stages - 1):.3g} (p - 1): bubble fixed")
    ax_p.plot([stages], [1 - bubble_fraction(stages, microbatches, chunks)], "o", color="black")
    ax_p.set_xlabel("pipeline stages p")
    ax_p.set_title("more stages: a bigger bubble", fontsize=10, loc="left")
    for ax in (ax_m, ax_p):
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("relative throughput (1 - bubble)")
        ax.grid(alpha=0.3)
        ax.legend(frameon=False, fontsize=8, loc="lower right")


def throughput_figure(name: str = "1f1b", stages: int = 4, microbatches: int = 8, chunks: int = 1):
    """A static Figure of the two throughput plots (the workshop's for the 22B and 1T models)."""
    fig = NotebookFigure(figsize=(9.6, 3.2), layout="constrained")
    draw_throughput(*fig.subplots(1, 2), name, stages, microbatches, chunks)
    return fig


def describe(timeline: Timeline, name: str, stages: int, microbatches: int, chunks: int) -> str:
    """The bubble in words, with the formula's value beside the simulated one."""
    v = f" v = {chunks}," if chunks > 1 else ""
    return (f"{name}, p = {stages},{v} m = {microbatches}: each stage idles {timeline.bubble_fraction:.1%} of the step "
            f"(formula (p - 1) / (v m + p - 1) = {bubble_fraction(stages, microbatches, chunks):.1%}); "
            f"idle / busy = {timeline.bubble_over_ideal:.3g} = (p - 1) / (v m). "
            f"Micro-batches in flight at most, per stage: {', '.join(map(str, timeline.peak_inflight_microbatches))}"
            + (" (chunk forwards)" if chunks > 1 else "") + ".")


class PipelineWidget:
    """Controls for the schedule, stages, micro-batches, chunks and backward/forward ratio; shows the
    simulated Gantt chart, the bubble beside its formula, and relative throughput against m and p.

    `PipelineWidget()` in a notebook cell displays it. Its state is inspectable without a browser:
    set `w.controls["microbatches"].value = 16` and `w.timeline` (simulate's Timeline), `w.text`,
    `w.bubble.value` and `w.png` follow. `measured=` ({schedule name: a real run's per-stage
    (start_s, end_s, op, microbatch, chunk) lists}) draws the run of the chosen schedule beside the
    simulated one while stages, micro-batches and chunks are that run's; elsewhere the panel says
    which runs there are and stays empty, so a prediction is never set beside another
    configuration's measurement (`w.measured_shown`: the name shown, or None). A combination the
    schedule refuses (interleaved with m not a multiple of p) is reported in the widget (`w.error`).
    CSS classes: labsupport-pipeline, labsupport-pipeline-bubble, labsupport-pipeline-figure, and
    labsupport-pipeline-<control> on each control.
    """

    def __init__(self, name: str = "1f1b", stages: int = 4, microbatches: int = 8, chunks: int = 2,
                 backward_ratio: float = 2.0, measured: dict | None = None):
        import ipywidgets as W

        self.measured = {run: _spans(spans) for run, spans in (measured or {}).items()}
        self.measured_shown: str | None = None
        style = {"description_width": DESCRIPTION_WIDTH}

        def slider(kind, **kwargs):   # its own Layout each: chunks' is hidden alone
            return kind(style=style, layout=W.Layout(width=SLIDER_WIDTH), **kwargs)

        c = self.controls = {
            "schedule": W.ToggleButtons(options=list(SCHEDULES), value=name, description="schedule", style=style),
            "stages": slider(W.IntSlider, value=stages, min=1, max=MAX_STAGES, description="stages p"),
            "microbatches": slider(W.IntSlider, value=microbatches, min=1, max=MAX_MICROBATCHES,
                                   description="micro-batches m"),
            "chunks": slider(W.IntSlider, value=chunks, min=2, max=MAX_CHUNKS, description="chunks v"),
            "backward_ratio": slider(W.FloatSlider, value=backward_ratio, min=0.5, max=4.0, step=0.5,
                                     description="backward / forward"),
        }
        for key, control in c.items():
            control.add_class(f"labsupport-pipeline-{key.replace('_', '-')}")
        self.bubble = W.HTML().add_class("labsupport-pipeline-bubble")
        self.image = W.Image(format="png", layout=W.Layout(max_width="960px")).add_class("labsupport-pipeline-figure")
        self.widget = W.VBox([W.VBox(list(c.values())), self.bubble, self.image]).add_class("labsupport-pipeline")
        self.timeline: Timeline | None = None
        self.error: str | None = None
        self.text = ""
        self.png = b""
        for control in c.values():
            control.observe(lambda _: self.update(), names="value")
        self.update()

    def options(self) -> dict:
        """The current settings: name, stages, microbatches, chunks (1 unless interleaved), backward_ratio."""
        c = self.controls
        name = c["schedule"].value
        return dict(name=name, stages=c["stages"].value, microbatches=c["microbatches"].value,
                    chunks=c["chunks"].value if name == "interleaved" else 1,
                    backward_ratio=c["backward_ratio"].value)

    def update(self) -> Timeline | None:
        """Simulate the chosen schedule; refresh readout and picture. Returns the Timeline (None on error)."""
        o = self.options()
        self.controls["chunks"].layout.display = None if o["name"] == "interleaved" else "none"
        try:
            check_schedule_args(o["name"], o["stages"], o["microbatches"], o["chunks"])
        except ValueError as e:
            self.timeline, self.error = None, str(e)
            self.text = f"Not a valid schedule: {e}"
            self.bubble.value = f"<span style='color:#b00'>{html.escape(self.text)}</span>"
            return None
        self.error = None
        self.timeline = simulate(schedule(o["name"], o["stages"], o["microbatches"], o["chunks"]),
                                 backward_ratio=o["backward_ratio"], chunks=o["chunks"])
        self.text = describe(self.timeline, o["name"], o["stages"], o["microbatches"], o["chunks"])
        shape = (o["stages"], o["microbatches"], o["chunks"])
        spans = self.measured.get(o["name"])
        self.measured_shown = o["name"] if spans is not None and run_shape(spans) == shape else None
        if self.measured_shown:
            self.text += " Beside it, measured: the real run of these settings."
        elif self.measured:
            self.text += f" No measured run of these settings; there are {self.measured_runs()}."
        self.bubble.value = f"<div style='max-width:960px'>{html.escape(self.text)}</div>"
        self.png = figure_png(self.figure())
        self.image.value = self.png
        return self.timeline

    def measured_runs(self, sep: str = "; ") -> str:
        """The measured runs in words: which settings show one."""
        return sep.join(run_label(name, *run_shape(spans)) for name, spans in self.measured.items())

    def figure(self):
        """A static Figure of what the widget shows now: the Gantt chart(s) above the two throughput plots."""
        if self.timeline is None:
            raise ValueError(f"the widget shows no schedule: {self.error}")
        o = self.options()
        fig = NotebookFigure(figsize=(9.6, 4.6 + 0.25 * o["stages"]), layout="constrained")
        top, bottom = fig.subfigures(2, 1, height_ratios=[1.0 + 0.08 * o["stages"], 1.0])
        axes = top.subplots(1, 2 if self.measured else 1, squeeze=False)[0]
        draw_gantt(axes[0], self.timeline.spans, f"{o['name']}: bubble {self.timeline.bubble_fraction:.1%}",
                   "time (a forward = 1)")
        if self.measured_shown:
            spans = self.measured[self.measured_shown]
            draw_gantt(axes[1], spans, f"measured: {run_label(self.measured_shown, *run_shape(spans))}", "seconds")
        elif self.measured:
            axes[1].set_axis_off()
            axes[1].set_title("measured: no run of these settings", fontsize=10, loc="left", color="gray")
            runs = self.measured_runs("\n")
            axes[1].text(0, 0.9, f"set the controls to a run that was measured:\n{runs}", va="top",
                         fontsize=9, color="gray", transform=axes[1].transAxes)
        top.legend(handles=gantt_legend(o["chunks"]), loc="outside right upper", frameon=False, fontsize=8)
        draw_throughput(*bottom.subplots(1, 2), o["name"], o["stages"], o["microbatches"], o["chunks"])
        return fig

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
