"""A widget is shown live with a static stand-in, and a stored notebook keeps only the stand-in."""
import base64

import ipywidgets
from matplotlib.figure import Figure

from labsupport.widgets import show as sh


def test_show_bundles_the_live_view_and_a_png(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append((obj, raw)))
    fig = Figure(figsize=(2, 1))
    fig.add_subplot().plot([0, 1])
    sh.show(ipywidgets.Label("x"), fig)
    (bundle, raw), = shown
    assert raw and sh.WIDGET_VIEW in bundle and bundle["text/plain"] == sh.STATIC_TEXT
    assert base64.b64decode(bundle["image/png"]).startswith(b"\x89PNG")


def test_keep_static_drops_only_views_that_have_a_stand_in(tmp_path):
    both = {"output_type": "display_data", "data": {sh.WIDGET_VIEW: {"model_id": "a"}, "image/png": "...", "text/plain": "t"}}
    alone = {"output_type": "display_data", "data": {sh.WIDGET_VIEW: {"model_id": "b"}, "text/plain": "VBox()"}}
    nb = {"cells": [{"cell_type": "code", "outputs": [both, alone]}]}
    assert sh.keep_static(nb) == 1
    assert sh.WIDGET_VIEW not in both["data"] and "image/png" in both["data"] and sh.WIDGET_VIEW in alone["data"]
