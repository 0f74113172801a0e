"""The planner held against published runs: what `labsupport plan --validate` prints.

For each run of `published.RUNS` the planner prices the run's own layout (`planner.evaluate` on the run's
machine, with its schedule's virtual stages and its framework's overlaps), and the predicted step becomes TFLOP/s per GPU in
the source's own convention (`Run.counts`): the source's FLOPs per step over the predicted step time,
so that predicted / published is the published step time over the predicted one. A run outside
BAND has a reason in REASONS: what the run did that the model does not see.
"""
from __future__ import annotations

from typing import NamedTuple

from .planner import Config, evaluate, step_flops
from .published import RUNS, Run

BAND = 0.15   # the target: every run within 15 %, or a reason

TERMS = ("compute", "tp_comm", "cp_comm", "pp_comm", "dp_comm", "bubble")

_MT_NLG = ("not identified: the quotations give neither the micro-batch nor the ZeRO stage nor the precision (taken "
           "as 1, ZeRO-1 and 16-bit), and the 1F1B bubble the model charges is 12 to 17 % of its step; Narayanan "
           "et al.'s 530B on TP 8 x PP 35 x DP 9, with Megatron-LM's interleaved schedule, measured 163 TFLOP/s "
           "per GPU, within 15 % of the model")
_LLAMA_BUBBLE = ("the interleaved schedule's stages per GPU and the micro-batch are not printed: with one stage and "
                 "micro-batch 1 the bubble, (p - 1) / m with m = 32 or 16, is a third to half of the predicted step")
REASONS = {
    **{f"MT-NLG 530B, DP {dp}": _MT_NLG for dp in (8, 10, 12)},
    **{f"Frontier {m}": ("the MI250X GCD's constants are 2024's (ROCm 6.2's matmul rate) or assumed (its attention "
                         "rate and memory bandwidth: no measurement was found), the runs used 2023's ROCm, and which "
                         "layout each measured percentage comes from is not printed") for m in ("175b", "1t")},
    "Llama 3 405B, 8,192 GPUs, 8k": _LLAMA_BUBBLE,
    "Llama 3 405B, 16,384 GPUs, 8k": _LLAMA_BUBBLE,
    "Llama 3 405B, 16,384 GPUs, 128k": _LLAMA_BUBBLE + (
        "; and whether Meta's MFU counts the masked half of the causal scores is not printed either: at 131,072 "
        "tokens that half is 29 % of the FLOPs counted here"),
}


class Check(NamedTuple):
    """One row of the table: the run, the planner's prediction for its layout, and their ratio."""

    run: Run
    config: Config
    predicted_tflops: float
    ratio: float          # predicted / published TFLOP/s per GPU
    dominant: str         # the step's largest term
    reason: str           # why it lies outside BAND ("" inside)

    def to_json(self) -> dict:
        r = self.run
        return {"run": r.name, "source": r.source, "machine": r.machine.name, "gpus": r.gpus, "counts": r.counts,
                "layout": dict(dp=r.dp, tp=r.tp, pp=r.pp, cp=r.cp, micro_batch=r.micro_batch, virtual=r.virtual,
                               zero=r.zero, recompute=r.recompute, global_batch=r.global_batch),
                "framework": r.framework._asdict(), "published_tflops_per_gpu": r.tflops_per_gpu,
                "predicted_tflops_per_gpu": self.predicted_tflops, "ratio": self.ratio, "dominant": self.dominant,
                "within_band": abs(self.ratio - 1) <= BAND, "reason": self.reason, "notes": r.notes,
                "step_time_s": self.config.step_time_s, "memory_per_gpu": self.config.memory_per_gpu,
                "fits": self.config.fits,
                **{f"{t}_s": getattr(self.config, f"{t}_s") for t in TERMS}}


def dominant(c: Config) -> str:
    """The term of the step that takes longest."""
    return max(TERMS, key=lambda t: getattr(c, f"{t}_s"))


def check(run: Run) -> Check:
    c = evaluate(run.cfg, run.machine, run.gpus, run.global_batch, run.dp, run.tp, run.pp,
                 run.micro_batch, run.zero, run.recompute, cp=run.cp, virtual=run.virtual, framework=run.framework)
    flops = step_flops(run.cfg, run.global_batch, run.recompute if run.counts == "hardware" else "none")
    predicted = flops / c.step_time_s / run.gpus / 1e12
    ratio = predicted / run.tflops_per_gpu
    reason = "" if abs(ratio - 1) <= BAND else REASONS.get(run.name, "")
    return Check(run, c, predicted, ratio, dominant(c), reason)


def validate(runs=RUNS) -> list[Check]:
    """Every run's check, in `runs`' order."""
    return [check(r) for r in runs]
