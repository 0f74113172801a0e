"""ZeRO-1/2/3 are proven like DDP: same global batch and seed, same gradients, losses and parameters
as `single`; and they are what they claim: 1/N of the optimizer states, gradients, parameters per
rank, for the traffic the paper says."""
import textwrap

import pytest
import torch

from conftest import cases_on_ranks, cli
from harness import LLAMA, NANO, assert_same_as_single, assert_traffic_in, prefetch, resume, single, train
from labsupport import checkpoint

pytestmark = pytest.mark.multiprocess

# ---------------------------------------------------------------- library level: a tiny model, every step compared

CHECKS = textwrap.dedent('''
    """Every case of this world size, one after the other, each with its own strategy and groups;
    argv[1] lists them as JSON: (label, check, its arguments). Reports {label: what it found}."""
    import json, sys
    import torch
    from labsupport import comm, init, report
    from labsupport.model import ModelConfig, TinyGPT, lm_loss
    from labsupport.parallel import ParallelConfig, make_strategy
    from labsupport.parallel.clip import clip_grad_norm_
    from labsupport.parallel.optim import adamw
    from labsupport.parallel.zero import Partition, ShardedOptimizer


    def tiny_model(rt, stage, accum, prefetch, planted_sum):
        """Each rank trains the strategy's model on its share and, beside it, the single-device
        reference on the whole global batch. Before the step, this rank's gradient pieces must equal
        the matching slices of the reference's gradients, and the global norm the reference's norm;
        after the last step (the strategy lets go: ZeRO-3 gathers) the parameters must agree.
        hidden 2 and 1-element buckets: tensors with fewer elements than ranks. `planted_sum`: the
        reduce-scatter sums instead of averaging, for this case only."""
        failures = []
        cfg = ModelConfig("tiny", n_layers=2, hidden=2, heads=1, vocab=5, seq_len=4)
        strategy = make_strategy(rt, ParallelConfig.build(rt.world_size, stage, bucket_mb=1e-6,  # a bucket per tensor
                                                          prefetch=prefetch))
        torch.manual_seed(rt.rank)  # different init per rank: the strategy must broadcast
        model = strategy.parallelize(TinyGPT(cfg))
        torch.manual_seed(0)
        reference = TinyGPT(cfg)  # rank 0's initial values, which the strategy broadcast
        opt, ref_opt = strategy.make_optimizer(model, 1e-2, 0.1), adamw(reference.parameters(), 1e-2, 0.1)
        bare = model  # without a pipeline, the model itself
        units = strategy.steps[-1].handle.units if stage == "zero3" else None  # fully_shard's, root last
        names = {id(p): name for name, p in bare.named_parameters()}
        if stage == "zero3":  # is block 1 on its way while block 0 computes? (only with prefetch)
            in_flight = []
            bare.blocks["0"].register_forward_hook(
                lambda *_: in_flight.append(units[1].work is not None or units[1].gathered))
        ref_params = dict(reference.named_parameters())

        def pieces():  # (name, lo, hi, gradient of those elements) this rank owns
            if stage == "zero3":
                for unit in units:
                    for p, (lo, hi, at) in zip(unit.partition.params, unit.spans):
                        yield names[id(p)], lo, hi, p.grad
            else:
                for part, p, lo, hi, at, piece in opt._pieces:
                    yield names[id(p)], lo, hi, piece.grad

        reduce_scatter = comm.reduce_scatter_tensor
        if planted_sum:
            comm.reduce_scatter_tensor = lambda out, inp, op, **kw: reduce_scatter(out, inp, "sum", **kw)
        n, per = rt.world_size, 2 * accum
        data = torch.Generator().manual_seed(1)
        for step in range(5):
            x = torch.randint(0, 5, (n * per, 4), generator=data)
            y = torch.randint(0, 5, (n * per, 4), generator=data)
            lm_loss(reference(x), y).backward()
            ref_norm = clip_grad_norm_(reference.parameters(), 0.5)
            mine = slice(rt.rank * per, (rt.rank + 1) * per)
            opt.zero_grad(set_to_none=True)
            loss = strategy.forward_backward(model, list(zip(x[mine].chunk(accum), y[mine].chunk(accum))))
            strategy.finish_backward(model)
            owned = list(pieces())
            norm = strategy.clip_grad_norm_(model, 0.5)
            if abs(norm - ref_norm) > 1e-5 * ref_norm:
                failures.append(f"step {step}: norm {norm} vs {ref_norm}")
            for name, lo, hi, grad in owned:
                if hi > lo:
                    want = ref_params[name].grad.reshape(-1)[lo:hi]
                    if grad is None or not torch.allclose(grad, want, atol=1e-7, rtol=1e-5):
                        diff = "missing" if grad is None else f"{(grad - want).abs().max().item():.2e}"
                        failures.append(f"step {step}: grad of {name}[{lo}:{hi}] differs: {diff}")
            opt.step(); ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
            if stage != "zero3":  # replicated parameters: compare them every step
                for name, p in bare.named_parameters():
                    if not torch.allclose(p, ref_params[name], atol=1e-6, rtol=1e-5):
                        failures.append(f"step {step}: {name} differs by {(p - ref_params[name]).abs().max().item():.2e}")
        strategy.close(model)
        comm.reduce_scatter_tensor = reduce_scatter
        for name, p in bare.named_parameters():
            if p.shape != ref_params[name].shape or not torch.allclose(p, ref_params[name], atol=1e-6, rtol=1e-5):
                failures.append(f"after training: {name} differs")
        if stage == "zero3" and set(in_flight) != {prefetch}:
            failures.append(f"prefetch {prefetch}, but block 1 in flight during block 0: {set(in_flight)}")
        return dict(failures=failures, owned=sum(hi - lo for _, lo, hi, _ in pieces()) if stage != "zero3" else None)


    def sharding(rt):
        """5 elements (a 3-element and a 2-element parameter) on 4 ranks: padded to 8, two per rank,
        the last rank all padding; ranks hold disjoint pieces that cover every element once, and the
        optimizer holds moments for its pieces only."""
        a, b = torch.nn.Parameter(torch.arange(3.0)), torch.nn.Parameter(torch.ones(2, 1))
        part = Partition([a, b], None)
        opt = ShardedOptimizer([a, b], torch.optim.AdamW, None, lr=0.1)
        for p in (a, b):
            p.grad = torch.ones_like(p)
        opt.shard_gradients()
        opt.step()
        return dict(padded=part.padded, shard=part.shard_size,
                    pieces=[(["a", "b"][p is b], lo, hi, at) for p, lo, hi, at in part.pieces()],
                    moments=sum(s["exp_avg"].numel() for s in opt.state.values()),
                    a=a.tolist(), b=b.flatten().tolist())


    with init(seed=0) as rt:
        for label, check, *args in json.loads(sys.argv[1]):
            try:
                report(**{label: {"tiny_model": tiny_model, "sharding": sharding}[check](rt, *args)})
            except Exception as e:
                raise RuntimeError(f"case {label!r} failed: {type(e).__name__}: {e}") from e
''')

