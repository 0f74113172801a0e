"""What tensor parallelism sends in one optimizer step, and what that costs on a real machine:
the comm-counter widget and its static figure.

Every number comes from `labsupport.estimate.tp_comm.step_cost`: the collectives from `tp_comm.tp_comm` and `tp_comm.total`, their time from
`comm_cost.collective_time` (ring algorithm) over the link that `machines.link` picks for a group
of T devices, the compute from `flops.training_flops_per_token` at `flops.TYPICAL_MFU`. This module
only chooses the inputs, formats the outputs and draws them:

    comm_figure(...)          the same as a static Figure: wire bytes per op and phase; the two times
    scaling_figure(ratios)    communication / compute against T, one line per machine, the node
                              boundary marked: why T stays inside a node
    from_run(summary)         the settings of a `labsupport.train.run(...)` result and what its rank 0
                              counted, so that a real run can be drawn beside its prediction
    CommCounterWidget(...)    controls -> step_cost(...) -> readout, table, figure; .figure() is the
                              static stand-in for show(w, w.figure())
"""
from __future__ import annotations

import html

from matplotlib.patches import Patch
from matplotlib.ticker import NullFormatter

from .figure import NotebookFigure, bytes_axis, figure_png
from .memory import preset_label
from ..estimate.flops import TYPICAL_MFU
from ..estimate.machines import MACHINES
from ..estimate.shapes import PRESETS, preset_shape, tensor_parallel_problems
from ..estimate.memory import RECOMPUTE
from ..estimate.tp_comm import PHASES, step_cost
from ..units import format_bytes

TP_DEGREES = (1, 2, 4, 8, 16, 32)
BYTES = {"bf16": 2, "fp32": 4}  # bytes per activation element, by the run's --dtype
PHASE_LABELS = {"forward": "forward", "recompute": "recompute (forward again)", "backward": "backward",
                "finish": "finish (SP: LayerNorm and bias gradients)", "clip": "clip (gradient norm)"}
COLORS = {"forward": "#4C72B0", "recompute": "#64B5CD", "backward": "#55A868", "finish": "#CCB974",
          "clip": "#8172B2"}
# The static figure fits JupyterLab's output area beside a 1280-px-wide window with the file browser open
# (about 800 px at the stored figures' 100 dpi); the byte axis ends above the tallest bar.
FIGSIZE = (7.4, 3.9)
HEADROOM = 1.12
RUN_KEYS = ("model", "seq_len", "vocab", "tp", "sequence_parallel", "micro_batch", "microbatches",
            "bytes_per_element", "recompute")  # what a run's counts depend on: the widget must match them to compare


def tp_choices(cfg) -> list[int]:
    """The tensor-parallel degrees offered for a model (a ModelConfig): those that split its heads, its
    key/value heads and its MLP width into whole pieces (`shapes.tensor_parallel_problems`)."""
    return [t for t in TP_DEGREES if not tensor_parallel_problems(cfg, t)]


def format_time(seconds: float) -> str:
    """0.0123 -> '12.3 ms'; 4.5e-5 -> '45 us'."""
    for unit, scale in (("s", 1), ("ms", 1e-3)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-6:.3g} us"


def from_run(summary: dict) -> tuple[dict, dict]:
    """(`step_cost`'s keywords for a run, what its rank 0 counted in its last step: {op: calls,
    payload_bytes, wire_bytes}) from a `labsupport.train.run(...)` result or `labsupport train --json`.
    The counts are the run's TP group's (`comm_groups`), so data-parallel traffic stays out;
    `labsupport.train` keeps every activation (recompute "none")."""
    shape, parallel = summary["model"], summary["parallel"]
    if shape["name"] not in PRESETS:
        raise ValueError(f"the run's model {shape['name']!r} is not a preset: the widget offers only presets")
    if parallel["pp"] != 1:
        raise ValueError("the comm counter predicts tensor parallelism without pipeline stages (pp = 1)")
    micro = summary["micro_batch"]
    settings = dict(model=shape["name"], seq_len=shape["seq_len"], vocab=shape["vocab"], tp=parallel["tp"],
                    sequence_parallel=parallel["sequence_parallel"], micro_batch=micro,
                    microbatches=summary["global_batch"] // (parallel["dp"] * micro),
                    bytes_per_element=BYTES[summary["dtype"]], recompute="none")
    return settings, summary["comm_groups"][0].get("tp", {})


