"""`labsupport doctor --gpu` without a GPU: the plan of checks for 0, 1 and 2 GPUs, the skip line, and the
verdicts on CPU runs of the same settings (harness runs, shared with the strategy tests), planted
inequalities included. The GPU runs themselves happen only where `make gpu-check` finds GPUs."""
import copy
import json

import pytest
import torch

from labsupport import gpu_check
from labsupport.cli import main
from harness import single, train


def test_the_checks_that_fit_each_machine():
    assert gpu_check.checks(0) == []
    one = gpu_check.checks(1)
    assert [c.name for c in one] == ["single fp32", "single bf16", "single fp16"]
    assert all(c.nproc == 1 and c.argv[:2] == ("--strategy", "single") for c in one)
    assert [c.argv[c.argv.index("--dtype") + 1] for c in one] == ["fp32", "bf16", "fp16"]
    two = gpu_check.checks(2)
    assert two[:3] == one and [c.name for c in two[3:]] == ["ddp x2", "zero3 x2", "tp x2", "pp x2", "deepspeed x2"]
    assert all(c.nproc == 2 and c.argv[1] == c.name.split()[0] for c in two[3:])
    assert gpu_check.checks(8) == two


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="this machine has a GPU: make gpu-check runs the checks")
def test_without_a_gpu_it_says_it_skipped_and_succeeds(capsys):
    assert main(["doctor", "--gpu"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: skipped, no CUDA GPU here")
    assert main(["doctor", "--gpu", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == {"gpus": 0, "checks": []} and out.err.startswith("gpu-check: skipped")


def shifted(run, key, step, by):
    """A copy of `run` with `key`'s value at `step` (1-based) changed by `by` (relative for norms)."""
    out = copy.deepcopy(dict(run))
    out[key][step - 1] = out[key][step - 1] + by if key == "losses" else out[key][step - 1] * (1 + by)
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
def test_equality_with_single_holds_on_cpu_runs_and_fails_on_a_planted_difference():
    ref, ddp = single(), train("ddp", 2)
    assert gpu_check.equal_to_single(ddp, ref) == []
    assert gpu_check.equal_to_single(shifted(ddp, "losses", 4, 2e-4), ref) == [
        "loss differs from single's by 2.0e-04 at step 4 (tolerance 0.0001)"]
    problems = gpu_check.equal_to_single(shifted(ddp, "grad_norms", 7, 3e-4), ref)
    assert len(problems) == 1 and problems[0].startswith("gradient norm differs") and "at step 7" in problems[0]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_memory_and_mfu_verdicts_on_a_cpu_run():
    ref = single()
    off, line = gpu_check.memory_against_prediction(ref)
    assert off == [] and "allocator peak" in line
    planted = copy.deepcopy(dict(ref))
    planted["memory"][0]["activations"] = int(planted["memory"][0]["activations"] * 1.3)
    off, _ = gpu_check.memory_against_prediction(planted)
    assert len(off) == 1 and off[0].startswith("activations")
    problems, line = gpu_check.mfu_line(ref)   # a CPU's peak is measured, not a datasheet's
    assert problems == [f"no datasheet peak ({ref['peak_flops_source']})"] and line.startswith("MFU ")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_one_line_per_check_and_a_failed_run_is_a_failed_check(monkeypatch):
    """run_checks on CPU summaries standing in for the GPU runs: every check a line, the planted ddp
    and the strategy that does not start each FAIL, with the reason."""
    ref, ddp = single(), train("ddp", 2)
    runs = {"single fp32": ref, "single bf16": ref, "single fp16": ref, "ddp x2": shifted(ddp, "losses", 2, 1e-3),
            "zero3 x2": ddp, "tp x2": ddp, "pp x2": ddp}

    def fake_train(check):
        if check.name not in runs:
            raise RuntimeError("labsupport train: error: unknown strategy")
        return runs[check.name]
    monkeypatch.setattr(gpu_check, "train", fake_train)
    lines = []
    results = gpu_check.run_checks(2, out=lines.append)
    assert [r["ok"] for r in results] == [False, False, False, False, True, True, True, False]
    assert len(lines) == len(gpu_check.checks(2)) + 1
    by_name = {line[5:18].strip(): line for line in lines[:-1]}
    assert by_name["zero3 x2"].startswith("ok   zero3 x2") and "equal to single fp32" in by_name["zero3 x2"]
    assert by_name["ddp x2"].startswith("FAIL ddp x2")
    assert "loss differs from single's by 1.0e-03 at step 2" in by_name["ddp x2"]
    assert by_name["deepspeed x2"] == "FAIL deepspeed x2  did not run: labsupport train: error: unknown strategy"
    assert by_name["single fp32"].startswith("FAIL") and "no datasheet peak" in by_name["single fp32"]
    assert lines[-1] == "gpu-check: 3 of 8 checks held on 2 GPU(s)"
