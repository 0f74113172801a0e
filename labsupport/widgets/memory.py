"""Where the memory of a training step goes: the memory-breakdown widget and its static figures.

Every number here comes from `labsupport.estimate.memory.estimate_memory`, the function behind
`labsupport memory`; this module only chooses the inputs, formats the outputs and draws them:

    MemoryWidget(...)                 controls -> estimate_memory(...) -> readout + stacked bar;
                                      .figure(): the same bar as a static Figure (show(w, w.figure()))
    memory_figure(...)                the same stacked bars as a static matplotlib Figure
    measured_vs_predicted_figure(..)  a run's measured bytes beside the prediction, per category

Figures are built with `matplotlib.figure.Figure` rather than pyplot, so they never pile up
in pyplot's list of open figures and are shown exactly once when a notebook cell returns one.
"""
from __future__ import annotations

import functools
import html

from .show import figure_png
from ..estimate.memory import BYTES_PER_PARAM, RECOMPUTE, estimate_memory
from ..model import CPU_PRESETS, PRESETS, get_preset

CATEGORIES = ("params", "grads", "optimizer", "activations")
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
          "activations": "activations"}
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}
CUSTOM = "custom"  # the model-menu entry that takes a parameter count instead of a shape
GB = 10**9  # decimal gigabytes, as in the workshop decks


@functools.lru_cache(maxsize=None)
def corpus_vocab() -> int:
    """Vocabulary of the shipped corpus's character tokenizer: what the CPU presets train with."""
    from ..data import CharTokenizer, load_text
    return CharTokenizer.from_text(load_text()).vocab_size


def model_shape(model: str, vocab: int | None = None):
    """The ModelConfig of a preset. CPU presets get `vocab` (default: the shipped corpus's)."""
    cfg = get_preset(model)
    if cfg.vocab is None:
        cfg = cfg.with_vocab(vocab if vocab is not None else corpus_vocab())
    return cfg


def breakdown(model: str | None = "22b", *, n_params: float | None = None, vocab: int | None = None,
              **options) -> dict:
    """`estimate_memory` for a preset name, or for a bare parameter count (`model=None` or "custom").

    `options` go straight to estimate_memory: micro_batch, precision, dp, tp, pp, zero,
    sequence_parallel, recompute. A bare parameter count has no shape, so no activations.
    """
    if model in (None, CUSTOM):
        if n_params is None:
            raise ValueError("give a model preset or a parameter count")
        return estimate_memory(n_params=int(n_params), **options)
    return estimate_memory(model_shape(model, vocab), **options)


