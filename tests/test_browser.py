"""Widgets in a real JupyterLab: open a notebook in headless Chromium, run it, click, read what it shows.

Skipped where Chromium is missing, except in CI (CI set), where that is a failure.
Each test writes a small notebook into the `lab` fixture's folder (a copy of notebooks/, so a stored
notebook can be opened the same way), runs it with `run_notebook_in_browser` and drives what it
displays; the stored notebooks themselves run top to bottom under nbval.
"""

import subprocess
import sys

import pytest

from browser import (REPO, artifacts_on_failure, chromium_page, jupyter_lab, make_lab_style, require_chromium,
                     run_notebook_in_browser, tagged_processes, wait_for_redraw, wait_for_text, write_notebook)
from labsupport.estimate.collective_steps import simulate
from labsupport.pool import START_TIMEOUT_S
from labsupport.widgets.collectives import format_state, symbolic_initial
from labsupport.widgets.comm_counter import CommCounterWidget
from labsupport.widgets.memory import MemoryWidget, preset_label, verdict
from labsupport.widgets.pipeline import PipelineWidget
from labsupport.widgets.planner import HEADER, PlannerWidget
from labsupport.widgets.rank_grid import RankGridWidget

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def lab():
    """One private JupyterLab for this module, serving a temporary copy of notebooks/."""
    require_chromium()  # skip (or fail in CI) before paying for the server
    with jupyter_lab() as server:
        yield server
    assert not tagged_processes(server.tag), "JupyterLab left processes behind"


@pytest.fixture
def page(lab):
    with chromium_page() as tab:
        yield tab


def test_collectives_stepper_updates_in_jupyterlab(lab, page, request):
    """Step through all_reduce on 4 ranks by clicking; the readout follows simulate() exactly."""
    write_notebook(lab.root / "stepper.ipynb",
                   "from labsupport.widgets.collectives import CollectivesWidget\n"
                   "w = CollectivesWidget('all_reduce', 4)\n"
                   "w.widget")
    n = 4
    expected = [format_state(s) for s in simulate("all_reduce", n, initial=symbolic_initial("all_reduce", n))]
    with artifacts_on_failure(page, request.node.name, lab):
        run_notebook_in_browser(page, lab, "stepper.ipynb")
        state = page.locator(".labsupport-collectives-state")
        label = page.locator(".labsupport-collectives-step")
        step = page.locator("button.labsupport-step")
        figure = page.locator(".labsupport-collectives-figure")
        figure.wait_for(state="visible", timeout=30_000)
        wait_for_text(state, expected[0], timeout_s=30)
        shown = [expected[0]]
        for k in range(1, 4):
            before = figure.get_attribute("src")
            step.click()
            wait_for_text(label, f"step {k} of {len(expected) - 1}")
            shown.append(wait_for_text(state, expected[k]))
            assert shown[-1] != shown[-2], f"step {k} changed nothing on the page"
            assert figure.get_attribute("src") != before, f"the picture was not redrawn at step {k}"
        page.locator("button.labsupport-back").click()
        wait_for_text(state, expected[2])
        page.locator("button.labsupport-reset").click()
        wait_for_text(state, expected[0])


def test_memory_widget_verdict_follows_its_controls_in_jupyterlab(lab, page, request):
    """Pick another model, device and ZeRO stage in the page: the verdict and the figure follow,
    and the verdict is the one the same widget gives in Python for those settings."""
    write_notebook(lab.root / "memory.ipynb",
                   "from labsupport.widgets.memory import MemoryWidget\n"
                   "w = MemoryWidget('22b', parallel=True, dp=8)\n"
                   "w.widget")
    expected = MemoryWidget("22b", parallel=True, dp=8)

    def expected_verdict():  # what the same widget says in Python, as plain text
        c = expected.controls
        return verdict(expected.estimate, c["gpu_memory_gb"].value, expected.device_label())

    with artifacts_on_failure(page, request.node.name, lab):
        run_notebook_in_browser(page, lab, "memory.ipynb")
        widget = page.locator(".labsupport-memory")
        shown, figure = widget.locator(".labsupport-memory-verdict"), widget.locator(".labsupport-memory-figure")
        figure.wait_for(state="visible", timeout=30_000)
        first = wait_for_text(shown, expected_verdict(), timeout_s=30)
        assert first.startswith("It does not fit on one A100 80 GB")
        steps = [
            (lambda: widget.locator(".labsupport-memory-zero button", has_text="3").click(), "zero", 3),
            (lambda: widget.locator(".labsupport-memory-device select").select_option("MI250X GCD 64 GB"),
             "device", "MI250X GCD 64 GB"),
            (lambda: widget.locator(".labsupport-memory-model select").select_option(
                label=preset_label("gpt2-xl")), "model", "gpt2-xl"),
        ]
        for act, name, value in steps:
            before = figure.get_attribute("src")
            act()
            expected.controls[name].value = value
            wait_for_text(shown, expected_verdict())
            wait_for_redraw(figure, before, f"{name} = {value}")
        assert shown.inner_text().startswith("It fits on one MI250X GCD 64 GB")


