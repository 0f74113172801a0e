"""`labsupport bench zero`: our ZeRO-3 and ZeRO-1 against torch's in one run. No test asserts a time."""
import json
import math

import pytest

from conftest import cli, run_cli


@pytest.mark.multiprocess
def test_bench_zero_races_each_stage_against_torch_and_measures_memory_per_rank():
    res = run_cli("bench", "zero", "--nproc", "2", "--model", "nano", "--global-batch", "4", "--repeats", "2", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    rows = {r["name"]: r for r in out["rows"]}
    assert [(r["name"], r["impl"]) for r in out["rows"]] == [
        ("zero3", "ours"), ("torch-fsdp", "reference"), ("zero1", "ours"), ("torch-zero1", "reference")]
    assert set(out["ratios"]) == {"zero3/torch-fsdp", "zero1/torch-zero1"}
    assert out["ratio"] == out["ratios"]["zero3/torch-fsdp"]
    for pair, ratio in out["ratios"].items():
        assert 0 < ratio and math.isfinite(ratio), pair
        assert rows[pair.split("/")[0]]["ratio"] == ratio and rows[pair.split("/")[1]]["ratio"] == 1.0
    for r in out["rows"]:
        assert len(r["memory"]) == 2 and all(m["params"] > 0 and m["activations"] > 0 for m in r["memory"]), r
    full = rows["zero1"]["memory"][0]["params"]  # zero1 replicates the parameters
    for name in ("zero3", "torch-fsdp"):  # both shard them: half each, within the padding
        assert all(abs(m["params"] - full / 2) <= 0.005 * full for m in rows[name]["memory"]), name
    assert "ratio zero1/torch-zero1" in res.stderr and "torch-fsdp" in res.stderr


def test_bench_zero_refuses_one_rank_and_a_bucket_sweep():
    res = cli("bench", "zero", "--nproc", "1")
    assert res.returncode == 2 and "bench zero needs --nproc 2 or more" in res.stderr and "Traceback" not in res.stderr
    res = cli("bench", "zero", "--bucket-sweep", "1,2")
    assert res.returncode == 2 and "--bucket-sweep is for bench ddp" in res.stderr


@pytest.mark.multiprocess
def test_bench_zero_against_deepspeed_races_its_zero1_and_zero3():
    res = run_cli("bench", "zero", "--against", "deepspeed", "--nproc", "2", "--model", "nano", "--global-batch", "4",
                  "--repeats", "2", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    assert [(r["name"], r["impl"]) for r in out["rows"]] == [
        ("zero3", "ours"), ("deepspeed-zero3", "reference"), ("zero1", "ours"), ("deepspeed-zero1", "reference")]
    assert set(out["ratios"]) == {"zero3/deepspeed-zero3", "zero1/deepspeed-zero1"} and out["against"] == "deepspeed"
    assert out["ratio"] == out["ratios"]["zero3/deepspeed-zero3"] and math.isfinite(out["ratio"])
    rows = {r["name"]: r for r in out["rows"]}
    full = rows["zero1"]["memory"][0]["params"]
    assert all(abs(m["params"] - full / 2) <= 0.01 * full for m in rows["deepspeed-zero3"]["memory"])
    assert "zero3 vs DeepSpeed ZeRO-3" in res.stderr


def test_bench_against_is_for_bench_zero():
    res = cli("bench", "ddp", "--against", "deepspeed")
    assert res.returncode == 2 and "--against is for bench zero" in res.stderr and "Traceback" not in res.stderr
