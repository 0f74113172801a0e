"""`labsupport plan --emit deepspeed` and `--check-config`: every emitted ds_config and the workshop's 22B
config read by DeepSpeed's own parser, our reading of them held to DeepSpeed's, each contradiction one line."""
import copy
import subprocess
import sys
import inspect
import json
import types

import pytest

from labsupport import ds_check
from labsupport.cli import main
from labsupport.estimate.planner import MACHINE_NAMES, deepspeed_config, megatron_arguments, plan
from labsupport.estimate.shapes import get_preset
from labsupport.estimate.simulator import bubble_over_ideal
from labsupport.estimate.workshop import PART_II_22B, PART_II_22B_DS_CONFIG

# Layouts whose emitted configs DeepSpeed parses: the planner's five best of each, in each precision.
CASES = [("175b", "frontier", 128, 640), ("22b", "frontier", 32, 20), ("22b", "dgx-h100", 64, 128)]
PRECISIONS = ("mixed", "megatron-fp16", "fp32")


def emitted():
    """(model, precision, layout, global batch, ds_config, Megatron arguments) of every layout the test reads."""
    for model, machine, gpus, batch in CASES:
        cfg = get_preset(model)
        for precision in PRECISIONS:
            for c in plan(cfg, MACHINE_NAMES[machine], gpus, batch, precision=precision)[:5]:
                yield (model, precision, c, gpus, deepspeed_config(c, batch, precision),
                       megatron_arguments(c, cfg, batch, precision))


