"""Training's launcher side: the options, their checks, the launch and the summary. The loop that
every rank runs is loop.py.

Run it on N ranks with `labsupport train --strategy NAME --nproc N` or `run(strategy=NAME, nproc=N)`,
or directly as `torchrun --nproc-per-node N -m labsupport.train ...`, or as `python -m labsupport.train`
for one process.

The options are checked once, before any process starts (`validate`): `run()` checks them in the
launching process and starts `-m labsupport.loop` on the ranks with what it checked, as JSON in
LABSUPPORT_TRAIN_CONFIG; each rank loads that instead of parsing and checking again. Started
without `run()` (a bare torchrun, a job script), each rank parses its command line and checks it
itself (`main`), then runs the loop.

This module imports no torch, so `labsupport train --help` and a notebook's `from labsupport.train
import run` start at once; checking a configuration asks the steps of the composition, which do.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .estimate.schedules import SCHEDULES
from .estimate.shapes import CPU_PRESETS, DEFAULT_PRESET, PRESETS, ModelConfig, get_preset, preset_shape
from .parallel import DDP_MODES, STRATEGIES, ConfigError, ParallelConfig, strategy_names
from .text import DataError, load_text, vocabulary

CHECKED_ENV = "LABSUPPORT_TRAIN_CONFIG"  # where run() hands its ranks the checked options, as JSON
DTYPES = ("fp32", "bf16", "fp16")  # --dtype: fp32, or what autocast computes in (loop.AUTOCAST)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labsupport train", description="Train TinyGPT with a parallel strategy.")
    p.add_argument("--strategy", default="single", help=f"one of: {', '.join(strategy_names())}")
    p.add_argument("--model", default=DEFAULT_PRESET, help=f"preset: {', '.join(PRESETS)}")
    p.add_argument("--data", default=None, help="UTF-8 text file (default: the shipped corpus)")
    p.add_argument("--steps", type=int, default=200, help="total optimizer steps of the run (and of the LR schedule)")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step, any world size")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (default: no accumulation)")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr", type=float, default=None, help="end of the cosine (default: lr/10)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default: 10%% of --steps)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default="fp32",
                   help="fp32; or autocast to bf16, or to fp16 with dynamic loss scaling (fp32 weights, gradients, Adam)")
    p.add_argument("--loss-scale", type=float, default=None,
                   help="fp16: the initial loss scale (default 65536, torch's GradScaler's), halved on overflow")
    p.add_argument("--eval-every", type=int, default=0, help="validation every K steps (0: at the end only)")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--sample-chars", type=int, default=200, help="characters generated at the end (0: none)")
    p.add_argument("--log-every", type=int, default=0, help="progress line every K steps (0: ten lines per run)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: what tp x pp leave)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (stages)")
    p.add_argument("--zero", type=int, default=None, help="ZeRO stage 0-3 (default: the strategy's; accelerate-fsdp: 3)")
    p.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="pipeline schedule")
    p.add_argument("--microbatches", type=int, default=None,
                   help="pipeline micro-batches per step (default: --pp, one per stage)")
    p.add_argument("--chunks", type=int, default=1, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel degree: the sequence cut over cp ranks (ring attention)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree: the experts spread over ep of the dp ranks")
    p.add_argument("--experts", type=int, default=0, help="a mixture of E experts in place of every MLP (0: dense)")
    p.add_argument("--top-k", type=int, default=2, help="--experts: experts per token")
    p.add_argument("--capacity-factor", type=float, default=None,
                   help="--experts: an expert's capacity as a multiple of its balanced share (default: none, nothing dropped)")
    p.add_argument("--sequence-parallel", action="store_true", help="tensor parallel: shard LayerNorm/dropout regions")
    p.add_argument("--ddp-mode", choices=DDP_MODES, default="bucketed", help="ddp: how gradients are all-reduced")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="ddp/torch-ddp: gradient bucket size in MiB")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="ddp/torch-ddp: allow parameters that get a gradient on some ranks only")
    p.add_argument("--dp-replicate", type=int, default=1, metavar="R",
                   help="zero3: R replicas of dp/R ranks each, ZeRO-3 inside each, gradients averaged across (HSDP)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="zero3: gather each unit only when it is needed (no overlap with the one before)")
    p.add_argument("--accelerate-config", default=None, metavar="FILE",
                   help="launch with `accelerate launch --config_file FILE` (an FSDP or DeepSpeed config); "
                        "FILE sets the strategy, ranks and ZeRO stage")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    return p


def parallel_config(args, world_size: int) -> ParallelConfig:
    """The run's parallel configuration from the command line: strategies read this, never `args`."""
    return ParallelConfig.build(
        world_size, strategy=args.strategy, dp=args.dp, tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, zero=args.zero,
        schedule=args.schedule, microbatches=args.microbatches, chunks=args.chunks,
        sequence_parallel=args.sequence_parallel, ddp_mode=args.ddp_mode, bucket_mb=args.bucket_mb,
        find_unused_parameters=args.find_unused_parameters, prefetch=not args.no_prefetch,
        dp_replicate=args.dp_replicate)


