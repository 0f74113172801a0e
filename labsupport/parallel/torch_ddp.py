"""torch's DistributedDataParallel, the reference our `ddp` strategy is measured against.

Its communication happens inside torch (C++ reducer), not through labsupport.comm, so a
torch-ddp run reports no comm counters: compare its losses and step times, not its counts.
"""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from .strategy import Strategy


class TorchDDP(Strategy):
    name = "torch-ddp"

    def data_rank(self):
        return self.rt.rank, self.rt.world_size

    def setup(self, model):
        model = model.to(self.rt.device)
        device_ids = [self.rt.device.index] if self.rt.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters itself; the bucket size matches ours for a fair race.
        self.ddp = DistributedDataParallel(model, device_ids=device_ids,
                                            bucket_cap_mb=getattr(self.args, "bucket_mb", 25.0),
                                            find_unused_parameters=getattr(self.args, "find_unused_parameters", False))
        return self.ddp

    def module(self, model):
        return model.module

    def no_sync(self):
        return self.ddp.no_sync()

    def model_state(self, model):
        return model.module.state_dict()

    def load_model_state(self, model, state):
        model.module.load_state_dict(state)
