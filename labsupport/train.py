"""The one training loop. Every strategy, from `single` to 3D, runs through `train()`.

Run it on N ranks with `labsupport train --strategy NAME --nproc N`, or directly as
`torchrun --nproc-per-node N -m labsupport.train ...`, or as `python -m labsupport.train`
for one process. The global batch (`--global-batch` sequences per optimizer step) is the same
whatever the world size, so every strategy can be compared with `single` step by step:

    global batch = micro-batch x accumulation steps x data-parallel ranks

A step is the same five moves for every strategy (`train_step`): forward and backward over
the micro-batches, finish the gradients, clip them by their global norm, the optimizer step,
and the step's loss. How each move is done is the strategy's business (ARCHITECTURE.md);
memory, tracing, evaluation, sampling and checkpoints are separate functions around it.

The options are checked once, before any process starts (`validate`): `run()` checks them in the
launching process and hands the ranks what it checked, as JSON in LABSUPPORT_TRAIN_CONFIG; each
rank loads that instead of parsing and checking again. Started without `run()` (a bare torchrun,
a job script), each rank parses its command line and checks it itself.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from . import checkpoint, comm, runtime
from .data import BatchSampler, Corpus, DataError, load_text, micro_batches, vocabulary
from .estimate.params import count_params
from .estimate.schedules import SCHEDULES
from .estimate.shapes import CPU_PRESETS, DEFAULT_PRESET, PRESETS, ModelConfig, get_preset, preset_shape
from .metrics import ActivationMeter, JsonlWriter, device_peak, grad_bytes, mfu, optimizer_bytes, param_bytes
from .model import TinyGPT, forward_stats, generate
from .parallel import DDP_MODES, STRATEGIES, ConfigError, ParallelConfig, make_strategy, strategy_names
from .rundir import make_run_dir

CHECKED_ENV = "LABSUPPORT_TRAIN_CONFIG"  # where run() hands its ranks the checked options, as JSON
AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype: what autocast computes in


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
    p.add_argument("--dtype", choices=list(AUTOCAST), default="fp32",
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
        find_unused_parameters=args.find_unused_parameters, prefetch=not args.no_prefetch)


def layout(config: ParallelConfig, world_size: int) -> dict:
    """What a checkpoint records about the run that wrote it, and a resume must match."""
    return {**config.layout(), "world_size": world_size}


def check_resume(checkpoint_dir, expected: dict) -> None:
    """Refuse to resume a checkpoint written with another strategy or rank grid."""
    step = checkpoint.latest(checkpoint_dir)
    saved = checkpoint.layout(checkpoint_dir, step) if step is not None else None
    if saved is not None and saved != expected:
        def say(lay):
            extra = "".join(f", {key} {lay[key]}" for key in ("chunks", "cp", "ep") if key in lay)
            return (f"{lay['strategy']} on {lay['world_size']} rank(s) (dp {lay['dp']}, tp {lay['tp']}, "
                    f"pp {lay['pp']}, zero {lay['zero']}{extra})")
        raise ValueError(f"the checkpoint at step {step} in {checkpoint_dir} was written by {say(saved)}, "
                         f"this run is {say(expected)}; resume with the same layout or use a new --checkpoint-dir")


def validate(args, world_size: int) -> tuple[ModelConfig, ParallelConfig]:
    """Refuse bad arguments before any rank starts: one line per mistake (ConfigError) or one DataError.
    Returns what the ranks build from: the model's shape and the parallel configuration."""
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


def train_step(strategy, model, optimizer, batches, grad_clip: float, autocast=None, scaler=None):
    """One optimizer step over this rank's micro-batches; returns (this rank's mean loss, global grad norm).

    Under fp16, `scaler` (the strategy's `loss_scaler`, loss_scale.py): the backward started from the
    scaled loss, so the gradients are unscaled before the clip measures them, and the update is
    skipped on every rank when one found an inf or NaN."""
    optimizer.zero_grad(set_to_none=True)
    loss = strategy.forward_backward(model, batches, autocast)
    with comm.phase("finish_backward"):
        strategy.finish_backward(model)
    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = strategy.clip_grad_norm_(model, grad_clip)
    with comm.phase("optimizer"):
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
    return loss, grad_norm


