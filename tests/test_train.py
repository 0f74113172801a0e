"""The training loop through `labsupport train`: JSON contract, learning, memory, checkpoints, bad input."""
import json
import os
import signal
import subprocess
import sys
import time
from argparse import Namespace

import pytest
import torch

from labsupport import checkpoint, loop, train
from labsupport.estimate.params import count_params
from labsupport.model import PRESETS
from labsupport.train import build_parser, lr_at
import harness
from conftest import cli, run_cli
from harness import resume_from, single

NANO = ["--model", "nano", "--global-batch", "8", "--sample-chars", "40", "--eval-batches", "1"]


@pytest.mark.multiprocess
def test_single_run_reports_the_contract_and_learns():
    out = harness.train("single", 1, "--steps", "40", "--lr", "3e-3", settings=NANO)
    for key in ("strategy", "world_size", "model", "n_params", "losses", "tokens_per_s", "memory", "comm", "run_dir"):
        assert key in out
    assert out["strategy"] == "single" and out["world_size"] == 1
    assert out["model"] == {"name": "nano", "n_layers": 2, "hidden": 64, "heads": 4, "vocab": out["model"]["vocab"],
                            "seq_len": 64}
    assert len(out["losses"]) == 40
    assert sum(out["losses"][-5:]) / 5 < 0.8 * out["losses"][0]
    mem = out["memory"][0]
    cfg = PRESETS["nano"].with_vocab(out["model"]["vocab"])
    assert out["n_params"] == count_params(cfg)            # as published counts go: no vocabulary padding
    assert mem["params"] == 4 * count_params(cfg, padded=True)  # fp32, tied head once, padding rows held
    assert mem["grads"] == mem["params"]
    # Adam's m and v, plus a 4-byte step counter per parameter tensor (28 tensors in nano)
    assert mem["optimizer"] == 2 * mem["params"] + 4 * 28
    assert mem["activations"] > 0 and mem["peak"] >= sum(mem[k] for k in ("params", "grads", "optimizer"))
    assert out["comm"] == [{}] and out["comm_groups"] == [{}]  # one device: nothing to communicate
    assert len(out["grad_norms"]) == 40 and all(n > 0 for n in out["grad_norms"])
    assert out["tokens_per_s"] > 0 and isinstance(out["sample"], str) and len(out["sample"]) == 40
    metrics = [json.loads(line) for line in open(os.path.join(out["run_dir"], "metrics-rank0.jsonl"))]
    assert [m["step"] for m in metrics] == list(range(40)) and metrics[-1]["memory"] == mem


def test_lr_schedule_warms_up_then_decays_to_min():
    args = Namespace(lr=1.0, min_lr=0.1, warmup=10, steps=100)
    assert lr_at(0, args) == pytest.approx(0.1) and lr_at(9, args) == pytest.approx(1.0)
    assert lr_at(55, args) == pytest.approx(0.55) and lr_at(100, args) == pytest.approx(0.1)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_killed_run_resumes_bit_identically(tmp_path):
    full = harness.train("single", 1, "--steps", "120", "--checkpoint-every", "10", settings=NANO)

    ckpt = tmp_path / "b"
    cmd = [sys.executable, "-m", "labsupport.cli", "train", *map(str, full.argv), "--checkpoint-dir", str(ckpt)]
    victim = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240  # a bound against a hang, not a speed check
    while checkpoint.latest(ckpt) is None:
        assert time.monotonic() < deadline and victim.poll() is None
        time.sleep(0.02)
    os.killpg(victim.pid, signal.SIGKILL)  # the whole launch, mid-run, no cleanup
    victim.wait()
    killed_at = checkpoint.latest(ckpt)
    assert killed_at < 120, "the run finished before it could be killed"

    resumed = resume_from(full, ckpt, tmp_path)
    assert resumed["resumed_from"] == killed_at
    assert resumed["losses"] == full["losses"]  # bit-identical, not approximately equal


def test_an_unfinished_checkpoint_is_ignored(tmp_path):
    checkpoint.save(tmp_path, 10, 0, {"x": torch.ones(2)}, barrier=lambda: None)
    half = checkpoint.step_dir(tmp_path, 20)
    half.mkdir()
    (half / ".rank0.pt.tmp123").write_bytes(b"\x80\x02truncated")  # crashed mid-write, never renamed
    assert checkpoint.latest(tmp_path) == 10
    assert torch.equal(checkpoint.load(tmp_path, 10, 0)["x"], torch.ones(2))


