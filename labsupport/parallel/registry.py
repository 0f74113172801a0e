"""Strategy names -> what runs them.

Our own strategies are presets of one composition (compose.py): the degrees a name may set above
1 and the ZeRO stages it takes; all of them run as `Parallel`. The references, the
implementations practitioners use, are classes of their own, each imported only when chosen
(torch's parallel modules take seconds to import, and every rank would pay for them).
"""
from __future__ import annotations

from typing import Callable, NamedTuple


class Entry(NamedTuple):
    load: Callable[[], type]  # the strategy's class
    axes: tuple[str, ...]     # the degrees of ParallelConfig it may set above 1 (dp, tp, pp, cp, ep)
    zero: int | None = 0      # the ZeRO stage the name fixes (zeroK: K; ddp: 0); None: --zero chooses
    default_zero: int = 0     # the stage when --zero is not given, where it chooses


def parallel():
    """The composition's strategy, imported when a rank builds it: the launcher and `labsupport train
    --help` read these entries without importing torch."""
    from .compose import Parallel
    return Parallel


def preset(axes: tuple[str, ...], zero: int | None = 0) -> Entry:
    """One of ours: the composition, with these degrees and ZeRO stage."""
    return Entry(parallel, axes, zero)


def torch_ddp():
    from .torch_ddp import TorchDDP
    return TorchDDP


def accelerate_ddp():
    from .accelerate_ddp import AccelerateDDP
    return AccelerateDDP


def torch_zero1():
    from .torch_zero import TorchZeRO1
    return TorchZeRO1


def torch_fsdp():
    from .torch_fsdp import TorchFSDP
    return TorchFSDP


def accelerate_fsdp():
    from .accelerate_fsdp import AccelerateFSDP
    return AccelerateFSDP


def deepspeed_zero():
    from .deepspeed_engine import DeepSpeedZeRO
    return DeepSpeedZeRO


def accelerate_deepspeed():
    from .accelerate_deepspeed import AccelerateDeepSpeed
    return AccelerateDeepSpeed


def torch_tp():
    from .torch_tp import TorchTP
    return TorchTP


def torch_pp():
    from .torch_pp import TorchPP
    return TorchPP


STRATEGIES = {
    "single": preset(()),
    "ddp": preset(("dp", "cp", "ep")),
    "torch-ddp": Entry(torch_ddp, ("dp",)),
    "accelerate-ddp": Entry(accelerate_ddp, ("dp",)),
    "zero1": preset(("dp",), zero=1),
    "zero2": preset(("dp",), zero=2),
    "zero3": preset(("dp",), zero=3),
    "torch-zero1": Entry(torch_zero1, ("dp",), zero=1),
    "torch-fsdp": Entry(torch_fsdp, ("dp",), zero=3),
    "accelerate-fsdp": Entry(accelerate_fsdp, ("dp",), zero=None, default_zero=3),  # it refuses 1
    "deepspeed": Entry(deepspeed_zero, ("dp",), zero=None, default_zero=1),  # ZeRO-1: the workshop's Frontier runs
    "accelerate-deepspeed": Entry(accelerate_deepspeed, ("dp",), zero=None, default_zero=2),  # it refuses 0
    "tp": preset(("tp", "cp")),
    "torch-tp": Entry(torch_tp, ("tp",)),
    "pp": preset(("pp",)),
    "torch-pp": Entry(torch_pp, ("pp",)),
    "3d": preset(("dp", "tp", "pp"), zero=None),
}
