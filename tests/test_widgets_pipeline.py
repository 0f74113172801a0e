"""The pipeline-bubble widget and its figures: every number is the simulator's, no browser needed."""
import matplotlib
import pytest

matplotlib.use("Agg")
pytest.importorskip("ipywidgets")

from matplotlib.colors import to_rgba  # noqa: E402

from figures import rendered, text_px  # noqa: E402
from labsupport.estimate.schedules import schedule  # noqa: E402
from labsupport.estimate.simulator import simulate  # noqa: E402
from labsupport.widgets import pipeline as wp  # noqa: E402
from labsupport.widgets.figure import figure_png  # noqa: E402


def stage_labels(ax):
    return [t.get_text() for t in ax.get_yticklabels()]


def bars_of_color(ax, color):
    """Total width of the bars drawn in `color` on `ax` (broken_barh collections, one path per bar)."""
    return sum(float(path.vertices[:, 0].max() - path.vertices[:, 0].min())
               for c in ax.collections if tuple(c.get_facecolor()[0]) == color for path in c.get_paths())


def gantt_figure_axes(timeline, **kwargs):
    return wp.gantt_figure(timeline, **kwargs).axes


def bundle_has_widget(w):
    return "application/vnd.jupyter.widget-view+json" in w._repr_mimebundle_()


def test_widget_follows_its_controls():
    w = wp.PipelineWidget("1f1b", stages=4, microbatches=8)
    assert w.timeline.bubble_over_ideal == pytest.approx(3 / 8)
    assert "27.3%" in w.text and "27.3%" in w.bubble.value and "4, 3, 2, 1" in w.text
    assert w.png.startswith(b"\x89PNG") and w.image.value == w.png
    assert w.controls["chunks"].layout.display == "none"
    first_png = w.png

    w.controls["microbatches"].value = 16
    assert w.timeline.bubble_over_ideal == pytest.approx(3 / 16) and "15.8%" in w.text
    assert w.png != first_png

    w.controls["schedule"].value = "interleaved"
    assert w.controls["chunks"].layout.display is None
    assert w.options() == dict(name="interleaved", stages=4, microbatches=16, chunks=2, backward_ratio=2.0)
    assert w.timeline.bubble_over_ideal == pytest.approx(3 / 32)
    assert w.timeline.spans == simulate(schedule("interleaved", 4, 16, 2), chunks=2).spans

    w.controls["schedule"].value = "gpipe"
    assert w.timeline.peak_inflight_microbatches == [16] * 4


def test_a_schedule_the_simulator_refuses_is_reported_not_raised():
    w = wp.PipelineWidget("interleaved", stages=4, microbatches=8)
    w.controls["microbatches"].value = 6
    assert w.timeline is None and "divisible by stages" in w.error and "divisible" in w.bubble.value
    with pytest.raises(ValueError, match="no schedule"):
        w.figure()
    w.controls["microbatches"].value = 12
    assert w.error is None and w.timeline.bubble_over_ideal == pytest.approx(3 / 24)


def test_static_fallback_is_the_widgets_picture():
    w = wp.PipelineWidget("interleaved", stages=2, microbatches=4, chunks=3)
    fig = w.figure()
    assert figure_png(fig) == w.png and fig._repr_png_().startswith(b"\x89PNG")
    gantt, by_m, by_p = fig.axes[:3]
    assert stage_labels(gantt) == ["stage 1", "stage 0"]
    assert by_m.get_xlabel().startswith("micro-batches") and by_p.get_xlabel() == "pipeline stages p"
    assert bundle_has_widget(w)


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 3, 4, 1), ("1f1b", 5, 7, 1), ("interleaved", 4, 8, 2)])
def test_gantt_has_one_row_per_stage_and_shows_compute_and_idle(name, p, m, v):
    timeline = simulate(schedule(name, p, m, v), chunks=v)
    (ax,) = gantt_figure_axes(timeline)
    assert stage_labels(ax) == [f"stage {s}" for s in reversed(range(p))]
    forward = bars_of_color(ax, to_rgba(wp.COLORS["F"]))
    backward = bars_of_color(ax, to_rgba(wp.COLORS["B"]))
    assert forward == pytest.approx(p * m / v)          # chunk 0's forwards, each 1 / v long
    assert backward == pytest.approx(2 * p * m / v)
    assert bars_of_color(ax, to_rgba(wp.IDLE)) == pytest.approx(p * timeline.total_time)   # the rows behind


