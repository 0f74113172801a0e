"""The overlap timeline draws recorded steps and shows trace.overlap's numbers; synthetic traces, no ranks."""
import json
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
pytest.importorskip("ipywidgets")

from matplotlib.colors import to_rgba  # noqa: E402

from labsupport.trace import overlap  # noqa: E402
from labsupport.widgets import timeline as tl  # noqa: E402

MS = 1e-3


def trace(rank, comm, backward=(0.010, 0.030), offset=100.0):
    """One rank's step: forward, backward, the given all-reduces [(start, end)], finish_backward, optimizer.

    Times are seconds on the rank's own clock, which starts at `offset` (clocks differ between ranks).
    """
    last = max([backward[1], *(end for _, end in comm)])
    events = [{"op": "forward", "start": 0.0, "end": backward[0]},
              {"op": "backward", "start": backward[0], "end": backward[1]},
              {"op": "finish_backward", "start": backward[1], "end": last + 0.001},
              {"op": "optimizer", "start": last + 0.002, "end": last + 0.005}]
    for i, (start, end) in enumerate(comm):
        events.append({"op": "all_reduce", "group": "world", "payload_bytes": 1000 * (i + 1), "bucket": i,
                       "start": start, "end": end})
    for e in events:
        e["start"] += offset
        e["end"] += offset
    return {"rank": rank, "step": 9, "events": events}


# bucketed: two buckets in flight during backward, the second one ends after it; flat: one at the end
BUCKETED = [trace(0, [(0.015, 0.025), (0.028, 0.040)]), trace(1, [(0.012, 0.026), (0.020, 0.050)], offset=7.0)]
FLAT = [trace(0, [(0.031, 0.045)]), trace(1, [(0.030, 0.047)], offset=3.0)]


def write_run(directory: Path, traces) -> Path:
    directory.mkdir(parents=True)
    for t in reversed(traces):  # written out of order on purpose
        (directory / f"trace-rank{t['rank']}.json").write_text(json.dumps(t))
    return directory


def bars_of_color(ax, color):
    return [p for p in ax.patches if p.get_facecolor() == to_rgba(color)]


def test_load_traces_in_rank_order(tmp_path):
    traces = [trace(r, [(0.015, 0.025)]) for r in range(12)]
    loaded = tl.load_traces(write_run(tmp_path / "run", traces))
    assert [t["rank"] for t in loaded] == list(range(12))  # 10 and 11 after 2, not after 1
    assert loaded == traces
    with pytest.raises(FileNotFoundError, match="trace-rank"):
        tl.load_traces(tmp_path)


def test_summary_is_trace_overlap():
    s = tl.summary(BUCKETED[0])
    assert {k: s[k] for k in ("compute_s", "comm_s", "hidden_s", "exposed_s")} == overlap(BUCKETED[0]["events"])
    assert s["hidden_s"] == pytest.approx(0.010 + 0.002) and s["exposed_s"] == pytest.approx(0.010)
    assert s["calls"] == 2 and s["payload_bytes"] == 3000
    assert tl.summary(FLAT[0])["hidden_s"] == 0  # flat starts after backward: nothing hidden


def test_figure_has_one_axis_per_rank_and_shows_the_overlap():
    fig = tl.timeline_figure(BUCKETED, title="bucketed")
    assert len(fig.axes) == 2
    for ax, t in zip(fig.axes, BUCKETED):
        ov = overlap(t["events"])
        title = ax.get_title(loc="left")
        assert title.startswith(f"rank {t['rank']}:")
        for key in ("comm_s", "hidden_s", "exposed_s"):
            assert tl.format_ms(ov[key]) in title
        assert [tick.get_text() for tick in ax.get_yticklabels()] == ["all-reduce", "compute"]
        # one exposed-coloured bar per all-reduce, as long as the call took (in ms, from the rank's first event)
        calls = tl.comm_events(t)
        red = bars_of_color(ax, tl.COLORS["exposed"])
        assert [p.get_width() for p in red] == pytest.approx([1e3 * (e["end"] - e["start"]) for e in calls])
        assert [p.get_x() for p in red] == pytest.approx([1e3 * (e["start"] - t["events"][0]["start"]) for e in calls])
        # the hidden-coloured copies are clipped to the backward pass
        for p in bars_of_color(ax, tl.COLORS["hidden"]):
            assert p.get_clip_path() is not None
        assert len(bars_of_color(ax, tl.COLORS["backward"])) == 1
    assert fig._suptitle.get_text() == "bucketed"
    assert tl.figure_png(fig).startswith(b"\x89PNG")
    with pytest.raises(ValueError):
        tl.timeline_figure([])


