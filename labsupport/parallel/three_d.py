"""3D parallelism: tensor x pipeline x data parallel on one rank grid, composed from the three.

Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", PTD-P) combine the three ways to split training: tensor parallelism inside a
node, where its per-layer all-reduces have the bandwidth; pipeline parallelism across nodes,
where only activations at stage boundaries travel; data parallelism over what is left, its
gradient reduction once per step. `mesh.py` lays the ranks out that way (dp x pp x tp, TP
fastest) and gives each rank its three groups; this strategy is the other strategies applied
one after the other, each on its own group, with nothing of theirs rewritten:

1. the pipeline split (`PipelineParallel`, this class's parent): this stage's model chunks,
   the tied embedding / LM head copied from the first stage to the last over the embedding
   group, and the schedule's executor, which owns the micro-batch loop;
2. tensor parallelism on each chunk (`apply_tensor_parallel` over the TP group), after the
   split as in torchtitan (`pipeline_llama` cuts the stages, then parallelizes each part; the
   split deep-copies the model, and a process group cannot be copied): a
   chunk's embedding and head become vocabulary-parallel where the chunk has them, and TP
   rank t of the first stage holds the same vocabulary rows as TP rank t of the last, which
   form one embedding group (one per pipeline, i.e. per (d, t)); the loss is the
   vocab-parallel cross-entropy;
3. data parallelism over the DP group: our `DataParallel` (--zero 0), or ZeRO-1's
   reduce-scattering buckets and `ShardedOptimizer` (--zero 1), put on the stage's chunks.

When DP communicates: the executor runs every backward but each chunk's last (micro-batch
m - 1) under `no_sync`, so gradients accumulate locally and DP's buckets go out during that
last backward, overlapping the pipeline's cool-down (Megatron-LM enables grad sync for the
last micro-batch of each model chunk). The alternative, reducing everything in
`finish_backward`, is no simpler: it loses the overlap and needs the buckets launched by hand.
The tied matrix's two copies are summed over the embedding group after DP has averaged them:
both are sums, so the order does not change the result, as long as under ZeRO-1 the two stages
own the same elements of it. The tied matrix therefore travels in a bucket of its own on both
stages (`own_bucket`): rank d's shard of it is the same rows there and here.

The gradient norm counts each gradient once: a TP-replicated parameter on TP rank 0 only, the
tied matrix on the first stage only, and over DP once (after the average every DP rank holds
the same gradients), except under ZeRO-1, where each DP rank holds the shard it updates and
the shards' squares are summed over the DP group too.
"""
from __future__ import annotations

import math

import torch

from .ddp import DataParallel
from .pipeline import PipelineParallel
from .strategy import clip_grad_norm_
from .tensor import apply_tensor_parallel, gather_vocabulary, grad_norm_parameters, vocab_parallel_cross_entropy
from .zero import ShardedGradientDataParallel, sharded_adamw


class ThreeD(PipelineParallel):
    """`--strategy 3d --dp D --tp T --pp P [--zero 0|1] [--schedule ... --microbatches M]`.

    The model it returns is the stage's chunks (an `nn.ModuleList`), as for `pp`; the data-parallel
    wrapper is `self.data_parallel` (None when dp is 1): it only needs its gradient hooks, the
    executor calls the chunks themselves. A degree of 1 skips its piece altogether, so its group
    carries no traffic.
    """

    name = "3d"

    def parallelize(self, model):
        c, mesh = self.config, self.mesh
        chunks = super().parallelize(model)  # the pipeline split; the tied matrix broadcast to the last stage
        if c.tp > 1:
            for part in chunks:
                apply_tensor_parallel(part, mesh.tp_group)
        self.data_parallel = None
        if c.dp > 1:
            tied = self._tied_weight(chunks)
            options = dict(bucket_mb=c.bucket_mb, find_unused_parameters=c.find_unused_parameters,
                           own_bucket=[tied] if tied is not None else [])
            if c.zero:
                self.data_parallel = ShardedGradientDataParallel(chunks, mesh.dp_group, keep_gradients=True, **options)
            else:
                self.data_parallel = DataParallel(chunks, mesh.dp_group, mode=c.ddp_mode, **options)
        return chunks

    def make_optimizer(self, model, lr, weight_decay):
        self.optimizer = (sharded_adamw(self.data_parallel, lr, weight_decay) if self.config.zero
                          else super().make_optimizer(model, lr, weight_decay))
        return self.optimizer

    def loss_fn(self, logits, targets):
        if self.config.tp == 1:
            return super().loss_fn(logits, targets)
        return vocab_parallel_cross_entropy(logits, targets, self.mesh.tp_group).mean()

    def no_sync(self, model):
        """What the executor wraps every backward but each chunk's last in: DP's no_sync."""
        return self.data_parallel.no_sync() if self.data_parallel is not None else super().no_sync(model)

    def finish_backward(self, model):
        """Wait for DP's buckets (sent in the last backward), sum the tied matrix's copies over the
        embedding group, then, under ZeRO-1, hand each rank's shard to the optimizer."""
        if self.data_parallel is not None:
            self.data_parallel.finish_gradient_synchronization()
        super().finish_backward(model)
        if self.config.zero:
            self.optimizer.shard_gradients()

    def clip_grad_norm_(self, model, max_norm):
        """Squares summed over the TP and PP groups (and DP under ZeRO-1) of the gradients this rank
        counts; then every gradient (or, under ZeRO-1, every piece this rank updates) scaled alike."""
        c, mesh = self.config, self.mesh
        tied = self._tied_weight(model) if mesh.is_last_stage else None
        counted = [p for part in model for p in grad_norm_parameters(part, mesh.tp_group) if p is not tied]
        scaled = list(model.parameters())
        if c.zero:
            counted, scaled = self.optimizer.pieces(of=counted), self.optimizer.pieces()
        degrees = ((c.tp, mesh.tp_group), (c.pp, mesh.pp_group), (c.dp if c.zero else 1, mesh.dp_group))
        groups = [group for degree, group in degrees if degree > 1]
        norm = clip_grad_norm_(counted, math.inf, groups=groups, device=self.rt.device)
        torch.nn.utils.clip_grads_with_norm_(scaled, max_norm, torch.tensor(norm), foreach=False)
        return norm

    def _last_stage_logits(self, model, idx):
        """The last stage's vocabulary shards, gathered over its TP group."""
        out = self._forward_only(model, idx)
        return gather_vocabulary(out, self.mesh.tp_group) if out is not None and self.config.tp > 1 else out

    def close(self, model):
        if self.data_parallel is not None:
            self.data_parallel.close()
