"""Benchmark: our collectives from send/recv against the backend's own, over a size sweep.

Measured on every size: all-reduce (our ring vs the backend's), all-gather (ring vs
all_gather_into_tensor), reduce-scatter (ring vs the backend's) and
broadcast (binomial tree vs the backend's). For each we report the median time, algorithm
bandwidth and bus bandwidth (nccl-tests definitions), fit alpha and beta of the ring model
to the sweep, and the headline ratio: our ring all-reduce / the backend's at 16 MB.
"""
from __future__ import annotations

import argparse

from ..estimate.comm_cost import algbw, busbw, fit_alpha_beta

DEFAULT_SIZES = (2**12, 2**16, 2**20, 2**22, 2**24)  # bytes: 4 KB .. 16 MB
HEADLINE_BYTES = 2**24
WARMUP = 3  # untimed rounds first, as nccl-tests does: the first calls of a process are slow
PER_VISIT = 3  # timed calls of each implementation each time a round comes to a size


def check(nproc: int, sizes=None, repeats: int = 5) -> None:
    """Bad options fail here, before any rank starts."""
    if nproc < 2:
        raise ValueError("bench collectives needs --nproc 2 or more: one rank has nobody to talk to")
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")
    for s in _parse_sizes(sizes):
        if s < 4 or s % 4:
            raise ValueError(f"sizes are bytes of float32 data: multiples of 4, got {s}")


def _parse_sizes(sizes) -> list[int]:
    if sizes is None:
        return list(DEFAULT_SIZES)
    if isinstance(sizes, str):
        sizes = sizes.split(",")
    return [int(float(s)) for s in sizes]


def measure(sizes: list[int], repeats: int) -> list[dict]:
    """Run on every rank; returns raw timings (rank 0's are reported): the median of
    `repeats` x PER_VISIT calls of each implementation, for each op and size.

    Every size is warmed up before any is timed, and each of the `repeats` rounds visits the
    sizes in a new shuffled order. Timing one size to the end before the next made the first
    size, 4 KiB, pay for the start of the run (the other processes of the launch still busy on
    the 2 cores) and let one burst of load spoil all of one size's samples: 4 KiB came out
    ~6x slower than 16 KiB. Now a burst costs a few samples of several sizes, which the median drops.
    """
    import random

    import torch.distributed as dist

    from . import alternate, median

    cases = {size: _cases(size) for size in sizes}
    for size in sizes:  # untimed, as nccl-tests does: connections, allocator, caches
        for impls in cases[size].values():
            alternate(impls, WARMUP, sync=dist.barrier)
    times = {(size, op): {impl: [] for impl in impls} for size in sizes for op, impls in cases[size].items()}
    order = random.Random(0)  # the same seed on every rank: all ranks must call the same collectives
    for _ in range(repeats):
        for size in order.sample(sizes, len(sizes)):
            for op, impls in cases[size].items():
                for impl, ts in alternate(impls, PER_VISIT, sync=dist.barrier).items():
                    times[size, op][impl] += ts
    return [{"op": op, "impl": impl, "bytes": size, "seconds": median(ts)}
            for (size, op), by_impl in times.items() for impl, ts in by_impl.items()]


def _cases(size: int) -> dict:
    """op -> {"ours": fn, "reference": fn} on float32 buffers of `size` bytes."""
    import torch
    import torch.distributed as dist

    from .. import algorithms, comm

    n = comm.get_world_size()
    x = torch.rand(size // 4, generator=torch.Generator().manual_seed(comm.get_rank()))
    gathered = torch.empty(n * (x.numel() // n))
    mine = x[: x.numel() // n].clone()
    shard = torch.empty(x.numel() // n)
    return {
        "all_reduce": {"ours": lambda: algorithms.ring_all_reduce(x.clone()),
                       "reference": lambda: dist.all_reduce(x.clone())},
        "all_gather": {"ours": lambda: algorithms.ring_all_gather(gathered, mine),
                       "reference": lambda: comm.all_gather_into_tensor(gathered, mine)},
        "reduce_scatter": {"ours": lambda: algorithms.ring_reduce_scatter(x[: n * shard.numel()]),
                           "reference": lambda: dist.reduce_scatter(shard, list(x[: n * shard.numel()].chunk(n)))},
        "broadcast": {"ours": lambda: algorithms.tree_broadcast(x.clone(), 0),
                      "reference": lambda: dist.broadcast(x.clone(), 0)},
    }


def summarize(report: dict, nproc: int) -> dict:
    """Bandwidths per row, alpha-beta fits per (op, impl), and the headline ratio."""
    rows = report["rows"]
    for r in rows:
        r["name"] = f"{r['op']}-{'ring' if r['impl'] == 'ours' and r['op'] != 'broadcast' else r['impl']}"
        r["algbw_GBps"] = algbw(r["bytes"], r["seconds"]) / 1e9
        r["busbw_GBps"] = busbw(r["op"], r["bytes"], r["seconds"], nproc) / 1e9
    fits = {}
    for op in sorted({r["op"] for r in rows}):
        for impl in ("ours", "reference"):
            pts = [r for r in rows if r["op"] == op and r["impl"] == impl]
            if len({r["bytes"] for r in pts}) >= 2:
                algorithm = "tree" if op == "broadcast" else "ring"
                alpha, beta = fit_alpha_beta([r["bytes"] for r in pts], [r["seconds"] for r in pts],
                                             op=op, algorithm=algorithm, p=nproc)
                fits[f"{op}/{impl}"] = {"algorithm": algorithm, "alpha_s": alpha, "beta_s_per_byte": beta}
    ratios = {}
    for r in rows:
        if r["impl"] == "ours":
            ref = next(q for q in rows if q["op"] == r["op"] and q["bytes"] == r["bytes"] and q["impl"] == "reference")
            ratios.setdefault(r["op"], {})[r["bytes"]] = r["seconds"] / ref["seconds"]
    size = max((r["bytes"] for r in rows if r["op"] == "all_reduce"), key=lambda b: (b <= HEADLINE_BYTES, b))
    return {"rows": rows, "fits": fits, "ratios": ratios, "headline": f"ring all_reduce vs backend at {size} bytes",
            "ratio": ratios["all_reduce"][size], "backend": report["backend"]}


def main() -> None:
    import torch.distributed as dist

    from .. import report
    from ..runtime import init
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default=None, help="comma-separated bytes, e.g. 4096,1e6,16e6")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    with init() as rt:
        rows = measure(_parse_sizes(args.sizes), args.repeats)
        if rt.rank == 0:
            report(rows=rows, backend=dist.get_backend())


if __name__ == "__main__":
    main()
