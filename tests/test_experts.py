"""The mixture of experts (labsupport.model's MoE), expert parallelism (labsupport.parallel.experts),
and their estimates.

- On one process, the MoE equals a plain loop, token by token and choice by choice, that fills each
  expert's queue in GShard's order: outputs, the load-balancing loss, what is routed and dropped, and
  every gradient; an expert no token chooses gets no gradient (None, as the loop leaves it, so AdamW
  does not decay it). A planted bug (combine adding each output to the token of the unsorted
  assignment, the dispatch sort not undone) fails it.
- On 2 and 4 real ranks (one launch each, checking everything: conftest.cases_on_ranks), expert parallelism equals the
  one-rank MoE on the same global batch, with capacity to spare, with drops and with an expert no
  token reaches (on 4 ranks its rank receives no row, yet joins the backward's all-to-alls): outputs,
  the loss, the load per expert and every gradient within 1e-5 relative (None where the one-rank
  layer's is None), the counters equal to estimate.experts' traffic, and removing it gives back the
  dense layer. On 4 ranks, the training step (dp 4 x ep 2) leaves the twins holding one expert in
  the two groups the same gradient, None where no token of either group reached it.
- Bad shapes are refused in one line, "ep divides dp" with the same line by the step and the Mesh;
  the parameter count is held to Mixtral 8x7B's published one.
"""
import importlib.util
import inspect
import math
import textwrap

import pytest
import torch
import torch.nn.functional as F

from conftest import cases_on_ranks, planted_copy
from labsupport.estimate.experts import MIXTRAL_8X7B, expert_params, moe_comm, moe_layer_params, moe_model_params
from labsupport import model
from labsupport.model import MoE, moe_problems
from labsupport.parallel import ParallelConfig
from labsupport.parallel.experts import ExpertParallelStep, problems
from labsupport.parallel.mesh import Mesh

HIDDEN, FFN, N_EXPERTS = 16, 32, 4
CASES = {"capacity to spare": dict(top_k=2, capacity_factor=None),
         "drops": dict(top_k=2, capacity_factor=0.5),
         "switch top-1": dict(top_k=1, capacity_factor=1.0, renormalize=False),
         "one row per expert": dict(top_k=2, capacity_factor=0.05),  # later ranks send nothing at all
         "an expert no token reaches": dict(top_k=2, capacity_factor=None, unreached=N_EXPERTS - 1)}


def build(MoE, case):
    """The MoE of a case; `unreached`: an expert whose router logit is pushed down, so that no token
    chooses it (under expert parallelism on 4 ranks, its rank then receives no row at all)."""
    case = dict(case)
    unreached = case.pop("unreached", None)
    moe = MoE(HIDDEN, FFN, N_EXPERTS, **case)
    if unreached is not None:
        moe.router.register_forward_hook(lambda _, __, logits: logits.index_fill(-1, torch.tensor([unreached]), -1e4))
    return moe


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
    moe = build(module.MoE, case)
    reference = build(module.MoE, case)
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
        if q.grad is None:  # the loop never ran it
            assert p.grad is None, f"{name} has a gradient, but no token reached its expert"
        else:
            assert_close(f"gradient of {name}", p.grad, q.grad)
    return moe


@pytest.mark.parametrize("case", CASES)
def test_one_rank_moe_is_the_token_by_token_loop(case):
    moe = check_against_loop(model, CASES[case])
    assert (sum(moe.load["dropped"]) > 0) == (CASES[case]["capacity_factor"] is not None), moe.load
    unreached = [str(e) for e, n in enumerate(moe.load["routed"]) if n == 0]
    assert unreached == (["3"] if "unreached" in CASES[case] else []), moe.load
    assert all(p.grad is None for e in unreached for p in moe.experts[e].parameters())


