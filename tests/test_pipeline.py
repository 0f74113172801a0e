"""Pipeline parallelism is proven against the dense model: every schedule (GPipe, 1F1B, interleaved)
on 2 and 4 stages gives the dense model's loss, every gradient (each stage's parameters, the tied
embedding's two copies), the global norm, evaluation loss and logits; each stage runs its
schedule's actions in order; `labsupport train` gives `single`'s losses step by step, for `pp`
and torch's pipelining (`torch-pp`); bad settings are refused before any rank starts."""
import textwrap

import pytest

from conftest import cases_on_ranks, cli, planted_copy
from harness import LLAMA, MICRO, assert_same_as_single, assert_traffic_in, planted, prefetch, single, train
from labsupport.estimate.schedules import schedule
from labsupport.parallel import ParallelConfig
from labsupport.model import ModelConfig

# ---------------------------------------------------------------- library level: the dense model beside the stages

DENSE = textwrap.dedent('''
    """Each case builds the dense TinyGPT (8 layers, random biases and norm gains) and this stage of a
    copy of it; ranks after the first perturb their copy of the (tied) embedding (the first stage's
    must win). "tiny" is GPT-2's shape, "llama" the Llama family's (RMSNorm, SwiGLU, RoPE, 4 query heads
    on 2 key/value heads, an untied head, no biases). One step of m micro-batches through the schedule
    against the dense model's mean loss. Every case of this world size runs here, one after the other,
    each with its own strategy and groups; argv[1] lists them as JSON: (label, strategy or planted
    module, schedule, chunks, m, model)."""
    import importlib, json, sys
    import torch
    from labsupport import comm, init, report
    from labsupport.estimate.shapes import LLAMA
    from labsupport.model import ModelConfig, TinyGPT, lm_loss
    from labsupport.parallel import ParallelConfig, compose, make_strategy

    MODELS = {"tiny": ModelConfig("tiny", n_layers=8, hidden=32, heads=4, vocab=57, seq_len=8),
              "llama": ModelConfig("tiny-llama", n_layers=8, hidden=32, heads=4, vocab=57, seq_len=8, **LLAMA,
                                   kv_heads=2, ffn_hidden=48)}


    def build(cfg):
        torch.manual_seed(0)
        model = TinyGPT(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 1:
                    p.add_(torch.randn_like(p))
        return model


    def check(rt, name, schedule, chunks, m, model_name):
        failures = []
        cfg = MODELS[model_name]
        dense, mine = build(cfg), build(cfg)
        if rt.rank > 0:
            with torch.no_grad():
                mine.tok_emb.weight.add_(1.0)
        config = ParallelConfig.build(rt.world_size, "pp" if name.startswith("planted") else name, pp=rt.world_size,
                                      schedule=schedule, chunks=chunks, microbatches=m)
        if name.startswith("planted_split"):  # a copy of pipeline.py with a bug in it, composed in its step's place
            class Planted(compose.Parallel):
                STEPS = tuple(importlib.import_module(name).PipelineSplit if step.__name__ == "PipelineSplit" else step
                              for step in compose.STEPS)
            strategy = Planted(rt, config)
        else:
            strategy = make_strategy(rt, config)
        model = strategy.parallelize(mine)
        if name.startswith("planted_schedule"):  # a copy of pipeline_schedule.py with a bug: the executor it makes
            strategy.runner = importlib.import_module(name).PipelineSchedule(strategy.mesh, config, cfg.hidden,
                                                                             cfg.padded_vocab, torch.float32, rt.device)
        data = torch.Generator().manual_seed(1)
        x, y = torch.randint(0, 57, (2 * m, 8), generator=data), torch.randint(0, 57, (2 * m, 8), generator=data)
        batches = list(zip(x.chunk(m), y.chunk(m)))

        def close(what, a, b, tol=1e-5):
            a, b = torch.as_tensor(a).double(), torch.as_tensor(b).double()
            scale = b[b.isfinite()].abs().max().item() if b.numel() else 1.0
            if a.shape != b.shape or not torch.allclose(a, b, rtol=tol, atol=tol * scale):
                failures.append(f"{what} differs" + (f" by {(a - b).nan_to_num().abs().max().item():.2e}"
                                                     if a.shape == b.shape else " in shape"))

        ref_losses = [lm_loss(dense(xb), yb) for xb, yb in batches]
        for loss in ref_losses:
            (loss / m).backward()
        comm.reset()
        loss = strategy.forward_backward(model, batches)
        counts = comm.group_counts()
        strategy.finish_backward(model)
        synced = sorted(comm.group_counts())  # the groups that carried the step's traffic, forward to finish
        reference = dict(dense.named_parameters())  # a tied matrix once, as tok_emb.weight
        for part in model:
            for pname, p in part.named_parameters():
                close(f"grad of {pname}", p.grad, reference[pname.replace("lm_head", "tok_emb") if cfg.tied else pname].grad)
        dense_norm = torch.cat([p.grad.flatten() for p in dense.parameters()]).norm()
        close("grad norm", strategy.clip_grad_norm_(model, 1e9), dense_norm)
        close("loss", strategy.reduce_loss(loss), torch.stack(ref_losses).mean())
        with torch.no_grad():
            close("evaluation loss", strategy.reduce_loss(strategy.evaluate_loss(model, x, y)), lm_loss(dense(x), y))
            close("logits", strategy.logits(model, x[:3]), dense(x[:3]))
        state = strategy.model_state(model)
        strategy.load_model_state(model, state)
        return dict(failures=failures, events=strategy.events, counts=counts, synced=synced, state=sorted(state),
                    dense_state=sorted(dense.state_dict()))


    with init(seed=0) as rt:
        for label, *case in json.loads(sys.argv[1]):
            try:
                report(**{label: check(rt, *case)})
            except Exception as e:
                raise RuntimeError(f"case {label!r} failed: {type(e).__name__}: {e}") from e
''')

