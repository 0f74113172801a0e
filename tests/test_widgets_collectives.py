"""The collectives stepper shows exactly what `collective_steps.simulate` computes, step by step."""

import pytest

pytest.importorskip("ipywidgets")

from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

from figures import rendered  # noqa: E402

from labsupport.estimate.collective_steps import COLLECTIVES, schedule, simulate  # noqa: E402
from labsupport.widgets.collectives import (DPI, CollectivesWidget, collectives_figure, draw_single,  # noqa: E402
                                            format_state, format_value, symbolic_initial, walkthrough)


def expected_states(collective, n, root=0):
    """The readouts the widget must show: simulate() on the widget's symbolic start, formatted."""
    return [format_state(s) for s in simulate(collective, n, root, initial=symbolic_initial(collective, n, root))]


def test_symbolic_start_names_what_initial_state_holds():
    start = symbolic_initial("scatter", 3, root=1)
    assert start == [[None] * 3, ["b0", "b1", "b2"], [None] * 3]
    assert format_value("c1+a1+b1") == "a1+b1+c1"


def test_stepping_all_reduce_follows_simulate_and_ends_with_the_full_sum():
    w = CollectivesWidget("all_reduce", 4)
    expected = expected_states("all_reduce", 4)
    assert len(expected) == len(schedule("all_reduce", 4)) + 1 == 7
    assert w.state_text() == expected[0]
    assert w.step_text() == "start (6 steps)"
    seen = [w.state_text()]
    for k in range(1, len(expected)):
        w.step()
        assert w.k == k
        assert w.state_text() == expected[k]
        assert w.step_text() == f"step {k} of 6"
        assert w.readout.value.count("rank ") == 4  # the HTML readout carries the same text
        seen.append(w.state_text())
    assert len(set(seen)) == len(seen), "every step changes what some rank holds"
    full = "  ".join(f"a{c}+b{c}+c{c}+d{c}" for c in range(4))
    assert w.state_text() == "\n".join(f"rank {r}: {full}" for r in range(4))
    assert w.step_button.disabled and not w.back_button.disabled
    w.step()  # at the end, step does nothing
    assert w.k == 6 and w.state_text() == expected[-1]


def test_back_and_reset():
    w = CollectivesWidget("reduce_scatter", 3)
    expected = expected_states("reduce_scatter", 3)
    w.step()
    w.step()
    w.back()
    assert w.k == 1 and w.state_text() == expected[1]
    w.reset()
    assert w.k == 0 and w.state_text() == expected[0]
    assert w.back_button.disabled
    w.back()  # at the start, back does nothing
    assert w.k == 0
    w.goto(99)
    assert w.k == len(expected) - 1


def test_buttons_drive_the_same_steps():
    w = CollectivesWidget("all_gather", 4)
    png = w.image.value
    w.step_button.click()
    assert w.k == 1 and w.state_text() == expected_states("all_gather", 4)[1]
    assert w.image.value != png  # the picture was redrawn
    w.reset_button.click()
    assert w.k == 0 and w.image.value == png


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_every_collective_plays_to_its_end(collective):
    w = CollectivesWidget(collective, 5, root=2)
    expected = expected_states(collective, 5, root=2)
    w.goto(len(expected) - 1)
    assert w.error is None
    assert w.state_text() == expected[-1]
    assert bytes(w.image.value).startswith(b"\x89PNG")


def test_menus_rebuild_and_root_follows_world_size():
    w = CollectivesWidget("broadcast", 6, root=5)
    w.step()
    w.ranks_menu.value = 4  # root 5 does not exist on 4 ranks: back to 0, and back to the start
    assert w.root_menu.value == 0 and w.k == 0
    assert w.state_text() == expected_states("broadcast", 4, root=0)[0]
    w.collective_menu.value = "all_to_all"
    assert w.root_menu.disabled
    assert w.state_text() == expected_states("all_to_all", 4)[0]


@pytest.mark.parametrize("n", [17, 0])
def test_unsupported_world_size_shows_the_error_instead_of_raising(n):
    with pytest.raises(ValueError) as excinfo:
        schedule("all_reduce", n)
    w = CollectivesWidget("all_reduce", n)
    assert w.error == str(excinfo.value)
    assert str(excinfo.value) in w.error_box.value
    assert w.error_box.layout.display != "none" and w.image.layout.display == "none"
    assert w.step_button.disabled and w.state_text() == ""
    w.step()  # harmless
    w.select(n=4)  # and a valid choice recovers
    assert w.error is None and w.error_box.layout.display == "none"
    assert w.state_text() == expected_states("all_reduce", 4)[0]


def test_impossible_root_shows_the_error():
    w = CollectivesWidget("scatter", 3, root=3)
    assert w.error and "root" in w.error


