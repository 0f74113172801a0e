"""`labsupport` on the command line: doctor, launch, train, bench, memory, bubble, plan, jobscript (more arrive with their notebooks).

Contract (DESIGN.md 4): every command takes `--json`, and then the last line on stdout is
one JSON object while human-readable text goes to stderr. A user mistake is one line on
stderr and a non-zero exit, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys

from .launch import LaunchError, display_path, launch


class UsageError(Exception):
    """A user mistake: printed as one line, exit code 2."""


def _emit(args, human: str, payload: dict) -> None:
    if args.json:
        if human:
            print(human, file=sys.stderr)
        print(json.dumps(payload))
    else:
        print(human)


# ---------------------------------------------------------------- doctor

def cmd_doctor(args) -> int:
    import torch
    import torch.distributed as dist
    if args.gpu:
        from .gpu_check import run_checks
        stream = sys.stderr if args.json else sys.stdout
        results = run_checks(torch.cuda.device_count(), out=lambda line: print(line, file=stream, flush=True))
        if args.json:
            print(json.dumps({"gpus": torch.cuda.device_count(), "checks": results}))
        return 0 if all(r["ok"] for r in results) else 1

    from .runtime import cpu_count, pick_device, recommended_nproc
    device, backend = pick_device(0, 1)
    info = {
        "python": platform.python_version(), "torch": torch.__version__,
        "backends": {b: getattr(dist, f"is_{b}_available")() for b in ("gloo", "nccl", "mpi")},
        "cuda_available": torch.cuda.is_available(), "gpus": torch.cuda.device_count(),
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cpu_cores": cpu_count(), "device": str(device), "backend": backend,
        "recommended_nproc": recommended_nproc(),
    }
    names = f" ({', '.join(info['gpu_names'])})" if info["gpu_names"] else ""
    lines = [f"python {info['python']}, torch {info['torch']}",
             "backends: " + ", ".join(f"{b} {'yes' if ok else 'no'}" for b, ok in info["backends"].items()),
             f"devices: {info['gpus']} GPU(s){names}, {info['cpu_cores']} CPU core(s); "
             f"ranks will use {device.type} + {backend}",
             f"recommended --nproc: {info['recommended_nproc']}"]
    try:
        res = launch(module="labsupport.smoke", nproc=2, timeout=args.timeout, name="doctor",
                     out=sys.stderr if args.json else sys.stdout)
        got = res.report(0).get("all_reduce_sum")
        info["smoke_test"] = {"ok": got == 3.0, "seconds": round(res.duration_s, 2), "all_reduce_sum": got}
        lines.append(f"2-rank smoke test: all_reduce of [1, 2] gave {got} (expected 3.0) in {res.duration_s:.1f} s")
    except LaunchError as e:
        info["smoke_test"] = {"ok": False, "error": str(e).splitlines()[0]}
        lines.append(f"2-rank smoke test FAILED: {str(e).splitlines()[0]}")
    _emit(args, "\n".join(lines), info)
    return 0 if info["smoke_test"]["ok"] else 1


# ---------------------------------------------------------------- launch

def cmd_launch(args) -> int:
    if args.module is None and not args.target:
        raise UsageError("give a script to run, or -m MODULE")
    script = None if args.module else args.target[0]
    rest = args.target if args.module else args.target[1:]
    res = launch(script, *rest, module=args.module, nproc=args.nproc, timeout=args.timeout,
                 run_dir=args.run_dir, ranks=args.ranks, device=args.device, check_collectives=args.check_collectives,
                 out=sys.stderr if args.json else sys.stdout, check=False)
    payload = {"ok": res.ok, "exit_codes": res.exit_codes, "duration_s": res.duration_s,
               "run_dir": str(res.run_dir), "reports": res.reports}
    if not res.ok:
        from .launch import failure_message
        print(f"labsupport: error: {failure_message(res)}", file=sys.stderr)
    if args.json:
        print(json.dumps(payload))
    return 0 if res.ok else 1


# ---------------------------------------------------------------- train

# What the `train` subcommand adds to labsupport.train's own flags: they drive the launch here.
_LAUNCH_FLAGS = ("command", "nproc", "timeout", "ranks", "json")


def cmd_train(args) -> int:
    from .train import run_parsed
    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if k not in _LAUNCH_FLAGS})
    summary = run_parsed(options, nproc=args.nproc, timeout=args.timeout, ranks=args.ranks,
                         out=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(summary))
    else:
        print(f"final loss {summary['losses'][-1]:.4f} (first {summary['losses'][0]:.4f}), "
              f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {summary['mfu']:.1%} "
              f"({summary['peak_flops_source']}); run directory {display_path(summary['run_dir'])}")
    return 0


# ---------------------------------------------------------------- memory

# The Llama family's switches of a custom shape (`memory`, `plan`): flag -> (ModelConfig field, its value when given)
_FAMILY_FLAGS = {"kv_heads": ("--kv-heads", "kv_heads"), "ffn_hidden": ("--ffn-hidden", "ffn_hidden"),
                 "norm": ("--norm", "norm"), "mlp": ("--mlp", "mlp"), "positions": ("--positions", "positions"),
                 "untied": ("--untied", "tied"), "no_bias": ("--no-bias", "bias")}


def _family_flags(args) -> list[str]:
    """The Llama family's switches given (which a preset or --params would ignore)."""
    return [flag for arg, (flag, _) in _FAMILY_FLAGS.items() if getattr(args, arg) not in (None, False)]


