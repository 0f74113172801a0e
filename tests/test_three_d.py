"""3D parallelism is proven against `single`: on a 2 x 2 x 2 grid of 8 ranks and on the grids
that leave one axis out, `labsupport train --strategy 3d` gives single's losses and gradient
norms step by step (fp32, 10 steps), with DDP or ZeRO-1 over the DP groups, and under the
interleaved schedule; a planted misalignment of the tied matrix's ZeRO shards is caught; each
group carries only its own traffic; a run killed after a checkpoint resumes bit for bit; bad
grids are refused in one line before any rank starts."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from labsupport import checkpoint
from labsupport.estimate.schedules import schedule
from labsupport.estimate.tp_comm import total, tp_comm
from labsupport.parallel import ParallelConfig
from labsupport.parallel.mesh import Mesh

# nano: 2 layers (one per stage at pp 2), 4 heads and hidden 64 (tp 2 divides them), vocabulary 64
COMMON = ["--model", "nano", "--steps", "10", "--global-batch", "8", "--sample-chars", "12", "--eval-batches", "1"]
_RUNS: dict = {}


def train(tmp_path_factory, nproc, *extra):
    """`labsupport train --json` once per configuration in this module: (summary, checkpoint dir)."""
    key = (nproc, *extra)
    if key not in _RUNS:
        ckpt = tmp_path_factory.mktemp("ckpt")
        strategy = ["--strategy", "single"] if nproc == 1 else ["--strategy", "3d"]
        res = run_cli("train", *strategy, "--nproc", nproc, "--json", *COMMON, "--checkpoint-dir", ckpt, *extra)
        assert res.returncode == 0, res.stderr[-3000:]
        _RUNS[key] = json.loads(res.stdout.splitlines()[-1]), ckpt
    return _RUNS[key]


def run_json(strategy, nproc, *args, env=None):
    """One uncached run of `labsupport train --json`."""
    res = run_cli("train", "--strategy", strategy, "--nproc", nproc, "--json", *args, env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train(tmp_path_factory, 1)[0]


def assert_same_as_single(out, ref):
    """Losses within 1e-5 and the global gradient norm within 1e-4 relative at every step; the same
    validation loss, and the same sampled text (full logits on every rank: the vocabulary shards
    gathered over TP, then broadcast from the last stage)."""
    assert len(out["losses"]) == len(ref["losses"]) == 10
    diffs = [abs(a - b) for a, b in zip(out["losses"], ref["losses"])]
    assert max(diffs) <= 1e-5, diffs
    norms = [abs(a - b) / b for a, b in zip(out["grad_norms"], ref["grad_norms"])]
    assert max(norms) <= 1e-4, norms
    assert out["val_losses"][-1][1] == pytest.approx(ref["val_losses"][-1][1], abs=1e-5)
    assert out["sample"] == ref["sample"]


GRID = ["--dp", "2", "--tp", "2", "--pp", "2", "--zero", "1", "--microbatches", "2", "--checkpoint-every", "5"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_by_two_by_two_with_zero1_matches_single(tmp_path_factory, single):
    out, _ = train(tmp_path_factory, 8, *GRID)
    assert (out["parallel"]["dp"], out["parallel"]["tp"], out["parallel"]["pp"], out["parallel"]["zero"]) == (2, 2, 2, 1)
    assert_same_as_single(out, single)


@pytest.mark.multiprocess
@pytest.mark.parametrize("extra", [
    ["--dp", "1", "--tp", "2", "--pp", "2", "--microbatches", "4"],                      # TP x PP, 1F1B
    ["--dp", "2", "--tp", "1", "--pp", "2", "--zero", "1", "--schedule", "gpipe", "--microbatches", "2"],
    ["--dp", "2", "--tp", "2", "--pp", "1", "--microbatches", "2"],                      # DP x TP, accumulating
], ids=["1x2x2", "2x1x2-zero1", "2x2x1"])
def test_grids_without_one_axis_match_single(tmp_path_factory, single, extra):
    out, _ = train(tmp_path_factory, 4, *extra)
    assert_same_as_single(out, single)
    degrees = {axis: int(extra[extra.index(f"--{axis}") + 1]) for axis in ("dp", "tp", "pp")}
    used = {axis for axis, degree in degrees.items() if degree > 1} | ({"embedding"} if degrees["pp"] > 1 else set())
    for rank, groups in enumerate(out["comm_groups"]):
        assert set(groups) == used, (rank, "an axis of degree 1 carries nothing")


MICRO = ["--model", "micro", "--seq-len", "16", "--steps", "6", "--global-batch", "8", "--sample-chars", "0",
         "--eval-batches", "1"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_interleaved_schedule_syncs_each_chunk_in_its_last_backward():
    """micro's 4 layers as 2 chunks per stage: each chunk's gradients are final after its own last
    backward, where DP's buckets go out; ZeRO-1 still matches single."""
    ref = run_json("single", 1, "--micro-batch", "2", *MICRO)
    out = run_json("3d", 4, "--dp", "2", "--pp", "2", "--zero", "1", "--schedule", "interleaved",
                   "--chunks", "2", "--microbatches", "2", *MICRO)
    diffs = [abs(a - b) for a, b in zip(out["losses"], ref["losses"])]
    assert len(out["losses"]) == 6 and max(diffs) <= 1e-5, diffs
    norms = [abs(a - b) / b for a, b in zip(out["grad_norms"], ref["grad_norms"])]
    assert max(norms) <= 1e-4, norms
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
def test_planted_tied_matrix_in_a_shared_bucket_is_caught(tmp_path, single):
    """Without a bucket of its own, ZeRO-1 cuts the tied matrix differently on the first and the last
    stage, so the embedding group adds one stage's averaged shard to the other's unaveraged gradient.
    (Planted through a sitecustomize that every rank imports.)"""
    (tmp_path / "sitecustomize.py").write_text(PLANTED)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    out = run_json("3d", 8, *COMMON, *GRID[:-2], env=env)
    assert max(abs(a - b) for a, b in zip(out["losses"], single["losses"])) > 1e-4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_group_carries_only_its_own_traffic(tmp_path_factory, single):
    """The last step of the 2 x 2 x 2 run, per rank and group: TP all-reduces inside TP groups,
    sends and receives between neighbouring stages of one pipeline, ZeRO-1's reduce-scatter and
    all-gather inside DP groups, one all-reduce of the tied matrix per embedding group; besides,
    each of the three axes carries the norm's one float64 all-reduce."""
    out, _ = train(tmp_path_factory, 8, *GRID)
    m, micro, seq, hidden, vocab = 2, 2, 64, 64, 64
    activation = micro * seq * hidden * 4
    norm = {"calls": 1, "payload_bytes": 8}
    for rank, groups in enumerate(out["comm_groups"]):
        mesh = Mesh(2, 2, 2, rank)
        first, last = mesh.is_first_stage, mesh.is_last_stage
        ops = {group: {op: {k: c[k] for k in ("calls", "payload_bytes")} for op, c in by_op.items()}
               for group, by_op in groups.items()}
        assert set(ops) == {"tp", "pp", "dp", "embedding"}, rank
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
def test_a_killed_run_resumes_bit_identically(tmp_path_factory, tmp_path):
    """Every rank checkpoints its TP shard of its stage and its ZeRO-1 shard of the Adam moments;
    a run killed (SIGKILL to the whole launch) after its step-5 checkpoint and resumed reports the
    same 10 losses and norms as the run that never stopped, bit for bit."""
    full, _ = train(tmp_path_factory, 8, *GRID)
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, "-m", "labsupport.cli", "train", "--strategy", "3d", "--nproc", "8", "--json", *COMMON,
           *GRID, "--checkpoint-dir", str(ckpt)]
    victim = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240  # a bound against a hang, not a speed check
    while checkpoint.latest(ckpt) is None:
        assert time.monotonic() < deadline and victim.poll() is None
        time.sleep(0.02)
    os.killpg(victim.pid, signal.SIGKILL)  # the whole launch, mid-run, no cleanup
    victim.wait()
    assert checkpoint.latest(ckpt) == 5, "the run finished before it could be killed"
    res = run_cli("train", "--strategy", "3d", "--nproc", 8, "--json", *COMMON, *GRID, "--checkpoint-dir", ckpt,
                  "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    resumed = json.loads(res.stdout.splitlines()[-1])
    assert resumed["resumed_from"] == 5
    assert resumed["losses"] == full["losses"] and resumed["grad_norms"] == full["grad_norms"]


@pytest.mark.parametrize("args, message", [
    (["--nproc", "4", "--dp", "2", "--tp", "2", "--pp", "2"],
     "--dp 2 x --tp 2 x --pp 2 = 8 ranks, but the run has 4 (--nproc); make dp x tp x pp equal the number of ranks"),
    (["--nproc", "8", "--tp", "2", "--pp", "2", "--zero", "2"], "strategy '3d' composes ZeRO-1 only"),
    (["--nproc", "4", "--tp", "2", "--pp", "2", "--zero", "1"], "--zero 1 shards the optimizer states over "
                                                                 "data-parallel ranks, but --dp is 1"),
    (["--nproc", "8", "--tp", "8"], "--tp 8 must divide the model's heads (4)"),
    (["--nproc", "8", "--tp", "2", "--pp", "4"], "--pp 4 x --chunks 1 = 4 pipeline chunks must divide the model's "
                                                 "2 layers"),
    (["--nproc", "8", "--tp", "2", "--pp", "2", "--global-batch", "6"],
     "the 3 sequences each data-parallel rank gets per step do not split into --pp 2 micro-batches"),
    (["--nproc", "4", "--tp", "2", "--pp", "2", "--sequence-parallel"],
     "strategy '3d' does not combine --sequence-parallel yet"),
])
def test_bad_grids_fail_before_start(tmp_path, args, message):
    res = run_cli("train", "--strategy", "3d", "--model", "nano", *args, "--run-dir", tmp_path / "run")
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists(), "no rank started"


def test_three_d_configurations_are_checked_without_ranks():
    config = ParallelConfig.build(8, "3d", tp=2, pp=2, microbatches=2)
    assert (config.dp, config.zero) == (2, 0), "dp from what tp x pp leave; DDP unless --zero 1"
    assert config.micro_batch_size(8) == 2 and config.layout()["zero"] == 0
