"""Parallel strategies, chosen by name. Each one is a `Strategy` (strategy.py) the one training loop calls.

The registry maps a name to 'module:Class' and to the axes of the rank grid the strategy
splits over (mesh.py), so a configuration can be checked, and importing labsupport does not
import every strategy's dependencies. Strategies arrive with their notebooks.
"""
from __future__ import annotations

import importlib
from typing import NamedTuple

from .config import ConfigError, ParallelConfig


class Entry(NamedTuple):
    target: str             # "module:Class"
    axes: tuple[str, ...]   # the degrees of ParallelConfig it may set above 1
    zero: int | None = None  # the ZeRO stage the strategy is (zeroK: K); None: --zero is free (3d reads it)
    default_zero: int = 0    # the stage when --zero is not given, for a strategy where it is free


STRATEGIES = {
    "single": Entry("labsupport.parallel.strategy:Strategy", ()),
    "ddp": Entry("labsupport.parallel.ddp:DDPStrategy", ("dp",)),
    "torch-ddp": Entry("labsupport.parallel.torch_ddp:TorchDDP", ("dp",)),
    "accelerate-ddp": Entry("labsupport.parallel.accelerate_ddp:AccelerateDDP", ("dp",)),
    "zero1": Entry("labsupport.parallel.zero:ZeRO1", ("dp",), zero=1),
    "zero2": Entry("labsupport.parallel.zero:ZeRO2", ("dp",), zero=2),
    "zero3": Entry("labsupport.parallel.zero:ZeRO3", ("dp",), zero=3),
    "torch-zero1": Entry("labsupport.parallel.torch_zero:TorchZeRO1", ("dp",), zero=1),
    "torch-fsdp": Entry("labsupport.parallel.torch_fsdp:TorchFSDP", ("dp",), zero=3),
    "accelerate-fsdp": Entry("labsupport.parallel.accelerate_fsdp:AccelerateFSDP", ("dp",), default_zero=3),
    "tp": Entry("labsupport.parallel.tensor:TensorParallel", ("tp",)),
    "torch-tp": Entry("labsupport.parallel.torch_tp:TorchTP", ("tp",)),
    "pp": Entry("labsupport.parallel.pipeline:PipelineParallel", ("pp",)),
    "torch-pp": Entry("labsupport.parallel.torch_pp:TorchPP", ("pp",)),
    "3d": Entry("labsupport.parallel.three_d:ThreeD", ("dp", "tp", "pp")),
}

__all__ = ["STRATEGIES", "ConfigError", "ParallelConfig", "make_strategy", "strategy_names"]


def strategy_names() -> list[str]:
    return list(STRATEGIES)


def make_strategy(rt, config: ParallelConfig):
    """The strategy `config.strategy` for this rank, its mesh built (a collective: every rank calls it)."""
    config.check(rt.world_size)
    module, cls = STRATEGIES[config.strategy].target.split(":")
    return getattr(importlib.import_module(module), cls)(rt, config)
