"""One training step of every rank on a time axis: the overlap-timeline widget and its static figure.

`labsupport.train` records the last step of every run as a timeline, one file per rank
(`trace-rank{k}.json`): the compute phases (forward, backward, finish_backward, optimizer) and
every communication call, each with its start and end in seconds on that rank's clock. This
module only reads and draws those files:

    load_traces(run_dir)        the traces of a run, in rank order
    timeline_figure(traces)     a static Figure: one row per rank, compute on top, all-reduces below
    describe(traces)            the same numbers as plain text, one line per rank
    TimelineWidget(run_dirs)    a toggle between runs (naive / flat / bucketed, or bucket sizes)

How much communication was hidden behind the backward pass and how much the step paid for
("exposed") is `labsupport.trace.overlap`, the function the notebooks and tests call too;
nothing here computes it again. In the picture, the part of an all-reduce bar that lies under
the backward pass is drawn in the "hidden" colour by clipping the bar to the backward pass's
time span, so the colours show exactly the intervals that overlap() measures.

Each row starts at that rank's first recorded event: the clocks of different processes are not
synchronized, so only durations, not absolute times, compare across rows.
"""
from __future__ import annotations

import html
import json
from pathlib import Path

from matplotlib.patches import Patch
from matplotlib.path import Path as MplPath

from ..trace import overlap
from .figure import NotebookFigure, figure_png

COMPUTE_OPS = ("forward", "backward", "finish_backward", "optimizer")
LABELS = {"forward": "forward", "backward": "backward", "finish_backward": "finish backward (wait for gradients)",
          "optimizer": "optimizer step", "hidden": "all-reduce, hidden behind backward",
          "exposed": "all-reduce, exposed", "band": "backward pass running (where an all-reduce can hide)"}
COLORS = {"forward": "#4C72B0", "backward": "#55A868", "finish_backward": "#CCB974", "optimizer": "#8172B2",
          "hidden": "#8FD19E", "exposed": "#C44E52"}
COMM_OPS = ("all_reduce",)
BAND_ALPHA = 0.12   # the pale band that marks the backward pass over the communication lane
BUCKET_FONT = 9     # points: the bucket numbers beside the bars must stay readable in a stored PNG
ROW_IN = 0.2        # inches per sub-row of the communication lane, so 9 pt numbers fit beside the bars


def load_traces(run_dir) -> list[dict]:
    """The `trace-rank{k}.json` files of a run directory, as dicts, in rank order."""
    run_dir = Path(run_dir)
    paths = list(run_dir.glob("trace-rank*.json"))
    if not paths:
        raise FileNotFoundError(f"no trace-rank*.json in {run_dir}; labsupport.train writes them for the last "
                                "step of every run: pass the run_dir of a finished run")
    traces = [json.loads(p.read_text(encoding="utf-8")) for p in paths]
    return sorted(traces, key=lambda t: t["rank"])


def format_ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f} ms"


def format_mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.2f} MB"


def comm_events(trace: dict) -> list[dict]:
    """The trace's communication calls (all-reduces), in the order they started."""
    return sorted((e for e in trace["events"] if e["op"] in COMM_OPS), key=lambda e: e["start"])


def summary(trace: dict) -> dict:
    """trace.overlap of the step, plus how many all-reduces it made, their payload bytes, and the
    step's duration on that rank (`step_s`: from its first recorded event to its last)."""
    calls = comm_events(trace)
    events = trace["events"]
    return {**overlap(events), "calls": len(calls),
            "payload_bytes": sum(e.get("payload_bytes", 0) for e in calls),
            "step_s": max(e["end"] for e in events) - min(e["start"] for e in events)}


def describe_rank(trace: dict) -> str:
    s = summary(trace)
    return (f"rank {trace['rank']}: backward {format_ms(s['compute_s'])}; communication {format_ms(s['comm_s'])}"
            f" = hidden {format_ms(s['hidden_s'])} + exposed {format_ms(s['exposed_s'])}"
            f" ({s['calls']} all-reduce{'s' if s['calls'] != 1 else ''}, {format_mb(s['payload_bytes'])})")