@pytest.mark.parametrize("args, message", [
    (["--strategy", "nope"], "unknown strategy 'nope'"),
    (["--model", "gpt9"], "unknown model preset 'gpt9'"),
    (["--model", "175b"], "is an analysis shape"),
    (["--global-batch", "6", "--micro-batch", "4"], "--global-batch 6 must be divisible"),
    (["--nproc", "2"], "strategy 'single' runs on one rank"),
    (["--data", "/no/such/file.txt"], "/no/such/file.txt"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--steps", "0"], "--steps must be >= 1"),
])
def test_bad_train_arguments_fail_fast_with_one_line(args, message, tmp_path):
    res = cli("train", *args, "--run-dir", tmp_path / "run")
    assert res.returncode == 2 and message in res.stderr, res.stderr
    assert res.stderr.count("\n") == 1 and "Traceback" not in res.stderr
    assert not (tmp_path / "run").exists(), "refused before any rank started"


def test_a_refusal_is_the_process_exit_status_and_one_line(tmp_path):
    """Refusals elsewhere, and the harness's runs, call the CLI's `main` in the test's process; the
    command itself exits 2 with the same one line, and no traceback."""
    res = run_cli("train", "--strategy", "ddp", "--nproc", "2", "--bucket-mb", "0", "--run-dir", tmp_path / "run")
    assert res.returncode == 2 and res.stderr == "labsupport train: error: DDP: --bucket-mb must be > 0, got 0\n", res.stderr
    assert res.stdout == "" and not (tmp_path / "run").exists()


def test_several_mistakes_get_a_line_each():
    res = cli("train", "--strategy", "ddp", "--nproc", "2", "--pp", "2", "--bucket-mb", "0")
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 2, res.stderr
    assert "strategy 'ddp' is data parallelism, but this grid has --dp 1" in lines[0]
    assert "--bucket-mb must be > 0" in lines[1]


@pytest.mark.multiprocess
def test_resume_on_another_layout_is_refused_before_start(tmp_path):
    ckpt = single().checkpoint_dir  # the strategy files' reference run (read here, never written)
    assert checkpoint.layout(ckpt, 20) == {"strategy": "single", "dp": 1, "tp": 1, "pp": 1, "zero": 0, "world_size": 1}
    res = cli("train", "--strategy", "ddp", "--nproc", "2", *NANO, "--steps", "8", "--checkpoint-dir", ckpt,
                  "--resume", "--run-dir", tmp_path / "run")
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert ("written by single on 1 rank(s) (dp 1, tp 1, pp 1, zero 0), this run is ddp on 2 rank(s) "
            "(dp 2, tp 1, pp 1, zero 0)") in res.stderr
    assert not (tmp_path / "run").exists()


def test_a_rank_of_run_trains_what_was_checked_and_checks_nothing(tmp_path, monkeypatch, capsys):
    """run() checks the options once and hands the ranks the result (CHECKED_ENV): a rank (loop.main)
    neither parses its command line nor validates nor builds the parallel configuration again. It starts by
    saying what trains, then how the global batch is made: two lines that fit an output area (issue 28)."""
    args = build_parser().parse_args([*NANO, "--steps", "2", "--sample-chars", "0", "--seq-len", "32"])
    model, config = train.validate(args, 1)
    checked = train.dump_checked(args, model, config)
    assert train.load_checked(checked) == (args, model, config)

    def refuse(*_, **__):
        raise AssertionError("a rank of run() must not parse, validate or build the configuration again")
    for module, name in ((train, "build_parser"), (train, "validate"), (train, "parallel_config"), (loop, "validate")):
        monkeypatch.setattr(module, name, refuse)
    monkeypatch.setenv(train.CHECKED_ENV, checked)
    monkeypatch.setenv("LABSUPPORT_RUN_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "argv", ["labsupport.loop", "--strategy", "nope"])
    assert loop.main() == 0  # the command line is not read
    report = json.loads((tmp_path / "report-rank0.jsonl").read_text().splitlines()[-1])
    assert len(report["losses"]) == 2 and report["model"]["seq_len"] == 32 and report["parallel"] == config.to_dict()
    printed = capsys.readouterr().out.splitlines()
    assert printed[:2] == [f"training nano ({count_params(model):,} parameters): single on 1 rank, 2 steps",
                           "global batch 8 = micro-batch 8 x 1 accumulation step x 1 data-parallel rank"], printed


NO_TORCH = """
import contextlib, io, sys
import labsupport.cli, labsupport.train
helps = []
for argv in (["--help"], ["train", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        labsupport.cli.main(argv)
    helps.append(out.getvalue())
assert "train" in helps[0] and "--strategy" in helps[1] and "--nproc" in helps[1], helps
print(sorted({"torch", "matplotlib"} & set(sys.modules)))
"""


def test_the_launcher_side_imports_no_torch():
    """`labsupport --help`, `labsupport train --help` and `import labsupport.cli` or `labsupport.train`
    (a notebook's `from labsupport.train import run`) load neither torch nor matplotlib, a second or more
    of imports: the loop that needs torch is loop.py, which only the ranks import."""
    res = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_train_parser_defaults_match_the_contract():
    args = build_parser().parse_args([])
    assert (args.strategy, args.model, args.dtype, args.steps) == ("single", "micro", "fp32", 200)


@pytest.mark.multiprocess
def test_bf16_autocast_trains_on_cpu():
    out = single("--dtype", "bf16")  # the reference test_zero's bf16 run follows
    assert len(out["losses"]) == 20 and all(0 < loss < 10 for loss in out["losses"])
    assert out["dtype"] == "bf16" and out["memory"][0]["activations"] > 0
