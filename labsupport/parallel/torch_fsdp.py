"""FSDP2, torch's ZeRO-3, the reference our `zero3` is measured against.

`fully_shard` on each transformer block, then on the root (embeddings, the tied LM head and the
final LayerNorm), the usual FSDP2 recipe. Every parameter becomes a DTensor sharded on dim 0
(`Shard(0)`: rank r keeps the r-th 1/N of its rows, padded to a multiple of N), so the optimizer,
its moments and the gradients are 1/N per rank. A block's parameters are all-gathered before its
forward and freed after, gathered again for its backward, and its gradients reduce-scattered; the
root stays gathered from the forward to the end of backward (FSDP2 keeps the root unsharded after
forward). Communication happens inside torch, not through labsupport.comm: compare losses,
memory and step times, not comm counts.

The DeviceMesh is made from the rank grid's own DP group (`DeviceMesh.from_group`), not over the
world: a mesh dimension spanning the world *is* the world group, and DTensor's plan caches would
keep it alive past destroy_process_group (runtime.py says why that matters).

Gradient accumulation: FSDP2 reduce-scatters after every micro-batch's backward and adds into
the sharded gradient, as our `zero3` does. (`set_requires_gradient_sync(False)` would keep full
gradients between micro-batches, undoing the sharding.)
"""
from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from .. import comm
from .ddp import first_rank
from .torch_dtensor import LocalShardStrategy, local


class TorchFSDP(LocalShardStrategy):  # a checkpoint holds this rank's rows of each tensor
    name = "torch-fsdp"

    def parallelize(self, model):
        model = model.to(self.rt.device)
        group = self.mesh.dp_group
        for tensor in [*model.parameters(), *model.buffers()]:  # FSDP shards what each rank has: start alike
            comm.broadcast(tensor.data, src=first_rank(group), group=group)
        mesh = DeviceMesh.from_group(group, self.rt.device.type, mesh_dim_names=("dp",))
        for block in model.blocks.values():
            fully_shard(block, mesh=mesh)
        return fully_shard(model, mesh=mesh)

    def clip_grad_norm_(self, model, max_norm):
        """torch's clip on DTensor gradients: the norm is a sum over the shards (all-reduced by DTensor)."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, foreach=False)
        return local(norm.full_tensor()).item()

    @torch.no_grad()
    def evaluate_loss(self, model, x, y):
        loss = self.loss_fn(model(x), y)
        model.reshard()  # without a backward, the root would stay gathered
        return loss

    @torch.no_grad()
    def logits(self, model, idx):
        out = model(idx)
        model.reshard()
        return out

    def optimizer_state(self, optimizer) -> dict:
        """AdamW's state with each moment as this rank's plain shard (a file any process can load)."""
        state = optimizer.state_dict()
        return {**state, "state": {i: {k: local(v) for k, v in s.items()} for i, s in state["state"].items()}}

    def load_optimizer_state(self, optimizer, state: dict) -> None:
        optimizer.load_state_dict(state)
        for p, s in optimizer.state.items():
            for k, v in s.items():
                if v.dim():  # a moment (the step count is a plain scalar): this rank's shard of p's layout
                    s[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())

