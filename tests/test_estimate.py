"""estimate/ against the published numbers it cites, and against TinyGPT itself.

Published figures are pinned as printed in the papers; where a paper rounds (174.6B, 31.4 GB),
the test rounds our exact value the same way.
"""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from labsupport.estimate.flops import (PEAK_TFLOPS, training_days, forward_flops_per_token, model_flops_per_token,
                                       peak_tflops, training_flops_per_token)
from labsupport.estimate.memory import (BYTES_PER_PARAM, activation_bytes_per_layer, activation_terms,
                                        estimate_memory, largest_model_that_fits, layer_activation_bytes,
                                        model_state_bytes, scaled_shape, tinygpt_activation_bytes)
from labsupport.estimate.offload import PCIE_GBPS, offload_pays, pcie_seconds
from labsupport.estimate.params import active_params, count_params, matmul_params, params_per_layer, rule_of_thumb
from labsupport.metrics import ActivationMeter
from labsupport.model import PRESETS, ModelConfig, TinyGPT, lm_loss

from conftest import cli, run_cli

GB = 1e9


# ---------------------------------------------------------------- params

@pytest.mark.parametrize("cfg", [
    PRESETS["nano"].with_vocab(65),
    PRESETS["micro"].with_vocab(65),
    ModelConfig("nobias", n_layers=3, hidden=48, heads=6, vocab=65, seq_len=32, bias=False),
    ModelConfig("moe", n_layers=2, hidden=64, heads=4, vocab=65, seq_len=32, experts=4),
    PRESETS["llama-micro"].with_vocab(65),
    # the options one at a time against the GPT shape: biases with GQA, LayerNorm with RoPE and SwiGLU, untied
    ModelConfig("gqa-bias", n_layers=2, hidden=48, heads=6, vocab=65, seq_len=32, kv_heads=2),
    ModelConfig("mqa-swiglu", n_layers=1, hidden=64, heads=4, vocab=65, seq_len=32, kv_heads=1, mlp="swiglu",
                positions="rope", tied=False),
    ModelConfig("rms-nobias", n_layers=1, hidden=32, heads=2, vocab=65, seq_len=16, norm="rmsnorm", bias=False),
    ModelConfig("swiglu-moe", n_layers=2, hidden=32, heads=4, vocab=65, seq_len=16, bias=False, norm="rmsnorm",
                mlp="swiglu", ffn_hidden=48, positions="rope", kv_heads=2, tied=False, experts=4, top_k=2),
], ids=lambda c: c.name)
def test_count_params_is_exact_for_tinygpt(cfg):
    model = TinyGPT(cfg)
    padding = (128 - 65) * cfg.hidden * (1 if cfg.tied else 2)  # the embedding's padding rows, and an untied head's
    assert count_params(cfg, padded=True) == sum(p.numel() for p in model.parameters())
    assert count_params(cfg) == model.num_params() == count_params(cfg, padded=True) - padding
    block = sum(p.numel() for p in model.blocks["0"].parameters())
    assert params_per_layer(cfg) == block
    if cfg.experts:  # a token uses the router and top_k experts of each layer
        expert = sum(p.numel() for p in model.blocks["0"].mlp.experts["0"].parameters())
        assert active_params(cfg) == count_params(cfg) - cfg.n_layers * (cfg.experts - cfg.top_k) * expert
    else:
        assert active_params(cfg) == count_params(cfg)


def test_llama_family_published_sizes():
    """The released checkpoints' counts, from the shapes of their config.json (shapes.py): Mistral 7B exactly
    7,241,732,096 (the sum of its safetensors); Mixtral 8x7B 46.7B, 12.9B active (Mistral AI's release); Llama 3
    8B, 70B and Llama 3.1 405B 8.03B, 70.6B, 405.9B (their model cards print 8B, 70B, 405B). Vocabularies as
    published (128,256 and 32,000 are multiples of 64: padding changes nothing)."""
    assert count_params(PRESETS["mistral-7b"]) == 7_241_732_096
    # per layer: q and out 4096^2 each, k and v 4096 x 1024 each, SwiGLU 3 x 4096 x 14336, two RMSNorm gains
    assert params_per_layer(PRESETS["mistral-7b"]) == 2 * 4096**2 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
    mixtral = PRESETS["mixtral-8x7b"]
    assert (count_params(mixtral), active_params(mixtral)) == (46_702_792_704, 12_879_925_248)
    assert (round(count_params(mixtral) / 1e9, 1), round(active_params(mixtral) / 1e9, 1)) == (46.7, 12.9)
    assert round(count_params(PRESETS["llama3-8b"]) / 1e9, 2) == 8.03
    assert round(count_params(PRESETS["llama3-70b"]) / 1e9, 1) == 70.6
    assert round(count_params(PRESETS["llama3-405b"]) / 1e9, 1) == 405.9
    for name in ("llama3-8b", "llama3-70b", "llama3-405b", "mistral-7b", "mixtral-8x7b"):
        assert count_params(PRESETS[name], padded=True) == count_params(PRESETS[name])


