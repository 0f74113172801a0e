"""The strategy interface: the loop asks, the strategy answers, and a strategy that owns the
micro-batch loop (as a pipeline schedule will) fits without a change to the loop."""
from dataclasses import replace

import pytest
import torch

from labsupport import comm, runtime
from labsupport.parallel import STRATEGIES, ConfigError, Entry, ParallelConfig
from labsupport.parallel.clip import clip_grad_norm_, count_once
from labsupport.parallel.strategy import Strategy
from labsupport.model import ModelConfig
from labsupport.loop import train
from labsupport.train import build_parser


class AllForwardAllBackward(Strategy):
    """Every micro-batch's forward first, then every backward (GPipe's order on one stage):
    the activations of all micro-batches are alive at once."""

    name = "afab"

    def forward_backward(self, model, batches, autocast=None):
        with comm.phase("forward"):
            losses = [self.loss_fn(model(x), y) for x, y in batches]
        with comm.phase("backward"):
            for loss in losses:
                (loss / len(batches)).backward()
        return torch.stack([loss.detach() for loss in losses]).mean()


def run_in_process(strategy, monkeypatch):
    monkeypatch.setitem(STRATEGIES, "afab", Entry(lambda: AllForwardAllBackward, ()))
    args = build_parser().parse_args(["--strategy", strategy, "--model", "nano", "--steps", "4", "--global-batch", "8",
                                      "--micro-batch", "2", "--sample-chars", "5", "--eval-batches", "1"])
    with runtime.init(seed=0) as rt:
        return train(args, rt)


def test_a_strategy_that_owns_its_micro_batch_loop_fits_the_loop(monkeypatch):
    single = run_in_process("single", monkeypatch)
    afab = run_in_process("afab", monkeypatch)
    assert afab["losses"] == pytest.approx(single["losses"], abs=1e-6)
    assert afab["grad_norms"] == pytest.approx(single["grad_norms"], rel=1e-6)
    assert afab["sample"] == single["sample"] and afab["val_losses"][0][1] == pytest.approx(single["val_losses"][0][1])
    # 4 micro-batches in flight instead of 1: the meter counts live saved tensors, so it sees it
    ratio = afab["memory"]["activations"] / single["memory"]["activations"]
    assert 3.9 < ratio <= 4.0, ratio


def test_clip_grad_norm_is_the_global_norm_and_scales_down_only():
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(4))
    a.grad, b.grad = torch.full((3,), 3.0), torch.full((4,), 2.0)  # norm sqrt(27 + 16)
    assert clip_grad_norm_([a, b], 100.0) == pytest.approx(43 ** 0.5)
    assert torch.equal(a.grad, torch.full((3,), 3.0)), "a norm under the limit leaves gradients alone"
    clip_grad_norm_([a, b], 1.0)
    assert torch.cat([a.grad, b.grad]).norm().item() == pytest.approx(1.0, rel=1e-5)



def test_a_replicated_gradient_is_counted_once_on_the_groups_rank_0(monkeypatch):
    """count_once: a rank's own gradients on every rank, the ones every rank holds on rank 0 only (the tensor,
    expert, FSDP and pipeline norms all take their rule from it)."""
    shard, replica = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    group = object()  # the group count_once asks its rank in
    for rank, counted in ((0, [shard, replica]), (1, [shard])):
        monkeypatch.setattr(comm, "get_rank", lambda g=None, rank=rank: rank if g is group else -1)
        assert list(map(id, count_once([shard, replica], [shard], group))) == list(map(id, counted)), rank


NANO = ModelConfig("nano", n_layers=2, hidden=64, heads=4, vocab=57, seq_len=64)