def test_measured_run_is_drawn_beside_the_prediction():
    timeline = simulate(schedule("1f1b", 2, 3))
    measured = [[(10.0 + 0.01 * s, 10.0 + 0.01 * e, op, mb, c) for s, e, op, mb, c in stage]
                for stage in timeline.spans]
    measured[0].append((10.5, 10.6, "SEND_F", 0, 0))     # communication spans are not drawn
    predicted, real = gantt_figure_axes(timeline, measured=measured)
    assert stage_labels(real) == stage_labels(predicted) == ["stage 1", "stage 0"]
    assert real.get_xlim() == pytest.approx((0, 0.01 * timeline.total_time))  # from the earliest span
    assert real.get_title(loc="left") == "measured" and real.get_xlabel() == "seconds"
    widget = wp.PipelineWidget("1f1b", stages=2, microbatches=3,
                               measured={"1f1b": [[list(s) for s in st] for st in measured]})
    assert len(widget.figure().axes) == 4  # two Gantt charts, two throughput plots


def measured_runs(p=2, m=8):
    """Seconds-scaled simulated runs standing in for the notebook's live gpipe, 1f1b and interleaved runs."""
    return {name: [[(10 + 0.01 * s, 10 + 0.01 * e, op, mb, c) for s, e, op, mb, c in stage]
                   for stage in simulate(schedule(name, p, m, v), chunks=v).spans]
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))}


def test_the_measured_panel_follows_the_controls_and_never_shows_another_runs_step():
    """Issue 18: the panel stayed at 1F1B p = 2 m = 8 whatever the controls said. It shows the run of the
    chosen schedule while stages, micro-batches and chunks are that run's, and otherwise says so, empty."""
    runs = measured_runs()
    w = wp.PipelineWidget("1f1b", stages=2, microbatches=8, measured=runs)
    for name in ("gpipe", "interleaved", "1f1b"):
        w.controls["schedule"].value = name
        measured = w.figure().axes[1]
        assert w.measured_shown == name and "Beside it, measured" in w.text
        assert measured.get_title(loc="left") == f"measured: {wp.run_label(name, *wp.run_shape(runs[name]))}"
        assert measured.get_xlim()[1] == pytest.approx(max(s[1] for st in runs[name] for s in st) - 10)
    for control, value in (("stages", 4), ("microbatches", 16)):
        w.controls[control].value = value
        fig = w.figure()
        measured, legend = fig.axes[1], fig.subfigs[0].legends[0]
        assert w.measured_shown is None and not measured.axison and len(measured.collections) == 0
        assert "no run of these settings" in measured.get_title(loc="left") and "No measured run" in w.text
        (note,) = measured.texts
        assert "1f1b, p = 2, m = 8" in note.get_text()
        renderer = rendered(fig)
        box = note.get_window_extent(renderer)
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
        assert not box.overlaps(legend.get_window_extent(renderer)), "the note runs under the legend"
        w.controls[control].value = {"stages": 2, "microbatches": 8}[control]
    w.controls["schedule"].value = "interleaved"
    w.controls["chunks"].value = 3            # v = 3 was not measured
    assert w.measured_shown is None
    assert len(wp.PipelineWidget("1f1b", stages=4).figure().axes) == 3   # no measurement, no panel


def label_boxes(fig):
    """(label, its box, its bar's box) for every micro-batch number drawn, after a draw as the PNG's."""
    renderer = rendered(fig)
    for ax in fig.axes:
        for label in ax.texts:
            if isinstance(label, wp.BarLabel) and label.fits:
                (left, _), (right, _) = ax.transData.transform([(label.bar[0], 0), (label.bar[1], 0)])
                yield label, label.get_window_extent(renderer), (left, right)


@pytest.mark.parametrize("make", [
    lambda: wp.gantt_figure(simulate(schedule("interleaved", 4, 8, 2), chunks=2)),       # notebook 05's [29]
    lambda: wp.gantt_figure(simulate(schedule("interleaved", 4, 16, 4), chunks=4)),
    lambda: wp.gantt_figure(simulate(schedule("1f1b", 4, 8))),
    lambda: wp.PipelineWidget("interleaved", stages=4, microbatches=8).figure(),
    lambda: wp.PipelineWidget("gpipe", stages=16, microbatches=64).figure(),
])
def test_micro_batch_numbers_sit_inside_their_bars_or_are_left_out(make):
    """Issue 18: 05[29]'s warm-up numbers ran into each other in the narrow chunk bars. A number is drawn
    only where it fits inside its bar, so none touches another; wide bars keep theirs."""
    fig = make()
    drawn = list(label_boxes(fig))
    for label, box, (left, right) in drawn:
        assert left + wp.PAD_PX <= box.x0 and box.x1 <= right - wp.PAD_PX, f"{label.get_text()!r} fills its bar"
    for (a, box_a, _), (b, box_b, _) in zip(drawn, drawn[1:]):
        assert not box_a.overlaps(box_b) or a.get_position()[1] != b.get_position()[1], (a.get_text(), b.get_text())
    one_f_one_b = [t for t in fig.axes[0].texts if isinstance(t, wp.BarLabel)]
    if len(one_f_one_b) <= 64:
        assert sum(t.fits for t in one_f_one_b) >= len(one_f_one_b) / 2   # most bars are wide enough to say which


