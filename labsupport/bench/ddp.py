"""Benchmark: our data parallelism (naive, flat, bucketed) against torch's DistributedDataParallel.

Each variant races step by step as race.py says, on its own replica of the same model. The
headline ratio is our bucketed step time over torch DDP's, with the same bucket size;
`--bucket-sweep` adds bucketed at other sizes.
"""
from __future__ import annotations

from ..parallel import ParallelConfig
from .race import main

VARIANTS = ("naive", "flat", "bucketed", "torch-ddp")


def check(nproc: int, model="micro", global_batch=16, bucket_mb=25.0, repeats=10, bucket_sweep=None,
          microbatches=None) -> None:
    from . import check_steps
    check_steps("ddp", nproc, model, global_batch, bucket_mb, repeats, dp=nproc, microbatches=microbatches)
    for mb in _sweep(bucket_sweep):
        if mb <= 0:
            raise ValueError("--bucket-sweep sizes must be > 0")


def _sweep(bucket_sweep) -> list[float]:
    if not bucket_sweep:
        return []
    parts = bucket_sweep.split(",") if isinstance(bucket_sweep, str) else bucket_sweep
    return [float(x) for x in parts]


def variants(bucket_mb: float, bucket_sweep) -> dict[str, tuple[str, str, float]]:
    """name -> (strategy, DDP mode, bucket MB)."""
    named = {v: ("ddp", v, bucket_mb) for v in VARIANTS if v != "torch-ddp"}
    named["torch-ddp"] = ("torch-ddp", "bucketed", bucket_mb)
    named.update({f"bucketed@{mb:g}MB": ("ddp", "bucketed", mb) for mb in _sweep(bucket_sweep)})
    return named


def configs(world_size: int, args) -> dict[str, ParallelConfig]:
    return {name: ParallelConfig.build(world_size, strategy, ddp_mode=mode, bucket_mb=mb)
            for name, (strategy, mode, mb) in variants(args.bucket_mb, args.bucket_sweep).items()}


def summarize(report: dict, nproc: int) -> dict:
    rows = report["rows"]
    reference = next(r["seconds"] for r in rows if r["name"] == "torch-ddp")
    named = variants(report["bucket_mb"], report["bucket_sweep"])
    for r in rows:
        r.pop("memory")  # step time is what bench ddp compares
        _, r["mode"], r["bucket_mb"] = named[r["name"]]
        r.update(impl="reference" if r["name"] == "torch-ddp" else "ours", ratio=r["seconds"] / reference)
    ratio = next(r["ratio"] for r in rows if r["name"] == "bucketed")
    return {"rows": rows, "ratio": ratio, "headline": "bucketed vs torch DDP step time, same bucket size",
            "model": report["model"], "global_batch": report["global_batch"]}


if __name__ == "__main__":
    main(configs)
