"""Run directories: where a run's logs, metrics, traces and configuration go.

Both sides of torchrun use them, so they live apart from the launcher: `launch()` makes the
directory before any rank starts and tells the ranks in LABSUPPORT_RUN_DIR; a rank started
without it (a bare torchrun) makes its own.
"""
from __future__ import annotations

import datetime
import os
import re
from pathlib import Path


class RunDirError(RuntimeError):
    """A run directory that cannot be made or written to; the message is one line."""


def runs_root() -> Path:
    """Where run directories go: $LABSUPPORT_RUNS, else ./runs (the Makefile points it at the repo's runs/)."""
    return Path(os.environ.get("LABSUPPORT_RUNS") or "runs")


def display_path(path) -> str:
    """A path as messages show it: relative to the working directory when that is short (runs/...,
    ../runs/... from a notebook), so stored notebook outputs carry no machine's absolute paths."""
    relative = os.path.relpath(path)
    return str(path) if relative.startswith(os.path.join("..", "..")) else relative


def make_run_dir(run_dir=None, name: str = "run") -> Path:
    """`run_dir`, or a new directory under runs_root() named by the time and `name`; made and checked writable."""
    if run_dir is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        run_dir = runs_root() / f"{stamp}-{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}"
    run_dir = Path(run_dir).resolve()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"cannot use run directory {run_dir}: {e.strerror}; pass a writable --run-dir") from None
    return run_dir
