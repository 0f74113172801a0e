"""torch's DistributedDataParallel, the reference our `ddp` strategy is measured against.

Its communication happens inside torch (C++ reducer), not through labsupport.comm, so a
torch-ddp run reports no comm counters: compare its losses and step times, not its counts.
"""
from __future__ import annotations

from torch.nn.parallel import DistributedDataParallel

from .strategy import Strategy


class TorchDDP(Strategy):
    name = "torch-ddp"

    def parallelize(self, model):
        model = model.to(self.rt.device)
        device_ids = [self.rt.device.index] if self.rt.device.type == "cuda" else None
        # DDP broadcasts its group's first rank's parameters itself; the bucket size matches
        # ours for a fair race.
        return DistributedDataParallel(model, device_ids=device_ids, process_group=self.mesh.dp_group,
                                       bucket_cap_mb=self.config.bucket_mb,
                                       find_unused_parameters=self.config.find_unused_parameters)

    def no_sync(self, model):
        return model.no_sync()
