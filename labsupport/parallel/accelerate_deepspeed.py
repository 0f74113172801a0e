"""Hugging Face Accelerate's DeepSpeed: the same loop, with the DeepSpeed plugin's `prepare` and `backward`.

`--zero` is DeepSpeed's ZeRO stage, 1, 2 (Accelerate's default, and ours) or 3: the optimizer
states, then the gradients too, then the parameters too, divided over the data-parallel ranks.
Stage 0 (nothing divided) is `accelerate-ddp`. The plugin is made from the fields an Accelerate
YAML's `deepspeed_config` holds (zero_stage, gradient_accumulation_steps, gradient_clipping,
offload devices; configs/accelerate/deepspeed.yaml), which need the step's shape and the loop's
clipping norm: `set_step` is where the loop says them. Under `accelerate launch` those YAML keys
reach the ranks as environment variables, which these fields override; the launcher checked
before starting that the two agree (accelerate_config.py).

DeepSpeed runs the step itself. `accelerator.backward` calls the engine's `backward` and, on the
step's last micro-batch (where Accelerate's `sync_gradients` is true), its `step`: the
reduction, the clipping to `gradient_clipping` and the optimizer's update happen there, and the
prepared optimizer's own `step` and `zero_grad` do nothing. So `clip_grad_norm_` only reads the
norm DeepSpeed computed before clipping. The optimizer is the loop's AdamW (optim.py, its two
weight-decay groups), which DeepSpeed wraps as ZeRO's optimizer over the shards. Each
micro-batch's loss is already divided by their number, so the engine's own division is turned off.

Accelerate turns its DeepSpeed plugin on for accelerators only: on CPU it silently falls back to
DDP. DeepSpeed itself runs on CPU (its CPU accelerator talks gloo through torch.distributed), so,
as accelerate_fsdp.py does for FSDP, we set Accelerate's distributed type to DEEPSPEED and hand it
the plugin ourselves; from `prepare` on, the path is Accelerate's own. (Accelerate's own way of
making a plugin active, `select()`, also registers it with transformers for its ZeRO-3 loading and
fails where transformers is not installed, as here; we load no transformers model.) The loop keeps the bare
model (ZeRO-3 gathers each module's parameters in hooks on the module itself); the engine DeepSpeed
returns runs backward and the step. A checkpoint is the engine's own, as the deepspeed strategy's
(`EngineCheckpoint`: each rank's partition, loaded on resume), beside the loop's file with the whole
model (ZeRO-3 gathers it).
"""
from __future__ import annotations

from contextlib import contextmanager

from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin, DistributedType

# DeepSpeed set up as our deepspeed strategy sets it up (importing that module does it): no C++ op probed or
# built (on CPU its torch backend would compile a shared-memory all-reduce at every start, ~45 s of CPU),
# torch's deprecation of the collectives DeepSpeed's ZeRO calls silenced; and its checkpoint
from .deepspeed_engine import EngineCheckpoint
from .optim import adamw
from .strategy import Strategy


class AccelerateDeepSpeed(EngineCheckpoint, Strategy):
    name = "accelerate-deepspeed"

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        if config.zero == 0:
            return ["strategy 'accelerate-deepspeed' needs ZeRO stage 1, 2 (the default) or 3; "
                    "for no sharding use --strategy accelerate-ddp"]
        return []

    def set_step(self, micro_batch: int, accumulation: int, grad_clip: float) -> None:
        """DeepSpeed's configuration holds the step's shape and the clipping norm: the Accelerator is made here."""
        plugin = DeepSpeedPlugin(zero_stage=self.config.zero, gradient_accumulation_steps=accumulation,
                                 gradient_clipping=grad_clip, offload_optimizer_device="none",
                                 offload_param_device="none", zero3_init_flag=False)
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = micro_batch  # Accelerate reads it off a DataLoader
        # ZeRO-3 keeps a parameter under 1e5 elements whole on every rank by default: all of the CPU presets' are
        plugin.deepspeed_config["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        self.accelerator = Accelerator(cpu=self.rt.device.type == "cpu", deepspeed_plugin=plugin)
        state = self.accelerator.state  # one per process: it may hold an earlier strategy's plugin
        if state.distributed_type != DistributedType.DEEPSPEED:  # on CPU (see the module's docstring)
            state.distributed_type, state.device = DistributedType.DEEPSPEED, self.rt.device
            # and in the process-wide state, which every later `AcceleratorState()` copies (as Accelerate does)
            PartialState().distributed_type = DistributedType.DEEPSPEED
        state.deepspeed_plugins = plugin  # the active plugin; not `plugin.select()`, which needs transformers

    def make_optimizer(self, model, lr, weight_decay):
        self.engine, optimizer = self.accelerator.prepare(model, adamw(model.parameters(), lr, weight_decay))
        return optimizer

    def backward(self, loss):
        self.accelerator.backward(loss, scale_wrt_gas=False)

    @contextmanager
    def no_sync(self, model):
        """Not the step's last micro-batch: DeepSpeed accumulates, reduces nothing and does not step."""
        self.accelerator.gradient_state._set_sync_gradients(False)
        try:
            yield
        finally:
            self.accelerator.gradient_state._set_sync_gradients(True)

    def clip_grad_norm_(self, model, max_norm):
        """DeepSpeed clipped in its step already: the global norm it measured before clipping."""
        return float(self.engine.get_global_grad_norm())
