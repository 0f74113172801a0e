"""The planner widget: every number is estimate.planner's (plan, why, search, explain_no_fit); no browser needed."""
import base64
from dataclasses import replace

import matplotlib
import pytest

matplotlib.use("Agg")

from figures import cut_off_controls, figure_defects  # noqa: E402

from labsupport.estimate.planner import (MACHINE_NAMES, explain_no_fit, plan, search, step_flops,  # noqa: E402
                                         usable_bytes, why)
from labsupport.model import PRESETS  # noqa: E402
from labsupport.widgets import planner as pw  # noqa: E402
from labsupport.widgets import show as sh  # noqa: E402

def expected_rows(configs, cfg, global_batch, top=5):
    best = configs[0].step_time_s
    return [[str(i), str(c.dp), str(c.tp), str(c.pp), str(c.micro_batch), str(c.zero), c.recompute,
             f"{c.memory_per_gpu / 1e9:.1f}", f"{c.step_time_s:.4g}",
             f"{step_flops(cfg, global_batch, c.recompute) / c.step_time_s / c.gpus / 1e12:.4g}",
             f"{c.step_time_s / best - 1:+.1%}"] for i, c in enumerate(configs[:top], 1)]


def test_the_table_and_reasons_are_the_planners():
    w = pw.PlannerWidget()  # the deck's 175B strong-scaling run: 1,024 GCDs, a total batch of 8,000
    assert (w.options()["model"], w.options()["gpus"], w.options()["global_batch"]) == ("175b", 1024, 8000)
    cfg, frontier = PRESETS["175b"], MACHINE_NAMES["frontier"]
    configs = plan(cfg, frontier, 1024, 8000)
    assert w.planned.configs == configs and w.rows == expected_rows(configs, cfg, 8000)
    assert w.text.splitlines()[1:] == why(configs[0], cfg, frontier, 1024, 8000)
    assert w.rows[0][1:4] == ["16", "4", "16"]  # the planner's best is Table VI's TP 4 x PP 16
    assert f"{len(configs)} layouts fit, the 5 fastest below" in w.text
    assert w.table.value.count("<tr>") == 1 + 5 and "TFLOP/s/GPU" in w.table.value
    assert w.rows[0][-1] == "+0.0%"


def test_controls_change_the_table():
    w = pw.PlannerWidget("175b", machine="frontier", gpus=1024, global_batch=8000)
    for name, value in [("machine", "dgx-h100"), ("gpus", 512), ("global_batch", 800), ("model", "22b"), ("zero", 0),
                        ("recompute", "full")]:
        before, png = (w.text, w.rows), w.png
        w.controls[name].value = value
        o = w.options()
        cfg = PRESETS[o["model"]]
        configs = plan(cfg, MACHINE_NAMES[o["machine"]], o["gpus"], o["global_batch"], zero=o["zero"],
                       recompute=o["recompute"])
        assert w.rows == expected_rows(configs, cfg, o["global_batch"]), name
        assert (w.text, w.rows) != before and w.png != png, f"{name} changed nothing"
    assert {row[5] for row in w.rows} == {"0"} and {row[6] for row in w.rows} == {"full"}  # pinned
    w.controls["recompute"].value = pw.ANY  # back to the planner's choice
    assert w.options()["recompute"] is None and w.rows == expected_rows(
        plan(PRESETS["22b"], MACHINE_NAMES["dgx-h100"], 512, 800, zero=0), PRESETS["22b"], 800)


def test_a_model_that_fits_nowhere_says_why_in_one_line():
    w = pw.PlannerWidget("1t", machine="frontier", gpus=8)
    reason = explain_no_fit(PRESETS["1t"], MACHINE_NAMES["frontier"], 8, 8000)
    assert w.planned.no_fit == reason and w.text == reason and "\n" not in w.text
    assert w.rows == [] and w.table.value == "" and "color:#b00" in w.readout.value
    assert [t.get_text().replace("\n", " ") for t in w.figure().texts] == [reason]
    w.controls["samples"].value = 20  # no search on top of a model that does not fit
    assert w.planned.trajectory == [] and w.text == reason
    w.controls["gpus"].value = 3072
    assert w.planned.no_fit.startswith("no layout splits this model over 3072 GPUs with global batch 8000")
    w.controls["global_batch"].value = 8016  # the workshop's
    assert w.planned.no_fit is None and len(w.rows) == 5


