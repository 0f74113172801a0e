"""`labsupport plan --validate` (estimate/validation.py): the planner against published runs, row by row."""
import json

import pytest

from labsupport import cli
from labsupport.estimate.published import NARAYANAN_RUNS, RUNS
from labsupport.estimate.validation import BAND, REASONS, TERMS, check, validate

CHECKS = {c.run.name: c for c in validate()}


@pytest.mark.parametrize("name", list(CHECKS))
def test_every_run_is_within_the_band_or_says_why(name):
    """A change to the model that moves a run out of the band fails here until REASONS says why."""
    c = CHECKS[name]
    assert abs(c.ratio - 1) <= BAND or c.reason, f"{name}: {c.ratio:.2f}x with no reason"


def test_no_reason_stands_for_a_run_inside_the_band():
    """A reason is kept only while its run misses: a change that brings one into the band must drop it."""
    stale = [name for name in REASONS if abs(CHECKS[name].ratio - 1) <= BAND]
    assert not stale, stale


def test_the_misses_lie_where_their_reasons_say():
    """Each reason stands beside an optimistic model (the run lost time the model does not see) but the Llama 3
    rows', whose unprinted interleaving the model cannot use (v = 1): there the model is pessimistic."""
    for name, c in CHECKS.items():
        if c.reason:
            assert (c.ratio < 1) == c.reason.startswith("the interleaved schedule's"), (name, c.ratio)
            assert 0.6 < c.ratio < 1.7, (name, c.ratio)


def test_the_table_covers_three_generations_and_its_sources():
    machines = {c.run.machine.name for c in CHECKS.values()}
    assert len(CHECKS) >= 8 and {"DGX A100", "DGX H100", "Frontier (MI250X GCD)"} <= machines
    assert {c.dominant for c in CHECKS.values()} <= set(TERMS)


def test_a_row_is_the_runs_step_in_its_sources_convention():
    """Narayanan's 1T row by hand: its hardware FLOPs (recomputation counted) over the predicted step and GPUs."""
    from labsupport.estimate.planner import step_flops
    run = NARAYANAN_RUNS[-1]
    c = check(run)
    assert c.predicted_tflops == pytest.approx(step_flops(run.cfg, 3072, "full") / c.config.step_time_s / 3072 / 1e12)
    assert c.ratio == pytest.approx(c.predicted_tflops / 163)
    assert (c.config.tp, c.config.pp, c.config.dp, c.config.virtual, c.config.micro_batch) == (8, 64, 6, 1, 1)
    selective = CHECKS["175B, selective + SP"]   # model FLOPs: the recomputed attention core not counted
    assert selective.predicted_tflops == pytest.approx(
        step_flops(selective.run.cfg, 64, "none") / selective.config.step_time_s / 64 / 1e12)
    assert (selective.config.virtual, selective.config.recompute) == (3, "selective")


def test_the_cli_prints_the_table_and_its_json(capsys):
    assert cli.main(["plan", "--validate"]) == 0
    out = capsys.readouterr().out
    assert f"of {len(RUNS)} within 15%" in out and "Outside the band, why:" in out
    for run in RUNS:
        assert run.name in out
    assert cli.main(["plan", "--validate", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["band"] == BAND and len(payload["runs"]) == len(RUNS)
    row = payload["runs"][0]
    assert {"run", "source", "published_tflops_per_gpu", "predicted_tflops_per_gpu", "ratio", "dominant", "reason",
            "within_band", "layout", "framework"} <= set(row)
    assert payload["within_band"] == sum(r["within_band"] for r in payload["runs"])


def test_the_planners_share_of_the_best_kernel_rates_is_table_1s_median():
    """planner.EFFICIENCY is fitted once: the median over Narayanan et al.'s ten runs of what they measured over
    what the planner predicts with every kernel at its best measured rate (a share of 1)."""
    import statistics

    from labsupport.estimate.planner import EFFICIENCY, evaluate, step_flops
    shares = []
    for run in NARAYANAN_RUNS:
        c = evaluate(run.cfg, run.machine, run.gpus, run.global_batch, run.dp, run.tp, run.pp, run.micro_batch,
                     run.zero, run.recompute, efficiency=1.0, virtual=run.virtual, framework=run.framework)
        best = step_flops(run.cfg, run.global_batch, run.recompute) / c.step_time_s / run.gpus / 1e12
        shares.append(run.tflops_per_gpu / best)
    assert statistics.median(shares) == pytest.approx(EFFICIENCY, abs=0.005)
