"""The shapes of the models: TinyGPT's configuration, the named presets and the vocabulary padding.

Plain data, no torch: estimate/, the CLI's `memory` and `plan` and the widgets size models with
it, and `labsupport.model` builds TinyGPT from it (and re-exports it, so `from labsupport.model
import ModelConfig, PRESETS` works too). The CPU presets have no vocabulary of their own: they
take the one of the corpus they train on, and `preset_shape` gives them the shipped corpus's.

One configuration covers two families. Its defaults are GPT-2's shape (Radford et al. 2019):
LayerNorm, a GELU MLP of 4 hidden, learned positions, one key/value head per query head, the LM
head tied to the embedding, biases. The Llama family (Touvron et al. 2023, "LLaMA", Sec. 2.2;
Mistral 7B, Jiang et al. 2023, Sec. 2; Llama 3, Dubey et al. 2024, Sec. 3.2) changes five of them,
each an option: `norm="rmsnorm"`, `mlp="swiglu"` with its own `ffn_hidden`, `positions="rope"`,
`kv_heads` < heads (grouped-query attention), `tied=False`, and `bias=False`. `shape_problems` and
`tensor_parallel_problems` say, one line per mistake, what a shape or a TP degree cannot do;
ModelConfig refuses the first kind when it is built (ValueError).
"""
from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, replace

# The vocabulary is padded to a multiple of 64, so that any tensor-parallel degree up to 64 that
# divides it splits the embedding evenly (57 -> 64 for the shipped corpus; GPT-2's 50,257 -> 50,304).
VOCAB_MULTIPLE = 64


NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("learned", "rope")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a model. `vocab=None` means 'take it from the tokenizer' (CPU presets).

    The Llama family's options (the defaults are GPT-2's, so every GPT preset is unchanged):

    * `norm`: "layernorm" (Ba et al. 2016, with a bias when `bias`) or "rmsnorm" (Zhang & Sennrich
      2019, "Root Mean Square Layer Normalization", eq. 4: x / sqrt(mean(x^2) + eps) times a gain,
      no centring, no bias); `norm_eps` is the eps of either (Llama 3's and Mistral's
      config.json: rms_norm_eps 1e-05, also torch's LayerNorm default).
    * `mlp`: "gelu" (hidden -> ffn -> hidden, GELU) or "swiglu" (Shazeer 2020, "GLU Variants Improve
      Transformer", eq. 6 FFN_SwiGLU: (Swish(x W) * x V) W2, three matrices, which we call gate, up and
      down); `ffn_hidden` is the inner width (`ffn`; default 4 hidden for GELU, LLaMA's rule for
      SwiGLU). Each expert of a mixture (`experts` > 0) is this MLP (Mixtral's are SwiGLU).
    * `positions`: "learned" (a table of seq_len x hidden added to the embedding, GPT-2) or "rope"
      (rotary embeddings, Su et al. 2021, "RoFormer", Sec. 3.2, eq. 15: each pair of a query's and a
      key's features rotated by position x theta_i, theta_i = rope_theta^(-2i / head_dim); 10,000 in
      the paper, 500,000 in Llama 3's config.json, 1e6 in Mixtral's). No parameters; the head
      dimension must be even (features are rotated in pairs).
    * `kv_heads`: key/value heads of grouped-query attention (Ainslie et al. 2023, "GQA", Sec. 2.2):
      heads / kv_heads query heads share each key/value head; None (the default) means `heads`,
      multi-head attention; 1 is multi-query attention (Shazeer 2019). It must divide `heads`.
    * `tied`: the LM head is the token embedding's matrix (GPT-2) or a matrix of its own (Llama,
      Mistral: tie_word_embeddings false in their config.json).
    """

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
    # The Llama family's options (class docstring); the defaults are GPT-2's.
    norm: str = "layernorm"              # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    mlp: str = "gelu"                    # "gelu" | "swiglu"
    ffn_hidden: int | None = None        # the MLP's inner width; None: 4 hidden (GELU) or LLaMA's rule (SwiGLU)
    positions: str = "learned"           # "learned" | "rope"
    rope_theta: float = 10000.0          # RoPE's base (RoFormer: 10,000)
    kv_heads: int | None = None          # key/value heads (grouped-query attention); None: `heads`
    tied: bool = True                    # the LM head shares the token embedding's matrix

    def __post_init__(self):
        found = shape_problems(self)
        if found:
            raise ValueError("; ".join(found))

    @property
    def padded_vocab(self) -> int:
        """Rows the embedding really has: the vocabulary rounded up to a multiple of 64."""
        return -(-self.vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE

    @property
    def head_dim(self) -> int:
        """Features of one attention head: hidden / heads (every model here has heads x head_dim = hidden)."""
        return self.hidden // self.heads

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads: `kv_heads`, or `heads` (multi-head attention) when it is None."""
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def ffn(self) -> int:
        """The MLP's inner width (each expert's too): `ffn_hidden` when given; else 4 hidden for the GELU
        MLP (GPT-2), and for SwiGLU LLaMA's 2/3 x 4 hidden (Touvron et al. 2023, Sec. 2.2, which keeps the
        three matrices' parameters those of the two of a 4 hidden MLP) rounded up to a multiple of 256
        as Meta's reference code rounds it (`multiple_of`): 11,008 for hidden 4096, LLaMA 7B's width."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.mlp == "swiglu":
            return -(-(8 * self.hidden // 3) // 256) * 256
        return 4 * self.hidden

    def with_vocab(self, vocab: int) -> "ModelConfig":
        return replace(self, vocab=vocab)

    def to_dict(self) -> dict:
        return asdict(self)


def shape_problems(cfg) -> list[str]:
    """What is wrong with a shape, one line per mistake (ModelConfig raises them as one ValueError)."""
    if min(cfg.n_layers, cfg.hidden, cfg.heads, cfg.seq_len) < 1:
        return ["n_layers, hidden, heads and seq_len must all be >= 1"]
    out = []
    if cfg.hidden % cfg.heads:
        out.append(f"hidden ({cfg.hidden}) must be divisible by heads ({cfg.heads})")
    for field, value, choices in (("norm", cfg.norm, NORMS), ("mlp", cfg.mlp, MLPS),
                                  ("positions", cfg.positions, POSITIONS)):
        if value not in choices:
            out.append(f"{field} {value!r} is not one of: {', '.join(choices)}")
    if cfg.kv_heads is not None and (cfg.kv_heads < 1 or cfg.heads % cfg.kv_heads):
        out.append(f"kv_heads ({cfg.kv_heads}) must divide heads ({cfg.heads}): each key/value head serves "
                   f"heads / kv_heads query heads (1: multi-query attention; {cfg.heads}: multi-head)")
    if cfg.positions == "rope" and not cfg.hidden % cfg.heads and cfg.head_dim % 2:
        out.append(f"RoPE rotates the features of a head in pairs, so the head dimension hidden / heads "
                   f"({cfg.hidden} / {cfg.heads} = {cfg.head_dim}) must be even")
    if cfg.ffn_hidden is not None and cfg.ffn_hidden < 1:
        out.append(f"ffn_hidden ({cfg.ffn_hidden}) must be >= 1")
    if not cfg.norm_eps > 0:
        out.append(f"norm_eps ({cfg.norm_eps:g}) must be > 0")
    if not cfg.rope_theta > 0:
        out.append(f"rope_theta ({cfg.rope_theta:g}) must be > 0")
    return out


def family_options(cfg) -> list[str]:
    """The Llama family's options this shape uses, in words (empty for the GPT shape; biases aside)."""
    return [what for what, used in (("RMSNorm", cfg.norm == "rmsnorm"), ("a SwiGLU MLP", cfg.mlp == "swiglu"),
                                    ("RoPE", cfg.positions == "rope"),
                                    ("grouped-query attention", cfg.n_kv_heads != cfg.heads),
                                    ("an untied LM head", not cfg.tied)) if used]


def tensor_parallel_problems(cfg, tp: int) -> list[str]:
    """What stops `tp` ranks from splitting this shape's attention and MLP by whole pieces, one line each.

    Megatron-LM's column/row split (Shoeybi et al. 2019, Sec. 3) gives each rank heads / tp query heads
    and ffn / tp of the MLP's inner units (of each of SwiGLU's gate and up). With grouped-query
    attention each rank also takes kv_heads / tp whole key/value heads, the ones its query heads read:
    Megatron-LM up to Megatron Core 0.15 splits its `num_query_groups` the same way,
    `divide(num_query_groups, tp)`, which asserts that tp divides it; since 0.16 it also takes a tp
    that kv_heads divides (each rank all-gathers qkv's output and keeps its group's block), and vLLM's
    QKVParallelLinear copies each key/value head onto tp / kv_heads ranks. This check refuses such a
    tp by this library's choice: every rank holds whole query groups."""
    out = []
    for what, size in (("attention heads", cfg.heads), ("key/value heads", cfg.n_kv_heads),
                       ("MLP's inner width (ffn_hidden)", cfg.ffn)):
        if size % tp:
            out.append(f"tp {tp} must divide the model's {what} ({size})")
    return out


GPT2_VOCAB = 50257
# The published vocabularies: Llama 3's tokenizer, 128,256 entries (128,000 + 256 special), and Mistral's
# 32,000. Both are multiples of 64 already (64 x 2004, 64 x 500), so padding adds no row to them.
LLAMA3_VOCAB, MISTRAL_VOCAB = 128256, 32000
# What makes a shape the Llama family's, beside its sizes (ModelConfig's docstring).
LLAMA = dict(bias=False, norm="rmsnorm", mlp="swiglu", positions="rope", tied=False)

PRESETS: dict[str, ModelConfig] = {
    # CPU presets: the notebooks and tests train these for real.
    "nano": ModelConfig("nano", n_layers=2, hidden=64, heads=4, seq_len=64),
    "micro": ModelConfig("micro", n_layers=4, hidden=128, heads=4, seq_len=128),
    "mini": ModelConfig("mini", n_layers=6, hidden=256, heads=8, seq_len=256),
    # micro's size in the Llama family: RMSNorm, SwiGLU, RoPE, 2 key/value heads for 4 query heads (so
    # tp = 2 splits whole key/value heads), an untied head, no biases. ffn 352 = 11 x 32 is about LLaMA's
    # 2/3 x 4 hidden (341), so the MLP holds about the parameters of micro's 4 hidden GELU MLP.
    "llama-micro": ModelConfig("llama-micro", n_layers=4, hidden=128, heads=4, seq_len=128, **LLAMA,
                               ffn_hidden=352, kv_heads=2),
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
    # The Llama family's published models (analysis only), from their config.json on the Hugging Face
    # Hub (hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, intermediate_size,
    # vocab_size, rope_theta, rms_norm_eps 1e-05, tie_word_embeddings false, no biases). seq_len is the
    # context of pre-training.
    # Meta-Llama-3-8B: 4096, 32, 32, 8, 14336, 128256, 500000.0; max_position_embeddings 8192.
    "llama3-8b": ModelConfig("llama3-8b", 32, 4096, 32, LLAMA3_VOCAB, 8192, **LLAMA, ffn_hidden=14336, kv_heads=8,
                             rope_theta=500000.0),
    # Meta-Llama-3-70B: 8192, 80, 64, 8, 28672, 128256, 500000.0; max_position_embeddings 8192.
    "llama3-70b": ModelConfig("llama3-70b", 80, 8192, 64, LLAMA3_VOCAB, 8192, **LLAMA, ffn_hidden=28672,
                              kv_heads=8, rope_theta=500000.0),
    # Llama-3.1-405B: 16384, 126, 128, 8, 53248, 128256, 500000.0 (Dubey et al. 2024, "The Llama 3 Herd of
    # Models", Table 3, the same shape). Pre-trained at 8K tokens, then extended to 128K (Sec. 3.4.2;
    # max_position_embeddings 131072 with the "llama3" rope_scaling, which this shape leaves out).
    "llama3-405b": ModelConfig("llama3-405b", 126, 16384, 128, LLAMA3_VOCAB, 8192, **LLAMA, ffn_hidden=53248,
                               kv_heads=8, rope_theta=500000.0),
    # Mistral-7B-v0.1: 4096, 32, 32, 8, 14336, 32000, 10000.0; context 8192 (Jiang et al. 2023, "Mistral
    # 7B", Table 1). Its sliding-window attention (window 4096) changes no shape and is left out.
    "mistral-7b": ModelConfig("mistral-7b", 32, 4096, 32, MISTRAL_VOCAB, 8192, **LLAMA, ffn_hidden=14336,
                              kv_heads=8),
    # Mixtral-8x7B-v0.1: Mistral 7B's shape with every MLP 8 SwiGLU experts, 2 per token
    # (num_local_experts 8, num_experts_per_tok 2), rope_theta 1000000.0, router_aux_loss_coef 0.02;
    # context 32768 (Jiang et al. 2024, "Mixtral of Experts", Table 1). No capacity: nothing dropped.
    "mixtral-8x7b": ModelConfig("mixtral-8x7b", 32, 4096, 32, MISTRAL_VOCAB, 32768, **LLAMA, ffn_hidden=14336,
                                kv_heads=8, rope_theta=1e6, experts=8, top_k=2, aux_loss_coef=0.02),
}
CPU_PRESETS = ("nano", "micro", "mini", "llama-micro")
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