def _title(model: str, tp: int, sequence_parallel: bool = False, recompute: str = "none") -> str:
    return (f"{model}, T = {tp}" + (", sequence parallel" if sequence_parallel else "")
            + ("" if recompute == "none" else f", {recompute} recomputation"))


def _figure(pred: dict, machine: str, counted: dict | None, title: str):
    """Two panels: wire bytes per op, stacked by phase (the counted bytes beside them, hatched,
    when given), and the step's communication time against its compute time."""
    fig = NotebookFigure(figsize=FIGSIZE, layout="constrained")
    ax, times = fig.subplots(1, 2, width_ratios=[4, 3])
    ops = sorted(set(pred["total"]) | set(counted or {}))
    width = 0.38 if counted else 0.6
    shift = -width / 2 if counted else 0
    bottom = [0.0] * len(ops)
    for phase in PHASES:
        if phase in pred["phases"]:
            heights = [pred["phases"][phase].get(op, {}).get("wire_bytes", 0) for op in ops]
            ax.bar([x + shift for x in range(len(ops))], heights, width, bottom=bottom, color=COLORS[phase],
                   label=PHASE_LABELS[phase])
            bottom = [b + h for b, h in zip(bottom, heights)]
    handles = list(ax.get_legend_handles_labels()[0])
    tallest = max(bottom, default=0.0)
    if counted:
        heights = [counted.get(op, {}).get("wire_bytes", 0) for op in ops]
        ax.bar([x + width / 2 for x in range(len(ops))], heights, width, color="white", edgecolor="gray", hatch="//")
        handles.append(Patch(facecolor="white", edgecolor="gray", hatch="//", label="counted in the run"))
        tallest = max([tallest, *heights])
    if tallest > 0:
        # Set, not left to autoscaling: each stacked layer's bar is "sticky" at its bottom, and a thin top layer
        # (the clip's 8 bytes) pins the axis to the stack's top, so the tallest bar would touch the frame.
        ax.set_ylim(0, tallest * HEADROOM)
    ax.set_xticks(range(len(ops)), ops)
    bytes_axis(ax.yaxis)
    ax.set_ylabel("wire bytes per rank and step")
    if ops:  # two rows when the counted bars add a fifth entry: one row would be wider than the figure
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 3 if len(handles) > 4 else 4),
                   frameon=False, fontsize=8)
    else:
        ax.text(0.5, 0.5, "T = 1: nothing to send", transform=ax.transAxes, ha="center")
    ax.set_title(title, fontsize=10)

    seconds = [pred["comm_s"], pred["compute_s"]]
    times.barh([1, 0], seconds, color=["#C44E52" if pred["crosses"] else "#DD8452", "#4C72B0"])
    # "of peak", not "MFU": under recomputation the device also executes the recomputed forward's FLOPs,
    # so 40 % of peak is the hardware's utilization, and the model's FLOPs use less of it.
    times.set_yticks([1, 0], ["TP\ncommunication", f"compute\n({TYPICAL_MFU:.0%} of peak)"])  # two lines: room for the title
    for y, s in zip([1, 0], seconds):
        times.annotate(format_time(s), (s, y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    times.set_xlim(0, max(seconds) * 1.3)
    times.set_xticks([])  # the bars carry their times
    # Short lines: the panel is narrow, and the longest machine name fills one of them.
    where = "between nodes,\nat a pessimistic bound" if pred["crosses"] else "inside one node"
    times.set_title(f"comm / compute = {pred['ratio']:.3g}\n{machine}\n{pred['gbps']:g} GB/s {where}", fontsize=10,
                    color="#b00" if pred["crosses"] else "black")
    return fig


def comm_figure(model: str = "22b", tp: int = 8, machine: str = "DGX H100", *, counted: dict | None = None,
                title: str | None = None, **options):
    """A static Figure of one step's TP traffic and its cost: `comm_figure("22b", 16, "Frontier (MI250X GCD)")`.
    Other keywords are `step_cost`'s; `counted` ({op: calls, payload_bytes, wire_bytes}) is drawn beside."""
    pred = step_cost(model, tp, machine, **options)
    return _figure(pred, machine, counted, title or _title(model, tp, options.get("sequence_parallel", False),
                                                           options.get("recompute", "none")))


def scaling_figure(ratios: dict[str, dict[int, float]], devices_per_node: int = 8, title: str = ""):
    """Communication / compute against T on log axes, one line per machine ({machine: {T: ratio}}),
    with the node boundary and the break-even line marked. Only T and the 1-2-5 values carry labels:
    a log axis's default minor labels run into each other."""
    fig = NotebookFigure(figsize=(6.4, 3.6), layout="constrained")
    ax = fig.subplots()
    for machine, by_tp in ratios.items():
        tps = sorted(by_tp)
        ax.plot(tps, [by_tp[t] for t in tps], marker="o", label=machine)
    ax.set(xscale="log", yscale="log", xlabel="tensor-parallel degree T", ylabel="TP comm / compute per layer")
    ax.set_title(title, fontsize=10)
    tps = sorted({t for by_tp in ratios.values() for t in by_tp})
    ax.set_xticks(tps, [str(t) for t in tps])
    low, high = ax.get_ylim()
    steps = [m * 10 ** e for e in range(-3, 4) for m in (1, 2, 5) if low <= m * 10 ** e <= high]
    ax.set_yticks(steps, [f"{v:g}" for v in steps])
    ax.set_ylim(low, high)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.axvline(devices_per_node, color="gray", linestyle=":")
    ax.text(devices_per_node * 1.04, high / 1.5, f"node boundary ({devices_per_node} devices)", color="gray",
            va="top", fontsize=9)
    ax.axhline(1, color="black", linewidth=0.5)
    ax.text(tps[0], 1.08, "communication = compute", fontsize=8, va="bottom")
    ax.legend(loc="lower right", fontsize=9)
    return fig


class CommCounterWidget:
    """Controls for a model, T, sequence parallelism, the batch, the element size, recomputation and a machine;
    shows one step's tensor-parallel collectives (table and bars) and their time beside the compute.

    `CommCounterWidget("22b", tp=8)` in a notebook cell displays it. Its state is inspectable
    without a browser: set `w.controls["tp"].value = 16` and `w.prediction` (step_cost's dict),
    `w.text`, `w.readout.value`, `w.table.value` and `w.png` follow. `measured=` takes a
    `labsupport.train.run(...)` result: the controls start at its settings (`machine` aside) and
    its counts appear beside the prediction whenever the controls match them again; a bare
    {op: counts} dict is taken to belong to the settings given as keywords.
    """

    def __init__(self, model: str = "22b", *, tp: int = 8, machine: str = "DGX H100", sequence_parallel: bool = False,
                 micro_batch: int = 1, microbatches: int = 1, bytes_per_element: int = 2, seq_len: int | None = None,
                 vocab: int | None = None, recompute: str = "none", measured: dict | None = None):
        import ipywidgets as W

        settings = dict(model=model, seq_len=seq_len, vocab=vocab, tp=tp, sequence_parallel=sequence_parallel,
                        micro_batch=micro_batch, microbatches=microbatches, bytes_per_element=bytes_per_element,
                        recompute=recompute)
        self.counted = measured
        if measured is not None and "comm_groups" in measured:
            settings, self.counted = from_run(measured)
        self.vocab = settings["vocab"]
        cfg = preset_shape(settings["model"], self.vocab, seq_len=settings["seq_len"])
        settings["seq_len"] = cfg.seq_len
        if settings["tp"] not in tp_choices(cfg):
            raise ValueError(f"T = {settings['tp']} is not offered for {cfg.name} ({cfg.heads} heads, {cfg.n_kv_heads} "
                             f"key/value heads, MLP width {cfg.ffn}): choose one "
                             f"of {tp_choices(cfg)}")
        # Every description fits its 180 px label and every menu entry its box (tests measure them):
        # the model menu is wide enough for "gpt2-medium (analysis shape: ...)", the rest share one width.
        style, wide, narrow = {"description_width": "180px"}, W.Layout(width="680px"), W.Layout(width="440px")
        c = self.controls = {
            "model": W.Dropdown(options=[(preset_label(n), n) for n in PRESETS], value=cfg.name,
                                description="model", style=style, layout=wide),
            "seq_len": W.BoundedIntText(value=cfg.seq_len, min=1, max=10_000_000, description="sequence length",
                                        style=style, layout=narrow),
            "tp": W.Dropdown(options=tp_choices(cfg), value=settings["tp"], description="tensor parallel T",
                             style=style, layout=narrow),
            "sequence_parallel": W.Checkbox(value=settings["sequence_parallel"], description="sequence parallel",
                                            style=style, layout=narrow),
            "micro_batch": W.BoundedIntText(value=settings["micro_batch"], min=1, max=4096, description="micro-batch",
                                            style=style, layout=narrow),
            "microbatches": W.BoundedIntText(value=settings["microbatches"], min=1, max=4096,
                                             description="micro-batches per step", style=style, layout=narrow),
            "bytes_per_element": W.Dropdown(options=[("bf16 (2 bytes)", 2), ("fp32 (4 bytes)", 4)],
                                            value=settings["bytes_per_element"], description="activations",
                                            style=style, layout=narrow),
            "recompute": W.Dropdown(options=list(RECOMPUTE), value=settings["recompute"], description="recomputation",
                                    style=style, layout=narrow),
            "machine": W.Dropdown(options=list(MACHINES), value=machine, description="machine", style=style,
                                  layout=narrow),
        }
        for name, control in c.items():  # so that a browser test, or a stylesheet, can find each one
            control.add_class(f"labsupport-comm-{name.replace('_', '-')}")
        self.run_settings = {k: settings[k] for k in RUN_KEYS}
        self.readout = W.HTML().add_class("labsupport-comm-readout")
        self.table = W.HTML().add_class("labsupport-comm-table")
        self.image = W.Image(format="png", layout=W.Layout(max_width="100%")).add_class("labsupport-comm-figure")
        self.widget = W.VBox([W.VBox(list(c.values())), self.readout, self.table, self.image])
        self.widget.add_class("labsupport-comm")
        self.prediction: dict = {}
        self.text = ""
        self.png = b""
        self._holding = False  # while one control sets another, update once at the end
        c["model"].observe(self._model_changed, names="value")
        for control in c.values():
            control.observe(self._changed, names="value")
        self.update()

    def _model_changed(self, change):
        """A preset brings its own context, and T must divide its heads: keep the largest T that does."""
        cfg = preset_shape(change["new"], self.vocab)
        tp = self.controls["tp"]
        keep = tp.value
        self._holding = True
        try:
            tp.options = tp_choices(cfg)
            tp.value = max(t for t in tp.options if t <= keep)
            self.controls["seq_len"].value = cfg.seq_len
        finally:
            self._holding = False

    def _changed(self, change):
        if not self._holding:
            self.update()

    def options(self) -> dict:
        """The current control values as keywords of `step_cost`."""
        return dict({name: control.value for name, control in self.controls.items()}, vocab=self.vocab)

    def matches_run(self) -> bool:
        """Whether the controls are the settings the counted traffic belongs to."""
        options = self.options()
        return self.counted is not None and all(options[k] == v for k, v in self.run_settings.items())

    def update(self) -> dict:
        """Recompute from the controls; refresh readout, table, text and picture. Returns the prediction."""
        o = self.options()
        pred = self.prediction = step_cost(**o)
        m = MACHINES[o["machine"]]
        tp = o["tp"]
        compute = (f"compute {format_time(pred['compute_s'])} ({pred['flops']:.3g} FLOPs per rank at {TYPICAL_MFU:.0%} "
                   f"of {m.peak_tflops_bf16:g} TFLOP/s bf16)")
        if tp == 1:
            self.text = f"T = 1: one device holds every layer and tensor parallelism sends nothing; {compute}."
            crossing = ""
        else:
            crossing = (f"T = {tp} > {m.devices_per_node} devices per node: the ring crosses the network"
                        if pred["crosses"] else f"T = {tp} fits in one node of {m.devices_per_node}")
            bound = ("; between nodes that bandwidth is a pessimistic bound and alpha an assumption, so the time "
                     "is an estimate whose bandwidth term errs high" if pred["crosses"] else "")
            link_text = f"{pred['gbps']:g} GB/s per direction, alpha {pred['alpha_s'] * 1e6:g} us{bound}"
            self.text = (f"{crossing} ({link_text}). "
                         f"On {m.name} one step's TP communication takes {format_time(pred['comm_s'])}, its "
                         f"{compute}: communication / compute = {pred['ratio']:.3g}.")
        if self.counted is not None:
            self.text += " " + self._run_text()
        shown = html.escape(self.text)
        if pred["crosses"]:
            shown = shown.replace(html.escape(crossing), f"<b style='color:#b00'>{html.escape(crossing)}</b>", 1)
        self.readout.value = f"<div style='max-width:960px'>{shown}</div>"
        self.table.value = self._table_html()
        self.png = figure_png(self.figure())
        self.image.value = self.png
        return pred

    def _run_text(self) -> str:
        run = self.run_settings
        if not self.matches_run():
            return (f"(The run's counts belong to {run['model']}, T = {run['tp']}, sequence parallel "
                    f"{'on' if run['sequence_parallel'] else 'off'}, micro-batch {run['micro_batch']} x "
                    f"{run['microbatches']}, {run['bytes_per_element']} bytes per element, recomputation "
                    f"{run['recompute']}: set the controls back to compare.)")
        same = self.counted == self.prediction["total"]
        return ("Counted in the run: " + ", ".join(f"{op} {c['calls']} calls, {format_bytes(c['wire_bytes'])} on the wire"
                                                    for op, c in sorted(self.counted.items()))
                + (": exactly the prediction." if same else ": not the prediction, see the table."))

    def _table_html(self) -> str:
        pred, counted = self.prediction, self.counted if self.matches_run() else None
        head = ["phase", "op", "calls", "payload", "wire bytes"]
        rows = [[PHASE_LABELS[phase], op, c["calls"], format_bytes(c["payload_bytes"]), format_bytes(c["wire_bytes"])]
                for phase in PHASES for op, c in pred["phases"].get(phase, {}).items()]
        none = {"calls": 0, "payload_bytes": 0, "wire_bytes": 0}
        # What the run counted goes in a row under each step total, not in columns beside it: three more
        # columns made the table wider than the output area (issue 28).
        for op in sorted(set(pred["total"]) | set(counted or {})):
            c = pred["total"].get(op, none)
            rows.append(["<b>step total</b>", f"<b>{op}</b>", c["calls"], format_bytes(c["payload_bytes"]),
                         format_bytes(c["wire_bytes"])])
            if counted is not None:
                k = counted.get(op, none)
                rows.append(["<i>counted in the run</i>", f"<i>{op}</i>", k["calls"], format_bytes(k["payload_bytes"]),
                             format_bytes(k["wire_bytes"])])
        if not rows:
            return ""
        # nowrap: a narrow output area must scroll the table, not break "18.9 MB" over two lines
        cell = "<td style='padding:1px 10px; white-space:nowrap; text-align:{}'>{}</td>"
        body = "".join("<tr>" + "".join(cell.format("left" if i < 2 else "right", v) for i, v in enumerate(r))
                       + "</tr>" for r in rows)
        header = "".join(f"<th style='padding:1px 10px; white-space:nowrap'>{h}</th>" for h in head)
        return f"<div style='overflow-x:auto'><table><tr>{header}</tr>{body}</table></div>"

    def figure(self):
        """A static Figure of what the widget shows now: the stand-in for `show(widget, figure)`."""
        o = self.options()
        return _figure(self.prediction, o["machine"], self.counted if self.matches_run() else None,
                       _title(o["model"], o["tp"], o["sequence_parallel"], o["recompute"]))

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)
