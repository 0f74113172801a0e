"""`labsupport doctor --gpu` (`make gpu-check`): the strategies that fit this machine's GPUs, run on them.

CI has no GPU, and the GPU paths (CUDA devices, NCCL, the allocator, 16-bit autocast) run nowhere
else; this is the one command that runs them all and says, one line per check, what held. One GPU:
`single` in fp32, bf16 and fp16; fp32's memory by category (measured from the tensors, the CUDA
allocator's peak beside them) against `estimate_memory`, and its MFU against the device's datasheet
peak. Two or more: 2-rank ddp, zero3, tp, pp and deepspeed on NCCL, each equal to `single` in fp32
at every step (DESIGN.md 5). Every run is `labsupport train --json` started by strategy and dtype
name, as a user would start it. Without a GPU: one line saying so, and success.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
from typing import NamedTuple

# The runs: nano (2 layers, 4 heads: TP 2 and PP 2 divide it), 20 steps, fp32 unless the check says.
SETTINGS = ("--model", "nano", "--steps", "20", "--global-batch", "8", "--sample-chars", "0", "--eval-batches", "1")
LOSS_TOL, NORM_RTOL = 1e-4, 1e-4   # DESIGN.md 5: |loss - single's| per step; the gradient norm, relative
MEMORY_RTOL = 0.10                 # each category against estimate_memory, as tests/test_memory_measured.py
HALF_RTOL = 0.05                   # 16-bit's last loss against fp32's: a sanity bound, rounding differs


class Check(NamedTuple):
    name: str
    nproc: int
    argv: tuple[str, ...]          # `labsupport train` flags besides SETTINGS


def checks(gpus: int) -> list[Check]:
    """What runs on `gpus` GPUs: nothing without one; the single-device checks on one; and on two
    or more, the 2-rank strategies beside them (compared with single fp32)."""
    if gpus < 1:
        return []
    plan = [Check(f"single {dtype}", 1, ("--strategy", "single", "--dtype", dtype))
            for dtype in ("fp32", "bf16", "fp16")]
    if gpus >= 2:
        plan += [Check(f"{name} x2", 2, ("--strategy", name, *extra)) for name, extra in (
            ("ddp", ()), ("zero3", ()), ("tp", ("--tp", "2")), ("pp", ("--pp", "2")), ("deepspeed", ()))]
    return plan


def train(check: Check) -> dict:
    """The run's `labsupport train --json` summary; a failed run raises with its last line of stderr."""
    argv = [sys.executable, "-m", "labsupport.cli", "train", "--nproc", str(check.nproc), "--json",
            *SETTINGS, *check.argv]
    res = subprocess.run(argv, capture_output=True, text=True)
    if res.returncode != 0:
        lines = res.stderr.strip().splitlines() or [f"exit {res.returncode}"]
        raise RuntimeError(lines[-1])
    return json.loads(res.stdout.strip().splitlines()[-1])


def equal_to_single(run: dict, ref: dict) -> list[str]:
    """Where `run` differs from single's `ref` beyond DESIGN.md 5's tolerances, one item each."""
    problems = []
    for what, got, want, tol, relative in (("loss", run["losses"], ref["losses"], LOSS_TOL, False),
                                            ("gradient norm", run["grad_norms"], ref["grad_norms"], NORM_RTOL, True)):
        if len(got) != len(want):
            problems.append(f"{len(got)} {what}es against single's {len(want)}")
            continue
        diffs = [abs(a - b) / (abs(b) if relative else 1) for a, b in zip(got, want)]
        worst = max(range(len(diffs)), key=diffs.__getitem__)
        if not diffs[worst] <= tol:
            problems.append(f"{what} differs from single's by {diffs[worst]:.1e} at step {worst + 1} "
                            f"({'relative ' if relative else ''}tolerance {tol:g})")
    return problems


