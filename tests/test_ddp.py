"""Data parallelism is proven by equivalence: same global batch and seed, same losses and parameters as `single`."""
import json
import textwrap
from pathlib import Path

import pytest

from labsupport.launch import RankFailed, launch
from conftest import cases_on_ranks, cli
from harness import LLAMA, assert_same_as_single, planted, prefetch, single, train

pytestmark = pytest.mark.multiprocess

# ---------------------------------------------------------------- library level: trap models, every step compared

CHECKS = textwrap.dedent('''
    """Every case of this world size, one after the other, each with its own DataParallel;
    argv[1] lists them as JSON: (label, check, its arguments). Reports {label: what it found}."""
    import json, sys, warnings
    from contextlib import nullcontext
    import torch, torch.nn as nn, torch.nn.functional as F
    from labsupport import comm, init, report
    from labsupport.parallel import ddp as data_parallel
    from labsupport.parallel.ddp import DataParallel
    from labsupport.parallel.optim import adamw

    class Trap(nn.Module):
        """Tied embedding/head, a frozen layer, a layer used only on even steps (all ranks alike),
        and a branch used only by sequences holding token 0 (so on some ranks only; with
        `same_everywhere`, never: then every rank must use the same parameters)."""
        def __init__(self, same_everywhere):
            super().__init__()
            self.same_everywhere = same_everywhere
            self.emb = nn.Embedding(16, 8)
            self.fc = nn.Linear(8, 8)
            self.frozen = nn.Linear(8, 8).requires_grad_(False)
            self.sometimes = nn.Linear(8, 8)
            self.branch = nn.Linear(8, 8)
            self.head = nn.Linear(8, 16, bias=False)
            self.head.weight = self.emb.weight
        def forward(self, x, y, step):
            h = torch.tanh(self.fc(self.frozen(self.emb(x))))
            if step % 2 == 0:
                h = h + self.sometimes(h)
            uses = torch.zeros(len(x), dtype=torch.bool) if self.same_everywhere else (x == 0).any(dim=1)
            if uses.any():
                h = h + uses[:, None, None] * self.branch(h)
            return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    class SumBucket(data_parallel.Bucket):
        """The planted bug: a bucket that sums the gradients (forgets to divide by the world size)."""
        def launch(self):
            for p, view in self._views():
                view.copy_(p.grad.view(-1)) if p.grad is not None else view.zero_()
            self.work = comm.all_reduce(self.buffer, "sum", group=self.group, async_op=True)

    def traps(rt, mode, accum, find_unused, planted_sum):
        """Each rank trains a DataParallel replica on its shard and, beside it, the single-device
        reference on the whole global batch; after the sync and before the optimizer step the
        gradients must agree (under AdamW the losses could not see a gradient scaled by a
        constant), and after the step the parameters. `planted_sum`: SumBucket, for this case only."""
        failures = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            bucket = data_parallel.Bucket
            data_parallel.Bucket = SumBucket if planted_sum else bucket
            torch.manual_seed(rt.rank)  # different init per rank: the broadcast must fix it
            ddp = DataParallel(Trap(not find_unused), mode=mode, bucket_mb=0.0005,  # ~4 buckets
                               find_unused_parameters=find_unused)
            torch.manual_seed(0)
            reference = Trap(not find_unused)
            ref_opt, opt = adamw(reference.parameters(), 1e-2, 0.1), adamw(ddp.parameters(), 1e-2, 0.1)  # the loop's AdamW recipe, for both
            n, per = rt.world_size, 2 * accum
            data = torch.Generator().manual_seed(1)
            for step in range(6):
                x = torch.randint(1, 16, (n * per, 5), generator=data)
                x[torch.randint(0, n * per, (1,), generator=data), 0] = 0  # token 0 in one sequence only
                y = torch.randint(0, 16, (n * per, 5), generator=data)
                reference(x, y, step).backward()  # the reference sees the whole global batch
                mine = slice(rt.rank * per, (rt.rank + 1) * per)
                xs, ys = x[mine].chunk(accum), y[mine].chunk(accum)
                for i in range(accum):
                    with ddp.no_sync() if i < accum - 1 else nullcontext():
                        (ddp(xs[i], ys[i], step) / accum).backward()  # plain backward: no strategy call
                ddp.finish_gradient_synchronization()
                for (name, a), b in zip(reference.named_parameters(), ddp.module.parameters()):
                    if (a.grad is None) != (b.grad is None):
                        failures.append(f"step {step}: {name} has a gradient on one side only")
                    elif a.grad is not None and not torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5):
                        failures.append(f"step {step}: grad of {name} differs by {(a.grad - b.grad).abs().max().item():.2e}")
                ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
                opt.step(); opt.zero_grad(set_to_none=True)
                for (name, a), b in zip(reference.named_parameters(), ddp.module.parameters()):
                    if not torch.allclose(a, b, atol=1e-6, rtol=1e-5):
                        failures.append(f"step {step}: {name} differs by {(a - b).abs().max().item():.2e}")
            ddp.close()
            data_parallel.Bucket = bucket
        return dict(failures=failures, frozen_untouched=bool(torch.equal(ddp.module.frozen.weight, reference.frozen.weight)),
                    warnings=[str(w.message) for w in caught if "DataParallel" in str(w.message)])

    def rewrap(rt):
        """A cell that wraps a model twice (run again without closing the first wrapper), closes both."""
        def hooks(module):
            return sum(len(p._post_accumulate_grad_hooks or {}) for p in module.parameters())

        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        first = DataParallel(model, bucket_mb=0.00001)   # a cell run once ...
        second = DataParallel(model, bucket_mb=0.00001)  # ... and again, without closing the first
        counted = [hooks(model)]
        comm.reset()
        second(torch.randn(3, 4)).sum().backward()
        second.finish_gradient_synchronization()
        calls = comm.counts()["all_reduce"]["calls"]
        second.close()
        first.close()  # already replaced: nothing left to remove
        counted.append(hooks(model))
        comm.reset()
        model(torch.randn(3, 4)).sum().backward()
        return dict(hooks=counted, calls=calls, buckets=len(second.buckets), after_close=comm.counts())

    with init(seed=0) as rt:
        for label, check, *args in json.loads(sys.argv[1]):
            try:
                report(**{label: {"traps": traps, "rewrap": rewrap}[check](rt, *args)})
            except Exception as e:
                raise RuntimeError(f"case {label!r} failed: {type(e).__name__}: {e}") from e
''')

