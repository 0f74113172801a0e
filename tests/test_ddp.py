"""Data parallelism is proven by equivalence: same global batch and seed, same losses and parameters as `single`."""
import json
import textwrap

import pytest
import torch

from labsupport import checkpoint
from labsupport.launch import RankFailed, launch
from conftest import run_cli

pytestmark = pytest.mark.multiprocess

# ---------------------------------------------------------------- library level: trap models, every step compared

TRAPS = textwrap.dedent('''
    """Each rank trains a DataParallel replica on its shard and, beside it, the single-device
    reference on the whole global batch; parameters must agree after every step."""
    import sys
    from types import SimpleNamespace
    import torch, torch.nn as nn, torch.nn.functional as F
    from labsupport import init, report
    from labsupport.parallel.ddp import DataParallel

    class Trap(nn.Module):
        """Tied embedding/head, a frozen layer, a layer used only on even steps (all ranks alike),
        and a branch used only by sequences holding token 0 (so on some ranks only)."""
        def __init__(self):
            super().__init__()
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
            uses = (x == 0).any(dim=1)
            if uses.any():
                h = h + uses[:, None, None] * self.branch(h)
            return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())

    mode, accum, find_unused = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "find-unused"
    failures = []
    with init(seed=0) as rt:
        torch.manual_seed(rt.rank)  # different init per rank: the broadcast must fix it
        ddp_model = Trap()
        args = SimpleNamespace(ddp_mode=mode, bucket_mb=0.0005, find_unused_parameters=find_unused)  # ~4 buckets
        strategy = DataParallel(rt, args)
        ddp_model = strategy.setup(ddp_model)
        torch.manual_seed(0)
        reference = Trap()
        ref_opt = strategy.make_optimizer(reference, 1e-2, 0.1)  # the same AdamW recipe
        opt = strategy.make_optimizer(ddp_model, 1e-2, 0.1)
        n, per = rt.world_size, 2 * accum
        data = torch.Generator().manual_seed(1)
        for step in range(6):
            x = torch.randint(1, 16, (n * per, 5), generator=data)
            x[torch.randint(0, n * per, (1,), generator=data), 0] = 0  # token 0 in one sequence only
            y = torch.randint(0, 16, (n * per, 5), generator=data)
            reference(x, y, step).backward()  # the reference sees the whole global batch
            ref_opt.step(); ref_opt.zero_grad(set_to_none=True)
            mine = slice(rt.rank * per, (rt.rank + 1) * per)
            xs, ys = x[mine].chunk(accum), y[mine].chunk(accum)
            for i in range(accum):
                ctx = strategy.no_sync() if i < accum - 1 else torch.enable_grad()
                with ctx:
                    strategy.backward(ddp_model(xs[i], ys[i], step) / accum)
            strategy.finish_backward(ddp_model)
            opt.step(); opt.zero_grad(set_to_none=True)
            for (name, a), b in zip(reference.named_parameters(), ddp_model.parameters()):
                if not torch.allclose(a, b, atol=1e-6, rtol=1e-5):
                    failures.append(f"step {step}: {name} differs by {(a - b).abs().max().item():.2e}")
        report(failures=failures, frozen_untouched=bool(torch.equal(ddp_model.frozen.weight, reference.frozen.weight)))
''')


@pytest.mark.parametrize("nproc, mode, accum, find_unused", [
    (2, "bucketed", 1, True), (3, "bucketed", 2, True), (3, "bucketed", 2, False), (2, "naive", 2, False),
    (2, "flat", 1, False)])
def test_trap_model_matches_single_device_every_step(tmp_path, nproc, mode, accum, find_unused):
    script = tmp_path / "traps.py"
    source = TRAPS
    if not find_unused:  # then every rank must use the same parameters: no data-dependent branch
        source = source.replace("uses = (x == 0).any(dim=1)", "uses = torch.zeros(len(x), dtype=torch.bool)")
    script.write_text(source)
    res = launch(str(script), mode, accum, "find-unused" if find_unused else "-", nproc=nproc, timeout=120,
                 run_dir=tmp_path / "run")
    for rank in range(nproc):
        assert res.report(rank)["failures"] == []
        assert res.report(rank)["frozen_untouched"]


