"""Shared test helpers: run the CLI, find processes a run left behind and the sockets they listen on.
(Training a configuration and comparing it with `single`: harness.py.)"""
import contextlib
import io
import ipaddress
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from labsupport.launch import alive, descendants

REPO = Path(__file__).resolve().parent.parent


SESSION = "LABSUPPORT_TEST_SESSION"


def pytest_configure(config):
    os.environ[SESSION] = str(os.getpid())  # inherited by every process a test, notebook or launch starts
    _share_the_cores()
    config.addinivalue_line("markers", "slow: a few slow tests, still part of make test")
    config.addinivalue_line("markers", "multiprocess: launches real ranks")
    config.addinivalue_line("markers", "browser: drives headless Chromium")


def _share_the_cores():
    """Under pytest-xdist (`make test` runs three workers) each worker's ranks count only its share of
    the cores (LABSUPPORT_CPUS, inherited by every rank, kernel and server its tests start), so the
    launcher gives each rank that share as threads (runtime.threads_per_rank). With the whole
    machine's count, a 1-rank run used 2 threads on 2 cores beside the other worker's 8 ranks, and
    its OpenMP threads waited for each other: 8x slower. The scheduler still spreads all ranks over
    all cores (pinning each worker to its own core instead left cores idle while a worker waited)."""
    worker, workers = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker and workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        os.environ["LABSUPPORT_CPUS"] = str(max(1, cores // int(workers)))


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    """Every test writes its run directories under its own tmp dir."""
    monkeypatch.setenv("LABSUPPORT_RUNS", str(tmp_path / "runs"))


@pytest.fixture(scope="session", autouse=True)
def _harness_dir(tmp_path_factory):
    """The harness's runs (one per configuration and session) live in one directory of the session."""
    import harness
    harness.WORKDIR = tmp_path_factory.mktemp("harness")


def pytest_terminal_summary(terminalreporter):
    harness = sys.modules.get("harness")
    if harness is not None and harness.LAUNCHES:
        terminalreporter.write_line(f"harness: {len(harness.LAUNCHES)} launches of labsupport train, "
                                    f"{len(harness.REUSED)} more requests answered by the session's runs")


@pytest.fixture(autouse=True)
def _bug_labs_as_shipped():
    """A bug lab counts the first source it grades as the cell as shipped (exercise.grade); in a test
    session, as in a fresh kernel, each test starts anew."""
    from labsupport.lab.exercise import EXERCISES
    for exercise in EXERCISES.values():
        exercise.shipped = None


def planted_copy(module, replacements, path: Path) -> None:
    """Write `module`'s source to `path` with bugs planted (each (old, new) must occur in it) and its
    relative imports made absolute, so a test's script can import the copy in place of the real one."""
    package = module.__package__
    parent = package.rsplit(".", 1)[0]
    source = open(module.__file__).read()
    source = re.sub(r"\bfrom \.\. import", f"from {parent} import", source)
    source = re.sub(r"\bfrom \.\.(\w)", rf"from {parent}.\1", source)
    source = re.sub(r"\bfrom \.(\w)", rf"from {package}.\1", source)
    for old, new in replacements:
        assert old in source, f"the planted bug's anchor is gone from {module.__name__}: {old!r}"
        source = source.replace(old, new)
    path.write_text(source)


def cases_on_ranks(tmp_path_factory, script: str, cases: dict, prepare=None):
    """`reports(label)`: a case's report per rank. `cases` is {label: (ranks, check, its arguments)};
    the first case asked for on N ranks launches `script` once with every case on N ranks (as JSON):
    a launch's start (torchrun and N imports of torch) is paid once, not per case. `prepare(folder)`
    writes what the script imports beside it (planted copies of a module)."""
    import json

    from labsupport.launch import launch
    runs = {}

    def reports(label):
        nproc = cases[label][0]
        if nproc not in runs:
            folder = tmp_path_factory.mktemp(f"checks{nproc}")
            if prepare is not None:
                prepare(folder)
            (folder / "checks.py").write_text(script)
            mine = [(name, *case[1:]) for name, case in cases.items() if case[0] == nproc]
            runs[nproc] = launch(str(folder / "checks.py"), json.dumps(mine), nproc=nproc, timeout=240,
                                 run_dir=folder / "run")
        return [runs[nproc].report(rank)[label] for rank in range(nproc)]
    return reports


def run_cli(*args, timeout=300, env=None):
    """`labsupport ARGS...` in a subprocess; returns the CompletedProcess (text)."""
    return subprocess.run([sys.executable, "-m", "labsupport.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def cli(*args, env=None) -> subprocess.CompletedProcess:
    """`labsupport ARGS...` run by the CLI's own `main` in this process: the code `python -m
    labsupport.cli` runs, without a fresh interpreter's ~1.5 s of importing torch (run_cli keeps
    the subprocess). The ranks a launch starts are processes as ever, `env` added to their
    environment. An exception escaping `main` fails the test, as a subprocess's traceback would."""
    from labsupport.cli import main
    out, err = io.StringIO(), io.StringIO()
    saved = {name: os.environ.get(name) for name in env or {}}
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([*map(str, args)])
            except SystemExit as e:  # argparse's own refusals
                code = e.code
    finally:
        for name, value in saved.items():
            os.environ.pop(name) if value is None else os.environ.__setitem__(name, value)
    return subprocess.CompletedProcess(["labsupport", *map(str, args)], code, out.getvalue(), err.getvalue())


def pytest_sessionfinish(session, exitstatus):
    """No test, notebook (nbval) or launch may leave a process behind: after the last test, nothing
    that carries this session's tag may still run (a few seconds' grace for processes that are exiting)."""
    from labsupport import forkserver
    running = forkserver.running()  # what this process's fork servers still run: left behind by a launch
    forkserver.stop()
    if running:
        print("\nprocesses left behind by launches: " + "; ".join(f"{pid}: {_command(pid)}" for pid in running))
        session.exitstatus = 1
    needle = f"{SESSION}={os.getpid()}"
    deadline = time.monotonic() + 15
    while (left := _processes_with(needle)) and time.monotonic() < deadline:
        time.sleep(0.5)
    if left:
        print("\nprocesses left behind by the tests: " + "; ".join(f"{pid}: {_command(pid)}" for pid in left))
        session.exitstatus = 1


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:150]
    except OSError:
        return "(exited)"


def processes_of(run_dir) -> list[int]:
    """PIDs of live processes started for `run_dir`: those whose environment names it, and those a fork
    server forked for it, which keep their server's environment in /proc (labsupport.forkserver): the
    agent and the ranks its pid files name, and everything below them."""
    run_dir = Path(run_dir).resolve()
    named = [int(f.read_text()) for pattern in ("agent-pid", "pid-rank*") for f in run_dir.glob(pattern)]
    found = set(_processes_with(f"LABSUPPORT_RUN_DIR={run_dir}"))
    for pid in filter(alive, named):
        found.update([pid, *descendants(pid)])
    return sorted(found - {os.getpid()})


def _processes_with(variable: str) -> list[int]:
    """PIDs of live processes (not this one, not zombies) whose environment holds `variable` (NAME=value)."""
    needle = variable.encode()
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


def listening_addresses(pids) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of every TCP socket that `pids` listen on: what `ss -ltnp` lists for them."""
    inodes = set()
    for pid in pids:
        try:
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # exited meanwhile
            continue
        inodes.update(link[len("socket:["):-1] for link in links if link.startswith("socket:["))
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state, inode = line.split()[1], line.split()[3], line.split()[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                found.append((ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))),
                              int(port, 16)))
    return found


def on_loopback(address) -> bool:
    return address.is_loopback or bool(getattr(address, "ipv4_mapped", None) and address.ipv4_mapped.is_loopback)