def describe(traces: list[dict]) -> str:
    """One line per rank: backward time, and communication split into hidden and exposed."""
    return "\n".join(describe_rank(t) for t in traces)


def _rows(events: list[dict]) -> list[int]:
    """A sub-row for each event so that events in flight at the same time don't cover each other."""
    ends: list[float] = []
    rows = []
    for e in events:
        row = next((i for i, end in enumerate(ends) if end <= e["start"]), len(ends))
        if row == len(ends):
            ends.append(e["end"])
        else:
            ends[row] = e["end"]
        rows.append(row)
    return rows


def _spans_path(spans, y0: float, y1: float) -> MplPath:
    """Rectangles over the time spans `spans` (ms), from y0 to y1: a clip path in data coordinates."""
    vertices, codes = [], []
    for x0, x1 in spans:
        vertices += [(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)]
        codes += [MplPath.MOVETO, MplPath.LINETO, MplPath.LINETO, MplPath.LINETO, MplPath.CLOSEPOLY]
    return MplPath(vertices, codes)


def draw_rank(ax, trace: dict, show_buckets: bool = True) -> dict:
    """Draw one rank's step on `ax`: compute lane on top, one lane of all-reduces below. Returns summary()."""
    events = trace["events"]
    t0 = min(e["start"] for e in events)

    def ms(t):
        return 1e3 * (t - t0)

    for e in events:  # compute lane: y from 1.1 to 1.9
        if e["op"] in COMPUTE_OPS:
            ax.barh(1.5, ms(e["end"]) - ms(e["start"]), left=ms(e["start"]), height=0.8,
                    color=COLORS[e["op"]], edgecolor="white", linewidth=0.5)
    backward = [(ms(e["start"]), ms(e["end"])) for e in events if e["op"] == "backward"]
    for x0, x1 in backward:  # where the backward pass runs, a light band over the communication lane
        ax.axvspan(x0, x1, ymin=0.0, ymax=0.5, color=COLORS["backward"], alpha=BAND_ALPHA, linewidth=0, zorder=0)

    calls = comm_events(trace)
    rows = _rows(calls)
    n_rows = max(rows, default=0) + 1
    height = 0.9 / n_rows  # communication lane: y from 0.05 to 0.95, split into sub-rows
    clip = _spans_path(backward, -1.0, 2.0)
    for e, row in zip(calls, rows):
        y = 0.95 - (row + 0.5) * height
        left, width = ms(e["start"]), ms(e["end"]) - ms(e["start"])
        ax.barh(y, width, left=left, height=0.85 * height, color=COLORS["exposed"], linewidth=0)
        if backward:
            (hidden,) = ax.barh(y, width, left=left, height=0.85 * height, color=COLORS["hidden"], linewidth=0)
            hidden.set_clip_path(clip, ax.transData)
        if show_buckets and "bucket" in e and n_rows > 1:
            ax.text(left, y, f"{e['bucket']} ", ha="right", va="center", fontsize=BUCKET_FONT, color="#333333")

    s = summary(trace)
    ax.set_yticks([0.5, 1.5], ["all-reduce", "compute"])
    ax.set_ylim(0, 2)
    ax.set_title(f"rank {trace['rank']}: communication {format_ms(s['comm_s'])} = hidden {format_ms(s['hidden_s'])}"
                 f" + exposed {format_ms(s['exposed_s'])}; {s['calls']} all-reduce{'s' if s['calls'] != 1 else ''}",
                 fontsize=9, loc="left")
    return s


def legend_handles() -> list[Patch]:
    """Every colour of the figure, the pale backward band included."""
    return ([Patch(facecolor=COLORS[k], label=LABELS[k]) for k in (*COMPUTE_OPS, "hidden", "exposed")]
            + [Patch(facecolor=COLORS["backward"], alpha=BAND_ALPHA, label=LABELS["band"])])


