"""`labsupport bench launch`: a fresh launch against a pool cell, in one run. No test asserts a time."""
import json

import pytest

from labsupport.bench import launch as bench_launch
from conftest import cli, processes_of, run_cli


@pytest.mark.multiprocess
def test_bench_launch_reports_pool_start_cell_and_fresh_launch():
    res = run_cli("bench", "launch", "--nproc", "2", "--repeats", "1", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert [(r["name"], r["impl"], r["samples"]) for r in out["rows"]] == [
        ("pool start", "ours", 1),
        ("pool cell", "ours", bench_launch.CELLS_PER_ROUND),
        ("fresh launch", "reference", 1),
    ]
    assert all(r["seconds"] > 0 for r in out["rows"]) and out["ratio"] > 0
    assert out["benchmark"] == "launch" and out["nproc"] == 2
    assert processes_of(out["run_dir"]) == []


def test_summary_takes_medians_and_the_ratio_of_pool_cell_to_launch():
    out = bench_launch.summarize({"pool start": [3.0], "pool cell": [0.01, 0.5, 0.02], "fresh launch": [5.0, 4.0, 6.0]})
    assert {r["name"]: r["seconds"] for r in out["rows"]} == {"pool start": 3.0, "pool cell": 0.02, "fresh launch": 5.0}
    assert out["ratio"] == pytest.approx(0.02 / 5.0)


def test_bad_bench_launch_options_fail_before_starting_anything():
    res = cli("bench", "launch", "--nproc", "1")
    assert res.returncode == 2 and "needs --nproc 2 or more" in res.stderr and "Traceback" not in res.stderr
    res = cli("bench", "launch", "--repeats", "0")
    assert res.returncode == 2 and "--repeats must be >= 1" in res.stderr