CASES = [  # (stages, schedule, chunks, micro-batches)
    (2, "gpipe", 1, 4), (2, "1f1b", 1, 4), (2, "1f1b", 1, 1), (2, "interleaved", 2, 4),
    (4, "gpipe", 1, 4), (4, "1f1b", 1, 6), (4, "interleaved", 2, 8),
]
TORCH_CASES = [("gpipe", 1, 4), ("1f1b", 1, 4), ("interleaved", 2, 4)]  # on 2 stages
# the Llama family's shape (its head untied): the same schedules, and torch's, on the same ranks
LLAMA_CASES = [(2, "1f1b", 1, 4), (2, "interleaved", 2, 4), (4, "1f1b", 1, 6)]
LLAMA_TORCH_CASES = [("1f1b", 1, 4)]
BUGS = {  # each planted in a copy of the executor (schedule) or of the split: (module, anchor, replacement,
    # how the failure begins, model); 1f1b on 2 stages
    "each micro-batch's loss not divided by m": ("schedule", "out = loss / m  #", "out = loss  #", "grad of", "tiny"),
    "the tied embedding's gradients not summed": (
        "split", 'comm.all_reduce(self.tied.grad, "sum", group=self.mesh.embedding_group)', "pass",
        "grad of tok_emb.weight", "tiny"),
    "the tied matrix counted twice in the norm": ("split", "if p is not self.tied]", "]", "grad norm", "tiny"),
    # an untied head taken for the tied matrix: overwritten by the embedding, its gradient summed with the embedding's
    "the untied head synced as if tied": ("split", "        if not self.tied_head:\n            return None\n", "",
                                          "grad of lm_head.weight", "llama"),
}
# every case: {label: (ranks, strategy or planted module, schedule, chunks, micro-batches, model)}
DENSE_CASES = {
    **{f"pp {name} on {stages} stages, chunks {chunks}, m {m}": (stages, "pp", name, chunks, m, "tiny")
       for stages, name, chunks, m in CASES},
    **{f"torch-pp {name}, chunks {chunks}, m {m}": (2, "torch-pp", name, chunks, m, "tiny")
       for name, chunks, m in TORCH_CASES},
    **{f"llama pp {name} on {stages} stages, chunks {chunks}, m {m}": (stages, "pp", name, chunks, m, "llama")
       for stages, name, chunks, m in LLAMA_CASES},
    **{f"llama torch-pp {name}, chunks {chunks}, m {m}": (2, "torch-pp", name, chunks, m, "llama")
       for name, chunks, m in LLAMA_TORCH_CASES},
    **{f"planted: {bug}": (2, f"planted_{where}_{i}", "1f1b", 1, 4, model)
       for i, (bug, (where, *_, model)) in enumerate(BUGS.items())},
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """`dense(label)`: the case's report per rank, every case of N ranks in one launch."""
    from labsupport.parallel import pipeline, pipeline_schedule

    def plant(folder):
        for i, (where, old, new, *_) in enumerate(BUGS.values()):
            module = pipeline_schedule if where == "schedule" else pipeline
            planted_copy(module, [(old, new)], folder / f"planted_{where}_{i}.py")
    return cases_on_ranks(tmp_path_factory, DENSE, DENSE_CASES, plant)


@pytest.mark.multiprocess
@pytest.mark.parametrize("stages, name, chunks, m", CASES)
def test_every_schedule_gives_the_dense_models_loss_and_gradients(dense, stages, name, chunks, m):
    reports = dense(f"pp {name} on {stages} stages, chunks {chunks}, m {m}")
    check_schedule(reports, stages, name, chunks, m)
    assert "embedding" in reports[0]["synced"] and "embedding" in reports[-1]["synced"], "the tied matrix's sum"


@pytest.mark.multiprocess
@pytest.mark.parametrize("stages, name, chunks, m", LLAMA_CASES)
def test_the_llama_shape_with_its_untied_head_gives_the_dense_models_loss_and_gradients(dense, stages, name,
                                                                                          chunks, m):
    """The first stage owns the embedding, the last the head, each its own parameter: every gradient (the
    head's and the embedding's apart), the norm, the losses and the logits are the dense model's, and nothing
    travels in the embedding group, which only a tied matrix needs."""
    reports = dense(f"llama pp {name} on {stages} stages, chunks {chunks}, m {m}")
    check_schedule(reports, stages, name, chunks, m)
    assert all("embedding" not in rep["synced"] for rep in reports), [rep["synced"] for rep in reports]


def check_schedule(reports, stages, name, chunks, m):
    actions = schedule(name, stages, m, chunks)
    for rank, rep in enumerate(reports):
        assert rep["failures"] == [], f"rank {rank}"
        # the stage ran its schedule's actions, in order, one after the other
        assert [tuple(e[2:]) for e in rep["events"]] == [(a.op, a.microbatch, a.chunk) for a in actions[rank]]
        starts, ends = [e[0] for e in rep["events"]], [e[1] for e in rep["events"]]
        assert all(0 <= s <= e for s, e in zip(starts, ends)) and all(e <= s for e, s in zip(ends, starts[1:]))
        computes = sorted(tuple(e[2:]) for e in rep["events"] if e[2] in ("F", "B"))
        assert computes == sorted((op, j, c) for op in "FB" for j in range(m) for c in range(chunks)), rank
        # every send between stages counted under "pp": one per SEND of the schedule, of one activation
        sends = sum(a.op.startswith("SEND") for a in actions[rank])
        assert rep["counts"].get("pp", {}).get("send", {"calls": 0})["calls"] == sends, rank
        if sends:
            assert rep["counts"]["pp"]["send"]["payload_bytes"] == sends * 2 * 8 * 32 * 4
    # each stage checkpoints its own parts under the dense names; together they are the dense model
    saved = [name for rep in reports for name in rep["state"]]
    assert sorted(saved) == reports[0]["dense_state"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, chunks, m", TORCH_CASES)
def test_torch_pipelining_gives_the_dense_models_loss_and_gradients(dense, name, chunks, m):
    for rank, rep in enumerate(dense(f"torch-pp {name}, chunks {chunks}, m {m}")):
        assert rep["failures"] == [], f"rank {rank}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("name, chunks, m", LLAMA_TORCH_CASES)
def test_torch_pipelining_of_the_llama_shape_gives_the_dense_models_loss_and_gradients(dense, name, chunks, m):
    for rank, rep in enumerate(dense(f"llama torch-pp {name}, chunks {chunks}, m {m}")):
        assert rep["failures"] == [], f"rank {rank}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("bug", BUGS)
def test_planted_bugs_are_caught(dense, bug):
    """Each bug is planted in a copy of pipeline.py or pipeline_schedule.py that its case uses instead of the real one."""
    reports = dense(f"planted: {bug}")
    expected = BUGS[bug][3]
    assert any(f.startswith(expected) for rep in reports for f in rep["failures"]), [r["failures"] for r in reports]


# ---------------------------------------------------------------- the CLI: `labsupport train --strategy pp --json`

@pytest.fixture(scope="module")
def runs():
    """This file's training runs, trained ahead in one launch per world size (harness.prefetch)."""
    prefetch(("single", 1, ()), ("single", 1, ("--micro-batch", "2"), MICRO), ("single", 1, (), LLAMA),
             *[(s, 2, ("--pp", "2", "--schedule", order, "--microbatches", "4")) for s, order in TWO_STAGES],
             *[(s, n, ("--pp", n, "--microbatches", "4", *extra), MICRO) for s, n, extra in FOUR_LAYERS],
             ("pp", 2, LLAMA_TWO_STAGES, LLAMA))


TWO_STAGES = [("pp", "1f1b"), ("pp", "gpipe"), ("torch-pp", "1f1b"), ("torch-pp", "gpipe")]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, order", TWO_STAGES)
def test_training_on_two_stages_matches_single_step_by_step(runs, strategy, order):
    out = train(strategy, 2, "--pp", "2", "--schedule", order, "--microbatches", "4")
    assert out["parallel"]["pp"] == 2 and out["micro_batch"] == 2
    assert_same_as_single(out, single())
    assert_traffic_in(out, {"pp", "embedding"})  # a pipeline talks within its PP group only
    if strategy == "pp":  # the last step, action by action, for a measured Gantt chart
        for rank, events in enumerate(out["pipeline_events"]):
            expected = [(a.op, a.microbatch, a.chunk) for a in schedule(order, 2, 4)[rank]]
            assert [tuple(e[2:]) for e in events] == expected


@pytest.mark.slow
@pytest.mark.multiprocess
def test_planted_tied_matrix_counted_twice_fails_the_comparison_with_single(tmp_path):
    """The tied embedding/head matrix lives on the first and on the last stage; its gradient,
    summed over the two, must count once in the norm. Counted on both stages, the norm is too
    large, and clipping to norm 1 then shrinks the gradients too much: losses and norms differ."""
    env = planted(tmp_path, "tied matrix counted twice in the norm")
    out = train("pp", 2, "--pp", "2", "--microbatches", "4", env=env)
    with pytest.raises(AssertionError, match="^losses differ"):
        assert_same_as_single(out, single())


LLAMA_TWO_STAGES = ("--pp", "2", "--microbatches", "4")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_llama_preset_on_two_stages_matches_single(runs):
    """llama-micro's untied head: the first stage owns the embedding, the last the head, neither synced with
    the other, so the pipeline talks in its PP group only (no embedding group); losses, every step's
    gradient norm, validation and the sample are single's."""
    out = train("pp", 2, *LLAMA_TWO_STAGES, settings=LLAMA)
    assert_same_as_single(out, single(settings=LLAMA))
    assert_traffic_in(out, {"pp"}, exact=True)


FOUR_LAYERS = [
    ("pp", 4, ["--schedule", "1f1b"]),
    ("pp", 2, ["--schedule", "interleaved", "--chunks", "2"]),
    ("torch-pp", 2, ["--schedule", "interleaved", "--chunks", "2"]),
]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("strategy, nproc, extra", FOUR_LAYERS)
def test_training_on_four_layers_matches_single(runs, strategy, nproc, extra):
    out = train(strategy, nproc, "--pp", nproc, "--microbatches", "4", *extra, settings=MICRO)
    assert_same_as_single(out, single("--micro-batch", "2", settings=MICRO))


# ---------------------------------------------------------------- bad settings: one line, before any rank starts

@pytest.mark.parametrize("args, message", [
    (["--nproc", "4", "--pp", "4"], "--pp 4 x --chunks 1 = 4 pipeline chunks must divide the model's 2 layers "
                                    "(each chunk needs at least one layer)"),
    (["--nproc", "4", "--pp", "4", "--model", "mini"], "--pp 4 x --chunks 1 = 4 pipeline chunks must divide "
                                                       "the model's 6 layers"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "3"],
     "--microbatches 3 must divide the 16 sequences each data-parallel rank gets per step"),
    (["--nproc", "2", "--pp", "2", "--microbatches", "2", "--micro-batch", "2"],
     "--micro-batch 2 x --microbatches 2 must equal the 16 sequences each data-parallel rank gets per step"),
    (["--nproc", "2", "--pp", "2", "--chunks", "2", "--model", "micro"],
     "--chunks 2 needs --schedule interleaved"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--model", "micro", "--microbatches", "2"],
     "--schedule interleaved needs --pp 2 or more and --chunks 2 or more"),
    (["--nproc", "2", "--pp", "2", "--schedule", "interleaved", "--chunks", "2", "--model", "micro",
      "--microbatches", "1"], "--schedule interleaved runs micro-batches in groups of --pp 2, but a step has 1"),
    (["--nproc", "2", "--pp", "2", "--strategy", "torch-pp", "--microbatches", "1"],
     "torch's 1f1b schedule needs at least --pp 2 micro-batches per step, but a step has 1"),
    (["--nproc", "2", "--pp", "2", "--global-batch", "3"],
     "the 3 sequences each data-parallel rank gets per step do not split into --pp 2 micro-batches (the default"),
    (["--nproc", "2"], "strategy 'pp' is pipeline parallelism, but this grid has --pp 1 (--dp 2 x --tp 1 x --pp 1 on 2 ranks); "
                    "name what runs: --strategy ddp"),
])
def test_bad_pipeline_arguments_fail_before_start(tmp_path, args, message):
    res = cli("train", "--strategy", "pp", "--model", "nano", *args)
    assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists(), "no rank started"


def test_resuming_with_another_pipeline_degree_is_refused(tmp_path):
    from labsupport import checkpoint
    layout = {**ParallelConfig.build(2, "pp", pp=2).layout(), "world_size": 2}
    checkpoint.save(tmp_path / "ckpt", 4, 0, {"step": 4}, barrier=lambda: None, layout=layout)
    res = cli("train", "--strategy", "pp", "--model", "micro", "--nproc", "4", "--pp", "4", "--resume",
                  "--checkpoint-dir", tmp_path / "ckpt")
    assert res.returncode == 2 and "written by pp on 2 rank(s) (dp 1, tp 1, pp 2" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_pipeline_configurations_are_checked_without_ranks():
    nano = ModelConfig("nano", n_layers=2, hidden=64, heads=4, vocab=57, seq_len=64)
    assert ParallelConfig.build(2, "pp", pp=2, microbatches=4).problems(2, nano, global_batch=8) == []
    assert ParallelConfig.build(2, "pp", pp=2, microbatches=4).micro_batch_size(8) == 2
    assert ParallelConfig.build(2, "pp", pp=2).micro_batch_size(8, 4) == 4
    assert ParallelConfig.build(2, "pp", pp=2).micro_batch_size(8) == 4, "by default one micro-batch per stage"
    assert ParallelConfig.build(2, "ddp").micro_batch_size(8) == 4, "without a pipeline, the whole share"
