"""labsupport: the package behind the distributed-training workbook.

In a notebook: `%load_ext labsupport` enables the `%%torchrun` cell magic; `launch()` is the
same thing as a function. Inside a rank: `runtime.init()` and `report()`.
"""
from .launch import LaunchError, RunResult, launch
from .runtime import init, report

__all__ = ["launch", "LaunchError", "RunResult", "init", "report", "load_ipython_extension"]
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """Register `%%torchrun` (IPython calls this on `%load_ext labsupport`)."""
    from .launch import torchrun_magic

    def torchrun(line, cell):
        return torchrun_magic(line, cell, ipython.user_ns)

    ipython.register_magic_function(torchrun, magic_kind="cell", magic_name="torchrun")
