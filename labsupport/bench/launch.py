"""Benchmark: a trivial collective cell through a fresh torchrun launch and through the pool.

What is measured is starting ranks itself, so unlike the other benchmarks this one runs in the
calling process (`run_here`), as a notebook would: each round times one fresh launch (what a
`%%torchrun` cell costs) and CELLS_PER_ROUND cells on an interactive pool (what a `%%ranks`
cell costs), both doing one all-reduce. Rows: `pool start` (once), `pool cell` and `fresh
launch`; the ratio is the median pool cell over the median fresh launch.
"""
from __future__ import annotations

import io
import time

CELLS_PER_ROUND = 7
POOL_CELL = "t = torch.ones(1)\ncomm.all_reduce(t)\nt.item()"
LAUNCH_SCRIPT = """\
import torch
from labsupport import comm, init
with init() as rt:
    t = torch.ones(1)
    comm.all_reduce(t)
"""


def check(nproc: int, repeats: int = 3) -> None:
    """Bad options fail here, before any rank starts."""
    if nproc < 2:
        raise ValueError("bench launch needs --nproc 2 or more: one rank has nobody to talk to")
    if repeats < 1:
        raise ValueError("--repeats must be >= 1")


def run_here(nproc: int, repeats: int = 3, timeout: float | None = 600, out=None) -> dict:
    """Start a pool, then alternate fresh launches and pool cells `repeats` rounds; the summary."""
    from ..launch import DEFAULT_NOTEBOOK_TIMEOUT, launch
    from ..pool import RankPool
    out = out or io.StringIO()
    pool = RankPool()
    t0 = time.perf_counter()
    pool.start(nproc, timeout=timeout or DEFAULT_NOTEBOOK_TIMEOUT)
    times = {"pool start": [time.perf_counter() - t0], "pool cell": [], "fresh launch": []}
    try:
        script = pool.run_dir / "fresh_launch.py"
        script.write_text(LAUNCH_SCRIPT)
        pool.run("import torch\nfrom labsupport import comm\n" + POOL_CELL)  # untimed: the imports
        for _ in range(repeats):
            t0 = time.perf_counter()
            launch(str(script), nproc=nproc, timeout=timeout, out=out, name="bench-launch")
            times["fresh launch"].append(time.perf_counter() - t0)
            for _ in range(CELLS_PER_ROUND):
                t0 = time.perf_counter()
                pool.run(POOL_CELL)
                times["pool cell"].append(time.perf_counter() - t0)
    finally:
        pool.stop()
    summary = summarize(times)
    summary["run_dir"] = str(pool.run_dir)
    return summary


def summarize(times: dict[str, list[float]]) -> dict:
    """Rows (median seconds of each) and the headline ratio: pool cell / fresh launch."""
    from . import median
    impl = {"pool start": "ours", "pool cell": "ours", "fresh launch": "reference"}
    rows = [{"name": name, "impl": impl[name], "seconds": median(ts), "samples": len(ts)} for name, ts in times.items()]
    seconds = {r["name"]: r["seconds"] for r in rows}
    return {"rows": rows, "headline": "pool cell vs fresh launch",
            "ratio": seconds["pool cell"] / seconds["fresh launch"]}