TRAP_CASES = [(2, "bucketed", 1, True), (3, "bucketed", 2, True), (3, "bucketed", 2, False), (2, "naive", 2, False),
              (2, "flat", 1, False)]
PLANTED_SUM = "planted: sum instead of average"


def trap_label(nproc, mode, accum, find_unused):
    return f"{mode} on {nproc} ranks, {accum} micro-batch(es), find_unused {find_unused}"


# every case: {label: (ranks, check, its arguments)}
CASES = {
    **{trap_label(*case): (case[0], "traps", *case[1:], False) for case in TRAP_CASES},
    PLANTED_SUM: (2, "traps", "bucketed", 1, True, True),
    "rewrap": (2, "rewrap"),
}


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """`checks(label)`: the case's report per rank, every case of N ranks in one launch."""
    return cases_on_ranks(tmp_path_factory, CHECKS, CASES)


@pytest.mark.parametrize("nproc, mode, accum, find_unused", TRAP_CASES)
def test_trap_model_matches_single_device_every_step(checks, nproc, mode, accum, find_unused):
    reports = checks(trap_label(nproc, mode, accum, find_unused))
    for rank in range(nproc):
        assert reports[rank]["failures"] == []
        assert reports[rank]["frozen_untouched"]
    stalled = reports[0]["warnings"]
    if mode == "bucketed" and not find_unused:  # branch is never used: its bucket held back the later ones
        assert len(stalled) == 1 and "branch.weight" in stalled[0] and "without overlap" in stalled[0], stalled
    else:
        assert stalled == []


def test_planted_sum_instead_of_average_is_caught_by_the_gradients(checks):
    """Summing gradients (forgetting to divide by the world size) leaves AdamW's steps almost
    unchanged; the gradient comparison must catch it."""
    failures = checks(PLANTED_SUM)[0]["failures"]
    assert any(f.startswith("step 0: grad of") for f in failures), failures