class MemoryPeaks:
    """Each category's peak over the run, measured from the tensors (the `memory` JSON key)."""

    def __init__(self, device):
        self.device = device
        self.peaks = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "peak": 0}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def update(self, model, optimizer, activations: int) -> dict:
        """After a step: gradients are still there (they are cleared at the next step's start)."""
        now = {"params": param_bytes(model), "grads": grad_bytes(model, optimizer), "optimizer": optimizer_bytes(optimizer),
               "activations": activations}
        for key, value in now.items():
            self.peaks[key] = max(self.peaks[key], value)
        self.peaks["peak"] = (torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda"
                              else max(self.peaks["peak"], sum(now.values())))
        return dict(self.peaks)


def evaluate(strategy, model, data, cfg, args, device) -> float:
    """Mean loss over fixed validation batches, each data-parallel rank taking its share."""
    sampler = BatchSampler(data, cfg.seq_len, args.global_batch, seed=args.seed + 1)
    dp_rank, dp_size = strategy.data_rank()
    model.eval()
    losses = [strategy.evaluate_loss(model, x.to(device), y.to(device))
              for x, y in (sampler.local_batch(i, dp_rank, dp_size) for i in range(args.eval_batches))]
    model.train()
    return strategy.reduce_loss(torch.stack(losses).mean())


def sample(strategy, model, corpus, cfg, n_chars: int, seed: int, device) -> str:
    """Text generated from one real character of the validation text; every rank takes part."""
    gen = torch.Generator(device=device).manual_seed(seed)
    prompt = corpus.val[:1].unsqueeze(0).to(device)
    model.eval()
    ids = generate(lambda idx: strategy.logits(model, idx), prompt, n_chars, cfg.seq_len, 0.8, gen)
    model.train()
    return corpus.tokenizer.decode(ids[0, 1:])


def save_checkpoint(args, rt, strategy, model, optimizer, step, history, run_layout) -> None:
    strategy.save_state(checkpoint.step_dir(args.checkpoint_dir, step))
    checkpoint.save(args.checkpoint_dir, step, rt.rank, {
        "model": strategy.model_state(model), "optimizer": strategy.optimizer_state(optimizer),
        "rng": checkpoint.rng_state(), "step": step,
        **({"loss_scaler": strategy.loss_scaler.state_dict()} if strategy.loss_scaler is not None else {}),
        **{key: torch.tensor(values, dtype=torch.float64) for key, values in history.items()}},
        barrier=lambda: comm.barrier() if rt.distributed else None, layout=run_layout)


def resume(args, rt, strategy, model, optimizer, run_layout) -> tuple[int, dict]:
    """Load the latest complete checkpoint, if any: (its step, the losses and norms so far, and
    under fp16 each step's loss scale and the steps skipped)."""
    history = {"losses": [], "grad_norms": []}
    if strategy.loss_scaler is not None:
        history.update(loss_scales=[], skipped_steps=[])
    step = checkpoint.latest(args.checkpoint_dir) if args.resume else None
    if step is None:
        return 0, history
    check_resume(args.checkpoint_dir, run_layout)
    state = checkpoint.load(args.checkpoint_dir, step, rt.rank)
    strategy.load_model_state(model, state["model"])
    strategy.load_optimizer_state(optimizer, state["optimizer"])
    strategy.load_state(checkpoint.step_dir(args.checkpoint_dir, step))
    checkpoint.set_rng_state(state["rng"])
    if strategy.loss_scaler is not None:
        strategy.loss_scaler.load_state_dict(state["loss_scaler"])
    rt.print(f"resumed from step {step} in {args.checkpoint_dir}")
    history = {key: state[key].tolist() for key in history}
    if "skipped_steps" in history:  # step numbers, saved as float64 like the rest
        history["skipped_steps"] = [int(s) for s in history["skipped_steps"]]
    return step, history


def _count(n: int, noun: str) -> str:
    """'1 rank', '2 ranks'."""
    return f"{n} {noun}" + ("" if n == 1 else "s")


