"""fp16 with dynamic loss scaling (parallel/loss_scale.py, loop.train_step): every preset equals the
fp32 reference within fp16's tolerance, an overflow is skipped, counted and halves the scale on every
rank alike, and the two mistakes that break it (clipping the scaled gradients; deciding to skip from
one rank's shard) fail these tests.

The comparison runs at a loss scale of 2^10 (`--loss-scale 1024`), which no step of nano overflows,
so fp16 and fp32 take the same steps; at GradScaler's 2^16 nano's step 5 overflows and is skipped
(fp32 takes it), which the forced-overflow test covers instead.

The tolerance. fp16 keeps 11 significant bits: a rounding is off by up to 2^-11 = 4.9e-4 relative.
The loss is a mean over 512 tokens computed in fp32 from fp16 logits, so its roundings mostly
average out: LOSS_RTOL, one fp16 rounding, is the bound for every step's loss (measured on nano:
2e-5). The gradient norm sums squares of gradients each rounded in fp16 matmuls and, under AdamW,
the weights move apart a little each step: NORM_RTOL, 40 roundings, is four times the worst
measured (5.5e-3, 3D's micro-batches of 2; single's 1e-3). bf16, with
8 significant bits, needs 1e-2 on the loss (test_zero.py). A clip of the scaled gradients measures
a norm 1024 times too large, far outside.
"""
import json
import math
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import cases_on_ranks, planted_copy
from harness import PLANTS, assert_same_as_single, planted, prefetch, resume, single, train
from labsupport import train as train_module
from labsupport.parallel import strategy as strategy_module
from labsupport.estimate.memory import estimate_memory, tinygpt_activation_bytes
from labsupport.model import PRESETS, TinyGPT, get_preset, lm_loss
from labsupport.parallel import ConfigError
from labsupport.parallel import loss_scale
from labsupport.parallel.loss_scale import fp16_problem

FP16 = ("--dtype", "fp16", "--loss-scale", "1024")
LOSS_RTOL = 2.0 ** -11  # relative, every step's loss
NORM_RTOL = 2e-2        # relative, every step's gradient norm before clipping
VAL_TOL = 1e-3          # absolute, the validation loss after 20 steps (nats)

# every preset on 2 ranks, and 3D's data and pipeline axes with ZeRO-1 on 4, each once per session
# (the fp32 reference is the harness's single run)
PRESET_RUNS = [("single", 1, ()), ("ddp", 2, ()), ("zero3", 2, ()), ("tp", 2, ("--tp", "2")),
               ("pp", 2, ("--pp", "2", "--microbatches", "4")),
               ("3d", 4, ("--dp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2"))]


@pytest.fixture(scope="module")
def runs():
    """This file's training runs, trained ahead in one launch per world size (harness.prefetch)."""
    prefetch(("single", 1, ()), ("single", 1, ("--dtype", "fp16")), ("ddp", 2, ()), ("ddp", 2, FP16),
             *[(s, n, (*FP16, *extra)) for s, n, extra in PRESET_RUNS])


def same_as_fp32(out) -> None:
    ref = single()
    assert out["dtype"] == "fp16" and ref["dtype"] == "fp32"
    assert_same_as_single({**out, "dtype": "fp32"}, ref, loss_tol=None, loss_rtol=LOSS_RTOL, norm_rtol=NORM_RTOL,
                          val_tol=VAL_TOL)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", PRESET_RUNS, ids=[s for s, *_ in PRESET_RUNS])
