"""Tensor parallelism is proven against the dense model: the same logits, loss and every gradient
(each rank's slice of it) on 2 and 4 ranks, with and without sequence parallelism, for the GPT shape
and the Llama family (RMSNorm, SwiGLU, RoPE, grouped-query attention, an untied head); the same
training losses and gradient norms as `single` through `labsupport train` (nano, llama-micro); and bad
degrees refused before any start."""
import textwrap

import pytest

from conftest import cases_on_ranks, cli, planted_copy
from harness import LLAMA, NANO, assert_same_as_single, assert_traffic_in, prefetch, single, train
from labsupport.estimate.tp_comm import total, tp_comm

pytestmark = pytest.mark.multiprocess

# ---------------------------------------------------------------- library level: dense and parallel side by side

DENSE = textwrap.dedent('''
    """Each case builds the dense TinyGPT (rank 0's weights) and a parallel copy of it cut over the
    world (each rank its own weights first: the broadcast must replace them by rank 0's). Forward and backward on the same
    batch; the parallel logits gathered, the loss and every gradient (this rank's slice of the
    dense one) must agree to 1e-5 relative; comm counts each phase per rank.
    Every case of this world size runs here, one after the other; argv[1] lists them as JSON:
    (label, the tensor-parallel module: ours or a planted copy, "sp" for sequence parallelism or "-",
    the shape: "gpt" or "llama")."""
    import importlib, json, sys
    import torch
    from labsupport import comm, init, report
    from labsupport.model import ModelConfig, TinyGPT, lm_loss

    SHAPES = {"gpt": ModelConfig("tiny", n_layers=2, hidden=32, heads=4, vocab=57, seq_len=8),
              # 8 query heads on 4 key/value heads (2 per group): 2 or 1 whole groups per rank at tp 2 or 4;
              # an MLP width of its own (48, not 4 x 32); RoPE, RMSNorm, an untied head, no biases
              "llama": ModelConfig("tiny-llama", n_layers=2, hidden=32, heads=8, vocab=57, seq_len=8, kv_heads=4,
                                   ffn_hidden=48, bias=False, norm="rmsnorm", mlp="swiglu", positions="rope",
                                   tied=False)}


    def build(seed, cfg):  # TinyGPT starts with zero biases and unit norms: too kind a trap
        torch.manual_seed(seed)
        model = TinyGPT(cfg)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p))
        return model


    def check(rt, module, mode, shape):
        tp = importlib.import_module(module)
        failures, counts = [], {}
        dense = build(0, SHAPES[shape])
        # rank 0's weights are the dense model's; the others' differ until the broadcast
        model = tp.apply_tensor_parallel(build(rt.rank, SHAPES[shape]), None, sequence_parallel=mode == "sp")
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
        for label, module, mode, shape in json.loads(sys.argv[1]):
            try:
                report(**{label: check(rt, module, mode, shape)})
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
    # the Llama family's own mistakes
    "sequence parallelism without summing the RMSNorms' gains": (
        [("isinstance(m, (nn.LayerNorm, nn.RMSNorm))", "isinstance(m, nn.LayerNorm)")],
        "sp", "grad of blocks.0.ln1.weight", "llama"),
    "the parallel attention without RoPE (the rotation left behind when the module is cut)": (
        [("self.q_per_kv, self.rope_theta = attn.q_per_kv, attn.rope_theta",
          "self.q_per_kv, self.rope_theta = attn.q_per_kv, None")],
        "-", "logits differs", "llama"),
}
MODES = [(2, "-"), (2, "sp"), (4, "-"), (4, "sp")]
SHAPES = ("gpt", "llama")
# every case: {label: (ranks, the tensor-parallel module, mode, shape)}; each bug planted in a copy of tensor.py,
# on 2 ranks, in the GPT shape unless its entry names another
CASES = {
    **{f"{nproc} ranks, {mode}, {shape}": (nproc, "labsupport.parallel.tensor", mode, shape)
       for nproc, mode in MODES for shape in SHAPES},
    **{f"planted: {bug}": (2, f"planted_tp_{i}", entry[1], entry[3] if len(entry) > 3 else "gpt")
       for i, (bug, entry) in enumerate(BUGS.items())},
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """`dense(label)`: the case's report per rank, every case of N ranks in one launch."""
    from labsupport.parallel import tensor

    def plant(folder):
        for i, (replacements, *_) in enumerate(BUGS.values()):
            planted_copy(tensor, replacements, folder / f"planted_tp_{i}.py")
    return cases_on_ranks(tmp_path_factory, DENSE, CASES, plant)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nproc, mode", MODES)
def test_logits_loss_and_every_gradient_match_the_dense_model(dense, nproc, mode, shape):
    """The Llama family's traffic is the GPT shape's but for the RMSNorms' gains (tp_comm's `norm`): SwiGLU's
    gate and up enter the parallel region once, grouped-query attention changes no activation at a boundary."""
    reports = dense(f"{nproc} ranks, {mode}, {shape}")
    llama = dict(bias=False, norm="rmsnorm") if shape == "llama" else {}
    predicted = tp_comm(n_layers=2, hidden=32, seq_len=8, micro_batch=3, sequence_parallel=mode == "sp", **llama)
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
    """This file's training runs, trained ahead in one launch per world size (harness.prefetch): the
    llama-micro runs ride the same 2-rank launch as nano's, their single the 1-rank one."""
    prefetch(("single", 1, ()), ("single", 1, (), LLAMA), *RUNS)


RUNS = [
    ("tp", 2, ["--tp", "2"], NANO),
    ("tp", 2, ["--tp", "2", "--sequence-parallel", "--micro-batch", "4"], NANO),
    ("tp", 4, ["--tp", "4", "--sequence-parallel"], NANO),
    ("torch-tp", 2, ["--tp", "2", "--sequence-parallel"], NANO),
    ("tp", 2, ["--tp", "2"], LLAMA),
    ("tp", 2, ["--tp", "2", "--sequence-parallel", "--micro-batch", "4"], LLAMA),
    ("torch-tp", 2, ["--tp", "2"], LLAMA),
    ("torch-tp", 2, ["--tp", "2", "--sequence-parallel"], LLAMA),
]


@pytest.mark.slow
@pytest.mark.parametrize("strategy, nproc, extra, settings", RUNS,
                         ids=[f"{s}-{n}-{'-'.join(e)}-{settings[1]}" for s, n, e, settings in RUNS])
def test_training_matches_single_step_by_step(runs, strategy, nproc, extra, settings):
    out = train(strategy, nproc, *extra, settings=settings)
    assert out["parallel"]["tp"] == nproc and out["parallel"]["dp"] == 1
    assert_same_as_single(out, single(settings=settings))
    assert_traffic_in(out, {"tp"})  # tensor parallelism talks within its TP group only
    if settings is LLAMA and strategy == "tp":  # the last step's counted traffic is tp_comm's, RMSNorm's gains too
        m, micro = out["model"], 4 if "--micro-batch" in extra else 8
        predicted = total(tp_comm(m["n_layers"], m["hidden"], m["seq_len"], micro, microbatches=8 // micro,
                                  sequence_parallel="--sequence-parallel" in extra, bias=False, norm="rmsnorm"), tp=2)
        assert all(by_group == {"tp": predicted} for by_group in out["comm_groups"]), out["comm_groups"]


@pytest.mark.parametrize("args, message", [
    (["--tp", "3", "--nproc", "3"], "--tp 3 must divide the model's heads (4)"),
    (["--tp", "4", "--nproc", "2"], "--tp 4 needs at least 4 ranks, but the run has 2 (--nproc)"),
    (["--tp", "2", "--nproc", "2", "--seq-len", "7", "--sequence-parallel"],
     "--sequence-parallel needs --tp 2 to divide the sequence length (7)"),
    (["--tp", "1", "--nproc", "2"], "strategy 'tp' is tensor parallelism, but this grid has --tp 1 "
                                    "(--dp 2 x --tp 1 x --pp 1 on 2 ranks); name what runs: --strategy ddp"),
    (["--tp", "4", "--nproc", "4", "--model", "llama-micro"], "--tp 4 must divide the model's key/value heads (2)"),
])
def test_bad_tensor_parallel_arguments_fail_before_start(args, message):
    res = cli("train", "--strategy", "tp", "--model", "nano", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
