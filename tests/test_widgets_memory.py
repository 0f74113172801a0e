"""The memory widget and its static figures: every number equals estimate_memory's, no browser needed."""
from dataclasses import replace
import subprocess
import sys

import matplotlib
import pytest

matplotlib.use("Agg")

from figures import rendered, text_px, texts_cut_or_overlapping  # noqa: E402
from labsupport.estimate.memory import estimate_memory, largest_model_that_fits  # noqa: E402
from labsupport.estimate.params import count_params  # noqa: E402
from labsupport.estimate.shapes import PRESETS, ModelConfig, corpus_vocab  # noqa: E402
from labsupport.widgets import memory as wm  # noqa: E402
from labsupport.units import format_bytes  # noqa: E402


def bar_heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def test_breakdown_is_estimate_memory():
    assert wm.breakdown("175b", micro_batch=2, precision="fp32", tp=8, pp=12) == estimate_memory(
        PRESETS["175b"], micro_batch=2, precision="fp32", tp=8, pp=12)
    # CPU presets have no vocabulary of their own: the shipped corpus's by default, or the one given
    assert wm.breakdown("micro", vocab=57) == estimate_memory(PRESETS["micro"].with_vocab(57))
    assert wm.breakdown("nano")["n_params"] == estimate_memory(PRESETS["nano"].with_vocab(corpus_vocab()))["n_params"]
    assert wm.breakdown(wm.CUSTOM, n_params=7.5e9) == estimate_memory(n_params=7_500_000_000)


def test_widget_follows_its_controls():
    w = wm.MemoryWidget("22b")
    assert w.estimate == estimate_memory(PRESETS["22b"])
    assert f"{w.estimate['n_params']:,} parameters" in w.text and "does not fit on one A100 80 GB" in w.text
    assert "does not fit" in w.verdict.value
    assert w.png.startswith(b"\x89PNG") and w.image.value == w.png
    first_text, first_png = w.text, w.png

    w.controls["precision"].value = "fp32"
    w.controls["micro_batch"].value = 4
    assert w.estimate == estimate_memory(PRESETS["22b"], micro_batch=4, precision="fp32")
    assert w.text != first_text and w.png != first_png
    assert wm.format_bytes(w.estimate["total"]) in w.text and wm.format_bytes(w.estimate["optimizer"]) in w.text
    assert w.readout.value.count(wm.format_bytes(w.estimate["total"])) == 1

    w.controls["model"].value = "micro"
    w.controls["gpu_memory_gb"].value = 16
    assert w.estimate == estimate_memory(PRESETS["micro"].with_vocab(corpus_vocab()), micro_batch=4,
                                         precision="fp32")
    assert "fits on one 16 GB GPU" in w.text and "does not" not in w.text and "fits" in w.verdict.value
    assert w.controls["device"].value == wm.CUSTOM  # a size no named device has


def test_parallel_controls_go_straight_to_estimate_memory():
    w = wm.MemoryWidget("175b", parallel=True, vocab=65)
    settings = dict(dp=8, tp=8, pp=12, zero=1, recompute="selective", sequence_parallel=True)
    for name, value in settings.items():
        w.controls[name].value = value
    assert w.estimate == estimate_memory(PRESETS["175b"], **settings)
    assert w.options() == dict(model="175b", vocab=65, seq_len=2048, precision="mixed", micro_batch=1,
                               offload=False, **settings)


def test_invalid_layout_is_reported_not_raised():
    w = wm.MemoryWidget("micro", vocab=65, parallel=True)
    w.controls["tp"].value = 8  # micro has 4 heads
    assert w.estimate is None and "heads (4) must be divisible by tp (8)" in w.text
    assert "divisible" in w.readout.value
    w.controls["tp"].value = 2
    assert w.estimate == estimate_memory(PRESETS["micro"].with_vocab(65), tp=2) and w.error is None


def test_custom_size_has_no_activations():
    w = wm.MemoryWidget("22b")
    assert w.controls["n_params"].layout.display == "none"
    w.controls["model"].value = wm.CUSTOM
    w.controls["n_params"].value = 1e9
    assert w.controls["n_params"].layout.display is None
    assert w.estimate == estimate_memory(n_params=1_000_000_000)
    assert w.estimate["activations"] == 0 and "need a shape" in w.text


