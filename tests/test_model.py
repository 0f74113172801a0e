"""TinyGPT's layout for parallelism (head-major q/k/v, padded vocabulary, blocks by index,
absent parts skipped) must not change its mathematics: same weights, same logits, loss and
gradients as a plain GPT written the obvious way."""
import copy
from dataclasses import replace
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from labsupport.model import PRESETS, ModelConfig, TinyGPT, generate, lm_loss


class PlainGPT(nn.Module):
    """The textbook GPT-2: separate q, k, v matrices, explicit softmax attention, unpadded vocabulary."""

    def __init__(self, cfg):
        super().__init__()
        d, self.heads = cfg.hidden, cfg.heads
        self.tok = nn.Embedding(cfg.vocab, d)
        self.pos = nn.Embedding(cfg.seq_len, d)
        self.layers = nn.ModuleList()
        for _ in range(cfg.n_layers):
            self.layers.append(nn.ModuleDict({
                "ln1": nn.LayerNorm(d), "q": nn.Linear(d, d), "k": nn.Linear(d, d), "v": nn.Linear(d, d),
                "o": nn.Linear(d, d), "ln2": nn.LayerNorm(d), "fc": nn.Linear(d, 4 * d), "out": nn.Linear(4 * d, d)}))
        self.ln_f = nn.LayerNorm(d)
        for p in self.parameters():  # random everything, biases and LayerNorms included
            nn.init.normal_(p, std=0.1)

    def forward(self, idx):
        b, t = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(t))
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        for layer in self.layers:
            h = layer["ln1"](x)
            q, k, v = (layer[n](h).view(b, t, self.heads, -1).transpose(1, 2) for n in "qkv")
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            x = x + layer["o"](att.transpose(1, 2).reshape(b, t, -1))
            x = x + layer["out"](F.gelu(layer["fc"](layer["ln2"](x))))
        return self.ln_f(x) @ self.tok.weight.T


