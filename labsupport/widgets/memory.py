"""Where the memory of a training step goes: the memory-breakdown widget and its static figures.

Every number here comes from `labsupport.estimate` (`memory.estimate_memory`, the function behind
`labsupport memory`, `memory.largest_model_that_fits`, `offload.offload_pays`) and every shape from
`estimate.shapes`; this module only chooses the inputs, formats the outputs and draws them:

    MemoryWidget(...)                 controls -> estimate_memory(...) -> verdict, readout, and a figure:
                                      its stacked bar, or with parallel=True the layout at ZeRO stages 0-3,
                                      the chosen one outlined;
                                      .figure(): the same as a static Figure (show(w, w.figure()))
    memory_figure(...)                stacked bars as a static matplotlib Figure, one per value of a setting
    zero_stages_figure(...)           ZeRO's Figure 1: baseline, P_os, P_os+g, P_os+g+p side by side
    measured_vs_predicted_figure(..)  a run's measured bytes beside the prediction, per category

Figures are built with `matplotlib.figure.Figure` rather than pyplot, so they never pile up
in pyplot's list of open figures and are shown exactly once when a notebook cell returns one.
"""
from __future__ import annotations

import html

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .figure import figure_png
from ..estimate.flops import TYPICAL_MFU, peak_tflops, training_flops_per_token
from ..estimate.memory import BYTES_PER_PARAM, RECOMPUTE, estimate_memory, largest_model_that_fits, recipe_label
from ..estimate.offload import DEVICE_HOST_LINK, HOST_LINK_GBPS, offload_pays
from ..estimate.shapes import CPU_PRESETS, PRESETS, ModelConfig, preset_shape
from ..units import BYTE_UNITS, format_bytes

CATEGORIES = ("params", "grads", "optimizer", "activations")
LABELS = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states",
          "activations": "activations"}
COLORS = {"params": "#4C72B0", "grads": "#DD8452", "optimizer": "#55A868", "activations": "#C44E52"}
CUSTOM = "custom"  # the model-menu entry that takes a parameter count instead of a shape
SHAPE = "custom shape"  # the model-menu entry that takes layers, hidden size, heads and vocabulary
GB = 10**9  # decimal gigabytes, as in the workshop decks
ZERO_STAGES = {0: "baseline", 1: "$P_{os}$", 2: "$P_{os+g}$", 3: "$P_{os+g+p}$"}  # ZeRO Figure 1's names, as mathtext
# Memory per device as marketed, in GB of 10^9 bytes: slightly conservative, the parts hold
# 80 GiB (85.9e9 bytes) and 64 GiB. An MI250X module is two GCDs, each its own device.
DEVICES = {"A100 80 GB": 80, "H100 80 GB": 80, "MI250X GCD 64 GB": 64}


def preset_label(name: str) -> str:
    """A model menu's entry: 'gpt2 (analysis shape: 12 layers x 768, 12 heads)'."""
    cfg = PRESETS[name]
    kind = "CPU preset" if name in CPU_PRESETS else "analysis shape"
    return f"{name} ({kind}: {cfg.n_layers} layers x {cfg.hidden}, {cfg.heads} heads)"


def model_shape(model: str, vocab: int | None = None, seq_len: int | None = None, layers: int | None = None,
                hidden: int | None = None, heads: int | None = None):
    """The ModelConfig of a preset (CPU presets get `vocab`, default the shipped corpus's), or of
    SHAPE from layers, hidden, heads, vocab and seq_len; `seq_len` replaces a preset's context."""
    if model == SHAPE:
        if None in (layers, hidden, heads, vocab, seq_len):
            raise ValueError("a custom shape needs layers, hidden, heads, vocab and seq_len")
        return ModelConfig(SHAPE, layers, hidden, heads, vocab, seq_len)
    return preset_shape(model, vocab, seq_len=seq_len)


