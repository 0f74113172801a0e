"""The shapes of the models: TinyGPT's configuration, the named presets and the vocabulary padding.

Plain data, no torch: estimate/, the CLI's `memory` and `plan` and the widgets size models with
it, and `labsupport.model` builds TinyGPT from it (and re-exports it, so `from labsupport.model
import ModelConfig, PRESETS` works too). The CPU presets have no vocabulary of their own: they
take the one of the corpus they train on, and `preset_shape` gives them the shipped corpus's.
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

# The vocabulary is padded to a multiple of 64, so that any tensor-parallel degree up to 64 that
# divides it splits the embedding evenly (57 -> 64 for the shipped corpus; GPT-2's 50,257 -> 50,304).
VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a model. `vocab=None` means 'take it from the tokenizer' (CPU presets)."""

    name: str = "custom"
    n_layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int | None = None
    seq_len: int = 64
    bias: bool = True
    dropout: float = 0.0
    # A mixture of experts in place of every block's MLP (model.py's MoE); 0: the dense MLP.
    experts: int = 0
    top_k: int = 2                       # experts each token goes to
    capacity_factor: float | None = None  # an expert's capacity, x its balanced share; None: no capacity, no drops
    aux_loss_coef: float = 0.01          # the load-balancing loss' weight in the training loss (Switch's alpha)

    def __post_init__(self):
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if min(self.n_layers, self.hidden, self.heads, self.seq_len) < 1:
            raise ValueError("n_layers, hidden, heads and seq_len must all be >= 1")

    @property
    def padded_vocab(self) -> int:
        """Rows the embedding really has: the vocabulary rounded up to a multiple of 64."""
        return -(-self.vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    def with_vocab(self, vocab: int) -> "ModelConfig":
        return replace(self, vocab=vocab)

    def to_dict(self) -> dict:
        return asdict(self)


GPT2_VOCAB = 50257

PRESETS: dict[str, ModelConfig] = {
    # CPU presets: the notebooks and tests train these for real.
    "nano": ModelConfig("nano", n_layers=2, hidden=64, heads=4, seq_len=64),
    "micro": ModelConfig("micro", n_layers=4, hidden=128, heads=4, seq_len=128),
    "mini": ModelConfig("mini", n_layers=6, hidden=256, heads=8, seq_len=256),
    # GPT-2's released shapes (Radford et al., 2019, Table 2): context 1024, tied head, biases.
    "gpt2": ModelConfig("gpt2", 12, 768, 12, GPT2_VOCAB, 1024),
    "gpt2-medium": ModelConfig("gpt2-medium", 24, 1024, 16, GPT2_VOCAB, 1024),
    "gpt2-large": ModelConfig("gpt2-large", 36, 1280, 20, GPT2_VOCAB, 1024),
    "gpt2-xl": ModelConfig("gpt2-xl", 48, 1600, 25, GPT2_VOCAB, 1024),
    # The workshop's configurations (analysis only: far too large to instantiate here).
    "forge-s": ModelConfig("forge-s", 24, 2064, 24, GPT2_VOCAB, 2048),
    "22b": ModelConfig("22b", 48, 6144, 48, GPT2_VOCAB, 2048),
    "175b": ModelConfig("175b", 96, 12288, 96, GPT2_VOCAB, 2048),
    "1t": ModelConfig("1t", 128, 25600, 128, GPT2_VOCAB, 2048),
}
CPU_PRESETS = ("nano", "micro", "mini")
DEFAULT_PRESET = "micro"


def get_preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}") from None


@functools.lru_cache(maxsize=None)
def corpus_vocab() -> int:
    """Vocabulary of the shipped corpus's character tokenizer: what the CPU presets train with (read once)."""
    from ..text import load_text, vocabulary
    return len(vocabulary(load_text()))


def preset_shape(name: str, vocab: int | None = None, *, seq_len: int | None = None,
                 dropout: float | None = None, **changes) -> ModelConfig:
    """Preset `name` ready to count or build: a CPU preset gets `vocab` (default: the shipped
    corpus's), an analysis shape keeps its own; `seq_len`, `dropout` and the other `changes` (fields
    of ModelConfig: experts=4, top_k=1), when given, replace the preset's."""
    cfg = get_preset(name)
    if cfg.vocab is None:
        cfg = cfg.with_vocab(vocab if vocab is not None else corpus_vocab())
    changes.update({key: value for key, value in (("seq_len", seq_len), ("dropout", dropout)) if value is not None})
    return replace(cfg, **changes) if changes else cfg
