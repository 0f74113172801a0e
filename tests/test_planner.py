"""The planner (estimate/planner.py) and scaling curves (estimate/scaling.py) against published runs.

Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", Table 1 (estimate/published.py): GPT models on DGX A100 (80 GB) nodes; the
micro-batch size is not in the table, so the planner chooses it.
The workshop's runs (Dash et al. 2023, arXiv:2312.12705, Table VI in the Part III deck) are on
Frontier's MI250X GCDs (64 GB).
"""
import re
from dataclasses import replace

import pytest

from labsupport.estimate.comm_cost import all_reduce_ring
from labsupport.estimate.devices import A100_80GB
from labsupport.estimate.machines import DGX_A100, DGX_H100, FRONTIER, Machine
from labsupport.estimate.memory import RECOMPUTE
from labsupport.estimate.params import count_params
from labsupport.estimate.planner import (EFFICIENCY, MACHINE_NAMES, MICRO_BATCHES, ZERO_STAGES, NoFit, check_machine,
                                         context_degrees, deepspeed_config, describe, evaluate, explain_no_fit,
                                         layouts, megatron_arguments, megatron_environment, plan, search, step_flops,
                                         why)
from labsupport.estimate.published import NARAYANAN_TABLE_1
from labsupport.estimate.scaling import WORKSHOP, strong_scaling, weak_scaling
from labsupport.estimate.step_time import Framework, head_s, layer_s, optimizer_s
from labsupport.model import PRESETS, ModelConfig

TABLE_1 = NARAYANAN_TABLE_1


def shape(row):
    return row.shape()


def test_full_recomputation_flops_are_narayanan_eq_3():
    """Sec. 5.1: 96 B s l h^2 (1 + s/6h + V/16lh) with recomputation, 72 B s l h^2 (1 + s/6h + V/12lh) without."""
    cfg = shape(TABLE_1[-1])
    B, s, l, h, V = 3072, 2048, 128, 25600, 51200
    assert step_flops(cfg, B, "full") == pytest.approx(96 * B * s * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h)),
                                                       rel=1e-3)
    assert step_flops(cfg, B, "none") == pytest.approx(72 * B * s * l * h**2 * (1 + s / (6 * h) + V / (12 * l * h)),
                                                       rel=1e-3)


def test_selective_recomputation_adds_the_attention_core_only():
    """Korthikanti et al. 2022, Sec. 5: Q K^T and attention over V again, 4 s h FLOPs per token and layer
    (no published total to compare with; this checks the count)."""
    cfg = PRESETS["175b"]
    extra = step_flops(cfg, 1, "selective") - step_flops(cfg, 1, "none")
    assert extra == cfg.n_layers * 4 * cfg.seq_len * cfg.hidden * cfg.seq_len


@pytest.mark.parametrize("row", TABLE_1, ids=lambda r: f"{r[0]}B")
def test_table_1_layouts_fit_and_are_within_10_percent_of_the_best(row):
    *_, tp, pp, gpus, batch, _ = row
    cfg = shape(row)
    best = plan(cfg, DGX_A100, gpus, batch)[0]
    published = plan(cfg, DGX_A100, gpus, batch, tp=tp, pp=pp)[0]
    assert published.fits
    assert published.step_time_s <= 1.1 * best.step_time_s


@pytest.mark.parametrize("row", TABLE_1[-4:], ids=lambda r: f"{r[0]}B")
def test_predicted_throughput_is_within_10_percent_of_table_1(row):
    *_, tp, pp, gpus, batch, tflops = row
    cfg = shape(row)
    c = plan(cfg, DGX_A100, gpus, batch, tp=tp, pp=pp)[0]
    achieved = step_flops(cfg, batch, c.recompute) / c.step_time_s / gpus / 1e12
    assert achieved == pytest.approx(tflops, rel=0.1)


def test_workshop_175b_fits_only_with_full_recomputation_and_is_competitive():
    """TP 4, PP 16, micro-batch 1, global batch 640, ZeRO-1, checkpoint-activations, on 16 nodes (128 GCDs)."""
    cfg, layout = PRESETS["175b"], dict(dp=2, tp=4, pp=16, micro_batch=1, zero=1)
    workshop = evaluate(cfg, FRONTIER, 128, 640, recompute="full", **layout)
    best = plan(cfg, FRONTIER, 128, 640)[0]
    assert workshop.fits and workshop.step_time_s <= 1.25 * best.step_time_s
    assert not evaluate(cfg, FRONTIER, 128, 640, recompute="selective", **layout).fits