def memory_against_prediction(run: dict) -> tuple[list[str], str]:
    """(categories off by more than MEMORY_RTOL, a line of measured / predicted bytes) for a 1-rank fp32 run.
    PyTorch's fused attention stores no s x s scores: the prediction is selective recomputation's."""
    from .estimate.memory import estimate_memory
    from .estimate.shapes import get_preset
    cfg = get_preset(run["model"]["name"]).with_vocab(run["model"]["vocab"])
    want = estimate_memory(cfg, micro_batch=run["micro_batch"], precision="fp32", recompute="selective")
    got = run["memory"][0]
    keys = ("params", "grads", "optimizer", "activations")
    off = [f"{k} {got[k]:,} B vs predicted {want[k]:,.0f} B" for k in keys
           if abs(got[k] - want[k]) > MEMORY_RTOL * want[k]]
    line = ", ".join(f"{k} {got[k] / 2**20:.2f}/{want[k] / 2**20:.2f}" for k in keys)
    total = sum(want[k] for k in keys)
    return off, (f"MiB measured/predicted: {line}; "
                 f"allocator peak {got['peak'] / 2**20:.2f} (predicted {total / 2**20:.2f})")


def mfu_line(run: dict) -> tuple[list[str], str]:
    """(problems, line): MFU must be measured against a datasheet peak and lie in (0, 1)."""
    source, mfu = run["peak_flops_source"], run["mfu"]
    problems = [] if "datasheet" in source else [f"no datasheet peak ({source})"]
    if not (isinstance(mfu, float) and 0 < mfu < 1):
        problems.append(f"MFU {mfu} outside (0, 1)")
    return problems, f"MFU {mfu:.1%} of {run['peak_flops'] / 1e12:.1f} TFLOP/s ({source})"


def verdict(check: Check, run: dict, ref: dict | None) -> tuple[list[str], str]:
    """(problems, details) of one finished run; `ref` is single fp32's, None for that run itself."""
    loss = f"loss {run['losses'][0]:.4f} -> {run['losses'][-1]:.4f}"
    if not all(math.isfinite(x) for x in run["losses"]):
        return ["a loss is not finite"], loss
    if ref is None:
        off, memory = memory_against_prediction(run)
        slow, mfu = mfu_line(run)
        return off + slow, f"{loss}; {memory}; {mfu}"
    if check.nproc == 1:   # 16-bit: it learns, and ends near fp32
        problems = [] if run["losses"][-1] < run["losses"][0] else ["the loss did not fall"]
        gap = abs(run["losses"][-1] - ref["losses"][-1]) / ref["losses"][-1]
        if gap > HALF_RTOL:
            problems.append(f"last loss {gap:.1%} from fp32's (bound {HALF_RTOL:.0%})")
        slow, mfu = mfu_line(run)
        return problems + slow, f"{loss}, {gap:.2%} from fp32's; {mfu}"
    return equal_to_single(run, ref), f"{loss}, equal to single fp32 at every step"


def run_checks(gpus: int, out=print) -> list[dict]:
    """Run `checks(gpus)`, print one line each; each check's name, whether it held, and why not."""
    plan = checks(gpus)
    if not plan:
        out("gpu-check: skipped, no CUDA GPU here (torch.cuda.device_count() is 0); CI runs without one")
        return []
    results, ref = [], None
    for check in plan:
        reference = check is plan[0]   # single fp32: the run the others are held to
        try:
            if ref is None and not reference:
                raise RuntimeError("single fp32 failed, so there is nothing to compare with")
            run = train(check)
            problems, details = verdict(check, run, None if reference else ref)
            ref = run if reference else ref
        except (RuntimeError, KeyError, ValueError) as e:
            problems, details = [f"did not run: {e}"], ""
        results.append({"check": check.name, "ok": not problems, "problems": problems, "details": details})
        out(f"{'FAIL' if problems else 'ok  '} {check.name:<13} {'; '.join(problems) if problems else details}")
    held = sum(r["ok"] for r in results)
    out(f"gpu-check: {held} of {len(plan)} checks held on {gpus} GPU(s)")
    return results
