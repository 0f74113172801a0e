"""Where a model's training should go on a cluster: the planner widget and its static figure.

Every number comes from `labsupport.estimate.planner`, the functions behind `labsupport plan`:
`plan` ranks the layouts that fit, `why` says why the best one wins, `explain_no_fit` why none
fits, `search` samples layouts at random as the workshop's DeepHyper search did. This module
only chooses the inputs, formats the outputs and draws them:

    plan_for(...)          plan (and search) a preset on a named machine: a Planned, nothing raised
    summary(planned)       the readout: the setting, the reasons for the best layout, the search's result
    header(planned)        the table's columns: HEADER, with cp after pp when a layout uses context parallelism
    table_rows(planned)    the fastest layouts as rows of text (dp, tp, [cp,] pp, ..., +% vs best)
    planner_figure(...)    left: the step time of the fastest layouts split into compute, TP, PP, DP
                           and the bubble; right: the search's trajectory, or step time against
                           memory per GPU of every layout that fits
    PlannerWidget(...)     controls -> readout, table, figure; .figure() for show(w, w.figure())
"""
from __future__ import annotations

import html
import math
import textwrap
from dataclasses import replace
from typing import NamedTuple

from matplotlib.ticker import LogFormatter, MaxNLocator

from ..estimate.machines import Machine
from ..estimate.memory import RECOMPUTE
from ..estimate.planner import (MACHINE_NAMES, USABLE_MEMORY, ZERO_STAGES, Config, NoFit, Sample, plan, search,
                                tflops_per_gpu, usable_bytes, why)
from ..estimate.shapes import CPU_PRESETS, PRESETS, ModelConfig, get_preset
from ..estimate.workshop import STRONG_SCALING
from .figure import NotebookFigure, figure_png
from .memory import preset_label

# The setting the widget opens on: the deck's 175B strong-scaling run, a total batch of 8,000 on
# 1,024 GCDs (Fig. 13), for which the planner's best is Table VI's TP 4 x PP 16.
GPUS, GLOBAL_BATCH = STRONG_SCALING["175b"].gpus, STRONG_SCALING["175b"].global_batch
MODELS = [name for name in PRESETS if name not in CPU_PRESETS]  # the analysis shapes: CPU presets have no vocab
GPU_COUNTS = (8, 16, 32, 64, 128, 256, 512, 768, 1024, 1536, 2048, 3072)  # whole nodes of 8, up to the workshop's 1T
ANY = "any"  # the menu entry that leaves ZeRO or recomputation to the planner (or the sequence length to the model)
MAX_SAMPLES = 200
PARTS = {"compute_s": "compute", "tp_comm_s": "TP all-reduces", "pp_comm_s": "PP sends",
         "dp_comm_s": "DP gradient sync", "bubble_s": "pipeline bubble"}  # Config's step-time terms
RING = {"cp_comm_s": "CP ring sends"}  # the term context parallelism adds, drawn after TP's where a layout has it
COLORS = {"compute_s": "#4C72B0", "tp_comm_s": "#DD8452", "cp_comm_s": "#DA8BC3", "pp_comm_s": "#55A868",
          "dp_comm_s": "#8172B2", "bubble_s": "#BBBBBB"}
RECOMPUTE_COLORS = {"none": "#4C72B0", "selective": "#DD8452", "full": "#55A868"}
HEADER = ["#", "dp", "tp", "pp", "micro-batch", "ZeRO", "recompute", "GB/GPU", "step s", "TFLOP/s/GPU", "+% vs best"]
# The context lengths the widget offers: the presets' 2048 up to Llama 3's long-context 131,072, where
# the activations outgrow a GPU and the planner adds context parallelism.
SEQ_LENS = (2048, 8192, 32768, 131072)