def test_the_figure_splits_the_fastest_step_times_into_their_parts():
    w = pw.PlannerWidget("175b", machine="frontier", gpus=1024, top=4)
    parts_ax, memory_ax = w.figure().axes
    top = w.planned.configs[:4]
    heights = [p.get_height() for p in parts_ax.patches]
    assert heights == pytest.approx([getattr(c, part) for part in pw.PARTS for c in top])  # stacked: part by part
    assert [sum(heights[i::4]) for i in range(4)] == pytest.approx([c.step_time_s for c in top])
    assert [t.get_text() for t in parts_ax.texts] == [f"{c.step_time_s:.3g} s" for c in top]
    # the right panel without a search: every fitting layout, the 4 fastest ringed, the usable memory as a line
    *dots, rings = memory_ax.collections
    assert sum(len(col.get_offsets()) for col in dots) == len(w.planned.configs)
    assert rings.get_offsets().tolist() == [[c.memory_per_gpu / 1e9, c.step_time_s] for c in top]
    (usable,) = memory_ax.get_lines()
    assert usable.get_xdata()[0] == pytest.approx(usable_bytes(MACHINE_NAMES["frontier"]) / 1e9)


def test_search_mode_draws_the_trajectory():
    w = pw.PlannerWidget("175b", machine="frontier", gpus=1024, samples=50)
    trajectory = search(PRESETS["175b"], MACHINE_NAMES["frontier"], 1024, 8000, 50, 0)
    assert w.planned.trajectory == trajectory
    assert w.text.splitlines()[-1].startswith("Random search, 50 samples (seed 0), "
                                              f"{sum(s.step_time_s is None for s in trajectory)} out of memory")
    ax = w.figure().axes[1]
    assert ax.get_title() == "random search: 50 samples (seed 0)"
    best_so_far, best_of_all = ax.get_lines()
    fit = [s for s in trajectory if s.step_time_s is not None]
    assert list(best_so_far.get_xdata()) == [s.index + 1 for s in fit] + [50]  # samples numbered from 1
    assert list(best_so_far.get_ydata()) == [s.best_s for s in fit] + [fit[-1].best_s]
    assert best_of_all.get_ydata()[0] == w.planned.configs[0].step_time_s
    samples, oom = ax.collections
    assert len(samples.get_offsets()) + len(oom.get_offsets()) == 50
    w.controls["samples"].value = 0
    assert w.planned.trajectory == [] and not w.text.splitlines()[-1].startswith("Random search")


def test_static_figure_stands_in_for_the_widget(monkeypatch):
    w = pw.PlannerWidget("22b", machine="dgx-a100", gpus=64, global_batch=512, samples=30)
    static = pw.planner_figure("22b", "dgx-a100", 64, 512, samples=30)
    for drawn, alone in zip(w.figure().axes, static.axes):
        assert [p.get_height() for p in drawn.patches] == [p.get_height() for p in alone.patches]
        assert drawn.get_title() == alone.get_title()
    assert w.png.startswith(b"\x89PNG") and w.image.value == w.png

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append(obj))
    sh.show(w, w.figure())
    (bundle,) = shown
    assert sh.WIDGET_VIEW in bundle and base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")


@pytest.mark.parametrize("options", [
    dict(model="175b", machine="frontier", gpus=1024, global_batch=8000, samples=40),
    dict(model="175b", machine="frontier", gpus=1024, global_batch=8000),
    dict(model="175b", machine="frontier", gpus=128, global_batch=640, samples=40),
    dict(model="1t", machine="frontier", gpus=3072, global_batch=8016, samples=200),
    dict(model="22b", machine="dgx-a100", gpus=64, global_batch=512, samples=30),
    dict(model="gpt2", machine="dgx-h100", gpus=8, global_batch=64, samples=10)])
