"""Benchmark: our tensor parallelism (`tp`, Megatron-style) against torch's (`torch-tp`, DTensor),
in one run, without and with sequence parallelism.

The model is cut over every rank (--tp = nproc, so all ranks read the same batches). Four
configurations, `tp`, `torch-tp` and both with `--sequence-parallel`, race step by step and are
measured for memory as race.py says. The headline ratio is tp's median step time over
torch-tp's; the sequence-parallel pair's ratio is beside it.
"""
from __future__ import annotations

from ..parallel import ParallelConfig
from .race import main, summarize_pairs

VARIANTS = {"tp": ("tp", False), "torch-tp": ("torch-tp", False),  # name -> (strategy, sequence parallel)
            "tp+sp": ("tp", True), "torch-tp+sp": ("torch-tp", True)}
PAIRS = {"tp": "torch-tp", "tp+sp": "torch-tp+sp"}  # ours -> the reference it races


def configs(nproc: int, args=None) -> dict[str, ParallelConfig]:
    return {name: ParallelConfig.build(nproc, strategy, tp=nproc, sequence_parallel=sp)
            for name, (strategy, sp) in VARIANTS.items()}


def check(nproc: int, model="micro", global_batch=16, bucket_mb=25.0, repeats=10, bucket_sweep=None,
          microbatches=None) -> None:
    """bench's common checks, then the TP ones `labsupport train` makes (heads, hidden size and
    vocabulary divisible by nproc; with sequence parallelism, the sequence too), one line each."""
    from ..estimate.shapes import preset_shape
    from . import check_steps
    check_steps("tp", nproc, model, global_batch, bucket_mb, repeats, dp=1, microbatches=microbatches)
    if bucket_sweep:
        raise ValueError("--bucket-sweep is for bench ddp")
    cfg = preset_shape(model)
    configs(nproc)["tp+sp"].check(nproc, cfg, global_batch)  # the sequence-parallel one checks everything


def summarize(report: dict, nproc: int) -> dict:
    rows = report["rows"]
    for r in rows:
        r.update(sequence_parallel=VARIANTS[r["name"]][1], tp=nproc)
    ratios, details = summarize_pairs(rows, PAIRS)
    return {"rows": rows, "ratio": ratios["tp/torch-tp"], "ratios": ratios, "details": details,
            "headline": f"tp vs DTensor step time, --tp {nproc}, same model and batch",
            "model": report["model"], "global_batch": report["global_batch"]}


if __name__ == "__main__":
    main(configs)
