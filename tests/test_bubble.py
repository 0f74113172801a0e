"""`labsupport bubble`: the simulated pipeline, its bubble beside the formula, and one-line mistakes."""
import json

import pytest

from conftest import run_cli
from labsupport.cli import main


def bubble(capsys, *args):
    code = main(["bubble", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def bubble_json(capsys, *args):
    code, out, _ = bubble(capsys, *args, "--json")
    assert code == 0
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("schedule, chunks, over_ideal", [("gpipe", 1, 3 / 8), ("1f1b", 1, 3 / 8),
                                                          ("interleaved", 2, 3 / 16)])
def test_json_has_the_contract_keys_and_the_papers_bubble(capsys, schedule, chunks, over_ideal):
    result = bubble_json(capsys, "--stages", 4, "--microbatches", 8, "--schedule", schedule, "--chunks", chunks,
                         "--timeline")
    assert result["bubble_over_ideal"] == pytest.approx(over_ideal)
    assert result["bubble_fraction"] == pytest.approx(over_ideal / (1 + over_ideal))
    assert len(result["timeline"]) == len(result["peak_inflight_microbatches"]) == len(result["busy"]) == 4
    assert result["busy"][0] + result["idle"][0] == pytest.approx(result["total_time"])
    start, end, op, microbatch, chunk = result["timeline"][0][0]
    assert (start, op, microbatch, chunk) == (0.0, "F", 0, 0)
    assert end == pytest.approx(1 / chunks)


def test_peak_inflight_tells_gpipe_from_1f1b(capsys):
    gpipe = bubble_json(capsys, "--stages", 4, "--microbatches", 8, "--schedule", "gpipe")
    one_f_one_b = bubble_json(capsys, "--stages", 4, "--microbatches", 8)
    assert gpipe["peak_inflight_microbatches"] == [8, 8, 8, 8]
    assert one_f_one_b["peak_inflight_microbatches"] == [4, 3, 2, 1]


def test_interleaved_defaults_to_two_chunks_and_backward_ratio_moves_no_bubble(capsys):
    assert bubble_json(capsys, "--stages", 2, "--microbatches", 4, "--schedule", "interleaved")["chunks"] == 2
    result = bubble_json(capsys, "--stages", 2, "--microbatches", 4, "--backward-ratio", 3)
    assert result["bubble_over_ideal"] == pytest.approx(1 / 4)
    assert result["total_time"] == pytest.approx((4 + 1) * (1 + 3))


def test_human_output_is_a_table_with_the_formula(capsys):
    code, out, _ = bubble(capsys, "--stages", 4, "--microbatches", 8)
    assert code == 0
    assert len([line for line in out.splitlines() if line.split()[:1] in (["0"], ["1"], ["2"], ["3"])]) == 4
    assert "(p-1)/(v*m) = 0.375" in out and "idle/busy 0.375" in out


def test_the_1t_runs_pipeline_meets_the_formula_and_its_json_holds_the_table(capsys):
    """The 1T run's pipeline (64 stages, 1600 micro-batches per replica): the bubble (p-1)/m exactly, at
    most p - s micro-batches in flight. Its JSON holds the table's figures, not its 200,000 spans (6 MB,
    most of the command's time; --timeline adds them). tests/test_schedules.py counts the simulation's work."""
    code, out, _ = bubble(capsys, "--stages", 64, "--microbatches", 1600, "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and len(out) < 5000 and "timeline" not in result
    assert result["bubble_over_ideal"] == pytest.approx(63 / 1600)
    assert result["peak_inflight_microbatches"] == list(range(64, 0, -1))
    assert len(result["busy"]) == len(result["idle"]) == 64


def test_timeline_asks_for_json(capsys):
    code, out, err = bubble(capsys, "--stages", 2, "--microbatches", 4, "--timeline")
    assert code == 2 and out == "" and err.strip() == ("labsupport bubble: error: --timeline adds the spans "
                                                       "to the JSON: use it with --json")


@pytest.mark.parametrize("args, message", [
    (("--stages", 0, "--microbatches", 4), "stages must be at least 1"),
    (("--stages", 4, "--microbatches", 6, "--schedule", "interleaved"), "try 8"),
    (("--stages", 4, "--microbatches", 8, "--schedule", "interleaved", "--chunks", 1), "at least 2 chunks"),
    (("--stages", 4, "--microbatches", 8, "--chunks", 2), "use interleaved"),
    (("--stages", 4, "--microbatches", 8, "--backward-ratio", 0), "must be positive"),
])
def test_mistakes_are_one_line_and_exit_2(capsys, args, message):
    code, out, err = bubble(capsys, *args)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and message in err and err.startswith("labsupport bubble: error:")


def test_from_the_shell_a_mistake_has_no_traceback():
    res = run_cli("bubble", "--stages", 3, "--microbatches", 4, "--schedule", "interleaved")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == ["labsupport bubble: error: interleaved needs micro-batches "
                                               "divisible by stages (4 % 3 != 0); try 6"]
