"""Showing a widget so that it works live and still reads where widgets don't run.

`show(widget, figure)` displays one output holding both the live widget and a PNG of the
equivalent static figure. JupyterLab renders the widget; a stored notebook (GitHub, nbviewer,
a PDF, a Lab without the kernel) cannot, because widget state is not stored (it would only churn
the diffs), and Lab would show "Error displaying widget: model not found". So `make notebooks`
runs `python -m labsupport.widgets.show NOTEBOOK...`, which keeps only the PNG of such outputs.
"""
from __future__ import annotations

import base64
import json
import sys

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
STATIC_TEXT = "(an interactive widget: run the cell in JupyterLab; the static figure stands in for it here)"


def show(widget, figure) -> None:
    """Display `widget` (an ipywidget, or an object with `.widget`) with `figure` as its stand-in."""
    from IPython.display import display

    from .figure import figure_png  # imported here: `python -m labsupport.widgets.show` needs no matplotlib
    widget = getattr(widget, "widget", widget)
    bundle = dict(widget._repr_mimebundle_() or {})
    bundle["image/png"] = base64.b64encode(figure_png(figure)).decode()
    bundle["text/plain"] = STATIC_TEXT
    display(bundle, raw=True)


def keep_static(notebook: dict) -> int:
    """Drop the live widget view from every output that also has a PNG; return how many."""
    dropped = 0
    for cell in notebook.get("cells", []):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if WIDGET_VIEW in data and "image/png" in data:
                del data[WIDGET_VIEW]
                dropped += 1
    return dropped


def main(paths: list[str]) -> int:
    for path in paths:
        with open(path, encoding="utf-8") as f:
            notebook = json.load(f)
        if keep_static(notebook):
            with open(path, "w", encoding="utf-8") as f:
                json.dump(notebook, f, indent=1, ensure_ascii=False)
                f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
