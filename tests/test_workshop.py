"""The workshop's facts (estimate/workshop.py) against the decks' and the scripts' numbers, and
against each other: each run fills its nodes, splits its model evenly, and fits the memory model."""
import re

import pytest

from labsupport.estimate.planner import MACHINE_NAMES, evaluate
from labsupport.estimate.scaling import WORKSHOP
from labsupport.estimate.workshop import (DEEPHYPER_HANDS_ON, HANDS_ON, MEASURED_PEAK_FRACTION, PART_II_22B, PART_II_SRUN,
                                          PLANNER_PRECISION, SCRIPTS as ALL_SCRIPTS, STRONG_SCALING, TABLE_V, TABLE_VI)
from labsupport.model import get_preset

FRONTIER = MACHINE_NAMES["frontier"]
SCRIPTS = [*HANDS_ON.values(), PART_II_22B]


def test_table_vi_is_the_decks():
    """TABLE VI: TP 4 / 8, PP 16 / 64, MBS 1, GBS 640 / 1600, ZeRO stage 1, Flash Attention v2, fp16,
    checkpoint-activations True."""
    assert [(r.tp, r.pp, r.micro_batch, r.per_replica_batch, r.zero, r.flash_attention, r.precision,
             r.checkpoint_activations) for r in TABLE_VI.values()] == [
        (4, 16, 1, 640, 1, "v2", "fp16", True), (8, 64, 1, 1600, 1, "v2", "fp16", True)]
    assert all(r.recompute == "full" for r in TABLE_VI.values())


def test_strong_scaling_totals_split_evenly_over_table_vi_replicas():
    """Fig. 13: 8000 sequences on 1024 GPUs (89.93%), 8016 on 3072 (87.05%): 16 replicas of the 175B
    layout with 500 each, 6 of the 1T layout with 1336 each."""
    split = {}
    for model, s in STRONG_SCALING.items():
        replicas, rest = divmod(s.gpus, TABLE_VI[model].replica_gpus)
        assert rest == 0 and s.global_batch % replicas == 0
        split[model] = (replicas, s.global_batch // replicas, s.efficiency)
    assert split == {"175b": (16, 500, 0.8993), "1t": (6, 1336, 0.8705)}


def test_scaling_reads_its_runs_from_workshop():
    for model, row in TABLE_VI.items():
        assert WORKSHOP[model]["layout"] == row.layout()
        assert WORKSHOP[model]["per_replica_batch"] == row.per_replica_batch
        assert WORKSHOP[model]["strong_batch"] == STRONG_SCALING[model].global_batch


def test_the_hands_on_scripts_run_on_the_nodes_the_deck_names():
    """"Train a 22B model on 2 nodes", "a 175B model on 16 nodes", "a 1T model on 128 nodes"."""
    for script in HANDS_ON.values():
        assert script.nodes == int(re.search(r"on (\d+) nodes", script.deck).group(1))
        assert script.path.endswith("_bf16.slurm")
    assert {m: (s.dp, s.microbatches) for m, s in HANDS_ON.items()} == {
        "22b": (2, 320), "175b": (2, 320), "1t": (2, 512)}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.path)
def test_each_script_fills_its_nodes_and_splits_its_model_evenly(script):
    cfg = get_preset(script.model)
    assert script.gpus % (script.tp * script.pp) == 0
    assert script.global_batch % (script.dp * script.micro_batch) == 0
    assert cfg.n_layers % script.pp == 0 and script.heads % script.tp == 0 and cfg.hidden % script.heads == 0


def test_the_part_ii_22b_script_needs_its_four_nodes():
    """`#SBATCH -N 4`: 32 GCDs, exactly TP 4 x PP 8, one replica of 20 / 2 = 10 micro-batches. On the
    hands-on's 2 nodes (16 GCDs) Megatron would refuse TP 4 x PP 8."""
    assert (PART_II_22B.nodes, PART_II_22B.tp * PART_II_22B.pp, PART_II_22B.dp, PART_II_22B.microbatches) == (4, 32, 1, 10)
    assert HANDS_ON["22b"].gpus % (PART_II_22B.tp * PART_II_22B.pp) != 0


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.path)
def test_each_script_fits_a_gcd_in_the_memory_model(script):
    """The planner's memory model agrees that the workshop's runs fit a 64 GB GCD (at 2048 tokens;
    the 175B script's 4096 would double the activations)."""
    c = evaluate(get_preset(script.model), FRONTIER, script.gpus, script.global_batch, **script.layout(),
                 precision=PLANNER_PRECISION)
    assert c.fits


