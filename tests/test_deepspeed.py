"""DeepSpeed's ZeRO (the `deepspeed` strategy) is proven like our ZeRO and torch's: same losses and
gradient norms as `single` at every step, the memory each stage claims to divide divided, its
collectives counted (through our door) against the ZeRO paper's traffic, and its own checkpoint
resumed bit-identically. Under fp16 DeepSpeed's own loss scaling gives the fp32 reference within
the tolerance test_fp16.py holds ours to (ZeRO-1 and ZeRO-3), and skips, counts and halves on an
overflow as ours."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli
from harness import LLAMA, assert_same_as_single, assert_traffic_in, resume, single, train
from labsupport.ds_config import ds_config
from labsupport.parallel import ParallelConfig
from test_fp16 import LOSS_RTOL, VAL_TOL

pytestmark = pytest.mark.multiprocess

# Each stage's run on 2 ranks, which the memory, traffic and resume tests below read too
DS_NORM_RTOL = 5e-2  # fp16: relative, every step's gradient norm (test_deepspeed_fp16_equals_the_fp32_reference)
TWO_RANKS = {1: ["--zero", "1"], 2: ["--zero", "2", "--micro-batch", "2"], 3: ["--zero", "3"]}


@pytest.mark.slow
@pytest.mark.parametrize("stage, nproc, extra", [
    (1, 2, TWO_RANKS[1]),
    (2, 2, TWO_RANKS[2]),                    # 2 accumulation steps: engine.step() steps on the second only
    (3, 2, TWO_RANKS[3]),
    (3, 4, ["--zero", "3", "--micro-batch", "1"]),  # 4 ranks, 2 accumulation steps
])
def test_deepspeed_matches_single_step_by_step(stage, nproc, extra):
    out = train("deepspeed", nproc, *extra)
    assert out["world_size"] == nproc and out["parallel"]["zero"] == stage
    assert_same_as_single(out, single(), params="whole")  # the loop's file holds the whole model


@pytest.mark.slow
def test_deepspeed_on_the_llama_family_matches_single_step_by_step():
    """ZeRO-3 on llama-micro (RMSNorm, SwiGLU, RoPE, grouped-query attention, an untied head): DeepSpeed
    partitions whatever modules it is given."""
    out = train("deepspeed", 2, "--zero", "3", settings=LLAMA)
    assert out["parallel"]["zero"] == 3 and out["model"]["name"] == "llama-micro"
    assert_same_as_single(out, single(settings=LLAMA), params="whole")


@pytest.mark.slow
def test_deepspeed_divides_what_each_stage_shards_and_talks_against_the_paper():
    """Per rank, against `single`: ZeRO-1 holds 1/N of the Adam moments plus 1/N of the parameters
    again, the fp32 copy DeepSpeed updates (1.5/N of single's optimizer bytes); ZeRO-3 holds 1/N of
    the parameters and updates them in place. DeepSpeed frees the gradients inside its step: none
    are held after it.
    Traffic, counted by our door (DeepSpeed's torch backend wrapped), in units of Psi (the fp32
    bytes of every parameter), against the paper's 2 Psi for ZeRO-1 (reduce-scatter and all-gather)
    and 3 Psi for ZeRO-3 (Sec. 7.2): DeepSpeed's ZeRO-1 all-reduces the gradients (Psi, twice a
    reduce-scatter's bytes on the wire) and all-gathers the updated parameters (Psi); its ZeRO-3
    (configured to release each module's parameters after use, as ours) gathers them for forward and
    again for backward (2 Psi, plus the tied embedding's second use each time) and reduce-scatters
    the gradients once (Psi)."""
    n, base = 2, single()["memory"][0]
    psi = base["params"]  # with the vocabulary's padding rows: what DeepSpeed flattens
    for stage in (1, 3):
        out = train("deepspeed", n, *TWO_RANKS[stage])
        assert_traffic_in(out, {"dp"}, exact=True)
        for rank in range(n):
            mine = out["memory"][rank]
            params = psi / n if stage == 3 else psi
            optimizer = base["optimizer"] / n * (1 if stage == 3 else 1.5)
            assert abs(mine["params"] - params) <= 0.01 * psi, (stage, rank, mine, base)
            assert abs(mine["optimizer"] - optimizer) <= 0.01 * base["optimizer"], (stage, rank, mine, base)
            assert mine["grads"] == 0, (stage, rank, mine)
            ops = {op: c["payload_bytes"] / psi for op, c in out["comm"][rank].items()}
            if stage == 1:
                assert set(ops) == {"all_reduce", "all_gather"}, ops
                assert ops["all_reduce"] == pytest.approx(1, abs=1e-3) and ops["all_gather"] == 1, ops
            else:
                assert ops["reduce_scatter"] == 1 and 2 < ops["all_gather"] < 2.1, ops
                assert ops["all_reduce"] < 1e-3, ops  # the gradient norm's squares and the overflow flag


@pytest.mark.slow
def test_deepspeed_checkpoint_resumes_bit_identically(tmp_path):
    """DeepSpeed's save_checkpoint writes each rank's partition into the step's directory; resumed
    from step 10 through load_checkpoint, a run reports the same 20 losses and norms."""
    full = train("deepspeed", 2, *TWO_RANKS[3])
    assert (full.checkpoint_dir / "step000010" / "deepspeed").is_dir()
    resumed = resume(full, 10, tmp_path)
    assert resumed["resumed_from"] == 10
    assert resumed["losses"] == full["losses"] and resumed["grad_norms"] == full["grad_norms"]


def deepspeed_says_fp16() -> bool:
    """What DeepSpeed's accelerator answers on this machine: on a CPU, whether oneDNN computes in fp16
    (AVX512-FP16 or AMX-FP16; most laptops and many servers have neither)."""
    from deepspeed.accelerator import get_accelerator
    return bool(get_accelerator().is_fp16_supported())


FP16_HERE = pytest.mark.skipif("not deepspeed_says_fp16()", reason="DeepSpeed refuses fp16 on this CPU: "
                               "test_deepspeed_fp16_is_refused_in_one_line_where_deepspeed_says_no checks that")


def test_deepspeed_fp16_is_refused_in_one_line_where_deepspeed_says_no(monkeypatch):
    """Issue 28: on a CPU without AVX512-FP16/AMX, `deepspeed.initialize` raised "Type fp16 is not supported
    on your device" on every rank. The launcher asks DeepSpeed's accelerator first and refuses in one
    line, before any rank starts. Here the accelerator is made to say no (as it does on such a CPU), in
    this process, where `labsupport train` validates; on a machine where it says no already, this is
    what the attendee sees."""
    from deepspeed.accelerator import get_accelerator
    monkeypatch.setattr(type(get_accelerator()), "is_fp16_supported", lambda self: False)
    res = cli("train", "--strategy", "deepspeed", "--nproc", "2", "--dtype", "fp16", "--steps", "2")
    assert res.returncode != 0 and res.stdout == "", res
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "DeepSpeed" in res.stderr and "does not support fp16" in res.stderr and "--dtype bf16" in res.stderr
    from labsupport.train import fp16_problems
    assert fp16_problems("zero1") == []  # our own fp16 does not ask DeepSpeed: torch's autocast suffices


@pytest.mark.slow
@FP16_HERE
@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_fp16_equals_the_fp32_reference(stage):
    """DeepSpeed's fp16 (fp16 module, fp32 copy of each partition, its own dynamic loss scale) at
    2^10, where no step of nano overflows: the fp32 reference within our fp16's tolerance for the
    losses, but not for the norms. The whole module is fp16 (LayerNorm, embeddings, the residual
    stream; autocast keeps them fp32), so its gradients are noisier: measured on nano, up to 2.4e-2
    relative (ours: 5.5e-3), against test_fp16's NORM_RTOL of 2e-2; DS_NORM_RTOL is twice that worst.
    ZeRO-3 partitions the fp16 module itself (each rank gathers the fp16 parameters per module and
    reduce-scatters fp16 gradients, where ZeRO-1 all-reduces them): the same roundings, so the same
    tolerances (measured: losses 3.7e-4 relative under either stage, LOSS_RTOL 4.9e-4; norms 2.4e-2).
    A clip of the scaled gradients, or none unscaled, is 1024 times off, far outside."""
    out = train("deepspeed", 2, *TWO_RANKS[stage], "--dtype", "fp16", "--loss-scale", "1024")
    assert out["skipped_steps"] == [] and out["loss_scales"] == [2.0 ** 10] * out["steps"]
    assert_same_as_single({**out, "dtype": "fp32"}, single(), loss_tol=None, loss_rtol=LOSS_RTOL,
                          norm_rtol=DS_NORM_RTOL, val_tol=VAL_TOL)


@pytest.mark.slow
@FP16_HERE
def test_deepspeed_fp16_skips_counts_and_halves_on_an_overflow():
    """At 2^20 nano's gradients overflow fp16: DeepSpeed skips the step (its norm is inf), halves the
    scale (GradScaler's rule, hysteresis 1), and the loop reports both, in the summary and in every
    rank's metrics, as for our own fp16 (ZeRO-2, 2 accumulation steps: the skip is on the last)."""
    out = train("deepspeed", 2, *TWO_RANKS[2], "--dtype", "fp16", "--loss-scale", str(2.0 ** 20))
    skipped, scales = out["skipped_steps"], out["loss_scales"]
    assert len(skipped) >= 2 and skipped[0] == 0, skipped
    for step in range(out["steps"] - 1):
        assert scales[step + 1] == scales[step] / (2 if step in skipped else 1), (step, scales)
    assert [not math.isfinite(n) for n in out["grad_norms"]] == [s in skipped for s in range(out["steps"])]
    for rank in range(2):
        records = [json.loads(line) for line in
                   (Path(out["run_dir"]) / f"metrics-rank{rank}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["skipped"]] == skipped, rank
        assert [r["loss_scale"] for r in records] == scales, rank
    assert out["losses"][-1] < out["losses"][0]


def test_only_the_deepspeed_strategy_pays_for_importing_deepspeed():
    """`import deepspeed` takes over a second: the loop, the CLI and the other strategies never import it,
    and ds_config (for `plan --emit deepspeed`) needs neither torch nor DeepSpeed."""
    code = ("import sys, labsupport.ds_config; alone = sorted({'torch', 'deepspeed'} & set(sys.modules)); "
            "import labsupport.train, labsupport.cli; from labsupport.parallel import ParallelConfig; "
            "ParallelConfig.build(2, 'zero3').check(2); print(alone, 'deepspeed' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.split("\n")[-2] == "[] False", res.stdout + res.stderr


def test_deepspeed_defaults_to_zero1_as_the_workshop_runs():
    assert ParallelConfig.build(2, "deepspeed").zero == 1
    assert ParallelConfig.build(2, "deepspeed", zero=3).layout()["zero"] == 3


def test_ds_config_follows_deepspeed_keys_and_our_recipe():
    from labsupport.parallel.optim import BETAS
    config = ds_config(2, 4, 8, 3, reduce_bucket=10, allgather_bucket=20, grad_clip=1.0, dtype="fp16", lr=3e-3,
                       weight_decay=0.1)
    assert config["train_batch_size"] == 2 * 4 * 8 and config["gradient_accumulation_steps"] == 4
    assert config["zero_optimization"]["stage3_prefetch_bucket_size"] == 20
    assert config["fp16"]["loss_scale"] == 0, "dynamic loss scaling"
    assert config["optimizer"]["params"]["betas"] == list(BETAS)
    assert "optimizer" not in ds_config(1, 1, 2, 1) and "stage3_prefetch_bucket_size" not in ds_config(1, 1, 2, 1)[
        "zero_optimization"]


@pytest.mark.parametrize("args, message", [
    (["--zero", "0"], "strategy 'deepspeed' without ZeRO is DDP"),
    (["--zero", "2", "--bucket-mb", "1e-9"], "strategy 'deepspeed': DeepSpeed refuses the ds_config"),
    (["--nproc", "1"], "ZeRO-1/2: stage 1 shards over the data-parallel ranks, but this grid has --dp 1"),
    (["--dtype", "fp16", "--loss-scale", "1000"], "--loss-scale must be a power of two"),
])
def test_bad_deepspeed_arguments_fail_before_start(args, message):
    res = cli("train", "--strategy", "deepspeed", *(["--nproc", "2"] if "--nproc" not in args else []), *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