def test_ranks_cell_streams_every_ranks_lines_into_the_page(lab, page, request):
    """A `%%ranks` cell in JupyterLab: each of the pool's ranks runs a ring all-reduce built from
    send/recv (notebook 00's) and its line reaches the page prefixed `[rank k]`, with the sum every rank
    must hold. (The notebooks run top to bottom under nbval; the collectives stepper has its own test.)"""
    write_notebook(lab.root / "ranks.ipynb",
                   "%load_ext labsupport\n"
                   "from labsupport.pool import ranks as pool\n"
                   "pool.start(2)",
                   "%%ranks\n"
                   "import torch\n"
                   "from labsupport import algorithms\n"
                   "x = torch.full((4,), float(rt.rank + 1))\n"
                   "algorithms.ring_all_reduce(x)\n"
                   "print(f'ring all-reduce of {rt.world_size} ranks: {x.tolist()}')",
                   "pool.stop()")
    with artifacts_on_failure(page, request.node.name, lab):
        # longer than the pool's own start limit, so that a start that fails says why in the page
        run_notebook_in_browser(page, lab, "ranks.ipynb", timeout_s=START_TIMEOUT_S + 120)
        lines = page.locator(".jp-OutputArea-output", has_text="ring all-reduce of 2 ranks")
        lines.first.wait_for(timeout=30_000)
        printed = "\n".join(lines.all_inner_texts())
        for r in range(2):
            assert f"[rank {r}] ring all-reduce of 2 ranks: [3.0, 3.0, 3.0, 3.0]" in printed, printed


def test_pipeline_widget_bubble_follows_the_schedule_in_jupyterlab(lab, page, request):
    """Click from 1F1B to interleaved in the page: the bubble shown drops from (p-1)/(m+p-1) to the
    interleaved one, exactly the text the same widget gives in Python, and the Gantt chart is redrawn."""
    write_notebook(lab.root / "pipeline.ipynb",
                   "from labsupport.widgets.pipeline import PipelineWidget\n"
                   "w = PipelineWidget('1f1b', stages=4, microbatches=8)\n"
                   "w.widget")
    expected = PipelineWidget("1f1b", stages=4, microbatches=8)
    with artifacts_on_failure(page, request.node.name, lab):
        run_notebook_in_browser(page, lab, "pipeline.ipynb")
        widget = page.locator(".labsupport-pipeline")
        bubble, figure = widget.locator(".labsupport-pipeline-bubble"), widget.locator(".labsupport-pipeline-figure")
        figure.wait_for(state="visible", timeout=30_000)
        assert "idles 27.3%" in wait_for_text(bubble, expected.text, timeout_s=30)
        before = figure.get_attribute("src")
        widget.locator(".labsupport-pipeline-schedule button", has_text="interleaved").click()
        expected.controls["schedule"].value = "interleaved"
        assert "idles 15.8%" in wait_for_text(bubble, expected.text)
        wait_for_redraw(figure, before, "switching to the interleaved schedule")


