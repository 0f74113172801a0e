"""Context parallelism (labsupport/parallel/context.py) on real ranks, held to dense causal attention
on one process, and the estimate (labsupport/estimate/context.py) held to what the ranks measure.

One launch per rank count (2 and 4, conftest.cases_on_ranks) runs RANKS, which checks everything for
that count and reports:
- ring attention on this rank's share of q, k, v, balanced and plain split, each block by the fused
  kernel and by the plain math: the output and dq, dk, dv equal dense scaled_dot_product_attention's
  on the whole sequence (1e-5 relative);
- the library object on TinyGPT's CausalSelfAttention: the output, the gradient of the input of the
  qkv projection and of the projection's input, and the weight gradients summed over the group;
  then removed, the module is dense again;
- the scores each rank computes, plain and balanced (deterministic counts, not times);
- one forward + backward's comm counters, the bytes saved for backward and the K/V buffers
  received and alive at once, against the estimate;
- the same with grouped-query attention (KV_HEADS key/value heads for HEADS query heads): the ring
  passes the grouped K/V, HEADS / KV_HEADS fewer bytes, and the Llama family's attention (GQA, RoPE)
  under the library object equals it dense when it rotates by the rank's global positions, not by
  its local indices.
"""
import textwrap

import pytest

from conftest import cases_on_ranks
from labsupport.estimate.context import (activation_bytes, attention_memory, long_sequence_memory,
                                         min_block_for_overlap, ring_traffic, split_problems, stage_activation_bytes)
from labsupport.estimate.memory import activation_bytes_per_layer, model_state_bytes
from labsupport.estimate.params import count_params
from labsupport.estimate.shapes import get_preset

B, HEADS, HEAD_DIM, SEQ = 2, 2, 4, 16  # 2 cp = 8 chunks of 2 positions on 4 ranks
KV_HEADS = 1  # grouped-query attention's cases: both query heads read one key/value head (multi-query)
SPLITS = [f"{split} {kernel}" for split in ("balanced", "plain") for kernel in ("flash", "math")]