def split_options(model: str | None = "22b", *, n_params: float | None = None, **options) -> tuple:
    """`breakdown`'s keywords as (the ModelConfig or None, the parameter count or None, estimate_memory's keywords)."""
    shape = {k: options.pop(k) for k in ("vocab", "seq_len", "layers", "hidden", "heads") if k in options}
    if model in (None, CUSTOM):
        if n_params is None:
            raise ValueError("give a model preset or a parameter count")
        return None, int(n_params), options
    return model_shape(model, **shape), None, options


def breakdown(model: str | None = "22b", **options) -> dict:
    """`estimate_memory` for a preset name, a custom shape (`model=SHAPE` with layers, hidden,
    heads, vocab, seq_len), or a bare parameter count (`model=None` or CUSTOM, with n_params).

    Presets take `vocab` (CPU presets) and `seq_len` (another context). The other keywords go
    straight to estimate_memory: micro_batch, precision, dp, tp, pp, zero, sequence_parallel,
    recompute, offload. A bare parameter count has no shape, so no activations.
    """
    cfg, n_params, options = split_options(model, **options)
    return estimate_memory(cfg, n_params=n_params, **options)


def describe(est: dict, gpu_memory_gb: float | None = None) -> str:
    """One paragraph of plain text: the bytes per device by category, the total, and whether it fits."""
    parts = ", ".join(f"{LABELS[k]} {format_bytes(est[k])}" for k in CATEGORIES)
    text = f"{est['n_params']:,} parameters. Per device: {parts}; total {format_bytes(est['total'])}."
    if gpu_memory_gb:
        text += " " + verdict(est, gpu_memory_gb)
    return text


def verdict(est: dict, gpu_memory_gb: float, device: str | None = None) -> str:
    """'It fits on one ... using N%' or 'It does not fit on one ...: it needs N times as much.'"""
    name = device or f"{gpu_memory_gb:g} GB GPU"
    share = est["total"] / (gpu_memory_gb * GB)
    if share <= 1:
        return f"It fits on one {name}, using {100 * share:.3g}% of it."
    return f"It does not fit on one {name}: it needs {share:.3g} times as much."


def _unit(largest: float) -> tuple[str, float]:
    """The unit of a bar chart's axis: the largest that `largest` reaches, kB at the least."""
    return next(((unit, scale) for unit, scale in BYTE_UNITS if largest >= scale), BYTE_UNITS[-1])


def _draw_stacked(ax, labels, estimates, gpu_memory_gb=None, title=None, capacity_label=None, highlight=None):
    """Stacked bars (one per estimate, one segment per category) and the GPU's capacity as a line;
    the bar at index `highlight` is outlined and its label set in bold. The legend names the
    categories that hold bytes (a custom parameter count has no activations) and the line."""
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
    handles = [bars for k, bars in zip(CATEGORIES, ax.containers) if any(e[k] for e in estimates)]
    if show_gpu:  # named in the legend: a label on the line would sit on a bar that crosses it
        handles.append(ax.axhline(gpu / scale, color="black", linestyle="--", linewidth=1.2,
                                  label=capacity_label or f"one GPU: {gpu_memory_gb:g} GB"))
    elif gpu is not None:
        ax.text(0.02, 0.97, f"a {gpu_memory_gb:g} GB GPU is far above this scale", transform=ax.transAxes,
                va="top", fontsize=9)
    top = max(largest, gpu if show_gpu else 0) / scale
    ax.set_ylim(0, top * 1.15 or 1)
    ax.set_xticks(list(xs), labels)
    if highlight is not None:
        ax.bar([highlight], [estimates[highlight]["total"] / scale], width=0.6, fill=False, edgecolor="black",
               linewidth=2)
        ax.get_xticklabels()[highlight].set_fontweight("bold")
    ax.set_ylabel(f"bytes per device ({unit})")
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
              fontsize=9)
    if title:
        ax.set_title(title, fontsize=11)