def layout(config: ParallelConfig, world_size: int) -> dict:
    """What a checkpoint records about the run that wrote it, and a resume must match."""
    return {**config.layout(), "world_size": world_size}


def check_resume(checkpoint_dir, expected: dict) -> None:
    """Refuse to resume a checkpoint written with another strategy or rank grid."""
    from . import checkpoint  # torch: only a resume reads a checkpoint
    step = checkpoint.latest(checkpoint_dir)
    saved = checkpoint.layout(checkpoint_dir, step) if step is not None else None
    if saved is not None and saved != expected:
        def say(lay):
            extra = "".join(f", {key} {lay[key]}" for key in ("chunks", "cp", "ep", "dp_replicate") if key in lay)
            return (f"{lay['strategy']} on {lay['world_size']} rank(s) (dp {lay['dp']}, tp {lay['tp']}, "
                    f"pp {lay['pp']}, zero {lay['zero']}{extra})")
        raise ValueError(f"the checkpoint at step {step} in {checkpoint_dir} was written by {say(saved)}, "
                         f"this run is {say(expected)}; resume with the same layout or use a new --checkpoint-dir")


def validate(args, world_size: int) -> tuple[ModelConfig, ParallelConfig]:
    """Refuse bad arguments before any rank starts: one line per mistake (ConfigError) or one DataError.
    Returns what the ranks build from: the model's shape and the parallel configuration. (The steps'
    checks import the composition, hence torch, when this runs.)"""
    cfg = get_preset(args.model)
    if cfg.vocab is not None:
        raise ValueError(f"preset {args.model!r} is an analysis shape ({cfg.n_layers} layers, hidden {cfg.hidden}); "
                         f"train one of the CPU presets: {', '.join(CPU_PRESETS)}")
    problems = []
    for name in ("steps", "global_batch"):
        if getattr(args, name) < 1:
            problems.append(f"--{name.replace('_', '-')} must be >= 1")
    if args.seq_len is not None and args.seq_len < 1:
        problems.append("--seq-len must be >= 1")
    if args.checkpoint_every and not args.checkpoint_dir:
        problems.append("--checkpoint-every needs --checkpoint-dir")
    if args.resume and not args.checkpoint_dir:
        problems.append("--resume needs --checkpoint-dir")
    if args.checkpoint_every < 0 or args.eval_every < 0:
        problems.append("--checkpoint-every and --eval-every must be >= 0")
    if not 0 <= args.dropout < 1:
        problems.append("--dropout must be in [0, 1)")
    if args.experts < 0:
        problems.append("--experts must be >= 0 (0: the dense MLP)")
    if args.dtype == "fp16":
        problems += fp16_problems(args.strategy)
    if args.loss_scale is not None and (args.dtype != "fp16" or not args.loss_scale > 0):
        problems.append("--loss-scale must be > 0 and needs --dtype fp16 (bf16 and fp32 need no loss scaling)")
    elif args.loss_scale is not None and math.log2(args.loss_scale) % 1:
        problems.append(f"--loss-scale must be a power of two (got {args.loss_scale:g}): multiplying by one is exact, "
                        "and DeepSpeed's initial_scale_power is its exponent")
    if problems:
        raise ConfigError(problems)
    vocab = len(vocabulary(load_text(args.data))) if args.data is not None else None  # DataError for a bad file
    model = preset_shape(args.model, vocab, seq_len=args.seq_len, dropout=args.dropout, experts=args.experts,
                         top_k=args.top_k, capacity_factor=args.capacity_factor)
    config = parallel_config(args, world_size)
    config.check(world_size, model, args.global_batch, args.micro_batch)
    if args.resume:
        check_resume(args.checkpoint_dir, layout(config, world_size))
    return model, config


def fp16_problems(strategy: str) -> list[str]:
    """What stops `--dtype fp16` before any rank starts: a strategy whose backward does not start from
    the scaled loss (a library's own), or a device where autocast has no float16."""
    entry = STRATEGIES.get(strategy)
    if entry is None:
        return []  # an unknown name: ParallelConfig.check says so
    if not entry.load().fp16:
        return [f"--dtype fp16: {strategy} runs backward its library's way, without our loss scaling "
                "(which the presets of our composition have); use --dtype bf16"]
    import torch
    device = "cpu" if os.environ.get("LABSUPPORT_DEVICE") == "cpu" or not torch.cuda.is_available() else "cuda"
    problem = entry.load().fp16_problem(device)  # the device the ranks will pick (runtime.pick_device)
    return [problem] if problem else []


def dump_checked(args, model: ModelConfig, config: ParallelConfig) -> str:
    """What `validate` checked, as JSON: the options, the model's shape, the parallel configuration."""
    return json.dumps({"options": vars(args), "model": model.to_dict(), "parallel": config.to_dict()})


