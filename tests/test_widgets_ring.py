"""The ring-attention stepper shows ring attention's schedule as `parallel/context.py` runs it: the
blocks each rank holds, the score blocks it computes or skips, the online softmax's running max and
sum; its picture reads at 4 ranks. No ranks: the library's own block rule is called in this process."""
import math

import pytest

pytest.importorskip("ipywidgets")

from figures import figure_defects, rendered  # noqa: E402
from labsupport.parallel.context import _visible_blocks, positions  # noqa: E402
from labsupport.widgets.figure import DPI  # noqa: E402
from labsupport.widgets.figure import NotebookFigure  # noqa: E402
from labsupport.widgets.ring import (RingWidget, _score, draw, online_softmax_trace, ring_figure,  # noqa: E402
                                     ring_walkthrough, state_lines)

SPLITS = [(cp, balanced) for cp in (2, 3, 4) for balanced in (False, True)]


@pytest.mark.parametrize("cp, balanced", SPLITS)
def test_each_rank_computes_the_blocks_the_library_computes(cp, balanced):
    """Per rank and step, the widget's blocks are `_visible_blocks` of the library's positions."""
    walk = ring_walkthrough(cp, balanced)
    seq = 4 * cp
    for step in range(cp):
        for r in range(cp):
            owner = walk.held[step][r]
            assert owner == (r - step) % cp
            library = _visible_blocks(positions(seq, r, cp, balanced), positions(seq, owner, cp, balanced), balanced)
            mine = [b for b in walk.blocks[step] if b.rank == r]
            assert len(mine) == len(library), (step, r)
            assert sorted(b.causal for b in mine) == sorted(causal for _, _, causal in library)


@pytest.mark.parametrize("cp, balanced", SPLITS)
def test_every_visible_block_is_computed_once_and_no_hidden_one(cp, balanced):
    walk = ring_walkthrough(cp, balanced)
    n = walk.n_chunks
    done = [(b.q_chunk, b.k_chunk) for step in walk.blocks for b in step]
    assert sorted(done) == [(q, k) for q in range(n) for k in range(q + 1)]
    assert sum(map(sum, walk.skipped)) == n * (n - 1) // 2  # the hidden half, each pair once


def test_the_plain_split_idles_ranks_and_the_balanced_one_does_not():
    plain, balanced = ring_walkthrough(4, False), ring_walkthrough(4, True)
    assert [plain.computed(r) for r in range(4)] == [1, 2, 3, 4]
    assert [balanced.computed(r) for r in range(4)] == [9] * 4
    assert [plain.share(r) for r in range(4)] == [1 / 16, 2 / 16, 3 / 16, 4 / 16]
    last = state_lines(plain, 3)
    assert all("idle" in line for line in last[:3]) and "idle" not in last[3]
    assert not any("idle" in line for k in range(4) for line in state_lines(balanced, k))


@pytest.mark.parametrize("cp, balanced", SPLITS)
def test_the_running_max_and_sum_end_at_the_rows_log_sum_exp(cp, balanced):
    walk = ring_walkthrough(cp, balanced)
    for r in range(cp):
        trace = online_softmax_trace(walk, r)
        query = trace[-1]["query"]
        scores = [_score(query, key) for key in range(query + 1)]
        final = trace[-1]["m"] + math.log(trace[-1]["l"])
        assert final == pytest.approx(math.log(sum(math.exp(s) for s in scores)), rel=1e-12)
        assert sum(t["keys"] for t in trace) == query + 1
        assert trace[-1]["m"] == max(scores)
        for before, t in zip(trace, trace[1:]):  # a step that sees no key leaves m and l as they were
            if t["keys"] == 0:
                assert (t["m"], t["l"]) == (before["m"], before["l"])


def test_stepping_back_and_reset_and_the_menus():
    w = RingWidget(4, balanced=False)
    assert w.k == 0 and w.step_label.value == "step 1 of 4" and w.back_button.disabled
    texts = [w.state_text()]
    for _ in range(5):
        w.step()
        texts.append(w.state_text())
    assert w.k == 3 and w.step_button.disabled
    assert texts[:4] == ["\n".join(state_lines(w.walk, k)) for k in range(4)] and texts[4] == texts[3]
    w.back()
    assert w.k == 2
    w.reset()
    assert w.k == 0
    w.step_button.click()
    assert w.k == 1
    w.select(balanced=True)
    assert w.k == 0 and w.walk.balanced and w.split_menu.value is True
    w.ranks_menu.value = 2
    assert w.walk.cp == 2 and w.play.max == 1
    w.select(cp=7)
    assert w.walk.cp == 7 and 7 in w.ranks_menu.options
    for name in ("labsupport-ring", ):
        assert name in w.widget._dom_classes
    assert "labsupport-ring-state" in w.readout._dom_classes and "labsupport-ring-figure" in w.image._dom_classes


# JupyterLab's output area in a 1280-px window with the file browser open (JupyterLab 4, Chromium), measured with
# tests/browser.py: the ring widget's picture of 850 px ran 2 px past it (issue 28 saw 4 px).
OUTPUT_AREA_PX = 848


@pytest.mark.parametrize("balanced", [False, True])
def test_the_picture_reads_at_4_ranks(balanced):
    """Every text >= 9 pt, none cut off or on top of another, and the picture, the widget's (without the state
    lines, shown under it as text) and the static one, narrower than JupyterLab's output area: shown at its size."""
    for step in range(4):
        fig = ring_figure(4, balanced, step)
        rendered(fig)
        assert figure_defects(fig) == [], step
        texts = fig.texts + [t for ax in fig.axes for t in ax.texts + ax.get_xticklabels() + ax.get_yticklabels()]
        assert min(t.get_fontsize() for t in texts if t.get_text()) >= 9
        widget_picture = NotebookFigure()
        draw(widget_picture, ring_walkthrough(4, balanced), step, text=False)
        assert figure_defects(widget_picture) == [], step
        assert max(fig.get_figwidth(), widget_picture.get_figwidth()) * DPI <= OUTPUT_AREA_PX - 20


def test_a_wider_picture_is_scaled_to_the_output_area_not_cut():
    """At 8 ranks, balanced, the picture is wider than the output area: the image may not be wider than its box
    (max-width 100 %), has no margin to push it past the edge, and no fixed width; as the planner's and the rank
    grid's pictures, it is not stretched by the VBox either (align_self)."""
    w = RingWidget(8, balanced=True)
    assert ring_figure(8, True, 0).get_figwidth() * DPI > OUTPUT_AREA_PX
    layout = w.image.layout
    assert (layout.max_width, layout.margin, layout.align_self, layout.width) == ("100%", "0", "flex-start", None)


def test_the_picture_shows_this_steps_blocks_solid_and_the_idle_ranks():
    fig = ring_figure(4, False, 3)
    matrix, load = fig.axes
    assert [t.get_text() for t in matrix.texts] == ["r3"]  # only rank 3 computes at the last step
    assert sum("idle this step" in t.get_text() for t in load.texts) == 3
    assert fig._repr_png_()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="step must be from 0 to 3"):
        ring_figure(4, False, 4)