def _family(args) -> dict:
    """ModelConfig's fields from the family's switches: what is given, and nothing else (the GPT defaults)."""
    out = {field: getattr(args, arg) for arg, (_, field) in _FAMILY_FLAGS.items()
           if arg not in ("untied", "no_bias") and getattr(args, arg) is not None}
    out.update({field: False for arg, (_, field) in _FAMILY_FLAGS.items()
                if arg in ("untied", "no_bias") and getattr(args, arg)})
    return out


def _model(args, alternative: str = ""):
    """The model `memory` and `plan` size: --model PRESET (a CPU preset with --vocab, or the
    shipped corpus's; --seq-len trains it at another context length, which changes the activations),
    or the shape flags: --layers --hidden --heads --vocab --seq-len, and for the Llama family
    --kv-heads, --ffn-hidden, --norm rmsnorm, --mlp swiglu, --positions rope, --untied, --no-bias."""
    from .estimate.shapes import ModelConfig, preset_shape
    if args.model:
        ignored = [f"--{f}" for f in ("layers", "hidden", "heads") if getattr(args, f) is not None] + _family_flags(args)
        if ignored:
            raise UsageError(f"--model {args.model} has its own shape, so {' '.join(ignored)} would be ignored: "
                             "drop them or --model (a preset takes --seq-len and --vocab)")
        return preset_shape(args.model, args.vocab, seq_len=args.seq_len)
    missing = [f"--{f.replace('_', '-')}" for f in ("layers", "hidden", "heads", "vocab", "seq_len")
               if getattr(args, f) is None]
    if missing:
        raise UsageError(f"give --model PRESET, {alternative}or all of --layers --hidden --heads --vocab --seq-len "
                         f"(missing {' '.join(missing)})")
    return ModelConfig("custom", args.layers, args.hidden, args.heads, args.vocab, args.seq_len, **_family(args))


def _count_line(cfg, n_params: int) -> str:
    """'N parameters', and with experts the active ones: what a token uses (Mixtral: 46.7B, 12.9B)."""
    if not cfg or not cfg.experts:
        return f"{n_params:,} parameters"
    from .estimate.params import active_params
    active = active_params(cfg)
    return (f"{n_params:,} parameters = {n_params / 1e9:.1f}B, {active:,} = {active / 1e9:.1f}B active per token "
            f"({cfg.top_k} of {cfg.experts} experts a layer)")