def test_gpt2_published_sizes():
    # GPT-2 small with its tied head: 124,439,808 (the count of the released checkpoint).
    assert count_params(PRESETS["gpt2"]) == 124_439_808
    # GPT-2 XL: Radford et al. 2019, Table 2, print 1542M; the released checkpoint has 1,557,611,200.
    assert count_params(PRESETS["gpt2-xl"]) == 1_557_611_200


@pytest.mark.parametrize("layers, hidden, billions", [(40, 6144, 18.4), (80, 12288, 145.6), (128, 25600, 1008.0)])
def test_megatron_table1_sizes(layers, hidden, billions):
    """Narayanan et al. 2021, Table 1 (vocabulary padded to 51,200, sequence 2048)."""
    cfg = ModelConfig("m", layers, hidden, heads=hidden // 128, vocab=51200, seq_len=2048)
    assert round(count_params(cfg) / 1e9, 1) == billions


def test_large_presets():
    # GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d_model 12288): 174.6B counted exactly.
    assert round(count_params(PRESETS["175b"]) / 1e9, 1) == 174.6
    assert count_params(PRESETS["22b"]) == pytest.approx(22e9, rel=0.01)
    assert count_params(PRESETS["1t"]) == pytest.approx(1e12, rel=0.01)


def test_rule_of_thumb_is_12_L_d2():
    # One layer is 12 d^2 (attention 4 d^2 + MLP 8 d^2), not the deck's 11 d^2.
    assert rule_of_thumb(PRESETS["175b"]) == 96 * 12 * 12288**2 == 173_946_175_488
    for name in ("22b", "175b", "1t"):
        cfg = PRESETS[name]
        assert params_per_layer(cfg) == pytest.approx(12 * cfg.hidden**2, rel=1e-3)
        assert rule_of_thumb(cfg) == pytest.approx(count_params(cfg), rel=0.02)


# ---------------------------------------------------------------- flops

def test_palm_540b_mfu():
    """PaLM, Chowdhery et al. 2022, App. B: 540B at 238.3K tokens/s on 6144 TPU v4 is 46.2% MFU."""
    # Table 1: 118 layers, 48 heads of dimension 256, sequence 2048; 540.35B parameters.
    per_token = model_flops_per_token(540.35e9, n_layers=118, heads=48, head_dim=256, seq_len=2048)
    tpu_v4_peak = 275e12
    assert round(238.3e3 * per_token / (6144 * tpu_v4_peak), 3) == 0.462


def test_gpt3_training_compute():
    """GPT-3, Brown et al. 2020, Table D.1: 175B on 300B tokens is 3.14e23 FLOPs, counted as 6ND
    without attention (their App. D: the attention share is under 10%)."""
    cfg = PRESETS["175b"]
    tokens = 300e9
    assert round(6 * count_params(cfg, position_embeddings=False) * tokens / 1e23, 2) == 3.14
    with_attention = training_flops_per_token(cfg) * tokens
    assert 1.0 < with_attention / 3.14e23 < 1.1


@pytest.mark.parametrize("n_params, tokens, gpus, tflops, days", [(175e9, 300e9, 1024, 140, 34), (1008e9, 450e9, 3072, 163, 84)])
def test_training_days_narayanan_2021(n_params, tokens, gpus, tflops, days):
    """Narayanan et al. 2021, Sec 5.1: 8TP/(nX) gives 34 days for GPT-3 and 84 days for 1T.
    Their X is achieved throughput per GPU, so peak x MFU = X with MFU 1."""
    assert round(training_days(n_params, tokens, gpus, tflops * 1e12, 1.0, flops_per_param_token=8)) == days


def test_llama_family_flops_count_what_a_token_multiplies_by():
    """6N + 12 L s d with N the parameters in a token's matmuls: Mistral 7B's untied input embedding is a
    lookup (left out), its head is a matmul (in); Mixtral's N has 2 of 8 experts a layer. GQA does not shrink
    the attention term (every query head scores every key). A causal kernel computes 6 L d (s + 1): the
    query at position i against i + 1 keys, about half the convention's 12 L s d (PaLM, App. B)."""
    mistral, mixtral = PRESETS["mistral-7b"], PRESETS["mixtral-8x7b"]
    n = 7_241_732_096 - 32000 * 4096
    assert matmul_params(mistral) == n
    assert training_flops_per_token(mistral) == 6 * n + 12 * 32 * 8192 * 4096
    assert training_flops_per_token(mistral, causal=True) == 6 * n + 6 * 32 * 4096 * 8193
    assert forward_flops_per_token(mistral, causal=True) == 2 * n + 2 * 32 * 4096 * 8193
    assert training_flops_per_token(mixtral) == 6 * (12_879_925_248 - 32000 * 4096) + 12 * 32 * 32768 * 4096
    # the causal count is what a causal kernel sums: position i scores i + 1 keys, 4 d FLOPs each, x 3
    s, d, layers = 8, 16, 2
    small = ModelConfig("s", layers, d, 4, 64, s, bias=False, norm="rmsnorm", mlp="swiglu", positions="rope",
                        kv_heads=2, tied=False)
    kernel = 3 * layers * sum(4 * d * (i + 1) for i in range(s)) / s
    assert training_flops_per_token(small, causal=True) - 6 * matmul_params(small) == kernel
    # the GPT shape's N is unchanged: the tied embedding counts once, the position table not at all
    assert matmul_params(PRESETS["gpt2"]) == count_params(PRESETS["gpt2"], position_embeddings=False)


def test_nanogpt_convention_for_gpt2():
    """N leaves out the position table only, as nanoGPT's get_num_params() (123.65M for GPT-2)."""
    cfg = PRESETS["gpt2"]
    n = 124_439_808 - 1024 * 768
    assert round(n / 1e6, 2) == 123.65
    assert training_flops_per_token(cfg) == 6 * n + 12 * 12 * 1024 * 768
    assert forward_flops_per_token(cfg) == 2 * n + 4 * 12 * 1024 * 768


def test_peak_lookup_prefers_specific_names():
    assert peak_tflops("NVIDIA H200") == (67.0, 989.0)
    assert peak_tflops("NVIDIA H100 80GB HBM3") == (67.0, 989.0)
    assert peak_tflops("NVIDIA H100 PCIe") == (51.0, 756.0)
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == (19.5, 312.0)
    assert peak_tflops("NVIDIA A10") == (31.2, 125.0)
    assert peak_tflops("AMD Instinct MI250X") == (47.9, 191.5)
    assert peak_tflops("Intel(R) Xeon(R)") is None
    # Every key must be reachable: no earlier key may be a substring of a later one.
    keys = list(PEAK_TFLOPS)
    for i, later in enumerate(keys):
        assert not [k for k in keys[:i] if k.lower() in later.lower()], later


# ---------------------------------------------------------------- memory: model states

def test_bytes_per_param_is_16_for_adam():
    """ZeRO, Rajbhandari et al. 2020, Sec 3.1: mixed-precision Adam is 2 + 2 + K with K = 12."""
    assert BYTES_PER_PARAM["mixed"] == dict(params=2, grads=2, optimizer=12)
    assert sum(BYTES_PER_PARAM["mixed"].values()) == sum(BYTES_PER_PARAM["fp32"].values()) == 16


@pytest.mark.parametrize("recipe, total, unsharded, sharded", [
    ("megatron-fp16", 20, 4, 16), ("megatron-bf16", 18, 6, 12), ("fp32", 16, 8, 8)])
def test_megatron_bytes_per_param_table(recipe, total, unsharded, sharded):
    """Megatron-LM README, "Distributed optimizer": 20, 18 and 16 bytes per parameter, and
    4 + 16/d, 6 + 12/d, 8 + 8/d when the optimizer is sharded over d data-parallel ranks (ZeRO-1)."""
    assert sum(BYTES_PER_PARAM[recipe].values()) == total
    d, n = 8, 1000
    states = model_state_bytes(n, recipe, dp=d, zero=1)
    assert states["params"] + states["grads"] == unsharded * n and states["optimizer"] == sharded * n // d


@pytest.mark.parametrize("zero, published_gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_figure1(zero, published_gb):
    """ZeRO Figure 1: Psi = 7.5B parameters, N_d = 64, K = 12, bytes per device in GB."""
    states = model_state_bytes(7_500_000_000, "mixed", dp=64, zero=zero)
    assert round(sum(states.values()) / GB, 1) == published_gb


def test_zero_figure1_exact():
    # P_os: 2 Psi + 2 Psi + K Psi / N_d = 30 GB + 90/64 GB, exactly.
    assert sum(model_state_bytes(7_500_000_000, dp=64, zero=1).values()) == 31_406_250_000


# ZeRO Sec 5.1 / Figure 1 per category, bytes per device: Psi = 7.5e9, N_d = 64, 2 + 2 + K bytes, K = 12.
# Stage 1 (P_os): 2 Psi + 2 Psi + K Psi / N_d; stage 2 (P_os+g): 2 Psi + (2 + K) Psi / N_d;
# stage 3 (P_os+g+p): (2 + 2 + K) Psi / N_d. Written out, so that a category sharded at the
# wrong stage fails here even when the total is right: 2 Psi = 15e9, 2 Psi / 64 = 234,375,000,
# 12 Psi = 90e9, 12 Psi / 64 = 1,406,250,000.
ZERO_FIGURE1_BYTES = {
    0: dict(params=15_000_000_000, grads=15_000_000_000, optimizer=90_000_000_000),
    1: dict(params=15_000_000_000, grads=15_000_000_000, optimizer=1_406_250_000),
    2: dict(params=15_000_000_000, grads=234_375_000, optimizer=1_406_250_000),
    3: dict(params=234_375_000, grads=234_375_000, optimizer=1_406_250_000),
}


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_figure1_per_category(zero):
    expected = ZERO_FIGURE1_BYTES[zero]
    assert model_state_bytes(7_500_000_000, "mixed", dp=64, zero=zero) == expected
    est = estimate_memory(n_params=7.5e9, precision="mixed", dp=64, zero=zero)
    assert {k: est[k] for k in expected} == expected
    assert est["total"] == sum(expected.values())


def test_workshop_model_states_and_the_decks_20x():
    """Model states of the workshop models; the deck's "20x" row disagrees with its own items."""
    assert sum(model_state_bytes(22_000_000_000).values()) == 352 * GB
    assert sum(model_state_bytes(175_000_000_000).values()) == 2_800 * GB
    assert sum(model_state_bytes(1_000_000_000_000).values()) == 16_000 * GB
    deck_items = dict(weights=6, gradients=4, optimizer=8)  # fp16 + fp32 master, fp32 grads, m and v
    deck_total = 20
    assert sum(deck_items.values()) == 18 != deck_total
    assert 22e9 * deck_total == 440 * GB and 22e9 * sum(deck_items.values()) == 396 * GB


@pytest.mark.parametrize("recipe, total", [("fp32", 16), ("mixed", 16), ("megatron-bf16", 18), ("megatron-fp16", 20)])
def test_cli_memory_names_each_recipe(recipe, total):
    """`labsupport memory --precision RECIPE`: 16 bytes a parameter (fp32, DeepSpeed mixed),
    18 (Megatron-LM bf16), 20 (Megatron-LM fp16)."""
    res = run_cli("memory", "--params", "1e9", "--precision", recipe, "--json")
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout.splitlines()[-1])
    assert est["params"] + est["grads"] + est["optimizer"] == est["total"] == total * 10**9
    assert f"({recipe} recipe)" in res.stderr
    assert recipe in run_cli("memory", "--help").stdout


# ---------------------------------------------------------------- memory: ZeRO-Offload

PSI = 7_500_000_000


def test_zero_offload_one_gpu_table1_and_sec3():
    """Ren et al. 2021 (ZeRO-Offload), one GPU: only the 16-bit weights stay, 2 Psi of 16 Psi,
    "8x" (Table 1); 2 Psi of gradients out and 2 Psi of weights back per step, 4 Psi, the least
    traffic of any offload that keeps forward and backward on the GPU (Sec 3.3)."""
    plain = estimate_memory(n_params=PSI, zero=2)
    est = estimate_memory(n_params=PSI, zero=2, offload=True)
    assert (est["params"], est["grads"], est["optimizer"]) == (2 * PSI, 0, 0)
    assert plain["total"] / est["total"] == 8
    assert (est["pcie_to_host"], est["pcie_to_device"], est["pcie"]) == (2 * PSI, 2 * PSI, 4 * PSI)
    assert est["host"] == 14 * PSI  # fp32 master, momentum, variance (K = 12) and the fp16 gradients


@pytest.mark.parametrize("n", [2, 8, 64])
def test_zero_offload_divides_over_data_parallel_ranks(n):
    """Sec 4.2: on top of ZeRO-2 each rank offloads its 1/N_d partition, so its PCIe traffic is
    4 Psi / N_d and the host memory of all ranks together stays what one GPU needed."""
    est = estimate_memory(n_params=PSI, dp=n, zero=2, offload=True)
    assert est["pcie"] == 4 * PSI // n and est["host"] * n == 14 * PSI
    assert est["params"] == 2 * PSI and est["grads"] == 0  # ZeRO-2 keeps the weights whole


@pytest.mark.parametrize("recipe, device, host, to_host, to_device", [
    ("fp32", 4, 16, 4, 4),            # the weights are their own master: the host keeps a copy (4) + m, v + grads
    ("mixed", 2, 14, 2, 2),           # master + m + v (12) + fp16 grads
    ("megatron-bf16", 2, 16, 4, 2),   # master + m + v (12) + fp32 grads
    ("megatron-fp16", 2, 18, 2, 2),   # master + m + v + fp32 grads' copy (16) + fp16 grads
])
def test_offload_moves_these_bytes_per_recipe(recipe, device, host, to_host, to_device):
    est = estimate_memory(n_params=1000, precision=recipe, zero=2, offload=True)
    assert (est["total"], est["host"], est["pcie_to_host"], est["pcie_to_device"]) == (
        1000 * device, 1000 * host, 1000 * to_host, 1000 * to_device)


def test_offload_by_zero_stage():
    """Gradients stay on the device while the stage does not shard them (ZeRO-0, 1); ZeRO-3 also
    divides the weights; ZeRO-0 shards nothing, so every rank offloads and moves everything."""
    states = {z: model_state_bytes(PSI, dp=64, zero=z, offload=True) for z in range(4)}
    assert [(s["params"], s["grads"], s["optimizer"]) for s in states.values()] == [
        (2 * PSI, 2 * PSI, 0), (2 * PSI, 2 * PSI, 0), (2 * PSI, 0, 0), (2 * PSI // 64, 0, 0)]
    assert states[0]["host"] == 14 * PSI and states[0]["pcie_to_host"] + states[0]["pcie_to_device"] == 4 * PSI
    assert {s["host"] for z, s in states.items() if z} == {14 * PSI // 64}


def test_pcie_time_and_when_offload_pays():
    """Sec 4.1 / 5.2: the transfer is hidden when it takes no longer than the step's compute.
    7.5B parameters: 30 GB per step, 0.952 s over PCIe 4.0 x16 (31.5 GB/s). On an A100 (312 TFLOP/s
    bf16 at 40%) one 2048-token sequence of 6 Psi FLOPs per token takes 0.738 s: not hidden;
    accumulate 2 sequences per step and it is (1.48 s)."""
    assert PCIE_GBPS["gen4"] == 31.5 and PCIE_GBPS["gen3"] * 2 == PCIE_GBPS["gen4"]
    traffic = estimate_memory(n_params=PSI, zero=2, offload=True)["pcie"]
    assert round(pcie_seconds(traffic), 3) == 0.952
    one = offload_pays(traffic, 6 * PSI * 2048, 312e12, mfu=0.4)
    assert round(one["compute_s"], 3) == 0.738 and not one["hidden"]
    assert round(one["break_even_tokens_factor"], 2) == 1.29
    assert offload_pays(traffic, 2 * 6 * PSI * 2048, 312e12, mfu=0.4)["hidden"]
    with pytest.raises(ValueError, match="> 0 GB/s"):
        pcie_seconds(1, 0)


def test_offload_fits_13b_on_one_32gb_gpu():
    """Ren et al. 2021, abstract: "over 13 billion parameters on a single GPU" (a 32 GB V100, with
    activation checkpointing), about 10x what PyTorch fits (1.4B; we count no allocator buffers)."""
    options = dict(micro_batch=1, zero=2, recompute="full")
    offloaded = largest_model_that_fits(32e9, PRESETS["22b"], offload=True, **options)
    plain = largest_model_that_fits(32e9, PRESETS["22b"], **options)
    assert offloaded["n_params"] > 13e9 and plain["n_params"] < 2e9


def test_largest_model_that_fits_is_the_edge_of_its_family():
    options = dict(precision="mixed", dp=8, tp=2, pp=4, zero=1, recompute="selective")
    best = largest_model_that_fits(80e9, PRESETS["22b"], **options)
    k = best["shape"].n_layers
    assert k % 4 == 0 and best["total"] <= 80e9  # k a multiple of lcm(tp, pp)
    assert estimate_memory(scaled_shape(PRESETS["22b"], k + 4), **options)["total"] > 80e9
    assert scaled_shape(PRESETS["22b"], 48) == replace(PRESETS["22b"], name="48 x 6144")  # the 22B preset's shape
    # no shape: model states only, 16 bytes a parameter on one device -> 5B in 80 GB
    assert largest_model_that_fits(80e9)["n_params"] == 5_000_000_000
    assert largest_model_that_fits(1.0, PRESETS["22b"]) is None


def test_the_llama_family_scales_with_its_group_size_and_mlp_ratio():
    """A Llama base keeps 4 query heads a key/value head and an MLP 3.5 x hidden as it scales (it used to keep
    Llama 3 8B's 8 key/value heads and 14,336 units, which no shape of 1 head could take: the memory widget
    failed on every Llama preset); Llama 3 8B is the family's 32nd shape."""
    base = PRESETS["llama3-8b"]
    assert replace(scaled_shape(base, 32), name="llama3-8b") == base
    assert (scaled_shape(base, 4).kv_heads, scaled_shape(base, 4).ffn_hidden) == (1, 1792)
    options = dict(precision="mixed", dp=8, tp=8, pp=4, zero=1, recompute="selective")
    best = largest_model_that_fits(80e9, base, **options)
    k = best["shape"].n_layers
    assert k % 32 == 0 and best["total"] <= 80e9  # lcm(tp x 4, pp): tp splits whole key/value heads
    assert estimate_memory(scaled_shape(base, k + 32), **options)["total"] > 80e9


def test_cli_memory_offload():
    res = run_cli("memory", "--params", "7.5e9", "--dp", "8", "--zero", "2", "--offload", "--pcie-gbps", "15.75",
                  "--json")
    assert res.returncode == 0, res.stderr
    est = json.loads(res.stdout.splitlines()[-1])
    assert (est["total"], est["host"], est["pcie"]) == (2 * PSI, 14 * PSI // 8, 4 * PSI // 8)
    assert est["pcie_gbps"] == 15.75 and est["pcie_s"] == pytest.approx(3.75e9 / 15.75e9)
    assert "host memory 13.12 GB" in res.stderr and "3.75 GB, 0.238 s at 15.75 GB/s" in res.stderr


@pytest.mark.parametrize("flags, message", [
    (["--pcie-gbps", "16"], "--pcie-gbps is the host link of --offload"),
    (["--offload", "--pcie-gbps", "0"], "PCIe bandwidth must be > 0 GB/s"),
])
def test_cli_memory_bad_offload_is_one_line(flags, message):
    res = run_cli("memory", "--params", "7.5e9", *flags)
    assert res.returncode == 2 and res.stdout == ""
    assert message in res.stderr and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


@pytest.mark.parametrize("flags, message", [
    (["--params", "-5"], "--params must be a positive parameter count"),   # was: negative bytes
    (["--params", "0"], "--params must be a positive parameter count"),
    (["--params", "7.5e9", "--seq-len", "4096"], "--seq-len would be ignored"),
    (["--params", "7.5e9", "--model", "gpt2"], "--model would be ignored"),
    (["--model", "gpt2", "--layers", "3"], "--layers would be ignored"),
    (["--model", "mistral-7b", "--kv-heads", "4", "--untied"], "--kv-heads --untied would be ignored"),
    (["--params", "7.5e9", "--mlp", "swiglu"], "--mlp would be ignored"),
    ([*"--layers 2 --hidden 64 --heads 4 --vocab 64 --seq-len 32 --kv-heads 3".split()],
     "kv_heads (3) must divide heads (4)"),
    ([*"--layers 2 --hidden 36 --heads 4 --vocab 64 --seq-len 32 --positions rope".split()],
     "the head dimension hidden / heads (36 / 4 = 9) must be even"),
    ([*"--layers 2 --hidden 64 --heads 4 --vocab 64 --seq-len 32 --norm batchnorm".split()],
     "argument --norm: invalid choice"),
])
def test_cli_memory_refuses_what_it_would_get_wrong_or_ignore(flags, message):
    res = cli("memory", *flags)
    assert res.returncode == 2 and res.stdout == ""
    assert message in res.stderr and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


def test_cli_memory_counts_the_llama_family():
    """`memory --model mistral-7b` prints the released checkpoint's 7,241,732,096 parameters, the custom shape
    with the family's switches the same; Mixtral prints its total and active counts (46.7B, 12.9B)."""
    mistral = cli("memory", "--model", "mistral-7b")
    assert mistral.returncode == 0 and mistral.stdout.startswith("7,241,732,096 parameters (mixed recipe)")
    custom = cli("memory", *"--layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq-len 8192 --kv-heads 8 "
                 "--ffn-hidden 14336 --norm rmsnorm --mlp swiglu --positions rope --untied --no-bias --json".split())
    assert json.loads(custom.stdout.splitlines()[-1]) == estimate_memory(PRESETS["mistral-7b"])
    mixtral = cli("memory", "--model", "mixtral-8x7b", "--json")
    assert mixtral.stderr.startswith("46,702,792,704 parameters = 46.7B, 12,879,925,248 = 12.9B active per token "
                                     "(2 of 8 experts a layer)")
    est = json.loads(mixtral.stdout.splitlines()[-1])
    assert (est["n_params"], est["active_params"]) == (46_702_792_704, 12_879_925_248)
    assert "not in them" not in mistral.stdout + mistral.stderr  # the activations are the family's own now


def test_cli_memory_trains_a_preset_at_its_seq_len():
    """`memory --model PRESET --seq-len N`, as `plan` reads it: the preset at context length N (was: N ignored)."""
    base, longer = (json.loads(cli("memory", "--model", "gpt2", *flags, "--json").stdout.splitlines()[-1])
                    for flags in ([], ["--seq-len", "4096"]))
    assert longer == estimate_memory(replace(PRESETS["gpt2"], seq_len=4096), micro_batch=1)
    assert longer["activations"] > 3 * base["activations"]


# ---------------------------------------------------------------- memory: activations

def test_korthikanti_22b_layer():
    """Korthikanti et al. 2022, Table 3's 22B: a = 64, h = 6144, s = 2048, t = 8; b = 1 here.

    Sec 4.2.1, tensor parallel: s b h (10 + 24/t + 5 a s / (h t))
      = 2048 * 6144 * (10 + 3 + 40/3) = 125,829,120 + 37,748,736 + 167,772,160 bytes.
    """
    shape = dict(seq_len=2048, micro_batch=1, hidden=6144, heads=64)
    sbh = 2048 * 6144
    assert activation_bytes_per_layer(**shape) == sbh * 34 + 5 * 64 * 2048**2  # Sec 4.1
    assert activation_bytes_per_layer(**shape, tp=8) == 331_350_016
    assert activation_bytes_per_layer(**shape, tp=8, sequence_parallel=True) == (34 * sbh + 5 * 64 * 2048**2) // 8
    assert activation_bytes_per_layer(**shape, tp=8, recompute="selective") == sbh * 13
    assert activation_bytes_per_layer(**shape, tp=8, sequence_parallel=True, recompute="selective") == 34 * sbh // 8
    assert activation_bytes_per_layer(**shape, tp=8, recompute="full") == 2 * sbh


def test_korthikanti_5x_for_1t():
    """The abstract's "5x less activation memory": sequence parallel + selective recompute vs
    tensor parallel alone, for Table 3's 1T (a = 160, h = 25600, s = 2048, t = 8): 21 / 4.25."""
    shape = dict(seq_len=2048, micro_batch=1, hidden=25600, heads=160, tp=8)
    baseline = activation_bytes_per_layer(**shape)
    both = activation_bytes_per_layer(**shape, sequence_parallel=True, recompute="selective")
    assert round(baseline / both, 1) == 4.9


def test_the_llama_familys_terms_by_hand():
    """No published figure gives a Llama model's activations per layer (Korthikanti et al. 2022 size GPT
    shapes only), so the rederived terms (`activation_terms`) are held to a hand computation, 16-bit bytes,
    for Llama 3 8B's layer (h 4096, a 32, g 8, f 14336, no dropout) at s 8192, b 1; sbh = 33,554,432:
      norms 4sbh            134,217,728      q 2sbh               67,108,864
      qkv_input 2sbh         67,108,864      kv 4sb g e = sbh     33,554,432   (g e = 1024 = h / 4)
      mlp_input 2sbh         67,108,864      proj_input 2sbh      67,108,864
      dropout                         0      mlp_inner 6sbf      704,643,072   (= 21 sbh)
      scores 2as^2b       4,294,967,296
    Without the scores (a flash kernel, or selective recomputation) 12 + 1 + 21 = 34 sbh =
    1,140,850,688. TP 8: the 8 sbh of norms and linear inputs replicated, (2 + 1 + 2 + 21) sbh / 8
    split: 268,435,456 + 109,051,904 = 377,487,360; with SP all over 8: 142,606,336. GQA's K and V are a
    quarter of MHA's 4 sbh, and dropping dropout removes 2 sbh and 3as^2b: the GPT-shape formula on
    the same h and a would say 34 sbh + 5as^2b = 11,878,268,928."""
    cfg, sbh = PRESETS["llama3-8b"], 8192 * 4096
    terms = activation_terms(8192, 1, 4096, 32, kv_heads=8, ffn=14336, mlp="swiglu", dropout=False)
    assert terms == {"norms": 134_217_728, "qkv_input": 67_108_864, "mlp_input": 67_108_864, "dropout": 0,
                     "q": 67_108_864, "kv": 33_554_432, "proj_input": 67_108_864, "mlp_inner": 704_643_072,
                     "scores": 4_294_967_296}
    assert layer_activation_bytes(cfg) == 34 * sbh + 4_294_967_296
    assert layer_activation_bytes(cfg, recompute="selective") == 34 * sbh == 1_140_850_688
    assert layer_activation_bytes(cfg, tp=8, recompute="selective") == 377_487_360
    assert layer_activation_bytes(cfg, tp=8, sequence_parallel=True, recompute="selective") == 142_606_336
    assert layer_activation_bytes(cfg, tp=8, sequence_parallel=True, recompute="full") == 2 * sbh // 8
    assert activation_bytes_per_layer(8192, 1, 4096, 32) == 11_878_268_928
    # the GPT shape's terms are the paper's: 34 sbh + 5 a s^2 b (Sec 4.1), replicated 10 sbh under TP
    gpt = activation_terms(2048, 1, 6144, 64)
    assert sum(gpt.values()) == 34 * 2048 * 6144 + 5 * 64 * 2048**2
    assert sum(gpt[k] for k in ("norms", "qkv_input", "mlp_input", "dropout")) == 10 * 2048 * 6144
    # estimate_memory takes the shape's own layer: 32 of them, 16-bit under the mixed recipe
    est = estimate_memory(cfg, recompute="selective")
    assert est["activations"] == 32 * 1_140_850_688
    with pytest.raises(ValueError, match=r"tp 16 must divide the model's key/value heads \(8\)"):
        estimate_memory(PRESETS["llama3-405b"], tp=16)


def test_estimate_memory_combines_the_parts():
    cfg = PRESETS["175b"]
    est = estimate_memory(cfg, micro_batch=1, dp=8, tp=8, pp=8, zero=1, sequence_parallel=True,
                          recompute="selective")
    n = count_params(cfg)
    assert est["n_params"] == n
    psi = -(-count_params(cfg, padded=True) // 64)  # memory holds the vocabulary padding too
    assert (est["params"], est["grads"], est["optimizer"]) == (2 * psi, 2 * psi, -(-12 * psi // 8))
    sbh = 2048 * 12288
    assert est["activations"] == 96 * 34 * sbh // 8  # first stage: pp micro-batches x L/pp layers
    assert est["total"] == sum(est[k] for k in ("params", "grads", "optimizer", "activations"))
    assert all(isinstance(v, int) for v in est.values())
    fp32 = estimate_memory(cfg, precision="fp32", dp=8, tp=8, pp=8, zero=1, sequence_parallel=True,
                           recompute="selective")
    assert fp32["activations"] == 2 * est["activations"]


def test_estimate_memory_from_a_parameter_count():
    est = estimate_memory(n_params=7.5e9, dp=64, zero=3)
    assert est["activations"] == 0 and round(est["total"] / GB, 1) == 1.9
    custom = estimate_memory(n_params=1000, bytes_override=dict(params=2, grads=4, optimizer=12))
    assert (custom["params"], custom["grads"], custom["optimizer"]) == (2000, 4000, 12000)


def test_a_stage_count_that_does_not_divide_the_layers_is_counted_at_its_fullest_stage():
    """70 layers on 12 stages (BLOOM-176B's split): the fullest stage holds 6 layers, so a device holds 6/70 of
    the model's states over tp and, under 1F1B, 12 micro-batches through 6 layers: 72 layers' activations."""
    from labsupport.estimate.memory import stage_layers
    assert (stage_layers(70, 12), stage_layers(96, 8), stage_layers(5, 5)) == (6, 12, 1)
    cfg = replace(PRESETS["gpt2"], n_layers=70)
    whole, split = estimate_memory(cfg, tp=4), estimate_memory(cfg, tp=4, pp=12)
    assert split["params"] == -(-count_params(cfg, padded=True) * 72 // 70 // 48) * 2
    assert split["activations"] * 70 == whole["activations"] * 72


@pytest.mark.parametrize("kwargs, message", [
    (dict(zero=4), "zero must be"),
    (dict(precision="fp8"), "unknown precision"),
    (dict(tp=5), "heads"),
    (dict(pp=13), "between 1 and the 12 layers"),
    (dict(recompute="some"), "unknown recompute"),
    (dict(dp=0), ">= 1"),
    (dict(bytes_override=dict(params=2)), "missing grads and optimizer"),
    (dict(bytes_override=dict(params=2, grads=2, optimizer=2.5)), "whole numbers >= 0, got optimizer=2.5"),
    (dict(bytes_override=dict(params=-2, grads=2, optimizer=12)), "whole numbers >= 0, got params=-2"),
])
def test_estimate_memory_rejects_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message) as err:
        estimate_memory(PRESETS["gpt2"], **kwargs)
    assert "\n" not in str(err.value)


def test_bytes_per_param_accepts_whole_floats():
    """2.0 is what a command line or a slider hands over; it means 2 bytes, and counts stay integers."""
    est = estimate_memory(n_params=1000, bytes_override=dict(params=2.0, grads=2, optimizer=12.0))
    assert (est["params"], est["grads"], est["optimizer"]) == (2000, 2000, 12000)
    assert all(type(v) is int for v in est.values())


def test_cli_memory_with_bytes_per_param():
    """ZeRO's Figure 1 at stage 2 from the command line, bytes given explicitly ("12.0" too)."""
    res = run_cli("memory", "--params", "7.5e9", "--param-bytes", "2", "--grad-bytes", "2",
                  "--optimizer-bytes", "12.0", "--dp", "64", "--zero", "2", "--json")
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.splitlines()[-1]) == {
        "n_params": 7_500_000_000, "params": 15_000_000_000, "grads": 234_375_000,
        "optimizer": 1_406_250_000, "activations": 0, "total": 16_640_625_000}


@pytest.mark.parametrize("flags, message", [
    (["--param-bytes", "2", "--grad-bytes", "2"], "missing --optimizer-bytes"),
    (["--grad-bytes", "2"], "missing --param-bytes and --optimizer-bytes"),
    (["--param-bytes", "2", "--grad-bytes", "2", "--optimizer-bytes", "2.5"], "whole numbers >= 0"),
])
def test_cli_memory_bad_bytes_per_param_is_one_line(flags, message):
    res = run_cli("memory", "--params", "7.5e9", *flags, "--json")
    assert res.returncode == 2 and res.stdout == ""
    assert message in res.stderr and res.stderr.count("\n") == 1 and "Traceback" not in res.stderr


@pytest.mark.parametrize("cfg, micro_batch, dtype", [
    (ModelConfig("a", n_layers=1, hidden=32, heads=2, vocab=65, seq_len=16), 1, torch.float32),
    (ModelConfig("b", n_layers=2, hidden=64, heads=4, vocab=65, seq_len=32), 3, torch.float32),
    (ModelConfig("c", n_layers=3, hidden=48, heads=8, vocab=97, seq_len=24, bias=False), 2, torch.float32),
    (ModelConfig("d", n_layers=2, hidden=64, heads=4, vocab=65, seq_len=32), 2, torch.bfloat16),
    # the Llama family: llama-micro at two micro-batches and in bf16 (RMSNorm keeps fp32 rows whatever the dtype)
    (PRESETS["llama-micro"].with_vocab(65), 1, torch.float32),
    (PRESETS["llama-micro"].with_vocab(65), 2, torch.float32),
    (PRESETS["llama-micro"].with_vocab(65), 2, torch.bfloat16),
    # the ways q is or is not made anew: grouped without RoPE (a copy), multi-query (a view)
    (ModelConfig("g", n_layers=1, hidden=64, heads=4, vocab=65, seq_len=16, kv_heads=2, norm="rmsnorm"), 2,
     torch.float32),
    (ModelConfig("m", n_layers=1, hidden=64, heads=4, vocab=65, seq_len=16, kv_heads=1, mlp="swiglu", bias=False),
     3, torch.bfloat16),
], ids=["L1", "L2-b3", "nobias", "bf16", "llama-micro", "llama-micro-b2", "llama-micro-bf16", "gqa-learned", "mqa"])
def test_tinygpt_activations_match_the_meter(cfg, micro_batch, dtype):
    torch.manual_seed(0)
    model = TinyGPT(cfg).to(dtype)
    x = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq_len))
    y = torch.randint(0, cfg.vocab, (micro_batch, cfg.seq_len))
    with ActivationMeter().measure() as meter:
        loss = lm_loss(model(x), y)
        assert meter.bytes == meter.peak == tinygpt_activation_bytes(cfg, micro_batch, dtype_bytes=dtype.itemsize)
        loss.backward()
    assert meter.bytes == 0, "backward frees what the forward saved, and the meter must see it"