RANKS = textwrap.dedent(f'''
    import json, sys, weakref
    import torch, torch.nn.functional as F
    from labsupport import comm, init, report
    from labsupport.metrics import ActivationMeter
    from labsupport.model import CausalSelfAttention, ModelConfig
    from labsupport.parallel.context import apply_context_parallel, positions, ring_attention, shard_sequence

    B, HEADS, HEAD_DIM, SEQ, KV_HEADS = {B}, {HEADS}, {HEAD_DIM}, {SEQ}, {KV_HEADS}

    def rel(got, want):
        return ((got - want).abs().max() / want.abs().max()).item()

    class Received:
        """The receive buffers of comm's batch_isend_irecv that are alive, and the most at once."""
        def __init__(self):
            self.bytes = self.peak = 0
            self.inner = comm.batch_isend_irecv
        def __call__(self, ops, group=None):
            for kind, t, _, _ in ops:
                if kind == "recv":
                    self.bytes += t.nbytes
                    self.peak = max(self.peak, self.bytes)
                    weakref.finalize(t, self.release, t.nbytes)
            return self.inner(ops, group)
        def release(self, n):
            self.bytes -= n

    [(label,)] = json.loads(sys.argv[1])  # one case per rank count: everything this count checks
    out = {{}}
    with init(seed=0) as rt:
        group = comm.new_group(range(rt.world_size), "cp")
        rank, cp = rt.rank, rt.world_size
        g = torch.Generator().manual_seed(0)
        q, k, v, grad = (torch.randn(B, HEADS, SEQ, HEAD_DIM, generator=g) for _ in range(4))
        k_grouped, v_grouped = k[:, :KV_HEADS].clone(), v[:, :KV_HEADS].clone()
        for prefix, (k, v) in (("", (k, v)), ("gqa ", (k_grouped, v_grouped))):  # multi-head, then grouped K/V
            dense = [t.clone().requires_grad_() for t in (q, k, v)]
            ref = F.scaled_dot_product_attention(*dense, is_causal=True, enable_gqa=bool(prefix))
            ref.backward(grad)
            for balanced, kernel in [(True, "flash"), (False, "flash"), (True, "math"), (False, "math")]:
                split = prefix + ("balanced " if balanced else "plain ") + kernel
                mine = [shard_sequence(t, rank, cp, balanced, dim=2).requires_grad_() for t in (q, k, v)]
                counts = {{"forward": 0, "backward": 0}}
                received = comm.batch_isend_irecv = Received()
                comm.reset()
                with ActivationMeter().measure() as meter:
                    o = ring_attention(*mine, group=group, balanced=balanced, kernel=kernel, counts=counts)
                out[split + " received peak"] = received.peak
                o.backward(shard_sequence(grad, rank, cp, balanced, dim=2))
                comm.batch_isend_irecv = received.inner
                out[split + " comm"] = comm.group_counts().get("cp", {{}})
                out[split + " saved"] = meter.peak
                out[split + " scores"] = counts
                out[split + " errors"] = {{name: rel(got, shard_sequence(want, rank, cp, balanced, dim=2))
                                          for name, got, want in [("out", o, ref), ("dq", mine[0].grad, dense[0].grad),
                                                                  ("dk", mine[1].grad, dense[1].grad),
                                                                  ("dv", mine[2].grad, dense[2].grad)]}}

        # the library object on the model's attention: x -> qkv -> attention -> proj
        cfg = ModelConfig("t", n_layers=1, hidden=HEADS * HEAD_DIM, heads=HEADS, vocab=8, seq_len=SEQ)
        attention = CausalSelfAttention(cfg)
        x = torch.randn(B, SEQ, cfg.hidden, generator=g, requires_grad=True)
        proj_input = {{}}
        attention.proj.register_forward_hook(lambda m, a, y: a[0].retain_grad() or proj_input.update(t=a[0]))
        y_ref = attention(x)
        y_ref.backward(grad.transpose(1, 2).reshape(B, SEQ, -1))
        dense_grads = {{n: p.grad.clone() for n, p in attention.named_parameters()}}
        dense_proj_input = shard_sequence(proj_input["t"].grad, rank, cp, dim=1)
        attention.zero_grad()
        cp_on = apply_context_parallel(attention, group, balanced=True)
        x_mine = shard_sequence(x.detach(), rank, cp).requires_grad_()
        y = attention(x_mine)
        y.backward(shard_sequence(grad.transpose(1, 2).reshape(B, SEQ, -1), rank, cp))
        errors = {{"out": rel(y, shard_sequence(y_ref, rank, cp)),
                  "d input": rel(x_mine.grad, shard_sequence(x.grad, rank, cp)),
                  "d proj input": rel(proj_input["t"].grad, dense_proj_input)}}
        for n, p in attention.named_parameters():  # each rank's weight gradient is its positions' part
            comm.all_reduce(p.grad, group=group)
            errors["d " + n] = rel(p.grad, dense_grads[n])
        out["module errors"] = errors
        out["module scores"] = cp_on.counts
        cp_on.remove()
        out["removed is dense"] = rel(attention(x), y_ref)

        # the Llama family's attention: grouped K/V and RoPE, rotated by each rank's global positions
        llama = ModelConfig("t", n_layers=1, hidden=HEADS * HEAD_DIM, heads=HEADS, vocab=8, seq_len=SEQ,
                            kv_heads=KV_HEADS, positions="rope", bias=False)
        attention = CausalSelfAttention(llama)
        x = x.detach().requires_grad_()  # a gradient of its own, not added to the GPT module's
        y_ref = attention(x)
        y_ref.backward(grad.transpose(1, 2).reshape(B, SEQ, -1))
        dense_grads = {{n: p.grad.clone() for n, p in attention.named_parameters()}}
        attention.zero_grad()
        cp_on = apply_context_parallel(attention, group, balanced=True)
        x_mine = shard_sequence(x.detach(), rank, cp).requires_grad_()
        comm.reset()
        y = attention(x_mine, positions=positions(SEQ, rank, cp))
        y.backward(shard_sequence(grad.transpose(1, 2).reshape(B, SEQ, -1), rank, cp))
        out["llama comm"] = comm.group_counts().get("cp", {{}})
        errors = {{"out": rel(y, shard_sequence(y_ref, rank, cp)),
                  "d input": rel(x_mine.grad, shard_sequence(x.grad, rank, cp))}}
        for n, p in attention.named_parameters():
            comm.all_reduce(p.grad, group=group)
            errors["d " + n] = rel(p.grad, dense_grads[n])
        out["llama errors"] = errors
        with torch.no_grad():  # RoPE by the local indices 0 .. SEQ / cp - 1: as if every block began the sequence
            out["llama local positions error"] = rel(attention(x_mine), shard_sequence(y_ref, rank, cp))
        cp_on.remove()
    report(**{{label: out}})
''')


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    return cases_on_ranks(tmp_path_factory, RANKS, {f"cp {cp}": (cp,) for cp in (2, 4)})