TINY_CASES = [("zero1", 4, 1, "-"), ("zero2", 4, 2, "-"), ("zero3", 4, 1, "prefetch"), ("zero3", 3, 2, "no-prefetch")]
PLANTED_SUM = "planted: sum instead of average in the reduce-scatter"
# every case: {label: (ranks, check, its arguments)}
CASES = {
    **{f"{stage} on {nproc} ranks, {accum} micro-batch(es), {prefetch}": (nproc, "tiny_model", stage, accum,
                                                                         prefetch == "prefetch", False)
       for stage, nproc, accum, prefetch in TINY_CASES},
    PLANTED_SUM: (2, "tiny_model", "zero3", 1, True, True),
    "sharding": (4, "sharding"),
}


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """`checks(label)`: the case's report per rank, every case of N ranks in one launch."""
    return cases_on_ranks(tmp_path_factory, CHECKS, CASES)


@pytest.mark.parametrize("stage, nproc, accum, prefetch", TINY_CASES)
def test_tiny_model_gradients_match_single_device_every_step(checks, stage, nproc, accum, prefetch):
    for rank, rep in enumerate(checks(f"{stage} on {nproc} ranks, {accum} micro-batch(es), {prefetch}")):
        assert rep["failures"] == [], f"rank {rank}"


