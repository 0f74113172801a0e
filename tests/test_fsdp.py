"""`fully_shard`, ZeRO-3 as a library object, on plain `nn.Module`s built here (no `blocks`, no
runtime or config of ours): every rank trains on its share of the batch, beside it a single-process
reference trains on the whole batch, and every step the losses, every whole gradient and every whole
parameter must agree (AdamW would hide a gradient scaled by a constant: the gradients are compared
before each step)."""
import textwrap

import pytest
import torch

from conftest import cases_on_ranks, planted_copy

RANKS = textwrap.dedent('''
    """Runs the cases argv[1] lists as JSON, (label, where, case), in turn: where "world" on every rank,
    "ranks 1.." on a group without rank 0, "planted" on every rank with the fully_shard of planted_fsdp.py
    (a copy of fsdp.py with a bug in it). Reports {label: failures, one line each}."""
    import copy, json, sys
    import torch, torch.nn as nn, torch.nn.functional as F
    from labsupport import comm, init, report
    from labsupport.parallel.fsdp import fully_shard

    class Layer(nn.Module):
        """A LayerNorm, a linear and a 0-dim gate (fewer elements than ranks); with `frozen`, a frozen
        projection first, whose weight backward needs after the layer's last gradient has arrived."""
        def __init__(self, d, frozen=False):
            super().__init__()
            self.frozen = nn.Linear(d, d).requires_grad_(False) if frozen else nn.Identity()
            self.norm = nn.LayerNorm(d)
            self.fc = nn.Linear(d, d)
            self.gate = nn.Parameter(torch.tensor(0.5))
        def forward(self, x):
            return x + self.gate * torch.tanh(self.fc(self.norm(self.frozen(x))))

    class MLP(nn.Module):
        """Layers in a ModuleList (no `blocks`), an input projection, a final norm and a head around them."""
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(5, 8)
            self.layers = nn.ModuleList(Layer(8, frozen=i == 1) for i in range(3))
            self.norm = nn.LayerNorm(8)
            self.out = nn.Linear(8, 3)
        def forward(self, x):
            h = self.inp(x)
            for layer in self.layers:
                h = layer(h)
            return self.out(self.norm(h))

    class Tied(nn.Module):
        """Embedding and head share their weight; the head is a unit, so its weight must join the root."""
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(11, 6)
            self.body = nn.Sequential(nn.Linear(6, 6), nn.GELU(), nn.Linear(6, 6))
            self.head = nn.Linear(6, 11)
            self.head.weight = self.emb.weight
        def forward(self, idx):
            return self.head(self.body(self.emb(idx))).flatten(0, 1)

    def mlp_data(gen, n):
        return torch.randn(n, 5, generator=gen), torch.randint(0, 3, (n,), generator=gen)

    def tied_data(gen, n):
        return torch.randint(0, 11, (n, 4), generator=gen), torch.randint(0, 11, (n, 4), generator=gen)

    CASES = {  # name: (model, data, fully_shard options, backward passes per step)
        "mlp": (MLP, mlp_data, lambda m: dict(units=list(m.layers)), 1),
        "mlp-no-prefetch": (MLP, mlp_data, lambda m: dict(units=list(m.layers), prefetch=False), 1),
        "mlp-replicated": (MLP, mlp_data, lambda m: dict(units=list(m.layers), replicate=lambda n, p: p.dim() < 2), 1),
        "mlp-bf16": (MLP, mlp_data, lambda m: dict(units=list(m.layers), param_dtype=torch.bfloat16,
                                                   replicate=lambda n, p: p.dim() < 2), 1),
        "mlp-accumulate": (MLP, mlp_data, lambda m: dict(units=list(m.layers)), 2),
        "tied": (Tied, tied_data, lambda m: dict(units=[m.body, m.head]), 1),
        "tied-one-unit": (Tied, tied_data, lambda m: dict(replicate=[m.head.bias]), 2),
    }

    def run(case, rt, group, failures, fully_shard=fully_shard):
        build, data, options, accum = CASES[case]
        bf16 = case.endswith("bf16")
        say = lambda message: failures.append(f"{case}: {message}")
        n, me = comm.get_world_size(group), comm.get_rank(group)
        torch.manual_seed(100 + rt.rank)  # different init per rank: fully_shard must broadcast
        model = build()
        torch.manual_seed(100 + comm.global_rank(group, 0))
        reference = build()  # the group's first rank's values, which fully_shard broadcasts
        shapes = {name: p.shape for name, p in reference.named_parameters()}
        handle = fully_shard(model, group, **options(model))
        replicated = {id(p) for u in handle.units for p in u.replicated}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        if case.startswith("mlp"):  # is layer 1 on its way while layer 0 computes (only with prefetch)?
            in_flight, dtypes, second = [], [], handle.units[1]
            model.layers[0].register_forward_pre_hook(lambda *_: (  # runs after fully_shard's (None: args kept)
                in_flight.append(second.work is not None or second.gathered)
                or dtypes.append(model.layers[0].fc.weight.dtype)))
        def close(a, b):
            if bf16:  # bf16 sums over a half and a whole batch round apart: a scalar's by a few of its 2^-8 steps
                return (a.float() - b).norm() <= 0.1 * b.norm() + 1e-4
            return torch.allclose(a, b, atol=1e-6, rtol=1e-5)
        per = 2 * accum
        gen = torch.Generator().manual_seed(1)
        for step in range(4):
            x, y = data(gen, n * per)
            if bf16:  # one device in mixed precision: a bf16 copy computes, the fp32 reference steps
                low = copy.deepcopy(reference).to(torch.bfloat16)
                ref_loss = F.cross_entropy(low(x.to(torch.bfloat16)), y.reshape(-1)).float()
                ref_loss.backward()
                for p, q in zip(reference.parameters(), low.parameters()):
                    p.grad = None if q.grad is None else q.grad.float()
            else:
                ref_loss = F.cross_entropy(reference(x), y.reshape(-1))
                ref_loss.backward()
            mine = slice(me * per, (me + 1) * per)
            loss = torch.zeros(())
            for i, (xs, ys) in enumerate(zip(x[mine].chunk(accum), y[mine].chunk(accum))):
                part = F.cross_entropy(model(xs), ys.reshape(-1)) / accum
                part.backward()  # no other call: the gradients are ready when it returns
                loss += part.detach().float()
                if i == 0:
                    for name, p in model.named_parameters():
                        if p.requires_grad and (p.grad is None or p.grad.shape != p.shape or p.grad.dtype != p.dtype):
                            say(f"step {step}: after backward {i}, {name} has no gradient of its shard")
            handle.finish_gradient_synchronization()  # idempotent: the loop's explicit call changes nothing
            limit = 0.5 if step % 2 else 100.0  # clipped on odd steps; even ones compare the gradients as they are
            norm = handle.clip_grad_norm_(limit)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), limit)
            if not abs(norm - ref_norm) <= (5e-2 if bf16 else 1e-5) * ref_norm:  # replicated ones counted once
                say(f"step {step}: gradient norm {norm} vs {ref_norm}")
            comm.all_reduce(loss, "avg", group=group)
            if not abs(loss.item() - ref_loss.item()) <= (2e-2 * ref_loss.item() if bf16 else 1e-5):
                say(f"step {step}: loss {loss.item()} vs {ref_loss.item()}")
            owned = torch.zeros(())  # between uses: fp32 shards, each element on one rank; replicated: whole
            for name, p in model.named_parameters():
                whole = id(p) in replicated
                if p.dtype != torch.float32 or (p.shape != shapes[name] if whole else p.dim() != 1) or (
                        p.grad is not None and p.grad.dtype != torch.float32):
                    say(f"step {step}: {name} is {p.dtype} {tuple(p.shape)} between uses")
                owned += 0 if whole else p.numel()
            total = sum(shapes[name].numel() for name, p in model.named_parameters() if id(p) not in replicated)
            if owned > total / n + len(handle.units):  # 1/N, within the padding
                say(f"step {step}: this rank holds {owned.item()} of {total} sharded elements")
            comm.all_reduce(owned, "sum", group=group)
            if owned.item() != total:
                say(f"step {step}: the ranks hold {owned.item()} elements of {total}")
            with handle.full_parameters(with_grads=True):
                for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
                    if p.shape != ref.shape or not close(p, ref):
                        say(f"step {step}: {name} differs before the step")
                    elif (p.grad is None) != (ref.grad is None):
                        say(f"step {step}: {name} has a gradient on one side only")
                    elif p.grad is not None and not close(p.grad, ref.grad):
                        say(f"step {step}: grad of {name} differs by {(p.grad - ref.grad).abs().max().item():.2e}")
            opt.step(); opt.zero_grad()
            ref_opt.step(); ref_opt.zero_grad()
        if case.startswith("mlp"):
            if set(in_flight) != {case != "mlp-no-prefetch"}:
                say(f"layer 1 in flight during layer 0: {set(in_flight)}")
            if set(dtypes) != {torch.bfloat16 if bf16 else torch.float32}:
                say(f"layer 0 computed in {set(dtypes)}")
        with torch.no_grad():  # evaluation, twice, through the same hooks; nothing stays gathered
            for _ in range(2):
                out, want = model(x), reference(x)
                if not close(out, want):
                    say(f"evaluation differs by {(out.float() - want).abs().max().item():.2e}")
        if any(u.gathered or u.work is not None for u in handle.units):
            say("a unit stayed gathered after evaluation")
        state, want = handle.full_state_dict(), reference.state_dict()
        if list(state) != list(want) or any(not close(state[k], want[k]) for k in want):
            say("full_state_dict differs from the reference's state_dict")
        shifted = {k: v + 1 for k, v in want.items()}
        with handle.full_parameters():  # the documented way to load: written back into the shards
            model.load_state_dict(shifted)
        if any(not torch.equal(v, shifted[k]) for k, v in handle.full_state_dict().items()):
            say("load_state_dict inside full_parameters() was not kept")
        with handle.full_parameters():
            model.load_state_dict(want)
        units = handle.units
        handle.close()
        comm.reset()
        out = model(x)
        if comm.counts():
            say(f"after close() a forward still communicates: {comm.counts()}")
        if not close(out, reference(x)):
            say("after close() the output differs")
        for name, p in model.named_parameters():
            if p.shape != shapes[name] or p.untyped_storage().nbytes() != p.numel() * p.element_size():
                say(f"after close() {name} is not a whole tensor of its own")
        if any(u.gathered for u in units):
            say("close() left a unit gathered")

    with init(seed=0) as rt:
        group = comm.new_group(range(1, rt.world_size), "dp")  # every rank calls it
        for label, where, case in json.loads(sys.argv[1]):
            failures = []
            if where == "world":
                run(case, rt, None, failures)
            elif where == "planted":
                from planted_fsdp import fully_shard as planted_fully_shard
                run(case, rt, None, failures, planted_fully_shard)
            elif rt.rank > 0:  # a group without rank 0: its first rank's values win
                run(case, rt, group, failures)
            report(**{label: failures})
''')