@pytest.fixture(params=[2, 4], ids=["cp2", "cp4"])
def ranks(request, checks):
    """Rank k's reports of one launch of RANKS on cp ranks: (cp, [report of rank k])."""
    return request.param, checks(f"cp {request.param}")


@pytest.mark.multiprocess
def test_ring_attention_equals_dense_causal_attention_outputs_and_gradients(ranks):
    """Multi-head attention and grouped-query attention (dense: SDPA with enable_gqa), each split and kernel."""
    cp, reports = ranks
    for rank, r in enumerate(reports):
        for split in SPLITS + [f"gqa {split}" for split in SPLITS]:
            for name, err in r[f"{split} errors"].items():
                assert err <= 1e-5, f"cp {cp} rank {rank} {split}: {name} differs by {err:.2e} (relative)"


@pytest.mark.multiprocess
def test_the_library_object_on_the_models_attention_equals_it_dense_and_comes_off(ranks):
    cp, reports = ranks
    for rank, r in enumerate(reports):
        assert set(r["module errors"]) == {"out", "d input", "d proj input", "d qkv.weight", "d qkv.bias",
                                           "d proj.weight", "d proj.bias"}
        for name, err in r["module errors"].items():
            assert err <= 1e-5, f"cp {cp} rank {rank}: {name} differs by {err:.2e} (relative)"
        assert r["module scores"]["forward"] == r["balanced flash scores"]["forward"] > 0
        assert r["removed is dense"] == 0.0


@pytest.mark.multiprocess
def test_the_balanced_split_evens_out_the_causal_work_the_plain_split_leaves_uneven(ranks):
    cp, reports = ranks
    c = SEQ // cp
    # plain: rank r computes its own block (masked) and the r earlier ranks' blocks whole
    assert all(r[f"{split} {kernel} scores"] == r[f"{split} flash scores"] for r in reports
               for split in ("plain", "balanced") for kernel in ("math", "flash"))
    plain = [r["plain flash scores"] for r in reports]
    assert plain == [{"forward": (rank + 1) * c * c, "backward": (rank + 1) * c * c} for rank in range(cp)]
    # balanced: 2 cp chunks; every rank computes 2 cp + 1 of the chunk pairs the mask does not hide entirely
    half = SEQ // (2 * cp)
    balanced = [r["balanced flash scores"] for r in reports]
    assert balanced == [{"forward": (2 * cp + 1) * half * half, "backward": (2 * cp + 1) * half * half}] * cp
    assert max(p["forward"] for p in plain) / min(p["forward"] for p in plain) == cp
    assert sum(p["forward"] for p in balanced) < sum(p["forward"] for p in plain), "hidden chunk pairs are skipped"


