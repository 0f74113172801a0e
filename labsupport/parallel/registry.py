"""Strategy names -> what runs them.

Our own strategies are names for one composition (compose.py), which reads the degrees (dp, tp,
pp, cp, ep) and the ZeRO stage: a name only fills defaults (`zero3`: --zero 3) and says what it
stands for (`ddp` is data parallelism: dp above 1), and any combination every step accepts runs
under it; each step refuses what it cannot do (`Step.problems`). `3d` stands for nothing more than
the degrees given. The references, the implementations practitioners use, are classes of their
own that declare what they can run (the degrees they split, whether they know experts), each
imported only when chosen (torch's parallel modules take seconds to import, and every rank would
pay for them).
"""
from __future__ import annotations

from typing import Callable, NamedTuple


class Entry(NamedTuple):
    load: Callable[[], type]        # the strategy's class
    splits: tuple[str, ...] | None  # the degrees it can set above 1; None: whatever the steps accept (ours)
    zero: int | None = 0            # the ZeRO stage the name fixes (zeroK: K; ddp: 0); None: --zero chooses
    default_zero: int = 0           # the stage when --zero is not given, where it chooses
    names: tuple[str, ...] = ()     # ours: the degrees the name stands for, each above 1 (ddp: dp)
    experts: bool = True            # whether it runs a mixture of experts (a reference declares it)


def parallel():
    """The composition's strategy, imported when a rank builds it: the launcher and `labsupport train
    --help` read these entries without importing torch."""
    from .compose import Parallel
    return Parallel


def ours(names: tuple[str, ...] = (), zero: int | None = None) -> Entry:
    """A name for the composition: the degrees it stands for and the ZeRO stage it fixes (None: --zero)."""
    return Entry(parallel, None, zero, names=names)


def reference(load, splits: tuple[str, ...], zero: int | None = 0, default_zero: int = 0) -> Entry:
    """Another library's implementation: what it splits; it knows no mixture of experts."""
    return Entry(load, splits, zero, default_zero, experts=False)


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
    "single": Entry(parallel, ()),
    "ddp": ours(("dp",), zero=0),
    "torch-ddp": reference(torch_ddp, ("dp",)),
    "accelerate-ddp": reference(accelerate_ddp, ("dp",)),
    "zero1": ours(zero=1),  # (ZeRO's step itself asks for dp above 1)
    "zero2": ours(zero=2),
    "zero3": ours(zero=3),
    "hsdp": ours(("dp_replicate",), zero=3),  # ZeRO-3 in replicas: --dp-replicate R (hsdp.py)
    "torch-zero1": reference(torch_zero1, ("dp",), zero=1),
    "torch-fsdp": reference(torch_fsdp, ("dp",), zero=3),
    "accelerate-fsdp": reference(accelerate_fsdp, ("dp",), zero=None, default_zero=3),  # it refuses 1
    "deepspeed": reference(deepspeed_zero, ("dp",), zero=None, default_zero=1),  # ZeRO-1: the workshop's Frontier runs
    "accelerate-deepspeed": reference(accelerate_deepspeed, ("dp",), zero=None, default_zero=2),  # it refuses 0
    "tp": ours(("tp",)),
    "torch-tp": reference(torch_tp, ("tp",)),
    "pp": ours(("pp",)),
    "torch-pp": reference(torch_pp, ("pp",)),
    "cp": ours(("cp",)),
    "3d": ours(),
}
