"""TinyGPT's layout for parallelism (head-major q/k/v, padded vocabulary, blocks by index,
absent parts skipped) must not change its mathematics: same weights, same logits, loss and
gradients as a plain GPT written the obvious way."""
import copy
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


def test_a_block_of_qkv_rows_is_a_set_of_whole_heads():
    """Keeping rows [h0 * 3 hd, h1 * 3 hd) and the matching proj columns computes those heads alone,
    which is what a tensor-parallel rank will do."""
    cfg = ModelConfig("h", n_layers=1, hidden=32, heads=4, vocab=64, seq_len=8)
    torch.manual_seed(0)
    attn = TinyGPT(cfg).blocks["0"].attn
    x = torch.randn(2, 8, 32)
    full = attn(x) - attn.proj.bias
    hd = 32 // 4
    halves = []
    for h0, h1 in ((0, 2), (2, 4)):
        part = copy.deepcopy(attn)
        rows, cols = slice(3 * hd * h0, 3 * hd * h1), slice(hd * h0, hd * h1)
        part.qkv.weight = nn.Parameter(attn.qkv.weight[rows])
        part.qkv.bias = nn.Parameter(attn.qkv.bias[rows])
        part.proj.weight = nn.Parameter(attn.proj.weight[:, cols])
        part.proj.bias = nn.Parameter(torch.zeros(32))
        halves.append(part(x))
    torch.testing.assert_close(halves[0] + halves[1], full, rtol=1e-5, atol=1e-6)


def test_a_model_cut_into_stages_is_the_model():
    """Two stages made by deleting parts of two copies chain to the same logits, names unchanged."""
    cfg = PRESETS["nano"].with_vocab(57)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    del first.blocks["1"]
    first.ln_f = first.lm_head = None
    del last.blocks["0"]
    last.tok_emb = last.pos_emb = None
    idx = torch.randint(0, 57, (2, 64))
    torch.testing.assert_close(last(first(idx)), model(idx))
    names = dict(model.named_parameters())
    assert {n for n, _ in first.named_parameters()} == {n for n in names if not n.startswith(("blocks.1", "ln_f"))}
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
