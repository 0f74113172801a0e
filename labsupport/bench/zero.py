"""Benchmark: our ZeRO against torch's, in one run: zero3 vs FSDP2 (`torch-fsdp`), zero1 vs
`torch-zero1` (DDP + ZeroRedundancyOptimizer).

The four strategies race step by step and are measured for memory as race.py says. The
headline ratio is zero3's median step time over FSDP2's; zero1's over torch-zero1's is beside it.
"""
from __future__ import annotations

from ..parallel import ParallelConfig
from .race import main, summarize_pairs

PAIRS = {"zero3": "torch-fsdp", "zero1": "torch-zero1"}  # ours -> the reference it races


def configs(world_size: int, args) -> dict[str, ParallelConfig]:
    return {name: ParallelConfig.build(world_size, name, bucket_mb=args.bucket_mb)
            for pair in PAIRS.items() for name in pair}


def check(nproc: int, model="micro", global_batch=16, bucket_mb=25.0, repeats=10, bucket_sweep=None,
          microbatches=None) -> None:
    from . import check_steps
    check_steps("zero", nproc, model, global_batch, bucket_mb, repeats, dp=nproc, microbatches=microbatches)
    if bucket_sweep:
        raise ValueError("--bucket-sweep is for bench ddp")


def summarize(report: dict, nproc: int) -> dict:
    ratios, details = summarize_pairs(report["rows"], PAIRS)
    return {"rows": report["rows"], "ratio": ratios["zero3/torch-fsdp"], "ratios": ratios,
            "headline": "zero3 vs FSDP2 step time, same model and batch", "details": details,
            "model": report["model"], "global_batch": report["global_batch"]}


if __name__ == "__main__":
    main(configs)
