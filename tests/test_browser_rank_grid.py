"""The rank-grid widget in a real JupyterLab, driven in headless Chromium (see tests/browser.py).

Pick the rank order with DP varying fastest in the page: the readout now says that the TP groups
cross nodes, word for word what the same widget says in Python, and the figure is redrawn.
"""
import time

import pytest

from browser import artifacts_on_failure, chromium_page, jupyter_lab, require_chromium, run_notebook_in_browser, \
    tagged_processes, wait_for_text, write_notebook
from labsupport.widgets.rank_grid import RankGridWidget

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.timeout(180)]


def test_rank_grid_shows_tp_groups_crossing_nodes_in_jupyterlab(tmp_path, request):
    require_chromium()  # skip (or fail in CI) before paying for the server
    expected = RankGridWidget(dp=2, tp=2, pp=2, devices_per_node=4)
    with jupyter_lab(tmp_path / "empty") as lab, chromium_page() as page, artifacts_on_failure(page, request.node.name,
                                                                                                lab):
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
        deadline = time.monotonic() + 10  # the picture is a message of its own, after the readout's
        while figure.get_attribute("src") == src:
            assert time.monotonic() < deadline, "the figure was not redrawn after the rank order changed"
            time.sleep(0.1)
    assert not tagged_processes(lab.tag), "JupyterLab left processes behind"
