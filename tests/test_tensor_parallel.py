"""Tensor parallelism is proven against the dense model: the same logits, loss and every gradient
(each rank's slice of it) on 2 and 4 ranks, with and without sequence parallelism; the same
training losses as `single` through `labsupport train`; and bad degrees refused before any start."""
import textwrap

import pytest

from conftest import cases_on_ranks, cli, planted_copy
from harness import assert_same_as_single, assert_traffic_in, prefetch, single, train
from labsupport.estimate.tp_comm import total, tp_comm

pytestmark = pytest.mark.multiprocess

# ---------------------------------------------------------------- library level: dense and parallel side by side

DENSE = textwrap.dedent('''
    """Each case builds the dense TinyGPT (rank 0's weights) and a parallel copy of it cut over the
    world (each rank its own weights first: the broadcast must replace them by rank 0's). Forward and backward on the same
    batch; the parallel logits gathered, the loss and every gradient (this rank's slice of the
    dense one) must agree to 1e-5 relative; comm counts each phase per rank.
    Every case of this world size runs here, one after the other; argv[1] lists them as JSON:
    (label, the tensor-parallel module: ours or a planted copy, "sp" for sequence parallelism or "-")."""
    import importlib, json, sys
    import torch
    from labsupport import comm, init, report
    from labsupport.model import ModelConfig, TinyGPT, lm_loss

    cfg = ModelConfig("tiny", n_layers=2, hidden=32, heads=4, vocab=57, seq_len=8)


    def build(seed):  # TinyGPT starts with zero biases and unit LayerNorms: too kind a trap
        torch.manual_seed(seed)
        model = TinyGPT(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p))
        return model


    def check(rt, module, mode):
        tp = importlib.import_module(module)
        failures, counts = [], {}
        dense = build(0)
        # rank 0's weights are the dense model's; the others' differ until the broadcast
        model = tp.apply_tensor_parallel(build(rt.rank), None, sequence_parallel=mode == "sp")
        data = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, 57, (3, 8), generator=data), torch.randint(0, 57, (3, 8), generator=data)

        def close(name, a, b):
            scale = b[b.isfinite()].abs().max().item()  # the padded logits are -inf on both sides
            if a.shape != b.shape or not torch.allclose(a, b, rtol=1e-5, atol=1e-5 * scale):
                failures.append(f"{name} differs" + (f" by {(a - b).nan_to_num().abs().max().item():.2e}"
                                                     if a.shape == b.shape
                                                     else f" in shape {tuple(a.shape)} vs {tuple(b.shape)}"))

        ref_logits = dense(x)
        ref_loss = lm_loss(ref_logits, y)
        ref_loss.backward()
        comm.reset()
        logits = model(x)
        loss = tp.vocab_parallel_cross_entropy(logits, y).mean()
        counts["forward"] = comm.counts()
        comm.reset()
        loss.backward()
        counts["backward"] = comm.counts()
        comm.reset()
        tp.allreduce_sequence_parallel_gradients(model)
        counts["finish"] = comm.counts()
        close("logits", tp.gather_vocabulary(logits.detach()), ref_logits.detach())
        close("loss", loss.detach(), ref_loss.detach())
        reference = dict(dense.named_parameters())
        for name, p in model.named_parameters():
            want = reference[name].grad
            for dim, (mine, full) in enumerate(zip(p.shape, want.shape)):
                if mine != full:  # the dimension this parameter is cut along: this rank's slice
                    want = want.chunk(rt.world_size, dim=dim)[rt.rank]
            close(f"grad of {name}", p.grad, want)
        return dict(failures=failures, counts=counts, names=sorted(n for n, _ in model.named_parameters()),
                    dense_names=sorted(reference))


    with init(seed=0) as rt:
        for label, module, mode in json.loads(sys.argv[1]):
            try:
                report(**{label: check(rt, module, mode)})
            except Exception as e:
                raise RuntimeError(f"case {label!r} failed: {type(e).__name__}: {e}") from e
''')