def cmd_memory(args) -> int:
    from .estimate.memory import estimate_memory
    if args.params is not None:  # the model states of a count alone: no shape
        if not args.params >= 1:
            raise UsageError(f"--params must be a positive parameter count, e.g. 7.5e9 (got {args.params:g})")
        shape = [f"--{f.replace('_', '-')}" for f in ("model", "layers", "hidden", "heads", "vocab", "seq_len")
                 if getattr(args, f) is not None] + _family_flags(args)
        if shape:
            raise UsageError(f"--params counts the model states only, so {' '.join(shape)} would be ignored: "
                             "give --params alone, or the shape without it")
    cfg = None if args.params is not None else _model(args, "--params N, ")
    override = None
    flags = {"params": "--param-bytes", "grads": "--grad-bytes", "optimizer": "--optimizer-bytes"}
    given = {"params": args.param_bytes, "grads": args.grad_bytes, "optimizer": args.optimizer_bytes}
    if any(v is not None for v in given.values()):  # one flag alone would silently mix with --precision
        missing = [flags[k] for k, v in given.items() if v is None]
        if missing:
            raise UsageError(f"give all three of --param-bytes, --grad-bytes and --optimizer-bytes "
                             f"(missing {' and '.join(missing)})")
        override = given
    if args.pcie_gbps is not None and not args.offload:
        raise UsageError("--pcie-gbps is the host link of --offload: add --offload, or drop --pcie-gbps")
    est = estimate_memory(cfg, micro_batch=args.micro_batch, precision=args.precision, dp=args.dp, tp=args.tp,
                          pp=args.pp, zero=args.zero, sequence_parallel=args.sequence_parallel,
                          recompute=args.recompute, bytes_override=override, n_params=args.params, offload=args.offload)
    from .units import format_bytes as gb
    recipe = "bytes given" if override else f"{args.precision} recipe"
    if cfg is not None and cfg.experts:
        from .estimate.params import active_params
        est["active_params"] = active_params(cfg)
    human = (f"{_count_line(cfg, est['n_params'])} ({recipe}); per device: params {gb(est['params'])}, "
             f"grads {gb(est['grads'])}, optimizer {gb(est['optimizer'])}, activations {gb(est['activations'])}, "
             f"total {gb(est['total'])}")
    if args.offload:
        from .estimate.offload import PCIE_GBPS, pcie_seconds
        est["pcie_gbps"] = args.pcie_gbps if args.pcie_gbps is not None else PCIE_GBPS["gen4"]
        est["pcie_s"] = pcie_seconds(est["pcie"], est["pcie_gbps"])
        human += (f"\noffloaded (ZeRO-Offload): host memory {gb(est['host'])} for this device's share; "
                  f"PCIe per step {gb(est['pcie_to_host'])} to the host + {gb(est['pcie_to_device'])} back "
                  f"= {gb(est['pcie'])}, {est['pcie_s']:.3g} s at {est['pcie_gbps']:g} GB/s")
    _emit(args, human, est)
    return 0


# ---------------------------------------------------------------- bubble

def cmd_bubble(args) -> int:
    from .estimate.schedules import schedule
    from .estimate.simulator import bubble_fraction, bubble_over_ideal, simulate
    chunks = args.chunks if args.chunks is not None else (2 if args.schedule == "interleaved" else 1)
    if args.backward_ratio <= 0:
        raise UsageError(f"--backward-ratio must be positive (got {args.backward_ratio:g})")
    if args.timeline and not args.json:
        raise UsageError("--timeline adds the spans to the JSON: use it with --json")
    timeline = simulate(schedule(args.schedule, args.stages, args.microbatches, chunks),
                        backward_ratio=args.backward_ratio, chunks=chunks)
    lines = [f"{args.schedule}: {args.stages} stages, {args.microbatches} micro-batches, {chunks} chunk(s) per stage, "
             f"backward = {args.backward_ratio:g} x forward (one forward = 1 time unit)",
             f"{'stage':>5} {'busy':>8} {'idle':>8} {'idle/total':>10} {'in flight':>9}"
             + ("  (chunk forwards, each 1/v of the stage's layers)" if chunks > 1 else "")]
    for s, (busy, idle, peak) in enumerate(zip(timeline.busy, timeline.idle, timeline.peak_inflight_microbatches)):
        lines.append(f"{s:>5} {busy:>8.3g} {idle:>8.3g} {idle / timeline.total_time:>10.1%} {peak:>9}")
    lines.append(f"total time {timeline.total_time:.3g}; bubble: idle/total {timeline.bubble_fraction:.1%}, "
                 f"idle/busy {timeline.bubble_over_ideal:.4g} "
                 f"(formula (p-1)/(v*m) = {bubble_over_ideal(args.stages, args.microbatches, chunks):.4g}, "
                 f"(p-1)/(v*m+p-1) = {bubble_fraction(args.stages, args.microbatches, chunks):.1%})")
    # The JSON holds the table's figures; every compute span of every stage only with --timeline
    result = {"schedule": args.schedule, "stages": args.stages, "microbatches": args.microbatches,
              "chunks": chunks, "backward_ratio": args.backward_ratio,
              **timeline.to_json(timeline=args.timeline)} if args.json else None
    _emit(args, "\n".join(lines), result)
    return 0


# ---------------------------------------------------------------- plan

_MACHINE_FLAGS = {"gpus_per_node": ("--gpus-per-node", "devices_per_node"),
                  "gpu_memory_gb": ("--gpu-memory-gb", "memory_gb"),
                  "peak_tflops": ("--peak-tflops", "peak_tflops_bf16"),
                  "intra_node_gbps": ("--intra-node-gbps", "intra_gbps"),
                  "inter_node_gbps": ("--inter-node-gbps", "inter_gbps")}


