"""What a DeepSpeed config does under Megatron-DeepSpeed, and where it contradicts the launch flags.

Megatron-DeepSpeed reads two descriptions of one run: its own flags (`--micro-batch-size`,
`--global-batch-size`, `--fp16`, `--clip-grad`, ...) and DeepSpeed's JSON config. Nothing compares
them, and several pairs silently disagree. The rules below are DeepSpeed's and the workshop fork's
(olcf/ai-training-series, Megatron-DeepSpeed-ORNL), read from their source:

* DeepSpeed derives the missing one of train_batch_size = train_micro_batch_size_per_gpu x
  gradient_accumulation_steps x DP from the two given, or sets accumulation to 1
  (`deepspeed/runtime/config.py`, `_set_batch_related_parameters`), and stops if the three disagree.
* Every step the fork calls `set_train_batch_size(--global-batch-size)`, which keeps DeepSpeed's
  micro-batch and sets accumulation = global batch / (DeepSpeed's micro-batch x DP); the pipeline
  engine runs that many micro-batches, each of `--micro-batch-size` sequences from Megatron's loader.
* Under `--deepspeed` the fork hands DeepSpeed its bare optimizer: DeepSpeed clips (gradient_clipping)
  and scales the loss (fp16); `--clip-grad` is not applied. An absent gradient_clipping meant no
  clipping until 2026, when DeepSpeed's default became 1.0 (deepspeedai/DeepSpeed#8068): what such a
  config does depends on the DeepSpeed it meets.
* DeepSpeed's PipelineEngine accepts ZeRO stage 0 or 1 only.

No torch, no DeepSpeed: `labsupport plan --check-config` answers at once, also where DeepSpeed is not
installed; tests/test_ds_check.py holds these readings to DeepSpeed's own parser.
"""
from __future__ import annotations

import argparse
import json

from .estimate.simulator import bubble_over_ideal

# DeepSpeed's gradient_clipping for a config without the key (deepspeed/runtime/constants.py,
# GRADIENT_CLIPPING_DEFAULT): 0, no clipping, in the DeepSpeed the workshop ran; 1.0 since #8068.
CLIP_DEFAULT_BEFORE_8068, CLIP_DEFAULT = 0.0, 1.0
ABSENT_CLIP = (f"absent: DeepSpeed's default, {CLIP_DEFAULT_BEFORE_8068:g} (no clipping) before 2026, "
               f"{CLIP_DEFAULT:g} since (deepspeedai/DeepSpeed#8068)")


class _Flags(argparse.ArgumentParser):
    """Megatron's flags that meet the config; every other flag is left to Megatron."""

    def error(self, message):
        raise ValueError(f"Megatron flags: {message}")


def megatron_flags(argv: list[str]) -> dict:
    """The flags of `argv` that a ds_config can contradict, with Megatron's defaults."""
    p = _Flags(add_help=False, allow_abbrev=False)
    p.add_argument("--tensor-model-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", dest="pp", type=int, default=1)
    p.add_argument("--micro-batch-size", dest="micro_batch", type=int, default=None)
    p.add_argument("--global-batch-size", dest="global_batch", type=int, default=None)
    p.add_argument("--clip-grad", dest="clip_grad", type=float, default=1.0)
    p.add_argument("--zero-stage", dest="zero_stage", type=int, default=1)   # the fork's default
    p.add_argument("--no-pipeline-parallel", dest="no_pipeline", action="store_true")
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--bf16", action="store_true")
    flags = vars(p.parse_known_args(argv)[0])
    if flags["micro_batch"] is None:
        raise ValueError("Megatron flags: --micro-batch-size is missing (Megatron requires it)")
    if flags["fp16"] and flags["bf16"]:
        raise ValueError("Megatron flags: --fp16 and --bf16 together (Megatron takes one)")
    fp16, bf16 = flags.pop("fp16"), flags.pop("bf16")
    flags["precision"] = "fp16" if fp16 else "bf16" if bf16 else "fp32"
    return flags