class Planned(NamedTuple):
    """What `plan_for` found: the layouts that fit, fastest first (empty when none does, and
    `no_fit` says why), and the random search's samples (empty without one)."""

    cfg: ModelConfig
    machine: Machine
    gpus: int
    global_batch: int
    configs: list[Config]
    trajectory: list[Sample]
    seed: int
    no_fit: str | None


def plan_for(model: str = "175b", machine: str = "frontier", gpus: int = GPUS, global_batch: int = GLOBAL_BATCH,
             *, samples: int = 0, seed: int = 0, zero: int | None = None, recompute: str | None = None,
             seq_len: int | None = None) -> Planned:
    """`plan` (and, with samples > 0, `search`) for a preset on one of `MACHINE_NAMES`, at its own
    context length or `seq_len`; `zero` and `recompute` pin those choices. A model that fits
    nowhere is an answer, not an error."""
    if machine not in MACHINE_NAMES:
        raise ValueError(f"unknown machine {machine!r}; choose one of: {', '.join(MACHINE_NAMES)}")
    cfg, m = get_preset(model), MACHINE_NAMES[machine]
    if seq_len is not None:
        cfg = replace(cfg, seq_len=seq_len)
    try:
        configs = plan(cfg, m, gpus, global_batch, zero=zero, recompute=recompute)
    except NoFit as e:
        return Planned(cfg, m, gpus, global_batch, [], [], seed, str(e))
    trajectory = search(cfg, m, gpus, global_batch, samples, seed, zero=zero, recompute=recompute) if samples else []
    return Planned(cfg, m, gpus, global_batch, configs, trajectory, seed, None)


def _context_parallel(p: Planned, top: int) -> bool:
    return any(c.cp > 1 for c in p.configs[:top])


def header(p: Planned, top: int = 5) -> list[str]:
    """The table's columns: HEADER, and cp after pp when one of the `top` layouts splits the sequence."""
    return HEADER[:4] + ["cp"] + HEADER[4:] if _context_parallel(p, top) else HEADER


def table_rows(p: Planned, top: int = 5) -> list[list[str]]:
    """The `top` fastest layouts, one row of text per layout, in `header`'s columns."""
    if not p.configs:
        return []
    best = p.configs[0].step_time_s
    cp = _context_parallel(p, top)
    return [[str(i), str(c.dp), str(c.tp), str(c.pp), *([str(c.cp)] if cp else []), str(c.micro_batch), str(c.zero),
             c.recompute, f"{c.memory_per_gpu / 1e9:.1f}", f"{c.step_time_s:.4g}",
             f"{tflops_per_gpu(c, p.cfg, p.global_batch):.4g}",
             f"{c.step_time_s / best - 1:+.1%}"] for i, c in enumerate(p.configs[:top], 1)]


def summary(p: Planned, top: int = 5) -> list[str]:
    """The readout's lines: the setting and how many layouts fit, why the best wins, and what the
    random search found against the best of all layouts; or the one line that says why none fits."""
    if p.no_fit:
        return [p.no_fit]
    m, best = p.machine, p.configs[0]
    lines = [f"{p.cfg.name} on {p.gpus} GPUs of {m.name} ({m.memory_gb:g} GB, {m.peak_tflops_bf16:g} TFLOP/s), "
             f"global batch {p.global_batch} x {p.cfg.seq_len} tokens: {len(p.configs)} layouts fit, "
             f"the {min(top, len(p.configs))} fastest below. Why #1:"]
    lines += why(best, p.cfg, m, p.gpus, p.global_batch)
    if p.trajectory:
        oom = sum(s.step_time_s is None for s in p.trajectory)
        found = p.trajectory[-1].best_s
        result = ("none of them fits" if found is None else
                  f"its best, {found:.4g} s, is {found / best.step_time_s - 1:+.1%} against the best of all "
                  f"{len(p.configs)} layouts")
        lines.append(f"Random search, {len(p.trajectory)} samples (seed {p.seed}), {oom} out of memory: {result}.")
    return lines


