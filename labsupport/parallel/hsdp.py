"""Hybrid sharding (HSDP, FSDP's HYBRID_SHARD): ZeRO-3 inside groups of data-parallel ranks, the
groups replicas of each other.

ZeRO-3 over all dp ranks all-gathers every unit's parameters over all of them, twice a step, and
those messages cross the slowest links once dp outgrows a node. HSDP cuts the dp ranks into
`--dp-replicate R` replicas of dp / R consecutive ranks (with consecutive ranks on a node, a replica
is a node or a few): inside a replica the parameters, gradients and optimizer state are sharded as
by ZeRO-3, so the all-gathers and reduce-scatters stay inside it; across replicas each shard's
gradient is averaged by one all-reduce over the R ranks holding the same shard, as DDP would do
for a whole model. Memory per rank is ZeRO-3's over dp / R ranks instead of dp (Zhao et al. 2023,
"PyTorch FSDP", Sec. 3.2.2; torchtitan's `dp_replicate` x `dp_shard`).

The step is ZeRO-3's (`FullyShardStep`, fsdp.py) on the shard group, plus the replicas' average:
the gradient norm sums the shards' squares over the shard group only (a replica holds the same
shards, counted once), and the loss is averaged over all dp ranks as before. The average across
replicas is one message after backward; FSDP and FSDP2 all-reduce each unit's shard across the
replicas right after its reduce-scatter, so that traffic hides behind the rest of backward.
"""
from __future__ import annotations

import torch

from .. import comm
from .fsdp import FullyShardStep


class HybridShardStep(FullyShardStep):
    """`--zero 3 --dp-replicate R`: ZeRO-3 within each of R replicas, gradients averaged across them."""

    title = "hybrid sharding"

    @classmethod
    def applies(cls, config):
        return config.zero == 3 and config.dp_replicate > 1

    @classmethod
    def problems(cls, config, model=None, microbatches=None):
        r, dp = config.dp_replicate, config.dp
        if r < 1:
            return [f"--dp-replicate must be >= 1, got {r}"]
        if r == 1:
            return []
        if config.zero != 3:
            return [f"--dp-replicate {r} replicates ZeRO-3's shard groups: give --zero 3 (or --strategy hsdp)"]
        if dp % r:
            return [f"--dp-replicate {r} must divide --dp {dp}: each replica is dp / R ranks"]
        if dp == r:
            return [f"--dp-replicate {r} on --dp {dp} leaves one rank per replica, which shards nothing (that is DDP, "
                    "--zero 0): give each replica 2 ranks or more"]
        return []

    def __init__(self, mesh, config):
        super().__init__(mesh, config)
        self.shard_group, self.replicas = mesh.split_dp(config.dp // config.dp_replicate, ("dp_shard", "dp_replicate"))

    def apply(self, parts, shared, owned):
        """ZeRO-3 on the shard group; then every replica takes the first replica's shards (as FSDP's
        `sync_module_states` does across the replicate group), so replicas start equal whatever the seed."""
        parts = super().apply(parts, shared, owned)
        shards = list(self.handle.module.parameters())
        with torch.no_grad():
            flat = torch.cat([p.reshape(-1) for p in shards])
            comm.broadcast(flat, comm.global_rank(self.replicas, 0), group=self.replicas)
            for p, piece in zip(shards, flat.split([p.numel() for p in shards])):
                p.copy_(piece.view_as(p))
        return parts

    def finish_backward(self):
        """The shard group's reduce-scatter is done; average each shard over the replicas in one message."""
        super().finish_backward()
        grads = [p.grad for p in self.handle.module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, "avg", group=self.replicas)
        for g, piece in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(piece.view_as(g))