def load_checked(text: str) -> tuple[argparse.Namespace, ModelConfig, ParallelConfig]:
    """`dump_checked`'s JSON back as (args, model, config), as a rank of `run()` receives them."""
    checked = json.loads(text)
    return (argparse.Namespace(**checked["options"]), ModelConfig(**checked["model"]),
            ParallelConfig(**checked["parallel"]))


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to min_lr at the last step (GPT-3 style)."""
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    min_lr = args.min_lr if args.min_lr is not None else args.lr / 10
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def to_argv(**options) -> list[str]:
    """`to_argv(global_batch=8, resume=True)` -> ["--global-batch", "8", "--resume"]."""
    argv = []
    for key, value in options.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is not False and value is not None:
            argv += [flag, str(value)]
    return argv


def follow_accelerate_config(args, nproc: int) -> int:
    """Set what the --accelerate-config file says (accelerate_config.py) on `args`; return its number
    of ranks. A flag or `nproc` given otherwise is refused, one line each, rather than overridden."""
    from .accelerate_config import options
    wanted = options(args.accelerate_config, args.global_batch)
    ranks, defaults = wanted.pop("nproc"), build_parser()
    problems = [f"--{key.replace('_', '-')} {getattr(args, key)}, but {args.accelerate_config} says {value}"
                for key, value in wanted.items() if getattr(args, key) not in (value, defaults.get_default(key))]
    if nproc not in (1, ranks):
        problems.append(f"--nproc {nproc}, but {args.accelerate_config} says num_processes {ranks}")
    if problems:
        raise ConfigError(problems)
    for key, value in wanted.items():
        setattr(args, key, value)
    return ranks


def run(nproc: int = 1, timeout: float | None = None, ranks: str = "0", out=None, **options) -> dict:
    """Launch the loop (loop.py) on `nproc` ranks and return its summary (the `labsupport train --json` object).

    `options` are the command-line flags as keywords: `run(strategy="ddp", nproc=2, steps=20)`.
    Arguments are checked here, before any process starts.
    """
    return run_parsed(build_parser().parse_args(to_argv(**options)), nproc, timeout, ranks, out)


def run_parsed(args, nproc: int = 1, timeout: float | None = None, ranks: str = "0", out=None) -> dict:
    """`run` with the options already parsed (`labsupport train` parses them with its own flags).
    They are checked here, once; the ranks receive what was checked."""
    from .launch import launch
    if args.accelerate_config:
        nproc = follow_accelerate_config(args, nproc)
    model, config = validate(args, nproc)
    res = launch("-m", "labsupport.loop", nproc=nproc, timeout=timeout, ranks=ranks, out=out,
                 run_dir=args.run_dir, name=f"train-{args.strategy}", accelerate_config=args.accelerate_config,
                 env={CHECKED_ENV: dump_checked(args, model, config)})
    return summarize(args, config, nproc, [res.report(r) for r in range(nproc)], res)


def shared_clock(reports: list) -> list:
    """Every stage's pipeline events on one time axis: each rank timed its step from its own start,
    so shift each by how much later than the earliest rank's its start was (the ranks of one host
    read the same monotonic clock)."""
    zero = min(r["pipeline_origin"] for r in reports)
    return [[(a + r["pipeline_origin"] - zero, b + r["pipeline_origin"] - zero, *rest)
             for a, b, *rest in r["pipeline_events"]] for r in reports]


def summarize(args, config: ParallelConfig, nproc: int, reports: list[dict], res) -> dict:
    """The `labsupport train --json` object: rank 0's results, every rank's memory and traffic, the launch's
    duration and run directory (`res`)."""
    r0 = reports[0]
    summary = {key: r0[key] for key in ("model", "n_params", "losses", "grad_norms", "val_losses", "tokens_per_s",
                                        "mfu", "peak_flops", "peak_flops_source", "steps", "resumed_from",
                                        "step_s_median", "parallel")}
    summary.update({key: r0[key] for key in ("loss_scales", "skipped_steps") if key in r0})  # fp16
    summary.update(r0["forward_stats"])  # what the model's layers recorded of the last step
    summary.update(strategy=args.strategy, world_size=nproc, sample=r0.get("sample"), dtype=args.dtype,
                   global_batch=args.global_batch,
                   micro_batch=config.micro_batch_size(args.global_batch, args.micro_batch),
                   memory=[r["memory"] for r in reports], comm=[r["comm"] for r in reports],
                   comm_groups=[r["comm_groups"] for r in reports], duration_s=res.duration_s,
                   **({"pipeline_events": shared_clock(reports)} if "pipeline_events" in r0 else {}),
                   run_dir=str(res.run_dir))
    return summary


def main(argv=None) -> int:
    """A rank of a bare `torchrun -m labsupport.train ARGS` (a job script): it parses and checks its
    command line (every rank alike, rank 0 saying what is wrong), then runs the loop."""
    from .loop import run_rank
    from .runtime import detect
    args = build_parser().parse_args(argv)
    info = detect()
    try:
        cfg, config = validate(args, info.world_size)
    except (ValueError, DataError) as e:
        if info.rank == 0:
            for line in str(e).splitlines():
                print(f"error: {line}", file=sys.stderr)
        return 2
    return run_rank(args, cfg, config)


if __name__ == "__main__":
    sys.exit(main())
