"""Notebook 01's exercises: count TinyGPT's parameters and a Llama's, bytes per parameter by recipe, days to
train the workshop's 22B model, and two find-the-bug labs (gradient accumulation whose gradient is
4x the whole batch's while AdamW's losses look right; an fp16 step whose logged gradient norm is
far too large and whose run learns more slowly than fp32's).

Expected values come from `estimate/` (one place per formula), so the exercises grade against
the same numbers the notebook and the CLI print.
"""
from __future__ import annotations

import functools
import re
from dataclasses import replace

from ..estimate.flops import training_days as reference_days
from ..estimate.memory import BYTES_PER_PARAM
from ..estimate.params import count_params, params_per_layer
from ..estimate.shapes import preset_shape
from ..model import GPT2_VOCAB, PRESETS
from .exercise import Exercise, Wrong, attempt, paragraphs, register


# ---------------------------------------------------------------- parameters

PARAM_SHAPES = [replace(PRESETS[name], vocab=vocab) for name, vocab in
                (("nano", 57), ("micro", 57), ("mini", 57), ("gpt2", GPT2_VOCAB), ("gpt2-medium", GPT2_VOCAB))]


def grade_tinygpt_params(fn, source) -> str:
    for cfg in PARAM_SHAPES:
        got = attempt(fn, cfg.n_layers, cfg.hidden, cfg.vocab, cfg.seq_len)
        want = count_params(cfg)
        if got != want:
            hint = ""
            d = cfg.hidden
            if got is not None and got - want == cfg.vocab * d:
                hint = " The LM head is tied to the token embedding: one matrix, counted once."
            elif got is not None and want - got == cfg.seq_len * d:
                hint = " The learned position embeddings are parameters too."
            elif got is not None and want - got == cfg.n_layers * d * d:
                hint = " A layer's matrices are 12 d², not 11 d²: q, k, v and the projection are 4 d², the MLP 8 d²."
            raise Wrong(f"for {cfg.name} (L={cfg.n_layers}, d={d}, V={cfg.vocab}, s={cfg.seq_len}) you count "
                        f"{got!r}, TinyGPT has {want:,}.{hint}")
    return (f"exact for {', '.join(c.name for c in PARAM_SHAPES)} "
            f"(GPT-2 small: {count_params(PARAM_SHAPES[3]):,}, as published)")


register(Exercise(
    name="tinygpt_params", notebook="01", title="Count TinyGPT's parameters",
    grade=grade_tinygpt_params,
    hints=("Embeddings: V·d for the tokens (the LM head shares it) and s·d for the positions.",
           "A block: 12 d² in matrices; vectors: 2 LayerNorms (weight and bias, 4d), and the biases of "
           "q/k/v (3d), the attention projection (d), the MLP (4d and d).",
           "Add a final LayerNorm (2d) after the last block."),
    solution='''
def tinygpt_params(n_layers, hidden, vocab, seq_len):
    d = hidden
    block = 12 * d * d + 13 * d      # matrices, then biases and LayerNorm weights/biases
    return vocab * d + seq_len * d + n_layers * block + 2 * d
'''))


# ---------------------------------------------------------------- a Llama's parameters

def _llama_shapes() -> list:
    """The shapes llama_params is checked on: llama-micro (the CPU preset, with the shipped corpus's vocabulary)
    untied as it is and tied, Mistral 7B, Llama 3 8B and 70B (their published shapes)."""
    micro = preset_shape("llama-micro")
    return [micro, replace(micro, name="llama-micro (tied)", tied=True),
            *(PRESETS[name] for name in ("mistral-7b", "llama3-8b", "llama3-70b"))]


