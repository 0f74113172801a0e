"""`labsupport bench cp`: ring attention on N ranks against dense attention on one, at growing
sequence lengths, time and the bytes kept for backward per rank. No test asserts a time."""
import json
import math

import pytest

from conftest import cli
from labsupport.estimate.context import attention_memory


@pytest.mark.multiprocess
def test_bench_cp_races_the_ring_against_dense_attention_over_sequence_lengths():
    res = cli("bench", "cp", "--nproc", "2", "--model", "nano", "--global-batch", "1", "--repeats", "1", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout.splitlines()[-1])
    lengths = [64, 256, 1024]  # nano's seq_len times 1, 4, 16
    assert [(r["name"], r["impl"], r["seq_len"]) for r in out["rows"]] == [
        (name, impl, s) for s in lengths for name, impl in (("dense", "reference"), ("ring", "ours"))]
    rows = {(r["name"], r["seq_len"]): r for r in out["rows"]}
    for s in lengths:
        dense, ring = rows["dense", s], rows["ring", s]
        assert math.isfinite(ring["ratio"]) and ring["ratio"] > 0 and dense["ratio"] == 1.0
        assert out["ratios"][str(s)] == ring["ratio"]
        # what autograd keeps: dense's fused kernel and the ring keep q, k, v, output and lse; the ring half of them
        assert dense["memory"]["activations"] == attention_memory(s, 1, 64, 4, cp=1, dtype_bytes=4)["saved"]
        assert ring["memory"]["activations"] == attention_memory(s, 1, 64, 4, cp=2, dtype_bytes=4)["saved"]
        assert ring["memory"]["activations"] * 2 == dense["memory"]["activations"]
        assert ring["memory"]["predicted"] == attention_memory(s, 1, 64, 4, cp=2, dtype_bytes=4)["total"]
    assert out["ratio"] == rows["ring", 1024]["ratio"]
    assert "the ring on 2 ranks is" in res.stderr and "seq_len" in res.stderr


@pytest.mark.parametrize("args, message", [
    (["--nproc", "1"], "bench cp needs --nproc 2 or more"),
    (["--nproc", "3", "--model", "nano"],
     "the sequence length 64 does not split into 2 x cp = 6 chunks (the balanced split); use a multiple of 6"),
    (["--sizes", "64,102"],
     "the sequence length 102 does not split into 2 x cp = 4 chunks (the balanced split); use a multiple of 4"),
    (["--sizes", "64,1k"], "--sizes 64,1k: give sequence lengths as whole numbers, e.g. 1024,4096"),
    (["--model", "22b"], "--model 22b is an analysis shape; use a CPU preset: nano, micro, mini, llama-micro"),
])
def test_bench_cp_refuses_bad_arguments_in_one_line(args, message):
    res = cli("bench", "cp", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
