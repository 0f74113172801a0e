"""The one training loop. Every strategy, from `single` to 3D, runs through `train()`.

Run it on N ranks with `labsupport train --strategy NAME --nproc N`, or directly as
`torchrun --nproc-per-node N -m labsupport.train ...`, or as `python -m labsupport.train`
for one process. The global batch (`--global-batch` sequences per optimizer step) is the same
whatever the world size, so every strategy can be compared with `single` step by step:

    global batch = micro-batch x accumulation steps x data-parallel ranks
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace

import torch

from . import checkpoint, comm, runtime
from .launch import make_run_dir
from .data import BatchSampler, Corpus, DataError, load_text, micro_batches
from .metrics import ActivationMeter, JsonlWriter, device_peak, grad_bytes, mfu, optimizer_bytes, param_bytes
from .model import DEFAULT_PRESET, PRESETS, TinyGPT, get_preset
from .parallel import make_strategy, strategy_names


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
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--eval-every", type=int, default=0, help="validation every K steps (0: at the end only)")
    p.add_argument("--eval-batches", type=int, default=4)
    p.add_argument("--sample-chars", type=int, default=200, help="characters generated at the end (0: none)")
    p.add_argument("--log-every", type=int, default=0, help="progress line every K steps (0: ten lines per run)")
    p.add_argument("--ddp-mode", choices=["naive", "flat", "bucketed"], default="bucketed",
                   help="ddp: how gradients are all-reduced")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="ddp/torch-ddp: gradient bucket size in MiB")
    p.add_argument("--find-unused-parameters", action="store_true",
                   help="ddp/torch-ddp: allow parameters that get a gradient on some ranks only")
    p.add_argument("--run-dir", default=None)
    p.add_argument("--checkpoint-dir", default=None)
    p.add_argument("--checkpoint-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint")
    return p


def validate(args, world_size: int) -> None:
    """Refuse bad arguments with one clear line, before any rank starts."""
    if args.strategy not in strategy_names():
        raise ValueError(f"unknown strategy {args.strategy!r}; available: {', '.join(strategy_names())}")
    cfg = get_preset(args.model)
    if cfg.vocab is not None:
        raise ValueError(f"preset {args.model!r} is an analysis shape ({cfg.n_layers} layers, hidden {cfg.hidden}); "
                         f"train one of the CPU presets: nano, micro, mini")
    if args.bucket_mb <= 0:
        raise ValueError(f"--bucket-mb must be > 0, got {args.bucket_mb:g}")
    if args.strategy == "single" and world_size != 1:
        raise ValueError(f"strategy 'single' runs on one rank; use --nproc 1 (got {world_size})")
    for name in ("steps", "global_batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    dp = world_size  # later strategies divide the world into dp x tp x pp
    micro = args.micro_batch or args.global_batch // dp
    if args.global_batch % dp or micro < 1 or (args.global_batch // dp) % micro:
        raise ValueError(f"--global-batch {args.global_batch} must be divisible by micro-batch x data-parallel ranks "
                         f"({args.micro_batch or 'auto'} x {dp})")
    if args.seq_len is not None and not 1 <= args.seq_len:
        raise ValueError("--seq-len must be >= 1")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ValueError("--checkpoint-every needs --checkpoint-dir")
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint-dir")
    if args.checkpoint_every < 0 or args.eval_every < 0:
        raise ValueError("--checkpoint-every and --eval-every must be >= 0")
    if not 0 <= args.dropout < 1:
        raise ValueError("--dropout must be in [0, 1)")
    load_text(args.data)  # DataError for a missing, empty or undecodable file


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to min_lr at the last step (GPT-3 style)."""
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 10)
    min_lr = args.min_lr if args.min_lr is not None else args.lr / 10
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return min_lr + 0.5 * (args.lr - min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def evaluate(model, data, cfg, args, device) -> float:
    """Mean loss over fixed validation batches (the same batches every time and on every rank)."""
    model.eval()
    sampler = BatchSampler(data, cfg.seq_len, args.global_batch, seed=args.seed + 1)
    losses = []
    for i in range(args.eval_batches):
        x, y = sampler.global_batch(i)
        losses.append(model(x.to(device), y.to(device)).item())
    model.train()
    return sum(losses) / len(losses)


def train_step(model, strategy, optimizer, batches, grad_clip, autocast, device, trace=None):
    """One optimizer step over this rank's micro-batches; returns (mean loss, measured stats).

    Gradients of all micro-batches but the last accumulate locally (`no_sync`); the strategy
    makes them global in `finish_backward`. With `trace` (a list), compute phases are
    appended as timeline events beside comm's.
    """
    def phase(name, t0):
        if trace is not None:
            trace.append({"op": name, "start": t0, "end": comm.now()})

    loss_sum, activations = 0.0, 0
    for i, (xb, yb) in enumerate(batches):
        meter = ActivationMeter(model)
        with strategy.no_sync() if i < len(batches) - 1 else nullcontext():
            t0 = comm.now()
            with meter.measure(), autocast:
                loss = model(xb.to(device), yb.to(device))
            phase("forward", t0)
            t0 = comm.now()
            strategy.backward(loss / len(batches))
            phase("backward", t0)
        loss_sum += loss.item()
        activations = max(activations, meter.bytes)
    t0 = comm.now()
    strategy.finish_backward(model)
    phase("finish_backward", t0)
    grad_norm = strategy.clip_grad_norm_(model, grad_clip)
    grads = grad_bytes(model)
    t0 = comm.now()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    phase("optimizer", t0)
    return loss_sum / len(batches), {"activations": activations, "grads": grads, "grad_norm": grad_norm}


def write_trace(path, rank, step, events) -> None:
    """The recorded step as JSON: compute phases and every communication, in seconds."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"rank": rank, "step": step, "events": events}, f)


def train(args, rt) -> dict:
    """Train on this rank; return what it measured (rank 0's dict also has losses and the sample)."""
    corpus = Corpus.load(args.data)
    preset = get_preset(args.model)
    cfg = replace(preset, vocab=corpus.tokenizer.vocab_size, seq_len=args.seq_len or preset.seq_len,
                  dropout=args.dropout)

    torch.manual_seed(args.seed)
    model = TinyGPT(cfg)
    n_params = model.num_params()
    strategy = make_strategy(args.strategy, rt, args)
    model = strategy.setup(model)
    optimizer = strategy.make_optimizer(model, args.lr, args.weight_decay)
    dp_rank, dp_size = strategy.data_rank()
    sampler = BatchSampler(corpus.train, cfg.seq_len, args.global_batch, seed=args.seed)
    micro = args.micro_batch or args.global_batch // dp_size
    accum = args.global_batch // (dp_size * micro)
    autocast = (torch.autocast(rt.device.type, dtype=torch.bfloat16) if args.dtype == "bf16" else nullcontext())

    run_dir = os.environ.get("LABSUPPORT_RUN_DIR") or str(make_run_dir(args.run_dir, f"train-{args.strategy}"))
    metrics_log = JsonlWriter(os.path.join(run_dir, f"metrics-rank{rt.rank}.jsonl"))
    peak_flops, peak_source = device_peak(rt.device, torch.bfloat16 if args.dtype == "bf16" else torch.float32)
    memory = {"params": 0, "grads": 0, "optimizer": 0, "activations": 0, "peak": 0}
    local_losses: list[float] = []
    start_step = 0
    if args.resume and checkpoint.latest(args.checkpoint_dir) is not None:
        start_step = checkpoint.latest(args.checkpoint_dir)
        state = checkpoint.load(args.checkpoint_dir, start_step, rt.rank)
        if state["world_size"] != rt.world_size or state["strategy"] != args.strategy:
            raise ValueError(f"checkpoint at step {start_step} was written by {state['strategy']} on "
                             f"{state['world_size']} ranks; resume with the same --strategy and --nproc")
        strategy.load_model_state(model, state["model"])
        optimizer.load_state_dict(state["optimizer"])
        checkpoint.set_rng_state(state["rng"])
        local_losses = state["local_losses"].tolist()
        rt.print(f"resumed from step {start_step} in {args.checkpoint_dir}")
    if rt.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(rt.device)

    log_every = args.log_every or max(1, args.steps // 10)
    tokens_per_step = args.global_batch * cfg.seq_len
    step_times, last_comm, val_losses = [], {}, []
    rt.print(f"training {cfg.name}: {n_params:,} parameters, {args.strategy} on {rt.world_size} rank(s), "
             f"global batch {args.global_batch} = {micro} x {accum} accumulation x {dp_size} ranks, "
             f"{args.steps} steps from step {start_step}")
    for step in range(start_step, args.steps):
        t0 = time.perf_counter()
        comm.reset()
        lr = lr_at(step, args)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = sampler.local_batch(step, dp_rank, dp_size)
        last = step == args.steps - 1
        with comm.timing(last) as events:  # the last step is recorded as a timeline
            loss, stats = train_step(model, strategy, optimizer, micro_batches(x, y, micro), args.grad_clip,
                                     autocast, rt.device, trace=events if last else None)
        if last:
            write_trace(os.path.join(run_dir, f"trace-rank{rt.rank}.json"), rt.rank, step, events)
        memory["activations"] = max(memory["activations"], stats["activations"])
        memory["grads"] = max(memory["grads"], stats["grads"])
        grad_norm = stats["grad_norm"]
        dt = time.perf_counter() - t0
        step_times.append(dt)
        local_losses.append(loss)
        memory["params"] = max(memory["params"], param_bytes(model))
        memory["optimizer"] = max(memory["optimizer"], optimizer_bytes(optimizer))
        memory["peak"] = (torch.cuda.max_memory_allocated(rt.device) if rt.device.type == "cuda"
                          else max(memory["peak"], sum(memory[k] for k in ("params", "grads", "optimizer", "activations"))))
        last_comm = comm.counts()
        record = {"step": step, "loss": local_losses[-1], "lr": lr, "grad_norm": grad_norm, "step_s": dt,
                  "tokens_per_s": tokens_per_step / dt, "mfu": mfu(tokens_per_step / dt / rt.world_size, cfg, peak_flops),
                  "memory": dict(memory), "comm": last_comm}
        done = step + 1
        if args.eval_every and done % args.eval_every == 0 and done < args.steps:
            val_losses.append([done, evaluate(strategy.module(model), corpus.val, cfg, args, rt.device)])
            record["val_loss"] = val_losses[-1][1]
        metrics_log.write(record)
        if done % log_every == 0 or done == args.steps:
            bar = "#" * (20 * done // args.steps)
            rt.print(f"step {done:>{len(str(args.steps))}}/{args.steps} [{bar:<20}] loss {local_losses[-1]:.4f} "
                     f"lr {lr:.2e} {tokens_per_step / dt:,.0f} tok/s")
        if args.checkpoint_every and done % args.checkpoint_every == 0:
            checkpoint.save(args.checkpoint_dir, done, rt.rank, {
                "model": strategy.model_state(model), "optimizer": optimizer.state_dict(),
                "rng": checkpoint.rng_state(), "local_losses": torch.tensor(local_losses, dtype=torch.float64),
                "world_size": rt.world_size, "strategy": args.strategy, "step": done},
                barrier=lambda: comm.barrier() if rt.distributed else None)
    metrics_log.close()

    # The loss of a step is the mean over the global batch: average the data-parallel ranks' means.
    losses = torch.tensor(local_losses, dtype=torch.float64)
    if rt.distributed:
        comm.all_reduce(losses, "avg", group=strategy.dp_group())
    # On a CPU the "peak" is measured; measure again now and keep the better one, so a busy
    # moment at start-up cannot make MFU exceed 100%.
    if rt.device.type == "cpu":
        peak_flops = max(peak_flops, device_peak(rt.device, torch.float32)[0])
    timed = step_times[1:] or step_times  # the first step pays for warm-up
    tokens_per_s = tokens_per_step * len(timed) / sum(timed) if timed else 0.0
    result = {"rank": rt.rank, "memory": memory, "comm": last_comm, "losses": losses.tolist(),
              "tokens_per_s": tokens_per_s, "mfu": mfu(tokens_per_s / rt.world_size, cfg, peak_flops),
              "peak_flops": peak_flops, "peak_flops_source": peak_source, "n_params": n_params,
              "model": {k: v for k, v in cfg.to_dict().items() if k in ("name", "n_layers", "hidden", "heads", "vocab", "seq_len")},
              "steps": args.steps, "resumed_from": start_step,
              "step_s_median": sorted(timed)[len(timed) // 2] if timed else None}
    if args.eval_batches:
        val_losses.append([args.steps, evaluate(strategy.module(model), corpus.val, cfg, args, rt.device)])
    result["val_losses"] = val_losses
    if rt.rank == 0 and args.sample_chars:
        gen = torch.Generator(device=rt.device).manual_seed(args.seed)
        prompt = corpus.val[:1].unsqueeze(0).to(rt.device)  # one real character of the text
        net = strategy.module(model)
        net.eval()
        result["sample"] = corpus.tokenizer.decode(net.generate(prompt, args.sample_chars, 0.8, gen)[0, 1:])
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


def run(nproc: int = 1, timeout: float | None = None, ranks: str = "0", out=None, **options) -> dict:
    """Launch this loop on `nproc` ranks and return its summary (the `labsupport train --json` object).

    `options` are the command-line flags as keywords: `run(strategy="ddp", nproc=2, steps=20)`.
    Arguments are checked here, before any process starts.
    """
    from .launch import launch
    argv = to_argv(**options)
    args = build_parser().parse_args(argv)
    validate(args, nproc)
    res = launch("-m", "labsupport.train", *argv, nproc=nproc, timeout=timeout, ranks=ranks, out=out,
                 run_dir=args.run_dir, name=f"train-{args.strategy}")
    reports = [res.report(r) for r in range(nproc)]
    r0 = reports[0]
    summary = {key: r0[key] for key in ("model", "n_params", "losses", "val_losses", "tokens_per_s", "mfu",
                                        "peak_flops", "peak_flops_source", "steps", "resumed_from",
                                        "step_s_median")}
    summary.update(strategy=args.strategy, world_size=nproc, sample=r0.get("sample"), dtype=args.dtype,
                   global_batch=args.global_batch, micro_batch=args.micro_batch or args.global_batch // nproc,
                   memory=[r["memory"] for r in reports], comm=[r["comm"] for r in reports],
                   duration_s=res.duration_s, run_dir=str(res.run_dir))
    return summary


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    info = runtime.detect()
    try:
        validate(args, info.world_size)
    except (ValueError, DataError) as e:
        if info.rank == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    with runtime.init(seed=args.seed) as rt:
        result = train(args, rt)
        result.update(strategy=args.strategy, world_size=rt.world_size)
        runtime.report(**result)
        if rt.rank == 0 and "sample" in result:
            rt.print("sample:\n" + result["sample"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