def memory_figure(model: str | None = "22b", *, vary: str | None = None, values=(),
                  gpu_memory_gb: float | None = 80, title: str | None = None, n_params: float | None = None,
                  vocab: int | None = None, labels=None, **options):
    """A static Figure of the memory breakdown: one stacked bar, or one per value of `vary`.

    `memory_figure("22b", precision="mixed")` draws one bar;
    `memory_figure(vary="model", values=["forge-s", "22b"])` one bar per model;
    `memory_figure("22b", vary="zero", values=[0, 1, 2, 3], dp=8)` one per ZeRO stage.
    Other keywords are `breakdown`'s (micro_batch, precision, dp, tp, pp, zero, offload, seq_len, ...);
    `labels` replaces the bars' default names.
    """
    settings = dict(model=model, n_params=n_params, vocab=vocab, **options)
    if vary is None:
        runs = [settings]
        default = [model if model not in (None, CUSTOM) else f"{float(n_params):.3g} params"]
    else:
        if not values:
            raise ValueError(f"vary={vary!r} needs values=[...]")
        runs = [{**settings, vary: v} for v in values]
        default = [str(v) if vary == "model" else f"{vary}={v}" for v in values]
    estimates = [breakdown(**r) for r in runs]
    fig = Figure(figsize=(2.2 + 1.1 * len(estimates), 3.6), layout="constrained")
    _draw_stacked(fig.add_subplot(), labels or default, estimates, gpu_memory_gb, title)
    return fig


def zero_stages_figure(model: str | None = CUSTOM, *, n_params: float | None = 7.5e9, dp: int = 64,
                       precision: str = "mixed", gpu_memory_gb: float | None = None, title: str | None = None,
                       **options):
    """ZeRO stages 0-3 side by side, named as in Rajbhandari et al. 2020, Figure 1.

    The defaults are that figure: Psi = 7.5B parameters, N_d = 64, K = 12 (mixed precision):
    120 GB, 31.4 GB, 16.6 GB and 1.9 GB per device. Any model and layout works the same way:
    `zero_stages_figure("22b", dp=8, micro_batch=1, gpu_memory_gb=80)`.
    """
    if model not in (None, CUSTOM):
        n_params = None
    if title is None:
        size = model if n_params is None else f"{n_params / 1e9:g}B parameters"
        title = f"ZeRO stages: {size}, N_d = {dp}, {precision}"
    return memory_figure(model, vary="zero", values=list(ZERO_STAGES), labels=list(ZERO_STAGES.values()),
                         n_params=n_params, dp=dp, precision=precision, gpu_memory_gb=gpu_memory_gb,
                         title=title, **options)