@pytest.mark.multiprocess
def test_counters_saved_bytes_and_buffers_in_flight_are_the_estimates(ranks):
    cp, reports = ranks
    traffic = ring_traffic(SEQ, B, HEADS * HEAD_DIM, cp, dtype_bytes=4)
    sends = {k: traffic["forward"][k] + traffic["backward"][k] for k in ("calls", "payload_bytes")}
    memory = attention_memory(SEQ, B, HEADS * HEAD_DIM, HEADS, cp, dtype_bytes=4)
    for rank, r in enumerate(reports):
        for split in SPLITS:
            counted = r[f"{split} comm"]
            assert set(counted) == {"send", "recv"}, counted
            for op in ("send", "recv"):
                assert {k: counted[op][k] for k in sends} == sends, (cp, rank, split, op)
            assert r[f"{split} saved"] == memory["saved"], (cp, rank, split)
            assert r[f"{split} received peak"] == memory["in_flight"], (cp, rank, split)


@pytest.mark.multiprocess
def test_the_ring_passes_grouped_kv_heads_over_heads_of_the_bytes_as_the_estimate_says(ranks):
    """Grouped-query attention: K, V and their gradients' sums travel with KV_HEADS heads, not HEADS: the same
    calls, HEADS / KV_HEADS fewer bytes, each counter the estimate's with kv_hidden = KV_HEADS x HEAD_DIM; the
    bytes saved for backward and the buffers in flight likewise (K/V never repeated over the query heads)."""
    cp, reports = ranks
    traffic = ring_traffic(SEQ, B, HEADS * HEAD_DIM, cp, dtype_bytes=4, kv_hidden=KV_HEADS * HEAD_DIM)
    sends = {k: traffic["forward"][k] + traffic["backward"][k] for k in ("calls", "payload_bytes")}
    memory = attention_memory(SEQ, B, HEADS * HEAD_DIM, HEADS, cp, dtype_bytes=4, kv_hidden=KV_HEADS * HEAD_DIM)
    for rank, r in enumerate(reports):
        for split in SPLITS:
            grouped, full = r[f"gqa {split} comm"], r[f"{split} comm"]
            for op in ("send", "recv"):
                assert {k: grouped[op][k] for k in sends} == sends, (cp, rank, split, op)
                assert grouped[op]["calls"] == full[op]["calls"]
                assert grouped[op]["payload_bytes"] * HEADS == full[op]["payload_bytes"] * KV_HEADS
            assert r[f"gqa {split} saved"] == memory["saved"], (cp, rank, split)
            assert r[f"gqa {split} received peak"] == memory["in_flight"], (cp, rank, split)
            assert r[f"gqa {split} scores"] == r[f"{split} scores"], "the same blocks, the same scores"


@pytest.mark.multiprocess
def test_the_llama_attention_under_the_ring_equals_it_dense_with_rope_from_global_positions(ranks):
    """CausalSelfAttention with grouped-query attention and RoPE, its SDPA the ring: the output, the input's and
    every weight's gradient equal the dense module's when each rank rotates q and k by its chunks' global positions
    (context.positions: the balanced split's chunk r and 2 cp - 1 - r). Rotated by the local indices instead, every
    rank's keys would stand at the start of the sequence: the output is off by far more than rounding."""
    cp, reports = ranks
    traffic = ring_traffic(SEQ, B, HEADS * HEAD_DIM, cp, dtype_bytes=4, kv_hidden=KV_HEADS * HEAD_DIM)
    for rank, r in enumerate(reports):
        assert set(r["llama errors"]) == {"out", "d input", "d qkv.weight", "d proj.weight"}
        for name, err in r["llama errors"].items():
            assert err <= 1e-5, f"cp {cp} rank {rank}: {name} differs by {err:.2e} (relative)"
        assert r["llama local positions error"] > 1e-2, (cp, rank)
        assert r["llama comm"]["send"]["payload_bytes"] == sum(t["payload_bytes"] for t in traffic.values())


