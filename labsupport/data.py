"""Text in, batches out: the tokenizer, the corpus, and per-rank sharding of a global batch.

The one idea that matters for distributed training is in `BatchSampler`: the G sequences
of optimizer step s depend only on (seed, s), never on the world size. Each of W ranks
takes a contiguous G/W slice of that global batch, so a run on 1, 2 or 4 ranks sees the
same data at every step and its losses can be compared with a single-process run.

Reading the text and listing its characters are text.py's (no torch there), re-exported here.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .text import DEFAULT_CORPUS, DataError, load_text, vocabulary  # noqa: F401  (re-exported)


class CharTokenizer:
    """One token per character: tiny vocabulary, no training, and every text round-trips exactly."""

    def __init__(self, chars):
        self.chars = list(chars)
        self._index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls(vocabulary(text))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, s: str) -> torch.Tensor:
        try:
            return torch.tensor([self._index[c] for c in s], dtype=torch.long)
        except KeyError as e:
            c = e.args[0]
            raise DataError(f"character {c!r} (U+{ord(c):04X}) is not in the tokenizer's vocabulary; "
                            "build the tokenizer from text that contains it") from None

    def decode(self, ids) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DataError(f"token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        return "".join(self.chars[i] for i in ids)


@dataclass
class Corpus:
    """A tokenized text split into a training part and a validation part (the end of the text)."""

    tokenizer: CharTokenizer
    train: torch.Tensor
    val: torch.Tensor

    @classmethod
    def load(cls, path=None, val_fraction: float = 0.1) -> "Corpus":
        if not 0 <= val_fraction < 1:
            raise DataError(f"val_fraction must be in [0, 1), got {val_fraction}")
        text = load_text(path)
        # The vocabulary comes from the whole text, so validation never meets an unknown character.
        tokenizer = CharTokenizer.from_text(text)
        ids = tokenizer.encode(text)
        n_train = len(ids) - int(len(ids) * val_fraction)
        return cls(tokenizer, ids[:n_train], ids[n_train:])


class BatchSampler:
    """Global batches that do not depend on world size: step s always yields the same G sequences."""

    def __init__(self, data: torch.Tensor, seq_len: int, global_batch: int, seed: int):
        if seq_len < 1 or global_batch < 1:
            raise DataError(f"seq_len and global batch must be >= 1, got {seq_len} and {global_batch}")
        if data.dim() != 1 or len(data) < seq_len + 1:
            raise DataError(f"data has {data.numel()} tokens but seq_len {seq_len} needs at least "
                            f"{seq_len + 1} (one extra for the shifted targets); use a shorter seq_len "
                            "or a longer text")
        self.data = data
        self.seq_len = seq_len
        self.G = global_batch
        self.seed = seed

    def starts(self, step: int) -> torch.Tensor:
        """The G start offsets of step `step`; a private generator leaves the global RNG alone."""
        # Hash (seed, step) into one 64-bit seed, so any step can be drawn directly (as a
        # resumed run must) and neighbouring steps or seeds give unrelated batches.
        digest = hashlib.sha256(f"{self.seed}:{step}".encode()).digest()
        g = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
        return torch.randint(0, len(self.data) - self.seq_len, (self.G,), generator=g)

    def _gather(self, starts: torch.Tensor):
        idx = starts[:, None] + torch.arange(self.seq_len)
        return self.data[idx], self.data[idx + 1]

    def global_batch(self, step: int):
        """x, y of shape [G, seq_len]; y[i, t] is the token that follows x[i, t]."""
        return self._gather(self.starts(step))

    def local_batch(self, step: int, rank: int, world_size: int):
        """This rank's contiguous share of the global batch: rows rank*G/W up to (rank+1)*G/W."""
        if world_size < 1 or self.G % world_size:
            raise DataError(f"global batch {self.G} must be divisible by world size {world_size}")
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside 0..{world_size - 1}")
        per_rank = self.G // world_size
        return self._gather(self.starts(step)[rank * per_rank:(rank + 1) * per_rank])


def micro_batches(x: torch.Tensor, y: torch.Tensor, micro_batch: int):
    """Split a batch into chunks of `micro_batch` rows, for gradient accumulation or pipelining."""
    if micro_batch < 1 or len(x) % micro_batch:
        raise DataError(f"batch of {len(x)} sequences is not divisible by micro batch {micro_batch}; "
                        "choose a micro batch that divides it")
    # clone: each micro-batch owns its memory, as it would after a copy to the device
    return [(a.clone(), b.clone()) for a, b in zip(x.split(micro_batch), y.split(micro_batch))]
