"""The references our ZeRO is measured against (torch-zero1, torch-fsdp, accelerate-fsdp) are proven
like it: same losses and gradient norms as `single`, and the memory each claims to divide, divided."""
import textwrap

import pytest

from conftest import cli
from harness import LLAMA, assert_same_as_single, prefetch, resume, single, train
from labsupport.launch import launch
from labsupport.parallel import ParallelConfig

pytestmark = pytest.mark.multiprocess


# Each reference's run on 2 ranks, which the memory and the resume tests below read too
TWO_RANKS = {"torch-zero1": [], "torch-fsdp": ["--micro-batch", "2"], "accelerate-fsdp": [],
             "accelerate-deepspeed": ["--zero", "1", "--micro-batch", "2"]}


# Each reference on 2 and on 4 ranks, once with and once without gradient accumulation
# (the whole cross product would not fit the CPU budget of the suite), and Accelerate's other two shardings.
RUNS = [
    ("torch-zero1", 2, TWO_RANKS["torch-zero1"]),
    ("torch-zero1", 4, ["--micro-batch", "1"]),      # 2 accumulation steps under DDP's no_sync
    ("torch-fsdp", 2, TWO_RANKS["torch-fsdp"]),      # a reduce-scatter per micro-batch, added into the shard
    ("torch-fsdp", 4, []),
    ("accelerate-fsdp", 2, TWO_RANKS["accelerate-fsdp"]),  # FULL_SHARD, the default
    ("accelerate-fsdp", 4, ["--micro-batch", "1"]),  # FSDP's no_sync
    ("accelerate-fsdp", 2, ["--zero", "2"]),         # SHARD_GRAD_OP
    ("accelerate-fsdp", 2, ["--zero", "0"]),         # NO_SHARD (the run the memory test reads too)
    ("accelerate-deepspeed", 2, TWO_RANKS["accelerate-deepspeed"]),  # accumulated in DeepSpeed; ZeRO-3: test_accelerate_launch
]


# llama-micro's runs (harness.LLAMA): torch's FSDP2 and ZeRO-1 shard it as they shard nano
LLAMA_RUNS = [("torch-fsdp", 2, []), ("torch-zero1", 2, [])]


@pytest.fixture(scope="module")
def runs():
    """This file's training runs, trained ahead in one launch per world size (harness.prefetch)."""
    prefetch(("single", 1, ()), *RUNS, ("single", 1, (), LLAMA), *[(s, n, e, LLAMA) for s, n, e in LLAMA_RUNS])


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", LLAMA_RUNS)
def test_the_llama_family_matches_single_step_by_step(runs, strategy, nproc, extra):
    out = train(strategy, nproc, *extra, settings=LLAMA)
    assert out["model"]["name"] == "llama-micro"
    assert_same_as_single(out, single(settings=LLAMA), params="rows" if strategy == "torch-fsdp" else "whole")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", RUNS)
def test_reference_matches_single_step_by_step(runs, strategy, nproc, extra):
    out = train(strategy, nproc, *extra)
    stage = int(extra[1]) if extra[:1] == ["--zero"] else {"torch-zero1": 1}.get(strategy, 3)
    assert out["world_size"] == nproc and out["parallel"]["zero"] == stage
    # torch-fsdp: rank 0's file holds its rows of each tensor (Shard(0)): the first ones
    assert_same_as_single(out, single(), params="rows" if strategy == "torch-fsdp" else "whole")


@pytest.mark.slow
def test_each_reference_divides_what_it_shards(runs):
    """Per rank, against `single`'s full model states: torch-zero1 holds 1/N of the Adam moments
    (whole parameters per rank, so only to a parameter's size), torch-fsdp and accelerate-fsdp 1/N
    of parameters, gradients and moments (within the padding); --zero 0 (NO_SHARD) divides nothing."""
    n, base = 2, single()["memory"][0]
    divided = {"torch-zero1": {"optimizer"}, "torch-fsdp": {"params", "grads", "optimizer"},
               "accelerate-fsdp": {"params", "grads", "optimizer"}}
    runs = {strategy: train(strategy, n, *TWO_RANKS[strategy]) for strategy in divided}
    divided["no-shard"], runs["no-shard"] = set(), train("accelerate-fsdp", n, "--zero", "0")
    for strategy, out in runs.items():
        for rank in range(n):
            for key in ("params", "grads", "optimizer"):
                expected = base[key] / n if key in divided[strategy] else base[key]
                tolerance = 0.02 if strategy == "torch-zero1" else 0.005
                assert abs(out["memory"][rank][key] - expected) <= tolerance * base[key], (strategy, rank, key)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["torch-zero1", "torch-fsdp", "accelerate-fsdp", "accelerate-deepspeed"])