def _plan_machine(args):
    """The --machine preset with the explicit values put over it, or a machine made of them and a --device."""
    from dataclasses import replace

    from .estimate.devices import DEVICES
    from .estimate.machines import INTER_ALPHA_S, INTRA_ALPHA_S, Machine
    from .estimate.planner import MACHINE_NAMES
    given = {field: getattr(args, arg) for arg, (_, field) in _MACHINE_FLAGS.items() if getattr(args, arg) is not None}
    if args.machine:
        if args.device:
            raise UsageError(f"--machine {args.machine} has its device; --device goes with a machine described "
                             f"by its flags")
        return replace(MACHINE_NAMES[args.machine], **given)
    optional = ("peak_tflops", "gpu_memory_gb")   # the device's own, unless given
    missing = [flag for arg, (flag, _) in _MACHINE_FLAGS.items() if getattr(args, arg) is None and arg not in optional]
    missing += [] if args.device else ["--device"]
    if missing:
        raise UsageError(f"give --machine {'|'.join(MACHINE_NAMES)}, or describe the machine in full "
                         f"(missing {' '.join(missing)})")
    return Machine("custom", intra_alpha_s=INTRA_ALPHA_S, inter_alpha_s=INTER_ALPHA_S,
                   **{**DEVICES[args.device]._asdict(), **given})


def _emit_plan(args, best, cfg, machine, global_batch) -> tuple[str, dict]:
    """The --emit text (the ds_config, Megatron-DeepSpeed's arguments beside it, or a job script running
    them) and its JSON keys."""
    import shlex

    from .estimate.planner import MEGATRON_SCRIPT, deepspeed_config, megatron_arguments, megatron_environment
    from .estimate.shapes import family_options
    if args.emit != "deepspeed" and family_options(cfg):
        raise UsageError(f"--emit {args.emit} writes a GPT shape's Megatron arguments, and {cfg.name} has "
                         f"{', '.join(family_options(cfg))} (their flags are not written yet); use --emit deepspeed")
    megatron = megatron_arguments(best, cfg, global_batch, args.precision)
    ds_config = deepspeed_config(best, global_batch, args.precision)
    environment = megatron_environment(best, frontier=args.machine == "frontier")
    if args.emit == "deepspeed":
        return f"ds_config.json of #1:\n{json.dumps(ds_config, indent=2)}", {"ds_config": ds_config}
    if args.emit == "megatron":
        text = "\n".join([f"# ds_config.json: {json.dumps(ds_config)}", *environment,
                          f"{MEGATRON_SCRIPT} {shlex.join(megatron)}"])
        return text, {"megatron_args": megatron, "ds_config": ds_config, "environment": environment}
    from .jobscript import render
    per_node = min(machine.devices_per_node, best.gpus)
    if best.gpus % per_node:
        raise UsageError(f"{best.gpus} GPUs do not fill whole nodes of {per_node}; give a multiple of {per_node}")
    script = render(args.scheduler, best.gpus // per_node, per_node, ["python", MEGATRON_SCRIPT, *megatron],
                    account=args.account, frontier=args.scheduler == "slurm" and args.machine == "frontier",
                    environment=environment)
    return (f"ds_config.json beside it: {json.dumps(ds_config)}\n{script}",
            {"megatron_args": megatron, "ds_config": ds_config, "environment": environment, "jobscript": script})


def _check_config(args) -> int:
    """`plan --check-config`: what the ds_config does, and each contradiction with the Megatron flags."""
    if args.gpus is None:
        raise UsageError("--check-config needs --gpus N, the launch's world size")
    from .ds_check import contradictions, explain, load, megatron_flags
    config, flags = load(args.check_config), megatron_flags(args.megatron)
    found = contradictions(config, flags, args.gpus)
    dp = args.gpus // (flags["tp"] * flags["pp"])
    does = explain(config, dp)
    lines = [f"{args.check_config} on {args.gpus} GPUs (TP {flags['tp']} x PP {flags['pp']} x DP {dp}) does:",
             *(f"  {line}" for line in does),
             f"{len(found)} contradiction(s) with the Megatron flags:" if found else
             "no contradiction with the Megatron flags", *(f"  {line}" for line in found)]
    _emit(args, "\n".join(lines), {"dp": dp, "megatron": flags, "explain": does, "contradictions": found})
    return 1 if found else 0


