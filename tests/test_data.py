"""The data layer: a reproducible corpus, clear errors, and batches that do not depend on world size."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from labsupport.data import (
    DEFAULT_CORPUS, BatchSampler, CharTokenizer, Corpus, DataError, load_text, micro_batches,
)

REPO = Path(__file__).resolve().parent.parent


def test_shipped_corpus_is_what_the_generator_writes():
    result = subprocess.run([sys.executable, str(REPO / "data" / "make_corpus.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_default_corpus_loads_as_text():
    text = load_text()
    assert DEFAULT_CORPUS == REPO / "data" / "corpus.txt"
    assert 400_000 <= len(text) <= 700_000
    assert text.isascii()


def test_tokenizer_round_trip():
    text = "Ada met Boris at the harbor.\n17 + 25 = 42."
    tok = CharTokenizer.from_text(text)
    assert tok.chars == sorted(set(text))
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert ids.dtype == torch.long and ids.shape == (len(text),)
    assert tok.decode(ids) == text
    assert tok.decode(ids.tolist()) == text


def test_unknown_character_is_named():
    tok = CharTokenizer.from_text("abc")
    with pytest.raises(DataError, match="'z'"):
        tok.encode("abz")


def _one_line_error(path):
    with pytest.raises(DataError) as info:
        load_text(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    return message


def test_missing_file(tmp_path):
    assert "does not exist" in _one_line_error(tmp_path / "nope.txt")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    assert "empty" in _one_line_error(path)


def test_not_utf8_names_the_byte_offset(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9".encode("latin-1"))
    message = _one_line_error(path)
    assert "UTF-8" in message and "offset 3" in message


def test_directory(tmp_path):
    assert "directory" in _one_line_error(tmp_path)


def test_corpus_split_keeps_the_end_for_validation(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("abcdefghij")
    corpus = Corpus.load(path, val_fraction=0.2)
    assert corpus.tokenizer.decode(corpus.train) == "abcdefgh"
    assert corpus.tokenizer.decode(corpus.val) == "ij"


def test_batches_are_shifted_windows_of_the_data():
    data = torch.arange(100)
    x, y = BatchSampler(data, seq_len=8, global_batch=4, seed=0).global_batch(3)
    assert x.shape == y.shape == (4, 8)
    assert torch.equal(y, x + 1)  # with data = 0..99, each target is the next token
    assert int(y.max()) <= 99


@pytest.mark.parametrize("G, world_sizes", [(8, [1, 2, 4]), (6, [1, 2, 3])])
def test_local_batches_concatenate_to_the_global_batch(G, world_sizes):
    sampler = BatchSampler(torch.arange(1000), seq_len=16, global_batch=G, seed=7)
    for step in range(5):
        x, y = sampler.global_batch(step)
        for W in world_sizes:
            parts = [sampler.local_batch(step, r, W) for r in range(W)]
            assert torch.equal(torch.cat([p[0] for p in parts]), x)
            assert torch.equal(torch.cat([p[1] for p in parts]), y)


def test_world_size_must_divide_the_global_batch():
    sampler = BatchSampler(torch.arange(100), seq_len=8, global_batch=6, seed=0)
    with pytest.raises(DataError, match="global batch 6 must be divisible by world size 4"):
        sampler.local_batch(0, 0, 4)


def test_data_too_short():
    with pytest.raises(DataError, match="seq_len 8"):
        BatchSampler(torch.arange(8), seq_len=8, global_batch=2, seed=0)


def test_sampler_is_deterministic_and_leaves_global_rng_alone():
    data = torch.arange(10_000)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    a = BatchSampler(data, 32, 8, seed=1)
    b = BatchSampler(data, 32, 8, seed=1)
    assert torch.equal(a.starts(5), b.starts(5))
    assert torch.equal(a.starts(5), a.starts(5))  # drawing again, or out of order, changes nothing
    assert not torch.equal(a.starts(5), a.starts(6))
    assert not torch.equal(a.starts(5), BatchSampler(data, 32, 8, seed=2).starts(5))
    assert torch.equal(torch.get_rng_state(), before)


def test_micro_batches():
    x, y = torch.arange(24).view(6, 4), torch.arange(24).view(6, 4) + 1
    chunks = micro_batches(x, y, 2)
    assert len(chunks) == 3 and all(cx.shape == (2, 4) for cx, _ in chunks)
    assert torch.equal(torch.cat([cx for cx, _ in chunks]), x)
    assert torch.equal(torch.cat([cy for _, cy in chunks]), y)
    with pytest.raises(DataError, match="not divisible by micro batch 4"):
        micro_batches(x, y, 4)


@pytest.mark.slow
def test_tiny_gpt_learns_the_corpus():
    """The shipped corpus has enough structure for the smallest preset to learn fast."""
    from labsupport.model import TinyGPT, get_preset, lm_loss

    corpus = Corpus.load()
    cfg = get_preset("nano").with_vocab(corpus.tokenizer.vocab_size)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sampler = BatchSampler(corpus.train, cfg.seq_len, global_batch=16, seed=0)
    losses, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)  # the CI machine has two cores shared with other jobs
    try:
        for step in range(150):
            x, y = sampler.global_batch(step)
            loss = lm_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    first, last = losses[0], sum(losses[-10:]) / 10
    assert last <= 0.75 * first, f"loss went from {first:.3f} to {last:.3f}"
