"""The comm-counter widget: every number is tp_comm's, collective_time's and the FLOP count's; no browser needed."""
import base64

import matplotlib
import pytest

matplotlib.use("Agg")

import re  # noqa: E402

from figures import px, text_px, texts_cut_or_overlapping  # noqa: E402
from labsupport.widgets.figure import DPI  # noqa: E402
from labsupport.estimate.comm_cost import collective_time  # noqa: E402
from labsupport.estimate.flops import training_flops_per_token  # noqa: E402
from labsupport.estimate.machines import MACHINES, link  # noqa: E402
from labsupport.estimate.tp_comm import step_cost, total, tp_comm  # noqa: E402
from labsupport.model import PRESETS  # noqa: E402
from labsupport.widgets import comm_counter as cc  # noqa: E402
from labsupport.widgets import show as sh  # noqa: E402


# JupyterLab's output area in a 1280-px-wide window with the file browser open is 848 px wide (Chromium,
# JupyterLab 4); 800 leaves a margin. test_browser.test_comm_counter_fits_the_output_area_in_jupyterlab checks
# the widget against the page itself.
OUTPUT_AREA_PX = 800


def fake_run(tp=2, sequence_parallel=False, micro_batch=4, global_batch=8, dtype="fp32", counted=None) -> dict:
    """The keys of a `labsupport.train.run(...)` result that the widget reads (nano on tp ranks)."""
    nano = PRESETS["nano"]
    settings = dict(model="nano", seq_len=nano.seq_len, vocab=65, tp=tp, sequence_parallel=sequence_parallel,
                    micro_batch=micro_batch, microbatches=global_batch // micro_batch,
                    bytes_per_element=cc.BYTES[dtype])
    counts = step_cost(**settings)["total"] if counted is None else counted
    return {"model": {"name": "nano", "n_layers": nano.n_layers, "hidden": nano.hidden, "heads": nano.heads,
                      "vocab": 65, "seq_len": nano.seq_len},
            "parallel": {"strategy": "tp", "dp": 1, "tp": tp, "pp": 1, "sequence_parallel": sequence_parallel},
            "micro_batch": micro_batch, "global_batch": global_batch, "dtype": dtype,
            "comm": [counts] * tp, "comm_groups": [{"tp": counts}] * tp}


def bar_heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def test_predict_is_tp_comm_priced_by_the_ring_formula():
    """22b at T = 8 on a DGX H100: the collectives are tp_comm's; each call costs the ring's alpha-beta
    time on NVLink; the compute is 1/8 of the step's training FLOPs at 40% of the H100's bf16 peak."""
    p = step_cost("22b", 8, "DGX H100", micro_batch=2, microbatches=3, bytes_per_element=2)
    cfg = PRESETS["22b"]
    step = tp_comm(48, 6144, 2048, 2, microbatches=3, bytes_per_element=2)
    assert p["total"] == total(step, 8)
    assert p["phases"] == {phase: total({phase: ops}, 8) for phase, ops in step.items()}
    alpha, gbps = link("DGX H100", 8)
    assert (p["alpha_s"], p["gbps"], p["crosses"]) == (5e-6, 450, False) == (alpha, gbps, False)
    latency = sum(c["calls"] * collective_time(op, "ring", 0, 8, alpha, 0) for op, c in p["total"].items())
    bandwidth = sum(collective_time(op, "ring", c["payload_bytes"], 8, 0, 1 / 450e9) for op, c in p["total"].items())
    assert p["comm_s"] == pytest.approx(latency + bandwidth)
    assert p["flops"] == training_flops_per_token(cfg) * 2 * 2048 * 3 / 8
    assert p["compute_s"] == pytest.approx(p["flops"] / (989e12 * 0.4))
    assert p["ratio"] == pytest.approx(p["comm_s"] / p["compute_s"])
    with pytest.raises(ValueError, match="T must divide"):
        step_cost("gpt2", 8)  # 12 heads
    with pytest.raises(ValueError, match="unknown machine"):
        step_cost("22b", 8, "Summit")