def format_bytes(n: float) -> str:
    """1234567890 -> '1.23 GB'; small values in MB or kB so a CPU model does not read as 0.00 GB."""
    for unit, scale in (("TB", 10**12), ("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def describe(est: dict, gpu_memory_gb: float | None = None) -> str:
    """One paragraph of plain text: the bytes per device by category, the total, and whether it fits."""
    parts = ", ".join(f"{LABELS[k]} {format_bytes(est[k])}" for k in CATEGORIES)
    text = f"{est['n_params']:,} parameters. Per device: {parts}; total {format_bytes(est['total'])}."
    if gpu_memory_gb:
        share = est["total"] / (gpu_memory_gb * GB)
        if share <= 1:
            text += f" It fits on one {gpu_memory_gb:g} GB GPU, using {100 * share:.3g}% of it."
        else:
            text += f" It does not fit on one {gpu_memory_gb:g} GB GPU: it needs {share:.3g} times as much."
    return text


def _unit(largest: float) -> tuple[str, float]:
    for unit, scale in (("TB", 10**12), ("GB", GB), ("MB", 10**6)):
        if largest >= scale:
            return unit, scale
    return "kB", 10**3


def _draw_stacked(ax, labels, estimates, gpu_memory_gb=None, title=None):
    """Stacked bars (one per estimate, one segment per category) and the GPU's capacity as a line."""
    largest = max(e["total"] for e in estimates)
    gpu = gpu_memory_gb * GB if gpu_memory_gb else None
    show_gpu = gpu is not None and gpu <= 20 * largest  # a line far above tiny bars would flatten them
    unit, scale = _unit(max(largest, gpu) if show_gpu else largest)
    xs = range(len(estimates))
    bottom = [0.0] * len(estimates)
    for k in CATEGORIES:
        heights = [e[k] / scale for e in estimates]
        ax.bar(xs, heights, bottom=bottom, color=COLORS[k], label=LABELS[k], width=0.6)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, e in zip(xs, estimates):
        ax.annotate(format_bytes(e["total"]), (x, e["total"] / scale), ha="center", va="bottom",
                    xytext=(0, 2), textcoords="offset points", fontsize=9)
    if show_gpu:
        ax.axhline(gpu / scale, color="black", linestyle="--", linewidth=1.2)
        ax.annotate(f"one GPU: {gpu_memory_gb:g} GB", (0, gpu / scale), xycoords=("axes fraction", "data"),
                    xytext=(4, 3), textcoords="offset points", fontsize=9)
    elif gpu is not None:
        ax.text(0.02, 0.97, f"a {gpu_memory_gb:g} GB GPU is far above this scale", transform=ax.transAxes,
                va="top", fontsize=9)
    top = max(largest, gpu if show_gpu else 0) / scale
    ax.set_ylim(0, top * 1.15 or 1)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel(f"bytes per device ({unit})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=9)
    if title:
        ax.set_title(title, fontsize=11)


def memory_figure(model: str | None = "22b", *, vary: str | None = None, values=(),
                  gpu_memory_gb: float | None = 80, title: str | None = None, n_params: float | None = None,
                  vocab: int | None = None, **options):
    """A static Figure of the memory breakdown: one stacked bar, or one per value of `vary`.

    `memory_figure("22b", precision="mixed")` draws one bar;
    `memory_figure(vary="model", values=["forge-s", "22b"])` one bar per model;
    `memory_figure("22b", vary="zero", values=[0, 1, 2, 3], dp=8)` one per ZeRO stage.
    Other keywords are estimate_memory's (micro_batch, precision, dp, tp, pp, zero, ...).
    """
    from matplotlib.figure import Figure

    settings = dict(model=model, n_params=n_params, vocab=vocab, **options)
    if vary is None:
        runs = [settings]
        labels = [model if model not in (None, CUSTOM) else f"{float(n_params):.3g} params"]
    else:
        if not values:
            raise ValueError(f"vary={vary!r} needs values=[...]")
        runs = [{**settings, vary: v} for v in values]
        labels = [str(v) if vary == "model" else f"{vary}={v}" for v in values]
    estimates = [breakdown(**r) for r in runs]
    fig = Figure(figsize=(2.2 + 1.1 * len(estimates), 3.6), layout="constrained")
    _draw_stacked(fig.add_subplot(), labels, estimates, gpu_memory_gb, title)
    return fig


def measured_vs_predicted_figure(measured: dict, predicted: dict, title: str | None = None,
                                 categories=CATEGORIES):
    """Bars side by side per category: what a run measured beside what estimate/ predicted."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    largest = max(max(measured[k], predicted[k]) for k in categories)
    unit, scale = _unit(largest)
    fig = Figure(figsize=(6.4, 3.4), layout="constrained")
    ax = fig.add_subplot()
    xs = range(len(categories))
    for offset, source, hatch in ((-0.2, measured, None), (0.2, predicted, "//")):
        bars = ax.bar([x + offset for x in xs], [source[k] / scale for k in categories], width=0.38,
                      color=[COLORS.get(k, "gray") for k in categories], hatch=hatch, edgecolor="white")
        ax.bar_label(bars, labels=[f"{source[k] / scale:,.2f}" for k in categories], fontsize=8, padding=2)
    ax.set_xticks(list(xs), [LABELS.get(k, k) for k in categories])
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_ylim(0, largest / scale * 1.18)
    ax.legend(handles=[Patch(facecolor="gray", edgecolor="white", label="measured (left)"),
                       Patch(facecolor="gray", edgecolor="white", hatch="//", label="predicted (right, hatched)")],
              frameon=False)
    if title:
        ax.set_title(title, fontsize=11)
    return fig


class MemoryWidget:
    """Controls for a model and a parallel layout; shows estimate_memory's bytes per device.

    `MemoryWidget("22b")` in a notebook cell displays it. Its state is inspectable without a
    browser: set `w.controls["precision"].value = "fp32"` and `w.estimate` (the dict that
    estimate_memory returned), `w.text` and `w.png` follow; `w.update()` recomputes them.
    `parallel=True` adds dp, tp, pp, ZeRO stage, recomputation and sequence parallelism.
    """

    def __init__(self, model: str = "22b", *, precision: str = "mixed", micro_batch: int = 1,
                 gpu_memory_gb: float = 80, vocab: int | None = None, n_params: float = 7.5e9,
                 dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0, recompute: str = "none",
                 sequence_parallel: bool = False, parallel: bool = False):
        import ipywidgets as W

        self.vocab = vocab
        style = {"description_width": "110px"}
        menu = [(self._menu_label(name), name) for name in PRESETS] + [("custom: a parameter count", CUSTOM)]
        c = self.controls = {
            "model": W.Dropdown(options=menu, value=model, description="model", style=style),
            "n_params": W.FloatLogSlider(value=n_params, base=10, min=6, max=13, step=0.05,
                                         description="parameters", readout_format=".3g", style=style),
            "precision": W.ToggleButtons(options=list(BYTES_PER_PARAM), value=precision, description="precision",
                                         style=style),
            "micro_batch": W.IntSlider(value=micro_batch, min=1, max=64, description="micro-batch", style=style),
            "gpu_memory_gb": W.BoundedFloatText(value=gpu_memory_gb, min=1, max=100_000, step=8,
                                                description="GPU memory (GB)", style=style),
            "dp": W.BoundedIntText(value=dp, min=1, max=1_000_000, description="data parallel", style=style),
            "tp": W.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=tp, description="tensor parallel", style=style),
            "pp": W.BoundedIntText(value=pp, min=1, max=1024, description="pipeline stages", style=style),
            "zero": W.ToggleButtons(options=[0, 1, 2, 3], value=zero, description="ZeRO stage", style=style),
            "recompute": W.ToggleButtons(options=list(RECOMPUTE), value=recompute, description="recompute",
                                         style=style),
            "sequence_parallel": W.Checkbox(value=sequence_parallel, description="sequence parallel", style=style),
        }
        shown = ["model", "n_params", "precision", "micro_batch", "gpu_memory_gb"]
        if parallel:
            shown += ["dp", "tp", "pp", "zero", "recompute", "sequence_parallel"]
        self.readout = W.HTML()
        self.image = W.Image(format="png", layout=W.Layout(max_width="680px"))
        self.widget = W.VBox([W.VBox([c[name] for name in shown]), self.readout, self.image])
        self.estimate: dict | None = None
        self.error: str | None = None
        self.text = ""
        self.png = b""
        for control in c.values():
            control.observe(self._changed, names="value")
        self.update()

    @staticmethod
    def _menu_label(name: str) -> str:
        cfg = PRESETS[name]
        kind = "CPU preset" if name in CPU_PRESETS else "analysis shape"
        return f"{name} ({kind}: {cfg.n_layers} layers x {cfg.hidden})"

    def _changed(self, change):
        self.update()

    def options(self) -> dict:
        """The current control values as keywords of `breakdown` / estimate_memory."""
        values = {name: control.value for name, control in self.controls.items()}
        del values["gpu_memory_gb"]
        if values["model"] != CUSTOM:
            del values["n_params"]
        return dict(values, vocab=self.vocab)

    def update(self) -> dict | None:
        """Recompute from the controls; refresh readout, text and picture. Returns the estimate (None on error)."""
        c = self.controls
        c["n_params"].layout.display = None if c["model"].value == CUSTOM else "none"
        opts = self.options()
        try:
            est = breakdown(**opts)
        except ValueError as e:  # e.g. heads not divisible by tp: say so instead of raising in a callback
            self.estimate, self.error, self.text = None, str(e), f"Not a valid layout: {e}"
            self.readout.value = f"<span style='color:#b00'>{html.escape(self.text)}</span>"
            return None
        self.estimate, self.error = est, None
        gpu = c["gpu_memory_gb"].value
        self.text = describe(est, gpu)
        if opts["model"] == CUSTOM:
            self.text += " Activations need a shape (layers, hidden, sequence): pick a preset to see them."
        self.readout.value = f"<div style='max-width:680px'>{html.escape(self.text)}</div>"
        label = opts["model"] if opts["model"] != CUSTOM else f"{c['n_params'].value:.3g} params"
        fig = self._figure(label, est, gpu)
        self.png = figure_png(fig)
        self.image.value = self.png
        return est

    def figure(self):
        """A static Figure of what the widget shows now: the stand-in for `show(widget, figure)`.

        Stored notebooks keep no widget state, so `labsupport.widgets.show.show(w, w.figure())`
        puts this picture beside the live widget in one output.
        """
        if self.estimate is None:
            raise ValueError(f"the widget shows no estimate: {self.error}")
        opts = self.options()
        label = opts["model"] if opts["model"] != CUSTOM else f"{self.controls['n_params'].value:.3g} params"
        title = f"{label}, {opts['precision']}, micro-batch {opts['micro_batch']}"
        return self._figure(label, self.estimate, self.controls["gpu_memory_gb"].value, title)

    @staticmethod
    def _figure(label, est, gpu, title=None):
        from matplotlib.figure import Figure

        fig = Figure(figsize=(4.6, 3.6), layout="constrained")
        _draw_stacked(fig.add_subplot(), [label], [est], gpu, title)
        return fig

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def memory_widget(model: str = "22b", **kwargs):
    """The ipywidgets container of a `MemoryWidget` (keywords as MemoryWidget's)."""
    return MemoryWidget(model, **kwargs).widget