def test_fp16_equals_the_fp32_reference(runs, strategy, nproc, extra):
    out = train(strategy, nproc, *FP16, *extra)
    assert out["skipped_steps"] == [], "2^10 lets every step of nano through"
    assert out["loss_scales"] == [2.0 ** 10] * out["steps"]  # no overflow, and 20 steps are short of 2000
    same_as_fp32(out)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_forced_overflow_is_skipped_counted_and_halves_the_scale_on_every_rank():
    """An initial scale of 2^20 overflows fp16 (nano's gradients pass at 2^17): each such step is
    skipped (no update), counted in the summary and the metrics, and halves the scale, on both TP
    ranks alike (each holds its own shards)."""
    out = train("tp", 2, "--tp", "2", "--dtype", "fp16", "--loss-scale", str(2.0 ** 20))
    skipped, scales = out["skipped_steps"], out["loss_scales"]
    assert len(skipped) >= 2 and skipped[0] == 0, skipped
    for step in range(out["steps"] - 1):  # halved after a skip, else kept (growth comes after 2000 good steps)
        assert scales[step + 1] == scales[step] / (2 if step in skipped else 1), (step, scales)
    assert [not math.isfinite(n) for n in out["grad_norms"]] == [s in skipped for s in range(out["steps"])]
    records = [[json.loads(line) for line in (Path(out["run_dir"]) / f"metrics-rank{r}.jsonl").read_text().splitlines()]
               for r in range(2)]
    for rank, rec in enumerate(records):
        assert [r["step"] for r in rec if r["skipped"]] == skipped, f"rank {rank} skipped other steps"
        assert [r["loss_scale"] for r in rec] == scales, f"rank {rank} has other loss scales"
    assert out["losses"][-1] < out["losses"][0]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_an_fp16_run_resumes_with_its_loss_scale(runs, tmp_path):
    """At GradScaler's 2^16 nano's step 5 overflows; resumed from step 10, the run goes on at the
    halved scale it had reached (the scaler's state is in the checkpoint), bit-identical."""
    full = train("single", 1, "--dtype", "fp16")
    assert any(step < 10 for step in full["skipped_steps"]), "this test needs an overflow before the checkpoint"
    resumed = resume(full, 10, tmp_path)
    for key in ("losses", "grad_norms", "loss_scales", "skipped_steps"):
        assert resumed[key] == full[key], key


SCALER = textwrap.dedent('''
    """Two ranks, an inf in rank 1's gradient only: both must skip, halve the scale and keep their
    weights; a clean step after it updates both. One case per (label, module) argv[1] lists (JSON),
    each with its own model and the module's LossScaler, reported under its label."""
    import importlib, json, sys
    import torch
    from labsupport import init, report


    def case(rt, module):
        LossScaler = importlib.import_module(module).LossScaler
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = LossScaler(torch.device("cpu"), init_scale=1024.0)
        seen = []
        for step in range(2):
            before = model.weight.detach().clone()
            scaler.scale(model(torch.ones(2, 4)).sum()).backward()
            if step == 0 and rt.rank == 1:
                model.weight.grad[0, 0] = float("inf")  # an overflow in this rank's shard alone
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            seen.append([scaler.skipped, scaler.get_scale(), not torch.equal(before, model.weight)])
        return seen


    with init(seed=0) as rt:
        for label, module in json.loads(sys.argv[1]):
            report(**{label: case(rt, module)})
''')


@pytest.fixture(scope="module")
def scaler_seen(tmp_path_factory):
    """`scaler_seen(module)`: each rank's (skipped, scale, updated) per step with `module`'s LossScaler.
    The real module and a planted copy (the inf not combined across ranks) run in one launch."""
    def plant(folder):
        planted_copy(loss_scale, [('comm.all_reduce(found, "max", group=self.group)', "pass")],
                     folder / "planted_loss_scale.py")
    modules = ["labsupport.parallel.loss_scale", "planted_loss_scale"]
    return cases_on_ranks(tmp_path_factory, SCALER, {module: (2, module) for module in modules}, plant)


@pytest.mark.multiprocess
def test_an_inf_on_one_rank_skips_the_step_on_every_rank(scaler_seen):
    for rank, seen in enumerate(scaler_seen("labsupport.parallel.loss_scale")):
        assert seen == [[True, 512.0, False], [False, 512.0, True]], f"rank {rank}: (skipped, scale, updated) {seen}"