def test_swiglu_experts_are_the_token_by_token_loop():
    """Mixtral's experts (SwiGLU: gate, up, down) through the same dispatch and combine, drops included."""
    moe = check_against_loop(model, dict(top_k=2, capacity_factor=0.5, mlp="swiglu"))
    assert sorted(n for n, _ in moe.experts["0"].named_parameters()) == [
        "down.bias", "down.weight", "gate.bias", "gate.weight", "up.bias", "up.weight"]


def test_combine_without_undoing_the_dispatch_sort_fails(tmp_path):
    path = tmp_path / "planted_model.py"
    planted_copy(model, [(".index_add(0, token, gated)", ".index_add(0, assignment // k, gated)")], path)
    spec = importlib.util.spec_from_file_location("planted_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(AssertionError, match="output differs"):
        check_against_loop(module, CASES["capacity to spare"])


def test_bad_shapes_are_refused_in_one_line():
    assert problems(4, n_experts=6) == ["6 experts do not split evenly over 4 expert-parallel ranks; "
                                        "use an ep degree that divides 6"]
    assert moe_problems(4, 5, 1.0) == ["top_k 5: each token chooses between 1 and n_experts (4) experts"]
    assert moe_problems(4, 2, 0.0)[0].startswith("capacity_factor 0.0: it must be above 0")
    assert moe_problems(8, 2, 1.25) == [] and problems(4, dp=8, n_experts=8) == []
    for bad in [dict(top_k=5), dict(capacity_factor=-1.0)]:
        with pytest.raises(ValueError) as error:
            MoE(HIDDEN, FFN, N_EXPERTS, **bad)
        assert "\n" not in str(error.value)


def test_ep_divides_dp_is_one_rule_with_one_message():
    """The expert step's check, which the Mesh (a library object) raises as it is."""
    line = "--ep 3 must divide --dp 4: expert parallelism spreads the experts over data-parallel ranks"
    assert ExpertParallelStep.problems(ParallelConfig(dp=4, ep=3)) == [line]
    with pytest.raises(ValueError) as error:
        Mesh(dp=4, ep=3)
    assert str(error.value) == line


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
    # and the model-wide count is params.count_params of the mixtral-8x7b preset: one formula
    from labsupport.estimate.params import active_params, count_params
    from labsupport.estimate.shapes import PRESETS
    assert moe_model_params(**MIXTRAL_8X7B) == {"total": count_params(PRESETS["mixtral-8x7b"]),
                                                "active": active_params(PRESETS["mixtral-8x7b"])}
    assert round((rest + layers * mixtral["active"]) / 1e9, 1) == 12.9
    assert expert_params(d, 14336, gated=True, bias=False) == 3 * d * 14336
    counted = moe_model_params(**MIXTRAL_8X7B)  # the same count, as notebook 07 shows it
    assert counted == {"total": rest + layers * mixtral["total"], "active": rest + layers * mixtral["active"]}


# ---------------------------------------------------------------- expert parallelism on real ranks

EXPERT_PARALLEL = textwrap.dedent('''
    import json
    import sys

    import torch
    from labsupport import comm, init, report
    from labsupport.model import MoE
    from labsupport.parallel import ParallelConfig
    from labsupport.parallel.experts import ExpertParallelStep, apply_expert_parallel, remove_expert_parallel
    from labsupport.parallel.mesh import Mesh

    HIDDEN, FFN, N_EXPERTS, CASES = {hidden}, {ffn}, {n_experts}, {cases}
    [(label,)] = json.loads(sys.argv[1])  # one case per EP degree: every MoE case of CASES
    failures, results, steps = [], {{}}, {{}}

    def close(what, got, want):
        if want is None or got is None:  # an expert no token reached has no gradient, here as on one rank
            if (got is None) != (want is None):
                failures.append(f"{{what}} is {{got}}, expected {{want}}")
            return
        err = (got - want).abs().max().item() / (want.abs().max().item() or 1.0)  # all zero: absolute
        if not err <= 1e-5:
            failures.append(f"{{what}} differs by {{err:.1e}} relative")

    {build}

    with init(seed=0) as rt:
        ep, rank = rt.world_size, rt.rank
        group = comm.new_group(range(ep), "ep")
        data = torch.Generator().manual_seed(1)
        x, w = torch.randn(8, 4, HIDDEN, generator=data), torch.randn(8, 4, HIDDEN, generator=data)
        mine = slice(rank * 8 // ep, (rank + 1) * 8 // ep)
        for name, case in CASES.items():
            torch.manual_seed(0)
            reference = build(MoE, case)
            torch.manual_seed(rank)  # each rank its own weights: apply_expert_parallel takes rank 0's
            moe = apply_expert_parallel(build(MoE, case), group)
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

        if ep == 4:  # the training step on dp 4 x ep 2: each expert on a rank of both ep groups (twins, edp)
            mesh = Mesh(dp=4, ep=2, rank=rank)
            for reached_by in ("group 1", "nobody"):  # whose tokens reach expert 3
                torch.manual_seed(0)
                skip = None if reached_by == "group 1" and rank >= 2 else N_EXPERTS - 1
                moe = build(MoE, dict(top_k=2, capacity_factor=None, unreached=skip))
                step = ExpertParallelStep(mesh, ParallelConfig(dp=4, ep=2))
                step.apply([moe], [], [])
                moe(x[mine]).sum().backward()
                had = {{n: p.grad is not None for n, p in moe.named_parameters() if n.startswith("experts.")}}
                step.finish_backward()
                steps[reached_by] = {{
                    "had": had, "grads": {{n: None if p.grad is None else p.grad.tolist()
                                          for n, p in moe.named_parameters() if n.startswith("experts.")}}}}
    report(**{{label: dict(failures=failures, results=results, steps=steps)}})
''')


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    """One launch per EP degree runs every case; each rank reports its failures, loads and counters."""
    script = EXPERT_PARALLEL.format(hidden=HIDDEN, ffn=FFN, n_experts=N_EXPERTS, cases=CASES,
                                    build=inspect.getsource(build))
    return cases_on_ranks(tmp_path_factory, script, {f"ep {ep}": (ep,) for ep in (2, 4)})


@pytest.fixture(params=[2, 4], ids=lambda n: f"ep{n}")
def expert_parallel(request, checks):
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
    assert all((sum(load["dropped"]) > 0) == (CASES[name]["capacity_factor"] is not None)
               for name, load in loads.items()), loads
    one_each = loads["one row per expert"]  # all from rank 0's first tokens: the other ranks dispatch nothing
    assert one_each["capacity"] == 1 and sum(one_each["routed"]) - sum(one_each["dropped"]) == N_EXPERTS


@pytest.mark.multiprocess
def test_the_step_sums_expert_gradients_over_twins_and_keeps_none_where_no_token_reached(checks):
    """ExpertParallelStep.finish_backward on dp 4 x ep 2 (the 4-rank launch; the 2-rank one has no twins): ranks 1
    and 3 hold experts 2 and 3. Where only group 1's tokens reach expert 3, rank 1 holds no gradient before and its
    twin's after; where nobody's do, both keep None, as one rank would (AdamW then leaves the expert alone)."""
    reports = checks("ep 4")
    for reached_by in ("group 1", "nobody"):
        results = [r["steps"][reached_by] for r in reports]
        assert not results[1]["had"]["experts.3.fc.weight"]
        assert results[3]["had"]["experts.3.fc.weight"] == (reached_by == "group 1")
        for a, b in ((0, 2), (1, 3)):
            assert results[a]["grads"] == results[b]["grads"], f"ranks {a} and {b} hold other expert gradients"
        held = {n: g is not None for n, g in results[1]["grads"].items()}
        assert held == {n: not (n.startswith("experts.3.") and reached_by == "nobody") for n in held}, held


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
