"""What the DTensor-based references (`torch-fsdp`, `torch-tp`) share: a checkpoint of this
rank's local shards, as plain tensors any process can load. It resumes on the same layout only,
which train.check_resume enforces."""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .strategy import Strategy


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a plain tensor is already whole)."""
    return t.to_local() if isinstance(t, DTensor) else t


class LocalShardStrategy(Strategy):
    def model_state(self, model) -> dict:
        return {k: local(v).clone() for k, v in model.state_dict().items()}

    @torch.no_grad()
    def load_model_state(self, model, state: dict) -> None:
        for k, v in model.state_dict().items():
            local(v).copy_(state[k])