def test_memory_widget_function_returns_the_container():
    import ipywidgets
    box = wm.memory_widget("gpt2", precision="fp32")
    assert isinstance(box, ipywidgets.VBox)


def test_memory_figure_draws_the_estimate():
    fig = wm.memory_figure("22b", precision="mixed", micro_batch=2, gpu_memory_gb=80)
    ax = fig.axes[0]
    est = estimate_memory(PRESETS["22b"], micro_batch=2)
    assert ax.get_ylabel() == "bytes per device (GB)"
    assert bar_heights(ax) == pytest.approx([est[k] / 1e9 for k in wm.CATEGORIES])
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [80]  # the GPU's capacity
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend == [wm.LABELS[k] for k in wm.CATEGORIES] + ["one GPU: 80 GB"]  # the line is named there


def test_memory_figure_one_bar_per_value():
    fig = wm.memory_figure("22b", vary="zero", values=[0, 1, 2, 3], dp=8)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["zero=0", "zero=1", "zero=2", "zero=3"]
    heights = bar_heights(ax)  # category by category, one bar per stage within each
    for stage in range(4):
        est = estimate_memory(PRESETS["22b"], dp=8, zero=stage)
        assert heights[stage::4] == pytest.approx([est[k] / 1e9 for k in wm.CATEGORIES])
    fig = wm.memory_figure(vary="model", values=["gpt2", "forge-s"])
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["gpt2", "forge-s"]
    with pytest.raises(ValueError):
        wm.memory_figure(vary="zero")


def test_small_models_are_not_flattened_by_the_gpu_line():
    fig = wm.memory_figure("nano", precision="fp32", vocab=65)
    ax = fig.axes[0]
    assert ax.get_lines() == [] and ax.get_ylabel() == "bytes per device (MB)"
    assert any("far above" in t.get_text() for t in ax.texts)


def test_measured_vs_predicted_figure():
    measured = dict(params=3_268_096, grads=3_268_096, optimizer=6_536_400, activations=69_985_284)
    predicted = dict(measured, optimizer=6_536_192)
    fig = wm.measured_vs_predicted_figure(measured, predicted, title="micro")
    ax = fig.axes[0]
    assert ax.get_title() == "micro" and ax.get_ylabel() == "bytes (MB)"
    assert bar_heights(ax) == pytest.approx([measured[k] / 1e6 for k in wm.CATEGORIES]
                                            + [predicted[k] / 1e6 for k in wm.CATEGORIES])
    assert wm.figure_png(fig).startswith(b"\x89PNG")


def test_format_bytes():
    assert format_bytes(421_949_374_464) == "421.95 GB"
    assert format_bytes(16_700_001_402_880) == "16.70 TB"
    assert format_bytes(3_268_096) == "3.27 MB"
    assert format_bytes(512) == "512 B"


def test_widgets_package_imports_no_submodule():
    code = "import sys, labsupport.widgets; print(sorted(m for m in sys.modules if m.startswith('labsupport.widgets.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def stage_totals(ax) -> list[float]:
    """Per bar, the sum of its category segments (the first 4 x bars patches; an outline may follow)."""
    n = len(ax.get_xticklabels())
    heights = bar_heights(ax)[:len(wm.CATEGORIES) * n]
    return [sum(heights[i::n]) for i in range(n)]


