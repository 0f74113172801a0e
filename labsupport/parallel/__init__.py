"""Parallel strategies, chosen by name (registry.py); each is a `Strategy` (strategy.py) the one
training loop calls. Ours are presets of one composition (compose.py); the references are torch's
and Accelerate's implementations, beside them."""
from __future__ import annotations

from .config import DDP_MODES, ConfigError, ParallelConfig
from .registry import STRATEGIES, Entry

__all__ = ["DDP_MODES", "STRATEGIES", "ConfigError", "Entry", "ParallelConfig", "make_strategy", "strategy_names"]


def strategy_names() -> list[str]:
    return list(STRATEGIES)


def make_strategy(rt, config: ParallelConfig):
    """The strategy `config.strategy` for this rank, its mesh built (a collective: every rank calls it)."""
    config.check(rt.world_size)
    return STRATEGIES[config.strategy].load()(rt, config)