def measured_vs_predicted_figure(measured: dict, predicted: dict, title: str | None = None,
                                 categories=CATEGORIES):
    """Bars side by side per category: what a run measured beside what estimate/ predicted."""
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
    """Controls for a model, a precision recipe, a parallel layout and a device; shows
    estimate_memory's bytes per device, whether they fit, and the largest model that would.

    `MemoryWidget("22b")` in a notebook cell displays it. Its state is inspectable without a
    browser: set `w.controls["precision"].value = "fp32"` and `w.estimate` (the dict that
    estimate_memory returned), `w.stages` (the same layout at ZeRO stages 0-3), `w.largest`
    (largest_model_that_fits's answer), `w.text`, `w.verdict.value` and `w.png` follow;
    `w.update()` recomputes them. `parallel=True` adds dp, tp, pp, ZeRO stage, recomputation,
    sequence parallelism and offloading. Picking a device sets the memory box; typing another
    size there makes the device "custom".
    """

    def __init__(self, model: str = "22b", *, precision: str = "mixed", micro_batch: int = 1,
                 gpu_memory_gb: float | None = None, device: str = "A100 80 GB", vocab: int | None = None,
                 n_params: float = 7.5e9, seq_len: int | None = None, dp: int = 1, tp: int = 1, pp: int = 1,
                 zero: int = 0, recompute: str = "none", sequence_parallel: bool = False, offload: bool = False,
                 pcie: str | None = None, parallel: bool = False):
        import ipywidgets as W

        self.vocab, self.parallel = vocab, parallel
        if gpu_memory_gb is not None and DEVICES.get(device) != gpu_memory_gb:
            device = CUSTOM
        start_shape = model_shape(model if model not in (CUSTOM, SHAPE) else "22b", vocab)
        style = {"description_width": "140px"}  # the longest description, "GPU memory (GB)", in full
        whole = W.Layout(width="auto")  # a checkbox's text follows the indent: let the row be as wide as it
        menu = ([(preset_label(name), name) for name in PRESETS] + [("custom: a shape", SHAPE)]
                + [("custom: a parameter count", CUSTOM)])
        c = self.controls = {
            "model": W.Dropdown(options=menu, value=model, description="model", style=style,
                                layout=W.Layout(width="600px")),
            # a text box, not a log slider: a slider's step would move 7.5e9 to its nearest notch
            "n_params": W.BoundedFloatText(value=n_params, min=1e6, max=1e13, description="parameters", style=style),
            "layers": W.BoundedIntText(value=start_shape.n_layers, min=1, max=10_000, description="layers",
                                       style=style),
            "hidden": W.BoundedIntText(value=start_shape.hidden, min=1, max=1_000_000, description="hidden size",
                                       style=style),
            "heads": W.BoundedIntText(value=start_shape.heads, min=1, max=10_000, description="heads", style=style),
            "shape_vocab": W.BoundedIntText(value=start_shape.vocab, min=1, max=10_000_000, description="vocabulary",
                                            style=style),
            "seq_len": W.BoundedIntText(value=seq_len or start_shape.seq_len, min=1, max=10_000_000,
                                        description="sequence length", style=style),
            "precision": W.Dropdown(options=[(recipe_label(r), r) for r in BYTES_PER_PARAM], value=precision,
                                    description="precision", style=style, layout=W.Layout(width="660px")),
            "micro_batch": W.IntSlider(value=micro_batch, min=1, max=64, description="micro-batch", style=style),
            "device": W.Dropdown(options=[*DEVICES, CUSTOM], value=device, description="device", style=style,
                                 layout=W.Layout(width="340px")),
            "gpu_memory_gb": W.BoundedFloatText(value=gpu_memory_gb or DEVICES[device], min=1, max=100_000, step=8,
                                                description="GPU memory (GB)", style=style),
            "dp": W.BoundedIntText(value=dp, min=1, max=1_000_000, description="data parallel", style=style),
            "tp": W.Dropdown(options=[1, 2, 4, 8, 16, 32, 64], value=tp, description="tensor parallel", style=style),
            "pp": W.BoundedIntText(value=pp, min=1, max=1024, description="pipeline stages", style=style),
            "zero": W.ToggleButtons(options=list(ZERO_STAGES), value=zero, description="ZeRO stage", style=style),
            "recompute": W.ToggleButtons(options=list(RECOMPUTE), value=recompute, description="recompute",
                                         style=style),
            "sequence_parallel": W.Checkbox(value=sequence_parallel, description="sequence parallel", style=style,
                                            layout=whole),
            "offload": W.Checkbox(value=offload, description="offload optimizer to host (ZeRO-Offload)",
                                  style=style, layout=whole),
            "pcie": W.Dropdown(options=list(HOST_LINK_GBPS),
                               value=pcie or DEVICE_HOST_LINK.get(device, DEVICE_HOST_LINK["A100 80 GB"]),
                               description="host link", style=style, layout=W.Layout(width="380px")),
        }
        for name, control in c.items():  # so that a browser test, or a stylesheet, can find each one
            control.add_class(f"labsupport-memory-{name.replace('_', '-')}")
        shown = ["model", "n_params", "layers", "hidden", "heads", "shape_vocab", "seq_len", "precision",
                 "micro_batch", "device", "gpu_memory_gb"]
        if parallel:
            shown += ["dp", "tp", "pp", "zero", "recompute", "sequence_parallel", "offload", "pcie"]
        self.verdict = W.HTML().add_class("labsupport-memory-verdict")
        self.readout = W.HTML().add_class("labsupport-memory-readout")
        self.image = W.Image(format="png", layout=W.Layout(max_width="900px")).add_class("labsupport-memory-figure")
        self.widget = W.VBox([W.VBox([c[name] for name in shown]), self.verdict, self.readout, self.image])
        self.widget.add_class("labsupport-memory")
        self.estimate: dict | None = None
        self.stages: list[dict] = []
        self.largest: dict | None = None
        self.error: str | None = None
        self.text = ""
        self.png = b""
        self._holding = False  # while one control sets another, update once at the end
        c["model"].observe(self._model_changed, names="value")
        c["device"].observe(self._device_changed, names="value")
        c["gpu_memory_gb"].observe(self._memory_changed, names="value")
        for control in c.values():
            control.observe(self._changed, names="value")
        self.update()

    def _set(self, name, value):
        self._holding = True
        try:
            self.controls[name].value = value
        finally:
            self._holding = False

    def _model_changed(self, change):
        if change["new"] not in (CUSTOM, SHAPE):  # a preset brings its own context length
            self._set("seq_len", model_shape(change["new"], self.vocab).seq_len)

    def _device_changed(self, change):
        if change["new"] in DEVICES:
            self._set("gpu_memory_gb", DEVICES[change["new"]])
            self._set("pcie", DEVICE_HOST_LINK[change["new"]])

    def _memory_changed(self, change):
        if DEVICES.get(self.controls["device"].value) != change["new"]:
            self._set("device", CUSTOM)

    def _changed(self, change):
        if not self._holding:
            self.update()

    def options(self) -> dict:
        """The current control values as keywords of `breakdown` / estimate_memory."""
        values = {name: control.value for name, control in self.controls.items()}
        for name in ("gpu_memory_gb", "device", "pcie"):
            del values[name]
        shape = {k: values.pop(k) for k in ("layers", "hidden", "heads", "shape_vocab")}
        if values["model"] == CUSTOM:
            del values["seq_len"]
        else:
            del values["n_params"]
        if values["model"] == SHAPE:
            return dict(values, layers=shape["layers"], hidden=shape["hidden"], heads=shape["heads"],
                        vocab=shape["shape_vocab"])
        return dict(values, vocab=self.vocab)

    def device_label(self) -> str:
        c = self.controls
        return c["device"].value if c["device"].value in DEVICES else f"{c['gpu_memory_gb'].value:g} GB GPU"

    def _label(self) -> str:
        model = self.controls["model"].value
        if model == CUSTOM:
            return f"{self.controls['n_params'].value:.3g} params"
        if model == SHAPE:
            c = self.controls
            return f"{c['layers'].value} x {c['hidden'].value}"
        return model

    def update(self) -> dict | None:
        """Recompute from the controls; refresh verdict, readout, text and picture.
        Returns the estimate (None on error)."""
        c = self.controls
        model = c["model"].value
        c["n_params"].layout.display = None if model == CUSTOM else "none"
        for name in ("layers", "hidden", "heads", "shape_vocab"):
            c[name].layout.display = None if model == SHAPE else "none"
        c["seq_len"].layout.display = "none" if model == CUSTOM else None
        c["pcie"].layout.display = None if c["offload"].value else "none"
        opts = self.options()
        try:
            est = breakdown(**opts)
        except ValueError as e:  # e.g. heads not divisible by tp: say so instead of raising in a callback
            self.estimate, self.stages, self.largest, self.error = None, [], None, str(e)
            self.text = f"Not a valid layout: {e}"
            self.verdict.value = ""
            self.readout.value = f"<span style='color:#b00'>{html.escape(self.text)}</span>"
            return None
        self.estimate, self.error = est, None
        self.stages = [breakdown(**{**opts, "zero": z}) for z in ZERO_STAGES]
        gpu = c["gpu_memory_gb"].value
        fits = verdict(est, gpu, self.device_label())
        self.verdict.value = (f"<b style='color:{'#1a7f37' if est['total'] <= gpu * GB else '#b00'}'>"
                              f"{html.escape(fits)}</b>")
        self.text = describe(est) + " " + fits
        if model == CUSTOM:
            self.text += " Activations need a shape (layers, hidden, sequence): pick a preset to see them."
        if c["offload"].value:
            self.text += " " + self._offload_text(est)
        self.largest = self._largest(opts, gpu)
        self.text += " " + self._largest_text()
        self.readout.value = f"<div style='max-width:900px'>{html.escape(self.text)}</div>"
        self.png = figure_png(self._figure(self._label()))
        self.image.value = self.png
        return est

    def _offload_text(self, est: dict) -> str:
        c = self.controls
        text = (f"Offloaded: the host holds {format_bytes(est['host'])} for this device; each step moves "
                f"{format_bytes(est['pcie_to_host'])} of gradients to the host and "
                f"{format_bytes(est['pcie_to_device'])} "
                f"of weights back over {c['pcie'].value} ({HOST_LINK_GBPS[c['pcie'].value]:g} GB/s each way).")
        peaks = peak_tflops(c["device"].value)
        cfg, _, _ = split_options(**self.options())
        if cfg is None or peaks is None:
            return text + " (Pick a model shape and a named device to compare with the step's compute.)"
        tokens = c["micro_batch"].value * cfg.seq_len  # one micro-batch per step: the least compute to hide behind
        step_flops = training_flops_per_token(cfg) * tokens / (c["tp"].value * c["pp"].value)
        pays = offload_pays(est["pcie"], step_flops, peaks[1] * 1e12, TYPICAL_MFU, HOST_LINK_GBPS[c["pcie"].value])
        if pays["hidden"]:
            return text + (f" That takes {pays['transfer_s']:.3g} s, hidden behind one micro-batch's "
                           f"{pays['compute_s']:.3g} s of compute (at {TYPICAL_MFU:.0%} of its bf16 peak).")
        return text + (f" That takes {pays['transfer_s']:.3g} s against one micro-batch's {pays['compute_s']:.3g} s of "
                       f"compute (at {TYPICAL_MFU:.0%} of its bf16 peak): not hidden unless each step processes "
                       f"{pays['break_even_tokens_factor']:.3g} times the tokens (gradient accumulation).")

    @staticmethod
    def _largest(opts: dict, gpu_gb: float) -> dict | None:
        cfg, _, options = split_options(**opts)
        return largest_model_that_fits(gpu_gb * GB, cfg, **options)

    def _largest_text(self) -> str:
        best = self.largest
        if best is None:
            return "No model of this family fits this device with these settings."
        if best["shape"] is None:
            return (f"The largest parameter count that fits: {best['n_params'] / 1e9:.3g} B "
                    f"(model states only, {format_bytes(best['total'])}).")
        cfg = best["shape"]
        return (f"The largest model of the family d = 128 L that fits: {cfg.n_layers} layers x {cfg.hidden}, "
                f"{best['n_params'] / 1e9:.3g} B parameters ({format_bytes(best['total'])}).")

    def figure(self):
        """A static Figure of what the widget shows now: the stand-in for `show(widget, figure)`.

        Stored notebooks keep no widget state, so `labsupport.widgets.show.show(w, w.figure())`
        puts this picture beside the live widget in one output.
        """
        if self.estimate is None:
            raise ValueError(f"the widget shows no estimate: {self.error}")
        opts = self.options()
        title = f"{self._label()}, {opts['precision']}, micro-batch {opts['micro_batch']}"
        if opts["offload"]:
            title += ", optimizer on the host"
        return self._figure(title)

    def _figure(self, title=None):
        """The layout at ZeRO stages 0-3 side by side against the device, the chosen stage outlined;
        without the parallel controls (one device: every stage the same) just its one bar."""
        c = self.controls
        gpu = c["gpu_memory_gb"].value
        capacity = f"{c['device'].value}" if c["device"].value in DEVICES else f"one GPU: {gpu:g} GB"
        if self.parallel:
            labels = [f"ZeRO-{z}\n{name}" for z, name in ZERO_STAGES.items()]
            bars, chosen = self.stages, c["zero"].value
        else:
            labels, bars, chosen = [self._label()], [self.estimate], None
        fig = Figure(figsize=(6.4 if self.parallel else 4.6, 3.8), layout="constrained")
        _draw_stacked(fig.add_subplot(), labels, bars, gpu, title, capacity, highlight=chosen)
        return fig

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


def memory_widget(model: str = "22b", **kwargs):
    """The ipywidgets container of a `MemoryWidget` (keywords as MemoryWidget's)."""
    return MemoryWidget(model, **kwargs).widget