def test_widget_figure_is_the_static_stand_in():
    """The figure: the layout at ZeRO stages 0-3 against the device, the chosen stage outlined and bold."""
    w = wm.MemoryWidget("22b", precision="megatron-bf16", micro_batch=2, parallel=True, dp=8, zero=1)
    fig = w.figure()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["ZeRO-0\nbaseline", "ZeRO-1\n$P_{os}$",
                                                           "ZeRO-2\n$P_{os+g}$", "ZeRO-3\n$P_{os+g+p}$"]
    heights = bar_heights(ax)
    for stage in range(4):
        est = estimate_memory(PRESETS["22b"], micro_batch=2, precision="megatron-bf16", dp=8, zero=stage)
        assert w.stages[stage] == est
        assert heights[stage:16:4] == pytest.approx([est[k] / 1e9 for k in wm.CATEGORIES])
    assert heights[16:] == pytest.approx([w.estimate["total"] / 1e9])  # the outline of the chosen stage, ZeRO-1
    assert [t.get_fontweight() for t in ax.get_xticklabels()] == ["normal", "bold", "normal", "normal"]
    assert [line.get_ydata()[0] for line in ax.get_lines()] == [80]
    assert ax.get_title() == "22b, megatron-bf16, micro-batch 2"
    assert wm.figure_png(fig).startswith(b"\x89PNG")
    w.controls["model"].value = wm.CUSTOM
    w.controls["n_params"].value = 1e9
    assert w.figure().axes[0].get_title().startswith("1e+09 params")
    w.controls["model"].value = "micro"
    w.controls["tp"].value = 8  # not a valid layout: no estimate, no figure
    with pytest.raises(ValueError, match="divisible"):
        w.figure()
    assert w.verdict.value == "" and w.stages == [] and w.largest is None


def test_one_device_widget_draws_one_bar():
    """Without the parallel controls every ZeRO stage is the same: the figure is the one bar."""
    w = wm.MemoryWidget("22b", precision="mixed", micro_batch=1, gpu_memory_gb=80)  # notebook 01's call
    assert w.controls["device"].value == "A100 80 GB"
    ax = w.figure().axes[0]
    assert bar_heights(ax) == pytest.approx([w.estimate[k] / 1e9 for k in wm.CATEGORIES])
    assert [t.get_text() for t in ax.get_xticklabels()] == ["22b"]


@pytest.mark.parametrize("recipe, total", [("fp32", 16), ("mixed", 16), ("megatron-bf16", 18), ("megatron-fp16", 20)])
def test_widget_offers_each_precision_recipe_by_name(recipe, total):
    """The menu names each recipe with its bytes; choosing it is estimate_memory(precision=recipe)."""
    w = wm.MemoryWidget("22b")
    labels = dict((value, label) for label, value in w.controls["precision"].options)
    assert labels[recipe].startswith(f"{recipe}: ") and f"= {total} B/param" in labels[recipe]
    w.controls["precision"].value = recipe
    assert w.estimate == estimate_memory(PRESETS["22b"], precision=recipe)
    states = sum(w.estimate[k] for k in ("params", "grads", "optimizer"))
    assert states == total * count_params(PRESETS["22b"], padded=True)