def test_planted_sum_instead_of_average_in_the_reduce_scatter_is_caught(checks):
    """Summing the gradients' shards instead of averaging them leaves AdamW's steps almost
    unchanged, and clipping to a norm hides the scale from the clipped gradients: the norm
    comparison must catch it (and the gradients, once a step's norm is under the limit)."""
    failures = checks(PLANTED_SUM)[0]["failures"]
    assert any(f.startswith("step 0: norm") for f in failures) and any(": grad of" in f for f in failures), failures


def test_a_tensor_smaller_than_the_group_is_padded_and_every_element_owned_once(checks):
    reports = checks("sharding")
    assert {(r["padded"], r["shard"]) for r in reports} == {(8, 2)}  # 5 elements -> 8
    owned = sorted((name, i) for r in reports for name, lo, hi, _ in r["pieces"] for i in range(lo, hi))
    assert owned == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
    assert [r["moments"] for r in reports] == [2, 2, 1, 0]
    assert all(r["a"] == reports[0]["a"] and r["b"] == reports[0]["b"] for r in reports), "all-gather"
    assert reports[0]["a"] != [0.0, 1.0, 2.0], "every element took its step"


# ---------------------------------------------------------------- the CLI: equivalence, memory, traffic

RUNS = [
    ("zero1", 2, []),
    ("zero1", 2, ["--micro-batch", "2"]),                 # 2 accumulation steps under DDP's no_sync
    ("zero2", 2, []),
    ("zero2", 2, ["--bucket-mb", "0.05", "--micro-batch", "2"]),  # several buckets, reduce-scattered in backward
    ("zero3", 2, []),
    ("zero3", 2, ["--micro-batch", "2"]),                 # a reduce-scatter per micro-batch, accumulated in the shard
    ("zero3", 4, ["--micro-batch", "1"]),  # zero1 and zero2 on 4 ranks: the tiny-model test above
]
# llama-micro's runs (harness.LLAMA): each stage shards whatever the model holds
LLAMA_RUNS = [("zero1", 2, []), ("zero2", 2, []), ("zero3", 2, [])]


@pytest.fixture(scope="module")
def runs():
    """This file's runs, trained ahead in one launch per world size (harness.prefetch)."""
    prefetch(("single", 1, ()), ("single", 1, ("--dtype", "bf16")), ("ddp", 2, ()), ("zero3", 2, ("--dtype", "bf16")),
             *RUNS, ("hsdp", 4, HSDP), ("single", 1, (), LLAMA), *[(s, n, e, LLAMA) for s, n, e in LLAMA_RUNS])


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", RUNS)
def test_zero_matches_single_step_by_step(runs, strategy, nproc, extra):
    out = train(strategy, nproc, *extra)
    assert out["world_size"] == nproc and out["parallel"]["zero"] == int(strategy[-1])
    # ZeRO-3: rank 0's file holds its shard: of each parameter, the first elements or none
    assert_same_as_single(out, single(), params="flat" if strategy == "zero3" else "whole")


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", LLAMA_RUNS)
def test_the_llama_family_matches_single_step_by_step(runs, strategy, nproc, extra):
    out = train(strategy, nproc, *extra, settings=LLAMA)
    assert out["parallel"]["zero"] == int(strategy[-1]) and out["model"]["name"] == "llama-micro"
    assert_same_as_single(out, single(settings=LLAMA), params="flat" if strategy == "zero3" else "whole")


HSDP = ("--dp-replicate", "2", "--micro-batch", "1")  # 2 replicas of 2 ranks, in the 4-rank launch of zero3's


