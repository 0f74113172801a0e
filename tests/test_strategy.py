"""The strategy interface: the loop asks, the strategy answers, and a strategy that owns the
micro-batch loop (as a pipeline schedule will) fits without a change to the loop."""
import pytest
import torch

from labsupport import comm, runtime
from labsupport.parallel import STRATEGIES, ConfigError, Entry, ParallelConfig
from labsupport.parallel.clip import clip_grad_norm_
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


NANO = ModelConfig("nano", n_layers=2, hidden=64, heads=4, vocab=57, seq_len=64)


@pytest.mark.parametrize("config, world, problems", [
    (ParallelConfig.build(4, "ddp"), 4, []),
    (ParallelConfig.build(2, "single"), 2, ["strategy 'single' runs on one rank; use --nproc 1 (got 2)"]),
    (ParallelConfig.build(2, "nope"), 2, ["unknown strategy 'nope'"]),
    (ParallelConfig.build(4, "ddp", dp=3), 4, ["--dp 3 x --tp 1 x --pp 1 = 3 ranks, but the run has 4",
                                                "--global-batch 8 must be divisible by micro-batch x data-parallel ranks (auto x 3)"]),
    (ParallelConfig.build(4, "ddp", tp=2), 4, ["strategy 'ddp' splits over dp only, so --tp must be 1 (got 2)"]),
    # a degree the strategy does not split is one line: the steps check the rest as if it were 1
    (ParallelConfig.build(6, "ddp", tp=3, pp=2, bucket_mb=0), 6,
     ["splits over dp only, so --tp must be 1", "splits over dp only, so --pp must be 1", "--bucket-mb must be > 0"]),
    (ParallelConfig.build(6, "3d", dp=1, tp=3, pp=2), 6,
     ["--tp 3 must divide the model's heads (4)", "--tp 3 must divide the model's hidden size (64)",
      "--tp 3 must divide the model's padded vocabulary (64)"]),
    (ParallelConfig.build(3, "ddp", pp=3), 3, ["so --pp must be 1 (got 3)",
                                               "the 8 sequences each data-parallel rank gets per step do not split into "
                                               "--pp 3 micro-batches"]),
    (ParallelConfig.build(3, "pp", pp=3), 3, ["--pp 3 x --chunks 1 = 3 pipeline chunks must divide the model's 2 layers",
                                              "the 8 sequences each data-parallel rank gets per step do not split into "
                                              "--pp 3 micro-batches"]),
    (ParallelConfig.build(2, "ddp", zero=4, ddp_mode="ring"), 2, ["--zero must be 0, 1, 2 or 3", "--ddp-mode must be"]),
    (ParallelConfig.build(2, "ddp", zero=1), 2, ["strategy 'ddp' does not shard with ZeRO, so --zero 1 would be ignored; "
                                                 "use --strategy zero1"]),
    (ParallelConfig.build(2, "tp", tp=2, zero=3), 2, ["strategy 'tp' does not shard with ZeRO"]),
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
