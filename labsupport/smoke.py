"""`python -m labsupport.smoke`: the 2-rank smoke test that `labsupport doctor` launches: each rank
all-reduces its rank + 1 and reports the sum.

A module of its own, not `python -m labsupport.runtime`: `labsupport/__init__` imports the runtime,
and running an already imported module with `-m` makes runpy warn on every rank.
"""
import torch

from . import comm
from .runtime import init, report

if __name__ == "__main__":
    with init() as rt:
        t = torch.tensor([float(rt.rank + 1)], device=rt.device)
        if rt.distributed:
            comm.all_reduce(t)
        rt.print(rt.describe(), ranks="all")
        report(all_reduce_sum=t.item())
