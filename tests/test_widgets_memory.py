"""The memory widget and its static figures: every number equals estimate_memory's, no browser needed."""
import ast
import subprocess
import sys
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

from labsupport.estimate.memory import estimate_memory  # noqa: E402
from labsupport.model import PRESETS  # noqa: E402
from labsupport.widgets import memory as wm  # noqa: E402

WIDGETS = Path(wm.__file__).parent


def bar_heights(ax) -> list[float]:
    return [p.get_height() for p in ax.patches]


def test_breakdown_is_estimate_memory():
    assert wm.breakdown("175b", micro_batch=2, precision="fp32", tp=8, pp=12) == estimate_memory(
        PRESETS["175b"], micro_batch=2, precision="fp32", tp=8, pp=12)
    # CPU presets have no vocabulary of their own: the shipped corpus's by default, or the one given
    assert wm.breakdown("micro", vocab=57) == estimate_memory(PRESETS["micro"].with_vocab(57))
    assert wm.breakdown("nano")["n_params"] == estimate_memory(PRESETS["nano"].with_vocab(wm.corpus_vocab()))["n_params"]
    assert wm.breakdown(wm.CUSTOM, n_params=7.5e9) == estimate_memory(n_params=7_500_000_000)


def test_widget_follows_its_controls():
    w = wm.MemoryWidget("22b")
    assert w.estimate == estimate_memory(PRESETS["22b"])
    assert f"{w.estimate['n_params']:,} parameters" in w.text and "does not fit on one 80 GB GPU" in w.text
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
    assert w.estimate == estimate_memory(PRESETS["micro"].with_vocab(wm.corpus_vocab()), micro_batch=4,
                                         precision="fp32")
    assert "fits on one 16 GB GPU" in w.text and "does not" not in w.text


def test_parallel_controls_go_straight_to_estimate_memory():
    w = wm.MemoryWidget("175b", parallel=True, vocab=65)
    settings = dict(dp=8, tp=8, pp=12, zero=1, recompute="selective", sequence_parallel=True)
    for name, value in settings.items():
        w.controls[name].value = value
    assert w.estimate == estimate_memory(PRESETS["175b"], **settings)
    assert w.options() == dict(model="175b", vocab=65, precision="mixed", micro_batch=1, **settings)


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
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [wm.LABELS[k] for k in wm.CATEGORIES]


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
    assert wm.format_bytes(421_949_374_464) == "421.95 GB"
    assert wm.format_bytes(16_700_001_402_880) == "16.70 TB"
    assert wm.format_bytes(3_268_096) == "3.27 MB"
    assert wm.format_bytes(512) == "512 B"


def test_widgets_import_no_torch_distributed():
    for path in WIDGETS.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.startswith("torch.distributed") for n in names), path


def test_widgets_package_imports_no_submodule():
    code = "import sys, labsupport.widgets; print(sorted(m for m in sys.modules if m.startswith('labsupport.widgets.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_widget_figure_is_the_static_stand_in():
    w = wm.MemoryWidget("22b", precision="megatron-bf16", micro_batch=2)
    fig = w.figure()
    ax = fig.axes[0]
    assert bar_heights(ax) == pytest.approx([w.estimate[k] / 1e9 for k in wm.CATEGORIES])
    assert ax.get_title() == "22b, megatron-bf16, micro-batch 2"
    assert wm.figure_png(fig).startswith(b"\x89PNG")
    w.controls["model"].value = wm.CUSTOM
    w.controls["n_params"].value = 1e9
    assert w.figure().axes[0].get_title().startswith("1e+09 params")
    w.controls["model"].value = "micro"
    w.controls["tp"].value = 8  # not a valid layout: no estimate, no figure
    with pytest.raises(ValueError, match="divisible"):
        w.figure()


def test_widget_offers_every_precision_recipe():
    from labsupport.estimate.memory import BYTES_PER_PARAM
    w = wm.MemoryWidget("22b")
    assert list(w.controls["precision"].options) == list(BYTES_PER_PARAM)
    states = {}
    for recipe in BYTES_PER_PARAM:
        w.controls["precision"].value = recipe
        assert w.estimate == estimate_memory(PRESETS["22b"], precision=recipe)
        states[recipe] = sum(w.estimate[k] for k in ("params", "grads", "optimizer"))
    # 16 / 16 / 18 / 20 bytes per parameter
    assert states["fp32"] == states["mixed"]
    assert states["megatron-bf16"] * 16 == states["mixed"] * 18 and states["megatron-fp16"] * 16 == states["mixed"] * 20