def test_comm_counter_follows_t_and_the_machine_in_jupyterlab(lab, page, request):
    expected = CommCounterWidget("22b", tp=8)
    with artifacts_on_failure(page, request.node.name, lab):
        write_notebook(lab.root / "comm.ipynb",
                       "from labsupport.widgets.comm_counter import CommCounterWidget\n"
                       "w = CommCounterWidget('22b', tp=8)\n"
                       "w.widget")
        run_notebook_in_browser(page, lab, "comm.ipynb")
        widget = page.locator(".labsupport-comm")
        readout, figure = widget.locator(".labsupport-comm-readout"), widget.locator(".labsupport-comm-figure")
        figure.wait_for(state="visible", timeout=30_000)
        shown = [wait_for_text(readout, expected.text, timeout_s=30)]
        assert "fits in one node" in shown[0]
        steps = [(lambda: widget.locator(".labsupport-comm-tp select").select_option(label="16"), "tp", 16),
                 (lambda: widget.locator(".labsupport-comm-machine select").select_option("Frontier (MI250X GCD)"),
                  "machine", "Frontier (MI250X GCD)")]
        for act, name, value in steps:
            before = figure.get_attribute("src")
            act()
            expected.controls[name].value = value
            shown.append(wait_for_text(readout, expected.text))
            assert shown[-1] != shown[-2], f"{name} = {value} changed nothing on the page"
            wait_for_redraw(figure, before, f"{name} = {value}")
        mark = readout.locator("b")
        assert mark.inner_text() == "T = 16 > 8 devices per node: the ring crosses the network"
        assert "12.5 GB/s per direction" in shown[-1] and f"= {expected.prediction['ratio']:.3g}." in shown[-1]


_COMM_WIDTHS_JS = """() => {
  const w = document.querySelector('.labsupport-comm'), out = w.closest('.jp-OutputArea-output');
  const table = w.querySelector('.labsupport-comm-table div'), img = w.querySelector('.labsupport-comm-figure');
  return {output: out.clientWidth, widget: w.scrollWidth, output_scroll: out.scrollWidth,
          table: table.scrollWidth, table_box: table.clientWidth, figure: img.naturalWidth};
}"""


def test_comm_counter_fits_the_output_area_in_jupyterlab(lab, page, request):
    """Issue 28: with a run's counts the comm counter was wider than the output area (its table's last column
    cut to "co...", a scrollbar). In a 1280-px window with the file browser open, nothing scrolls sideways:
    not the output, not the table, and the figure is drawn at its own size."""
    with artifacts_on_failure(page, request.node.name, lab):
        write_notebook(lab.root / "comm_width.ipynb",
                       "from labsupport.widgets.comm_counter import CommCounterWidget\n"
                       "from labsupport.estimate.tp_comm import step_cost\n"
                       "run = dict(tp=2, vocab=65, bytes_per_element=4, sequence_parallel=True, micro_batch=16)\n"
                       "w = CommCounterWidget('micro', **run, measured=step_cost('micro', **run)['total'])\n"
                       "w.widget")
        run_notebook_in_browser(page, lab, "comm_width.ipynb")
        page.locator(".labsupport-comm-figure").wait_for(state="visible", timeout=30_000)
        page.locator(".labsupport-comm-table", has_text="counted in the run").wait_for(state="visible", timeout=30_000)
        sizes = page.evaluate(_COMM_WIDTHS_JS)
        assert sizes["widget"] <= sizes["output"] and sizes["output_scroll"] <= sizes["output"], sizes
        assert sizes["table"] <= sizes["table_box"], sizes
        assert 0 < sizes["figure"] <= sizes["output"], sizes


def table_text(w: PlannerWidget) -> str:
    """The table as Chromium's inner_text renders it: cells joined by tabs, rows by newlines."""
    return "\n".join("\t".join(row) for row in [HEADER] + w.rows)


