"""Racing training steps: one model per strategy configuration, one step of each in turn.

Every benchmark that compares training strategies (ddp, zero, tp) measures the same way: each
configuration gets its own model from the same seed and trains on the same batches; after a
warm-up step each, one step of each is timed in turn (`alternate`), so they share the machine's
ups and downs; then one more step of each is measured for memory, per rank and by category
(parameters, gradients, optimizer states, the activations autograd kept), as `labsupport train`
measures it.
"""
from __future__ import annotations

MEMORY = ("params", "grads", "optimizer", "activations")


def race(rt, configs: dict, model_name: str, global_batch: int, repeats: int) -> list[dict]:
    """A row per configuration name: the median step time (`seconds`) and `memory`, each rank's
    bytes by category in rank order (every rank gets them; rank 0 reports). Each rank reads its
    data-parallel share of the global batch, so any strategy can race any other.
    """
    import torch

    from .. import comm
    from ..data import BatchSampler, Corpus
    from ..estimate.shapes import preset_shape
    from ..metrics import ActivationMeter
    from ..model import TinyGPT
    from ..parallel import make_strategy
    from ..loop import MemoryPeaks, train_step
    from . import alternate, median

    corpus = Corpus.load()
    cfg = preset_shape(model_name)  # the vocabulary of the shipped corpus, which Corpus.load() reads
    sampler = BatchSampler(corpus.train, cfg.seq_len, global_batch, seed=0)
    runners, memory = {}, {}
    for name, config in configs.items():
        torch.manual_seed(0)
        strategy = make_strategy(rt, config)
        m = config.microbatches or 1
        strategy.set_step(global_batch // config.dp // m, m, 1.0)
        model = strategy.parallelize(TinyGPT(cfg))
        optimizer = strategy.make_optimizer(model, 1e-3, 0.1)
        step = iter(range(10**9))

        def run(strategy=strategy, model=model, optimizer=optimizer, step=step, m=m):
            x, y = sampler.local_batch(next(step), *strategy.data_rank())
            micro_batches = list(zip(x.to(rt.device).chunk(m), y.to(rt.device).chunk(m)))  # a pipeline's m
            train_step(strategy, model, optimizer, micro_batches, 1.0)

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
        rows.append({"name": name, "seconds": median(ts),
                     "memory": [dict(zip(MEMORY, r)) for r in every.view(rt.world_size, len(MEMORY)).tolist()]})
    return rows


def summarize_pairs(rows: list[dict], pairs: dict[str, str]) -> tuple[dict, list[str]]:
    """Each row's `impl` and `ratio` (ours over its reference, the reference 1.0), the ratios by
    pair, and the lines that print memory by category (the largest rank's) and the ratios."""
    by_name = {r["name"]: r for r in rows}
    ratios = {}
    for ours, reference in pairs.items():
        by_name[ours].update(impl="ours", ratio=by_name[ours]["seconds"] / by_name[reference]["seconds"])
        by_name[reference].update(impl="reference", ratio=1.0)
        ratios[f"{ours}/{reference}"] = by_name[ours]["ratio"]
    details = [f"{'bytes/rank':<12}" + "".join(f"{key:>13}" for key in MEMORY) + "   (the largest rank's)"]
    for r in rows:
        top = {key: max(m[key] for m in r["memory"]) for key in MEMORY}
        details.append(f"{r['name']:<12}" + "".join(f"{top[key]:>13,}" for key in MEMORY))
    details += [f"ratio {pair}: {ratio:.3g}x time" for pair, ratio in ratios.items()]
    return ratios, details


def main(configs) -> None:
    """A racing benchmark on the ranks: `configs(world_size, args)` names the configurations;
    rank 0 reports the rows and the flags. Every benchmark takes bench's common flags (the CLI passes them all)."""
    import argparse

    from .. import report
    from ..runtime import init
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="micro")
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--bucket-sweep", default=None)
    p.add_argument("--microbatches", type=int, default=None)
    p.add_argument("--against", default="torch")
    args = p.parse_args()
    with init() as rt:
        rows = race(rt, configs(rt.world_size, args), args.model, args.global_batch, args.repeats)
        if rt.rank == 0:
            report(rows=rows, **vars(args))