def test_workshop_175b_megatron_arguments_are_the_forks_flags():
    """The flags of sajal-vt/Megatron-DeepSpeed-ORNL's megatron/arguments.py (and DeepSpeed's
    --deepspeed, --deepspeed_config); full recomputation and fp16 as its launch scripts pass them."""
    cfg = PRESETS["175b"]
    c = evaluate(cfg, FRONTIER, 128, 640, dp=2, tp=4, pp=16, micro_batch=1, zero=1, recompute="full",
                 precision="megatron-fp16")
    assert megatron_arguments(c, cfg, 640, "megatron-fp16") == [
        "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "16",
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96",
        "--seq-length", "2048", "--max-position-embeddings", "2048",
        "--micro-batch-size", "1", "--global-batch-size", "640", "--fp16",
        "--deepspeed", "--deepspeed_config", "ds_config.json",
        "--deepspeed-activation-checkpointing", "--checkpoint-activations", "--checkpoint-num-layers", "1",
        "--zero-stage", "1"]
    config = deepspeed_config(c, 640, "megatron-fp16")   # DeepSpeed parses it: tests/test_ds_check.py
    assert {k: config[k] for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                                   "gradient_clipping")} == {
        "train_batch_size": 640, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 320,
        "gradient_clipping": 1.0}
    assert config["zero_optimization"]["stage"] == 1 and config["fp16"]["enabled"] and "bf16" not in config


def test_megatron_environment_exports_max_connections_and_says_the_command_does_not_need_it():
    """CUDA_DEVICE_MAX_CONNECTIONS=1 wherever TP > 1 and on Frontier (every workshop script exports it), with the one
    account workshop.Script.max_connections gives a --deepspeed script: the fork turns its asynchronous TP all-reduce
    off there, so nothing in the fork relies on the order it gives and the fork does not require it; on Frontier, HIP's own variable and the Part III
    deck's porting steps as comments."""
    cfg = PRESETS["175b"]
    tp4 = evaluate(cfg, FRONTIER, 128, 640, dp=2, tp=4, pp=16, micro_batch=1, zero=1, recompute="full")
    tp1 = evaluate(cfg, FRONTIER, 128, 640, dp=8, tp=1, pp=16, micro_batch=1, zero=1, recompute="full")
    export = "export CUDA_DEVICE_MAX_CONNECTIONS=1"
    assert megatron_environment(tp1) == []
    for lines in (megatron_environment(tp4), megatron_environment(tp4, frontier=True),
                  megatron_environment(tp1, frontier=True)):
        assert lines[-1] == export and all(line.startswith("# ") for line in lines[:-1])
    assert "DS_BUILD" not in " ".join(megatron_environment(tp4))  # the porting steps are Frontier's
    said = " ".join(line.removeprefix("# ") for line in megatron_environment(tp4, frontier=True))
    flags = megatron_arguments(tp4, cfg, 640)
    assert "--deepspeed" in flags and "--sequence-parallel" not in flags
    assert "turns the asynchronous all-reduce off" in said and "orders nothing" not in said, said
    assert "nothing in the fork relies on the order, and the fork does not require the variable" in said, said
    assert '"In the launch script we had to set: export CUDA_DEVICE_MAX_CONNECTIONS=1"' in said, said   # the deck
    assert "runs without --deepspeed, and runs with --sequence-parallel at TP > 1" in said, said      # when "had to" holds
    assert "overlap" not in said and "GPU_MAX_HW_QUEUES" in said
    assert "GPU_MAX_HW_QUEUES" not in " ".join(megatron_environment(tp4))   # HIP's variable is named on Frontier
    porting = " ".join(megatron_environment(tp1, frontier=True))
    assert set(re.findall(r"DS_BUILD_(\w+)=1", porting)) == {"CPU_ADAM", "FUSED_ADAM", "FUSED_LAMB", "TRANSFORMER",
                                                             "AIO", "UTILS"}  # the deck's list
    for edit in ("set_jit_fusion_options()", "megatron/training.py", "config.gradient_accumulation_fusion = False",
                 "megatron/core/tensor_parallel/layers.py"):
        assert edit in porting, edit


