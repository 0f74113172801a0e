"""Benchmark: our ZeRO against a library's, in one run: torch's (zero3 vs FSDP2, `torch-fsdp`; zero1
vs `torch-zero1`, DDP + ZeroRedundancyOptimizer) or, with `--against deepspeed`, DeepSpeed's
ZeRO-3 and ZeRO-1 (the `deepspeed` strategy), with the same model, batch and bucket size.

The four strategies race step by step and are measured for memory as race.py says. The
headline ratio is zero3's median step time over the reference's ZeRO-3; zero1's over its ZeRO-1
is beside it.
"""
from __future__ import annotations

from ..parallel import ParallelConfig
from .race import main, summarize_pairs

# ours -> the reference it races, by library; a reference is (its row name): (strategy, ZeRO stage)
PAIRS = {"torch": {"zero3": "torch-fsdp", "zero1": "torch-zero1"},
         "deepspeed": {"zero3": "deepspeed-zero3", "zero1": "deepspeed-zero1"}}
STRATEGY = {"deepspeed-zero3": ("deepspeed", 3), "deepspeed-zero1": ("deepspeed", 1)}
HEADLINE = {"torch": "FSDP2", "deepspeed": "DeepSpeed ZeRO-3"}


def configs(world_size: int, args) -> dict[str, ParallelConfig]:
    def config(name):
        strategy, zero = STRATEGY.get(name, (name, None))
        return ParallelConfig.build(world_size, strategy, zero=zero, bucket_mb=args.bucket_mb)
    return {name: config(name) for pair in PAIRS[args.against].items() for name in pair}


def check(nproc: int, model="micro", global_batch=16, bucket_mb=25.0, repeats=10, bucket_sweep=None,
          microbatches=None, against="torch") -> None:
    from . import check_steps
    check_steps("zero", nproc, model, global_batch, bucket_mb, repeats, dp=nproc, microbatches=microbatches)
    if bucket_sweep:
        raise ValueError("--bucket-sweep is for bench ddp")
    if against not in PAIRS:
        raise ValueError(f"--against must be one of: {', '.join(PAIRS)} (got {against!r})")


def summarize(report: dict, nproc: int) -> dict:
    against = report.get("against", "torch")
    ratios, details = summarize_pairs(report["rows"], PAIRS[against])
    return {"rows": report["rows"], "ratio": ratios[f"zero3/{PAIRS[against]['zero3']}"], "ratios": ratios,
            "headline": f"zero3 vs {HEADLINE[against]} step time, same model and batch", "details": details,
            "model": report["model"], "global_batch": report["global_batch"], "against": against}


if __name__ == "__main__":
    main(configs)