def head_major(q, k, v, heads):
    """Stack q, k, v rows (or biases) head by head: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    parts = [z.reshape(heads, -1, *z.shape[1:]) for z in (q, k, v)]
    return torch.stack(parts, dim=1).reshape(-1, *q.shape[1:])


def copy_into_tinygpt(plain, model, cfg):
    with torch.no_grad():
        model.tok_emb.weight[:cfg.vocab] = plain.tok.weight
        model.pos_emb.weight.copy_(plain.pos.weight)
        for i, layer in enumerate(plain.layers):
            block = model.blocks[str(i)]
            block.attn.qkv.weight.copy_(head_major(layer["q"].weight, layer["k"].weight, layer["v"].weight, cfg.heads))
            block.attn.qkv.bias.copy_(head_major(layer["q"].bias, layer["k"].bias, layer["v"].bias, cfg.heads))
            for ours, theirs in ((block.ln1, layer["ln1"]), (block.attn.proj, layer["o"]), (block.ln2, layer["ln2"]),
                                 (block.mlp.fc, layer["fc"]), (block.mlp.proj, layer["out"])):
                ours.weight.copy_(theirs.weight)
                ours.bias.copy_(theirs.bias)
        model.ln_f.weight.copy_(plain.ln_f.weight)
        model.ln_f.bias.copy_(plain.ln_f.bias)


@pytest.mark.parametrize("cfg", [ModelConfig("a", n_layers=2, hidden=32, heads=4, vocab=57, seq_len=16),
                                 ModelConfig("b", n_layers=1, hidden=48, heads=3, vocab=64, seq_len=12)],
                         ids=["padded-57", "vocab-64"])
def test_same_logits_loss_and_gradients_as_a_plain_gpt(cfg):
    torch.manual_seed(0)
    plain, model = PlainGPT(cfg), TinyGPT(cfg)
    copy_into_tinygpt(plain, model, cfg)
    idx = torch.randint(0, cfg.vocab, (3, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab, (3, cfg.seq_len))
    ours, theirs = model(idx), plain(idx)
    assert ours.shape[-1] == cfg.padded_vocab == 64
    torch.testing.assert_close(ours[..., :cfg.vocab], theirs, rtol=1e-5, atol=1e-5)
    assert torch.isneginf(ours[..., cfg.vocab:]).all(), "padded logits must never win"
    loss_ours, loss_theirs = lm_loss(ours, targets), F.cross_entropy(theirs.flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=1e-6, atol=1e-6)
    loss_ours.backward()
    loss_theirs.backward()
    torch.testing.assert_close(model.tok_emb.weight.grad[:cfg.vocab], plain.tok.weight.grad, rtol=1e-4, atol=1e-6)
    assert not model.tok_emb.weight.grad[cfg.vocab:].any(), "padding rows get no gradient"
    attn, layer = model.blocks["0"].attn, plain.layers[0]
    expected = head_major(layer["q"].weight.grad, layer["k"].weight.grad, layer["v"].weight.grad, cfg.heads)
    torch.testing.assert_close(attn.qkv.weight.grad, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.blocks["0"].mlp.fc.weight.grad, layer["fc"].weight.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("cfg", [PRESETS["nano"].with_vocab(57), PRESETS["llama-micro"].with_vocab(57)],
                         ids=lambda c: c.name)
def test_a_model_cut_into_stages_is_the_model(cfg):
    """Two stages made by deleting parts of two copies chain to the same logits, names unchanged (with
    RoPE, the last stage's blocks take the positions 0..t-1 from the hidden states they are given)."""
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    for i in range(cfg.n_layers // 2, cfg.n_layers):
        del first.blocks[str(i)]
    first.ln_f = first.lm_head = None
    for i in range(cfg.n_layers // 2):
        del last.blocks[str(i)]
    last.tok_emb = last.pos_emb = None
    idx = torch.randint(0, 57, (2, 64))
    torch.testing.assert_close(last(first(idx)), model(idx))
    names = dict(model.named_parameters())
    later = tuple(f"blocks.{i}." for i in range(cfg.n_layers // 2, cfg.n_layers))
    assert {n for n, _ in first.named_parameters()} == {n for n in names if not n.startswith((*later, "ln_f",
                                                                                               "lm_head"))}
    # the last stage keeps the head: the tied matrix, now a copy of its own (ARCHITECTURE.md, tying across stages)
    assert "lm_head.weight" in dict(last.named_parameters()) and "blocks.1.attn.qkv.weight" in names


def test_generate_takes_any_logits_function_and_never_samples_padding():
    cfg = PRESETS["nano"].with_vocab(57)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    gen = torch.Generator().manual_seed(0)
    out = generate(model, torch.zeros(1, 1, dtype=torch.long), 300, cfg.seq_len, 1.0, gen)
    assert out.shape == (1, 301) and out.max() < 57
    again = model.generate(torch.zeros(1, 1, dtype=torch.long), 300, 1.0, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)


def test_a_preset_takes_the_corpus_vocabulary_and_tinygpt_builds_from_it():
    """The shapes are estimate/shapes.py's (no torch); a CPU preset gets the shipped corpus's vocabulary,
    which TinyGPT pads to a multiple of 64 rows."""
    from labsupport.data import Corpus
    from labsupport.estimate import shapes

    assert ModelConfig is shapes.ModelConfig and PRESETS is shapes.PRESETS
    cfg = shapes.preset_shape("nano")
    assert cfg == PRESETS["nano"].with_vocab(Corpus.load().tokenizer.vocab_size) == PRESETS["nano"].with_vocab(57)
    assert cfg.padded_vocab == 64 and TinyGPT(cfg).tok_emb.weight.shape == (64, 64)
    assert shapes.preset_shape("nano", 100, seq_len=16, dropout=0.1) == ModelConfig("nano", 2, 64, 4, 100, 16,
                                                                                    dropout=0.1)
    assert shapes.preset_shape("gpt2", 100) == PRESETS["gpt2"]  # an analysis shape keeps its own vocabulary
    assert PRESETS["gpt2"].padded_vocab == 50_304
    with pytest.raises(ValueError, match="unknown model preset 'gpt9'"):
        shapes.preset_shape("gpt9")


# ---------------------------------------------------------------- the Llama family

class PlainLlama(nn.Module):
    """The Llama family written the obvious way, independently of TinyGPT: separate q, k, v matrices
    (k and v with kv_heads heads, repeated for the query heads that read them), RMSNorm as a formula,
    RoPE as Meta's reference code does it (adjacent features as complex numbers), SwiGLU, explicit
    softmax attention, an untied head, unpadded vocabulary, no biases."""

    def __init__(self, cfg):
        super().__init__()
        d, self.cfg = cfg.hidden, cfg
        hd, kv = cfg.hidden // cfg.heads, cfg.n_kv_heads
        self.tok = nn.Embedding(cfg.vocab, d)
        self.layers = nn.ModuleList(nn.ModuleDict({
            "q": nn.Linear(d, d, bias=False), "k": nn.Linear(d, kv * hd, bias=False),
            "v": nn.Linear(d, kv * hd, bias=False), "o": nn.Linear(d, d, bias=False),
            "w1": nn.Linear(d, cfg.ffn, bias=False), "w3": nn.Linear(d, cfg.ffn, bias=False),
            "w2": nn.Linear(cfg.ffn, d, bias=False)}) for _ in range(cfg.n_layers))
        self.gains = nn.ParameterList(nn.Parameter(torch.ones(d)) for _ in range(2 * cfg.n_layers + 1))
        self.head = nn.Linear(d, cfg.vocab, bias=False)
        for p in self.parameters():
            nn.init.normal_(p, std=0.1)

    def norm(self, x, i):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps) * self.gains[i]

    def rope(self, x, positions):  # x: (b, heads, t, hd)
        hd = x.shape[-1]
        freqs = 1.0 / self.cfg.rope_theta ** (torch.arange(0, hd, 2).float() / hd)
        turn = torch.polar(torch.ones(len(positions), hd // 2), torch.outer(positions.float(), freqs))
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * turn).flatten(-2)

    def forward(self, idx, positions=None):
        b, t = idx.shape
        positions = torch.arange(t) if positions is None else positions
        heads, kv = self.cfg.heads, self.cfg.n_kv_heads
        x = self.tok(idx)
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        for i, layer in enumerate(self.layers):
            h = self.norm(x, 2 * i)
            q, k, v = (layer[n](h).view(b, t, -1, self.cfg.head_dim).transpose(1, 2) for n in "qkv")
            q, k = self.rope(q, positions), self.rope(k, positions)
            k, v = k.repeat_interleave(heads // kv, dim=1), v.repeat_interleave(heads // kv, dim=1)
            scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
            x = x + layer["o"](att.transpose(1, 2).reshape(b, t, -1))
            h = self.norm(x, 2 * i + 1)
            x = x + layer["w2"](F.silu(layer["w1"](h)) * layer["w3"](h))
        return self.head(self.norm(x, -1))


def grouped(q, k, v, kv_heads):
    """Stack q, k, v rows by key/value head: [q_(g,0) .. q_(g,r-1) k_g v_g | ...] (Megatron's query groups)."""
    qs = q.reshape(kv_heads, -1, *q.shape[1:])                   # (groups, r head_dim, ...)
    ks, vs = (z.reshape(kv_heads, -1, *z.shape[1:]) for z in (k, v))
    return torch.cat([qs, ks, vs], dim=1).reshape(-1, *q.shape[1:])


def copy_into_llama(plain, model, cfg):
    with torch.no_grad():
        model.tok_emb.weight[:cfg.vocab] = plain.tok.weight
        model.lm_head.weight[:cfg.vocab] = plain.head.weight
        for i, layer in enumerate(plain.layers):
            block = model.blocks[str(i)]
            block.attn.qkv.weight.copy_(grouped(layer["q"].weight, layer["k"].weight, layer["v"].weight,
                                                cfg.n_kv_heads))
            for ours, theirs in ((block.attn.proj, "o"), (block.mlp.gate, "w1"), (block.mlp.up, "w3"),
                                 (block.mlp.down, "w2")):
                ours.weight.copy_(layer[theirs].weight)
            block.ln1.weight.copy_(plain.gains[2 * i])
            block.ln2.weight.copy_(plain.gains[2 * i + 1])
        model.ln_f.weight.copy_(plain.gains[-1])


LLAMAS = [ModelConfig("gqa", n_layers=2, hidden=32, heads=4, vocab=57, seq_len=16, bias=False, norm="rmsnorm",
                      mlp="swiglu", ffn_hidden=40, positions="rope", kv_heads=2, tied=False, rope_theta=500.0),
          ModelConfig("mqa", n_layers=1, hidden=48, heads=3, vocab=64, seq_len=12, bias=False, norm="rmsnorm",
                      mlp="swiglu", ffn_hidden=24, positions="rope", kv_heads=1, tied=False),
          ModelConfig("mha", n_layers=1, hidden=32, heads=2, vocab=57, seq_len=8, bias=False, norm="rmsnorm",
                      mlp="swiglu", positions="rope", tied=False)]


@pytest.mark.parametrize("cfg", LLAMAS, ids=lambda c: c.name)
def test_the_llama_options_are_the_plain_llama(cfg):
    """RMSNorm, SwiGLU, RoPE and grouped-query attention (4 heads on 2, multi-query, multi-head) in TinyGPT,
    with q, k, v in query-group order, compute the textbook model's logits and gradients, at the default
    positions and at global ones (a context-parallel rank's)."""
    torch.manual_seed(0)
    plain, model = PlainLlama(cfg), TinyGPT(cfg)
    copy_into_llama(plain, model, cfg)
    assert model.pos_emb is None and model.lm_head.weight is not model.tok_emb.weight
    idx = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    targets = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    ours, theirs = model(idx), plain(idx)
    torch.testing.assert_close(ours[..., :cfg.vocab], theirs, rtol=1e-5, atol=1e-5)
    loss_ours, loss_theirs = lm_loss(ours, targets), F.cross_entropy(theirs.flatten(0, 1), targets.flatten())
    loss_ours.backward()
    loss_theirs.backward()
    attn, layer = model.blocks["0"].attn, plain.layers[0]
    expected = grouped(layer["q"].weight.grad, layer["k"].weight.grad, layer["v"].weight.grad, cfg.n_kv_heads)
    torch.testing.assert_close(attn.qkv.weight.grad, expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.blocks["0"].mlp.up.weight.grad, layer["w3"].weight.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(model.lm_head.weight.grad[:cfg.vocab], plain.head.weight.grad, rtol=1e-4, atol=1e-6)
    assert not model.lm_head.weight.grad[cfg.vocab:].any() and not model.lm_head.weight[cfg.vocab:].any()
    positions = torch.arange(cfg.seq_len) * 3 + 5  # global positions, not 0..t-1
    with torch.no_grad():
        torch.testing.assert_close(model(idx, positions)[..., :cfg.vocab], plain(idx, positions), rtol=1e-5, atol=1e-5)


def test_rope_turns_by_the_global_position_so_only_distances_count():
    """Queries and keys rotated by their positions score by m - n alone (RoFormer eq. 16): attention
    at positions 100..115 is attention at 0..15, and a layer given other positions than 0..t-1 uses them."""
    cfg = LLAMAS[0]
    torch.manual_seed(0)
    attn = TinyGPT(cfg).blocks["0"].attn
    nn.init.normal_(attn.qkv.weight, std=0.5)  # scores far from 0, so that the rotation shows
    x = torch.randn(2, 16, 32)
    torch.testing.assert_close(attn(x, positions=torch.arange(100, 116)), attn(x), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(attn(x, positions=torch.arange(16) * 2), attn(x), atol=1e-3)


@pytest.mark.parametrize("cfg", [ModelConfig("h", n_layers=1, hidden=32, heads=4, vocab=64, seq_len=8),
                                 replace(LLAMAS[0], n_layers=1)], ids=["mha", "gqa-rope"])
def test_a_block_of_qkv_rows_is_a_set_of_whole_heads(cfg):
    """Keeping half the rows of qkv (whole key/value heads with their query heads: with 4 query heads on 2
    key/value heads, one query group) and the matching proj columns computes those heads alone, which is
    what a tensor-parallel rank will do."""
    torch.manual_seed(0)
    attn = TinyGPT(cfg).blocks["0"].attn
    x = torch.randn(2, 8, 32)
    bias = attn.proj.bias if cfg.bias else 0
    full = attn(x) - bias
    rows, cols = attn.qkv.weight.shape[0] // 2, 32 // 2
    halves = []
    for half in range(2):
        part = copy.deepcopy(attn)
        part.qkv.weight = nn.Parameter(attn.qkv.weight[half * rows:(half + 1) * rows])
        part.proj.weight = nn.Parameter(attn.proj.weight[:, half * cols:(half + 1) * cols])
        if cfg.bias:
            part.qkv.bias = nn.Parameter(attn.qkv.bias[half * rows:(half + 1) * rows])
            part.proj.bias = nn.Parameter(torch.zeros(32))
        halves.append(part(x))
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-5, atol=1e-6)


def test_llama_micro_is_a_cpu_preset_tinygpt_builds_counts_and_samples():
    """llama-micro: a CPU preset of micro's size (RMSNorm, SwiGLU, RoPE, 2 key/value heads for 4 query heads,
    untied, no biases); TinyGPT builds it with the parameters count_params counts, and it samples."""
    from labsupport.estimate import shapes
    from labsupport.estimate.params import count_params
    cfg = shapes.preset_shape("llama-micro")
    assert "llama-micro" in shapes.CPU_PRESETS and cfg.vocab == 57
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    assert count_params(cfg, padded=True) == sum(p.numel() for p in model.parameters()) == 754_816
    assert model.num_params() == count_params(cfg) == 753_024
    names = {n for n, _ in model.named_parameters()}
    assert {"blocks.0.attn.qkv.weight", "blocks.0.mlp.gate.weight", "blocks.0.mlp.up.weight",
            "blocks.0.mlp.down.weight", "blocks.0.ln1.weight", "lm_head.weight"} <= names
    assert not any(n.endswith("bias") for n in names) and "pos_emb.weight" not in names
    assert model.blocks["0"].attn.qkv.weight.shape == ((4 + 2 * 2) * 32, 128)
    out = model.generate(torch.zeros(1, 1, dtype=torch.long), 150, 1.0, torch.Generator().manual_seed(0))
    assert out.shape == (1, 151) and out.max() < 57  # past seq_len 128: the window slides, positions restart


@pytest.mark.parametrize("changes, message", [
    (dict(kv_heads=3), r"kv_heads \(3\) must divide heads \(4\)"),
    (dict(kv_heads=0), r"kv_heads \(0\) must divide heads \(4\)"),
    (dict(hidden=36, heads=4, positions="rope"), r"head dimension hidden / heads \(36 / 4 = 9\) must be even"),
    (dict(norm="batchnorm"), "norm 'batchnorm' is not one of: layernorm, rmsnorm"),
    (dict(mlp="relu"), "mlp 'relu' is not one of: gelu, swiglu"),
    (dict(positions="alibi"), "positions 'alibi' is not one of: learned, rope"),
    (dict(ffn_hidden=0), r"ffn_hidden \(0\) must be >= 1"),
])
def test_a_shape_the_family_cannot_take_is_one_line(changes, message):
    with pytest.raises(ValueError, match=message) as error:
        ModelConfig("bad", **{"hidden": 64, "heads": 4, **changes})
    assert "\n" not in str(error.value)


def test_tensor_parallel_problems_name_heads_kv_heads_and_ffn():
    """The torch-free checks a tensor-parallel step reuses: tp must split query heads, key/value heads (as
    Megatron Core up to 0.15's divide(num_query_groups, tp) asserts) and the MLP's units into whole pieces."""
    from labsupport.estimate.shapes import PRESETS, tensor_parallel_problems
    llama = PRESETS["llama-micro"]
    assert tensor_parallel_problems(llama, 2) == []
    assert tensor_parallel_problems(llama, 4) == ["tp 4 must divide the model's key/value heads (2)"]
    assert tensor_parallel_problems(replace(llama, ffn_hidden=350), 4) == [
        "tp 4 must divide the model's key/value heads (2)", "tp 4 must divide the model's MLP's inner width "
        "(ffn_hidden) (350)"]
    assert tensor_parallel_problems(PRESETS["llama3-405b"], 8) == [] and tensor_parallel_problems(
        PRESETS["llama3-405b"], 16) == ["tp 16 must divide the model's key/value heads (8)"]
    assert tensor_parallel_problems(PRESETS["micro"], 3) == ["tp 3 must divide the model's attention heads (4)",
                                                             "tp 3 must divide the model's key/value heads (4)",
                                                             "tp 3 must divide the model's MLP's inner width "
                                                             "(ffn_hidden) (512)"]
