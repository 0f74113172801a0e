"""3D parallelism is proven against `single`: on a 2 x 2 x 2 grid of 8 ranks and on the grids
that leave one axis out, `labsupport train --strategy 3d` gives single's losses and gradient
norms step by step (fp32, 10 steps), with DDP or ZeRO-1 over the DP groups, under the interleaved
schedule, and on the Llama preset (grouped-query attention, SwiGLU, an untied head); a planted
misalignment of the tied matrix's ZeRO shards is caught; each group carries only its own traffic;
a run resumed from its checkpoint is bit for bit the run that never stopped; bad grids are refused
in one line before any rank starts."""
import json
import os
from pathlib import Path

import pytest

from conftest import cli
from harness import (LLAMA, MICRO, NANO_10, assert_same_as_single, assert_traffic_in, group_traffic, prefetch, resume,
                     single, train)
from labsupport.estimate.schedules import schedule
from labsupport.estimate.tp_comm import total, tp_comm
from labsupport.parallel import ParallelConfig
from labsupport.parallel.mesh import Mesh

GRID = ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2"]
GRIDS_OF_FOUR = [
    ["--dp", "1", "--tp", "2", "--pp", "2", "--microbatches", "4"],                      # TP x PP, 1F1B
    ["--dp", "2", "--tp", "1", "--pp", "2", "--zero", "1", "--schedule", "gpipe", "--microbatches", "2"],
    ["--dp", "2", "--tp", "2", "--pp", "1", "--microbatches", "2"],                      # DP x TP, accumulating
    ["--dp", "2", "--tp", "2", "--pp", "1", "--zero", "1", "--sequence-parallel"],         # DP x TP with SP, ZeRO-1
]
INTERLEAVED = ["--dp", "2", "--pp", "2", "--zero", "1", "--schedule", "interleaved", "--chunks", "2",
               "--microbatches", "2"]
LLAMA_GRID = GRID  # on llama-micro: 4 query heads on 2 K/V heads, so tp 2 splits whole query groups


@pytest.fixture(scope="module")
def runs():
    """This file's runs on 4 ranks and their references, trained ahead in one launch per world size
    (harness.prefetch); the 8-rank grid is one run (its test reads its launch's traces)."""
    prefetch(("single", 1, (), NANO_10), ("single", 1, ("--micro-batch", "2"), MICRO), ("single", 1, (), LLAMA),
             *[("3d", 4, extra, NANO_10) for extra in GRIDS_OF_FOUR], ("3d", 4, INTERLEAVED, MICRO))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_by_two_by_two_with_zero1_matches_single():
    out = train("3d", 8, *GRID, settings=NANO_10)
    assert (out["parallel"]["dp"], out["parallel"]["tp"], out["parallel"]["pp"], out["parallel"]["zero"]) == (2, 2, 2, 1)
    # the sampled text too: full logits on every rank (the vocabulary shards gathered over TP, then
    # broadcast from the last stage)
    assert_same_as_single(out, single(settings=NANO_10))


