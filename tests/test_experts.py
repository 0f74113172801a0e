"""The mixture of experts and expert parallelism (labsupport.parallel.experts), and their estimates.

- On one process, the MoE equals a plain loop, token by token and choice by choice, that fills each
  expert's queue in GShard's order: outputs, the load-balancing loss, what is routed and dropped, and
  every gradient. A planted bug (combine adding each output to the token of the unsorted
  assignment, the dispatch sort not undone) fails it.
- On 2 and 4 real ranks (one launch each, checking everything: conftest.cases_on_ranks), expert
  parallelism equals the one-rank MoE on the same global batch, with capacity to spare and with
  drops: outputs, the loss, the load per expert and every gradient within 1e-5 relative, the
  counters equal to estimate.experts' traffic, and removing it gives back the dense layer.
- Bad shapes are refused in one line; the parameter count is held to Mixtral 8x7B's published one.
"""
import importlib.util
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import cases_on_ranks, planted_copy
from labsupport.estimate.experts import MIXTRAL_8X7B, expert_params, moe_comm, moe_layer_params, moe_model_params
from labsupport.parallel import experts
from labsupport.parallel.experts import MoE, problems

HIDDEN, FFN, N_EXPERTS = 16, 32, 4
CASES = {"capacity to spare": dict(top_k=2, capacity_factor=None),
         "drops": dict(top_k=2, capacity_factor=0.5),
         "switch top-1": dict(top_k=1, capacity_factor=1.0, renormalize=False),
         "one row per expert": dict(top_k=2, capacity_factor=0.05)}  # later ranks send nothing at all


def loop_moe(moe, x):
    """The reference: each token's choices one by one, every first choice before any second, each
    kept while its expert's queue has room. Returns (output, aux loss, load)."""
    tokens = x.reshape(-1, x.shape[-1])
    n, k, factor = len(tokens), moe.top_k, moe.capacity_factor
    capacity = n if factor is None else math.ceil(factor * k * n / moe.n_experts)
    probs = F.softmax(moe.router(tokens), dim=-1)
    rows = [torch.zeros(x.shape[-1]) for _ in tokens]
    routed, dropped = [0] * moe.n_experts, [0] * moe.n_experts
    for j in range(k):
        for t in range(n):
            top = probs[t].topk(k)
            e = int(top.indices[j])
            gate = top.values[j] / top.values.sum() if moe.renormalize else top.values[j]
            routed[e] += 1
            if routed[e] - dropped[e] > capacity:  # already full
                dropped[e] += 1
            else:
                rows[t] = rows[t] + gate * moe.experts[str(e)](tokens[t])
    fraction = torch.tensor(routed) / (n * k)
    aux = moe.n_experts * (fraction * probs.mean(dim=0)).sum()
    return torch.stack(rows).view_as(x), aux, {"routed": routed, "dropped": dropped, "capacity": capacity}


def assert_close(what, got, want, rtol=1e-5):
    err = (got - want).abs().max().item() / (want.abs().max().item() or 1.0)  # all zero: absolute
    assert err <= rtol, f"{what} differs by {err:.1e} relative"


def check_against_loop(module, case):
    torch.manual_seed(0)
    moe = module.MoE(HIDDEN, FFN, N_EXPERTS, **case)
    reference = module.MoE(HIDDEN, FFN, N_EXPERTS, **case)
    reference.load_state_dict(moe.state_dict())
    x = torch.randn(3, 8, HIDDEN)
    w = torch.randn(3, 8, HIDDEN)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    y = moe(xa)
    ((y * w).sum() + moe.aux_loss).backward()
    want, aux, load = loop_moe(reference, xb)
    ((want * w).sum() + aux).backward()
    assert_close("output", y, want)
    assert_close("aux loss", moe.aux_loss, aux)
    assert moe.load == load
    assert_close("input gradient", xa.grad, xb.grad)
    for (name, p), q in zip(moe.named_parameters(), reference.parameters()):
        assert_close(f"gradient of {name}", p.grad, q.grad)
    return load


@pytest.mark.parametrize("case", CASES)
def test_one_rank_moe_is_the_token_by_token_loop(case):
    load = check_against_loop(experts, CASES[case])
    assert (sum(load["dropped"]) > 0) == (case != "capacity to spare"), load


