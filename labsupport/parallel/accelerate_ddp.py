"""Hugging Face Accelerate's data parallelism: the same loop, with `prepare` and `backward`.

Accelerate wraps the model in torch's DistributedDataParallel when it finds a multi-process
launch; `accelerator.backward` replaces `loss.backward()` so it can add loss scaling in mixed
precision. We keep our own batch sharding (not Accelerate's DataLoader) so the global batch,
and so the losses, stay comparable with `single` step by step. Accelerate works on the whole
world, so this strategy does too (its config has dp = world size).
"""
from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from .strategy import Strategy


class AccelerateDDP(Strategy):
    name = "accelerate-ddp"

    def __init__(self, rt, config):
        super().__init__(rt, config)
        kwargs = DistributedDataParallelKwargs(bucket_cap_mb=config.bucket_mb,
                                               find_unused_parameters=config.find_unused_parameters)
        self.accelerator = Accelerator(cpu=rt.device.type == "cpu", kwargs_handlers=[kwargs])

    def parallelize(self, model):
        return self.accelerator.prepare_model(model)

    def make_optimizer(self, model, lr, weight_decay):
        return self.accelerator.prepare_optimizer(super().make_optimizer(model, lr, weight_decay))

    def no_sync(self, model):
        return self.accelerator.no_sync(model)

    def backward(self, loss):
        self.accelerator.backward(loss)