def test_planner_follows_the_gpus_and_the_machine_in_jupyterlab(lab, page, request):
    expected = PlannerWidget("175b", machine="frontier", gpus=1024)
    with artifacts_on_failure(page, request.node.name, lab):
        write_notebook(lab.root / "planner.ipynb",
                       "from labsupport.widgets.planner import PlannerWidget\n"
                       "w = PlannerWidget('175b', machine='frontier', gpus=1024)\n"
                       "w.widget")
        run_notebook_in_browser(page, lab, "planner.ipynb")
        widget = page.locator(".labsupport-planner")
        readout, table = widget.locator(".labsupport-planner-readout"), widget.locator(".labsupport-planner-table")
        figure = widget.locator(".labsupport-planner-figure")
        figure.wait_for(state="visible", timeout=30_000)
        shown = [wait_for_text(readout, expected.text, timeout_s=30)]
        wait_for_text(table, table_text(expected))
        steps = [(lambda: widget.locator(".labsupport-planner-gpus select").select_option(label="512"), "gpus", 512),
                 (lambda: widget.locator(".labsupport-planner-machine select").select_option(label="DGX H100"),
                  "machine", "dgx-h100")]
        for act, name, value in steps:
            before = figure.get_attribute("src")
            act()
            expected.controls[name].value = value
            shown.append(wait_for_text(readout, expected.text))
            assert shown[-1] != shown[-2], f"{name} = {value} changed nothing on the page"
            wait_for_text(table, table_text(expected))
            wait_for_redraw(figure, before, f"{name} = {value}")
        assert shown[-1].startswith("175b on 512 GPUs of DGX H100 (80 GB")


def test_rank_grid_shows_tp_groups_crossing_nodes_in_jupyterlab(lab, page, request):
    expected = RankGridWidget(dp=2, tp=2, pp=2, devices_per_node=4)
    with artifacts_on_failure(page, request.node.name, lab):
        write_notebook(lab.root / "grid.ipynb",
                       "from labsupport.widgets.rank_grid import RankGridWidget\n"
                       "w = RankGridWidget(dp=2, tp=2, pp=2, devices_per_node=4)\n"
                       "w.widget")
        run_notebook_in_browser(page, lab, "grid.ipynb")
        widget = page.locator(".labsupport-rankgrid")
        readout, figure = widget.locator(".labsupport-rankgrid-readout"), widget.locator(".labsupport-rankgrid-figure")
        figure.wait_for(state="visible", timeout=30_000)
        before = wait_for_text(readout, expected.text, timeout_s=30)
        assert "TP groups stay inside a node" in before and "TP groups cross nodes" not in before
        src = figure.get_attribute("src")

        widget.locator(".labsupport-rankgrid-order select").select_option(label="dp, pp, tp")
        expected.controls["order"].value = ("dp", "pp", "tp")
        after = wait_for_text(readout, expected.text)
        assert readout.locator("b").inner_text().startswith("TP groups cross nodes: 4 of 4")
        assert "TP groups cross nodes" in after
        wait_for_redraw(figure, src, "the rank order changed")


# Where each line of the text output holding `marker` starts, as Chromium laid it out: per character its line
# box's top, and a character lower than the one before starts a line.
LINE_STARTS_JS = """(marker) => {
  const pre = Array.from(document.querySelectorAll('.jp-OutputArea-output pre')).find(p => p.textContent.includes(marker));
  if (!pre) return null;
  const walker = document.createTreeWalker(pre, NodeFilter.SHOW_TEXT), range = document.createRange();
  let text = '';
  const tops = [];
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    for (let i = 0; i < node.length; i++) {
      range.setStart(node, i);
      range.setEnd(node, i + 1);
      const rects = range.getClientRects();
      tops.push(rects.length ? rects[0].top : null);
      text += node.data[i];
    }
  }
  const starts = [];
  for (let i = 1; i < text.length; i++) {
    if (tops[i] !== null && tops[i - 1] !== null && tops[i] > tops[i - 1] + 1) starts.push(i);
  }
  return {text, starts, wordBreak: getComputedStyle(pre).wordBreak};
}"""

# A printed line three times wider than the output area, of words 11 to 13 letters long: broken at any character
# (JupyterLab's own `word-break: break-all`), nearly every one of its lines would end inside a word.
LONG_LINE = "wraps: " + " ".join(["microbatches", "accumulation", "interleaved", "pipelining"] * 8)


