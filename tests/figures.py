"""What a reader would trip over in a widget's picture or controls, measured the way the page draws them.

Shared by the widget tests: a text cut off at the figure's edge, two texts on top of each other
(tick labels included), a legend inside a plot, and control labels or menu entries wider than the
box JupyterLab gives them (it cuts those off with an ellipsis).
"""
import matplotlib

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.font_manager import FontProperties  # noqa: E402
from matplotlib.textpath import TextPath  # noqa: E402

from labsupport.widgets.figure import DPI  # noqa: E402


def rendered(fig):
    """Draw `fig` as its PNG is drawn (at the stored figures' DPI) and return the renderer."""
    fig.set_dpi(DPI)
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer()


def drawn_texts(fig) -> list:
    """Every text the PNG shows: titles, labels, annotations, legend entries, the tick labels in view."""
    texts = list(fig.texts) + [t for legend in fig.legends for t in legend.get_texts()]
    for ax in fig.axes:
        texts += [ax.title, ax._left_title, ax._right_title, *ax.texts]
        texts += ax.get_legend().get_texts() if ax.get_legend() else []
        if ax.axison:
            texts += [ax.xaxis.label, ax.yaxis.label]
            for axis in (ax.xaxis, ax.yaxis):
                low, high = sorted(axis.get_view_interval())
                texts += [tick.label1 for tick in axis.get_major_ticks() + axis.get_minor_ticks()
                          if low <= tick.get_loc() <= high and tick.label1.get_visible()]
    return [t for t in texts if t.get_visible() and t.get_text().strip()]


def texts_cut_or_overlapping(fig) -> list[str]:
    """Texts that leave the figure, and pairs of texts drawn on top of each other."""
    renderer = rendered(fig)
    boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in drawn_texts(fig)]
    page = fig.bbox
    defects = [f"cut off: {text!r}" for text, b in boxes
               if b.x0 < page.x0 - 0.5 or b.y0 < page.y0 - 0.5 or b.x1 > page.x1 + 0.5 or b.y1 > page.y1 + 0.5]
    defects += [f"on top of each other: {a!r}, {b!r}" for i, (a, box) in enumerate(boxes)
                for b, other in boxes[i + 1:] if box.overlaps(other)]
    return defects


def figure_defects(fig) -> list[str]:
    """texts_cut_or_overlapping, and any legend inside a plot (where it hides or crowds the data)."""
    defects = texts_cut_or_overlapping(fig)
    renderer = rendered(fig)
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    defects += [f"legend {[t.get_text() for t in legend.get_texts()][:2]} inside the plot {ax.get_title()!r}"
                for legend in legends for ax in fig.axes
                if legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))]
    return defects


def text_px(text: str) -> float:
    """The width of `text` at JupyterLab's 13 px widget font, measured in DejaVu Sans (wider than
    the browsers' UI fonts, so a text that fits here fits there)."""
    return TextPath((0, 0), text, size=13, prop=FontProperties(family="DejaVu Sans")).get_extents().width


def px(length: str | None, default: str = "300px") -> float:
    """A CSS length in px as a number ("150px" -> 150.0); ipywidgets' default width where unset."""
    return float((length or default).removesuffix("px"))


def cut_off_controls(controls: dict, arrow_px: float = 40) -> list[str]:
    """Control descriptions wider than their description_width, and menu entries wider than the
    menu (the control's width less its description and the arrow's padding)."""
    from ipywidgets import Dropdown

    cut = []
    for name, control in controls.items():
        label_px = px(control.style.description_width)
        if text_px(control.description) > label_px:
            cut.append(f"{name}: {control.description!r}")
        if isinstance(control, Dropdown):
            menu_px = px(control.layout.width) - label_px - arrow_px
            cut += [f"{name}: {label!r}" for label in control._options_labels if text_px(str(label)) > menu_px]
    return cut