def measured_with_slivers(p=2, m=8):
    """A measured-like 1F1B step in seconds: forwards ~3 ms, backwards ~5 ms, and three forwards per stage that a
    loaded machine made slivers of 0.6 ms (the newcomer's pass of issue 28 saw such bars without numbers)."""
    predicted = simulate(schedule("1f1b", p, m), forward_time=0.003, backward_ratio=5 / 3)
    return predicted, [[(s, s + (0.0006 if op == "F" and mb in (2, 3, 5) else e - s), op, mb, c)
                        for s, e, op, mb, c in stage] for stage in predicted.spans]


@pytest.mark.parametrize("make", [
    lambda: wp.gantt_figure(*measured_with_slivers(), unit="seconds", title="1F1B, p = 2, m = 8: simulated with "
                            "the measured times", measured_title="measured: the run's last step"),  # notebook 05's [36]
    lambda: wp.PipelineWidget("1f1b", stages=2, microbatches=8, measured={"1f1b": measured_with_slivers()[1]}).figure(),
])
def test_a_measured_bar_too_narrow_for_its_number_has_none_and_the_legend_says_so(make):
    """Issue 28: in 05's measured Gantt chart the numbers set above and below the slivers crowded the rows. A measured
    bar carries its micro-batch number only inside, where it fits: the three slivers of each stage have none, every
    other bar keeps its number, and the legend says what the numbers are and why a bar can lack one."""
    fig = make()
    renderer = rendered(fig)
    measured = next(ax for ax in fig.axes if ax.get_title(loc="left").startswith("measured"))
    labels = [t for t in measured.texts if isinstance(t, wp.BarLabel)]
    assert len(labels) == 2 * 2 * 8
    assert sorted(t.get_text() for t in labels if not t.fits) == ["2", "2", "3", "3", "5", "5"]
    for t in labels:
        if t.fits:
            box = t.get_window_extent(renderer)
            (left, _), (right, _) = measured.transData.transform([(t.bar[0], 0), (t.bar[1], 0)])
            assert left + wp.PAD_PX <= box.x0 and box.x1 <= right - wp.PAD_PX, f"{t.get_text()!r} fills its bar"
            assert t.get_position()[1] in (0, 1), f"{t.get_text()!r} is off its row"
    legends = fig.legends + [legend for sub in fig.subfigs for legend in sub.legends]
    assert [text.get_text() for legend in legends for text in legend.get_texts()][-1] == wp.NUMBERS_NOTE
    assert fig.get_figwidth() <= 9.6, "wider than the output area (the widget's figure is 9.6 in)"


def test_a_measured_figure_stacks_its_two_charts_on_one_time_axis():
    predicted, measured = measured_with_slivers()
    top, bottom = wp.gantt_figure(predicted, measured=measured, unit="seconds").axes
    assert top.get_position().y0 > bottom.get_position().y1     # one above the other, each the figure's width
    longest = max(predicted.total_time, max(s[1] for st in measured for s in st))
    assert top.get_xlim() == bottom.get_xlim() == (0, longest)


def test_control_labels_are_not_cut_off():
    """Issue 18: "backward / forw..." - JupyterLab cuts a description wider than description_width."""
    w = wp.PipelineWidget()
    width = float(wp.DESCRIPTION_WIDTH.removesuffix("px"))
    for name, control in w.controls.items():
        assert text_px(control.description) <= width - 4, name
        if name != "schedule":   # a slider keeps a track to drag beside the wider description and its readout
            assert float(control.layout.width.removesuffix("px")) - width - 60 >= 250, name


def test_throughput_plots_are_one_minus_the_bubble_formula():
    fig = wp.throughput_figure("1f1b", stages=4, microbatches=8)
    by_m, by_p = fig.axes
    xs, ys = by_m.lines[0].get_data()
    assert list(xs[:3]) == [1, 2, 3] and ys[7] == pytest.approx(1 - 3 / 11)
    fixed, growing = by_p.lines[:2]
    assert fixed.get_ydata()[-1] == pytest.approx(1 - 15 / 23)            # p = 16, m = 8
    assert list(growing.get_xdata()) == list(range(2, 17))                 # m = 8 (p - 1) / 3
    assert growing.get_ydata() == pytest.approx([1 - 3 / 11] * 15)