@pytest.fixture
def parse(monkeypatch):
    """DeepSpeed's own parser, DeepSpeedConfig, for `dp` data-parallel ranks. It asks the mpu for the DP
    size only after asking deepspeed.comm for this rank, which fails without a process group (and then
    takes a world of 1): the test stands in for rank 0 instead of starting one."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)

    def parse(config, dp):
        mpu = types.SimpleNamespace(get_data_parallel_world_size=lambda: dp)
        return DeepSpeedConfig(copy.deepcopy(config), mpu=mpu)
    return parse


def ours_equal_deepspeeds(config, dp, parsed):
    """What --check-config reads from `config` is what DeepSpeed parsed from it."""
    assert ds_check.batch_sizes(config, dp) == (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu,
                                                parsed.gradient_accumulation_steps)
    half = ds_check.precision(config)
    assert (parsed.float16_config.enabled, parsed.bfloat16_config.enabled) == (half == "fp16", half == "bf16")
    assert parsed.zero_optimization_stage == config.get("zero_optimization", {}).get("stage", 0)
    assert parsed.gradient_clipping == config.get("gradient_clipping", ds_check.CLIP_DEFAULT)


def test_every_emitted_config_parses_and_agrees_with_its_megatron_arguments(parse):
    seen = 0
    for model, precision, c, gpus, config, megatron in emitted():
        ours_equal_deepspeeds(config, c.dp, parse(config, c.dp))
        assert ds_check.contradictions(config, ds_check.megatron_flags(megatron), gpus) == [], (model, precision, c)
        seen += 1
    assert seen == len(CASES) * len(PRECISIONS) * 5


def test_the_workshops_22b_config_parses_and_contradicts_its_launch_twice(parse):
    config, script = PART_II_22B_DS_CONFIG, PART_II_22B
    assert (config["zero_optimization"]["stage"], ds_check.precision(config)) == (script.zero, script.ds_precision)
    ours_equal_deepspeeds(config, script.dp, parse(config, script.dp))
    found = ds_check.contradictions(config, ds_check.megatron_flags(script.megatron_flags()), script.gpus)
    assert len(found) == 2
    assert found[0].startswith("train_micro_batch_size_per_gpu 4 vs --micro-batch-size 2")
    assert "5 of them, so a step trains 10 sequences, not 20" in found[0]
    assert "bubble (p-1)/m = 140%, not 70%" in found[0]
    assert (bubble_over_ideal(8, 5), bubble_over_ideal(8, script.microbatches)) == (1.4, 0.7)
    assert found[1] == ("--clip-grad 1 vs gradient_clipping absent: DeepSpeed's default, 0 (no clipping) before "
                        "2026, 1 since (deepspeedai/DeepSpeed#8068): under --deepspeed only DeepSpeed clips, so write "
                        "it out")


def test_the_rules_we_read_are_deepspeeds():
    """set_train_batch_size keeps DeepSpeed's micro-batch and recomputes the accumulation (what the fork
    calls every step); the pipeline engine refuses ZeRO-2 and -3."""
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine
    engine = types.SimpleNamespace(train_micro_batch_size_per_gpu=lambda: 4, dp_world_size=1,
                                   _config=types.SimpleNamespace())
    DeepSpeedEngine.set_train_batch_size(engine, PART_II_22B.global_batch)
    assert engine._config.gradient_accumulation_steps == 5
    assert "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in inspect.getsource(PipelineEngine)
    from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT
    assert GRADIENT_CLIPPING_DEFAULT == ds_check.CLIP_DEFAULT, deepspeed.__version__


GOOD = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "gradient_clipping": 1.0, "bf16": {"enabled": True}, "zero_optimization": {"stage": 1}}
FLAGS = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--micro-batch-size", "2",
         "--global-batch-size", "16", "--bf16", "--zero-stage", "1"]   # 8 GPUs: DP 2, 4 micro-batches


@pytest.mark.parametrize("keys", [("train_batch_size", "train_micro_batch_size_per_gpu"),
                                  ("train_batch_size", "gradient_accumulation_steps"),
                                  ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"),
                                  ("train_batch_size",), ("train_micro_batch_size_per_gpu",)])
def test_the_missing_batch_keys_are_completed_as_deepspeed_does(parse, keys):
    config = {k: GOOD[k] for k in keys}
    for dp in (1, 2):
        ours_equal_deepspeeds(config, dp, parse(config, dp))


@pytest.mark.parametrize("change, flags, message", [
    ({}, [], None),
    ({"train_batch_size": 32}, [], "train_batch_size 32 != train_micro_batch_size_per_gpu 2 x gradient_accumulation"),
    ({"train_batch_size": 32, "gradient_accumulation_steps": 8}, [], "train_batch_size 32 vs --global-batch-size 16"),
    ({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 8}, [],
     "8 of them, so a step trains 32 sequences, not 16; the pipeline runs 8 micro-batches, not 4"),
    ({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": None, "train_batch_size": None}, [],
     "is not a multiple of 3 x DP 2"),
    ({"bf16": {"enabled": False}, "fp16": {"enabled": True}}, [], "--bf16 but the config enables fp16"),
    ({"zero_optimization": {"stage": 2}}, ["--zero-stage", "2"], "ZeRO stage 2 with --pipeline-model-parallel-size 2"),
    ({"zero_optimization": {"stage": 0}}, [], "--zero-stage 1 vs the config's stage 0"),
    ({"gradient_clipping": None}, [], "--clip-grad 1 vs gradient_clipping absent"),
    ({"gradient_clipping": 0}, [], "--clip-grad 1 vs gradient_clipping 0: under --deepspeed only DeepSpeed clips, "
                                   "so the run does not clip at all"),
    ({}, ["--clip-grad", "0.5"], "--clip-grad 0.5 vs gradient_clipping 1"),
])
def test_each_contradiction_is_one_line(change, flags, message):
    config = {k: v for k, v in {**GOOD, **change}.items() if v is not None}
    found = ds_check.contradictions(config, ds_check.megatron_flags(FLAGS + flags), 8)
    assert found == [] if message is None else (len(found) == 1 and message in found[0]), found


def check(capsys, tmp_path, config, *flags, gpus=8):
    path = tmp_path / "ds_config.json"
    path.write_text(config if isinstance(config, str) else json.dumps(config))
    code = main(["plan", "--gpus", str(gpus), "--check-config", str(path), "--json", "--", *flags])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_check_config_explains_the_config_and_exits_1_on_a_contradiction(capsys, tmp_path):
    code, out, _ = check(capsys, tmp_path, GOOD, *FLAGS)
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["contradictions"] == [] and result["dp"] == 2
    assert result["explain"][0].startswith("batch: 2 sequence(s) per micro-batch per GPU x 4 micro-batch(es)")
    assert any(line.startswith("ZeRO stage 1: shards the fp32 master weights") for line in result["explain"])
    code, out, _ = check(capsys, tmp_path, GOOD, *FLAGS, "--fp16")
    assert code == 2  # --fp16 with --bf16: a mistake in the flags, one line (below)
    code, out, _ = check(capsys, tmp_path, {**GOOD, "gradient_clipping": 0}, *FLAGS)
    assert code == 1 and len(json.loads(out.strip().splitlines()[-1])["contradictions"]) == 1


@pytest.mark.parametrize("config, flags, message", [
    ('{"train_batch_size": 16,}', FLAGS, "not JSON (Expecting property name enclosed in double quotes at line 1"),
    ("[1, 2]", FLAGS, "a ds_config is a JSON object {...}, this is a list"),
    ({"zero_optimization": {"stage": 1}}, FLAGS, "neither train_batch_size nor train_micro_batch_size_per_gpu"),
    (GOOD, FLAGS[:4], "--micro-batch-size is missing"),
    (GOOD, [*FLAGS, "--fp16"], "--fp16 and --bf16 together"),
    (GOOD, ["--tensor-model-parallel-size", "3", *FLAGS[2:]], "tp x pp = 3 x 2 = 6 does not divide the 8 GPUs"),
    ({**GOOD, "fp16": {"enabled": True}}, FLAGS, "enables fp16 and bf16 together"),
])
def test_a_config_or_flags_that_do_not_parse_are_one_line(capsys, tmp_path, config, flags, message):
    code, out, err = check(capsys, tmp_path, config, *flags)
    assert code == 2 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_megatron_flags_without_check_config_are_a_mistake(capsys):
    code = main(["plan", "--model", "22b", "--gpus", "32", "--machine", "frontier", "--", "--fp16"])
    err = capsys.readouterr().err
    assert code == 2 and "go with --check-config" in err and len(err.strip().splitlines()) == 1


def test_emit_deepspeed_writes_the_layouts_config(capsys):
    args = ["plan", "--model", "175b", "--machine", "frontier", "--gpus", "128", "--global-batch", "640",
            "--tp", "4", "--pp", "16", "--micro-batch", "1", "--zero", "1", "--recompute", "full", "--top", "1"]
    assert main([*args, "--emit", "deepspeed"]) == 0
    out = capsys.readouterr().out
    text = out[out.index("ds_config.json of #1:\n") + len("ds_config.json of #1:\n"):]
    config = json.loads(text)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"], config["zero_optimization"]["stage"]) == (640, 1, 320, 1)
    assert main([*args, "--emit", "deepspeed", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["ds_config"] == config


def test_check_config_runs_without_torch(tmp_path):
    """Like `plan` itself (test_plan_cli.py), the check is arithmetic: no torch, no DeepSpeed imported."""
    path = tmp_path / "ds_config_4N_22B.json"
    path.write_text(json.dumps(PART_II_22B_DS_CONFIG))
    code = ("import contextlib, io, sys\nfrom labsupport.cli import main\n"
            "from labsupport.estimate.workshop import PART_II_22B as s\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    assert main(['plan', '--gpus', str(s.gpus), '--check-config', {str(path)!r}, '--', "
            "*s.megatron_flags()]) == 1\n"
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"