@pytest.mark.multiprocess
def test_planted_found_inf_not_combined_across_ranks_fails(scaler_seen):
    """GradScaler alone: rank 0 sees no inf, steps and keeps its scale while rank 1 skips."""
    seen = scaler_seen("planted_loss_scale")
    assert seen[0][0] != seen[1][0], "without the all-reduce the ranks must disagree (is the anchor still the combine?)"
    with pytest.raises(AssertionError):
        assert seen[0] == [[True, 512.0, False], [False, 512.0, True]]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_planted_clip_before_unscale_fails_the_comparison(tmp_path):
    """The clip then measures S = 1024 times the true norm and shrinks every step's gradient."""
    out = train("single", 1, *FP16, env=planted(tmp_path, "clip before unscale"))
    with pytest.raises(AssertionError, match="gradient norms|losses"):
        same_as_fp32(out)


def test_the_plant_swaps_unscale_and_clip():
    (module, [(old, new)]), = PLANTS["clip before unscale"]
    assert module == "labsupport.loop" and old.index("unscale_") < old.index("clip_grad_norm_")
    assert new.index("clip_grad_norm_") < new.index("unscale_")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_fp16_runs_hold_the_fp32_recipe_and_fewer_activations(runs):
    """What an autocast run holds, measured beside the memory model. torch.autocast keeps the weights,
    gradients and Adam's moments in fp32: BYTES_PER_PARAM["fp32"], 4 + 4 + 8 = 16 bytes per parameter,
    the same as fp32 to the byte (not the "mixed" 2 + 2 + 12, nor Megatron-LM's 18 or 20, which keep
    16-bit weights). The activations lie between tinygpt_activation_bytes in 2 bytes (everything
    saved in fp16) and in 4 (fp32, which the fp32 run holds exactly): the matmuls' inputs are fp16,
    LayerNorm and the loss stay fp32, and autocast saves fp16 copies of the weights for backward."""
    out, fp32 = train("ddp", 2, *FP16), train("ddp", 2)
    cfg = PRESETS[out["model"]["name"]].with_vocab(out["model"]["vocab"])
    states = estimate_memory(cfg, micro_batch=out["micro_batch"], precision="fp32", dp=2, recompute="selective")
    low, high = (tinygpt_activation_bytes(cfg, out["micro_batch"], size) for size in (2, 4))
    for rank, (measured, full) in enumerate(zip(out["memory"], fp32["memory"])):
        for k in ("params", "grads", "optimizer"):
            assert measured[k] == full[k] == pytest.approx(states[k], rel=0.01), (rank, k, measured[k], states[k])
        assert full["activations"] == high and low < measured["activations"] < high, (rank, measured, low, high)


def test_autocast_runs_the_matmuls_in_fp16_on_this_machine():
    """torch 2.13's CPU autocast has float16: every Linear of TinyGPT computes in it, the loss in fp32."""
    assert fp16_problem("cpu") is None
    model = TinyGPT(get_preset("nano").with_vocab(57))
    dtypes = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_hook(lambda m, i, o, name=name: dtypes.__setitem__(name, o.dtype))
    x = torch.randint(0, 57, (2, 16))
    with torch.autocast("cpu", dtype=torch.float16):
        loss = lm_loss(model(x), x)
    assert dtypes and set(dtypes.values()) == {torch.float16}, dtypes
    assert loss.dtype == torch.float32


def test_fp16_without_device_support_is_one_line_before_any_process(monkeypatch, tmp_path):
    line = fp16_problem("meta")  # a device type without float16 autocast
    assert line.startswith("--dtype fp16: ") and "\n" not in line
    monkeypatch.setattr(strategy_module, "fp16_problem", lambda device: line)  # what Strategy.fp16_problem asks
    with pytest.raises(ConfigError) as e:
        train_module.run(nproc=1, dtype="fp16", steps=2)
    assert e.value.problems == [line]
    assert not (tmp_path / "runs").exists(), "a run directory was made: something started"


@pytest.mark.parametrize("options, message", [
    (dict(strategy="torch-ddp", nproc=2, dtype="fp16"), "torch-ddp runs backward its library's way"),
    (dict(loss_scale=1024.0), "--loss-scale must be > 0 and needs --dtype fp16"),
    (dict(dtype="fp16", loss_scale=0.0), "--loss-scale must be > 0"),
])
def test_bad_fp16_arguments_fail_before_start(options, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        train_module.run(**{"steps": 2, **options})
    assert not (tmp_path / "runs").exists()