ALL = ["mlp", "mlp-no-prefetch", "mlp-replicated", "mlp-bf16", "mlp-accumulate", "tied", "tied-one-unit"]
PLANTED = "planted sum instead of average: mlp on 2 ranks"

RUNS = {  # ranks: (cases on the world, then on ranks 1..)
    2: (ALL, []),
    # 3 ranks: padding, pieces cut between ranks, empty pieces; then ranks 1 and 2, a group without rank 0
    3: (["mlp", "mlp-accumulate", "tied"], ["mlp-replicated", "tied-one-unit"]),
}

# every case: {label: (ranks, where, case)}; the planted bug runs in the 2-rank launch
CASES = {
    **{f"{case} on {nproc} ranks": (nproc, "world", case) for nproc, (on_world, _) in RUNS.items()
       for case in on_world},
    **{f"{case} on ranks 1.. of {nproc}": (nproc, "ranks 1..", case) for nproc, (_, on_sub) in RUNS.items()
       for case in on_sub},
    PLANTED: (2, "planted", "mlp"),
}


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """`checks(label)`: the case's failures per rank, every case of N ranks in one launch."""
    from labsupport.parallel import fsdp

    def plant(folder):
        planted_copy(fsdp, [('reduce_scatter_tensor(shard, flat, "avg"', 'reduce_scatter_tensor(shard, flat, "sum"')],
                     folder / "planted_fsdp.py")
    return cases_on_ranks(tmp_path_factory, RANKS, CASES, plant)


