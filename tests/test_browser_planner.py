"""The planner widget in a real JupyterLab, driven in headless Chromium (see tests/browser.py).

Halve the GPUs, then pick another machine, in the page: the readout (why the best layout wins)
and the table of the fastest layouts follow, word for word what the same widget says in Python,
and the figure is redrawn.
"""
import time

import pytest

from browser import artifacts_on_failure, chromium_page, jupyter_lab, require_chromium, run_notebook_in_browser, \
    tagged_processes, wait_for_text, write_notebook
from labsupport.widgets.planner import HEADER, PlannerWidget

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(180)]


def table_text(w: PlannerWidget) -> str:
    """The table as Chromium's inner_text renders it: cells joined by tabs, rows by newlines."""
    return "\n".join("\t".join(row) for row in [HEADER] + w.rows)


def test_planner_follows_the_gpus_and_the_machine_in_jupyterlab(tmp_path, request):
    require_chromium()  # skip (or fail in CI) before paying for the server
    expected = PlannerWidget("175b", machine="frontier", gpus=1024)
    with jupyter_lab(tmp_path / "empty") as lab, chromium_page() as page, artifacts_on_failure(page, request.node.name,
                                                                                                lab):
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
            deadline = time.monotonic() + 10  # the picture is a message of its own, after the readout's
            while figure.get_attribute("src") == before:
                assert time.monotonic() < deadline, f"the figure was not redrawn after {name} = {value}"
                time.sleep(0.1)
        assert shown[-1].startswith("175b on 512 GPUs of DGX H100 (80 GB")
    assert not tagged_processes(lab.tag), "JupyterLab left processes behind"
