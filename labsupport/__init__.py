"""labsupport: the package behind the distributed-training workbook.

In a notebook: `%load_ext labsupport` enables the `%%torchrun` cell magic (`launch()` is the
same thing as a function) and `%ranks` / `%%ranks`, a pool of ranks that live between cells
(`labsupport.pool`). Inside a rank: `runtime.init()` and `report()`.

`init` and `report` are imported on first use, so `labsupport.estimate` (pure math) and the
widgets load without torch; the launcher needs no torch in this process either.
"""
import importlib

from .launch import LaunchError, RunResult, launch

__all__ = ["launch", "LaunchError", "RunResult", "init", "report", "load_ipython_extension"]
__version__ = "0.1.0"

_LAZY = {"init": "runtime", "report": "runtime"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'labsupport' has no attribute {name!r}")


def load_ipython_extension(ipython):
    """Register `%%torchrun`, `%ranks`/`%%ranks` and `%%exercise` (IPython calls this on `%load_ext labsupport`)."""
    from .launch import torchrun_magic

    def torchrun(line, cell):
        return torchrun_magic(line, cell, ipython.user_ns)

    def ranks(line, cell=None):
        from .pool import ranks_magic  # imported on first use: ipyparallel loads only for the pool
        return ranks_magic(line, cell, ipython.user_ns)

    def exercise(line, cell):
        from .lab.exercise import run_cell
        run_cell(line.strip(), cell, ipython.user_ns)

    ipython.register_magic_function(torchrun, magic_kind="cell", magic_name="torchrun")
    ipython.register_magic_function(ranks, magic_kind="line_cell", magic_name="ranks")
    ipython.register_magic_function(exercise, magic_kind="cell", magic_name="exercise")
