"""The comm-counter widget in a real JupyterLab, driven in headless Chromium (see tests/browser.py).

Pick T beyond a node, then another machine, in the page: the readout (the step's communication
time, compute time and their ratio) follows, word for word what the same widget says in Python.
"""
import time

import pytest

from browser import artifacts_on_failure, chromium_page, jupyter_lab, require_chromium, run_notebook_in_browser, \
    tagged_processes, wait_for_text, write_notebook
from labsupport.widgets.comm_counter import CommCounterWidget

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(180)]


def test_comm_counter_follows_t_and_the_machine_in_jupyterlab(tmp_path, request):
    require_chromium()  # skip (or fail in CI) before paying for the server
    expected = CommCounterWidget("22b", tp=8)
    with jupyter_lab(tmp_path / "empty") as lab, chromium_page() as page, artifacts_on_failure(page, request.node.name,
                                                                                                lab):
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
            deadline = time.monotonic() + 10  # the picture is a message of its own, after the readout's
            while figure.get_attribute("src") == before:
                assert time.monotonic() < deadline, f"the figure was not redrawn after {name} = {value}"
                time.sleep(0.1)
        mark = readout.locator("b")
        assert mark.inner_text() == "T = 16 > 8 devices per node: the ring crosses the network"
        assert "12.5 GB/s per direction" in shown[-1] and f"= {expected.prediction['ratio']:.3g}." in shown[-1]
    assert not tagged_processes(lab.tag), "JupyterLab left processes behind"