def write_trace(path, rank, step, events) -> None:
    """The recorded step as JSON: compute phases and every communication, in seconds."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "step": step, "events": events}, f)


def train(args, rt, cfg: ModelConfig | None = None, config: ParallelConfig | None = None) -> dict:
    """Train on this rank; return what it measured (losses and norms are global, the same on every rank).

    `cfg` and `config` are what `validate(args, ...)` returned; a caller in this process may leave
    them out, and they are checked here."""
    if cfg is None or config is None:
        cfg, config = validate(args, rt.world_size)
    corpus = Corpus.load(args.data)
    strategy = make_strategy(rt, config)
    dp_rank, dp_size = strategy.data_rank()
    micro = config.micro_batch_size(args.global_batch, args.micro_batch)
    strategy.set_step(micro, args.global_batch // (dp_size * micro), args.grad_clip)
    if args.dtype == "fp16":
        strategy.loss_scaler = strategy.make_loss_scaler(args.loss_scale)
    scaler = strategy.loss_scaler
    torch.manual_seed(args.seed)
    model = strategy.parallelize(TinyGPT(cfg))
    optimizer = strategy.make_optimizer(model, args.lr, args.weight_decay)
    sampler = BatchSampler(corpus.train, cfg.seq_len, args.global_batch, seed=args.seed)
    autocast = torch.autocast(rt.device.type, dtype=AUTOCAST[args.dtype]) if AUTOCAST[args.dtype] else None

    run_dir = os.environ.get("LABSUPPORT_RUN_DIR") or str(make_run_dir(args.run_dir, f"train-{args.strategy}"))
    metrics_log = JsonlWriter(os.path.join(run_dir, f"metrics-rank{rt.rank}.jsonl"))
    peak_flops, peak_source = device_peak(rt.device, AUTOCAST[args.dtype] or torch.float32)
    memory = MemoryPeaks(rt.device)
    run_layout = layout(config, rt.world_size)
    start_step, history = resume(args, rt, strategy, model, optimizer, run_layout)

    log_every = args.log_every or max(1, args.steps // 10)
    tokens_per_step = args.global_batch * cfg.seq_len
    step_times, val_losses = [], []
    # Two lines, usually under 90 characters with the "[rank 0] " prefix: what trains, then how the global
    # batch is made (one line of 150 was broken wherever the output area ended, issue 28).
    accumulation = args.global_batch // (dp_size * micro)
    steps = f"steps {start_step + 1} to {args.steps}" if start_step else _count(args.steps, "step")
    axes = [f"{name} {n}" for name, n in (("tp", config.tp), ("pp", config.pp), ("cp", config.cp)) if n > 1]
    grid = f" (dp {config.dp} x {' x '.join(axes)})" if axes else ""   # where the ranks beyond dp went
    experts = f", ep {config.ep}" if config.ep > 1 else ""
    rt.print(f"training {cfg.name} ({count_params(cfg):,} parameters): {args.strategy} on "
             f"{_count(rt.world_size, 'rank')}{grid}{experts}, {steps}")
    # With a pipeline the micro-batches of a step flow through the stages together (m), not one after another
    per_replica = (f"{accumulation} micro-batch{'es' if accumulation > 1 else ''} per pipeline" if config.pp > 1
                   else _count(accumulation, "accumulation step"))
    rt.print(f"global batch {args.global_batch} = micro-batch {micro} x {per_replica} "
             f"x {_count(dp_size, 'data-parallel rank')}")
    for step in range(start_step, args.steps):
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = sampler.local_batch(step, dp_rank, dp_size)
        batches = [(xb.to(rt.device), yb.to(rt.device)) for xb, yb in micro_batches(x, y, micro)]
        last = step == args.steps - 1
        comm.reset()
        t0 = time.perf_counter()
        with comm.timing(last) as events, ActivationMeter().measure() as meter:  # the last step is traced
            scale = scaler.get_scale() if scaler is not None else None  # the loss scale of this step's backward
            loss, grad_norm = train_step(strategy, model, optimizer, batches, args.grad_clip, autocast, scaler)
        dt = time.perf_counter() - t0
        step_comm, step_groups = comm.counts(), comm.group_counts()  # the step's traffic, before bookkeeping
        history["losses"].append(strategy.reduce_loss(loss))
        history["grad_norms"].append(grad_norm)
        if scaler is not None:
            history["loss_scales"].append(scale)
            if scaler.skipped:
                history["skipped_steps"].append(step)
        step_times.append(dt)
        peaks = memory.update(model, optimizer, meter.peak)
        if last:
            write_trace(os.path.join(run_dir, f"trace-rank{rt.rank}.json"), rt.rank, step, events)
        record = {"step": step, "loss": history["losses"][-1], "lr": lr, "grad_norm": grad_norm, "step_s": dt,
                  "tokens_per_s": tokens_per_step / dt, "mfu": mfu(tokens_per_step / dt / rt.world_size, cfg, peak_flops),
                  "memory": peaks, "comm": step_comm,
                  **({"loss_scale": scale, "skipped": scaler.skipped} if scaler is not None else {}),
                  **forward_stats(model)}  # what the model's layers recorded of the step's last micro-batch
        done = step + 1
        if args.eval_every and done % args.eval_every == 0 and done < args.steps:
            val_losses.append([done, evaluate(strategy, model, corpus.val, cfg, args, rt.device)])
            record["val_loss"] = val_losses[-1][1]
        metrics_log.write(record)
        if done % log_every == 0 or done == args.steps:
            bar = "#" * (20 * done // args.steps)
            rt.print(f"step {done:>{len(str(args.steps))}}/{args.steps} [{bar:<20}] loss {history['losses'][-1]:.4f} "
                     f"lr {lr:.2e} {tokens_per_step / dt:,.0f} tok/s")
        if args.checkpoint_every and done % args.checkpoint_every == 0:
            save_checkpoint(args, rt, strategy, model, optimizer, done, history, run_layout)
    metrics_log.close()

    # On a CPU the "peak" is measured; measure again now and keep the better one, so a busy
    # moment at start-up cannot make MFU exceed 100%.
    if rt.device.type == "cpu":
        peak_flops = max(peak_flops, device_peak(rt.device, torch.float32)[0])
    timed = step_times[1:] or step_times  # the first step pays for warm-up
    tokens_per_s = tokens_per_step * len(timed) / sum(timed) if timed else 0.0
    result = {"rank": rt.rank, "memory": memory.peaks, "comm": step_comm if step_times else {},
              "comm_groups": step_groups if step_times else {}, **history,
              "tokens_per_s": tokens_per_s, "mfu": mfu(tokens_per_s / rt.world_size, cfg, peak_flops),
              "peak_flops": peak_flops, "peak_flops_source": peak_source, "n_params": count_params(cfg),
              "model": {k: v for k, v in cfg.to_dict().items() if k in ("name", "n_layers", "hidden", "heads", "vocab", "seq_len")},
              "parallel": config.to_dict(), "steps": args.steps, "resumed_from": start_step,
              "step_s_median": sorted(timed)[len(timed) // 2] if timed else None,
              "forward_stats": forward_stats(model) if step_times else {}}
    if args.eval_batches:
        val_losses.append([args.steps, evaluate(strategy, model, corpus.val, cfg, args, rt.device)])
    result["val_losses"] = val_losses
    if getattr(strategy, "events", None):  # a pipeline's last step, action by action (a measured Gantt chart)
        result["pipeline_events"] = strategy.events
        result["pipeline_origin"] = strategy.events_origin  # its start on the host's shared clock
    if args.sample_chars:
        text = sample(strategy, model, corpus, cfg, args.sample_chars, args.seed, rt.device)
        if rt.rank == 0:
            result["sample"] = text
    strategy.close(model)
    return result


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
    """Launch this loop on `nproc` ranks and return its summary (the `labsupport train --json` object).

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
    res = launch("-m", "labsupport.train", nproc=nproc, timeout=timeout, ranks=ranks, out=out,
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
    if CHECKED_ENV in os.environ:  # started by run(), which checked the options already
        args, cfg, config = load_checked(os.environ[CHECKED_ENV])
    else:
        args = build_parser().parse_args(argv)
        info = runtime.detect()
        try:
            cfg, config = validate(args, info.world_size)
        except (ValueError, DataError) as e:
            if info.rank == 0:
                for line in str(e).splitlines():
                    print(f"error: {line}", file=sys.stderr)
            return 2
    with runtime.init(seed=args.seed) as rt:
        result = train(args, rt, cfg, config)
        result.update(strategy=args.strategy, world_size=rt.world_size)
        runtime.report(**result)
        if rt.rank == 0 and "sample" in result:
            rt.print("sample:\n" + result["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