def comm_rows(trace: dict) -> int:
    """How many sub-rows the trace's all-reduces need (calls in flight at the same time stack)."""
    return max(_rows(comm_events(trace)), default=0) + 1


def timeline_figure(traces: list[dict], title: str | None = None, show_buckets: bool = True):
    """A static Figure of one step: one axis per rank (rank order), compute above, all-reduces below.

    An all-reduce bar is green where it runs during the backward pass (hidden) and red where it
    does not (exposed); a pale band over the communication lane marks the backward pass (it is in
    the legend too); bucket numbers (9 pt) are written beside the bars of bucketed runs.
    """
    if not traces:
        raise ValueError("no traces to draw: pass load_traces(run_dir)")
    n = len(traces)
    per_rank = max(1.45, 0.75 + ROW_IN * max(comm_rows(t) for t in traces))  # room for 9 pt bucket numbers
    fig = NotebookFigure(figsize=(8.6, 1.1 + per_rank * n), layout="constrained")
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    for ax, trace in zip(axes, traces):
        draw_rank(ax, trace, show_buckets)
    axes[-1].set_xlabel("time within the step (ms), from each rank's first event")
    fig.legend(handles=legend_handles(), loc="outside lower center", ncol=2, frameon=False, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _table_html(traces: list[dict]) -> str:
    head = ("<tr><th>rank</th><th>backward</th><th>communication</th><th>hidden</th><th>exposed</th>"
            "<th>all-reduces</th><th>payload</th></tr>")
    rows = []
    for t in traces:
        s = summary(t)
        cells = [str(t["rank"]), format_ms(s["compute_s"]), format_ms(s["comm_s"]), format_ms(s["hidden_s"]),
                 format_ms(s["exposed_s"]), str(s["calls"]), format_mb(s["payload_bytes"])]
        rows.append("<tr>" + "".join(f"<td style='padding:0 8px;text-align:right'>{html.escape(c)}</td>"
                                     for c in cells) + "</tr>")
    return f"<table>{head}{''.join(rows)}</table>"


class TimelineWidget:
    """Switch between the recorded steps of several runs; the timeline and its numbers follow.

    `TimelineWidget({"flat": run_dir_a, "bucketed": run_dir_b})` in a notebook cell displays it.
    Its state is inspectable without a browser: set `w.controls["run"].value = "flat"`, and
    `w.label`, `w.traces` (that run's traces), `w.summaries` (summary() per rank, whose overlap
    numbers are trace.overlap's), `w.text` and `w.png` follow.
    """

    def __init__(self, run_dirs: dict, value: str | None = None):
        import ipywidgets as W

        if not run_dirs:
            raise ValueError("give at least one run: {label: run_dir}")
        self.runs = {str(label): load_traces(d) for label, d in run_dirs.items()}
        labels = list(self.runs)
        self.controls = {"run": W.ToggleButtons(options=labels, value=value if value is not None else labels[0],
                                                description="run")}
        self.readout = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="860px"))
        self.widget = W.VBox([self.controls["run"], self.readout, self.image])
        self.label = ""
        self.traces: list[dict] = []
        self.summaries: list[dict] = []
        self.text = ""
        self.png = b""
        self.controls["run"].observe(self._changed, names="value")
        self.update()

    def _changed(self, change):
        self.update()

    def update(self) -> list[dict]:
        """Redraw for the selected run; returns its per-rank summaries."""
        self.label = self.controls["run"].value
        self.traces = self.runs[self.label]
        self.summaries = [summary(t) for t in self.traces]
        self.text = describe(self.traces)
        self.readout.value = f"<div><b>{html.escape(self.label)}</b>{_table_html(self.traces)}</div>"
        self.png = figure_png(timeline_figure(self.traces, title=self.label))
        self.image.value = self.png
        return self.summaries

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
