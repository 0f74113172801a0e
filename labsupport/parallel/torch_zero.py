"""torch's ZeRO-1, the reference our `zero1` is measured against: DistributedDataParallel
for the gradients, and `ZeroRedundancyOptimizer` for the optimizer states.

ZeroRedundancyOptimizer gives each rank of the group whole parameters (largest first, each to
the rank holding the fewest elements so far) and runs AdamW on those only, so each rank keeps
about 1/N of the Adam moments (to a parameter's granularity: ours cuts parameters, so it is
exact to the padding). After its step, every rank broadcasts the parameters it updated.
DDP still all-reduces every gradient, so the traffic is DDP's plus those broadcasts, 1.5x
(our `zero1` reduce-scatters instead: 1x, as the ZeRO paper derives). Its communication
happens inside torch, not through labsupport.comm, so a torch-zero1 run reports no comm counters.

A checkpoint holds this rank's shard of the optimizer state (its local AdamW's state dict): the
partition depends only on the parameters and the group size, which a resume must match anyway.
torch's own `state_dict()` would first gather every shard on one rank (`consolidate_state_dict`).
"""
from __future__ import annotations

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer

from .optim import BETAS, decay_groups
from .torch_ddp import TorchDDP


class TorchZeRO1(TorchDDP):
    name = "torch-zero1"

    def make_optimizer(self, model, lr, weight_decay):
        groups = decay_groups(model.module.parameters(), weight_decay)
        optimizer = ZeroRedundancyOptimizer(groups, optimizer_class=torch.optim.AdamW, process_group=self.mesh.dp_group,
                                            lr=lr, betas=BETAS, foreach=False)
        optimizer.state = optimizer.optim.state  # the moments this rank holds (what memory counts)
        return optimizer

    def optimizer_state(self, optimizer) -> dict:
        return optimizer.optim.state_dict()

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        optimizer.optim.load_state_dict(state)
        optimizer.state = optimizer.optim.state