def _llama_diagnosis(cfg, got, want) -> str:
    """What one usual slip makes of the count, recognised by the difference it leaves (each differs on llama-micro)."""
    L, d, f, V = cfg.n_layers, cfg.hidden, cfg.ffn, cfg.vocab
    kv = cfg.n_kv_heads * cfg.head_dim
    slips = {
        2 * L * d * (d - kv): (f" K and V are as wide as Q in your count. With grouped-query attention each projects "
                               f"to kv_heads heads of head_dim = hidden / heads features: {cfg.n_kv_heads} x "
                               f"{cfg.head_dim} = {kv} here, not {d}."),
        -L * d * f: " SwiGLU has three matrices (gate and up: d x ffn_hidden, down: ffn_hidden x d); you count two.",
        L * (8 * d * d - 3 * d * f): " The MLP is SwiGLU of width ffn_hidden, three matrices, not GPT's two of width 4d.",
        (V * d if cfg.tied else -V * d): (" The LM head is tied here: it is the embedding's matrix, counted once."
                                          if cfg.tied else " The LM head is untied: a V x d matrix of its own."),
        (2 * L + 1) * d: " RMSNorm has a gain and no shift: d per norm, not LayerNorm's 2d.",
        2 * L * d: " RMSNorm has a gain and no shift: d per norm, not LayerNorm's 2d.",
        -(2 * L + 1) * d: " The norms are parameters too: two RMSNorm gains per block and a final one, d each.",
        -2 * L * d: " Each block has two RMSNorm gains, d each.",
        -d: " There is a final RMSNorm after the last block (d).",
        L * ((cfg.heads + 2 * cfg.n_kv_heads) * cfg.head_dim + d + 2 * f + d): " The Llama family has no biases.",
    }
    return slips.get(got - want, "") if isinstance(got, (int, float)) and not isinstance(got, bool) else ""


def grade_llama_params(fn, source) -> str:
    if re.search(r"count_params|params_per_layer|attention_params|estimate\.params", source or ""):
        raise Wrong("your llama_params calls the library's count (labsupport.estimate.params), the very count the "
                    "check compares with: add up the matrices and the norms yourself")
    shapes = _llama_shapes()
    for cfg in shapes:
        got = attempt(fn, cfg.n_layers, cfg.hidden, cfg.heads, cfg.n_kv_heads, cfg.ffn, cfg.vocab, cfg.tied)
        want = count_params(cfg)
        if got != want:
            raise Wrong(f"for {cfg.name} (L={cfg.n_layers}, d={cfg.hidden}, heads={cfg.heads}, kv_heads="
                        f"{cfg.n_kv_heads}, ffn_hidden={cfg.ffn}, V={cfg.vocab}, tied={cfg.tied}) you count {got!r}, "
                        f"the model has {want:,} parameters.{_llama_diagnosis(cfg, got, want)}")
    return (f"exact for llama-micro (untied, and tied), Mistral 7B ({count_params(shapes[2]):,}), Llama 3 8B and "
            f"Llama 3 70B")


def _llama_lesson() -> str:
    mistral, l8, l70 = (PRESETS[name] for name in ("mistral-7b", "llama3-8b", "llama3-70b"))
    vocab_share = 2 * l8.vocab * l8.hidden / count_params(l8)
    return paragraphs(
        f"""A Llama-family block spends its parameters differently from GPT-2's. Grouped-query attention gives K and V
        kv_heads heads where Q has heads: they are {mistral.heads // mistral.n_kv_heads}x smaller than Q in Mistral 7B
        and Llama 3 8B, {l70.heads // l70.n_kv_heads}x in Llama 3 70B. SwiGLU's MLP has three matrices of width
        ffn_hidden where GPT's has two of width 4d: at Mistral 7B's width, {mistral.ffn / mistral.hidden:g} d, that is
        {3 * mistral.ffn / mistral.hidden:g} d² against GPT's 8 d². RMSNorm keeps a gain and no shift, no layer has a
        bias, and RoPE rotates queries and keys without a parameter of its own.""",
        f"""An untied LM head makes the vocabulary cost two V x d matrices: with Llama 3's {l8.vocab:,} tokens they are
        {vocab_share:.0%} of Llama 3 8B.""")


def count_by_part(cfg) -> tuple[dict, dict]:
    """A Llama-family model's parameters part by part, a block's and the whole model's; printed as a table once
    llama_params is earned (the parts are that exercise's answer), a locked line before. Returns both dicts."""
    from . import exercise
    d, kv = cfg.hidden, cfg.n_kv_heads * cfg.head_dim
    block = {"Q and the output projection, 2·d·d": 2 * d * d, "K and V, 2·d·(g·e)": 2 * d * kv,
             "MLP: gate, up and down, 3·d·f": 3 * d * cfg.ffn, "two RMSNorm gains, 2·d": 2 * d}
    whole = {f"{cfg.n_layers} blocks": cfg.n_layers * sum(block.values()), "token embedding, V·d": cfg.vocab * d,
             **({} if cfg.tied else {"LM head (untied), V·d": cfg.vocab * d}), "final RMSNorm, d": d}
    total = count_params(cfg)
    assert sum(block.values()) == params_per_layer(cfg) and sum(whole.values()) == total, "the parts miss the count"
    if not exercise.unlocked("llama_params"):
        exercise.locked("llama_params", f"{cfg.name}'s count, part by part,")
        return block, whole
    print(f"{cfg.name + ', one block':<38}{'parameters':>15}{'in d²':>9}")
    for part, n in [*block.items(), ("one block", sum(block.values()))]:
        print(f"  {part:<36}{n:>15,}" + ("" if "RMSNorm" in part else f"{n / d ** 2:>9.3f}"))
    print(f"{cfg.name:<38}{'':>15}{'share':>9}")
    for part, n in whole.items():
        print(f"{part:<38}{n:>15,}{n / total:>9.1%}")
    print(f"{'total (count_params)':<38}{total:>15,}")
    return block, whole


register(Exercise(
    name="llama_params", notebook="01", title="Count a Llama's parameters",
    grade=grade_llama_params,
    hints=("Attention: Q and the output projection are d x d each. K and V each map d to kv_heads heads of "
           "head_dim = hidden / heads features.",
           "The MLP (SwiGLU) has three matrices of d x ffn_hidden; each RMSNorm is a gain of d, two per block; no "
           "biases anywhere.",
           "Around the blocks: the embedding (V·d), the LM head (another V·d unless tied), a final RMSNorm (d). RoPE "
           "has no parameters."),
    lesson=_llama_lesson(),
    solution='''
def llama_params(n_layers, hidden, heads, kv_heads, ffn_hidden, vocab, tied):
    d = hidden
    kv = kv_heads * (hidden // heads)        # K and V: kv_heads heads of head_dim features
    attention = 2 * d * d + 2 * d * kv       # Q and the output projection; K and V (no biases)
    mlp = 3 * d * ffn_hidden                 # SwiGLU: gate, up and down
    block = attention + mlp + 2 * d          # + two RMSNorm gains
    head = 0 if tied else vocab * d          # an untied LM head is a matrix of its own
    return vocab * d + head + n_layers * block + d   # embedding, head, blocks, final RMSNorm
'''))


# ---------------------------------------------------------------- bytes per parameter

def _bytes_wrong(got, want: dict) -> str:
    """What is wrong with the attendee's dict, entry by entry (too many, too few, missing), without the values."""
    if not isinstance(got, dict):
        return f"you return {got!r}; the check expects a dict with the entries {', '.join(map(repr, want))}"
    missing, extra = [k for k in want if k not in got], [k for k in got if k not in want]
    if missing or extra:
        return ("your dict " + "; ".join(([f"misses {', '.join(map(repr, missing))}"] if missing else [])
                                         + ([f"has no place for {', '.join(map(repr, extra))}"] if extra else [])))
    numbers = [k for k in want if isinstance(got[k], bool) or not isinstance(got[k], (int, float))]
    if numbers:
        return f"your {numbers[0]!r} is {got[numbers[0]]!r}, not a number of bytes"
    wrong = [f"{k!r} has too {'many' if got[k] > want[k] else 'few'} bytes" for k in want if got[k] != want[k]]
    return "your " + ", ".join(wrong[:-1]) + (" and " if len(wrong) > 1 else "") + wrong[-1]


def grade_bytes_per_param(fn, source) -> str:
    for recipe, want in BYTES_PER_PARAM.items():
        got = attempt(fn, recipe)
        if got != want:
            raise Wrong(f"for {recipe!r} {_bytes_wrong(got, want)}")
    return "16 / 16 / 18 / 20 bytes per parameter, and the split between weights, gradients and optimizer"


register(Exercise(
    name="bytes_per_param", notebook="01", title="Bytes per parameter, by recipe",
    grade=grade_bytes_per_param,
    hints=("Adam keeps two moments per parameter (m and v), in fp32.",
           "Mixed precision adds an fp32 master copy of the weights to the optimizer's state: 4 + 4 + 4 = 12.",
           "Megatron's bf16 recipe accumulates gradients in fp32 (4 bytes); its fp16 recipe keeps 16-bit "
           "gradients (2) and an fp32 copy of them in the optimizer (12 + 4)."),
    solution='''
def bytes_per_param(recipe):
    return {"fp32": dict(params=4, grads=4, optimizer=8),            # weights, grads, Adam m and v
            "mixed": dict(params=2, grads=2, optimizer=12),           # + fp32 master weights (ZeRO's K = 12)
            "megatron-bf16": dict(params=2, grads=4, optimizer=12),   # fp32 gradient accumulation
            "megatron-fp16": dict(params=2, grads=2, optimizer=16)}[recipe]  # + fp32 copy of the gradients
'''))


# ---------------------------------------------------------------- days to train

DAYS_CASES = [(count_params(replace(PRESETS["22b"], vocab=GPT2_VOCAB)), 257e9, gcds, 191.5e12, mfu)
              for gcds, mfu in ((1024, 0.3), (4096, 0.25), (256, 0.4))]


def grade_training_days(fn, source) -> str:
    for n, tokens, gcds, peak, mfu in DAYS_CASES:
        got = attempt(fn, n, tokens, gcds, peak, mfu)
        want = reference_days(n, tokens, gcds, peak, mfu)
        if got is None or abs(got - want) > 1e-3 * want:
            raise Wrong(f"{n / 1e9:.1f}B parameters, {tokens / 1e9:.0f}B tokens, {gcds} GCDs at {mfu:.0%} MFU: "
                        f"you say {got!r} days, 6·N·D / (GCDs · peak · MFU) gives {want:.1f}")
    return f"e.g. {DAYS_CASES[0][2]} GCDs at 30% MFU: {reference_days(*DAYS_CASES[0]):.1f} days"


register(Exercise(
    name="training_days", notebook="01", title="Days to train the workshop's 22B model",
    grade=grade_training_days,
    hints=("Training costs about 6 FLOPs per parameter per token: 2 in the forward pass, 4 in the backward.",
           "The machine does devices x peak FLOP/s x MFU useful FLOPs per second; a day is 86,400 s."),
    solution='''
def training_days(n_params, tokens, gcds, peak_flops, mfu):
    return 6 * n_params * tokens / (gcds * peak_flops * mfu) / 86400
'''))


# ---------------------------------------------------------------- find the bug: gradient accumulation

def grade_accumulate(fn, source) -> str:
    """The accumulated gradient of 4 micro-batches must equal the gradient of the whole batch."""
    import torch

    from ..model import TinyGPT, get_preset, lm_loss
    torch.manual_seed(0)
    model = TinyGPT(get_preset("nano").with_vocab(57))
    x = torch.randint(0, 57, (8, 32))
    y = torch.roll(x, -1, dims=1)
    lm_loss(model(x), y).backward()
    full = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    attempt(fn, model, [(x[i:i + 2], y[i:i + 2]) for i in range(0, 8, 2)])
    got = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])
    ratio = (got.norm() / full.norm()).item()
    if not torch.allclose(got, full, rtol=1e-4, atol=1e-7):
        raise Wrong(f"the accumulated gradient's norm is {ratio:.2f}x the whole batch's ({got.norm():.4f} vs "
                    f"{full.norm():.4f}). Under AdamW the losses would still look right (Adam ignores a common "
                    "scale), so only the gradients show it")
    return "4 micro-batches give the gradient of the whole batch"


register(Exercise(
    name="accumulate", notebook="01", title="Find the bug: gradient accumulation",
    grade=grade_accumulate, bug_lab=True,
    cause=("sum of 4 mean losses", "sum of the 4 mean losses", "sum of the micro-batches' mean",
           "divided by the number of micro-batches", "divide each micro-batch", "len(micro_batches)",
           "4 times the mean"),
    hints=("Gradients of successive backward passes add up in .grad. Which loss is the whole batch's gradient the "
           "gradient of, and which losses does the loop differentiate?",
           "The whole batch's loss is the mean over all its sequences: each micro-batch's mean loss must be "
           "divided by the number of micro-batches before backward."),
    lesson=("Each micro-batch's loss is already a mean over its own sequences, and the gradients of successive "
            "backward passes add up in .grad: after 4 micro-batches .grad holds the gradient of the sum of 4 mean "
            "losses, 4 times the mean that one pass over the whole batch differentiates. Dividing each micro-batch's "
            "loss by the number of micro-batches before its backward makes the sum the mean (so does dividing the "
            "gradients once after the last one). labsupport's loop does the former (`forward_backward` in "
            "labsupport/parallel/strategy.py: `loss / len(batches)`). Under AdamW the losses could not show the "
            "factor, since Adam divides by the root of its running mean of squared gradients; clipping at a fixed "
            "norm, SGD, or a change in the number of micro-batches would."),
    solution='''
from labsupport.model import lm_loss


def accumulate(model, micro_batches):
    for x, y in micro_batches:
        loss = lm_loss(model(x), y)
        (loss / len(micro_batches)).backward()   # the mean over the whole batch
'''))


# ---------------------------------------------------------------- find the bug: fp16, clip before unscale

def reference_fp16_step(model, optimizer, scaler, x, y, max_norm=1.0):
    """torch's recipe (and loop.train_step's order): unscale, then clip, then step and update."""
    import torch

    from ..model import lm_loss
    with torch.autocast("cpu", dtype=torch.float16):
        loss = lm_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _fp16_run(step):
    """Three fp16 steps of nano with `step`, from the same start and batches every time: (the gradient norms it
    returns, the weights before the first step, the weights after the third)."""
    import torch

    from ..model import TinyGPT, get_preset
    torch.manual_seed(0)
    model = TinyGPT(get_preset("nano").with_vocab(57))
    start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    gen = torch.Generator().manual_seed(0)
    norms = []
    for _ in range(3):
        x = torch.randint(0, 57, (4, 32), generator=gen)
        norms.append(float(attempt(step, model, optimizer, scaler, x, torch.roll(x, -1, dims=1))))
    return norms, start, torch.cat([p.detach().flatten() for p in model.parameters()])


def scaled_clip_fp16_step(model, optimizer, scaler, x, y, max_norm=1.0):
    """The recipe with its clip moved before the unscale, at max_norm x S: what an attendee who saw the
    shipped norm tries next. scaler.step unscales what the clip left."""
    import torch

    from ..model import lm_loss
    with torch.autocast("cpu", dtype=torch.float16):
        loss = lm_loss(model(x), y)
    scaler.scale(loss).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm


@functools.lru_cache(maxsize=2)
def _cached_fp16_run(step):
    """A reference step's run, the same on every check: computed once."""
    return _fp16_run(step)


def grade_fp16_step(fn, source) -> str:
    """Three fp16 steps of nano from the same start: the attendee's and the reference's must return the
    same gradient norms and leave the same weights (to 1e-6). The feedback says what the attendee would
    see: the norm the step returns (what a log shows) and how far the weights moved, against the recipe's.

    One answer gets its own account: the clip of the still-scaled gradients at max_norm x S, recognised by
    its weights (scaled_clip_fp16_step's run). It is the recipe's clip but for clip_grad_norm_'s 1e-6
    guard against a zero norm, which weighs S times less beside the scaled norm: the clip factor differs by
    about 1e-6 / norm, the first step's weights by 4e-9, and fp16's forward passes and Adam (which divides
    each gradient by its own size) magnify that over the next two steps, so a few % of the weights end
    more than 1e-6 away. Multiplying by S is exact in fp32: the order alone changes nothing else."""
    import torch
    norms, start, weights = _fp16_run(fn)
    want, _, ref_weights = _cached_fp16_run(reference_fp16_step)
    differ = [i for i, (a, b) in enumerate(zip(norms, want)) if not abs(a / b - 1) <= 1e-3]  # nan differs too
    i = differ[0] if differ else 0
    ratio = norms[i] / want[i]
    recipes = torch.allclose(weights, ref_weights, rtol=0, atol=1e-6)
    off = int(((weights - ref_weights).abs() > 1e-6).sum())
    scaled_clip = torch.allclose(weights, _cached_fp16_run(scaled_clip_fp16_step)[2], rtol=0, atol=1e-6)
    returns = (f"{f'at step {i + 1} ' if i else ''}the step returns a gradient norm of {norms[i]:.4g} where torch's "
               f"recipe, from the same start, returns {want[i]:.4g}")
    if scaled_clip and not recipes:
        norm_line = ("" if not differ else
                     f" The norm it returns, {norms[i]:.4g}, is {ratio:,.0f} times the recipe's {want[i]:.4g}: "
                     "it is measured before the unscale.")
        raise Wrong(f"your step clips the still-scaled gradients at max_norm x S. That is the recipe's clip but for "
                    f"clip_grad_norm_'s 1e-6 guard against a zero norm, which weighs S times less beside the scaled "
                    f"norm: the first step agrees to about 4e-9, and fp16's forward passes and Adam magnify that, so "
                    f"after 3 steps {off:,} of {weights.numel():,} weights differ from the recipe's by more than "
                    f"1e-6.{norm_line} The check asks for the recipe's order: unscale, then clip at max_norm")
    if differ:
        if recipes:
            raise Wrong(f"your step's updates are the recipe's, but {returns} (the unscaled gradients' norm, "
                        "before the clip)")
        far = ((weights - start).norm() / (ref_weights - start).norm()).item()
        raise Wrong(f"{returns}, and after 3 steps the weights have moved {far:.2f}x as far from their start as "
                    "the recipe's")
    if not recipes:
        far = ((weights - start).norm() / (ref_weights - start).norm()).item()
        raise Wrong(f"the gradient norms are right, but after 3 steps the weights have moved {far:.2f}x as far from "
                    f"their start as the recipe's, and {off:,} of {weights.numel():,} differ from the recipe's by more "
                    "than 1e-6")
    return f"unscaled before the clip: true gradient norms ({want[0]:.3f}, ...), weights as the reference's"


