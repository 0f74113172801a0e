"""Our mechanisms as library objects, as a user outside this repository meets them: plain
`nn.Module`s defined here, a process group, and the object used the way its torch counterpart is.

- `ShardedOptimizer` is a `torch.optim.Optimizer`: `step()` after `backward()` (and DataParallel's
  average) does the whole job, with the same parameters after every step as AdamW on one process.
- The tensor-parallel layers refuse, in one clear error, a size the group does not divide (a
  vocabulary of 31 rows on 2 ranks, 6 output features on 4, 2 key/value heads or a SwiGLU of 6 units
  on 4), instead of computing the wrong rows.
"""
import textwrap

import pytest

from labsupport.launch import launch

pytestmark = pytest.mark.multiprocess

SHARDED_OPTIMIZER = textwrap.dedent('''
    import torch, torch.nn as nn
    from labsupport import init, report
    from labsupport.parallel.ddp import DataParallel
    from labsupport.parallel.zero import ShardedOptimizer

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.norm, self.fc2 = nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 3)
        def forward(self, x):
            return self.fc2(torch.relu(self.norm(self.fc1(x))))

    failures = []
    with init(seed=0) as rt:
        torch.manual_seed(0)
        reference, mine = Net(), Net()
        mine.load_state_dict(reference.state_dict())
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
        ddp = DataParallel(mine)
        opt = ShardedOptimizer(mine.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
        owned = sum(t.numel() for t in opt.pieces())
        data = torch.Generator().manual_seed(1)
        for step in range(4):
            x, y = torch.randn(4 * rt.world_size, 6, generator=data), torch.randn(4 * rt.world_size, 3, generator=data)
            nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step(); ref_opt.zero_grad()
            mine_rows = slice(4 * rt.rank, 4 * rt.rank + 4)
            nn.functional.mse_loss(ddp(x[mine_rows]), y[mine_rows]).backward()
            ddp.finish_gradient_synchronization()
            opt.step(); opt.zero_grad()   # no other call: step() takes its shard of the gradients itself
            for (name, a), b in zip(reference.named_parameters(), mine.parameters()):
                if not torch.allclose(a, b, atol=1e-6, rtol=1e-5):
                    failures.append(f"step {step}: {name} differs by {(a - b).abs().max().item():.2e}")
        ddp.close()
    report(failures=failures, owned=owned, total=sum(p.numel() for p in reference.parameters()))
''')

REFUSALS = textwrap.dedent('''
    import torch.nn as nn
    from labsupport import init, report
    from labsupport.model import CausalSelfAttention, ModelConfig, SwiGLU
    from labsupport.parallel.tensor import (ColumnParallelLinear, ParallelAttention, ParallelSwiGLU, RowParallelLinear,
                                            VocabParallelEmbedding)

    # 8 query heads on 2 key/value heads: qkv's 48 rows split over 4 ranks, but not into whole query groups
    GQA = ModelConfig("gqa", n_layers=1, hidden=32, heads=8, kv_heads=2, vocab=8, seq_len=4)

    errors = {}
    with init(seed=0) as rt:
        for name, build in [("embedding", lambda: VocabParallelEmbedding(nn.Embedding(31, 8))),
                            ("column", lambda: ColumnParallelLinear(nn.Linear(8, 6))),
                            ("row", lambda: RowParallelLinear(nn.Linear(6, 8))),
                            ("attention", lambda: ParallelAttention(CausalSelfAttention(GQA))),
                            ("swiglu", lambda: ParallelSwiGLU(SwiGLU(8, 6)))]:
            try:
                build()
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)
        ColumnParallelLinear(nn.Linear(8, 12))  # 4 ranks divide 12: accepted
    report(errors=errors)
''')


def test_sharded_optimizer_step_alone_is_adamw_on_every_parameter(tmp_path):
    script = tmp_path / "sharded_optimizer.py"
    script.write_text(SHARDED_OPTIMIZER)
    res = launch(str(script), nproc=2, timeout=120, run_dir=tmp_path / "run")
    owned = 0
    for rank in range(2):
        assert res.report(rank)["failures"] == []
        owned += res.report(rank)["owned"]
    assert owned == res.report(0)["total"], "every element updated by exactly one rank"


def test_tensor_parallel_layers_refuse_sizes_the_group_does_not_divide(tmp_path):
    script = tmp_path / "refusals.py"
    script.write_text(REFUSALS)
    errors = launch(str(script), nproc=4, timeout=120, run_dir=tmp_path / "run").report(0)["errors"]
    assert errors["embedding"] == ("VocabParallelEmbedding(31, 8) vocabulary rows: 31 do not split evenly over 4 "
                                   "tensor-parallel ranks; pad them to a multiple of 4 or use a group size that divides 31")
    assert errors["column"].startswith("ColumnParallelLinear(8, 6) output features: 6 do not split evenly over 4")
    assert errors["row"].startswith("RowParallelLinear(6, 8) input features: 6 do not split evenly over 4")
    assert errors["attention"].startswith("ParallelAttention: 2 key/value heads (query groups) do not split over 4 "
                                          "tensor-parallel ranks")
    assert errors["swiglu"].startswith("ColumnParallelLinear(8, 6) output features: 6 do not split evenly over 4")
