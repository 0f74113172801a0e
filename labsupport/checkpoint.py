"""Checkpoints that survive a crash at any moment and resume bit-identically.

Layout: `DIR/step000040/rank0.pt ... rank{N-1}.pt`, `layout.json` (the strategy and rank grid
that wrote them, so a resume on another layout is refused before any rank starts) and
`DIR/step000040/COMPLETE`.
Each file is written to a temporary name and renamed (atomic on POSIX), and rank 0 writes
COMPLETE only after every rank has renamed its file; a checkpoint without COMPLETE is
ignored. So a run killed mid-save resumes from the previous complete step. Files hold only
tensors and plain containers, so they load with `weights_only=True` (no pickle code runs).
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

COMPLETE = "COMPLETE"
LAYOUT = "layout.json"


def step_dir(root, step: int) -> Path:
    return Path(root) / f"step{step:06d}"


def atomic_save(obj, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save(root, step: int, rank: int, state: dict, barrier, layout: dict | None = None) -> Path:
    """Every rank saves its part; after `barrier()` rank 0 records the layout and marks the step complete."""
    d = step_dir(root, step)
    d.mkdir(parents=True, exist_ok=True)
    atomic_save(state, d / f"rank{rank}.pt")
    barrier()
    if rank == 0:
        if layout is not None:
            _atomic_write_text(d / LAYOUT, json.dumps(layout, sort_keys=True))
        _atomic_write_text(d / COMPLETE, str(step))
    return d


def layout(root, step: int) -> dict | None:
    """The strategy and grid that wrote checkpoint `step` (None if it recorded none)."""
    path = step_dir(root, step) / LAYOUT
    return json.loads(path.read_text()) if path.exists() else None


def latest(root) -> int | None:
    """The last step with a complete checkpoint, or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    steps = [int(d.name[4:]) for d in root.glob("step*") if (d / COMPLETE).exists() and d.name[4:].isdigit()]
    return max(steps, default=None)


def load(root, step: int, rank: int) -> dict:
    return torch.load(step_dir(root, step) / f"rank{rank}.pt", map_location="cpu", weights_only=True)