def test_zero_figure1_data():
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, N_d = 64, K = 12 -> 120, 31.4, 16.6, 1.9 GB per device."""
    fig = wm.zero_stages_figure()
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["baseline", "$P_{os}$", "$P_{os+g}$", "$P_{os+g+p}$"]
    assert ax.get_ylabel() == "bytes per device (GB)"
    assert [round(total, 1) for total in stage_totals(ax)] == [120.0, 31.4, 16.6, 1.9]
    assert ax.get_title() == "ZeRO stages: 7.5B parameters, N_d = 64, mixed"


def test_zero_stages_figure_for_a_preset():
    fig = wm.zero_stages_figure("22b", dp=8, gpu_memory_gb=80, recompute="selective")
    totals = [estimate_memory(PRESETS["22b"], dp=8, zero=z, recompute="selective")["total"] / 1e9 for z in range(4)]
    assert stage_totals(fig.axes[0]) == pytest.approx(totals)
    assert [line.get_ydata()[0] for line in fig.axes[0].get_lines()] == [80]


def test_device_menu_sets_the_capacity_and_the_verdict():
    w = wm.MemoryWidget("gpt2-xl", parallel=True)
    assert w.controls["device"].value == "A100 80 GB" and w.controls["gpu_memory_gb"].value == 80
    assert "It fits on one A100 80 GB" in w.verdict.value
    w.controls["model"].value = "22b"
    assert "does not fit on one A100 80 GB" in w.verdict.value
    w.controls["device"].value = "MI250X GCD 64 GB"
    assert w.controls["gpu_memory_gb"].value == 64 and "does not fit on one MI250X GCD 64 GB" in w.verdict.value
    w.controls["gpu_memory_gb"].value = 1000
    assert w.controls["device"].value == wm.CUSTOM and "fits on one 1000 GB GPU" in w.verdict.value
    assert wm.MemoryWidget("22b", gpu_memory_gb=40).controls["device"].value == wm.CUSTOM
    assert wm.MemoryWidget("22b", device="H100 80 GB").controls["gpu_memory_gb"].value == 80


def test_offload_control():
    w = wm.MemoryWidget("22b", parallel=True, dp=8, zero=2)
    assert w.controls["pcie"].layout.display == "none"
    w.controls["offload"].value = True
    assert w.controls["pcie"].layout.display is None
    assert w.estimate == estimate_memory(PRESETS["22b"], dp=8, zero=2, offload=True)
    assert w.estimate["optimizer"] == 0 and w.stages[0]["optimizer"] == 0
    assert f"the host holds {wm.format_bytes(w.estimate['host'])}" in w.text
    assert "hidden behind one micro-batch" in w.text  # 0.35 s of PCIe 4.0 against 2.2 s of compute on an A100
    w.controls["pcie"].value = "PCIe gen3 x16"
    w.controls["seq_len"].value = 128  # 16x fewer tokens: the same transfer, 16x less compute to hide it
    assert "not hidden unless each step processes" in w.text and "PCIe gen3" in w.text
    assert w.figure().axes[0].get_title() == "22b, mixed, micro-batch 1, optimizer on the host"


def test_custom_shape_and_sequence_length():
    w = wm.MemoryWidget("gpt2", parallel=True)
    assert w.controls["seq_len"].value == 1024 and w.controls["layers"].layout.display == "none"
    w.controls["seq_len"].value = 256
    assert w.estimate == estimate_memory(replace(PRESETS["gpt2"], seq_len=256))
    w.controls["model"].value = "175b"  # a preset brings its own context
    assert w.controls["seq_len"].value == 2048
    w.controls["model"].value = wm.SHAPE
    for name, value in dict(layers=3, hidden=96, heads=3, shape_vocab=100, seq_len=64).items():
        w.controls[name].value = value
    assert w.controls["layers"].layout.display is None
    assert w.estimate == estimate_memory(ModelConfig(wm.SHAPE, 3, 96, 3, 100, 64))
    w.controls["heads"].value = 5  # 96 is not divisible by 5
    assert w.estimate is None and "divisible" in w.text


def test_largest_model_that_fits_is_shown():
    w = wm.MemoryWidget("22b")
    best = w.largest
    assert best == largest_model_that_fits(80e9, PRESETS["22b"])
    cfg = best["shape"]
    assert f"{cfg.n_layers} layers x {cfg.hidden}" in w.text
    w.controls["model"].value = wm.CUSTOM  # no shape: solve for the parameter count, model states only
    assert w.largest["n_params"] == 5_000_000_000 and "40 B" not in w.text and "5 B" in w.text


def test_device_picks_its_host_link():
    """An MI250X GCD reaches its CPU over Infinity Fabric at 36 GB/s each way, not over PCIe."""
    w = wm.MemoryWidget("22b", parallel=True, dp=8, zero=2, offload=True)
    assert w.controls["pcie"].value == "PCIe gen4 x16"
    w.controls["device"].value = "MI250X GCD 64 GB"
    assert w.controls["pcie"].value == "Infinity Fabric (Frontier GCD)" and "(36 GB/s each way)" in w.text
    w.controls["device"].value = "H100 80 GB"
    assert w.controls["pcie"].value == "PCIe gen5 x16" and "(63 GB/s each way)" in w.text


# The parameter counts notebooks 01 and 03 start the widget at, and one a reader types.
NOTEBOOK_COUNTS = (7.5e9, 7_241_732_096, 6_053_381_344, 1e9)


@pytest.mark.parametrize("n", NOTEBOOK_COUNTS)
def test_parameter_count_is_kept_exactly(n):
    """Issue 18: a log slider's step moved 7.5e9 to 7.94e9 as the browser drew it. The control is a
    text box with no step (the browser's input then takes any value): what the notebook sets is shown."""
    w = wm.MemoryWidget(wm.CUSTOM, n_params=n, parallel=True)
    control = w.controls["n_params"]
    assert control.value == n and control.step is None and control.min <= n <= control.max
    assert w.estimate["n_params"] == int(n) and f"{int(n):,} parameters" in w.text


def test_control_descriptions_fit_their_labels():
    """Issue 18: 'GPU memory (...' and 'offload optimizer to ho...': a description wider than its label
    box is cut off. Every description fits the box; a checkbox's row is as wide as its text."""
    w = wm.MemoryWidget("22b", parallel=True)
    for name, control in w.controls.items():
        if isinstance(control, __import__("ipywidgets").Checkbox):
            assert control.layout.width == "auto", name
            continue
        width = float(control.style.description_width.removesuffix("px"))
        assert text_px(control.description) <= width, f"{name}: {control.description!r}"
        if isinstance(control, __import__("ipywidgets").Dropdown):  # the menu's box, less its arrow, holds each entry
            box = float((control.layout.width or "300px").removesuffix("px")) - width - 30
            assert max(text_px(str(label)) for label in control._options_labels) <= box, name


def notebook_figures():
    """The memory figures notebooks 01 and 03 show (with their titles), and the widget's at other settings."""
    yield "03 Figure 1", wm.zero_stages_figure(
        n_params=7.5e9, dp=64, precision="mixed", gpu_memory_gb=80,
        title=r"The ZeRO paper's Figure 1: $\Psi$ = 7.5B, $N_d$ = 64, $K$ = 12")
    yield "03 widget", wm.MemoryWidget("22b", precision="mixed", dp=8, zero=1, device="MI250X GCD 64 GB",
                                       parallel=True).figure()
    yield "01 widget", wm.MemoryWidget("22b", precision="mixed", micro_batch=1, gpu_memory_gb=80).figure()
    w = wm.MemoryWidget(wm.CUSTOM, n_params=7.5e9, dp=64, zero=3, parallel=True, offload=True)
    yield "custom, offloaded", w.figure()
    yield "ZeRO-3 measured", wm.measured_vs_predicted_figure(
        dict(params=1_635_840, grads=1_635_840, optimizer=3_271_888), dict(params=1_635_840, grads=1_635_840,
        optimizer=3_271_680), categories=("params", "grads", "optimizer"), title="ZeRO-3 on 2 ranks, rank 0")


@pytest.mark.parametrize("name, fig", list(notebook_figures()))
def test_figure_texts_are_whole_and_apart(name, fig):
    """Issue 18: labels cut off at the figure's edge, "A100 80 GB" written over the ZeRO-0 bar. Every
    text lies inside the figure, no two texts overlap, and no text other than a bar's total sits on a bar."""
    assert texts_cut_or_overlapping(fig) == [], name
    renderer = rendered(fig)
    ax = fig.axes[0]
    bars = [p.get_window_extent(renderer) for p in ax.patches if p.get_height() > 0]
    for t in ax.texts:
        box = t.get_window_extent(renderer).shrunk(0.9, 0.8)  # a total's box touches its bar's top
        assert not any(bar.overlaps(box) for bar in bars), f"{name}: {t.get_text()!r} sits on a bar"


def test_legend_names_only_what_the_bars_hold():
    """Issue 18: a parameter count has no activations, and the legend listed them at 0."""
    fig = wm.zero_stages_figure(gpu_memory_gb=80)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend == ["parameters", "gradients", "optimizer states", "one GPU: 80 GB"]
    w = wm.MemoryWidget("22b", parallel=True, dp=8, zero=2, offload=True)  # the optimizer is on the host
    legend = [t.get_text() for t in w.figure().axes[0].get_legend().get_texts()]
    assert "optimizer states" not in legend and legend[-1] == "A100 80 GB"
