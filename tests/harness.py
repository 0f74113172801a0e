"""The strategy tests' one harness: train a configuration through `labsupport train --json` (each
configuration once per pytest session, whichever test or file asks first), compare it with `single`
on the same settings (losses, every step's gradient norm, validation loss, sampled text,
parameters), check which process groups carry its traffic, and plant a bug in a copy of the package
that the ranks of `labsupport train` then run.

Equivalence is the proof (DESIGN 5): any strategy, same global batch and seed, fp32, must give
single's losses and its gradient norm before clipping at every step; under AdamW (and clipping)
the losses alone cannot see a gradient scaled by a constant, the norm can."""
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from conftest import cli
from labsupport import checkpoint
from labsupport.train import build_parser

# Settings every run of a file shares; `single(settings=...)` is the reference for all runs on them.
# nano: 2 layers (one per stage at pp 2), 4 heads and hidden 64 (tp 2 and 4 divide them).
NANO = ("--model", "nano", "--steps", "20", "--global-batch", "8", "--sample-chars", "0", "--eval-batches", "1",
        "--checkpoint-every", "10")
# 3D's 8-rank grid is the suite's dearest run: 10 steps, with a sample (every rank takes part in it)
NANO_10 = ("--model", "nano", "--steps", "10", "--global-batch", "8", "--sample-chars", "12", "--eval-batches", "1",
           "--checkpoint-every", "5")
# micro's 4 layers: 2 chunks on each of 2 stages, or one layer on each of 4
MICRO = ("--model", "micro", "--seq-len", "16", "--steps", "6", "--global-batch", "8", "--sample-chars", "0",
         "--eval-batches", "1")
# the Llama family's CPU preset (RMSNorm, SwiGLU, RoPE, 4 query heads on 2 key/value heads, an untied head):
# 4 layers, one per stage at pp 4; 32 positions, 4 chunks for the ring at cp 2; a short sample (every rank
# takes part, the ring paused); the last step's checkpoint, for the parameters
LLAMA = ("--model", "llama-micro", "--seq-len", "32", "--steps", "6", "--global-batch", "8", "--sample-chars",
         "8", "--eval-batches", "1", "--checkpoint-every", "6")

# Planted bugs, each a list of (module, [(anchor, replacement), ...]): the one place their anchors live.
PLANTS = {
    # the data-parallel gradient average becomes a sum: DDP's all-reduced buckets, ZeRO-1/2's reduce-scattered ones
    "sum instead of average": [
        ("labsupport.parallel.ddp", [('comm.all_reduce(self.buffer, "avg"', 'comm.all_reduce(self.buffer, "sum"')]),
        ("labsupport.parallel.zero", [('comm.reduce_scatter_tensor(self.shard, self.buffer, "avg"',
                                       'comm.reduce_scatter_tensor(self.shard, self.buffer, "sum"')]),
    ],
    # fp16: the clip measures the gradients while they are still multiplied by the loss scale
    "clip before unscale": [
        ("labsupport.loop", [("""    if scaler is not None:
        scaler.unscale_(optimizer)
    grad_norm = strategy.clip_grad_norm_(model, grad_clip)""", """    grad_norm = strategy.clip_grad_norm_(model, grad_clip)
    if scaler is not None:
        scaler.unscale_(optimizer)""")]),
    ],
    # the tied embedding/head matrix, summed over the embedding group, counted on both stages
    "tied matrix counted twice in the norm": [
        ("labsupport.parallel.pipeline", [("own = [p for p in counted if p is not self.tied]",
                                           "own = list(counted)")]),
    ],
}

WORKDIR: Path | None = None  # set per session by conftest: runs and checkpoints go under it
LAUNCHES: list[tuple] = []   # every launch the harness made, for the session's summary line
REUSED: list[tuple] = []     # every request a run of the session answered instead
_RUNS: dict = {}