def test_controls_change_the_numbers():
    w = cc.CommCounterWidget("22b", tp=8)
    assert w.prediction["total"] == step_cost("22b", 8)["total"]
    assert "communication / compute = " + f"{w.prediction['ratio']:.3g}" in w.text
    seen = {w.text}
    for name, value in [("micro_batch", 4), ("microbatches", 8), ("bytes_per_element", 4), ("seq_len", 4096),
                        ("recompute", "full"), ("machine", "DGX A100"), ("tp", 4), ("model", "175b")]:
        before = w.png
        w.controls[name].value = value
        assert w.prediction == step_cost(**w.options()), name
        assert w.text not in seen and w.png != before, f"{name} changed nothing"
        seen.add(w.text)
    assert w.controls["seq_len"].value == 2048  # a preset brings its own context
    assert w.prediction["cfg"] == PRESETS["175b"]
    assert w.table.value.count("<tr>") == 1 + 4 + 1  # header; forward, recompute, backward, clip; step total
    w.controls["recompute"].value = "none"
    assert w.table.value.count("<tr>") == 1 + 3 + 1  # header; forward, backward and clip all_reduce; step total


def test_full_recomputation_adds_half_the_tp_traffic_and_a_third_of_the_compute():
    """Part II's 22B hands-on passes --checkpoint-activations: each layer's forward, its two all-reduces
    included, runs again in backward. The layers' TP traffic grows by 3/2 (the embedding's and the
    loss's stay), the compute by about 4/3 (the LM head is not recomputed)."""
    kept = step_cost("22b", 16, "Frontier (MI250X GCD)", micro_batch=2)
    full = step_cost("22b", 16, "Frontier (MI250X GCD)", micro_batch=2, recompute="full")
    assert full["phases"]["recompute"]["all_reduce"]["calls"] == 2 * 48 and "recompute" not in kept["phases"]
    assert full["total"]["all_reduce"]["calls"] == kept["total"]["all_reduce"]["calls"] + 2 * 48
    assert 1.45 < full["comm_s"] / kept["comm_s"] < 1.5
    assert 1.32 < full["flops"] / kept["flops"] < 4 / 3
    w = cc.CommCounterWidget("22b", tp=16, machine="Frontier (MI250X GCD)", micro_batch=2, recompute="full")
    assert w.prediction == full and "recompute (forward again)" in w.table.value
    assert w.figure().axes[0].get_title() == "22b, T = 16, full recomputation"


def test_sequence_parallelism_trades_all_reduces_for_all_gathers_and_reduce_scatters():
    w = cc.CommCounterWidget("22b", tp=8)
    plain = w.prediction["total"]
    w.controls["sequence_parallel"].value = True
    sp = w.prediction["total"]
    assert set(plain) == {"all_reduce"} and set(sp) == {"all_gather", "all_reduce", "reduce_scatter"}
    assert sp["all_reduce"]["calls"] < plain["all_reduce"]["calls"]  # only embedding, loss, SP's gradients, norm
    layer_pairs = sp["all_gather"]["wire_bytes"] + sp["reduce_scatter"]["wire_bytes"]
    assert layer_pairs > plain["all_reduce"]["wire_bytes"] - sp["all_reduce"]["wire_bytes"]  # plus the re-gathers
    assert "all_gather" in w.table.value and "reduce_scatter" in w.table.value