def test_workshop_1t_fits_and_is_within_10_percent_of_the_best():
    """TP 8, PP 64, global batch 1600 (micro-batch 1, ZeRO-1, full recomputation) on 128 nodes (1024 GCDs)."""
    cfg = PRESETS["1t"]
    workshop = evaluate(cfg, FRONTIER, 1024, 1600, 2, 8, 64, 1, 1, "full")
    best = plan(cfg, FRONTIER, 1024, 1600)[0]
    assert workshop.fits and workshop.step_time_s <= 1.1 * best.step_time_s


@pytest.mark.parametrize("machine, cfg, gpus, batch", [(DGX_A100, shape(TABLE_1[6]), 1536, 2304),
                                                      (FRONTIER, PRESETS["175b"], 128, 640)])
def test_tp_beyond_a_node_is_penalized(machine, cfg, gpus, batch):
    best = plan(cfg, machine, gpus, batch)[0]
    tp16 = plan(cfg, machine, gpus, batch, tp=16)[0]
    assert best.tp <= machine.devices_per_node
    assert tp16.step_time_s > 2 * best.step_time_s
    assert "TP 16 crosses nodes of 8 GPUs" in why(tp16, cfg, machine, gpus, batch)[1]


@pytest.mark.parametrize("tp, where", [(4, "stays inside a node"), (16, "crosses nodes of 8 GPUs")])
def test_why_counts_six_tp_all_reduces_under_full_recomputation(tp, where):
    """Megatron's 2 all-reduces forward and 2 backward per layer and micro-batch; full recomputation runs the
    forward's 2 again, so `why` says 6 where the planner prices 6 (its TP time 1.5x that of selective)."""
    cfg = PRESETS["175b"]
    said, seconds = {}, {}
    for recompute in ("selective", "full"):
        c = evaluate(cfg, FRONTIER, 1024, 8000, dp=1024 // (tp * 16), tp=tp, pp=16, micro_batch=1, zero=1,
                     recompute=recompute)
        said[recompute] = next(line for line in why(c, cfg, FRONTIER, 1024, 8000) if line.startswith(f"TP {tp} {where}"))
        seconds[recompute] = c.tp_comm_s
    assert "all-reduces, 4 per layer and micro-batch," in said["selective"], said
    assert "all-reduces, 6 per layer and micro-batch, the recomputed forward's 2 included," in said["full"], said
    assert seconds["full"] == pytest.approx(1.5 * seconds["selective"])


ROUND = Machine("round", devices_per_node=4, intra_alpha_s=0, intra_gbps=100, inter_alpha_s=0, inter_gbps=10,
                **A100_80GB._replace(peak_tflops_bf16=100)._asdict())


def _compute_by_hand(cfg, machine, tokens, tp, cp, layers, m, recompute="none"):
    """m micro-batches through a stage of `layers` layers that holds the LM head too (pp divides the layers), and the
    stage's micro-batch time alone, as step_time prices them."""
    layer = layer_s(cfg, machine.device, tokens, tp, cp, Framework())
    again = {"none": 0, "full": layer["forward"]}[recompute]
    stage = (layers * (layer["forward"] + layer["backward"] + again)
             + head_s(cfg, machine.device, tokens, tp)) / EFFICIENCY
    return m * stage, stage