def _short(c: Config) -> str:
    context = f" CP {c.cp}" if c.cp > 1 else ""
    return f"TP {c.tp}{context} PP {c.pp}\nDP {c.dp} mb {c.micro_batch}\nZeRO-{c.zero} {c.recompute}"


def _draw_parts(ax, configs: list[Config]) -> None:
    """Stacked bars, one per layout: where its step time goes (the CP ring only where a layout has one)."""
    xs = range(len(configs))
    bottom = [0.0] * len(configs)
    parts = list(PARTS.items())
    if any(c.cp > 1 for c in configs):
        parts[2:2] = RING.items()
    for part, label in parts:
        heights = [getattr(c, part) for c in configs]
        ax.bar(xs, heights, 0.6, bottom=bottom, color=COLORS[part], label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, c in zip(xs, configs):
        ax.annotate(f"{c.step_time_s:.3g} s", (x, c.step_time_s), ha="center", va="bottom", xytext=(0, 2),
                    textcoords="offset points", fontsize=8)
    ax.set_xticks(list(xs), [f"#{i}\n{_short(c)}" for i, c in enumerate(configs, 1)], fontsize=7)
    ax.set_ylim(0, max(c.step_time_s for c in configs) * 1.15)
    ax.set_ylabel("seconds per optimizer step")


def _log_seconds(ax, times: list[float], headroom: float = 1.0) -> None:
    """A log axis of step times labelled 40, 60, 100 rather than 4 x 10^1, with a margin of a
    quarter below the fastest (room for a label under it) and `headroom` (a fraction of the
    height) left empty above the slowest."""
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(1, 0.4)))
    low, high = math.log10(min(times) / 1.25), math.log10(max(times) * 1.1)
    ax.set_ylim(10 ** low, 10 ** (low + (high - low) / headroom))
    ax.set_ylabel("step s")


def _legend_below(ax, ncols: int) -> None:
    """The panel's legend under its x label, where it covers no point."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=ncols, fontsize=7, frameon=False)


def _draw_search(ax, p: Planned) -> None:
    """As the workshop's DeepHyper plot: each sample's step time (numbered from 1) and the best so
    far, against the best of all layouts, labelled on its line; samples that ran out of memory are
    crosses in a strip along the top, above every point."""
    n, best = len(p.trajectory), p.configs[0].step_time_s
    fit = [s for s in p.trajectory if s.step_time_s is not None]
    xs = [s.index + 1 for s in fit]
    ax.scatter(xs, [s.step_time_s for s in fit], s=14, color="#4C72B0", label="sample")
    if fit:  # the best so far holds to the last sample, fitting or not
        ax.step(xs + [n], [s.best_s for s in fit] + [fit[-1].best_s], where="post", color="black",
                label="best so far")
    oom = [s.index + 1 for s in p.trajectory if s.step_time_s is None]
    ax.scatter(oom, [0.95] * len(oom), transform=ax.get_xaxis_transform(), marker="x", color="#C44E52",
               label="out of memory")
    ax.axhline(best, color="gray", linestyle="--", linewidth=1)
    ax.annotate(f"best of all {len(p.configs)} layouts: {best:.3g} s", (1, best), xycoords=("axes fraction", "data"),
                xytext=(-3, -3), textcoords="offset points", ha="right", va="top", fontsize=7, color="dimgray")
    _log_seconds(ax, [best] + [s.step_time_s for s in fit], headroom=0.85)
    ax.set_xlim(0.5, n + 0.5)
    ticks = [t for t in MaxNLocator(nbins=5, steps=[1, 2, 5, 10], integer=True).tick_values(1, n) if 1 < t <= n]
    ax.set_xticks([1] + ticks)
    ax.set_xlabel("sample")
    ax.set_title(f"random search: {n} samples (seed {p.seed})", fontsize=10)
    _legend_below(ax, 3)


def _draw_memory(ax, p: Planned, top: int) -> None:
    """Every layout that fits: step time against memory per GPU, by recomputation; the fastest
    ringed (they are the bars on the left), #1 labelled."""
    for recompute, color in RECOMPUTE_COLORS.items():
        mine = [c for c in p.configs if c.recompute == recompute]
        if mine:
            ax.scatter([c.memory_per_gpu / 1e9 for c in mine], [c.step_time_s for c in mine], s=14, color=color,
                       label=f"{'no' if recompute == 'none' else recompute} recomputation")
    fastest = p.configs[:top]
    ax.scatter([c.memory_per_gpu / 1e9 for c in fastest], [c.step_time_s for c in fastest], s=70,
               facecolors="none", edgecolors="black", linewidths=1, label=f"the {len(fastest)} fastest")
    ax.annotate("#1", (fastest[0].memory_per_gpu / 1e9, fastest[0].step_time_s), xytext=(0, -7),
                textcoords="offset points", ha="center", va="top", fontsize=7)
    usable = usable_bytes(p.machine) / 1e9
    ax.axvline(usable, color="black", linestyle="--", linewidth=1,
               label=f"usable: {USABLE_MEMORY:.0%} of {p.machine.memory_gb:g} GB")
    ax.set_xlim(0, p.machine.memory_gb)
    _log_seconds(ax, [c.step_time_s for c in p.configs])
    ax.set_xlabel("GB per GPU")
    ax.set_title(f"every layout that fits ({len(p.configs)})", fontsize=10)
    _legend_below(ax, 3)