def _validate(args) -> int:
    """`plan --validate`: the planner against published runs (estimate/validation.py), one row each."""
    from .estimate.validation import BAND, validate
    checks = validate()
    inside = sum(abs(c.ratio - 1) <= BAND for c in checks)
    lines = [f"The planner on {len(checks)} published runs, each priced on its own layout, machine and framework; "
             f"TFLOP/s per GPU in the source's convention (hardware: recomputation counted; model: not). "
             f"{inside} of {len(checks)} within {BAND:.0%}.",
             f"{'run':<34}{'machine':<22}{'GPUs':>6} {'counts':<9}{'published':>10}{'predicted':>10}{'ratio':>7}"
             f"  {'dominant':<9}{'GB/GPU':>7}"]
    for c in checks:
        r = c.run
        lines.append(f"{r.name:<34}{r.machine.name:<22}{r.gpus:>6} {r.counts:<9}{r.tflops_per_gpu:>10.1f}"
                     f"{c.predicted_tflops:>10.1f}{c.ratio:>7.2f}  {c.dominant:<9}"
                     f"{c.config.memory_per_gpu / 1e9:>7.1f}{'' if c.config.fits else ' (does not fit)'}")
    lines.append("Outside the band, why:")
    for reason in dict.fromkeys(c.reason for c in checks if c.reason):
        names = [c.run.name for c in checks if c.reason == reason]
        lines.append(f"  {', '.join(names)}: {reason}")
    lines.append("Sources:")
    lines += [f"  {c.run.name}: {c.run.source}" for c in checks]
    _emit(args, "\n".join(lines), {"band": BAND, "within_band": inside, "runs": [c.to_json() for c in checks]})
    return 0


def cmd_plan(args) -> int:
    if args.check_config:
        return _check_config(args)
    if args.validate:
        return _validate(args)
    if args.gpus is None:
        raise UsageError("give --gpus N (or --validate, which takes the published runs' own)")
    if args.megatron:
        raise UsageError(f"Megatron flags ({args.megatron[0]} ...) go with --check-config DS_CONFIG")
    from .estimate.params import active_params, count_params
    from .estimate.planner import describe, plan, rates, search, why
    cfg, machine = _model(args), _plan_machine(args)
    global_batch = args.global_batch if args.global_batch is not None else args.gpus
    if args.top < 1:
        raise UsageError(f"--top must be >= 1 (got {args.top})")
    fixed = {k: getattr(args, k) for k in ("dp", "tp", "pp", "cp", "micro_batch", "zero", "recompute")
             if getattr(args, k) is not None}
    options = dict(precision=args.precision, efficiency=args.efficiency, **fixed)
    configs = plan(cfg, machine, args.gpus, global_batch, **options)
    best = configs[0]
    shown = configs[:args.top]
    context = any(c.cp > 1 for c in shown)  # a cp column only where a layout splits the sequence
    lines = [f"{cfg.name}: {args.gpus} GPUs of {machine.name} ({machine.memory_gb:g} GB, "
             f"{machine.peak_tflops_bf16:g} TFLOP/s), global batch {global_batch} x {cfg.seq_len} tokens; "
             f"{len(configs)} layouts fit, the {min(args.top, len(configs))} fastest:",
             f"{'#':>3} {'dp':>5} {'tp':>3} " + (f"{'cp':>3} " if context else "")
             + f"{'pp':>4} {'mb':>3} {'zero':>4} {'recompute':>9} {'GB/GPU':>7} {'step s':>9} {'tokens/s':>10} "
             f"{'TFLOP/s/GPU':>11} {'MFU':>5}"]
    for i, c in enumerate(shown, 1):
        r = rates(c, cfg, machine, global_batch)
        cp = f"{c.cp:>3} " if context else ""
        lines.append(f"{i:>3} {c.dp:>5} {c.tp:>3} {cp}{c.pp:>4} {c.micro_batch:>3} {c.zero:>4} {c.recompute:>9} "
                     f"{c.memory_per_gpu / 1e9:>7.1f} {c.step_time_s:>9.4g} {r['tokens_per_s']:>10.4g} "
                     f"{r['tflops_per_gpu']:>11.4g} {r['mfu']:>5.1%}")
    lines.append("Why #1:")
    lines += ["  " + line for line in why(best, cfg, machine, args.gpus, global_batch, args.precision, args.efficiency)]
    for i, c in enumerate(configs[1:3], 2):
        lines.append(f"#{i}: {describe(c)}, {c.step_time_s / best.step_time_s - 1:+.1%} step time.")
    lines[0] = f"{lines[0]} ({_count_line(cfg, count_params(cfg))})" if cfg.experts else lines[0]
    payload = {"n_params": count_params(cfg),
               **({"active_params": active_params(cfg)} if cfg.experts else {}),
               "gpus": args.gpus, "global_batch": global_batch, "machine": vars(machine).copy(),
               "configs": [{**c.to_json(), **rates(c, cfg, machine, global_batch)} for c in configs[:args.top]]}
    if args.search:
        trajectory = search(cfg, machine, args.gpus, global_batch, args.search, args.seed, **options)
        lines.append(f"random search, {len(trajectory)} samples (seed {args.seed}): sample, layout, step s "
                     f"(oom: does not fit), best so far")
        for s in trajectory:
            step = f"{s.step_time_s:.4g}" if s.step_time_s is not None else "oom"
            best_s = f"{s.best_s:.4g}" if s.best_s is not None else "-"
            lines.append(f"{s.index:>4} {describe(s.config):<70} {step:>9} {best_s:>9}")
        payload["search"] = [{"index": s.index, **s.config.to_json(), "step_time_s": s.step_time_s,
                              "best_s": s.best_s} for s in trajectory]
    if args.emit:
        text, keys = _emit_plan(args, best, cfg, machine, global_batch)
        lines.append(text)
        payload.update(keys)
    _emit(args, "\n".join(lines), payload)
    return 0