def test_replicas_that_differ_are_refused_without_broadcast(tmp_path):
    script = tmp_path / "differ.py"
    script.write_text(textwrap.dedent("""
        from types import SimpleNamespace
        import torch
        from labsupport import init
        from labsupport.parallel.ddp import DataParallel
        with init() as rt:
            torch.manual_seed(rt.rank)
            DataParallel(rt, SimpleNamespace(broadcast_init=False)).setup(torch.nn.Linear(4, 4))
    """))
    with pytest.raises(RankFailed, match=r"model parameters differ between ranks \(2 tensors, first: weight\)"):
        launch(str(script), nproc=2, timeout=60, run_dir=tmp_path / "run")


# ---------------------------------------------------------------- the CLI: `labsupport train --strategy ... --json`

COMMON = ["--model", "nano", "--steps", "20", "--global-batch", "8", "--sample-chars", "0", "--eval-batches", "1",
          "--checkpoint-every", "20"]


def train(tmp_path, strategy, nproc, *extra):
    ckpt = tmp_path / f"{strategy}-{nproc}-{'-'.join(extra)}"
    res = run_cli("train", "--strategy", strategy, "--nproc", nproc, "--json", *COMMON, "--checkpoint-dir", ckpt, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    return out, checkpoint.load(ckpt, 20, 0)["model"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"), "single", 1)


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", [
    ("ddp", 2, ["--ddp-mode", "naive"]),
    ("ddp", 2, ["--ddp-mode", "flat"]),
    ("ddp", 2, ["--ddp-mode", "bucketed", "--bucket-mb", "0.1"]),
    ("ddp", 2, ["--micro-batch", "2"]),                       # 2 accumulation steps with no_sync
    ("ddp", 4, ["--ddp-mode", "naive", "--micro-batch", "1"]),
    ("ddp", 4, ["--ddp-mode", "flat"]),
    ("ddp", 4, ["--bucket-mb", "0.1", "--micro-batch", "1"]),
    ("torch-ddp", 2, ["--micro-batch", "2"]),
    ("torch-ddp", 4, []),
    ("accelerate-ddp", 2, []),
])
def test_strategy_matches_single_step_by_step(tmp_path, single, strategy, nproc, extra):
    ref, ref_params = single
    out, params = train(tmp_path, strategy, nproc, *extra)
    assert out["world_size"] == nproc and len(out["losses"]) == 20
    diffs = [abs(a - b) for a, b in zip(out["losses"], ref["losses"])]
    assert max(diffs) <= 1e-5, diffs
    # Parameters agree to 1e-4, not 1e-5: the key bias gets no true gradient (softmax ignores a
    # shift shared by all keys), only rounding noise, and Adam scales that noise to lr-sized steps.
    for name, p in ref_params.items():
        assert torch.allclose(params[name], p, atol=1e-4, rtol=0), name


@pytest.mark.slow
def test_ddp_comm_counts_one_bucket_per_step(tmp_path, single):
    out, _ = train(tmp_path, "ddp", 2)
    n_params = out["n_params"]
    for per_rank in out["comm"]:  # default 25 MiB bucket: all 4-byte gradients in one all-reduce
        assert per_rank == {"all_reduce": {"calls": 1, "payload_bytes": 4 * n_params, "wire_bytes": 4 * n_params}}


@pytest.mark.parametrize("args, message", [
    (["--strategy", "ddp", "--nproc", "2", "--global-batch", "6", "--micro-batch", "2"], "must be divisible"),
    (["--strategy", "ddp", "--nproc", "4", "--global-batch", "6"], "must be divisible"),
    (["--strategy", "ddp", "--nproc", "2", "--bucket-mb", "0"], "--bucket-mb must be > 0"),
    (["--strategy", "ddp", "--nproc", "2", "--ddp-mode", "ring"], "invalid choice: 'ring'"),
])
def test_bad_ddp_arguments_fail_before_start(args, message):
    res = run_cli("train", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr
