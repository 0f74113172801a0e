"""The one training loop, as every rank runs it. Every strategy, from `single` to 3D, runs through `train()`.

The global batch (`--global-batch` sequences per optimizer step) is the same whatever the world
size, so every strategy can be compared with `single` step by step:

    global batch = micro-batch x accumulation steps x data-parallel ranks

A step is the same five moves for every strategy (`train_step`): forward and backward over
the micro-batches, finish the gradients, clip them by their global norm, the optimizer step,
and the step's loss. How each move is done is the strategy's business (ARCHITECTURE.md);
memory, tracing, evaluation, sampling and checkpoints are separate functions around it.

The options are parsed and checked by the launcher side, train.py, before any process starts:
`train.run()` launches `-m labsupport.loop` with what it checked in LABSUPPORT_TRAIN_CONFIG
(`main` here), and a bare `torchrun -m labsupport.train ARGS` has each rank parse and check its
command line, then call `run_rank`.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from . import checkpoint, comm, runtime
from .data import BatchSampler, Corpus, micro_batches
from .estimate.params import count_params
from .estimate.shapes import ModelConfig
from .metrics import ActivationMeter, JsonlWriter, device_peak, grad_bytes, mfu, optimizer_bytes, param_bytes
from .model import TinyGPT, forward_stats, generate
from .parallel import ParallelConfig, make_strategy
from .rundir import make_run_dir
from .train import CHECKED_ENV, check_resume, layout, load_checked, lr_at, validate

AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}  # --dtype (train.DTYPES): autocast's type


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
    experts = f" (dp {config.dp}, experts over ep {config.ep})" if config.ep > 1 else ""  # ep borrows the dp ranks
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



def run_rank(args, cfg: ModelConfig, config: ParallelConfig) -> int:
    """This rank's whole run on checked options: train, report to the launcher, print the sample."""
    with runtime.init(seed=args.seed) as rt:
        result = train(args, rt, cfg, config)
        result.update(strategy=args.strategy, world_size=rt.world_size)
        runtime.report(**result)
        if rt.rank == 0 and "sample" in result:
            rt.print("sample:\n" + result["sample"])
    return 0


def main() -> int:
    """A rank of `train.run()`: the options it checked, from LABSUPPORT_TRAIN_CONFIG, neither parsed nor checked again."""
    if CHECKED_ENV not in os.environ:
        print(f"error: labsupport.loop runs what train.run() checked ({CHECKED_ENV} is not set); "
              "start a run with `labsupport train ARGS` or `torchrun -m labsupport.train ARGS`", file=sys.stderr)
        return 2
    return run_rank(*load_checked(os.environ[CHECKED_ENV]))


if __name__ == "__main__":
    sys.exit(main())