SUBGROUPS = textwrap.dedent("""
    import torch, torch.nn as nn, torch.nn.functional as F
    from labsupport import comm, init, report
    from labsupport.parallel.ddp import DataParallel

    def net():
        return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))

    with init() as rt:
        groups = [comm.new_group([0, 1], name="dp"), comm.new_group([2, 3], name="dp")]
        index = rt.rank // 2
        torch.manual_seed(100 + rt.rank)  # every rank its own initial weights
        ddp = DataParallel(net(), groups[index], bucket_mb=0.0002)
        torch.manual_seed(100 + 2 * index)  # the group's first rank's weights, which the broadcast gave all
        reference = net()
        started_equal = all(torch.equal(a, b) for a, b in zip(reference.parameters(), ddp.module.parameters()))
        opt, ref_opt = torch.optim.SGD(ddp.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(index)  # each group trains on its own data
        losses, reference_losses, grads_equal = [], [], True
        for step in range(5):
            x, y = torch.randn(8, 6, generator=data), torch.randint(0, 3, (8,), generator=data)
            loss = F.cross_entropy(reference(x), y)
            loss.backward()
            reference_losses.append(loss.item())
            mine = slice(4 * (rt.rank % 2), 4 * (rt.rank % 2) + 4)
            local = F.cross_entropy(ddp(x[mine]), y[mine])
            local.backward()
            ddp.finish_gradient_synchronization()
            grads_equal &= all(torch.allclose(a.grad, b.grad, atol=1e-7, rtol=1e-5)
                               for a, b in zip(reference.parameters(), ddp.module.parameters()))
            mean = local.detach().reshape(1)
            comm.all_reduce(mean, "avg", group=groups[index])
            losses.append(mean.item())
            for o in (opt, ref_opt):
                o.step(); o.zero_grad()
        report(started_equal=started_equal, grads_equal=grads_equal, losses=losses, reference=reference_losses,
               groups=sorted(comm.group_counts()))
""")


def test_ddp_on_subgroups_each_group_matches_its_own_single_device(tmp_path):
    script = tmp_path / "subgroups.py"
    script.write_text(SUBGROUPS)
    res = launch(str(script), nproc=4, timeout=120, run_dir=tmp_path / "run")
    for rank in range(4):
        rep = res.report(rank)
        assert rep["started_equal"], f"rank {rank} does not hold its group's first rank's weights"
        assert rep["grads_equal"], f"rank {rank}: gradients differ from its group's single device"
        assert max(abs(a - b) for a, b in zip(rep["losses"], rep["reference"])) < 1e-6
        assert rep["groups"] == ["dp"], "traffic outside the rank's own DP group"
    assert res.report(0)["losses"] != res.report(2)["losses"], "the two groups should have trained apart"


def test_wrapping_twice_and_closing_once_leaves_no_hooks(checks):
    rep = checks("rewrap")[0]
    assert rep["hooks"] == [4, 0], "one wrapper's hooks while wrapped, none after close"
    assert rep["calls"] == rep["buckets"] == 4, "every bucket all-reduced once, not twice"
    assert rep["after_close"] == {}, "a closed DataParallel must not communicate"


def test_replicas_that_differ_are_refused_without_broadcast(tmp_path):
    script = tmp_path / "differ.py"
    script.write_text(textwrap.dedent("""
        import torch
        from labsupport import init
        from labsupport.parallel.ddp import DataParallel
        with init() as rt:
            torch.manual_seed(rt.rank)
            DataParallel(torch.nn.Linear(4, 4), broadcast_init=False)
    """))
    with pytest.raises(RankFailed, match=r"model parameters differ between ranks \(2 tensors, first: weight\)"):
        launch(str(script), nproc=2, timeout=60, run_dir=tmp_path / "run")


# ---------------------------------------------------------------- the CLI: `labsupport train --strategy ... --json`

