"""Hugging Face Accelerate's data parallelism: the same loop, with `prepare` and `backward`.

Accelerate wraps the model in torch's DistributedDataParallel when it finds a multi-process
launch; `accelerator.backward` replaces `loss.backward()` so it can add loss scaling in mixed
precision. We keep our own batch sharding (not Accelerate's DataLoader) so the global batch,
and so the losses, stay comparable with `single` step by step.
"""
from __future__ import annotations

from accelerate import Accelerator
from accelerate.utils import DistributedDataParallelKwargs

from .strategy import Strategy


class AccelerateDDP(Strategy):
    name = "accelerate-ddp"

    def __init__(self, rt, args):
        super().__init__(rt, args)
        kwargs = DistributedDataParallelKwargs(bucket_cap_mb=getattr(args, "bucket_mb", 25.0))
        self.accelerator = Accelerator(cpu=rt.device.type == "cpu", kwargs_handlers=[kwargs])
        self.model = None

    def data_rank(self):
        return self.accelerator.process_index, self.accelerator.num_processes

    def setup(self, model):
        self.model = self.accelerator.prepare_model(model)
        return self.model

    def make_optimizer(self, model, lr, weight_decay):
        return self.accelerator.prepare_optimizer(super().make_optimizer(model, lr, weight_decay))

    def module(self, model):
        return self.accelerator.unwrap_model(model)

    def backward(self, loss):
        self.accelerator.backward(loss)

    def no_sync(self):
        return self.accelerator.no_sync(self.model)

    def model_state(self, model):
        return self.module(model).state_dict()

    def load_model_state(self, model, state):
        self.module(model).load_state_dict(state)