@pytest.mark.parametrize("config, world, problems", [
    (ParallelConfig.build(4, "ddp"), 4, []),
    (ParallelConfig.build(2, "single"), 2, ["strategy 'single' runs on one rank, but the run has 2: name a parallel strategy (e.g. --strategy ddp), or run it on one rank"]),
    (ParallelConfig.build(2, "nope"), 2, ["unknown strategy 'nope'"]),
    (ParallelConfig.build(4, "ddp", dp=3), 4, ["--dp 3 x --tp 1 x --pp 1 = 3 ranks, but the run has 4",
                                                "--global-batch 8 must be divisible by micro-batch x data-parallel ranks (auto x 3)"]),
    # a name of ours fills defaults and restricts nothing the steps accept: dp 2 x tp 2 is `ddp` with --tp 2
    (ParallelConfig.build(4, "ddp", tp=2), 4, []),
    (ParallelConfig.build(8, "tp", tp=2, cp=2), 8, []),
    (ParallelConfig.build(2, "cp", cp=2), 2, []),
    # ... but it does not run what it does not name: ddp on dp 1 is not data parallelism
    (ParallelConfig.build(2, "ddp", cp=2), 2, ["strategy 'ddp' is data parallelism, but this grid has --dp 1 "
                                               "(--dp 1 x --tp 1 x --pp 1 x --cp 2 on 2 ranks); name what runs: "
                                               "--strategy cp"]),
    (ParallelConfig.build(16, "3d", tp=2, pp=2, cp=2), 16, ["--cp 2 does not combine with --pp"]),  # a step refuses
    (ParallelConfig.build(2, "zero1", cp=2), 2, ["--cp 2 runs with --zero 0 only",
                                                 "ZeRO-1/2: stage 1 shards over the data-parallel ranks, but this grid has --dp 1"]),
    # a reference declares what it splits: a degree it does not split is one line, the steps check the rest as if 1
    (ParallelConfig.build(4, "torch-ddp", tp=2), 4, ["strategy 'torch-ddp' splits over dp only, so --tp must be 1 (got 2)"]),
    (ParallelConfig.build(6, "torch-ddp", tp=3, pp=2, bucket_mb=0), 6,
     ["splits over dp only, so --tp must be 1", "splits over dp only, so --pp must be 1", "--bucket-mb must be > 0"]),
    (ParallelConfig.build(6, "3d", dp=1, tp=3, pp=2), 6,
     ["--tp 3 must divide the model's heads (4)", "--tp 3 must divide the model's hidden size (64)",
      "--tp 3 must divide the model's padded vocabulary (64)"]),
    (ParallelConfig.build(3, "torch-ddp", pp=3), 3, ["so --pp must be 1 (got 3)",
                                               "the 8 sequences each data-parallel rank gets per step do not split into "
                                               "--pp 3 micro-batches"]),
    (ParallelConfig.build(3, "pp", pp=3), 3, ["--pp 3 x --chunks 1 = 3 pipeline chunks must divide the model's 2 layers",
                                              "the 8 sequences each data-parallel rank gets per step do not split into "
                                              "--pp 3 micro-batches"]),
    (ParallelConfig.build(2, "ddp", zero=4, ddp_mode="ring"), 2, ["--zero must be 0, 1, 2 or 3", "--ddp-mode must be"]),
    (ParallelConfig.build(2, "ddp", zero=1), 2, ["strategy 'ddp' does not shard with ZeRO, so --zero 1 would be ignored; "
                                                 "use --strategy zero1"]),
    (ParallelConfig.build(2, "tp", tp=2, zero=3), 2, ["ZeRO-3 shards whole units over the DP group; it does not "
                                                      "compose with --tp or --pp"]),
    (ParallelConfig.build(2, "ddp", zero=0), 2, []),
])
def test_config_names_every_mistake_on_its_own_line(config, world, problems):
    found = config.problems(world, NANO, global_batch=8)  # the configuration's own, then each step's
    assert len(found) == len(problems), found
    for expected in problems:
        assert sum(expected in line for line in found) == 1, (expected, found)
    assert not any("\n" in line for line in found)
    if problems:
        with pytest.raises(ConfigError) as err:
            config.check(world, NANO, global_batch=8)
        assert str(err.value).count("\n") == len(problems) - 1


def test_config_checks_the_batch_against_the_data_parallel_degree():
    config = ParallelConfig.build(4, "ddp")
    assert config.problems(4, NANO, global_batch=8, micro_batch=2) == []
    assert "--global-batch 6 must be divisible" in config.problems(4, NANO, global_batch=6)[0]
    assert "--global-batch 8 must be divisible" in config.problems(4, NANO, global_batch=8, micro_batch=3)[0]


def test_what_the_llama_family_does_not_cut_yet_is_one_line_before_any_rank():
    """llama-micro (issue 30): data parallelism and ZeRO take it as they are; tensor parallelism (ours and
    torch's) on whole key/value heads, the pipeline (its untied head), the ring (grouped K/V, RoPE from global
    positions) and expert parallelism (SwiGLU experts) cut it. A tp that splits no whole key/value heads, or
    does not divide the MLP's width, is one line naming the numbers."""
    from labsupport.estimate.shapes import preset_shape
    llama = preset_shape("llama-micro", 57)
    for config in (ParallelConfig.build(2, "ddp"), ParallelConfig.build(2, "zero3"), ParallelConfig.build(1, "single"),
                   ParallelConfig.build(2, "tp", tp=2), ParallelConfig.build(2, "torch-tp", tp=2, sequence_parallel=True),
                   ParallelConfig.build(2, "pp", pp=2), ParallelConfig.build(2, "torch-pp", pp=2),
                   ParallelConfig.build(4, "3d", dp=2, pp=2, zero=1), ParallelConfig.build(2, "cp", cp=2)):
        assert config.problems(config.world_size, llama, global_batch=8) == []
    for config, line in ((ParallelConfig.build(4, "tp", tp=4), "--tp 4 must divide the model's key/value heads (2)"),
                         (ParallelConfig.build(4, "torch-tp", tp=4), "--tp 4 must divide the model's key/value heads")):
        found = config.problems(config.world_size, llama, global_batch=8)
        assert len(found) == 1 and line in found[0] and "\n" not in found[0], found
    assert "--tp 2 must divide the model's MLP width (ffn_hidden 351)" in ParallelConfig.build(2, "tp", tp=2).problems(
        2, replace(llama, ffn_hidden=351), global_batch=8)[0]