def test_figure_scales_with_the_number_of_ranks():
    fig = tl.timeline_figure([trace(r, [(0.031, 0.045)]) for r in range(4)])
    assert len(fig.axes) == 4
    assert [ax.get_title(loc="left").split(":")[0] for ax in fig.axes] == [f"rank {r}" for r in range(4)]


def test_in_flight_calls_get_their_own_rows():
    # rank 1's two buckets overlap in time, so they are drawn one above the other
    red = bars_of_color(tl.timeline_figure(BUCKETED).axes[1], tl.COLORS["exposed"])
    assert red[0].get_y() != red[1].get_y()
    red = bars_of_color(tl.timeline_figure(FLAT).axes[0], tl.COLORS["exposed"])
    assert len(red) == 1


def test_describe_one_line_per_rank():
    text = tl.describe(BUCKETED)
    lines = text.splitlines()
    assert len(lines) == 2
    for line, t in zip(lines, BUCKETED):
        ov = overlap(t["events"])
        assert line.startswith(f"rank {t['rank']}: backward {tl.format_ms(ov['compute_s'])}")
        assert f"hidden {tl.format_ms(ov['hidden_s'])} + exposed {tl.format_ms(ov['exposed_s'])}" in line
        assert "2 all-reduces, 0.00 MB" in line


def test_widget_switches_runs(tmp_path):
    runs = {"flat": write_run(tmp_path / "flat", FLAT), "bucketed": write_run(tmp_path / "bucketed", BUCKETED)}
    w = tl.TimelineWidget(runs)
    assert w.label == "flat" and w.traces == FLAT
    assert list(w.controls["run"].options) == ["flat", "bucketed"]
    first_png, first_text = w.png, w.text
    assert first_png.startswith(b"\x89PNG") and w.image.value == first_png

    w.controls["run"].value = "bucketed"
    assert w.label == "bucketed" and w.traces == BUCKETED
    assert w.png != first_png and w.text != first_text and w.text == tl.describe(BUCKETED)
    for s, t in zip(w.summaries, BUCKETED):
        ov = overlap(t["events"])
        assert {k: s[k] for k in ov} == ov
        for key in ov:  # the readout shows the same numbers
            assert tl.format_ms(ov[key]) in w.readout.value
    assert "bucketed" in w.readout.value

    w.controls["run"].value = "flat"
    assert w.png == first_png and w.text == first_text


def test_widget_starting_value_and_errors(tmp_path):
    runs = {"a": write_run(tmp_path / "a", FLAT), "b": write_run(tmp_path / "b", BUCKETED)}
    assert tl.TimelineWidget(runs, value="b").traces == BUCKETED
    with pytest.raises(ValueError):
        tl.TimelineWidget({})
    with pytest.raises(FileNotFoundError):
        tl.TimelineWidget({"empty": tmp_path})


def test_legend_names_every_colour_and_bucket_numbers_are_readable():
    fig = tl.timeline_figure(BUCKETED)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert tl.LABELS["band"] in labels and tl.LABELS["hidden"] in labels and tl.LABELS["exposed"] in labels
    band = [h for h in fig.legends[0].legend_handles if h.get_label() == tl.LABELS["band"]]
    assert band and band[0].get_alpha() == tl.BAND_ALPHA
    numbers = [t for t in fig.axes[1].texts if t.get_text().strip().isdigit()]
    assert numbers and all(t.get_fontsize() >= 9 for t in numbers)  # rank 1's buckets are in flight together


def test_summary_has_the_step_duration():
    t = BUCKETED[1]
    assert tl.summary(t)["step_s"] == pytest.approx(max(e["end"] for e in t["events"]) - min(e["start"] for e in t["events"]))