def test_the_ring_traffic_is_each_block_going_round_once_forward_and_twice_backward():
    t = ring_traffic(seq_len=8192, micro_batch=1, hidden=4096, cp=4, dtype_bytes=2)
    block = 1 * 2048 * 4096 * 2
    assert t["forward"] == {"calls": 6, "payload_bytes": 6 * block}   # K and V, 3 hops each
    assert t["backward"] == {"calls": 12, "payload_bytes": 6 * block + 6 * 2 * block}  # and dK, dV in fp32
    assert ring_traffic(8192, 1, 4096, cp=1) == {"forward": {"calls": 0, "payload_bytes": 0},
                                                 "backward": {"calls": 0, "payload_bytes": 0}}


def test_grouped_query_attention_shrinks_the_rings_bytes_by_heads_over_kv_heads():
    """Llama 3 8B (32 query heads on 8 key/value heads of 128): K and V are 1024 wide, not 4096, so every byte
    the ring sends is a quarter of multi-head attention's, in the same calls; what travels and is kept of K/V
    shrinks alike, the queries, output and log-sum-exp not."""
    cfg = get_preset("llama3-8b")
    assert (cfg.heads, cfg.n_kv_heads, cfg.head_dim) == (32, 8, 128)
    kv_hidden = cfg.n_kv_heads * cfg.head_dim
    grouped = ring_traffic(8192, 1, cfg.hidden, 4, kv_hidden=kv_hidden)
    full = ring_traffic(8192, 1, cfg.hidden, 4)
    block = 1 * 2048 * 1024 * 2
    assert grouped["forward"] == {"calls": 6, "payload_bytes": 6 * block}
    assert grouped["backward"] == {"calls": 12, "payload_bytes": 6 * block + 6 * 2 * block}
    for phase in ("forward", "backward"):
        assert grouped[phase]["calls"] == full[phase]["calls"]
        assert grouped[phase]["payload_bytes"] * 4 == full[phase]["payload_bytes"]
    m, mha = attention_memory(8192, 1, cfg.hidden, 32, 4, kv_hidden=kv_hidden), attention_memory(8192, 1, cfg.hidden, 32, 4)
    assert m["in_flight"] * 4 == mha["in_flight"] == 4 * 2048 * 4096 * 2
    assert mha["saved"] - m["saved"] == 2 * 2048 * (4096 - 1024) * 2  # k and v kept grouped
    assert attention_memory(8192, 1, 4096, 32, 4, kv_hidden=4096) == mha
    # a stage's and a layer's activations under CP differ by the blocks in flight only (tp 2: each rank its half)
    saved = attention_memory(8192, 1, 2048, 16, 4)["in_flight"] - attention_memory(8192, 1, 2048, 16, 4,
                                                                                    kv_hidden=512)["in_flight"]
    assert saved == 4 * 2048 * (2048 - 512) * 2
    assert stage_activation_bytes(32, 8192, 1, 4096, 32, 4, 2, "selective", kv_hidden=kv_hidden) == \
        stage_activation_bytes(32, 8192, 1, 4096, 32, 4, 2, "selective") - saved
    assert activation_bytes(8192, 1, 4096, 32, cp=4, tp=2, kv_hidden=kv_hidden) == \
        activation_bytes(8192, 1, 4096, 32, cp=4, tp=2) - saved


