"""`labsupport bench pp`: our pipeline executor against torch.distributed.pipelining, same schedule,
in one run. No test asserts a time."""
import json
import math

import pytest

from conftest import cli, run_cli


@pytest.mark.multiprocess
def test_bench_pp_races_each_schedule_against_torch_and_measures_memory_per_rank():
    res = run_cli("bench", "pp", "--nproc", "2", "--model", "nano", "--global-batch", "8", "--microbatches", "4",
                  "--repeats", "2", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    rows = {r["name"]: r for r in out["rows"]}
    assert [(r["name"], r["impl"], r["schedule"], r["pp"], r["microbatches"]) for r in out["rows"]] == [
        ("1f1b", "ours", "1f1b", 2, 4), ("torch-1f1b", "reference", "1f1b", 2, 4),
        ("gpipe", "ours", "gpipe", 2, 4), ("torch-gpipe", "reference", "gpipe", 2, 4)]
    assert out["ratio"] == out["ratios"]["1f1b/torch-1f1b"] and set(out["ratios"]) == {"1f1b/torch-1f1b",
                                                                                        "gpipe/torch-gpipe"}
    for pair, ratio in out["ratios"].items():
        assert 0 < ratio and math.isfinite(ratio), pair
    for ours, reference in (("1f1b", "torch-1f1b"), ("gpipe", "torch-gpipe")):  # the same stages
        assert [m["params"] for m in rows[ours]["memory"]] == [m["params"] for m in rows[reference]["memory"]]
    first_stage = {name: r["memory"][0]["activations"] for name, r in rows.items()}
    assert first_stage["1f1b"] < first_stage["gpipe"], "1F1B keeps p - s micro-batches in flight, GPipe all m"


@pytest.mark.parametrize("args, message", [
    (["--nproc", "1"], "bench pp needs --nproc 2 or more"),
    (["--nproc", "2", "--microbatches", "3"], "--microbatches 3 must divide the 16 sequences"),
    (["--nproc", "3"], "pipeline chunks must divide the model's 4 layers"),
    (["--bucket-sweep", "1,2"], "--bucket-sweep is for bench ddp"),
])
def test_bench_pp_refuses_bad_arguments_in_one_line(args, message):
    res = cli("bench", "pp", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_microbatches_belong_to_bench_pp_only():
    res = cli("bench", "tp", "--microbatches", "2")
    assert res.returncode == 2 and "--microbatches is for bench pp" in res.stderr, res.stderr