BUGS = {
    "the row-parallel bias added before the all-reduce (T times)": (
        [("y = F.linear(x, self.weight)\n", "y = F.linear(x, self.weight, self.bias)\n"),
         ("return y if self.bias is None else y + self.bias", "return y")], "-", "logits differs"),
    "f and g swapped": (
        [("F.linear(copy_to_tensor_parallel_region(x, self.group)", "F.linear(reduce_from_tensor_parallel_region(x, self.group)"),
         ("y = reduce_from_tensor_parallel_region(y, self.group)", "y = copy_to_tensor_parallel_region(y, self.group)")],
        "-", "logits differs"),
    "sequence parallelism without summing the LayerNorms' partial gradients": (
        [("params = [p for p in sequence_parallel_parameters(model) if p.grad is not None]", "params = []")],
        "sp", "grad of blocks.0.ln1.weight"),
    "sequence parallelism's column-parallel backward keeping all positions' input gradients": (
        [("grad_x = _reduce_scatter(grad @ weight.to(grad.dtype), SEQ_DIM, ctx.group)",
          "grad_x = _shard(grad @ weight.to(grad.dtype), SEQ_DIM, ctx.group)")],
        "sp", "grad of"),
}
MODES = [(2, "-"), (2, "sp"), (4, "-"), (4, "sp")]
# every case: {label: (ranks, the tensor-parallel module, mode)}; each bug planted in a copy of tensor.py, on 2 ranks
CASES = {
    **{f"{nproc} ranks, {mode}": (nproc, "labsupport.parallel.tensor", mode) for nproc, mode in MODES},
    **{f"planted: {bug}": (2, f"planted_tp_{i}", mode) for i, (bug, (_, mode, _)) in enumerate(BUGS.items())},
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """`dense(label)`: the case's report per rank, every case of N ranks in one launch."""
    from labsupport.parallel import tensor

    def plant(folder):
        for i, (replacements, _, _) in enumerate(BUGS.values()):
            planted_copy(tensor, replacements, folder / f"planted_tp_{i}.py")
    return cases_on_ranks(tmp_path_factory, DENSE, CASES, plant)


@pytest.mark.parametrize("nproc, mode", MODES)
def test_logits_loss_and_every_gradient_match_the_dense_model(dense, nproc, mode):
    reports = dense(f"{nproc} ranks, {mode}")
    predicted = tp_comm(n_layers=2, hidden=32, seq_len=8, micro_batch=3, sequence_parallel=mode == "sp")
    for rank, rep in enumerate(reports):
        assert rep["failures"] == [], f"rank {rank}"
        assert rep["names"] == rep["dense_names"], "the parallel model keeps the dense parameter names"
        for phase in ("forward", "backward", "finish"):  # what comm counted against estimate/tp_comm.py
            assert rep["counts"][phase] == total({phase: predicted.get(phase, {})}, nproc), (rank, phase)


@pytest.mark.parametrize("bug", BUGS)
def test_planted_bugs_are_caught(dense, bug):
    """Each bug is planted in a copy of tensor.py that its case imports instead of the real one."""
    expected = BUGS[bug][2]
    reports = dense(f"planted: {bug}")
    assert any(f.startswith(expected) for f in reports[0]["failures"]), reports[0]["failures"]


# ---------------------------------------------------------------- the CLI: `labsupport train --strategy tp --json`

@pytest.fixture(scope="module")
def runs():
    """This file's training runs, trained ahead in one launch per world size (harness.prefetch)."""
    prefetch(("single", 1, ()), *RUNS)


RUNS = [
    ("tp", 2, ["--tp", "2"]),
    ("tp", 2, ["--tp", "2", "--sequence-parallel", "--micro-batch", "4"]),
    ("tp", 4, ["--tp", "4", "--sequence-parallel"]),
    ("torch-tp", 2, ["--tp", "2", "--sequence-parallel"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra", RUNS)
def test_training_matches_single_step_by_step(runs, strategy, nproc, extra):
    out = train(strategy, nproc, *extra)
    assert out["parallel"]["tp"] == nproc and out["parallel"]["dp"] == 1
    assert_same_as_single(out, single())
    assert_traffic_in(out, {"tp"})  # tensor parallelism talks within its TP group only


@pytest.mark.parametrize("args, message", [
    (["--tp", "3", "--nproc", "3"], "--tp 3 must divide the model's heads (4)"),
    (["--tp", "4", "--nproc", "2"], "--tp 4 needs at least 4 ranks, but the run has 2 (--nproc)"),
    (["--tp", "2", "--nproc", "2", "--seq-len", "7", "--sequence-parallel"],
     "--sequence-parallel needs --tp 2 to divide the sequence length (7)"),
    (["--tp", "1", "--nproc", "2"], "strategy 'tp' is tensor parallelism, but this grid has --tp 1 "
                                    "(--dp 2 x --tp 1 x --pp 1 on 2 ranks); name what runs: --strategy ddp"),
])
def test_bad_tensor_parallel_arguments_fail_before_start(args, message):
    res = cli("train", "--strategy", "tp", "--model", "nano", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