def test_nothing_in_the_figure_is_cut_off_covered_or_on_top_of_another(options):
    """Issue 18: the search plot's legend sat on its points, the best line under the lowest tick."""
    assert figure_defects(pw.planner_figure(**options)) == []


def test_the_search_plot_numbers_samples_from_1_and_labels_the_best_line():
    """Issue 18: the x axis began at 0 with a tick every 5 and the dashed best line lay on the
    lowest tick label with nothing saying its value. Now sample 1 is the first tick, the best of all
    layouts says its step time on its line, inside the axes, and the crosses of the samples out
    of memory are in a strip above every point."""
    w = pw.PlannerWidget("175b", machine="frontier", gpus=1024, samples=40)
    fig = w.figure()
    ax = fig.axes[1]
    figure_defects(fig)  # draws it
    renderer = fig.canvas.get_renderer()
    assert ax.get_xticks()[0] == 1 and ax.get_xlim() == (0.5, 40.5)
    best = w.planned.configs[0].step_time_s
    (label,) = [t for t in ax.texts if t.get_text() == f"best of all {len(w.planned.configs)} layouts: {best:.3g} s"]
    inside = ax.get_window_extent(renderer)
    extent = label.get_window_extent(renderer)
    assert inside.y0 < extent.y0 and extent.y1 < ax.transData.transform((1, best))[1] <= inside.y1
    samples, oom = (c.get_offset_transform().transform(c.get_offsets()) for c in ax.collections)
    assert len(oom) and oom[:, 1].min() > samples[:, 1].max() + 10  # pixels
    best_so_far = ax.get_lines()[0]
    assert best_so_far.get_xdata()[-1] == 40  # drawn to the last sample, which ran out of memory


def test_the_controls_show_their_whole_labels():
    """Issue 18 (a model menu's entries cut off in JupyterLab)."""
    assert cut_off_controls(pw.PlannerWidget().controls) == []


def test_menus():
    w = pw.PlannerWidget(gpus=96)  # a count outside the menu joins it
    assert 96 in w.controls["gpus"].options and all(n % 8 == 0 for n in w.controls["gpus"].options)
    assert [v for _, v in w.controls["model"].options] == pw.MODELS and "nano" not in pw.MODELS
    assert [v for _, v in w.controls["machine"].options] == list(MACHINE_NAMES)
    with pytest.raises(ValueError, match="unknown machine"):
        pw.plan_for("175b", "summit")
    # A Dropdown whose value is None selects no entry and shows an empty box: "the model's own" is a value of its own.
    seq = w.controls["seq_len"]
    assert seq.value is not None and seq.label == "the model's own" and w.options()["seq_len"] is None
    seq.value = 8192
    assert w.planned.cfg.seq_len == 8192
    seq.label = "the model's own"
    assert w.planned.cfg.seq_len == PRESETS["175b"].seq_len


def test_at_a_long_context_the_table_and_figure_gain_the_cp_axis():
    """131,072 tokens: the 175B's layouts split the sequence (estimate.planner), so the table has a cp column after pp
    and the bars a CP ring part; at the presets' own 2048 tokens neither appears."""
    w = pw.PlannerWidget("175b", machine="frontier", gpus=1024, global_batch=64)
    assert w.header == pw.HEADER and "CP ring sends" not in [t.get_text() for t in w.figure().legends[0].get_texts()]
    w.controls["seq_len"].value = 131072
    cfg = replace(PRESETS["175b"], seq_len=131072)
    configs = plan(cfg, MACHINE_NAMES["frontier"], 1024, 64)
    assert w.planned.configs == configs and w.header == pw.HEADER[:4] + ["cp"] + pw.HEADER[4:]
    assert [row[4] for row in w.rows] == [str(c.cp) for c in configs[:5]] and all(c.cp > 1 for c in configs[:5])
    assert "<th style='padding:1px 3px'>cp</th>" in w.table.value and "global batch 64 x 131072 tokens" in w.text
    assert "CP ring sends" in [t.get_text() for t in w.figure().legends[0].get_texts()]
    assert figure_defects(w.figure()) == [] and cut_off_controls(w.controls) == []
