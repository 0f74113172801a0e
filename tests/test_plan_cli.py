"""`labsupport plan`: the ranked layouts as JSON (DESIGN.md 4), the explanation, --search, --emit, one-line mistakes."""
import json
import subprocess
import sys

import pytest

from labsupport.cli import main

CONTRACT = {"dp", "tp", "pp", "micro_batch", "zero", "recompute", "memory_per_gpu", "step_time_s", "fits"}
FRONTIER_175B = ["--model", "175b", "--gpus", "128", "--machine", "frontier", "--global-batch", "640"]
WORKSHOP_175B = [*FRONTIER_175B, "--tp", "4", "--pp", "16", "--micro-batch", "1", "--zero", "1", "--recompute", "full"]
# A Llama 3 70B-sized GPT at 131,072 tokens (tests/test_planner.py, LLAMA3_70B_128K) on 512 H100s.
LONG_70B = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--vocab", "128256", "--seq-len", "131072",
            "--gpus", "512", "--machine", "dgx-h100", "--global-batch", "32"]


def plan(capsys, *args):
    code = main(["plan", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def plan_json(capsys, *args):
    code, out, _ = plan(capsys, *args, "--json")
    assert code == 0
    return json.loads(out.strip().splitlines()[-1])


def test_json_is_a_ranked_list_with_the_contract_keys(capsys):
    result = plan_json(capsys, *FRONTIER_175B, "--top", "5")
    assert result["n_params"] == pytest.approx(175e9, rel=0.02)
    assert len(result["configs"]) == 5
    assert all(CONTRACT <= set(c) and c["fits"] for c in result["configs"])
    times = [c["step_time_s"] for c in result["configs"]]
    assert times == sorted(times)
    assert all(c["dp"] * c["tp"] * c["pp"] == 128 for c in result["configs"])


def test_json_carries_the_rates_the_table_prints(capsys):
    """tokens/s, TFLOP/s per GPU (recomputation included, Narayanan's count) and MFU (the model's FLOPs alone):
    the table's row and the JSON's are the same numbers; full recomputation executes a third more than MFU counts."""
    (best,) = plan_json(capsys, *WORKSHOP_175B, "--top", "1")["configs"]
    code, out, _ = plan(capsys, *WORKSHOP_175B, "--top", "1")
    row = out.splitlines()[2].split()
    assert (row[0], float(row[-3]), float(row[-2]), row[-1]) == (
        "1", float(f"{best['tokens_per_s']:.4g}"), float(f"{best['tflops_per_gpu']:.4g}"), f"{best['mfu']:.1%}")
    peak = 191.5e12  # Frontier's MI250X GCD, bf16
    executed = best["tflops_per_gpu"] * 1e12 / peak
    assert executed / best["mfu"] == pytest.approx(4 / 3, rel=0.03), "full recomputation: one more forward of 3 passes"
    assert best["tokens_per_s"] == pytest.approx(640 * 2048 / best["step_time_s"])


def test_human_output_is_a_table_and_the_reasons(capsys):
    code, out, _ = plan(capsys, *FRONTIER_175B, "--top", "3")
    assert code == 0
    assert "3 fastest" in out and "recompute" in out
    assert "Why #1:" in out and "stays inside a node" in out


def test_the_workshop_layout_pinned_emits_its_megatron_arguments(capsys):
    result = plan_json(capsys, *WORKSHOP_175B, "--emit", "megatron")
    args = result["megatron_args"]
    for flag, value in (("--tensor-model-parallel-size", "4"), ("--pipeline-model-parallel-size", "16"),
                        ("--micro-batch-size", "1"), ("--global-batch-size", "640"), ("--zero-stage", "1")):
        assert args[args.index(flag) + 1] == value
    assert "--deepspeed-activation-checkpointing" in args and "--checkpoint-activations" in args
    assert result["ds_config"]["zero_optimization"]["stage"] == 1
    fp16 = plan_json(capsys, *WORKSHOP_175B, "--precision", "megatron-fp16", "--emit", "megatron")
    assert "--fp16" in fp16["megatron_args"] and fp16["ds_config"]["fp16"]["enabled"]


def test_emit_jobscript_runs_megatron_on_the_layouts_nodes(capsys):
    result = plan_json(capsys, *WORKSHOP_175B, "--emit", "jobscript")
    script = result["jobscript"]
    assert "#SBATCH --nodes=16" in script and "pretrain_gpt_deepspeed.py" in script
    assert "export FI_CXI_ATS=0" in script  # --frontier's network settings
    pbs = plan_json(capsys, *WORKSHOP_175B, "--emit", "jobscript", "--scheduler", "pbs")["jobscript"]
    assert "#PBS" in pbs


def test_search_trajectory_is_reproducible(capsys):
    first = plan_json(capsys, *FRONTIER_175B, "--search", "8", "--seed", "2")["search"]
    again = plan_json(capsys, *FRONTIER_175B, "--search", "8", "--seed", "2")["search"]
    assert first == again and [s["index"] for s in first] == list(range(8))


def test_explicit_values_override_the_preset_or_describe_a_machine(capsys):
    bigger = plan_json(capsys, *FRONTIER_175B, "--gpu-memory-gb", "128")
    assert bigger["machine"]["memory_gb"] == 128 and bigger["machine"]["intra_gbps"] == 50
    custom = plan_json(capsys, "--model", "22b", "--gpus", "16", "--gpus-per-node", "8", "--device", "a100-40gb",
                       "--intra-node-gbps", "300", "--inter-node-gbps", "25")
    assert custom["configs"][0]["tp"] <= 8
    assert (custom["machine"]["memory_gb"], custom["machine"]["hbm_gbps"]) == (40, 1377.5)   # the device's own


@pytest.mark.parametrize("args, message", [
    ([*FRONTIER_175B, "--dp", "2", "--tp", "4", "--pp", "8"], "dp x tp x pp = 2 x 4 x 8 = 64, not the 128 GPUs"),
    ([*FRONTIER_175B, "--tp", "5"], "tp 5 does not divide the 96 attention heads"),
    ([*FRONTIER_175B, "--pp", "128"], "pp 128 is more stages than the 96 layers"),
    ([*FRONTIER_175B, "--gpu-memory-gb", "0"], "memory_gb must be > 0"),
    (["--model", "175b", "--gpus", "128", "--gpu-memory-gb", "80"], "missing --gpus-per-node"),
    (["--model", "175b", "--machine", "frontier"], "give --gpus N"),
    (["--model", "175b", "--gpus", "128", "--gpus-per-node", "8", "--intra-node-gbps", "300", "--inter-node-gbps", "25"],
     "(missing --device)"),
    ([*FRONTIER_175B, "--device", "h100-sxm"], "--machine frontier has its device"),
    (["--model", "1t", "--gpus", "64", "--machine", "frontier"], "fits nowhere on 64 x 64 GB"),
    (["--layers", "4", "--gpus", "8", "--machine", "frontier"], "missing --hidden --heads --vocab --seq-len"),
    ([*FRONTIER_175B, "--cp", "3"], "the sequence length 2048 does not split into 2 x cp = 6 chunks"),
    ([*LONG_70B, "--cp", "1"], "leave cp to the planner (context parallelism)"),
    ([*LONG_70B, "--emit", "megatron"], "uses context parallelism, which the workshop's Megatron-DeepSpeed fork"),
])
def test_mistakes_are_one_line(capsys, args, message):
    code, out, err = plan(capsys, *args)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err and "Traceback" not in err


def test_plan_takes_the_llama_family(capsys):
    """A preset of the family and a custom shape with its switches; --emit megatron would write a GPT's flags
    for them, so it refuses in one line."""
    mixtral = plan_json(capsys, "--model", "mixtral-8x7b", "--gpus", "64", "--machine", "dgx-h100", "--top", "1")
    assert (mixtral["n_params"], mixtral["active_params"]) == (46_702_792_704, 12_879_925_248)
    custom = plan_json(capsys, *"--layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq-len 8192 --kv-heads 8 "
                       "--ffn-hidden 14336 --norm rmsnorm --mlp swiglu --positions rope --untied --no-bias --gpus 16 "
                       "--machine dgx-h100 --top 1".split())
    assert custom["n_params"] == 7_241_732_096 and "active_params" not in custom
    code, out, err = plan(capsys, "--model", "mistral-7b", "--gpus", "16", "--machine", "dgx-h100", "--emit", "megatron")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "--emit megatron writes a GPT shape's Megatron arguments, and mistral-7b has RMSNorm" in err


def test_emit_exports_what_megatron_needs_and_names_frontiers_porting_steps(capsys):
    """TP 4 on Frontier: CUDA_DEVICE_MAX_CONNECTIONS=1 just before the command (as every workshop script exports it;
    the comment says this --deepspeed command does not need it), the Part III deck's porting steps as comments; the
    same lines in the job script."""
    code, out, _ = plan(capsys, *WORKSHOP_175B, "--emit", "megatron")
    lines = out.strip().splitlines()
    assert code == 0 and lines[-2:] == ["export CUDA_DEVICE_MAX_CONNECTIONS=1", lines[-1]]
    assert lines[-1].startswith("pretrain_gpt_deepspeed.py ") and "DS_BUILD_CPU_ADAM=1" in out
    result = plan_json(capsys, *WORKSHOP_175B, "--emit", "jobscript")
    assert "\n".join(result["environment"]) in result["jobscript"]
    elsewhere = plan_json(capsys, *WORKSHOP_175B[:4], "--machine", "dgx-a100", *WORKSHOP_175B[6:], "--emit", "megatron")
    assert elsewhere["environment"][-1] == "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert "DS_BUILD" not in " ".join(elsewhere["environment"])


def test_a_128k_context_is_planned_with_context_parallelism(capsys):
    """The shape flags at 131,072 tokens: no DP x TP x PP layout fits (the pinned --cp 1 above), the planner's
    layouts add a CP axis, in the JSON and as a table column (shown only where a layout has cp > 1, so the
    2048-token tables read as before); --seq-len also sets a preset's context length."""
    result = plan_json(capsys, *LONG_70B, "--top", "3")
    assert all(c["cp"] > 1 and c["dp"] * c["tp"] * c["pp"] * c["cp"] == 512 for c in result["configs"])
    assert CONTRACT | {"cp", "cp_comm_s"} <= set(result["configs"][0])
    code, out, _ = plan(capsys, *LONG_70B, "--top", "3")
    best = result["configs"][0]
    assert code == 0 and " cp " in out.splitlines()[1]
    assert " cp " not in plan(capsys, *FRONTIER_175B, "--top", "3")[1].splitlines()[1]  # 2048 tokens: no CP column
    assert f"TP {best['tp']} x CP {best['cp']} x PP {best['pp']} x DP {best['dp']}" in out and "CP ring" in out
    long_175b = plan_json(capsys, "--model", "175b", "--seq-len", "131072", "--gpus", "1024", "--machine", "frontier",
                          "--global-batch", "64", "--top", "1")
    assert long_175b["configs"][0]["cp"] > 1


NO_TORCH = """
import contextlib, io, sys
from labsupport.cli import main
for argv in ({commands}):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert main(argv) == 0, argv
import labsupport.estimate.published, labsupport.estimate.scaling, labsupport.estimate.tp_comm  # noqa: E401
print(sorted(m for m in ("torch", "matplotlib", "labsupport.model", "labsupport.data") if m in sys.modules))
"""


def test_memory_and_plan_run_without_torch():
    """Sizing a model is arithmetic on torch-free shapes (estimate/shapes.py): `labsupport memory` and
    `plan`, a CPU preset with the corpus's vocabulary included, never import torch or the model, nor
    matplotlib for the bytes they print (units.py)."""
    commands = [["plan", *FRONTIER_175B, "--top", "3"], ["plan", *WORKSHOP_175B, "--emit", "megatron", "--json"],
                ["plan", *WORKSHOP_175B, "--emit", "deepspeed"],
                ["plan", "--model", "mini", "--gpus", "8", "--machine", "dgx-h100"], ["plan", *LONG_70B, "--json"],
                ["memory", "--model", "22b", "--tp", "8", "--pp", "2", "--json"], ["memory", "--model", "nano"],
                ["memory", "--params", "7.5e9", "--dp", "8", "--zero", "2", "--offload", "--json"]]
    code = NO_TORCH.format(commands=", ".join(map(repr, commands)))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[]"


def test_an_uneven_pipeline_is_planned_when_asked_for(capsys):
    """BLOOM-176B's layout (70 layers, 12 stages, TP 4, DP 8 on 384 A100s; Le Scao et al. 2022, Sec. 3.4), which
    the planner refused while pp had to divide the layers: its fullest stage (6 layers) is priced."""
    bloom = ["--layers", "70", "--hidden", "14336", "--heads", "112", "--vocab", "250880", "--seq-len", "2048",
             "--gpus", "384", "--machine", "dgx-a100", "--global-batch", "2048"]
    (best,) = plan_json(capsys, *bloom, "--tp", "4", "--pp", "12", "--dp", "8", "--micro-batch", "2", "--zero", "1",
                        "--recompute", "full")["configs"]
    assert (best["dp"], best["tp"], best["pp"], best["fits"]) == (8, 4, 12, True)