def load(path: str) -> dict:
    """The config in `path`; a file that is not a JSON object is one line of error."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except OSError as e:
        raise ValueError(f"{path}: cannot read it ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a ds_config is a JSON object {{...}}, this is a {type(config).__name__}")
    return config


def batch_sizes(config: dict, dp: int) -> tuple[int, int, int]:
    """(train_batch_size, micro-batch, accumulation) as DeepSpeed completes them for `dp` DP ranks."""
    train, micro = config.get("train_batch_size"), config.get("train_micro_batch_size_per_gpu")
    accum = config.get("gradient_accumulation_steps")
    if train is None and micro is None:
        raise ValueError("the config gives neither train_batch_size nor train_micro_batch_size_per_gpu "
                         "(DeepSpeed needs one)")
    if train is not None and micro is not None and accum is None:
        accum = train // micro // dp
    elif train is not None and micro is None:
        accum = accum or 1
        micro = train // dp // accum
    elif train is None:
        accum = accum or 1
        train = micro * accum * dp
    return train, micro, accum


def precision(config: dict) -> str:
    """The 16-bit format the config enables, or fp32."""
    on = [k for k in ("fp16", "bf16") if config.get(k, {}).get("enabled", False)]
    if len(on) == 2:
        raise ValueError("the config enables fp16 and bf16 together (DeepSpeed takes one)")
    return on[0] if on else "fp32"


def explain(config: dict, dp: int) -> list[str]:
    """What the config makes DeepSpeed do, one line per part."""
    train, micro, accum = batch_sizes(config, dp)
    given = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
             if k in config]
    lines = [f"batch: {micro} sequence(s) per micro-batch per GPU x {accum} micro-batch(es) per step x DP {dp} "
             f"= {train} sequences a step at start-up (given: {', '.join(given)}; DeepSpeed derives the rest)"]
    half = precision(config)
    if half == "fp16":
        power = config["fp16"].get("initial_scale_power", 16)
        scale = config["fp16"].get("loss_scale", 0)
        lines.append("fp16: 16-bit weights, activations and gradients; " + (
            f"dynamic loss scaling from 2**{power}, halved on an overflow (the step skipped), raised after a run of "
            "clean steps" if scale == 0 else f"a fixed loss scale of {scale:g}"))
    else:
        lines.append({"bf16": "bf16: 16-bit weights, activations and gradients with fp32's range: no loss scaling",
                      "fp32": "fp32: neither fp16 nor bf16 enabled"}[half])
    stage = config.get("zero_optimization", {}).get("stage", 0)
    sharded = {0: "nothing: every DP rank holds the whole optimizer state", 1: "the fp32 master weights and Adam's "
               "moments", 2: "the optimizer states and the gradients", 3: "the optimizer states, gradients and "
               "parameters"}[stage]
    if stage and dp == 1:
        lines.append(f"ZeRO stage {stage}: would shard {sharded} over the DP ranks; with DP 1 it shards nothing")
    else:
        lines.append(f"ZeRO stage {stage}: shards {sharded}" + (f" over the {dp} DP ranks" if stage else ""))
    clip = config.get("gradient_clipping")
    lines.append(f"gradient clipping: {ABSENT_CLIP}" if clip is None else
                 f"gradient clipping: global norm clipped to {clip:g}" if clip else "gradient clipping: none (0)")
    if "optimizer" in config:
        params = config["optimizer"].get("params", {})
        auto = [k for k, v in params.items() if v == "auto"]
        lines.append(f"optimizer: DeepSpeed builds {config['optimizer'].get('type')} from this block only when the "
                     "program passes none; Megatron-DeepSpeed passes its own, so the block is unused"
                     + (f"; \"auto\" ({', '.join(auto)}) is Hugging Face Trainer's placeholder, which DeepSpeed "
                        "itself never fills in" if auto else ""))
    return lines


def contradictions(config: dict, flags: dict, gpus: int) -> list[str]:
    """Each disagreement between the config and Megatron's flags on `gpus` GPUs, one line each."""
    tp, pp, micro = flags["tp"], flags["pp"], flags["micro_batch"]
    if gpus % (tp * pp):
        raise ValueError(f"tp x pp = {tp} x {pp} = {tp * pp} does not divide the {gpus} GPUs")
    dp = gpus // (tp * pp)
    global_batch = flags["global_batch"] or micro * dp
    if global_batch % (micro * dp):
        return [f"--global-batch-size {global_batch} is not a multiple of --micro-batch-size {micro} x DP {dp}: "
                "Megatron stops at start-up"]
    m = global_batch // (micro * dp)
    train, ds_micro, accum = batch_sizes(config, dp)
    lines = []
    if train != ds_micro * accum * dp:
        lines.append(f"train_batch_size {train} != train_micro_batch_size_per_gpu {ds_micro} x "
                     f"gradient_accumulation_steps {accum} x DP {dp}: DeepSpeed stops at start-up")
    elif "train_batch_size" in config and train != global_batch:
        lines.append(f"train_batch_size {train} vs --global-batch-size {global_batch}: Megatron-DeepSpeed resets "
                     f"DeepSpeed's batch to {global_batch} every step; the file's value only passes the start-up check")
    if ds_micro != micro:
        if global_batch % (ds_micro * dp):
            lines.append(f"train_micro_batch_size_per_gpu {ds_micro} vs --micro-batch-size {micro}: "
                         f"--global-batch-size {global_batch} is not a multiple of {ds_micro} x DP {dp}, so "
                         "DeepSpeed's set_train_batch_size stops the run at its first step")
        else:
            ds_m = global_batch // (ds_micro * dp)
            line = (f"train_micro_batch_size_per_gpu {ds_micro} vs --micro-batch-size {micro}: Megatron's loader "
                    f"makes micro-batches of {micro}, DeepSpeed accumulates {global_batch} / ({ds_micro} x DP {dp}) "
                    f"= {ds_m} of them, so a step trains {ds_m * micro * dp} sequences, not {global_batch}")
            if pp > 1 and not flags["no_pipeline"]:
                line += (f"; the pipeline runs {ds_m} micro-batches, not {m}: bubble (p-1)/m = "
                         f"{bubble_over_ideal(pp, ds_m, 1):.0%}, not {bubble_over_ideal(pp, m, 1):.0%}")
            lines.append(line)
    half = precision(config)
    if half != flags["precision"]:
        flag = f"--{flags['precision']}" if flags["precision"] != "fp32" else "neither --fp16 nor --bf16"
        lines.append(f"{flag} but the config enables {half if half != 'fp32' else 'neither fp16 nor bf16'}: "
                     f"Megatron builds the model in {flags['precision']}, DeepSpeed picks its optimizer wrapper and "
                     f"loss scaling for {half}")
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage >= 2 and pp > 1 and not flags["no_pipeline"]:
        lines.append(f"ZeRO stage {stage} with --pipeline-model-parallel-size {pp}: DeepSpeed's PipelineEngine "
                     "takes stage 0 or 1 only (\"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism\")")
    if flags["zero_stage"] != stage:
        lines.append(f"--zero-stage {flags['zero_stage']} vs the config's stage {stage}: DeepSpeed runs stage "
                     f"{stage}; Megatron uses --zero-stage only to build the model inside ZeRO-3's zero.Init (3) "
                     "and to sum its optimizer statistics (above 0)")
    clip = config.get("gradient_clipping")
    if clip is None:
        lines.append(f"--clip-grad {flags['clip_grad']:g} vs gradient_clipping {ABSENT_CLIP}: under --deepspeed "
                     "only DeepSpeed clips, so write it out")
    elif clip != flags["clip_grad"]:
        lines.append(f"--clip-grad {flags['clip_grad']:g} vs gradient_clipping {clip:g}: under --deepspeed only "
                     "DeepSpeed clips, so the run " + (f"clips at {clip:g}" if clip else "does not clip at all"))
    return lines