def test_table_v_is_the_search_space_the_deck_prints():
    assert TABLE_V == dict(pp=(1, 2, 4, 8, 12, 16), tp=(1, 2, 4, 8), micro_batch=(4, 20), gradient_accumulation=(5, 10),
                           zero1=(True, False), nodes=(12, 16))
    # Table VI's micro-batch 1 lies outside the searched [4, 20]: the final layouts were not drawn from it.
    assert all(r.micro_batch < TABLE_V["micro_batch"][0] for r in TABLE_VI.values())


def test_the_deephyper_hands_on_searches_a_small_model_on_four_nodes_per_sample():
    """The slide says "Find the best strategy for training a 22B model"; the script searches 24 x 2064."""
    dh = DEEPHYPER_HANDS_ON
    assert dh["gpus_per_sample"] == 4 * 8 and dh["nodes"] % 4 == 0
    assert (dh["layers"], dh["hidden"]) != (get_preset("22b").n_layers, get_preset("22b").hidden)
    assert all(dh["layers"] % pp == 0 for pp in dh["pp"]) and all(dh["heads"] % tp == 0 for tp in dh["tp"])


def test_the_part_ii_srun_scripts_are_read_flag_for_flag():
    """launch_gpt175b_srun.frontier: -N 24, TP 8 x PP 12, 96 x 12288, 96 heads, micro-batch 1, global 12, --fp16;
    launch_gpt1T_srun.frontier: -N 64, TP 8 x PP 64, 128 x 25600, 128 heads, micro-batch 1, global 8, --fp16.
    Neither passes --deepspeed, a DeepSpeed config or --checkpoint-activations."""
    got = {m: (s.nodes, s.tp, s.pp, get_preset(s.model).n_layers, get_preset(s.model).hidden, s.heads, s.micro_batch,
               s.global_batch, s.precision, s.deepspeed, s.ds_config, s.recompute) for m, s in PART_II_SRUN.items()}
    assert got == {"175b": (24, 8, 12, 96, 12288, 96, 1, 12, "fp16", False, None, "none"),
                   "1t": (64, 8, 64, 128, 25600, 128, 1, 8, "fp16", False, None, "none")}
    assert {m: (s.dp, s.microbatches) for m, s in PART_II_SRUN.items()} == {"175b": (2, 6), "1t": (1, 8)}
    assert all("--deepspeed" not in s.megatron_flags() for s in PART_II_SRUN.values())


def test_one_account_of_cuda_device_max_connections_per_script():
    """The fork turns the asynchronous TP all-reduce off under --deepspeed: the FA2 scripts, Part II's 22B and its
    launch_gpt_srun.frontier, and the DeepHyper search's samples pass it, so there nothing relies on the variable;
    the Part II srun scripts for 175B and 1T do not, and there the fork's validate_args refuses to start without it
    (would refuse, for the 175B one, whose pretrain_gpt_owt3.py neither repository holds). Every script exports it."""
    by_path = {(s.path, s.where): (s.deepspeed, s.async_tp_allreduce, s.requires_max_connections) for s in ALL_SCRIPTS}
    off, on = (True, False, False), (False, True, True)
    assert by_path == {("launch_gpt22b_bf16.slurm", "FA2"): off, ("launch_gpt175b_bf16.slurm", "FA2"): off,
                       ("launch_gpt1T_bf16.slurm", "FA2"): off, ("launch_gpt_srun.frontier", "FA2"): off,
                       ("launch_gpt22b_srun.frontier", "Part II"): off, ("launch_gpt_srun.frontier", "Part II"): off,
                       ("launch_gpt175b_srun.frontier", "Part II"): on, ("launch_gpt1T_srun.frontier", "Part II"): on,
                       ("launch_dh.frontier", "frontier-sd"): off}
    assert len(ALL_SCRIPTS) == len(by_path) == 9 and all(s.exports_max_connections for s in ALL_SCRIPTS)
    for s in ALL_SCRIPTS:
        said = s.max_connections()
        assert ("nothing in the fork relies on the order" in said) == s.deepspeed, said
        assert ("orders nothing" not in said and bool(re.search(r"refuses? to start", said)) == s.requires_max_connections)
        assert ("would refuse" in said) == (not s.entry_in_repository), said
        assert ("the LM head" in said) == s.async_tp_allreduce, said
    assert [s.path for s in ALL_SCRIPTS if not s.entry_in_repository] == ["launch_gpt175b_srun.frontier"]


def test_the_measured_throughputs_are_the_papers():
    """Dash et al. 2023, abstract: "38.38%, 36.14%, and 31.96%" for 22B, 175B and 1T; of a GCD's 191.5 TFLOP/s,
    about 73.5, 69.2 and 61.2 TFLOP/s."""
    assert MEASURED_PEAK_FRACTION == {"22b": 0.3838, "175b": 0.3614, "1t": 0.3196}
    assert [round(f * FRONTIER.peak_tflops_bf16, 1) for f in MEASURED_PEAK_FRACTION.values()] == [73.5, 69.2, 61.2]
