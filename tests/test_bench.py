"""`labsupport bench`: the contract (rows, ratio) and what the summary computes. No test asserts a time."""
import json

import pytest

from labsupport.bench import collectives
from conftest import cli, run_cli


@pytest.mark.multiprocess
def test_bench_collectives_reports_rows_fits_and_ratio():
    res = run_cli("bench", "collectives", "--nproc", "2", "--sizes", "4096,65536", "--repeats", "2", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    ops = {(r["op"], r["impl"]) for r in out["rows"]}
    assert {("all_reduce", "ours"), ("all_reduce", "reference"), ("all_gather", "ours"), ("broadcast", "reference")} <= ops
    assert all(r["seconds"] > 0 and r["busbw_GBps"] > 0 for r in out["rows"])
    assert out["ratio"] > 0 and out["headline"].endswith("65536 bytes") and out["backend"] == "gloo"
    assert "all_reduce/ours" in out["fits"]


def test_summary_bandwidths_and_ratio_from_known_timings():
    rows = [{"op": "all_reduce", "impl": impl, "bytes": b, "seconds": s}
            for impl, b, s in [("ours", 1000, 2e-3), ("reference", 1000, 1e-3),
                               ("ours", 2**24, 0.04), ("reference", 2**24, 0.032)]]
    out = collectives.summarize({"rows": rows, "backend": "gloo"}, nproc=4)
    assert out["ratio"] == pytest.approx(0.04 / 0.032)
    big = next(r for r in out["rows"] if r["impl"] == "ours" and r["bytes"] == 2**24)
    assert big["algbw_GBps"] == pytest.approx(2**24 / 0.04 / 1e9)
    assert big["busbw_GBps"] == pytest.approx(big["algbw_GBps"] * 2 * 3 / 4)  # nccl-tests factor 2(n-1)/n


def test_measure_warms_every_size_then_interleaves_them(monkeypatch):
    """Issue 9: sizes timed one after the other made the first, 4 KiB, pay for the start of the run
    (~6x slower than 16 KiB). Every size is warmed before any is timed, then rounds visit them shuffled."""
    import labsupport.bench

    calls = []

    def fake_cases(size):  # what measure() times, without ranks: each "function" names its size
        return {op: {"ours": size, "reference": size} for op in ("all_reduce", "broadcast")}

    def fake_alternate(impls, repeats, sync):
        size = next(iter(impls.values()))
        calls.append((size, repeats))
        return {name: [size * 1e-9] * repeats for name in impls}

    monkeypatch.setattr(collectives, "_cases", fake_cases)
    monkeypatch.setattr(labsupport.bench, "alternate", fake_alternate)
    sizes, repeats = [4096, 16384, 65536, 262144], 4
    rows = collectives.measure(sizes, repeats)
    warm, timed = calls[:2 * len(sizes)], calls[2 * len(sizes):]
    assert sorted({s for s, _ in warm}) == sizes and {r for _, r in warm} == {collectives.WARMUP}
    assert len(timed) == 2 * len(sizes) * repeats and {r for _, r in timed} == {collectives.PER_VISIT}
    rounds = [[s for s, _ in timed[i:i + 2 * len(sizes):2]] for i in range(0, len(timed), 2 * len(sizes))]
    assert all(sorted(r) == sizes for r in rounds) and any(r != sizes for r in rounds)
    assert len(rows) == 2 * 2 * len(sizes) and all(r["seconds"] == r["bytes"] * 1e-9 for r in rows)


def test_bad_bench_options_fail_before_launch():
    res = cli("bench", "collectives", "--nproc", "1")
    assert res.returncode == 2 and "needs --nproc 2 or more" in res.stderr and "Traceback" not in res.stderr
    res = cli("bench", "collectives", "--sizes", "4097")
    assert res.returncode == 2 and "multiples of 4" in res.stderr


@pytest.mark.multiprocess
def test_bench_ddp_compares_every_mode_with_torch_ddp():
    res = run_cli("bench", "ddp", "--nproc", "2", "--model", "nano", "--global-batch", "8", "--repeats", "2",
                  "--bucket-sweep", "0.05", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    names = [r["name"] for r in out["rows"]]
    assert names == ["naive", "flat", "bucketed", "torch-ddp", "bucketed@0.05MB"]
    bucketed = next(r for r in out["rows"] if r["name"] == "bucketed")
    assert out["ratio"] == bucketed["ratio"] > 0
    assert next(r for r in out["rows"] if r["name"] == "torch-ddp")["ratio"] == 1.0


def test_bench_ddp_refuses_an_analysis_model():
    res = cli("bench", "ddp", "--model", "175b")
    assert res.returncode == 2 and "analysis shape" in res.stderr
