"""torch's tensor parallelism (DTensor), the reference our `tp` is measured against.

`parallelize_module` with a plan per module, as torchtitan's `apply_tp` writes it, on a
DeviceMesh made from the rank grid's TP group:

* attention's qkv and the MLP's fc `ColwiseParallel`, their output projections `RowwiseParallel`
  (TinyGPT's head-by-head qkv layout makes a block of rows whole heads);
* the Llama family: SwiGLU's gate and up `ColwiseParallel`, down `RowwiseParallel`, behind one
  `PrepareModuleInput` that makes their common input a replicated DTensor once (so its gradient is
  summed over the group once, not once per matrix; under sequence parallelism it is the one
  all-gather), as torchtitan's plan for w1, w3, w2. Grouped-query attention needs no other style:
  the plan is GQA-aware through the layout. `Shard(0)` of qkv's weight gives rank i its contiguous
  1/T of the rows, and TinyGPT lays the rows out by query group (model.py), so that block is
  kv_heads/T whole key/value heads with their query heads, and proj's `Shard(1)` the matching
  query heads' columns; the attention reads its local head counts off the shapes. T must divide
  kv_heads (the step refuses it: DTensor would cut a head apart without a word). torchtitan kept
  wq, wk, wv as three matrices, `ColwiseParallel` each, until mid-2026; its FusedQKVLinear (PR #2878,
  April 2026; its Llama 3 default since PR #3714, June 2026) is one wqkv laid out
  (n_kv_heads, heads/kv_heads + 2, head_dim) by key/value group, as here, `ColwiseParallel`,
  read with a `-1` view: the same heads on the same rank either way. RoPE rotates the local q and k (plain
  tensors, qkv's local output) by the global positions the blocks get by keyword; RMSNorm is
  `SequenceParallel` as LayerNorm;
* the token embedding `RowwiseParallel` (vocabulary rows, the partial rows summed), the LM
  head `ColwiseParallel` on the same rows, its output kept as a DTensor sharded on the
  vocabulary, and the loss computed under `loss_parallel()`, which never gathers the logits;
  an untied head stays a matrix of its own;
* with `--sequence-parallel`, the LayerNorms `SequenceParallel`, the row-parallel outputs
  reduce-scattered to `Shard(1)` (the sequence) and gathered again before the next column-parallel
  input (`PrepareModuleInput`); the embeddings' dropout takes its positions (`Replicate` ->
  `Shard(1)`, a local slice) since the position embedding is added to the full sequence.

DTensor redistributes these parameters; the tie between embedding and head (when the model ties
them) is restored after.
Under sequence parallelism DTensor knows what our `tp` sums by hand: a replicated parameter
used on this rank's positions only may get a `Partial` gradient, summed where it is read (the
optimizer step; `full_tensor()` in the norm). Communication happens inside torch, not through
labsupport.comm: compare losses and times, not comm counts.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               loss_parallel, parallelize_module)

from .. import comm
from .clip import clip_grad_norm_, count_once
from .torch_dtensor import LocalShardStrategy, local


def plan(model, sequence_parallel: bool) -> dict:
    """torchtitan's `apply_tp` plan for TinyGPT's module names (the GPT shape's MLP `fc`, `proj`;
    SwiGLU's `gate`, `up`, `down`)."""
    seq, rep = Shard(1), Replicate()
    between = seq if sequence_parallel else rep  # the residual stream between parallel regions
    out = {"tok_emb": RowwiseParallel(input_layouts=rep, output_layouts=rep),
           "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        out["drop"] = PrepareModuleInput(input_layouts=rep, desired_input_layouts=seq, use_local_output=True)
        out["ln_f"] = SequenceParallel()
    for i, block in model.blocks.items():
        mlp = (("gate", "up"), "down") if hasattr(block.mlp, "gate") else (("fc",), "proj")
        for part, (cols, row) in (("attn", (("qkv",), "proj")), ("mlp", mlp)):
            for col in cols:
                out[f"blocks.{i}.{part}.{col}"] = ColwiseParallel()
            out[f"blocks.{i}.{part}.{row}"] = RowwiseParallel(output_layouts=between)
            if sequence_parallel or len(cols) > 1:  # the input made a DTensor once, for every column-parallel matrix
                out[f"blocks.{i}.{part}"] = PrepareModuleInput(input_layouts=between, desired_input_layouts=rep)
        if sequence_parallel:
            out[f"blocks.{i}.ln1"] = out[f"blocks.{i}.ln2"] = SequenceParallel()
    return out


class TorchTP(LocalShardStrategy):
    name = "torch-tp"

    def parallelize(self, model):
        model = model.to(self.rt.device)
        group = self.mesh.tp_group
        for tensor in [*model.parameters(), *model.buffers()]:  # DTensor slices what each rank has: start alike
            comm.broadcast(tensor.data, src=comm.global_rank(group, 0), group=group)
        self.tp_mesh = DeviceMesh.from_group(group, self.rt.device.type, mesh_dim_names=("tp",))
        parallelize_module(model, self.tp_mesh, plan(model, self.config.sequence_parallel))
        if model.cfg.tied:
            model.lm_head.weight = model.tok_emb.weight  # both Shard(0) on the vocabulary: tie them again
        model.vocab_padding = distribute_tensor(model.vocab_padding, self.tp_mesh, [Shard(0)])
        return model

    def loss_fn(self, logits, targets):
        with loss_parallel():
            return super().loss_fn(logits, targets)

    def backward(self, loss):
        with loss_parallel():
            loss.backward()

    def clip_grad_norm_(self, model, max_norm):
        """Our clip on plain tensors (DTensor's own norm wants every parameter a DTensor): the
        shards counted on every rank, the replicated ones on TP rank 0; then all scaled, on
        every rank. A replicated parameter's gradient may still be `Partial` (a LayerNorm's
        under sequence parallelism): `full_tensor()` sums it (on every rank: a collective).
        Which is which is read off the gradient, not the parameter: DTensor's embedding backward
        leaves an untied embedding's gradient `Replicate` (the whole V x h on every rank) although
        the parameter is `Shard(0)`; counted as a shard it would count T times (seen on llama-micro:
        the norm 3.5% high). (Tied to the head, the matrix's gradient comes out a shard: the GPT
        runs' norms are single's.)"""
        params = [p for p in model.parameters() if p.grad is not None]
        sharded = [p for p in params if isinstance(p.grad, DTensor) and p.grad.placements[0].is_shard()]
        replicated = [p for p in params if not any(p is q for q in sharded)]
        shards = [SimpleNamespace(grad=local(p.grad)) for p in sharded]
        whole = [SimpleNamespace(grad=p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad) for p in replicated]
        counted = count_once(shards + whole, shards, self.mesh.tp_group)
        views = [SimpleNamespace(grad=local(p.grad)) for p in params]  # the gradients' own storage
        return clip_grad_norm_(counted, max_norm, (self.mesh.tp_group,), scaled=views, device=self.rt.device)

    @torch.no_grad()
    def logits(self, model, idx):
        t, pad = idx.shape[1], -idx.shape[1] % self.config.tp if self.config.sequence_parallel else 0
        out = model(torch.nn.functional.pad(idx, (0, pad)))
        return out.full_tensor()[:, :t]