def test_memory_is_the_papers_six_blocks_and_the_layer_divided_by_cp():
    # Liu et al. 2023, Table 1: ring attention keeps 6 b c h per layer (16-bit: 12 b c h bytes)
    b, s, h, a = 2, 4096, 1024, 16
    m = attention_memory(s, b, h, a, cp=2, dtype_bytes=2)
    c = s // 2
    assert m["total"] - b * c * a * 4 == 6 * b * c * h * 2, "the paper's 6 b c h plus the fp32 log-sum-exp"
    assert attention_memory(s, b, h, a, cp=8)["in_flight"] == 4 * b * (s // 8) * h * 2
    assert attention_memory(s, b, h, a, cp=1)["in_flight"] == 0
    one = activation_bytes_per_layer(s, b, h, a, recompute="selective")
    assert activation_bytes(s, b, h, a, cp=4) == one // 4 + attention_memory(s, b, h, a, cp=4)["in_flight"]


def test_a_long_sequences_memory_is_a_peak_of_states_kept_activations_gather_and_working_set_or_logits():
    """long_sequence_memory, notebook 07's tables: each part from the formula it cites, each counted once, and the
    working set and the logits, never alive together, not added."""
    cfg, s, GB = get_preset("22b"), 131072, 1e9
    h, a, L, V = cfg.hidden, cfg.heads, cfg.n_layers, cfg.padded_vocab
    psi = count_params(cfg, padded=True)
    tp8 = long_sequence_memory(cfg, s, tp=8)
    assert tp8["states"] == sum(model_state_bytes(psi, "mixed", model_parallel=8).values()) == 16 * psi // 8
    assert round(tp8["states"] / GB) == 44  # 22B at 16 bytes a parameter over 8 GCDs
    assert tp8["activations"] == L * 34 * s * h // 8 and tp8["working"] == 0 and tp8["stage"] == "only"
    assert tp8["gathered"] == 2 * s * h  # sequence parallelism all-gathers a linear's input: all s positions, 16-bit
    assert tp8["logits"] == (2 + 4) * s * V // 8  # the 16-bit logits beside their fp32 copy, vocabulary over tp
    assert tp8["total"] == tp8["states"] + tp8["activations"] + tp8["gathered"] + tp8["logits"]
    full = long_sequence_memory(cfg, s, tp=8, recompute="full")  # each layer's input, and one layer recomputed
    assert full["activations"] == L * 2 * s * h // 8 and full["working"] == 34 * s * h // 8
    assert full["total"] == full["states"] + full["activations"] + full["gathered"] + max(full["working"], full["logits"])
    # without sequence parallelism (the workshop's flags) each layer's input is kept whole on every TP rank, no gather
    plain = long_sequence_memory(cfg, s, tp=8, recompute="full", sequence_parallel=False)
    assert plain["activations"] == 8 * full["activations"] and plain["gathered"] == 0
    assert plain["working"] == (10 + 24 // 8) * s * h
    assert long_sequence_memory(cfg, s, tp=1)["gathered"] == 0
    # CP: every activation, the gather and the logits over cp; the K/V blocks in flight once, as stage_activation_bytes
    cp8 = long_sequence_memory(cfg, s, tp=8, cp=8)
    in_flight = attention_memory(s, 1, h // 8, a // 8, 8)["in_flight"]
    assert cp8["activations"] == L * 34 * (s // 8) * h // 8 and cp8["working"] == in_flight
    assert cp8["activations"] + cp8["working"] == stage_activation_bytes(L, s, 1, h, a, 8, 8, "selective",
                                                                         sequence_parallel=True)
    assert cp8["logits"] == tp8["logits"] // 8 and cp8["gathered"] == tp8["gathered"] // 8
    assert cp8["states"] == tp8["states"]  # CP ranks hold the same weights
    # ZeRO-1 shards the optimizer states over dp x cp
    zero = long_sequence_memory(cfg, s, tp=8, cp=8, zero=1)
    assert zero["optimizer"] == -(-cp8["optimizer"] // 8) and zero["params"] == cp8["params"]
    assert long_sequence_memory(cfg, s, tp=8, dp=8, zero=1)["states"] == zero["states"]
    # PP under 1F1B: one micro-batch in flight, each stage L / pp layers (the last one also the logits);
    # with m >= pp the first stage holds pp micro-batches of them, L layers' worth, as without PP
    one = long_sequence_memory(cfg, s, tp=8, pp=8, microbatches=1)
    assert one["stage"] == "last" and one["activations"] * 8 == tp8["activations"] and one["logits"] == tp8["logits"]
    assert one["stages"]["first"] == one["states"] + one["activations"] + one["gathered"] + one["working"]
    assert one["stages"]["last"] == one["total"] > one["stages"]["first"]
    deep = long_sequence_memory(cfg, s, tp=8, pp=8, microbatches=8)
    assert deep["stage"] == "first" and deep["activations"] == tp8["activations"] and deep["logits"] == 0
    assert deep["states"] * 8 == pytest.approx(tp8["states"], abs=16)
    # at 1M with PP 8 and full recomputation, the last stage's peak is at the logits, not at the recomputed layer
    million = long_sequence_memory(cfg, 8 * s, tp=8, pp=8, microbatches=1, recompute="full")
    assert million["stage"] == "last" and million["logits"] > million["working"]
    assert million["total"] == million["states"] + million["activations"] + million["gathered"] + million["logits"]
    with pytest.raises(ValueError, match="ring attention stores no scores"):
        long_sequence_memory(cfg, s, tp=8, cp=8, recompute="none")


def test_stage_activations_with_sequence_parallelism_shard_what_tp_leaves_replicated():
    s, h, a = 8192, 1024, 16
    plain = stage_activation_bytes(4, s, 1, h, a, cp=2, tp=4, recompute="selective")
    sharded = stage_activation_bytes(4, s, 1, h, a, cp=2, tp=4, recompute="selective", sequence_parallel=True)
    in_flight = attention_memory(s, 1, h // 4, a // 4, 2)["in_flight"]
    assert plain - in_flight == 4 * (s // 2) * h * (10 + 24 // 4)
    assert sharded - in_flight == 4 * (s // 2) * h * 34 // 4


def test_the_block_that_hides_communication_is_the_papers_1k_for_an_a100_over_nvlink():
    # Liu et al. 2023, Sec 3: c >= F / B; their table: ~1K for A100 (312 TFLOPS) over NVLink (300 GB/s)
    assert round(min_block_for_overlap(312e12, 300e9)) == 1040


@pytest.mark.parametrize("seq_len, cp, balanced, message", [
    (10, 4, False, "the sequence length 10 does not split into 4 ranks; use a multiple of 4"),
    (12, 4, True, "the sequence length 12 does not split into 2 x cp = 8 chunks (the balanced split); "
                  "use a multiple of 8"),
    (16, 0, True, "--cp 0 must be at least 1"),
])
def test_a_split_that_does_not_fit_is_one_line(seq_len, cp, balanced, message):
    assert split_problems(seq_len, cp, balanced) == [message]
    assert split_problems(16, 4, True) == [] and split_problems(12, 4, False) == []


def test_the_split_functions_refuse_before_any_communication():
    import torch

    from labsupport.parallel.context import positions, ring_attention, shard_sequence
    with pytest.raises(ValueError, match="does not split into 2 x cp = 4 chunks"):
        shard_sequence(torch.zeros(1, 6), 0, 2)
    assert positions(16, 1, 4).tolist() == [2, 3, 12, 13]     # one chunk from the front, one from the back
    assert positions(16, 1, 4, balanced=False).tolist() == [4, 5, 6, 7]
    q = torch.zeros(1, 1, 3, 2)
    with pytest.raises(ValueError, match="sequence length 3 does not split into 2 x cp = 2 chunks"):
        ring_attention(q, q, q)
    q, k = torch.zeros(1, 4, 4, 2), torch.zeros(1, 3, 4, 2)  # 3 key/value heads cannot serve 4 query heads
    with pytest.raises(ValueError, match="a number of heads that divides the queries'"):
        ring_attention(q, k, k)