@pytest.mark.parametrize("machine", list(MACHINES))
def test_beyond_a_node_the_ring_crosses_the_network(machine):
    m = MACHINES[machine]
    w = cc.CommCounterWidget("175b", tp=8, machine=machine)
    inside = w.prediction
    assert not inside["crosses"] and (inside["alpha_s"], inside["gbps"]) == (m.intra_alpha_s, m.intra_gbps)
    assert "crosses the network" not in w.text and f"fits in one node of {m.devices_per_node}" in w.text
    w.controls["tp"].value = 16
    across = w.prediction
    assert across["crosses"] and (across["alpha_s"], across["gbps"]) == (m.inter_alpha_s, m.inter_gbps)
    assert "T = 16 > 8 devices per node: the ring crosses the network" in w.text
    assert "<b style='color:#b00'>T = 16 &gt; 8 devices per node: the ring crosses the network</b>" in w.readout.value
    # review 04 item 6: only the bandwidth is a bound; with an assumed alpha the time is an estimate
    assert "pessimistic bound" in w.text and "the time is an estimate" in w.text and "upper bound" not in w.text
    titles = [ax.get_title() for ax in w.figure().axes]
    assert any("pessimistic bound" in t for t in titles) and not any("upper bound" in t for t in titles), titles
    assert across["ratio"] > 2 * inside["ratio"]  # half the compute per rank, and a slower link


def test_tp_menu_offers_only_degrees_that_divide_the_heads_and_key_value_heads():
    w = cc.CommCounterWidget("22b", tp=16)
    assert w.controls["tp"].options == (1, 2, 4, 8, 16)  # 48 heads
    w.controls["model"].value = "gpt2"  # 12 heads: the largest T that still divides them
    assert w.controls["tp"].options == (1, 2, 4) and w.controls["tp"].value == 4
    assert w.prediction == step_cost("gpt2", 4)
    w.controls["model"].value = "175b"
    assert w.controls["tp"].options == tuple(cc.TP_DEGREES)
    with pytest.raises(ValueError, match=r"choose one of \[1, 2, 4\]"):
        cc.CommCounterWidget("gpt2", tp=8)
    w.controls["model"].value = "llama3-8b"  # 32 query heads on 8 key/value heads: T splits whole key/value heads
    assert w.controls["tp"].options == (1, 2, 4, 8)
    w.controls["model"].value = "nano"
    w.controls["tp"].value = 1
    assert w.prediction["total"] == {} and w.prediction["comm_s"] == 0
    assert w.text.startswith("T = 1: one device holds every layer") and w.table.value == ""


def test_a_runs_counts_are_shown_beside_the_prediction_when_the_settings_match():
    run = fake_run(tp=2, sequence_parallel=True, micro_batch=4, global_batch=8)
    w = cc.CommCounterWidget(measured=run, machine="DGX A100")
    assert w.options() == dict(model="nano", seq_len=64, vocab=65, tp=2, sequence_parallel=True, micro_batch=4,
                               microbatches=2, bytes_per_element=4, recompute="none", machine="DGX A100")
    assert w.matches_run() and "exactly the prediction" in w.text
    assert "counted in the run" in w.table.value
    hatched = [p for p in w.figure().axes[0].patches if p.get_hatch() == "//"]
    assert [p.get_height() for p in hatched] == [c["wire_bytes"] for _, c in sorted(w.counted.items())]

    w.controls["tp"].value = 4
    assert not w.matches_run() and "set the controls back to compare" in w.text
    assert "counted" not in w.table.value
    assert not any(p.get_hatch() for p in w.figure().axes[0].patches)
    w.controls["tp"].value = 2
    assert w.matches_run()

    off = fake_run(counted={"all_reduce": {"calls": 1, "payload_bytes": 8, "wire_bytes": 8}})
    assert "not the prediction" in cc.CommCounterWidget(measured=off).text


def test_a_bare_comm_dict_belongs_to_the_keywords():
    counted = step_cost("micro", 2, vocab=65)["total"]
    w = cc.CommCounterWidget("micro", tp=2, vocab=65, bytes_per_element=2, measured=counted)
    assert w.matches_run() and "exactly the prediction" in w.text


