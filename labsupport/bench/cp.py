"""Benchmark: ring attention on N ranks (parallel/context.py, balanced split) against dense causal
attention on one rank (torch's scaled_dot_product_attention), at growing sequence lengths.

Attention only, forward and backward, with the heads and hidden size of `--model` and
`--global-batch` sequences; the lengths are the model's seq_len times 1, 4 and 16 unless
`seq_lens` is given. The dense attention runs on rank 0 while the others wait; the ring on all
ranks; the two alternate (`alternate`), so machine drift hits both. Memory per rank is what
autograd keeps for backward (`ActivationMeter`), beside the estimate's, which adds the K/V
blocks in flight (estimate/context.py). torch's own `context_parallel` does not run on CPU (its
SDPA op has no CPU sharding rule), so the reference is the dense computation.
"""
from __future__ import annotations

import argparse

FACTORS = (1, 4, 16)  # default lengths: the model's seq_len times these


def seq_lens_for(model: str, seq_lens=None) -> list[int]:
    from ..estimate.shapes import get_preset
    if seq_lens is None:
        return [get_preset(model).seq_len * f for f in FACTORS]
    if isinstance(seq_lens, str):
        seq_lens = seq_lens.split(",")
    try:
        return [int(s) for s in seq_lens]
    except ValueError:
        raise ValueError(f"--sizes {','.join(map(str, seq_lens))}: give sequence lengths as whole numbers, "
                         "e.g. 1024,4096") from None


def check(nproc: int, model="micro", global_batch=16, repeats=10, seq_lens=None) -> None:
    """Bad options fail here, one line, before any rank starts."""
    from ..estimate.context import split_problems
    from ..estimate.shapes import CPU_PRESETS, get_preset
    if nproc < 2:
        raise ValueError("bench cp needs --nproc 2 or more: the ring needs a neighbour")
    if get_preset(model).vocab is not None:
        raise ValueError(f"--model {model} is an analysis shape; use a CPU preset: {', '.join(CPU_PRESETS)}")
    if global_batch < 1 or repeats < 1:
        raise ValueError("--global-batch and --repeats must be >= 1")
    for s in seq_lens_for(model, seq_lens):
        for problem in split_problems(s, nproc, balanced=True):
            raise ValueError(problem)


def measure(rt, model: str, batch: int, seq_lens: list[int], repeats: int) -> list[dict]:
    """Run on every rank; rank 0's rows are reported: per length and implementation the median
    seconds of a forward + backward and the bytes saved for backward on rank 0."""
    import torch
    import torch.nn.functional as F

    from .. import comm
    from ..estimate.context import attention_memory
    from ..estimate.shapes import get_preset
    from ..metrics import ActivationMeter
    from ..parallel.context import ring_attention, shard_sequence
    from . import alternate, median

    shape = get_preset(model)
    heads, head_dim = shape.heads, shape.hidden // shape.heads
    group = comm.new_group(range(rt.world_size), "cp")
    rows = []
    for s in seq_lens:
        g = torch.Generator().manual_seed(s)
        q, k, v, grad = (torch.randn(batch, heads, s, head_dim, generator=g) for _ in range(4))
        mine = [shard_sequence(t, rt.rank, rt.world_size, dim=2) for t in (q, k, v, grad)]

        def dense():
            if rt.rank == 0:
                leaves = [t.clone().requires_grad_() for t in (q, k, v)]
                F.scaled_dot_product_attention(*leaves, is_causal=True).backward(grad)

        def ring():
            leaves = [t.clone().requires_grad_() for t in mine[:3]]
            ring_attention(*leaves, group=group).backward(mine[3])

        saved = {}
        for name, fn in (("dense", dense), ("ring", ring)):  # untimed: the memory, and a warm-up
            with ActivationMeter().measure() as meter:
                fn()
            saved[name] = meter.peak
        times = alternate({"dense": dense, "ring": ring}, repeats, sync=comm.barrier)
        for name, impl, cp in (("dense", "reference", 1), ("ring", "ours", rt.world_size)):
            rows.append({"name": name, "impl": impl, "seq_len": s, "seconds": median(times[name]),
                         "memory": {"activations": saved[name],
                                    "predicted": attention_memory(s, batch, shape.hidden, heads, cp, 4)["total"]}})
    return rows


def summarize(report: dict, nproc: int) -> dict:
    """Each ring row's `ratio` (its time over dense's at that length); the headline at the longest."""
    rows = report["rows"]
    details = [f"{'seq_len':>9}{'dense s':>11}{'ring s':>11}{'ratio':>8}{'dense act':>12}{'ring act':>12}"
               f"{'+in flight':>12}"]
    ratios = {}
    for r in rows:
        if r["impl"] == "ours":
            ref = next(d for d in rows if d["impl"] == "reference" and d["seq_len"] == r["seq_len"])
            r["ratio"] = ratios[r["seq_len"]] = r["seconds"] / ref["seconds"]
            ref["ratio"] = 1.0
            details.append(f"{r['seq_len']:>9}{ref['seconds']:>11.4g}{r['seconds']:>11.4g}{r['ratio']:>8.3g}"
                           f"{ref['memory']['activations']:>12}{r['memory']['activations']:>12}"
                           f"{r['memory']['predicted'] - r['memory']['activations']:>12}")
    pays = [s for s, ratio in sorted(ratios.items()) if ratio < 1]
    details.append(f"the ring on {nproc} ranks is faster than dense on one from seq_len {pays[0]}" if pays else
                   f"the ring on {nproc} ranks is slower than dense on one at every length measured")
    longest = max(ratios)
    return {"rows": rows, "ratio": ratios[longest], "ratios": ratios, "details": details,
            "headline": f"ring attention on {nproc} ranks vs dense on one, seq_len {longest}",
            "model": report["model"], "global_batch": report["global_batch"]}


def main() -> None:
    from .. import report
    from ..runtime import init
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--seq-lens", default=None, help="comma-separated, e.g. 256,1024")
    p.add_argument("--bucket-mb", type=float, default=None, help="passed to every benchmark; unused")
    args = p.parse_args()
    with init() as rt:
        rows = measure(rt, args.model, args.global_batch, seq_lens_for(args.model, args.seq_lens), args.repeats)
        if rt.rank == 0:
            report(rows=rows, model=args.model, global_batch=args.global_batch)


if __name__ == "__main__":
    main()
