"""What every widget's figure shares: the Figure class a notebook shows, its PNG, and byte-valued
axes (in units.py's units); and what the step buttons of the stepper widgets do (`Stepper`).

Figures are built with `matplotlib.figure.Figure` rather than pyplot, so redrawing a widget never
piles up pyplot's open figures and a figure that a cell returns is shown exactly once. A
`NotebookFigure` carries its own PNG representation, so it shows in a notebook even when nothing
imported pyplot (which is what registers matplotlib's display hook with IPython).
"""
from __future__ import annotations

import io

from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter

DPI = 100  # of every PNG a widget shows or a notebook stores


def bytes_axis(axis) -> None:
    """Tick labels of an axis in bytes, in the same decimal units (0 B, 500 B, 1 kB, ...)."""
    axis.set_major_formatter(EngFormatter(unit="B"))


def figure_png(fig, dpi: int = DPI) -> bytes:
    """A matplotlib Figure as PNG bytes (no pyplot, no display needed)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    if fig.canvas is None or not hasattr(fig.canvas, "print_png"):
        FigureCanvasAgg(fig)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


class NotebookFigure(Figure):
    """A Figure that shows itself as a PNG when a cell returns it, pyplot or not."""

    def _repr_png_(self) -> bytes:
        return figure_png(self)


class Stepper:
    """What the step buttons of a stepper widget do. The widget holds `position` (an IntSlider over
    the states 0..`last`), `play` (ipywidgets' Play, driving the slider) and the property `last`."""

    @property
    def k(self) -> int:
        """The state shown."""
        return self.position.value

    def step(self) -> None:
        """One step forward (nothing at the end)."""
        self.goto(self.k + 1)

    def back(self) -> None:
        """One step back (nothing at the start)."""
        self.goto(self.k - 1)

    def reset(self) -> None:
        """Back to the first state, and stop playing."""
        self.play.playing = False
        self.goto(0)

    def goto(self, k: int) -> None:
        """Show state k, clipped to the available states."""
        self.position.value = max(0, min(int(k), self.last))

    def rewind(self) -> None:
        """After the states changed (another collective, other ranks): stopped, at state 0, the play
        button's range the new one. Sets values only; the caller redraws."""
        self.play.playing = False
        self.position.value = 0
        self.play.max = self.last