def _figure(p: Planned, top: int = 5):
    fig = NotebookFigure(figsize=(11, 4.4), layout="constrained")
    if p.no_fit:
        fig.text(0.5, 0.5, textwrap.fill(p.no_fit, 90), ha="center", va="center", color="#b00")
        return fig
    parts, right = fig.subplots(1, 2, width_ratios=[3, 2])
    _draw_parts(parts, p.configs[:top])
    handles, labels = parts.get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False, fontsize=8)
    parts.set_title(f"{p.cfg.name} on {p.gpus} x {p.machine.name}, global batch {p.global_batch}: "
                    f"the {min(top, len(p.configs))} fastest", fontsize=10)
    if p.trajectory:
        _draw_search(right, p)
    else:
        _draw_memory(right, p, top)
    return fig


def planner_figure(model: str = "175b", machine: str = "frontier", gpus: int = GPUS,
                   global_batch: int = GLOBAL_BATCH, *, top: int = 5, **options):
    """A static Figure of the planner's answer: `planner_figure("1t", "frontier", 3072, 8016, samples=50)`.
    Other keywords are `plan_for`'s; a model that fits nowhere draws the reason."""
    return _figure(plan_for(model, machine, gpus, global_batch, **options), top)


class PlannerWidget:
    """Controls for the model, its sequence length, the machine, the GPUs, the global batch, ZeRO and recomputation
    (pinned or the planner's choice) and the random search's samples; shows the fastest layouts
    (table), why the best wins (readout) and where their time goes (figure).

    `PlannerWidget("175b", machine="frontier", gpus=1024, global_batch=8000)` in a notebook cell displays it. Its
    state is inspectable without a browser: set `w.controls["gpus"].value = 512` and `w.planned`
    (plan_for's answer), `w.text`, `w.header`, `w.rows`, `w.readout.value`, `w.table.value` and `w.png` follow.
    At long sequences (`seq_len=131072`) the layouts gain a CP column.
    """

    def __init__(self, model: str = "175b", machine: str = "frontier", gpus: int = GPUS,
                 global_batch: int = GLOBAL_BATCH, *, top: int = 5, zero: int | None = None,
                 recompute: str | None = None, samples: int = 0, seq_len: int | None = None):
        import ipywidgets as W

        self.top = top
        style = {"description_width": "130px"}
        c = self.controls = {
            "model": W.Dropdown(options=[(preset_label(n), n) for n in MODELS], value=model, description="model",
                                style=style, layout=W.Layout(width="580px")),
            # "the model's own" is ANY, not None: a Dropdown whose value is None shows no entry at all.
            "seq_len": W.Dropdown(options=[("the model's own", ANY)] + [(f"{n:,} tokens", n) for n in SEQ_LENS],
                                  value=ANY if seq_len is None else seq_len, description="sequence length", style=style,
                                  layout=W.Layout(width="330px")),
            "machine": W.Dropdown(options=[(m.name, name) for name, m in MACHINE_NAMES.items()], value=machine,
                                  description="machine", style=style, layout=W.Layout(width="460px")),
            "gpus": W.Dropdown(options=sorted({*GPU_COUNTS, gpus}), value=gpus, description="GPUs", style=style),
            "global_batch": W.BoundedIntText(value=global_batch, min=1, max=1_000_000, description="global batch",
                                             style=style),
            "zero": W.Dropdown(options=[("planner's choice", ANY)] + [(f"ZeRO-{z}", z) for z in ZERO_STAGES],
                               value=ANY if zero is None else zero, description="ZeRO", style=style),
            "recompute": W.Dropdown(options=[("planner's choice", ANY)] + [(r, r) for r in RECOMPUTE],
                                    value=recompute or ANY, description="recomputation", style=style),
            "samples": W.IntSlider(value=samples, min=0, max=MAX_SAMPLES, step=10, description="search samples",
                                   style=style, layout=W.Layout(width="460px")),
        }
        for name, control in c.items():  # so that a browser test, or a stylesheet, can find each one
            control.add_class(f"labsupport-planner-{name.replace('_', '-')}")
        self.readout = W.HTML().add_class("labsupport-planner-readout")
        self.table = W.HTML().add_class("labsupport-planner-table")
        # align_self: a VBox would otherwise stretch a narrower picture to its width (blurred, not sharper).
        picture = W.Layout(max_width="100%", align_self="flex-start", margin="0")
        self.image = W.Image(format="png", layout=picture).add_class("labsupport-planner-figure")
        self.widget = W.VBox([W.VBox(list(c.values())), self.readout, self.table, self.image])
        self.widget.add_class("labsupport-planner")
        for control in c.values():
            control.observe(lambda change: self.update(), names="value")
        self.update()

    def options(self) -> dict:
        """The current control values as keywords of `plan_for`."""
        return {name: None if control.value == ANY else control.value for name, control in self.controls.items()}

    def update(self) -> Planned:
        """Plan again from the controls; refresh readout, table, text and picture. Returns the plan."""
        p = self.planned = plan_for(**self.options())
        lines = summary(p, self.top)
        self.text = "\n".join(lines)
        self.rows = table_rows(p, self.top)
        self.header = header(p, self.top)
        color = "#b00" if p.no_fit else "black"
        self.readout.value = (f"<div style='max-width:960px; color:{color}'>"
                              + "<br>".join(html.escape(line) for line in lines) + "</div>")
        self.table.value = self._table_html()
        self.png = figure_png(self.figure())
        self.image.value = self.png
        return p

    def _table_html(self) -> str:
        if not self.rows:
            return ""
        # Narrow padding: the table must fit JupyterLab's output area beside an open file browser (about 590 px).
        cell = "<td style='padding:1px 3px; text-align:{}'>{}</td>"
        body = "".join("<tr>" + "".join(cell.format("left" if h == "recompute" else "right", html.escape(v))
                                        for h, v in zip(self.header, row)) + "</tr>" for row in self.rows)
        columns = "".join(f"<th style='padding:1px 3px'>{h}</th>" for h in self.header)
        return f"<table><tr>{columns}</tr>{body}</table>"

    def figure(self):
        """A static Figure of what the widget shows now: the stand-in for `show(widget, figure)`."""
        return _figure(self.planned, self.top)

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
