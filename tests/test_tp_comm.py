"""Tensor parallelism's traffic: the prediction (estimate/tp_comm.py) against the papers' statements,
and against what labsupport.comm counts in a real `labsupport train --strategy tp` step."""
import json

import pytest

from conftest import run_cli
from labsupport.estimate.comm_cost import BUS_FACTOR
from labsupport.estimate.tp_comm import NORM_BYTES, layer_comm, total, tp_comm


def wire(ops: dict, tp: int) -> float:
    return sum(BUS_FACTOR[op](tp) * payload for op, (_, payload) in ops.items())


def test_a_layer_needs_two_all_reduces_forward_and_two_backward():
    """Shoeybi et al. 2019, Sec. 3 and Fig. 4: two all-reduces in the forward path and two in the
    backward path per transformer layer, each over the b x s x h activations."""
    b, s, h = 4, 2048, 12288
    layer = layer_comm(b * s, h, bytes_per_element=2)
    assert layer == {"forward": {"all_reduce": (2, 2 * b * s * h * 2)}, "backward": {"all_reduce": (2, 2 * b * s * h * 2)}}


@pytest.mark.parametrize("tp", [2, 4, 8])
def test_sequence_parallelism_trades_each_all_reduce_for_a_pair_of_the_same_volume(tp):
    """Korthikanti et al. 2022, Sec. 4.2.2: four all-gathers and four reduce-scatters instead of four
    all-reduces; a ring all-reduce is a reduce-scatter followed by an all-gather, so the bandwidth
    is the same. Backward all-gathers the two column-parallel inputs once more (stored s/T, as
    Table 2 assumes): that, and only that, is on top."""
    b, s, h = 1, 2048, 12288
    plain, sp = layer_comm(b * s, h), layer_comm(b * s, h, sequence_parallel=True)
    calls = {op: sum(sp[phase].get(op, (0, 0))[0] for phase in sp) for op in ("all_gather", "reduce_scatter")}
    assert calls == {"all_gather": 4 + 2, "reduce_scatter": 4}
    regather = {"all_gather": (2, 2 * b * s * h * 2)}
    assert wire(sp["forward"], tp) == pytest.approx(wire(plain["forward"], tp))
    assert wire(sp["backward"], tp) == pytest.approx(wire(plain["backward"], tp) + wire(regather, tp))


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_full_recomputation_runs_the_layers_forward_collectives_again(sequence_parallel):
    """Korthikanti et al. 2022, Sec. 5: full activation recomputation recomputes a layer "using an extra
    forward pass during back-propagation", its collectives included. Without SP: 2 forward + 2 recomputed
    + 2 backward = 6 all-reduces per layer and micro-batch, 3/2 of the bytes. Selective recomputation
    reruns only the attention core, inside the parallel region: nothing more is sent. Only the layers
    are recomputed: the embedding's and the loss's collectives stay as they were."""
    b, s, h = 2, 2048, 6144
    kept = layer_comm(b * s, h, sequence_parallel, recompute="none")
    full = layer_comm(b * s, h, sequence_parallel, recompute="full")
    assert list(full) == ["forward", "recompute", "backward"] and full["recompute"] == full["forward"]
    assert layer_comm(b * s, h, sequence_parallel, recompute="selective") == kept
    if not sequence_parallel:
        assert full["forward"]["all_reduce"][0] + full["recompute"]["all_reduce"][0] \
            + full["backward"]["all_reduce"][0] == 6
        assert sum(wire(ops, 4) for ops in full.values()) == pytest.approx(
            1.5 * sum(wire(ops, 4) for ops in kept.values()))
    step, again = (total(tp_comm(3, 64, 32, 2, microbatches=2, sequence_parallel=sequence_parallel, recompute=r), 2)
                   for r in ("none", "full"))
    for op, counts in again.items():
        extra = full["recompute"].get(op, (0, 0))
        # per layer and micro-batch, at tp_comm's default 4 bytes per element
        assert counts["calls"] == step[op]["calls"] + 3 * 2 * extra[0]
        assert counts["payload_bytes"] == step[op]["payload_bytes"] + 3 * 2 * 2 * 32 * 64 * 4 * extra[0]
    with pytest.raises(ValueError, match="unknown recompute"):
        layer_comm(b * s, h, recompute="yes")