@pytest.mark.slow
def test_hybrid_sharding_equals_single_and_talks_within_its_replica_and_across(runs):
    """HSDP (hsdp.py, ARCHITECTURE.md's worked example of a new step): ZeRO-3 inside each replica of
    2 ranks, its gradient shards averaged across the 2 replicas. Single's losses and norms; the model
    states divided by 2, not 4 (zero3 on the same 4 ranks); the gathers and reduce-scatters in the
    shard group, one all-reduce of the shards (ZeRO-3's over 2 ranks: half the parameters) across."""
    out, zero3 = train("hsdp", 4, *HSDP), train("zero3", 4, "--micro-batch", "1")
    assert out["parallel"]["zero"] == 3 and out["parallel"]["dp_replicate"] == 2
    assert_same_as_single(out, single(), params="flat")
    assert_traffic_in(out, {"dp_shard", "dp_replicate"}, exact=True)
    for rank in range(4):
        assert out["memory"][rank]["params"] == pytest.approx(2 * zero3["memory"][rank]["params"], rel=0.01)
        ops = out["comm_groups"][rank]
        # the shard group: ZeRO-3's gathers and reduce-scatters, and the norm's sum of squares (a replica's
        # shards counted once: not summed across replicas)
        assert set(ops["dp_shard"]) == {"all_gather", "reduce_scatter", "all_reduce"}
        assert ops["dp_shard"]["all_reduce"]["calls"] == 1 and set(ops["dp_replicate"]) == {"all_reduce"}
        assert ops["dp_replicate"]["all_reduce"]["calls"] == 1
        assert ops["dp_replicate"]["all_reduce"]["payload_bytes"] == out["memory"][rank]["grads"]


@pytest.mark.slow
def test_each_stage_divides_its_model_states_by_n_and_talks_as_the_paper_says(runs):
    """ZeRO-1 divides the optimizer states, ZeRO-2 also the gradients, ZeRO-3 also the parameters
    (within the padding). Traffic per step, against DDP's all-reduce of the gradients (wire 2(n-1)/n P):
    ZeRO-2's reduce-scatter + all-gather is the same; ZeRO-3 all-gathers twice (forward and backward)
    and reduce-scatters once: 1.5x. ZeRO-1 reduce-scatters like ZeRO-2 but keeps the full gradients: 1x."""
    n = 2
    ddp = train("ddp", n)
    divided = {"zero1": {"optimizer"}, "zero2": {"optimizer", "grads"}, "zero3": {"optimizer", "grads", "params"}}
    ratios = {"zero1": 1.0, "zero2": 1.0, "zero3": 1.5}
    for strategy in divided:
        out = train(strategy, n)
        assert_traffic_in(out, {"dp"}, exact=True)
        for rank in range(n):
            mine, base = out["memory"][rank], ddp["memory"][rank]
            for key in ("params", "grads", "optimizer"):
                expected = base[key] / n if key in divided[strategy] else base[key]
                assert abs(mine[key] - expected) <= 0.005 * base[key], (strategy, rank, key, mine[key], base[key])
            assert mine["activations"] == base["activations"], "gathered parameters are not activations"
            wire = sum(op["wire_bytes"] for op in out["comm"][rank].values())
            ddp_wire = sum(op["wire_bytes"] for op in ddp["comm"][rank].values())
            assert wire / ddp_wire == pytest.approx(ratios[strategy], rel=2e-3), (strategy, out["comm"][rank])
        ops = out["comm"][0]
        units = out["model"]["n_layers"] + 1
        if strategy == "zero3":
            assert ops["all_gather"]["calls"] == 2 * units and ops["reduce_scatter"]["calls"] == units
            assert ops["all_gather"]["payload_bytes"] == 2 * ops["reduce_scatter"]["payload_bytes"]
        else:
            assert ops["all_gather"]["payload_bytes"] == out["memory"][0]["params"]  # the padded flat buffers