def test_step_time_parts_by_hand():
    """dp 2 x tp 2 x pp 2 on two nodes of 4, 8 sequences of 512: m = 4 micro-batches, 2 layers a stage; the compute
    from step_time (each stage's micro-batches, the last stage with the LM head, then the optimizer over the stage's
    parameters), the rest from the links."""
    cfg = ModelConfig("small", n_layers=4, hidden=1024, heads=8, vocab=1024, seq_len=512)
    c = evaluate(cfg, ROUND, 8, 8, dp=2, tp=2, pp=2, micro_batch=1)
    m, sbh_bytes = 4, 512 * 1024 * 2
    share = -(-count_params(cfg, padded=True) // 4)
    micro_batches, stage = _compute_by_hand(cfg, ROUND, 512, 2, 1, 2, m)
    assert c.microbatches == m
    assert c.compute_s == pytest.approx(micro_batches + optimizer_s(share, ROUND.device) / EFFICIENCY)
    assert c.tp_comm_s == pytest.approx(m * 2 * 4 * sbh_bytes / 100e9)            # 4 all-reduces, 2 layers/stage
    assert c.pp_comm_s == pytest.approx(2 * (m + 1) * sbh_bytes / 2 / 100e9)      # inside the 4-GPU node
    assert c.dp_comm_s == pytest.approx(all_reduce_ring(2 * share, 2, 0, 1 / 10e9))  # across nodes
    assert c.bubble_s == pytest.approx((micro_batches + c.tp_comm_s) / m)
    assert c.step_time_s == pytest.approx(c.compute_s + c.tp_comm_s + c.pp_comm_s + c.dp_comm_s + c.bubble_s)
    interleaved = evaluate(cfg, ROUND, 8, 8, dp=2, tp=2, pp=2, micro_batch=1, virtual=2)   # Narayanan Sec. 2.2.2
    assert interleaved.bubble_s == pytest.approx(c.bubble_s / 2)
    assert interleaved.pp_comm_s == pytest.approx(2 * (2 * m + 1) * sbh_bytes / 2 / 100e9)
    overlapped = evaluate(cfg, ROUND, 8, 8, dp=2, tp=2, pp=2, micro_batch=1, framework=Framework(overlap_dp=True))
    backward = 2 * layer_s(cfg, ROUND.device, 512, 2, 1, Framework())["backward"]   # the last micro-batch's, 2 layers
    assert overlapped.dp_comm_s == pytest.approx(max(0.0, c.dp_comm_s - backward / EFFICIENCY))
    tp_overlapped = evaluate(cfg, ROUND, 8, 8, dp=2, tp=2, pp=2, micro_batch=1, framework=Framework(overlap_tp=True))
    assert tp_overlapped.tp_comm_s == pytest.approx(max(0.0, c.tp_comm_s - micro_batches))
    with pytest.raises(ValueError, match="1 without a pipeline"):
        evaluate(cfg, ROUND, 8, 8, dp=4, tp=2, pp=1, virtual=2)


def test_the_last_stage_holds_the_head_unless_the_split_is_uneven():
    """Where pp divides the layers every stage has L / pp and the last the LM head too, which sets the pace; 70 layers on
    12 stages (BLOOM's) leave the last stage 4 beside the head, and a stage of 6 sets it."""
    cfg = ModelConfig("bloomish", n_layers=70, hidden=1024, heads=8, vocab=250880, seq_len=512)
    c = evaluate(cfg, ROUND, 12, 12, dp=1, tp=1, pp=12, micro_batch=1)
    layer = layer_s(cfg, ROUND.device, 512, 1, 1, Framework())
    per_layer = layer["forward"] + layer["backward"]
    head = head_s(cfg, ROUND.device, 512, 1)
    share = -(-count_params(cfg, padded=True) * 6 // 70)
    assert c.compute_s == pytest.approx((12 * max(6 * per_layer, 4 * per_layer + head)
                                         + optimizer_s(share, ROUND.device)) / EFFICIENCY)


@pytest.mark.parametrize("field, value", [("memory_gb", 0), ("inter_gbps", -1), ("peak_tflops_bf16", None),
                                          ("devices_per_node", 0)])
def test_bad_machine_values_are_refused_in_one_line(field, value):
    with pytest.raises(ValueError, match=field) as e:
        check_machine(replace(FRONTIER, **{field: value}))
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=field):
        plan(PRESETS["22b"], replace(FRONTIER, **{field: value}), 16, 16)


@pytest.mark.parametrize("fixed, message", [
    (dict(dp=2, tp=4, pp=8), "dp x tp x pp = 2 x 4 x 8 = 64, not the 128 GPUs"),
    (dict(tp=5), "tp 5 does not divide the 96 attention heads"),
    (dict(pp=128), "pp 128 is more stages than the 96 layers; pick at most 96"),
    (dict(dp=2, micro_batch=3), "not a multiple of dp x micro-batch = 2 x 3"),
    (dict(cp=3), "the sequence length 2048 does not split into 2 x cp = 6 chunks (the balanced split)"),
    (dict(dp=2, tp=4, pp=8, cp=4), "dp x tp x pp x cp = 2 x 4 x 8 x 4 = 256, not the 128 GPUs"),
])
def test_bad_degrees_are_refused_before_anything_runs(fixed, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        plan(PRESETS["175b"], FRONTIER, 128, 640, **fixed)


def test_tensor_parallel_degrees_split_whole_key_value_heads():
    """Llama 3 8B has 32 query heads on 8 key/value heads: tp 16 divides the heads but would cut key/value
    heads apart (Megatron Core up to 0.15 refuses it; the library always does), so the planner neither
    tries it nor takes it."""
    cfg = PRESETS["llama3-8b"]
    assert {layout[1] for layout in layouts(cfg, DGX_H100, 32, 256)} == {1, 2, 4, 8}
    with pytest.raises(ValueError, match=re.escape("tp 16 must divide the model's key/value heads (8)")):
        plan(cfg, DGX_H100, 32, 256, tp=16)


def test_a_model_that_fits_nowhere_says_why():
    with pytest.raises(NoFit, match=r"fits nowhere on 64 x 64 GB: even TP \d+ x PP \d+ .* needs [\d.]+ GB per GPU"):
        plan(PRESETS["1t"], FRONTIER, 64, 64)
    assert "no layout splits" in explain_no_fit(PRESETS["175b"], FRONTIER, 7, 8)


def test_explanation_of_the_workshop_175b_best():
    cfg = PRESETS["175b"]
    best = plan(cfg, FRONTIER, 128, 640)[0]
    lines = why(best, cfg, FRONTIER, 128, 640)
    assert lines[0].startswith(describe(best))
    assert any("stays inside a node" in line for line in lines)
    assert any("bubble is (p - 1)/m" in line for line in lines)
    # Narayanan et al. 2021 (arXiv:2104.04473): takeaway #1 closes Sec. 3.2; "we thus need m >> p" is Sec. 2.2.1.
    assert any("(Narayanan et al. 2021, Sec. 3.2, takeaway #1)" in line for line in lines)
    assert any("(Narayanan et al. 2021, Sec. 2.2.1: keep m >> p)" in line for line in lines)


def test_search_is_reproducible_and_its_best_only_improves():
    cfg = PRESETS["175b"]
    first = search(cfg, FRONTIER, 128, 640, samples=30, seed=3)
    assert first == search(cfg, FRONTIER, 128, 640, samples=30, seed=3)
    assert first != search(cfg, FRONTIER, 128, 640, samples=30, seed=4)
    bests = [s.best_s for s in first if s.best_s is not None]
    assert bests == sorted(bests, reverse=True)
    assert bests[-1] >= plan(cfg, FRONTIER, 128, 640)[0].step_time_s
    assert [s.index for s in first] == list(range(30))


def test_weak_scaling_is_flat_and_strong_scaling_loses_to_the_bubble():
    cfg, w = PRESETS["175b"], WORKSHOP["175b"]
    weak = weak_scaling(cfg, FRONTIER, w["layout"], w["per_replica_batch"], [1, 2, 4, 8, 16])
    strong = strong_scaling(cfg, FRONTIER, w["layout"], w["strong_batch"], [1, 2, 4, 8, 16])
    for curve in (weak, strong):
        assert curve[0].efficiency == 1
        assert all(a.efficiency >= b.efficiency for a, b in zip(curve, curve[1:]))
        assert all(a.tokens_per_s < b.tokens_per_s for a, b in zip(curve, curve[1:]))
    assert weak[-1].efficiency > 0.99
    # The model leaves out what else is lost at scale, so it predicts more than the workshop measured.
    assert strong[-1].gpus == w["strong_gpus"] and strong[-1].efficiency > w["strong_efficiency"]


def test_strong_scaling_efficiency_by_hand():
    cfg, layout = PRESETS["22b"], dict(tp=8, pp=2, micro_batch=1, zero=0, recompute="full")
    one, four = strong_scaling(cfg, FRONTIER, layout, 64, [1, 4])
    t1 = evaluate(cfg, FRONTIER, 16, 64, 1, **layout).step_time_s
    t4 = evaluate(cfg, FRONTIER, 64, 64, 4, **layout).step_time_s
    assert (one.step_time_s, four.step_time_s) == (t1, t4)
    assert four.efficiency == pytest.approx(t1 * 16 / (t4 * 64))
    assert four.tokens_per_s == pytest.approx(64 * 2048 / t4)


@pytest.mark.parametrize("gpus", [3072, 64 * 3072])
def test_the_planners_work_does_not_grow_with_the_gpus(gpus):
    """tp divides the heads, pp the layers, and dp is what is left: the 1T model (128 heads, 128 layers) on
    Frontier has 5 tp (1..16) x 8 pp candidates, times micro-batches, ZeRO stages and recomputations, whether on
    3072 GCDs or 196,608. Counted, not timed: a few hundred evaluations, milliseconds."""
    cfg = PRESETS["1t"]
    candidates = 5 * 8 * len(MICRO_BATCHES) * len(ZERO_STAGES) * len(RECOMPUTE)
    assert len(list(layouts(cfg, FRONTIER, gpus, gpus))) <= candidates
    best = plan(cfg, FRONTIER, gpus, gpus)[0]
    assert best.dp * best.tp * best.pp == gpus


# ---------------------------------------------------------------- context parallelism (long sequences)

# A Llama 3 70B-sized model (Dubey et al. 2024, Table 3: 80 layers, model dimension 8192, 64 heads, a
# 128K-token vocabulary, here 128,256 as released) as this planner's GPT: 4h MLP, full multi-head attention,
# learned positions (66.6B parameters), at the 131,072 tokens of Llama 3's long-context stage (Sec. 3.4.2).
LLAMA3_70B_128K = ModelConfig("70b-128k", n_layers=80, hidden=8192, heads=64, vocab=128256, seq_len=131072)


def test_at_128k_tokens_no_tp_x_pp_layout_fits_and_context_parallelism_does():
    """512 H100s, 32 sequences of 131,072 tokens. Without CP the leanest layout is full recomputation, which still keeps
    each layer's input: 2 s b h bytes x 80 layers = 2 x 131072 x 8192 x 80 = 171.8 GB on the first stage whatever TP
    and PP do (no sequence parallelism in this model), against 72 GB usable. CP divides that by cp."""
    cfg = LLAMA3_70B_128K
    with pytest.raises(NoFit, match=r"needs (17\d\.\d) GB per GPU > 72.0 GB usable .*leave cp to the planner") as e:
        plan(cfg, DGX_H100, 512, 32, cp=1)
    assert float(re.search(r"needs ([\d.]+) GB", str(e.value)).group(1)) > 2 * 131072 * 8192 * 80 / 1e9
    best = plan(cfg, DGX_H100, 512, 32)[0]
    assert best.fits and best.cp > 1 and best.gpus == 512
    assert describe(best).startswith(f"TP {best.tp} x CP {best.cp} x PP")
    assert any(line.startswith(f"CP {best.cp} cuts each sequence of 131072 tokens") for line in why(
        best, cfg, DGX_H100, 512, 32))


def test_llama_3s_128k_layout_fits_only_with_context_parallelism_and_is_near_the_best():
    """Dubey et al. 2024, Table 4: the 405B's 128K stage ran on 16,384 H100s as TP 8 x CP 16 x PP 16 x DP 8, 16M
    tokens per batch (128 sequences of 131,072). Its shape (Table 3: 126 layers of 16384, 128 heads) with 128 layers
    here, so that 16 stages are equal (Sec. 3.3.2: Llama 3 took one layer off the first and the last stage)."""
    cfg = replace(LLAMA3_70B_128K, name="405b-128k", n_layers=128, hidden=16384, heads=128)
    with pytest.raises(NoFit):
        plan(cfg, DGX_H100, 16384, 128, cp=1)
    published = plan(cfg, DGX_H100, 16384, 128, tp=8, cp=16, pp=16)[0]
    best = plan(cfg, DGX_H100, 16384, 128)[0]
    assert (published.dp, published.fits) == (8, True)
    assert best.cp == 16 and published.step_time_s <= 1.05 * best.step_time_s


def test_the_ring_and_the_other_terms_under_cp_by_hand():
    """dp 1 x tp 2 x pp 2 x cp 2 on two nodes of 4, 8 sequences of 512, hidden 1024: m = 8 micro-batches, 2 layers a
    stage, each rank holds 256 positions. One K (or V) block: 256 x 1024/2 x 2 bytes = 262,144 B. Per layer and
    micro-batch the ring sends (Liu et al. 2023) K and V once forward (2 blocks), backward K and V again and the dK, dV
    sums in fp32 (2 + 4 blocks): 8 blocks over the CP group's tp x cp = 4 ranks, inside a node (100 GB/s). TP's 4
    all-reduces carry 256 x 1024 x 2 bytes each; PP sends b s h / (tp cp) = 262,144 B across nodes (a pipeline spans
    tp x cp x pp = 8 ranks); the gradients are reduced over the dp x cp = 2 ranks that hold them."""
    machine = ROUND
    cfg = ModelConfig("small", n_layers=4, hidden=1024, heads=8, vocab=1024, seq_len=512)
    c = evaluate(cfg, machine, 8, 8, dp=1, tp=2, pp=2, cp=2, micro_batch=1)
    m, block = 8, 262_144
    assert c.microbatches == m and c.gpus == 8
    assert c.cp_comm_s == pytest.approx(m * 2 * 8 * block / 100e9)
    assert c.tp_comm_s == pytest.approx(m * 2 * 4 * 256 * 1024 * 2 / 100e9)
    assert c.pp_comm_s == pytest.approx(2 * (m + 1) * block / 10e9)
    share = -(-count_params(cfg, padded=True) // 4)
    assert c.dp_comm_s == pytest.approx(all_reduce_ring(2 * share, 2, 0, 1 / 10e9))
    micro_batches, _ = _compute_by_hand(cfg, machine, 256, 2, 2, 2, m)
    assert c.bubble_s == pytest.approx((micro_batches + c.tp_comm_s + c.cp_comm_s) / m)
    full = evaluate(cfg, machine, 8, 8, dp=1, tp=2, pp=2, cp=2, micro_batch=1, recompute="full")
    assert full.cp_comm_s == pytest.approx(m * 2 * (2 * 2 + 6) * block / 100e9)  # the forward's sends twice


def test_sequence_parallelism_and_a_fused_kernel_shrink_what_a_layout_keeps():
    """The framework's kernels change the memory evaluate counts, with and without CP: sequence parallelism cuts
    the norms' and dropouts' activations over TP (Korthikanti et al. 2022, Sec. 4.2.2), a fused attention kernel
    keeps no s x s scores (selective recomputation's count)."""
    cfg = PRESETS["175b"]
    plain = evaluate(cfg, FRONTIER, 128, 640, dp=2, tp=4, pp=16, micro_batch=1, zero=1)
    assert evaluate(cfg, FRONTIER, 128, 640, dp=2, tp=4, pp=16, micro_batch=1, zero=1,
                    framework=Framework(flash_attention=True)).memory_per_gpu == evaluate(
        cfg, FRONTIER, 128, 640, dp=2, tp=4, pp=16, micro_batch=1, zero=1, recompute="selective").memory_per_gpu
    assert evaluate(cfg, FRONTIER, 128, 640, dp=2, tp=4, pp=16, micro_batch=1, zero=1,
                    framework=Framework(sequence_parallel=True)).memory_per_gpu < plain.memory_per_gpu
    long = replace(PRESETS["llama3-8b"], seq_len=131072)
    kept = {sp: evaluate(long, DGX_H100, 64, 8, dp=1, tp=4, pp=1, cp=16, framework=Framework(True, sp)).memory_per_gpu
            for sp in (False, True)}
    assert kept[True] < kept[False], kept


def test_memory_under_cp_by_hand():
    """The same layout, ZeRO-1, mixed precision. Model states: the tp x pp = 4 split of the parameters psi, 2 + 2 bytes
    each, the 12 bytes of the optimizer sharded over the dp x cp = 2 ranks. Activations (Korthikanti et al. 2022 with
    ring attention's no scores, s / cp positions): (10 + 24 / t) s b h / cp = 22 x 256 x 1024 bytes per layer, 4
    layers on the first stage, and once the pair of K/V blocks in flight (Liu et al. 2023): 2 x 262,144 bytes."""
    cfg = ModelConfig("small", n_layers=4, hidden=1024, heads=8, vocab=1024, seq_len=512)
    c = evaluate(cfg, FRONTIER, 8, 8, dp=1, tp=2, pp=2, cp=2, zero=1)
    psi = -(-count_params(cfg, padded=True) // 4)
    assert c.memory_per_gpu == 2 * psi + 2 * psi + 12 * psi // 2 + 4 * 22 * 256 * 1024 + 2 * 262_144


def test_cp_is_tried_only_where_each_block_can_hide_its_sends():
    """Liu et al. 2023, Sec. 3: a block of c positions hides its K/V sends when c >= F / B. On a DGX H100's NVLink,
    989.4e12 / 450e9 = 2199 positions: at 131,072 tokens cp up to 32 (4096 positions), not 64 (2048); at 2048
    tokens no cp > 1 on any of the machines, so the plans of the 2048-token models are those of DP x TP x PP."""
    assert context_degrees(131072, DGX_H100) == [1, 2, 4, 8, 16, 32]
    assert all(context_degrees(2048, machine) == [1] for machine in MACHINE_NAMES.values())
    assert {c.cp for c in plan(PRESETS["175b"], FRONTIER, 128, 640)} == {1}
    assert {c.cp for c in plan(PRESETS["175b"], FRONTIER, 128, 640, cp=2)} == {2}  # pinned, it is planned


def test_megatron_deepspeed_arguments_are_refused_for_a_cp_layout():
    c = plan(LLAMA3_70B_128K, DGX_H100, 512, 32)[0]
    for emit in (lambda: megatron_arguments(c, LLAMA3_70B_128K, 32), lambda: deepspeed_config(c, 32)):
        with pytest.raises(ValueError, match="uses context parallelism, which the workshop's Megatron-DeepSpeed fork"):
            emit()


# BLOOM-176B's published layout (Le Scao et al. 2022, Sec. 3.4): 70 layers on 12 pipeline stages, TP 4, DP 8, 384 A100s
BLOOM_LIKE = ModelConfig("bloom-like", n_layers=70, hidden=14336, heads=112, vocab=250880, seq_len=2048)


def test_a_pipeline_of_stages_that_do_not_divide_the_layers_is_priced_by_its_fullest_stage():
    """pp 12 on 70 layers: the fullest stage holds ceil(70 / 12) = 6 layers (its compute by hand:
    test_the_last_stage_holds_the_head_unless_the_split_is_uneven) and 6 of the 70 layers' model states. The
    planner proposes even splits only; an uneven one must be asked for."""
    uneven = evaluate(BLOOM_LIKE, DGX_A100, 240, 2400, dp=5, tp=4, pp=12, recompute="full")
    even = evaluate(BLOOM_LIKE, DGX_A100, 240, 2400, dp=6, tp=4, pp=10, recompute="full")
    assert uneven.compute_s > even.compute_s * 6 / 7    # a stage of 6 layers against 7, with 2400 / 5 micro-batches
    held = count_params(BLOOM_LIKE, padded=True)
    bloom = evaluate(BLOOM_LIKE, DGX_A100, 384, 2048, dp=8, tp=4, pp=12, micro_batch=2, zero=1, recompute="full")
    assert bloom.fits and bloom.microbatches == 128
    assert bloom.memory_per_gpu > held * 6 / 70 / 4 * 2, "at least the fullest stage's 16-bit weights"
    with pytest.raises(NoFit, match="give a --pp that does not divide the layers"):
        plan(BLOOM_LIKE, DGX_A100, 384, 2048)   # it proposes divisors of 70 only, and none splits 384 GPUs and 2048
    assert all(c.pp == 12 for c in plan(BLOOM_LIKE, DGX_A100, 384, 2048, pp=12))
