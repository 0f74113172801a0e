"""Shared test helpers: run the CLI, and find processes a run left behind."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: a few slow tests, still part of make test")
    config.addinivalue_line("markers", "multiprocess: launches real ranks")
    config.addinivalue_line("markers", "browser: drives headless Chromium")


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    """Every test writes its run directories under its own tmp dir."""
    monkeypatch.setenv("LABSUPPORT_RUNS", str(tmp_path / "runs"))


def run_cli(*args, timeout=300, env=None):
    """`labsupport ARGS...` in a subprocess; returns the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "labsupport.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def processes_of(run_dir) -> list[int]:
    """PIDs of live processes started for `run_dir` (their environment names it)."""
    needle = f"LABSUPPORT_RUN_DIR={Path(run_dir).resolve()}".encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            pids.append(int(entry))
    return pids
