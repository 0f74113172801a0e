"""The memory model against the trainer: `labsupport train --json` measures each rank's bytes by
category from the tensors themselves; `estimate_memory` for the same preset, dp = 2 and ZeRO
stage must agree within 10% in every category.

The CPU presets train in fp32 (4 + 4 + 8 bytes per parameter) with PyTorch's fused attention,
which stores no attention scores: Korthikanti's 5 a s / h term drops out, as under selective
recomputation, so the prediction is `recompute="selective"`. What remains differs from the
measurement by the LM head's logits (not a transformer layer), the padding of ZeRO's flat
buffers and Adam's step counters: a few percent. One run per stage, each preset once; the runs
are the harness's (one per configuration and session), so the nano ones cost nothing more in a full session.
"""
import pytest

from labsupport.estimate.memory import estimate_memory
from labsupport.model import PRESETS
from harness import prefetch, train

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

CATEGORIES = ("params", "grads", "optimizer", "activations")


def predicted(summary, zero: int) -> dict:
    """estimate_memory for the run's model (its vocabulary), micro-batch and data-parallel size."""
    cfg = PRESETS[summary["model"]["name"]].with_vocab(summary["model"]["vocab"])
    return estimate_memory(cfg, micro_batch=summary["micro_batch"], precision="fp32", dp=summary["world_size"],
                           zero=zero, recompute="selective")


RUNS = [("ddp", 0, "nano"), ("zero1", 1, "nano"), ("zero2", 2, "micro"), ("zero3", 3, "mini")]


@pytest.fixture(scope="module")
def runs():
    """The four runs, trained ahead in one launch (harness.prefetch): the bytes are counted from the
    tensors each run holds, whatever ran before it in the process."""
    prefetch(*[(strategy, 2, ("--model", preset)) for strategy, _, preset in RUNS])


@pytest.mark.parametrize("strategy, zero, preset", RUNS)
def test_prediction_within_10_percent_of_the_measurement(runs, strategy, zero, preset):
    summary = train(strategy, 2, "--model", preset)  # nano: the runs test_ddp and test_zero compare with single
    assert summary["model"]["name"] == preset and summary["world_size"] == 2
    want = predicted(summary, zero)
    for rank, measured in enumerate(summary["memory"]):
        for k in CATEGORIES:
            assert measured[k] == pytest.approx(want[k], rel=0.10), (strategy, preset, rank, k, measured[k], want[k])