@pytest.mark.multiprocess
@pytest.mark.parametrize("nproc", RUNS, ids=["2 ranks", "3 ranks, then a group of 2"])
def test_fully_shard_matches_single_device_every_step(checks, nproc):
    for label in [label for label, (n, where, _) in CASES.items() if n == nproc and where != "planted"]:
        for rank, failures in enumerate(checks(label)):
            assert failures == [], f"rank {rank}"


@pytest.mark.multiprocess
def test_planted_sum_instead_of_average_in_the_reduce_scatter_is_caught(checks):
    """Summing the gradients instead of averaging them barely changes AdamW's steps, and clipping
    hides the scale from the clipped gradients: the norm must catch it, and the gradients on a step
    that is not clipped. (Planted in a copy of fsdp.py that the 2-rank run's planted case uses.)"""
    failures = checks(PLANTED)[0]
    assert any(f.startswith("mlp: step 1: gradient norm") for f in failures), failures
    assert any(f.startswith("mlp: step 0: grad of inp.weight differs") for f in failures), failures


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.act = torch.nn.Linear(2, 2), torch.nn.GELU()

    def forward(self, x):
        return self.act(self.fc(x))


@pytest.mark.parametrize("units, message", [
    (lambda m: [m.layers], "units[0] (ModuleList) is never called"),
    (lambda m: [torch.nn.Linear(2, 2)], "units[0] must be a submodule of the module"),
    (lambda m: [m], "units[0] must be a submodule of the module (the module itself is the root unit)"),
    (lambda m: [m.layers[0], m.layers[0].fc], "units[1] is inside units[0]; units must not nest"),
    (lambda m: [m.layers[0].act], "units[0] (GELU) holds no parameters"),
])
def test_units_that_cannot_work_are_refused_before_anything_is_sent(units, message):
    """Checked before the broadcast: no process group is needed to see the message."""
    import re
    from labsupport.parallel.fsdp import fully_shard
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_Layer()])
    with pytest.raises(ValueError, match=re.escape(message)):
        fully_shard(model, units=units(model))