def test_from_run_reads_the_run_summary():
    settings, counted = cc.from_run(fake_run(tp=2, micro_batch=2, global_batch=8, dtype="bf16"))
    assert settings == dict(model="nano", seq_len=64, vocab=65, tp=2, sequence_parallel=False, micro_batch=2,
                            microbatches=4, bytes_per_element=2, recompute="none")
    assert counted == step_cost(**settings)["total"]
    piped = fake_run()
    piped["parallel"]["pp"] = 2
    with pytest.raises(ValueError, match="pp = 1"):
        cc.from_run(piped)


def test_static_figure_stands_in_for_the_widget(monkeypatch):
    w = cc.CommCounterWidget("22b", tp=8, sequence_parallel=True)
    fig = w.figure()
    bytes_ax, times_ax = fig.axes
    ops = [t.get_text() for t in bytes_ax.get_xticklabels()]
    assert ops == ["all_gather", "all_reduce", "reduce_scatter"]
    phases = [ph for ph in cc.PHASES if ph in w.prediction["phases"]]
    expected = [w.prediction["phases"][ph].get(op, {}).get("wire_bytes", 0) for ph in phases for op in ops]
    assert bar_heights(bytes_ax) == expected  # stacked: phase by phase, one bar per op
    assert [p.get_width() for p in times_ax.patches] == [w.prediction["comm_s"], w.prediction["compute_s"]]
    assert bytes_ax.get_title() == "22b, T = 8, sequence parallel"
    assert times_ax.get_title() == f"comm / compute = {w.prediction['ratio']:.3g}\nDGX H100\n450 GB/s inside one node"
    assert bar_heights(cc.comm_figure("22b", 8, sequence_parallel=True).axes[0]) == expected
    assert w.png.startswith(b"\x89PNG") and w.image.value == w.png

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append(obj))
    sh.show(w, w.figure())
    (bundle,) = shown
    assert sh.WIDGET_VIEW in bundle and base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")


def test_format_time():
    assert [cc.format_time(s) for s in (2.5, 0.0123, 4.5e-5)] == ["2.5 s", "12.3 ms", "45 us"]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_real_run_reads_back_as_its_prediction():
    """`labsupport.train.run` on 2 TP ranks: the widget starts at its settings and its counts equal the prediction."""
    from labsupport.train import run

    res = run(strategy="tp", nproc=2, tp=2, model="nano", steps=1, global_batch=4, micro_batch=2,
              sequence_parallel=True, sample_chars=0, eval_batches=0)
    w = cc.CommCounterWidget(measured=res)
    assert w.options()["microbatches"] == 2 and w.options()["sequence_parallel"]
    assert w.matches_run() and w.counted == w.prediction["total"], w.text


# ---------------------------------------------------------------- what the pictures and the controls look like

def test_descriptions_and_menu_entries_are_not_cut_off():
    """Issue 18: a description wider than its label box, or a menu entry wider than its menu, is cut off
    ("...") in JupyterLab. Each description fits the label box; each entry fits its menu less the arrow."""
    import ipywidgets as W

    w = cc.CommCounterWidget("22b", tp=8)
    for name, control in w.controls.items():
        label = px(control.style.description_width)
        width = px(control.layout.width)
        if isinstance(control, W.Checkbox):  # its text follows the indent and the box
            assert label + 24 + text_px(control.description) <= width, name
            continue
        assert text_px(control.description) + 8 <= label, f"{name}: {control.description!r}"
        if isinstance(control, W.Dropdown):
            longest = max(control._options_labels, key=text_px)
            assert text_px(longest) <= width - label - 40, f"{name}: {longest!r}"


def test_table_numbers_stay_on_one_line():
    """Issue 18: the payload column broke "18.9 MB" over two lines. No cell wraps; a narrow page scrolls the table."""
    w = cc.CommCounterWidget(measured=fake_run(tp=2, sequence_parallel=True))
    table = w.table.value
    assert table.startswith("<div style='overflow-x:auto'><table>")
    cells = table.count("<td") + table.count("<th")
    assert cells > 20 and table.count("white-space:nowrap") == cells


