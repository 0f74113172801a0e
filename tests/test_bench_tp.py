"""`labsupport bench tp`: our tensor parallelism against DTensor's, without and with sequence
parallelism, in one run. No test asserts a time."""
import json
import math

import pytest

from conftest import cli, run_cli


@pytest.mark.multiprocess
def test_bench_tp_races_ours_against_dtensor_and_measures_memory_per_rank():
    res = run_cli("bench", "tp", "--nproc", "2", "--model", "nano", "--global-batch", "4", "--repeats", "2", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    rows = {r["name"]: r for r in out["rows"]}
    assert [(r["name"], r["impl"], r["sequence_parallel"], r["tp"]) for r in out["rows"]] == [
        ("tp", "ours", False, 2), ("torch-tp", "reference", False, 2),
        ("tp+sp", "ours", True, 2), ("torch-tp+sp", "reference", True, 2)]
    assert set(out["ratios"]) == {"tp/torch-tp", "tp+sp/torch-tp+sp"}
    assert out["ratio"] == out["ratios"]["tp/torch-tp"]
    for pair, ratio in out["ratios"].items():
        assert 0 < ratio and math.isfinite(ratio), pair
        ours, reference = pair.split("/")
        assert rows[ours]["ratio"] == ratio and rows[reference]["ratio"] == 1.0
    for r in out["rows"]:
        assert len(r["memory"]) == 2 and all(m["params"] > 0 and m["activations"] > 0 for m in r["memory"]), r
    for ours, reference in (("tp", "torch-tp"), ("tp+sp", "torch-tp+sp")):  # the same cut: the same shards
        assert [m["params"] for m in rows[ours]["memory"]] == [m["params"] for m in rows[reference]["memory"]]
    plain, sp = rows["tp"]["memory"][0]["activations"], rows["tp+sp"]["memory"][0]["activations"]
    assert sp < plain, "sequence parallelism shards the activations between the parallel regions"
    assert "ratio tp+sp/torch-tp+sp" in res.stderr and "torch-tp+sp" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--nproc", "1"], "bench tp needs --nproc 2 or more"),
    (["--nproc", "8", "--model", "nano", "--global-batch", "8"], "--tp 8 must divide the model's heads (4)"),
    (["--bucket-sweep", "1,2"], "--bucket-sweep is for bench ddp"),
])
def test_bench_tp_refuses_bad_arguments_in_one_line(args, message):
    res = cli("bench", "tp", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