register(Exercise(
    name="fp16_step", notebook="01", title="Find the bug: an fp16 step with a gradient clip",
    grade=grade_fp16_step, bug_lab=True,
    cause=("unscale first", "unscale_ first", "unscale before", "before unscal", "before it unscales",
           "clips the scaled", "scaled gradients", "clip by the true", "the clip measures the scaled"),
    hints=("After `scaler.scale(loss).backward()` every gradient is S times the true one. What does the clip "
           "measure, and which threshold does it compare that with?",
           "`scaler.unscale_(optimizer)` divides the gradients by S. The clip must see the true gradients: "
           "unscale first, then clip; `scaler.step` will not unscale twice."),
    lesson=("After `scaler.scale(loss).backward()` every gradient is S times the true one, and the buggy step clipped "
            "before `scaler.unscale_`: `clip_grad_norm_` measured and returned S times the true norm and compared "
            "that with max_norm, so it clipped steps that needed no clipping and shrank the others S times more "
            "than it should. Unscale first, then clip: `scaler.unscale_(optimizer)` divides the gradients by S "
            "in place and `scaler.step` does not unscale a second time. labsupport's loop (`train_step` in "
            "labsupport/loop.py) keeps the same order for every strategy: backward from the scaled loss, make "
            "the gradients global, unscale (the ranks agree on whether any of them overflowed), clip by the "
            "true global norm, then step and update the scale. `tests/test_fp16.py` plants this very bug in the "
            "loop and checks that the comparison with fp32 catches it."),
    solution='''
import torch

from labsupport.model import lm_loss


def fp16_step(model, optimizer, scaler, x, y, max_norm=1.0):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = lm_loss(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)                     # the true gradients first ...
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)   # ... then the clip measures them
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm
'''))


# Predict, then run: what `lab.reveal(guess_NAME, ..., why="NAME")` prints after the answer, kept here
# and not in the notebook's cell, which the attendee reads before predicting.
# A {field} is a value the cell passes: why="NAME", field=value.
WHY = {
    "params": ("The {n_layers} blocks hold {blocks_share:.0%} of them (12·d² + 13·d each); with 57 characters and "
               "128 positions the embeddings are small."),
    "optimizer_mb": ("8 bytes (Adam's two fp32 moments) x {padded_params:,} parameters, the vocabulary padding rows "
                     "included, + a 4-byte `step` per tensor ({n_tensors} tensors): {optimizer_bytes:,} bytes."),
    "fp16_skipped": ("The first backward at S = {first_scale:,.0f} overflowed fp16 ({largest:,} is its largest number): "
                     "the step was skipped and S halved, {skipped} times, until S = {good_scale:,.0f} let the "
                     "gradients through: S halves only until the scaled gradients fit, so the count depends on how large "
                     "the gradients are, not on how far S lies above the default. Each skip costs a whole step of "
                     "compute and teaches the model nothing; "
                     "from GradScaler's default 65,536 a run usually skips none or a few."),
    "mfu_percent": ("On a CPU the peak is this machine's own fp32 matmul rate, measured as the run starts. A step "
                    "also spends time outside the large matmuls (attention's small ones, softmax, LayerNorm, the "
                    "optimizer, Python), and on a shared machine the peak and the throughput both move with the "
                    "other programs (section 7), so the figure changes from run to run and machine to machine. On a "
                    "GPU this tiny model would reach a few percent (see below)."),
}