def test_the_table_is_no_wider_than_the_output_area():
    """Issue 28: with the run's counts in three more columns the table was wider than JupyterLab's output
    area (its last column cut to "co...", a scrollbar). The counts are rows now; every column's widest
    cell, measured in the widget font, with its padding, fits the output area, and so does the figure."""
    w = cc.CommCounterWidget(measured=fake_run(tp=2, sequence_parallel=True))
    rows = re.findall(r"<tr>(.*?)</tr>", w.table.value)
    cells = [[re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<t[hd][^>]*>(.*?)</t[hd]>", row)] for row in rows]
    assert {len(r) for r in cells} == {5} and any("counted in the run" in r[0] for r in cells)
    width = sum(max(text_px(r[i]) if r[i] else 0 for r in cells) + 2 * 10 for i in range(5))
    assert width <= OUTPUT_AREA_PX, f"the table is {width:.0f} px wide"
    assert cc.FIGSIZE[0] * DPI <= OUTPUT_AREA_PX
    assert all(px(c.layout.width) <= OUTPUT_AREA_PX for c in w.controls.values())


@pytest.mark.parametrize("fig", [cc.CommCounterWidget(measured=fake_run(tp=2, sequence_parallel=True)).figure(),
                                 cc.comm_figure("22b", 16, "Frontier (MI250X GCD)"),
                                 cc.comm_figure("175b", 32, "DGX A100", sequence_parallel=True, microbatches=8)],
                         ids=["04 tp + SP run, counted", "04 22b T = 16", "175b T = 32 SP"])
def test_the_byte_axis_ends_above_the_tallest_bar(fig):
    """Issue 28: the all_gather bar of 14.16 MB ran into the top of a 14 MB axis, and 22B's T = 16 bar into the
    frame (the thin top layer of a stack pinned autoscaling to the stack's top). The axis has headroom."""
    ax = fig.axes[0]
    tallest = max(p.get_y() + p.get_height() for p in ax.patches)
    assert ax.get_ylim()[1] >= 1.1 * tallest, (ax.get_ylim(), tallest)


def pictures():
    """The comm counter's figure as notebook 04 shows it, and at other settings; notebook 04's scaling plot."""
    yield "04 tp + SP run", cc.CommCounterWidget(measured=fake_run(tp=2, sequence_parallel=True),
                                                 machine="DGX H100").figure()
    yield "04 22b T = 16", cc.CommCounterWidget("22b", tp=16, machine="Frontier (MI250X GCD)", micro_batch=2,
                                                recompute="full").figure()
    yield "T = 1", cc.comm_figure("nano", 1, vocab=65)
    yield "175b T = 32", cc.comm_figure("175b", 32, "DGX A100", sequence_parallel=True, microbatches=8)
    ratios = {m: {t: step_cost("22b", t, m)["ratio"] for t in (2, 4, 8, 16)} for m in ("Frontier (MI250X GCD)",
                                                                                       "DGX H100")}
    yield "04 scaling", cc.scaling_figure(ratios, 8, "22B: TP's all-reduces against its compute\n(a second line)")


@pytest.mark.parametrize("name, fig", list(pictures()))
def test_figure_texts_are_whole_and_apart(name, fig):
    """Issue 18: colliding minor tick labels on 04's log-log plot. Every drawn text lies inside the
    figure and no two overlap."""
    assert texts_cut_or_overlapping(fig) == [], name


def test_scaling_figure_labels_the_degrees_and_round_ratios_only():
    ratios = {"DGX H100": {2: 0.04, 4: 0.12, 8: 0.36, 16: 5.3, 32: 13.6}}
    ax = cc.scaling_figure(ratios, 8).axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["2", "4", "8", "16", "32"]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["0.05", "0.1", "0.2", "0.5", "1", "2", "5", "10"]
    assert [line.get_ydata().tolist() for line in ax.get_lines()[:1]] == [[0.04, 0.12, 0.36, 5.3, 13.6]]
    assert not any(t.get_text() for t in ax.get_xticklabels(minor=True) + ax.get_yticklabels(minor=True))