def test_make_labs_jupyterlab_loads_the_magics_and_breaks_text_between_words(tmp_path, request):
    """`make lab`'s JupyterLab, started as the Makefile starts it (its IPython profile, its custom CSS):
    1. after a kernel restart, an attendee runs an exercise cell alone, before the notebook's
       `%load_ext labsupport`: every kernel has loaded the magics;
    2. issue 28: a printed line wider than the output area breaks between words, never inside one."""
    require_chromium()
    work = tmp_path / "work"
    subprocess.run(["make", "--no-print-directory", "-C", str(REPO), "lab-copy", f"WORK={work}", f"VENV={sys.prefix}"],
                   check=True, capture_output=True)
    write_notebook(work / "notebooks" / "alone.ipynb",
                   "%%exercise wire_bytes\ndef wire_bytes(op, payload_bytes, n):\n    raise NotImplementedError",
                   f"print({LONG_LINE!r})")
    with jupyter_lab(work / "notebooks", ipython_dir=work / ".ipython", extra_args=make_lab_style()) as server, \
            chromium_page() as page:
        with artifacts_on_failure(page, request.node.name, server):
            run_notebook_in_browser(page, server, "alone.ipynb", timeout_s=60)
            shown = page.locator(".jp-OutputArea-output", has_text="wire_bytes: not solved yet")
            shown.first.wait_for(timeout=15_000)
            page.locator(".jp-OutputArea-output pre", has_text="wraps: ").first.wait_for(timeout=15_000)
            laid_out = page.evaluate(LINE_STARTS_JS, "wraps: ")
            assert laid_out["text"].rstrip("\n") == LONG_LINE
            assert laid_out["wordBreak"] == "normal", laid_out["wordBreak"]
            starts, text = laid_out["starts"], laid_out["text"]
            assert len(starts) >= 2, f"the line was not broken at all: {laid_out}"
            inside = [text[max(0, i - 8):i] + "|" + text[i:i + 8] for i in starts if text[i - 1] != " "]
            assert not inside, f"lines broken inside words: {inside}"
    assert not tagged_processes(server.tag), "JupyterLab left processes behind"


# Every element of an output whose right edge passes the output area's (what JupyterLab would cut or scroll).
PAST_THE_OUTPUT_AREA = """() => Array.from(document.querySelectorAll('.jp-OutputArea-output')).flatMap(o => {
  const right = o.getBoundingClientRect().right;
  return Array.from(o.querySelectorAll('*')).filter(e => e.getBoundingClientRect().right > right + 0.5)
    .map(e => `${e.tagName.toLowerCase()}.${String(e.className)} ${Math.round(e.getBoundingClientRect().right - right)} px`);
})"""


def test_notebook_06s_widgets_fit_the_output_area_beside_the_file_browser(lab, request):
    """Issue 28: a figure or table wider than the output area is cut or scrolls. At a 1024-pixel window with the file
    browser open (an output area of about 590 px), the planner (its table with the CP column too) and the rank grid
    of notebook 06 stay inside; their pictures are scaled down, never stretched (a VBox stretches its children)."""
    write_notebook(lab.root / "fit06.ipynb",
                   "from labsupport.widgets.planner import PlannerWidget\n"
                   "from labsupport.widgets.rank_grid import RankGridWidget\n"
                   "from labsupport.widgets.show import show",
                   "g = RankGridWidget(devices_per_node=4, order=('dp', 'pp', 'tp'))\nshow(g, g.figure())",
                   "p = PlannerWidget('175b', machine='frontier', gpus=1024, global_batch=8000, samples=40)\n"
                   "show(p, p.figure())",
                   "q = PlannerWidget('175b', machine='frontier', gpus=1024, global_batch=64, seq_len=131072)\n"
                   "show(q, q.figure())")
    with chromium_page(width=1024, height=3000) as page, artifacts_on_failure(page, request.node.name, lab):
        run_notebook_in_browser(page, lab, "fit06.ipynb", timeout_s=240)
        for name in ("rankgrid", "planner"):
            page.locator(f".labsupport-{name}-figure").first.wait_for(state="visible", timeout=30_000)
        page.wait_for_function("() => Array.from(document.querySelectorAll('.jp-OutputArea-output img'))"
                               ".every(i => i.complete && i.naturalWidth > 0)", timeout=30_000)
        assert page.evaluate(PAST_THE_OUTPUT_AREA) == []
        sizes = page.evaluate("() => Array.from(document.querySelectorAll('img.widget-image'))"
                              ".map(i => [i.naturalWidth, i.getBoundingClientRect().width])")
        assert len(sizes) == 3 and all(shown <= natural + 0.5 for natural, shown in sizes), sizes
