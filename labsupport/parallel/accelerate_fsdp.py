"""Hugging Face Accelerate's FSDP: the same loop, with the FSDP plugin's `prepare` and `backward`.

The ZeRO stage chooses FSDP's sharding strategy, the mapping the notebook teaches:

    --zero 3  FULL_SHARD     parameters, gradients and optimizer states sharded (the default)
    --zero 2  SHARD_GRAD_OP  gradients and optimizer states; parameters stay gathered from
                             forward to the end of backward
    --zero 0  NO_SHARD       nothing sharded: DDP

FSDP has no stage 1 (sharding the optimizer states shards the gradients too), so --zero 1 is
refused before any process starts. This is FSDP1 (`FullyShardedDataParallel`), the version
whose plugin takes those three names; `torch-fsdp` is FSDP2. Each block is a unit of its own
(`ModuleWrapPolicy`), the root one more, as in `zero3`. `use_orig_params` keeps the model's own
Parameter objects (as views into FSDP's flat shards), so the weight-decay groups, chosen by each
parameter's dimension before wrapping, stay the loop's recipe. FSDP's communication happens
inside torch, not through labsupport.comm.

Accelerate turns its FSDP plugin on for accelerators only: on CPU it silently falls back to
DDP. FSDP1 itself runs on CPU with gloo, so there we set Accelerate's distributed type to FSDP
and its device to the CPU ourselves; from `prepare_model` on, the path is Accelerate's own.
Its `sync_module_states` asks for a GPU, so the ranks' initial weights are broadcast here.
A checkpoint holds the whole model (FSDP gathers it, FULL_STATE_DICT) and this rank's shard of
the optimizer state (a resume needs the same layout, which train.check_resume enforces).
"""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import FullyShardedDataParallel, StateDictType
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from .. import comm
from ..model import Block
from .ddp import first_rank
from .strategy import Strategy
from .optim import adamw

SHARDING = {3: "FULL_SHARD", 2: "SHARD_GRAD_OP", 0: "NO_SHARD"}  # --zero -> FSDP's sharding strategy


@contextmanager
def deprecations_expected():
    """Accelerate calls `sharding_strategy` deprecated (its successor cannot say SHARD_GRAD_OP or
    NO_SHARD: it forces FULL_SHARD) and torch calls NO_SHARD deprecated (use DDP); we use both on
    purpose, to show the mapping, so each rank need not say so."""
    plugin_log = logging.getLogger("accelerate.utils.dataclasses")  # Accelerate logs its own
    level = plugin_log.level
    plugin_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*`NO_SHARD` sharding strategy is deprecated")
            yield
    finally:
        plugin_log.setLevel(level)


class AccelerateFSDP(Strategy):
    name = "accelerate-fsdp"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        if config.zero == 1:
            return ["strategy 'accelerate-fsdp' has no ZeRO-1 (FSDP shards the gradients with the optimizer "
                    "states): use --zero 3 (FULL_SHARD, the default), 2 (SHARD_GRAD_OP) or 0 (NO_SHARD), "
                    "or --strategy torch-zero1"]
        return []

    def __init__(self, rt, config):
        super().__init__(rt, config)
        with deprecations_expected():
            plugin = FullyShardedDataParallelPlugin(
                fsdp_version=1, sharding_strategy=SHARDING[config.zero], auto_wrap_policy=ModuleWrapPolicy({Block}),
                use_orig_params=True, sync_module_states=False)
        self.accelerator = Accelerator(cpu=rt.device.type == "cpu", fsdp_plugin=plugin)
        state = self.accelerator.state  # one per process: it may hold an earlier strategy's plugin
        if state.distributed_type != DistributedType.FSDP:  # on CPU (see the module's docstring)
            state.distributed_type, state.device = DistributedType.FSDP, rt.device
        state.fsdp_plugin = plugin

    def parallelize(self, model):
        model = model.to(self.rt.device)
        group = self.mesh.dp_group
        for tensor in [*model.parameters(), *model.buffers()]:  # FSDP shards what each rank has: start alike
            comm.broadcast(tensor.data, src=first_rank(group), group=group)
        self.dims = {id(p): p.dim() for p in model.parameters()}  # FSDP's views are flat
        with deprecations_expected():
            return self.accelerator.prepare_model(model)

    def make_optimizer(self, model, lr, weight_decay):
        return self.accelerator.prepare_optimizer(adamw(model.parameters(), lr, weight_decay, self.dims))

    def no_sync(self, model):
        return self.accelerator.no_sync(model)

    def backward(self, loss):
        self.accelerator.backward(loss)

    def clip_grad_norm_(self, model, max_norm):
        """FSDP's own clip: squares summed over the shards and all-reduced, each gradient counted once."""
        return model.clip_grad_norm_(max_norm).item()

    def model_state(self, model) -> dict:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            return model.state_dict()

    def load_model_state(self, model, state: dict) -> None:
        with FullyShardedDataParallel.state_dict_type(model, StateDictType.FULL_STATE_DICT):
            model.load_state_dict(state)