@pytest.mark.parametrize("args, message", [
    (["--strategy", "zero3", "--nproc", "1"], "ZeRO-3: stage 3 shards over the data-parallel ranks, but this grid has --dp 1"),
    (["--strategy", "zero1", "--nproc", "2", "--zero", "4"], "--zero must be 0, 1, 2 or 3, got 4"),
    (["--strategy", "zero2", "--nproc", "2", "--zero", "3"], "strategy 'zero2' is ZeRO stage 2, but --zero 3"),
    (["--strategy", "zero2", "--nproc", "4", "--tp", "2"], "ZeRO-2 frees the full gradients the tensor- and "
                                                            "pipeline-parallel steps still reduce"),
    (["--strategy", "zero1", "--nproc", "2", "--ddp-mode", "flat"], "so --ddp-mode must be bucketed (got flat)"),
    (["--strategy", "hsdp", "--nproc", "4"], "strategy 'hsdp' is hybrid sharding (ZeRO-3 in replicas), but this grid "
                                             "has --dp-replicate 1"),
    (["--strategy", "ddp", "--nproc", "4", "--dp-replicate", "2"], "--dp-replicate 2 replicates ZeRO-3's shard groups: "
                                                                   "give --zero 3"),
    (["--strategy", "hsdp", "--nproc", "4", "--dp-replicate", "4"], "--dp-replicate 4 on --dp 4 leaves one rank per "
                                                                    "replica"),
    (["--strategy", "torch-fsdp", "--nproc", "4", "--dp-replicate", "2"], "--dp-replicate must be 1 (got 2)"),
])
def test_bad_zero_arguments_fail_before_start(args, message):
    res = cli("train", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_zero_strategy_names_its_stage():
    from labsupport.parallel import ParallelConfig
    assert [ParallelConfig.build(2, f"zero{k}").zero for k in (1, 2, 3)] == [1, 2, 3]
    assert ParallelConfig.build(2, "ddp").zero == 0
    assert ParallelConfig.build(2, "zero2").layout()["zero"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["zero3"])
def test_sharded_checkpoint_resumes_bit_identically(runs, tmp_path, strategy):
    """Every rank saves its shard (its Adam moments and its parameters); a run resumed from step 10
    reports the same 20 losses and norms as the run that never stopped. (ZeRO-1 and -2 keep the same
    ShardedOptimizer state; test_three_d kills and resumes a run of it on 8 ranks.)"""
    full = train(strategy, 2)
    resumed = resume(full, 10, tmp_path)
    assert resumed["resumed_from"] == 10
    assert resumed["losses"] == full["losses"] and resumed["grad_norms"] == full["grad_norms"]
    shard = checkpoint.load(resumed.checkpoint_dir, 20, 1)["optimizer"]["state"]
    moments = sum(v["exp_avg"].numel() for v in shard.values())
    assert moments == pytest.approx(full["n_params"] / 2, rel=0.02), "rank 1 saved its half of the moments"
    res = cli("train", "--strategy", strategy, "--nproc", 4, *NANO, "--checkpoint-dir", resumed.checkpoint_dir,
                  "--resume")
    assert res.returncode == 2 and f"written by {strategy} on 2 rank(s)" in res.stderr


@pytest.mark.slow
def test_zero3_computes_in_bf16_on_fp32_master_shards(runs):
    """Under `--dtype bf16` the forward and backward run in bf16 (autocast) while the shards the
    optimizer updates stay fp32: the same bytes per rank as the fp32 run, and losses that follow
    a bf16 run on one device to bf16's precision."""
    out, fp32 = train("zero3", 2, "--dtype", "bf16"), train("zero3", 2)
    assert all(p.dtype == torch.float32 for p in out.params().values())
    for key in ("params", "grads", "optimizer"):
        assert out["memory"][0][key] == fp32["memory"][0][key], key
    assert_same_as_single(out, single("--dtype", "bf16"), loss_tol=None, loss_rtol=1e-2, norm_rtol=None,
                          val_tol=None)
    assert out["losses"] != fp32["losses"], "bf16 compute changes the rounding"
