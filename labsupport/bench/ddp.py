"""Benchmark: our data parallelism (naive, flat, bucketed) against torch's DistributedDataParallel.

Each variant gets its own replica of the same model and trains on the same batches; one
step of each, in turn, is timed, so the variants share the machine's ups and downs. The
headline ratio is our bucketed step time over torch DDP's, with the same bucket size.
"""
from __future__ import annotations

import argparse

VARIANTS = ("naive", "flat", "bucketed", "torch-ddp")


def check(nproc: int, model="micro", global_batch=16, bucket_mb=25.0, repeats=10, bucket_sweep=None) -> None:
    from . import check_steps
    check_steps("ddp", nproc, model, global_batch, bucket_mb, repeats)
    for mb in _sweep(bucket_sweep):
        if mb <= 0:
            raise ValueError("--bucket-sweep sizes must be > 0")


def _sweep(bucket_sweep) -> list[float]:
    if not bucket_sweep:
        return []
    parts = bucket_sweep.split(",") if isinstance(bucket_sweep, str) else bucket_sweep
    return [float(x) for x in parts]


def measure(rt, model_name, global_batch, bucket_mb, repeats, sweep):
    import torch

    from .. import comm
    from ..data import BatchSampler, Corpus
    from ..model import TinyGPT, get_preset
    from ..parallel import ParallelConfig, make_strategy
    from ..train import train_step
    from . import alternate, median

    corpus = Corpus.load()
    cfg = get_preset(model_name).with_vocab(corpus.tokenizer.vocab_size)
    sampler = BatchSampler(corpus.train, cfg.seq_len, global_batch, seed=0)
    variants = {v: ("torch-ddp" if v == "torch-ddp" else "ddp", v if v != "torch-ddp" else "bucketed", bucket_mb)
                for v in VARIANTS}
    variants.update({f"bucketed@{mb:g}MB": ("ddp", "bucketed", mb) for mb in sweep})
    runners = {}
    for name, (strategy_name, mode, mb) in variants.items():
        torch.manual_seed(0)
        config = ParallelConfig.build(rt.world_size, strategy_name, ddp_mode=mode, bucket_mb=mb)
        strategy = make_strategy(rt, config)
        model = strategy.parallelize(TinyGPT(cfg))
        optimizer = strategy.make_optimizer(model, 1e-3, 0.1)
        step = iter(range(10**9))

        def run(strategy=strategy, model=model, optimizer=optimizer, step=step):
            x, y = sampler.local_batch(next(step), rt.rank, rt.world_size)
            train_step(strategy, model, optimizer, [(x.to(rt.device), y.to(rt.device))], 1.0)
        runners[name] = run
    for run in runners.values():
        run()  # warm-up
    times = alternate(runners, repeats, sync=comm.barrier)
    return [{"name": name, "impl": "reference" if name == "torch-ddp" else "ours",
             "mode": variants[name][1], "bucket_mb": variants[name][2], "seconds": median(ts)}
            for name, ts in times.items()]


def summarize(report: dict, nproc: int) -> dict:
    rows = report["rows"]
    reference = next(r["seconds"] for r in rows if r["name"] == "torch-ddp")
    for r in rows:
        r["ratio"] = r["seconds"] / reference
    ratio = next(r["ratio"] for r in rows if r["name"] == "bucketed")
    return {"rows": rows, "ratio": ratio, "headline": "bucketed vs torch DDP step time, same bucket size",
            "model": report["model"], "global_batch": report["global_batch"]}


def main() -> None:
    from .. import report
    from ..runtime import init
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--bucket-sweep", default=None)
    args = p.parse_args()
    with init() as rt:
        rows = measure(rt, args.model, args.global_batch, args.bucket_mb, args.repeats, _sweep(args.bucket_sweep))
        if rt.rank == 0:
            report(rows=rows, model=args.model, global_batch=args.global_batch)


if __name__ == "__main__":
    main()
