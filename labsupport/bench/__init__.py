"""`labsupport bench ...`: ours against torch's own implementation, measured in the same run.

Each benchmark is a module here that runs on the ranks (`python -m labsupport.bench.NAME`
under the launcher) and reports raw timings from rank 0; `summarize()` in the same module
turns them into rows and the headline ratio. Those that compare training strategies race
their steps with race.py. Ours and the reference alternate inside one loop, so drift of the machine (other processes, frequency scaling) hits both alike. A benchmark
of starting ranks (`launch`) starts them itself: it has `run_here()`, called in this process.
"""
from __future__ import annotations

import statistics
import time

BENCHMARKS = ("collectives", "ddp", "zero", "tp", "pp", "launch", "cp")


def alternate(candidates: dict, repeats: int, sync) -> dict[str, list[float]]:
    """Time each callable `repeats` times, interleaved (A B A B ...), `sync()` before each start."""
    times = {name: [] for name in candidates}
    for _ in range(repeats):
        for name, fn in candidates.items():
            sync()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def median(xs) -> float:
    return statistics.median(xs)


def check_steps(name: str, nproc: int, model: str, global_batch: int, bucket_mb: float, repeats: int,
                dp: int, microbatches: int | None = None) -> None:
    """What every benchmark that races training steps (race.py) asks of its arguments; `dp` is the
    data-parallel degree its configurations split the global batch over."""
    from ..estimate.shapes import CPU_PRESETS, get_preset
    if nproc < 2:
        raise ValueError(f"bench {name} needs --nproc 2 or more")
    if get_preset(model).vocab is not None:
        raise ValueError(f"--model {model} is an analysis shape; use a CPU preset: {', '.join(CPU_PRESETS)}")
    if global_batch % dp:
        raise ValueError(f"--global-batch {global_batch} must be divisible by the {dp} data-parallel ranks")
    if bucket_mb <= 0 or repeats < 1:
        raise ValueError("--bucket-mb must be > 0 and --repeats >= 1")
    if microbatches is not None and name != "pp":
        raise ValueError("--microbatches is for bench pp")


def run(name: str, nproc: int = 2, timeout: float | None = 600, out=None, **options) -> dict:
    """Launch benchmark `name` on `nproc` ranks; return its summary (rows, ratio, ...)."""
    import importlib

    from ..launch import launch
    from ..train import to_argv
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; available: {', '.join(BENCHMARKS)}")
    module = importlib.import_module(f".{name}", __name__)
    module.check(nproc=nproc, **options)
    if hasattr(module, "run_here"):
        summary = module.run_here(nproc=nproc, timeout=timeout, out=out, **options)
    else:
        res = launch("-m", f"labsupport.bench.{name}", *to_argv(**options), nproc=nproc, timeout=timeout,
                     ranks="0", out=out, name=f"bench-{name}")
        summary = module.summarize(res.report(0), nproc)
        summary["run_dir"] = str(res.run_dir)
    summary.update(benchmark=name, nproc=nproc)
    return summary