def test_the_loss_never_moves_the_logits():
    """The vocab-parallel cross-entropy reduces 3 numbers per token, whatever the vocabulary."""
    step = tp_comm(n_layers=1, hidden=64, seq_len=8, micro_batch=2)
    tokens, activation = 16, 16 * 64 * 4
    forward = step["forward"]["all_reduce"]
    assert forward == {"calls": 2 + 1 + 2, "payload_bytes": 3 * activation + 3 * tokens * 4}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_llama_family_sends_the_gpt_shapes_bytes_but_for_its_norms(sequence_parallel):
    """Every collective is of a layer's input or output (b x s x h): SwiGLU's width and three matrices and
    grouped-query attention's fewer key/value heads never cross a rank boundary, so Llama 3 8B sends what a GPT
    shape of its layers, hidden size and context sends. Only sequence parallelism's "finish" differs: an RMSNorm
    has a gain and no bias, h numbers to sum per norm (two per layer and the final one), no row-parallel bias."""
    from labsupport.estimate.shapes import PRESETS
    from labsupport.estimate.tp_comm import step_cost
    cfg = PRESETS["llama3-8b"]
    llama = tp_comm(cfg.n_layers, cfg.hidden, cfg.seq_len, 1, sequence_parallel=sequence_parallel, bias=False,
                    norm="rmsnorm", bytes_per_element=2)
    gpt = tp_comm(cfg.n_layers, cfg.hidden, cfg.seq_len, 1, sequence_parallel=sequence_parallel, bytes_per_element=2)
    assert {k: v for k, v in llama.items() if k != "finish"} == {k: v for k, v in gpt.items() if k != "finish"}
    if sequence_parallel:
        h = cfg.hidden
        assert llama["finish"] == {"all_reduce": {"calls": 1, "payload_bytes": (2 * cfg.n_layers + 1) * h * 4}}
        assert gpt["finish"]["all_reduce"]["payload_bytes"] == ((2 * 2 + 2) * cfg.n_layers + 2) * h * 4
    assert step_cost("llama3-8b", 8, sequence_parallel=sequence_parallel)["total"] == total(llama, 8)
    with pytest.raises(ValueError, match=r"tp 16 must divide the model's key/value heads \(8\)"):
        step_cost("llama3-8b", 16)


# ---------------------------------------------------------------- measured: labsupport train --strategy tp --json

@pytest.mark.multiprocess
@pytest.mark.parametrize("extra, microbatches", [([], 1), (["--sequence-parallel", "--micro-batch", "4"], 2)])
def test_counted_traffic_is_the_prediction(tmp_path, extra, microbatches):
    """Every op's calls, payload and wire bytes of the last step, per rank, within the TP group."""
    res = run_cli("train", "--strategy", "tp", "--tp", 2, "--nproc", 2, "--json", "--model", "nano", "--steps", 2,
                  "--global-batch", 8, "--sample-chars", 0, "--eval-batches", 0, *extra)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.splitlines()[-1])
    m = out["model"]
    predicted = total(tp_comm(m["n_layers"], m["hidden"], m["seq_len"], 8 // microbatches, microbatches=microbatches,
                              sequence_parallel="--sequence-parallel" in extra), tp=2)
    for rank in range(2):
        assert out["comm_groups"][rank] == {"tp": predicted}, rank
        assert out["comm"][rank] == predicted


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_pipeline_stages_split_the_whole_models_traffic(sequence_parallel):
    """A first stage (embedding, no head) and a last stage (head and loss, no embedding) of L layers
    each send together what the whole 2L-layer model sends, but for the second stage's gradient norm
    (the TP traffic of notebook 06's 3D runs, stage by stage)."""
    kw = dict(microbatches=3, sequence_parallel=sequence_parallel)
    first = total(tp_comm(2, 64, 32, 2, embedding=True, head=False, **kw), 2)
    last = total(tp_comm(2, 64, 32, 2, embedding=False, head=True, **kw), 2)
    whole = total(tp_comm(4, 64, 32, 2, **kw), 2)
    for op, counts in whole.items():
        extra = NORM_BYTES if op == "all_reduce" else 0
        assert first.get(op, {}).get("payload_bytes", 0) + last[op]["payload_bytes"] == counts["payload_bytes"] + extra
    assert first["all_reduce"]["calls"] < last["all_reduce"]["calls"]     # the loss's reductions live on the last stage