class Run(dict):
    """A `labsupport train --json` summary, with the run's checkpoint directory and its arguments."""

    def __init__(self, summary: dict, checkpoint_dir: Path, argv: list):
        super().__init__(summary)
        self.checkpoint_dir, self.argv = checkpoint_dir, argv

    def params(self, rank: int = 0, step: int | None = None) -> dict:
        """Rank `rank`'s model state from the checkpoint at `step` (default: the last step)."""
        return checkpoint.load(self.checkpoint_dir, step or self["steps"], rank)["model"]


def canonical(strategy: str, nproc: int, settings, args) -> tuple:
    """What a run is, whatever the order of its flags or defaults spelled out: the parsed options."""
    options = vars(build_parser().parse_args([*map(str, settings), "--strategy", strategy, *map(str, args)]))
    options.pop("checkpoint_dir"), options.pop("run_dir")
    return (int(nproc), *sorted(options.items()))


def train(strategy: str, nproc: int, *args, settings=NANO, env: dict | None = None) -> Run:
    """`labsupport train --strategy STRATEGY --nproc NPROC --json SETTINGS ARGS` with a checkpoint
    directory of its own; each configuration runs once per session (a run under `env`, e.g. a
    planted copy, every time). Returns the summary; the caller must not change it."""
    key = canonical(strategy, nproc, settings, args)
    if env is None and key in _RUNS:
        REUSED.append(key)
        return _RUNS[key]
    assert WORKDIR is not None, "the harness runs inside pytest (conftest sets its directory)"
    where = WORKDIR / f"{strategy}-{nproc}-{len(LAUNCHES)}"
    LAUNCHES.append(key)
    argv = ["--strategy", strategy, "--nproc", nproc, "--json", *settings, *args]
    res = cli("train", *argv, "--checkpoint-dir", where / "ckpt", "--run-dir", where / "run", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    run = Run(json.loads(res.stdout.splitlines()[-1]), where / "ckpt", argv)
    if env is None:
        _RUNS[key] = run
    return run


# The rank side of `prefetch`: every checked configuration of the file given, in turn, in one process group
BATCH = """
import json, sys
from labsupport import runtime
from labsupport.loop import train
from labsupport.train import load_checked
with runtime.init() as rt:
    for checked in json.load(open(sys.argv[1])):
        args, cfg, config = load_checked(checked)
        runtime.report(**train(args, rt, cfg, config), strategy=args.strategy, world_size=rt.world_size)
"""
# Ours, and torch's references; not Accelerate's or DeepSpeed's, whose runs leave state in the process
BATCHED = {"single", "ddp", "zero1", "zero2", "zero3", "tp", "pp", "cp", "3d",
           "torch-ddp", "torch-zero1", "torch-fsdp", "torch-tp", "torch-pp", "accelerate-fsdp"}


def prefetch(*requests) -> None:
    """Train the configurations `(strategy, nproc, args[, settings])` ahead, one launch per world size:
    its ranks train each configuration in turn (BATCH), saving a launch's start (processes importing
    torch, the ranks forming their group) per configuration; `train` then answers from
    them. The loop reseeds and builds everything per run, so a run gives what its own launch gives.
    Only our strategies are batched; a batch that fails leaves its configurations to `train` one by
    one, whose launch then says what failed."""
    groups: dict[int, list] = {}
    for strategy, nproc, args, *rest in requests:
        settings = rest[0] if rest else NANO
        key = canonical(strategy, nproc, settings, args)
        if strategy in BATCHED and key not in _RUNS and key not in [k for k, *_ in groups.get(nproc, [])]:
            groups.setdefault(nproc, []).append((key, strategy, [*map(str, settings), "--strategy", strategy,
                                                                 *map(str, args)]))
    for nproc, runs in groups.items():
        if len(runs) > 1:
            _train_batch(nproc, runs)


def _train_batch(nproc: int, runs: list) -> None:
    from labsupport.launch import RankFailed, launch
    from labsupport.train import build_parser, dump_checked, summarize, validate
    where = WORKDIR / f"batch-{nproc}-{len(LAUNCHES)}"
    where.mkdir(parents=True)
    LAUNCHES.append(("batch", nproc, len(runs)))
    parsed = []
    for i, (_, strategy, argv) in enumerate(runs):
        args = build_parser().parse_args([*argv, "--checkpoint-dir", str(where / f"ckpt{i}")])
        parsed.append((args, *validate(args, nproc)))
    (where / "runs.json").write_text(json.dumps([dump_checked(*p) for p in parsed]))
    (where / "batch.py").write_text(BATCH)
    try:
        res = launch(str(where / "batch.py"), str(where / "runs.json"), nproc=nproc, run_dir=where / "run",
                     out=io.StringIO())
    except RankFailed:
        return
    reports = res.reports  # rank -> one report per configuration, in order
    for i, ((key, strategy, argv), (args, _, config)) in enumerate(zip(runs, parsed)):
        summary = summarize(args, config, nproc, [reports[r][i] for r in range(nproc)], res)
        del summary["run_dir"]  # the batch's: its traces and logs are the last configuration's
        _RUNS[key] = Run(summary, where / f"ckpt{i}", ["--strategy", strategy, "--nproc", nproc, "--json",
                                                         *argv[:argv.index("--strategy")],
                                                         *argv[argv.index("--strategy") + 2:]])


def single(*args, settings=NANO) -> Run:
    """The reference: `single` on one rank with these settings (ARGS: e.g. its own micro-batch)."""
    return train("single", 1, *args, settings=settings)


def resume(run: Run, step: int, tmp_path: Path) -> Run:
    """`run` again, resumed from a copy of its checkpoint at `step` (the cached run's stays as it was)."""
    ckpt = tmp_path / "resumed"
    shutil.copytree(checkpoint.step_dir(run.checkpoint_dir, step), checkpoint.step_dir(ckpt, step))
    return resume_from(run, ckpt, tmp_path)


def resume_from(run: Run, ckpt: Path, tmp_path: Path) -> Run:
    """`run`'s configuration again, resumed from the latest checkpoint in `ckpt` (another run of it wrote them)."""
    res = cli("train", *run.argv, "--checkpoint-dir", ckpt, "--run-dir", tmp_path / "run", "--resume")
    assert res.returncode == 0, res.stderr[-3000:]
    LAUNCHES.append(("resumed", *run.argv))
    return Run(json.loads(res.stdout.splitlines()[-1]), ckpt, run.argv)


def _within(what: str, got, want, abs_tol=None, rel_tol=None) -> None:
    """Step by step: |got - want| <= abs_tol, or |got - want| / want <= rel_tol."""
    assert len(got) == len(want), f"{what}: {len(got)} steps against single's {len(want)}"
    if abs_tol is not None:
        diffs, tol = [abs(a - b) for a, b in zip(got, want)], abs_tol
    else:
        diffs, tol = [abs(a - b) / b for a, b in zip(got, want)], rel_tol
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    assert diffs[worst] <= tol, (f"{what} differ from single's by up to {diffs[worst]:.2e} "
                                 f"({'absolute' if abs_tol is not None else 'relative'}, step {worst}; "
                                 f"tolerance {tol:g}): {diffs}")


def assert_same_as_single(out: dict, ref: dict, *, loss_tol=1e-5, loss_rtol=None, norm_rtol=1e-4, val_tol=1e-5,
                          params: str | None = None, param_atol=1e-4) -> None:
    """`out` gives `ref`'s (single's) results on the same settings, step by step:
    - losses within `loss_tol` (absolute; or `loss_rtol` relative, for bf16),
    - the gradient norm before clipping within `norm_rtol` relative at every step (None: not compared),
    - the validation losses within `val_tol` (None: not compared), the sampled text equal where sampled,
    - with `params`, rank 0's parameters in the last checkpoint within `param_atol`: "whole" (each
      rank holds whole parameters), "flat" (rank 0's shard: of each parameter the first elements of
      the flattened tensor, or none; ZeRO-3), "rows" (of each the first rows, torch's Shard(0)).
      To 1e-4, not 1e-5: the key bias gets no true gradient (softmax ignores a shift shared by all
      keys), only rounding noise, and Adam scales that noise to lr-sized steps.
    Each failure names what differs ("losses", "gradient norms", "validation losses", "sample",
    "parameter NAME")."""
    same = ("model", "global_batch", "dtype", "steps")
    assert ref["strategy"] == "single" and ref["world_size"] == 1, "the reference is a single-device run"
    assert {k: out[k] for k in same} == {k: ref[k] for k in same}, "compared with single on other settings"
    assert len(out["losses"]) == len(ref["losses"]) == ref["steps"]
    _within("losses", out["losses"], ref["losses"], abs_tol=loss_tol, rel_tol=loss_rtol)
    if norm_rtol is not None:
        _within("gradient norms", out["grad_norms"], ref["grad_norms"], rel_tol=norm_rtol)
    if val_tol is not None:
        assert [s for s, _ in out["val_losses"]] == [s for s, _ in ref["val_losses"]], "validation losses: steps"
        _within("validation losses", [v for _, v in out["val_losses"]], [v for _, v in ref["val_losses"]],
                abs_tol=val_tol)
    if out.get("sample") is not None or ref.get("sample") is not None:
        assert out["sample"] == ref["sample"], f"sample differs: {out['sample']!r} vs single's {ref['sample']!r}"
    if params:
        mine, theirs = out.params(), ref.params()
        for name, p in mine.items():
            want = {"whole": theirs[name], "flat": theirs[name].reshape(-1)[:p.numel()],
                    "rows": theirs[name][:p.shape[0]]}[params]
            assert p.shape == want.shape and torch.allclose(p, want, atol=param_atol, rtol=0), \
                f"parameter {name} differs from single's"


def assert_traffic_in(out: dict, groups, *, exact: bool = False) -> None:
    """Every rank's last step talks in `groups` only (process groups by name: dp, tp, pp, embedding,
    world); with `exact`, in each of them."""
    for rank, by_group in enumerate(out["comm_groups"]):
        used = set(by_group)
        assert used == set(groups) if exact else used <= set(groups), \
            f"rank {rank} talks in {sorted(used)}, expected {'' if exact else 'within '}{sorted(groups)}"


def group_traffic(out: dict, rank: int, keys=("calls", "payload_bytes")) -> dict:
    """Rank `rank`'s last step: {group: {op: {key: value}}} for `keys` (wire bytes left out by default)."""
    return {group: {op: {k: c[k] for k in keys} for op, c in by_op.items()}
            for group, by_op in out["comm_groups"][rank].items()}


def planted(tmp_path: Path, bug: str) -> dict:
    """A copy of the labsupport package under `tmp_path` with `PLANTS[bug]` planted (each anchor must
    occur in its module: a changed source fails here, loudly), and the environment under which
    every process a launch starts (torchrun's agent, each rank) imports the copy instead of the
    package; `train(..., env=planted(...))` runs it."""
    import labsupport
    root = tmp_path / "planted"
    package = Path(labsupport.__file__).parent
    shutil.copytree(package, root / "labsupport", ignore=shutil.ignore_patterns("__pycache__"))
    (root / "data").symlink_to(package.parent / "data")  # the corpus, found beside the package
    for module, replacements in PLANTS[bug]:
        path = root / (module.replace(".", "/") + ".py")
        source = path.read_text()
        for old, new in replacements:
            assert old in source, f"the planted bug's anchor is gone from {module}: {old!r}"
            source = source.replace(old, new)
        path.write_text(source)
    # PYTHONSAFEPATH: `python -m` would put the working directory (the repository) first on sys.path
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])),
           "PYTHONSAFEPATH": "1"}
    where = "import importlib.util as u; print(u.find_spec('labsupport').origin)"
    found = subprocess.run([sys.executable, "-c", where], capture_output=True, text=True, env={**os.environ, **env},
                           check=True).stdout.strip()
    assert found == str(root / "labsupport" / "__init__.py"), f"the copy is not what runs: {found}"
    return env