def test_combine_without_undoing_the_dispatch_sort_fails(tmp_path):
    path = tmp_path / "planted_experts.py"
    planted_copy(experts, [(".index_add(0, token, gated)", ".index_add(0, assignment // k, gated)")], path)
    spec = importlib.util.spec_from_file_location("planted_experts", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(AssertionError, match="output differs"):
        check_against_loop(module, CASES["capacity to spare"])


def test_bad_shapes_are_refused_in_one_line():
    assert problems(6, 2, 1.0, ep=4) == ["6 experts do not split evenly over 4 expert-parallel ranks; "
                                         "use an ep degree that divides 6"]
    assert problems(4, 5, 1.0) == ["top_k 5: each token chooses between 1 and n_experts (4) experts"]
    assert problems(4, 2, 0.0)[0].startswith("capacity_factor 0.0: it must be above 0")
    assert problems(8, 2, 1.25, ep=4) == [] and problems(8, 2, None, ep=8) == []
    for bad in [dict(top_k=5), dict(capacity_factor=-1.0)]:
        with pytest.raises(ValueError) as error:
            MoE(HIDDEN, FFN, N_EXPERTS, **bad)
        assert "\n" not in str(error.value)


def test_parameter_counts():
    moe = MoE(HIDDEN, FFN, N_EXPERTS, top_k=2)
    counts = moe_layer_params(HIDDEN, FFN, N_EXPERTS, 2)
    assert counts["total"] == sum(p.numel() for p in moe.parameters())
    assert counts["active"] == counts["router"] + 2 * sum(p.numel() for p in moe.experts["0"].parameters())
    # Mixtral 8x7B (Jiang et al. 2024, Table 1: dim 4096, 32 layers, head_dim 128, 32 heads, 8 kv heads,
    # hidden_dim 14336, vocab 32000, 8 experts, top 2; Sec. 1: "47B parameters", "13B active";
    # Mistral AI's release: 46.7B total, 12.9B per token). Around the experts: attention (q and out
    # 4096 x 4096, k and v 4096 x 8 x 128), two RMSNorm weights a layer, untied embedding and head, a final norm.
    d, layers = 4096, 32
    rest = layers * (2 * d * d + 2 * d * 8 * 128 + 2 * d) + 2 * 32000 * d + d
    mixtral = moe_layer_params(d, 14336, 8, 2, gated=True, bias=False)
    assert round((rest + layers * mixtral["total"]) / 1e9, 1) == 46.7
    assert round((rest + layers * mixtral["active"]) / 1e9, 1) == 12.9
    assert expert_params(d, 14336, gated=True, bias=False) == 3 * d * 14336
    counted = moe_model_params(**MIXTRAL_8X7B)  # the same count, as notebook 07 shows it
    assert counted == {"total": rest + layers * mixtral["total"], "active": rest + layers * mixtral["active"]}


# ---------------------------------------------------------------- expert parallelism on real ranks

EXPERT_PARALLEL = textwrap.dedent('''
    import json, sys
    import torch
    from labsupport import comm, init, report
    from labsupport.parallel.experts import MoE, apply_expert_parallel, remove_expert_parallel

    HIDDEN, FFN, N_EXPERTS, CASES = {hidden}, {ffn}, {n_experts}, {cases}
    [(label,)] = json.loads(sys.argv[1])  # one case per EP degree: every MoE case of CASES
    failures, results = [], {{}}

    def close(what, got, want):
        err = (got - want).abs().max().item() / (want.abs().max().item() or 1.0)  # all zero: absolute
        if not err <= 1e-5:
            failures.append(f"{{what}} differs by {{err:.1e}} relative")

    with init(seed=0) as rt:
        ep, rank = rt.world_size, rt.rank
        group = comm.new_group(range(ep), "ep")
        data = torch.Generator().manual_seed(1)
        x, w = torch.randn(8, 4, HIDDEN, generator=data), torch.randn(8, 4, HIDDEN, generator=data)
        mine = slice(rank * 8 // ep, (rank + 1) * 8 // ep)
        for name, case in CASES.items():
            torch.manual_seed(0)
            reference = MoE(HIDDEN, FFN, N_EXPERTS, **case)
            torch.manual_seed(rank)  # each rank its own weights: apply_expert_parallel takes rank 0's
            moe = apply_expert_parallel(MoE(HIDDEN, FFN, N_EXPERTS, **case), group)
            x_all, x_mine = x.clone().requires_grad_(), x[mine].clone().requires_grad_()
            y_all = reference(x_all)
            ((y_all * w).sum() + reference.aux_loss).backward()

            comm.reset()
            y = moe(x_mine)
            forward = comm.group_counts()
            ((y * w[mine]).sum() + moe.aux_loss / ep).backward()  # the ranks' losses add up to the reference's
            both = comm.group_counts()
            results[name] = {{"load": moe.load, "reference_load": reference.load, "forward": forward["ep"],
                             "backward": {{op: {{key: n - forward["ep"].get(op, {{}}).get(key, 0)
                                                for key, n in c.items()}} for op, c in both["ep"].items()
                                          if c != forward["ep"].get(op)}}}}

            close(f"{{name}}: output", y, y_all[mine])
            close(f"{{name}}: input gradient", x_mine.grad, x_all.grad[mine])
            aux = moe.aux_loss.detach().clone()
            comm.all_reduce(aux, "avg", group=group)
            close(f"{{name}}: aux loss (mean over ranks)", aux, reference.aux_loss)
            router = moe.router.weight.grad.clone()
            comm.all_reduce(router, "sum", group=group)
            close(f"{{name}}: router gradient (sum over ranks)", router, reference.router.weight.grad)
            wanted = dict(reference.named_parameters())
            held = [n for n, _ in moe.named_parameters() if n.startswith("experts.")]
            for n, p in moe.named_parameters():
                if n.startswith("experts."):
                    close(f"{{name}}: gradient of {{n}}", p.grad, wanted[n].grad)
            results[name]["experts_held"] = sorted({{int(n.split(".")[1]) for n in held}})

            remove_expert_parallel(moe)
            for (n, p), q in zip(moe.named_parameters(), reference.parameters()):
                if not torch.equal(p, q):
                    failures.append(f"{{name}}: {{n}} after remove_expert_parallel is not the reference's")
    report(**{{label: dict(failures=failures, results=results)}})
''')


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    script = EXPERT_PARALLEL.format(hidden=HIDDEN, ffn=FFN, n_experts=N_EXPERTS, cases=CASES)
    return cases_on_ranks(tmp_path_factory, script, {f"ep {ep}": (ep,) for ep in (2, 4)})


@pytest.fixture(params=[2, 4], ids=lambda n: f"ep{n}")
def expert_parallel(request, checks):
    """One launch per EP degree runs every case; each rank reports its failures, loads and counters."""
    return request.param, checks(f"ep {request.param}")


@pytest.mark.multiprocess
def test_expert_parallel_equals_the_one_rank_moe(expert_parallel):
    ep, reports = expert_parallel
    for rank, r in enumerate(reports):
        assert r["failures"] == [], f"rank {rank}: {r['failures']}"
        for name, result in r["results"].items():
            assert result["load"] == result["reference_load"], f"rank {rank}, {name}: other drops than one rank's"
            per_rank = N_EXPERTS // ep
            assert result["experts_held"] == list(range(rank * per_rank, (rank + 1) * per_rank))
    loads = {name: result["load"] for name, result in reports[0]["results"].items()}
    assert all((sum(load["dropped"]) > 0) == (name != "capacity to spare") for name, load in loads.items()), loads
    one_each = loads["one row per expert"]  # all from rank 0's first tokens: the other ranks dispatch nothing
    assert one_each["capacity"] == 1 and sum(one_each["routed"]) - sum(one_each["dropped"]) == N_EXPERTS


@pytest.mark.multiprocess
def test_expert_parallel_traffic_is_the_estimate(expert_parallel):
    ep, reports = expert_parallel
    for name, case in CASES.items():
        measured = {phase: {} for phase in ("forward", "backward")}
        for r in reports:
            for phase in measured:
                for op, c in r["results"][name][phase].items():
                    total = measured[phase].setdefault(op, {"calls": 0, "payload_bytes": 0, "wire_bytes": 0})
                    for key in total:
                        total[key] += c[key]
        dropped = sum(reports[0]["results"][name]["load"]["dropped"])
        assert measured == moe_comm(8 * 4, HIDDEN, case["top_k"], N_EXPERTS, ep, dropped=dropped), name