# ---------------------------------------------------------------- bench

def cmd_bench(args) -> int:
    from .bench import run
    if args.repeats is None:
        args.repeats = {"collectives": 5, "launch": 3}.get(args.name, 10)
    if args.name == "collectives":
        options = {"sizes": args.sizes, "repeats": args.repeats}
    elif args.name == "launch":
        options = {"repeats": args.repeats}
    elif args.name == "cp":
        options = {"model": args.model, "global_batch": args.global_batch, "repeats": args.repeats,
                   "seq_lens": args.sizes}
    else:
        options = {"model": args.model, "global_batch": args.global_batch, "bucket_mb": args.bucket_mb,
                   "repeats": args.repeats, "bucket_sweep": args.bucket_sweep, "microbatches": args.microbatches}
        if args.against is not None:
            if args.name != "zero":
                raise UsageError("--against is for bench zero")
            options["against"] = args.against
    summary = run(args.name, nproc=args.nproc, timeout=args.timeout, out=sys.stderr, **options)
    columns = [k for k in ("name", "impl", "bytes", "bucket_mb", "seconds", "busbw_GBps", "ratio")
               if k in summary["rows"][0]]
    lines = ["".join(f"{c:>14}" for c in columns)]
    for r in summary["rows"]:
        lines.append("".join(f"{r[c]:>14.6g}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in columns))
    for key, fit in summary.get("fits", {}).items():
        lines.append(f"fit {key:<28} alpha {fit['alpha_s'] * 1e6:8.1f} us   1/beta {1 / fit['beta_s_per_byte'] / 1e9 if fit['beta_s_per_byte'] else float('inf'):8.2f} GB/s")
    lines += summary.get("details", [])  # a benchmark's own lines (bench zero: memory per rank)
    lines.append(f"ratio ours/reference ({summary['headline']}): {summary['ratio']:.3g}x time")
    _emit(args, "\n".join(lines), summary)
    return 0


# ---------------------------------------------------------------- the parser

class OneLineParser(argparse.ArgumentParser):
    """argparse, but a mistake is one line (DESIGN.md 4), with a pointer to --help instead of the usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _family_arguments(parser) -> None:
    """A custom shape's Llama-family switches (`memory`, `plan`); each default is the GPT shape's."""
    from .estimate.shapes import MLPS, NORMS, POSITIONS
    parser.add_argument("--kv-heads", type=int, default=None,
                        help="key/value heads, dividing --heads (grouped-query attention; 1: multi-query; "
                             "default: --heads)")
    parser.add_argument("--ffn-hidden", type=int, default=None,
                        help="the MLP's inner width (default: 4 x hidden for gelu, LLaMA's 8/3 x hidden rounded up "
                             "to 256 for swiglu)")
    parser.add_argument("--norm", choices=NORMS, default=None, help="default layernorm")
    parser.add_argument("--mlp", choices=MLPS, default=None, help="default gelu")
    parser.add_argument("--positions", choices=POSITIONS, default=None, help="default learned")
    parser.add_argument("--untied", action="store_true", help="an LM head of its own (default: tied to the embedding)")
    parser.add_argument("--no-bias", action="store_true", help="no biases (and LayerNorm without its bias)")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="labsupport", description="Distributed training, built from scratch.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    d = sub.add_parser("doctor", help="versions, backends, devices and a 2-rank smoke test")
    d.add_argument("--timeout", type=float, default=120)
    d.add_argument("--gpu", action="store_true",
                   help="instead: train every strategy that fits this machine's GPUs and check it, one line each "
                        "(make gpu-check); without a GPU, one line saying it skipped")

    la = sub.add_parser("launch", help="run a script or module on N ranks under torchrun")
    la.add_argument("--nproc", type=int, default=2)
    la.add_argument("--timeout", type=float, default=None)
    la.add_argument("--run-dir", default=None)
    la.add_argument("--ranks", default="all", help="whose output to show: all, or e.g. 0")
    la.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    la.add_argument("--check-collectives", action="store_true",
                    help="compare op, shapes and dtypes of every collective across ranks (slower)")
    la.add_argument("-m", dest="module", default=None, help="run a module instead of a script")
    la.add_argument("target", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...] or, after -m MODULE, ARGS")

    from .train import build_parser as train_parser  # the launcher side only: no torch
    tr = sub.add_parser("train", help="train TinyGPT with a strategy on N ranks", parents=[train_parser()],
                        add_help=False, conflict_handler="resolve")
    tr.add_argument("--nproc", type=int, default=1)
    tr.add_argument("--timeout", type=float, default=None)
    tr.add_argument("--ranks", default="0", help="whose output to show: 0 (default) or all")

    from .bench import BENCHMARKS
    b = sub.add_parser("bench", help="ours vs torch's implementation, measured in one run")
    b.add_argument("name", choices=BENCHMARKS)
    b.add_argument("--nproc", type=int, default=2)
    b.add_argument("--timeout", type=float, default=600)
    b.add_argument("--sizes", default=None, help="collectives: comma-separated message sizes in bytes; "
                   "cp: comma-separated sequence lengths (default: the model's seq_len x 1, 4, 16)")
    b.add_argument("--repeats", type=int, default=None,
                   help="timed repetitions per variant (launch: rounds of one fresh launch and 7 pool cells)")
    b.add_argument("--model", default="micro", help="ddp, zero, tp, pp: the CPU preset trained; cp: whose heads and hidden size")
    b.add_argument("--global-batch", type=int, default=16, help="ddp, zero, tp, pp: sequences per step; cp: sequences")
    b.add_argument("--bucket-mb", type=float, default=25.0, help="ddp, zero: bucket size of ours and torch's")
    b.add_argument("--bucket-sweep", default=None, help="ddp: extra bucket sizes for ours, e.g. 0.25,1,4")
    b.add_argument("--microbatches", type=int, default=None, help="pp: micro-batches per step (default 4)")
    b.add_argument("--against", default=None, choices=["torch", "deepspeed"],
                   help="zero: whose ZeRO-1 and ZeRO-3 ours race (default torch)")

    m = sub.add_parser("memory", help="predicted memory per device (params, grads, optimizer, activations)")
    m.add_argument("--model", default=None)
    m.add_argument("--params", type=float, default=None, help="a parameter count, e.g. 7.5e9 (model states only)")
    for flag in ("layers", "hidden", "heads", "vocab", "seq-len"):
        m.add_argument(f"--{flag}", type=int, default=None)
    _family_arguments(m)
    m.add_argument("--micro-batch", type=int, default=1)
    from .estimate.memory import BYTES_PER_PARAM, recipe_label
    m.add_argument("--precision", choices=list(BYTES_PER_PARAM), default="mixed",
                   help="bytes per parameter (weights + gradients + optimizer), by recipe: "
                        + "; ".join(recipe_label(r) for r in BYTES_PER_PARAM))
    for flag in ("param-bytes", "grad-bytes", "optimizer-bytes"):  # floats, so "2.0" works; whole numbers only
        m.add_argument(f"--{flag}", type=float, default=None, help="bytes per parameter; give all three")
    for flag in ("dp", "tp", "pp"):
        m.add_argument(f"--{flag}", type=int, default=1)
    m.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    m.add_argument("--sequence-parallel", action="store_true")
    m.add_argument("--recompute", choices=["none", "selective", "full"], default="none")
    m.add_argument("--offload", action="store_true",
                   help="ZeRO-Offload: optimizer states and step on the host; "
                        "adds host bytes and PCIe bytes/time per step")
    m.add_argument("--pcie-gbps", type=float, default=None,
                   help="with --offload: host link bandwidth in GB/s per direction (default 31.5, PCIe 4.0 x16)")

    from .estimate.schedules import SCHEDULES
    bu = sub.add_parser("bubble", help="simulate a pipeline schedule: timeline, bubble, micro-batches in flight")
    bu.add_argument("--stages", type=int, required=True, help="pipeline stages p")
    bu.add_argument("--microbatches", type=int, required=True, help="micro-batches m per step")
    bu.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    bu.add_argument("--chunks", type=int, default=None, help="model chunks v per stage (interleaved; default 2)")
    bu.add_argument("--backward-ratio", type=float, default=2.0, help="backward time / forward time (default 2)")
    bu.add_argument("--timeline", action="store_true",
                    help="with --json: every stage's compute spans too, [start, end, op, micro-batch, chunk]")

    from .estimate.devices import DEVICES
    from .estimate.planner import EFFICIENCY, MACHINE_NAMES
    pl = sub.add_parser("plan", help="rank DP x TP x PP x CP layouts of a model on a machine by predicted step time")
    pl.add_argument("--model", default=None, help="a preset (--seq-len changes its context length), or give the "
                                                  "shape with --layers ... --seq-len")
    for flag in ("layers", "hidden", "heads", "vocab", "seq-len"):
        pl.add_argument(f"--{flag}", type=int, default=None)
    _family_arguments(pl)
    pl.add_argument("--gpus", type=int, default=None)
    pl.add_argument("--machine", choices=list(MACHINE_NAMES), default=None,
                    help="a node preset; the flags below override its values")
    for arg, (flag, _) in _MACHINE_FLAGS.items():
        pl.add_argument(flag, dest=arg, type=int if arg == "gpus_per_node" else float, default=None)
    pl.add_argument("--device", choices=list(DEVICES), default=None,
                    help="without --machine: the accelerator, whose kernel rates the step time uses")
    pl.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: one per GPU)")
    pl.add_argument("--precision", choices=list(BYTES_PER_PARAM), default="mixed")
    pl.add_argument("--efficiency", type=float, default=EFFICIENCY,
                    help=f"share of the device's best measured kernel rates a whole step reaches (default {EFFICIENCY}, "
                         "fitted to Narayanan et al.'s Table 1)")
    for flag in ("dp", "tp", "pp", "cp", "micro-batch"):
        pl.add_argument(f"--{flag}", type=int, default=None, help="fix this degree (default: the planner chooses)")
    pl.add_argument("--zero", type=int, default=None, choices=[0, 1])
    pl.add_argument("--recompute", choices=["none", "selective", "full"], default=None)
    pl.add_argument("--top", type=int, default=10, help="how many layouts to show (default 10)")
    pl.add_argument("--search", type=int, default=0, metavar="N", help="also sample N layouts at random")
    pl.add_argument("--seed", type=int, default=0, help="seed of --search")
    pl.add_argument("--emit", choices=["deepspeed", "megatron", "jobscript"], default=None,
                    help="write the best layout's ds_config.json, its Megatron-DeepSpeed arguments (with the "
                         "ds_config), or a job script running them")
    pl.add_argument("--scheduler", choices=["slurm", "pbs"], default="slurm", help="--emit jobscript: the scheduler")
    pl.add_argument("--account", default=None, help="--emit jobscript: project to charge")
    pl.add_argument("--check-config", default=None, metavar="DS_CONFIG",
                    help="instead of planning: what this ds_config.json does on --gpus GPUs, and each contradiction "
                         "with the Megatron flags given after --; exit 1 if there is one")
    pl.add_argument("--validate", action="store_true",
                    help="instead of planning: the planner against published runs, predicted beside measured")
    pl.add_argument("megatron", nargs="*", metavar="-- MEGATRON_FLAGS",
                    help="with --check-config: the launch's Megatron-DeepSpeed flags (others are ignored)")

    from .jobscript import add_arguments as jobscript_arguments
    js = sub.add_parser("jobscript", help="write a Slurm or PBS job script: N nodes x G GPUs, one rank per GPU")
    jobscript_arguments(js)

    for sp in sub.choices.values():
        sp.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        if args.command == "doctor":
            return cmd_doctor(args)
        if args.command == "launch":
            return cmd_launch(args)
        if args.command == "train":
            return cmd_train(args)
        if args.command == "memory":
            return cmd_memory(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "bubble":
            return cmd_bubble(args)
        if args.command == "plan":
            return cmd_plan(args)
        if args.command == "jobscript":
            from .jobscript import run_cli as jobscript_run
            return jobscript_run(args)
    except (UsageError, ValueError) as e:  # a user mistake; a ConfigError has one line per mistake
        for line in str(e).splitlines():
            print(f"labsupport {args.command}: error: {line}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"labsupport {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"labsupport {args.command}: interrupted; all ranks stopped", file=sys.stderr)
        return 130
    return 2


if __name__ == "__main__":
    sys.exit(main())