@pytest.mark.multiprocess
@pytest.mark.parametrize("extra", GRIDS_OF_FOUR, ids=["1x2x2", "2x1x2-zero1", "2x2x1", "2x2x1-sp-zero1"])
def test_grids_without_one_axis_match_single(runs, extra):
    out = train("3d", 4, *extra, settings=NANO_10)
    assert_same_as_single(out, single(settings=NANO_10))
    degrees = {axis: int(extra[extra.index(f"--{axis}") + 1]) for axis in ("dp", "tp", "pp")}
    used = {axis for axis, degree in degrees.items() if degree > 1} | ({"embedding"} if degrees["pp"] > 1 else set())
    assert_traffic_in(out, used, exact=True)  # an axis of degree 1 carries nothing


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_by_two_by_two_on_the_llama_preset_matches_single(runs):
    """dp 2 x tp 2 x pp 2 with ZeRO-1 on llama-micro: each TP rank holds one query group (2 query heads and
    their K/V head) and half of SwiGLU's gate, up and down; 1F1B over 2 stages of 2 layers; the untied head
    is the last stage's own, so nothing travels in the embedding group."""
    out = train("3d", 8, *LLAMA_GRID, settings=LLAMA)
    assert (out["parallel"]["dp"], out["parallel"]["tp"], out["parallel"]["pp"]) == (2, 2, 2)
    assert_same_as_single(out, single(settings=LLAMA))
    assert_traffic_in(out, {"dp", "tp", "pp"}, exact=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_interleaved_schedule_syncs_each_chunk_in_its_last_backward(runs):
    """micro's 4 layers as 2 chunks per stage: each chunk's gradients are final after its own last
    backward, where DP's buckets go out; ZeRO-1 still matches single."""
    out = train("3d", 4, *INTERLEAVED, settings=MICRO)
    assert_same_as_single(out, single("--micro-batch", "2", settings=MICRO))
    assert out["comm_groups"][0]["dp"]["reduce_scatter"]["calls"] == 2, "once per step, not per micro-batch"


PLANTED = """
from labsupport.parallel import ddp
_init = ddp.DataParallel.__init__
def __init__(self, module, group=None, **options):
    _init(self, module, group, **{**options, "own_bucket": ()})
ddp.DataParallel.__init__ = __init__
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_planted_tied_matrix_in_a_shared_bucket_is_caught(tmp_path):
    """Without a bucket of its own, ZeRO-1 cuts the tied matrix differently on the first and the last
    stage, so the embedding group adds one stage's averaged shard to the other's unaveraged gradient.
    (Planted through a sitecustomize that every rank imports.)"""
    (tmp_path / "sitecustomize.py").write_text(PLANTED)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = train("3d", 8, *GRID, settings=NANO_10, env=env)
    with pytest.raises(AssertionError, match="^losses differ"):  # by more than 1e-4
        assert_same_as_single(out, single(settings=NANO_10), loss_tol=1e-4)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_group_carries_only_its_own_traffic():
    """The last step of the 2 x 2 x 2 run, per rank and group: TP all-reduces inside TP groups,
    sends and receives between neighbouring stages of one pipeline, ZeRO-1's reduce-scatter and
    all-gather inside DP groups, one all-reduce of the tied matrix per embedding group; besides,
    each of the three axes carries the norm's one float64 all-reduce."""
    out = train("3d", 8, *GRID, settings=NANO_10)
    assert_traffic_in(out, {"tp", "pp", "dp", "embedding"}, exact=True)
    m, micro, seq, hidden, vocab = 2, 2, 64, 64, 64
    activation = micro * seq * hidden * 4
    norm = {"calls": 1, "payload_bytes": 8}
    for rank in range(8):
        mesh = Mesh(2, 2, 2, rank)
        first, last = mesh.is_first_stage, mesh.is_last_stage
        ops = group_traffic(out, rank)
        assert set(ops["tp"]) == {"all_reduce"}
        predicted = total(tp_comm(1, hidden, seq, micro, microbatches=m, embedding=first, head=last), 2)
        assert ops["tp"] == {op: {k: c[k] for k in ("calls", "payload_bytes")} for op, c in predicted.items()}, rank
        sends = sum(a.op.startswith("SEND") for a in schedule("1f1b", 2, m)[mesh.pp_rank])
        assert ops["pp"] == {"send": {"calls": sends, "payload_bytes": sends * activation},
                             "recv": {"calls": sends, "payload_bytes": sends * activation}, "all_reduce": norm}, rank
        assert set(ops["dp"]) == {"reduce_scatter", "all_gather", "all_reduce"} and ops["dp"]["all_reduce"] == norm
        assert ops["dp"]["reduce_scatter"]["calls"] == ops["dp"]["all_gather"]["calls"] == 2, "two buckets: the tied one alone"
        assert ops["dp"]["reduce_scatter"]["payload_bytes"] == ops["dp"]["all_gather"]["payload_bytes"]
        assert ops["dp"]["all_gather"]["payload_bytes"] == out["memory"][rank]["params"], "the stage's TP shard, whole"
        assert ops["embedding"] == {"all_reduce": {"calls": 1, "payload_bytes": vocab // 2 * hidden * 4}}, rank
    # point to point stays between neighbours of one pipeline (the traced last step names each peer)
    for rank in range(8):
        mesh = Mesh(2, 2, 2, rank)
        trace = json.loads((Path(out["run_dir"]) / f"trace-rank{rank}.json").read_text())
        peers = {e["peer"] for e in trace["events"] if e["op"] in ("send", "recv")}
        assert peers == {mesh.next_stage_rank if mesh.is_first_stage else mesh.prev_stage_rank}, rank


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_resumed_run_is_bit_identical(tmp_path):
    """Every rank checkpoints its TP shard of its stage and its ZeRO-1 shard of the Adam moments;
    the run resumed from its step-5 checkpoint reports the same 10 losses and norms as the run that
    never stopped, bit for bit. (That a run killed mid-write leaves a checkpoint to resume from is
    the checkpoint code's, the same for every strategy: test_train's killed run holds it.)"""
    full = train("3d", 8, *GRID, settings=NANO_10)
    resumed = resume(full, 5, tmp_path)
    assert resumed["resumed_from"] == 5
    assert resumed["losses"] == full["losses"] and resumed["grad_norms"] == full["grad_norms"]


@pytest.mark.parametrize("args, message", [
    (["--nproc", "4", "--dp", "2", "--tp", "2", "--pp", "2"],
     "--dp 2 x --tp 2 x --pp 2 = 8 ranks, but the run has 4 (--nproc); make dp x tp x pp equal the number of ranks"),
    (["--nproc", "8", "--tp", "2", "--pp", "2", "--zero", "2"], "ZeRO-2 frees the full gradients the tensor- and "
                                                                 "pipeline-parallel steps still reduce"),
    (["--nproc", "8", "--tp", "2", "--pp", "2", "--zero", "3"], "ZeRO-3 shards whole units over the DP group; it "
                                                                 "does not compose with --tp or --pp here"),
    (["--nproc", "4", "--tp", "2", "--pp", "2", "--zero", "1"], "ZeRO-1/2: stage 1 shards over the data-parallel "
                                                                 "ranks, but this grid has --dp 1"),
    (["--nproc", "8", "--tp", "8"], "--tp 8 must divide the model's heads (4)"),
    (["--nproc", "8", "--tp", "2", "--pp", "4"], "--pp 4 x --chunks 1 = 4 pipeline chunks must divide the model's "
                                                 "2 layers"),
    (["--nproc", "8", "--tp", "2", "--pp", "2", "--global-batch", "6"],
     "the 3 sequences each data-parallel rank gets per step do not split into --pp 2 micro-batches"),
    (["--nproc", "4", "--tp", "2", "--pp", "2", "--sequence-parallel"],
     "--sequence-parallel does not combine with --pp yet"),
])
def test_bad_grids_fail_before_start(tmp_path, args, message):
    res = cli("train", "--strategy", "3d", "--model", "nano", *args, "--run-dir", tmp_path / "run")
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists(), "no rank started"


def test_three_d_configurations_are_checked_without_ranks():
    config = ParallelConfig.build(8, "3d", tp=2, pp=2, microbatches=2)
    assert (config.dp, config.zero) == (2, 0), "dp from what tp x pp leave; DDP unless --zero 1"
    assert config.micro_batch_size(8) == 2 and config.layout()["zero"] == 0