@pytest.fixture(scope="module")
def runs():
    """This file's training runs, trained ahead in one launch per world size (harness.prefetch)."""
    prefetch(("single", 1, ()), ("ddp", 2, ()),  # the --bucket-mb runs read their own launch's trace
             *[(s, n, e) for s, n, e in RUNS if "--bucket-mb" not in e],
             ("single", 1, (), LLAMA), *[(s, n, e, LLAMA) for s, n, e in LLAMA_RUNS])


RUNS = [
    ("ddp", 2, ["--ddp-mode", "naive"]),
    ("ddp", 2, ["--ddp-mode", "flat"]),
    ("ddp", 2, ["--ddp-mode", "bucketed", "--bucket-mb", "0.1"]),
    ("ddp", 2, ["--micro-batch", "2"]),                       # 2 accumulation steps with no_sync
    ("ddp", 4, ["--bucket-mb", "0.1", "--micro-batch", "1"]),  # 4 ranks once: naive and flat differ only in packing
    ("torch-ddp", 2, ["--micro-batch", "2"]),
    ("torch-ddp", 4, []),
    ("accelerate-ddp", 2, []),
]
# llama-micro's runs (harness.LLAMA): the data-parallel strategies average whatever the model is
LLAMA_RUNS = [("ddp", 2, []), ("torch-ddp", 2, [])]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", RUNS)
def test_strategy_matches_single_step_by_step(runs, strategy, nproc, extra):
    out = train(strategy, nproc, *extra)
    assert out["world_size"] == nproc
    assert_same_as_single(out, single(), params="whole")
    if "--bucket-mb" in extra:  # small buckets: some all-reduce must start while backward still runs
        trace = json.loads((Path(out["run_dir"]) / "trace-rank0.json").read_text())["events"]
        backward_end = max(e["end"] for e in trace if e["op"] == "backward")
        starts = [e["start"] for e in trace if e["op"] == "all_reduce"]
        assert starts and min(starts) < backward_end, "no bucket was launched during backward: no overlap"


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", LLAMA_RUNS)
def test_the_llama_family_matches_single_step_by_step(runs, strategy, nproc, extra):
    out = train(strategy, nproc, *extra, settings=LLAMA)
    assert out["world_size"] == nproc and out["model"]["name"] == "llama-micro"
    assert_same_as_single(out, single(settings=LLAMA), params="whole")


@pytest.mark.slow
def test_ddp_comm_counts_one_bucket_per_step(runs):
    out = train("ddp", 2)
    for per_rank, groups, memory in zip(out["comm"], out["comm_groups"], out["memory"]):
        grads = memory["params"]  # default 25 MiB bucket: all 4-byte gradients (padding rows too) in one all-reduce
        assert per_rank == {"all_reduce": {"calls": 1, "payload_bytes": grads, "wire_bytes": grads}}
        assert groups == {"dp": per_rank}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_planted_sum_instead_of_average_fails_the_comparison_with_single(tmp_path, strategy):
    """Gradients summed over the ranks instead of averaged: clipping to norm 1 gives the same
    clipped gradients, and AdamW hardly sees the scale, so the losses may stay within tolerance;
    the gradient norms cannot."""
    out = train(strategy, 2, env=planted(tmp_path, "sum instead of average"))
    with pytest.raises(AssertionError, match="^gradient norms differ"):
        assert_same_as_single(out, single())


@pytest.mark.parametrize("args, message", [
    (["--strategy", "ddp", "--nproc", "2", "--global-batch", "6", "--micro-batch", "2"], "must be divisible"),
    (["--strategy", "ddp", "--nproc", "4", "--global-batch", "6"], "must be divisible"),
    (["--strategy", "ddp", "--nproc", "2", "--bucket-mb", "0"], "--bucket-mb must be > 0"),
    (["--strategy", "ddp", "--nproc", "2", "--ddp-mode", "ring"], "invalid choice: 'ring'"),
    (["--strategy", "ddp", "--nproc", "2", "--tp", "2"], "strategy 'ddp' is data parallelism, but this grid has --dp 1"),
    (["--strategy", "ddp", "--nproc", "4", "--dp", "3", "--global-batch", "6"], "--dp 3 x --tp 1 x --pp 1 = 3 ranks"),
])
def test_bad_ddp_arguments_fail_before_start(args, message):
    res = cli("train", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