def test_css_classes_for_browser_tests():
    w = CollectivesWidget()
    assert "labsupport-collectives-state" in w.readout._dom_classes
    assert "labsupport-collectives-step" in w.step_label._dom_classes
    assert "labsupport-step" in w.step_button._dom_classes
    assert "labsupport-back" in w.back_button._dom_classes
    assert "labsupport-reset" in w.reset_button._dom_classes
    assert "labsupport-play" in w.play._dom_classes


def test_static_figure_has_one_panel_per_state():
    assert len(collectives_figure("all_reduce", 4).axes) == len(schedule("all_reduce", 4)) + 1 == 7
    assert len(collectives_figure("broadcast", 8).axes) == len(walkthrough("broadcast", 8)) == 4
    assert len(collectives_figure("all_reduce", 4, step=3).axes) == 1
    with pytest.raises(ValueError, match="step"):
        collectives_figure("all_reduce", 4, step=7)
    with pytest.raises(ValueError):
        collectives_figure("all_reduce", 17)


def test_static_figure_shows_itself_in_a_notebook_without_pyplot():
    assert collectives_figure("gather", 3, step=1)._repr_png_().startswith(b"\x89PNG")


# ---------------------------------------------------------------- what the pictures look like

def covered_labels(fig):
    """(label text, the arrow's zorder, the label) for every label whose box an arrow's box overlaps."""
    renderer = rendered(fig)
    for ax in fig.axes:
        arrows = [(p.get_window_extent(renderer), p) for p in ax.patches if isinstance(p, FancyArrowPatch)]
        labels = [t for t in ax.texts if t.get_text()] + ax.get_xticklabels() + ax.get_yticklabels()
        for label in labels:
            box = label.get_window_extent(renderer)
            for extent, arrow in arrows:
                if extent.overlaps(box):
                    yield label.get_text(), arrow.get_zorder(), label


ROUTED = [c for c in COLLECTIVES if c != "all_to_all"]  # every arrow can go around the labels


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("collective", ROUTED)
def test_no_arrow_covers_a_label(collective, n):
    """Issue 9: arrowheads drawn over 'a2+b2' made it read 'a2+b7'. Arrows run between the boxes."""
    assert list(covered_labels(collectives_figure(collective, n))) == []
    walk = walkthrough(collective, n)
    for k in sorted({1, len(walk) // 2, len(walk) - 1} - {0}):  # the widget's picture, at its own scale
        fig = Figure()
        draw_single(fig, walk, k)
        assert [text for text, _, _ in covered_labels(fig)] == [], f"step {k}"


@pytest.mark.parametrize("n", [2, 4, 8])
def test_all_to_all_arrows_pass_under_the_labels(n):
    """All-to-all arrows must cross boxes, so each label they cross is drawn above them, on an opaque patch."""
    fig = Figure()
    draw_single(fig, walkthrough("all_to_all", n), 1)
    crossed = list(covered_labels(fig)) + list(covered_labels(collectives_figure("all_to_all", n)))
    assert crossed or n == 2  # the test looks at something
    for text, arrow_z, label in crossed:
        patch = label.get_bbox_patch()
        assert label.get_zorder() > arrow_z and patch is not None and patch.get_facecolor()[3] == 1, text


@pytest.mark.parametrize("collective", COLLECTIVES)
def test_stepper_text_is_readable_at_8_ranks(collective):
    """Issue 9: 7 px labels at 8 ranks. Every text of the widget's picture is >= 9 pt and fits its box."""
    walk = walkthrough(collective, 8)
    for k in range(len(walk)):
        fig = Figure()
        draw_single(fig, walk, k, caption=False)
        renderer = rendered(fig)
        ax = fig.axes[0]
        texts = (fig.texts + [fig._suptitle] + ax.texts + ax.get_xticklabels() + ax.get_yticklabels())
        small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_text() and t.get_fontsize() < 9]
        assert small == [], f"step {k}"
        boxes = [p.get_window_extent(renderer) for p in ax.patches if isinstance(p, FancyBboxPatch)]
        for t in ax.texts:
            extent = t.get_window_extent(renderer)
            assert any(b.x0 <= extent.x0 and extent.x1 <= b.x1 and b.y0 <= extent.y0 and extent.y1 <= b.y1
                       for b in boxes), f"step {k}: {t.get_text()!r} sticks out of its box"
        assert fig.get_figwidth() * DPI <= 900  # still fits a notebook's output area


def test_the_widget_explains_each_step_once():
    """Issue 9: the picture's caption, the text under it and each listed send all said what the step
    does. Now the picture has no caption and the text says it once, then lists the sends."""
    w = CollectivesWidget("all_reduce", 8)
    w.step()
    caption = w.transfers.value
    assert caption.count("adds") == 1 and caption.count("sends") == 1 + 8  # how, once; then each send
    assert w.step_label.value == "step 1 of 14" and "Step 1" not in caption  # the label numbers the step
    assert [t.get_text() for t in w._fig.texts if "Step" in t.get_text()] == []
    fig = collectives_figure("all_reduce", 8, step=1)  # the static picture keeps its caption
    assert any(t.get_text().startswith("Step 1 of 14") for t in fig.texts)
