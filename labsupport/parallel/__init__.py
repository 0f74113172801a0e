"""Parallel strategies, chosen by name. Each one is a `Strategy` (strategy.py) the one training loop calls.

Strategies arrive with their notebooks; the registry maps a name to 'module:Class' so that
importing labsupport never imports every strategy's dependencies.
"""
from __future__ import annotations

import importlib

STRATEGIES = {
    "single": "labsupport.parallel.strategy:Strategy",
    "ddp": "labsupport.parallel.ddp:DataParallel",
    "torch-ddp": "labsupport.parallel.torch_ddp:TorchDDP",
    "accelerate-ddp": "labsupport.parallel.accelerate_ddp:AccelerateDDP",
}
DATA_PARALLEL = ("ddp", "torch-ddp", "accelerate-ddp")


def strategy_names() -> list[str]:
    return list(STRATEGIES)


def make_strategy(name: str, rt, args):
    try:
        module, cls = STRATEGIES[name].split(":")
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(STRATEGIES)}") from None
    return getattr(importlib.import_module(module), cls)(rt, args)
