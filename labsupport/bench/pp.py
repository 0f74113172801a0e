"""Benchmark: our pipeline executor (`pp`) against torch.distributed.pipelining (`torch-pp`), in
one run, with the same schedule: 1F1B against torch's Schedule1F1B, GPipe against ScheduleGPipe.

The model is cut into --pp = nproc stages (every stage reads the same batches), each step runs
--microbatches micro-batches, and the four configurations race step by step and are measured for
memory as race.py says. Both run the same stage modules (torch-pp wraps pp's split), so the
ratio is the executor's: the schedule's bookkeeping and its sends and receives. The headline is
1F1B's; GPipe's is beside it.
"""
from __future__ import annotations

import argparse

from ..parallel import ParallelConfig
from .race import main, summarize_pairs

VARIANTS = {"1f1b": ("pp", "1f1b"), "torch-1f1b": ("torch-pp", "1f1b"),  # name -> (strategy, schedule)
            "gpipe": ("pp", "gpipe"), "torch-gpipe": ("torch-pp", "gpipe")}
PAIRS = {"1f1b": "torch-1f1b", "gpipe": "torch-gpipe"}  # ours -> the reference it races
MICROBATCHES = 4


def configs(nproc: int, args) -> dict[str, ParallelConfig]:
    m = args.microbatches or MICROBATCHES
    return {name: ParallelConfig.build(nproc, strategy, pp=nproc, schedule=schedule, microbatches=m)
            for name, (strategy, schedule) in VARIANTS.items()}


def check(nproc: int, model="micro", global_batch=16, bucket_mb=25.0, repeats=10, bucket_sweep=None,
          microbatches=None) -> None:
    """bench's common checks, then `labsupport train`'s for each configuration (stages dividing the
    layers, micro-batches dividing the batch and, for torch's 1F1B, at least one per stage)."""
    from ..estimate.shapes import preset_shape
    from . import check_steps
    check_steps("pp", nproc, model, global_batch, bucket_mb, repeats, dp=1, microbatches=microbatches)
    if bucket_sweep:
        raise ValueError("--bucket-sweep is for bench ddp")
    cfg = preset_shape(model)
    for config in configs(nproc, argparse.Namespace(microbatches=microbatches)).values():
        config.check(nproc, cfg, global_batch)


def summarize(report: dict, nproc: int) -> dict:
    rows = report["rows"]
    for r in rows:
        r.update(schedule=VARIANTS[r["name"]][1], pp=nproc, microbatches=report["microbatches"] or MICROBATCHES)
    ratios, details = summarize_pairs(rows, PAIRS)
    return {"rows": rows, "ratio": ratios["1f1b/torch-1f1b"], "ratios": ratios, "details": details,
            "headline": f"pp vs torch.distributed.pipelining step time, 1F1B, --pp {nproc}, same model and batch",
            "model": report["model"], "global_batch": report["global_batch"]}


if __name__ == "__main__":
    main(configs)