def test_reference_checkpoint_resumes_bit_identically(runs, tmp_path, strategy):
    """Each rank saves its shard of the optimizer state (torch-fsdp: of the parameters too; accelerate-deepspeed:
    DeepSpeed's engine saves its partition, as the deepspeed strategy's); resumed from step 10, a run reports
    the same 20 losses and norms as the run that never stopped."""
    full = train(strategy, 2, *TWO_RANKS[strategy])
    resumed = resume(full, 10, tmp_path)
    assert resumed["resumed_from"] == 10
    assert resumed["losses"] == full["losses"] and resumed["grad_norms"] == full["grad_norms"]


MAPPING = textwrap.dedent('''
    """The sharding strategy FSDP was given for each --zero, and how many elements this rank keeps."""
    import torch
    from labsupport import init, report
    from labsupport.model import TinyGPT, get_preset
    from labsupport.parallel import ParallelConfig, make_strategy
    with init(seed=0) as rt:
        seen = {}
        for zero in (3, 2, 0):  # one process: Accelerate's state is shared, each strategy must set its own
            strategy = make_strategy(rt, ParallelConfig.build(rt.world_size, "accelerate-fsdp", zero=zero))
            model = TinyGPT(get_preset("nano").with_vocab(57))
            full = sum(p.numel() for p in model.parameters())
            model = strategy.parallelize(model)
            seen[zero] = [model.sharding_strategy.name, sum(p.numel() for p in model.parameters()) / full]
        report(seen=seen)
''')


def test_accelerate_fsdp_maps_the_zero_stage_to_fsdp_sharding(tmp_path):
    script = tmp_path / "mapping.py"
    script.write_text(MAPPING)
    seen = launch(str(script), nproc=2, timeout=120, run_dir=tmp_path / "run").report(0)["seen"]
    names = {zero: name for zero, (name, _) in seen.items()}
    assert names == {"3": "FULL_SHARD", "2": "SHARD_GRAD_OP", "0": "NO_SHARD"}
    kept = {zero: share for zero, (_, share) in seen.items()}  # between steps, both shardings keep 1/N
    assert kept["3"] == kept["2"] == pytest.approx(0.5, abs=0.005) and kept["0"] == 1.0


def test_reference_stages_and_defaults():
    stages = {name: ParallelConfig.build(2, name).zero for name in ("torch-zero1", "torch-fsdp", "accelerate-fsdp")}
    assert stages == {"torch-zero1": 1, "torch-fsdp": 3, "accelerate-fsdp": 3}  # accelerate-fsdp: FULL_SHARD
    assert ParallelConfig.build(2, "accelerate-fsdp", zero=0).zero == 0  # NO_SHARD, when asked for
    assert ParallelConfig.build(2, "accelerate-deepspeed").zero == 2  # Accelerate's default stage


@pytest.mark.parametrize("args, message", [
    (["--strategy", "accelerate-fsdp", "--nproc", "2", "--zero", "1"], "strategy 'accelerate-fsdp' has no ZeRO-1"),
    (["--strategy", "accelerate-fsdp", "--nproc", "1"], "ZeRO-3: stage 3 shards over the data-parallel ranks, but this grid has --dp 1"),
    (["--strategy", "torch-fsdp", "--nproc", "2", "--zero", "2"], "'torch-fsdp' is ZeRO stage 3, but --zero 2"),
    (["--strategy", "torch-zero1", "--nproc", "1"], "ZeRO-1/2: stage 1 shards over the data-parallel ranks, but this grid has --dp 1"),
    (["--strategy", "accelerate-deepspeed", "--nproc", "2", "--zero", "0"], "'accelerate-deepspeed' needs ZeRO stage 1"),
])
def test_bad_reference_arguments_fail_before_start(args, message):
    res = cli("train", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
