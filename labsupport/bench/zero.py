"""Benchmark: our ZeRO against torch's, in one run: zero3 vs FSDP2 (`torch-fsdp`), zero1 vs
`torch-zero1` (DDP + ZeroRedundancyOptimizer).

The four strategies each get their own model from the same seed, train on the same batches, and
take one step each in turn, so they share the machine's ups and downs. After the timed steps one
more step of each is measured for memory, per rank and by category (parameters, gradients,
optimizer states, the activations autograd kept), as `labsupport train` measures it. The
headline ratio is zero3's median step time over FSDP2's; zero1's over torch-zero1's is beside it.
"""
from __future__ import annotations

import argparse

from ..parallel import ParallelConfig, make_strategy

PAIRS = {"zero3": "torch-fsdp", "zero1": "torch-zero1"}  # ours -> the reference it races
MEMORY = ("params", "grads", "optimizer", "activations")


def check(nproc: int, model="micro", global_batch=16, bucket_mb=25.0, repeats=10, bucket_sweep=None) -> None:
    from . import check_steps
    check_steps("zero", nproc, model, global_batch, bucket_mb, repeats)
    if bucket_sweep:
        raise ValueError("--bucket-sweep is for bench ddp")


def measure(rt, model_name, global_batch, bucket_mb, repeats):
    import torch

    from .. import comm
    from ..data import BatchSampler, Corpus
    from ..metrics import ActivationMeter
    from ..model import TinyGPT, get_preset
    from ..train import MemoryPeaks, train_step
    from . import alternate, median

    corpus = Corpus.load()
    cfg = get_preset(model_name).with_vocab(corpus.tokenizer.vocab_size)
    sampler = BatchSampler(corpus.train, cfg.seq_len, global_batch, seed=0)
    runners, memory = {}, {}
    for name in [n for pair in PAIRS.items() for n in pair]:
        torch.manual_seed(0)
        strategy = make_strategy(rt, ParallelConfig.build(rt.world_size, name, bucket_mb=bucket_mb))
        model = strategy.parallelize(TinyGPT(cfg))
        optimizer = strategy.make_optimizer(model, 1e-3, 0.1)
        step = iter(range(10**9))

        def run(strategy=strategy, model=model, optimizer=optimizer, step=step):
            x, y = sampler.local_batch(next(step), rt.rank, rt.world_size)
            train_step(strategy, model, optimizer, [(x.to(rt.device), y.to(rt.device))], 1.0)

        def measure_memory(model=model, optimizer=optimizer, run=run):
            peaks = MemoryPeaks(rt.device)
            with ActivationMeter().measure() as meter:
                run()
            return peaks.update(model, optimizer, meter.peak)
        runners[name], memory[name] = run, measure_memory
    for run in runners.values():
        run()  # warm-up
    times = alternate(runners, repeats, sync=comm.barrier)
    rows = []
    for name, ts in times.items():
        mine = memory[name]()
        local = torch.tensor([mine[key] for key in MEMORY], dtype=torch.int64)
        every = torch.zeros(rt.world_size * len(MEMORY), dtype=torch.int64)
        comm.all_gather_into_tensor(every, local)  # (all ranks take part) each rank's memory, in rank order
        per_rank = [dict(zip(MEMORY, r)) for r in every.view(rt.world_size, len(MEMORY)).tolist()]
        rows.append({"name": name, "impl": "ours" if name in PAIRS else "reference", "seconds": median(ts),
                     "memory": per_rank})
    return rows


def summarize(report: dict, nproc: int) -> dict:
    rows = {r["name"]: r for r in report["rows"]}
    ratios = {}
    for ours, reference in PAIRS.items():
        ratios[f"{ours}/{reference}"] = rows[ours]["ratio"] = rows[ours]["seconds"] / rows[reference]["seconds"]
        rows[reference]["ratio"] = 1.0
    details = [f"{'bytes/rank':<12}" + "".join(f"{key:>13}" for key in MEMORY) + "   (the largest rank's)"]
    for name, r in rows.items():
        top = {key: max(m[key] for m in r["memory"]) for key in MEMORY}
        details.append(f"{name:<12}" + "".join(f"{top[key]:>13,}" for key in MEMORY))
    details += [f"ratio {pair}: {ratio:.3g}x time" for pair, ratio in ratios.items()]
    return {"rows": list(rows.values()), "ratio": ratios["zero3/torch-fsdp"], "ratios": ratios,
            "headline": "zero3 vs FSDP2 step time, same model and batch", "details": details,
            "model": report["model"], "global_batch": report["global_batch"]}


def main() -> None:
    from .. import report
    from ..runtime import init
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    with init() as rt:
        rows = measure(rt, args.model, args.global_batch, args.bucket_mb, args.repeats)
        if rt.rank == 0:
            report(rows=rows, model=args.model, global_batch=args.global_batch)


if __name__ == "__main__":
    main()
