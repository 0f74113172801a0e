"""Launch cells: start N real ranks with torchrun, stream their output, supervise, clean up.

Two halves live here, one on each side of torchrun:

* the launcher (`launch()`, the `%%torchrun` magic, `labsupport launch`) runs in the notebook
  kernel or the shell. It checks the arguments, picks a free port on 127.0.0.1, starts
  torchrun in its own process session, prints each rank's lines as they arrive, enforces a
  timeout, and on any failure, timeout or interrupt kills the whole process tree;
* the rank wrapper (rank.py: `python -m labsupport.rank SCRIPT|-m MODULE ...`, started by
  torchrun once per rank) prefixes the rank's output, tees it to `rank{k}.log`, records the
  rank's exit code or traceback in the run directory, and can dump its Python stack on
  request so a hung rank can say where it is waiting.

The launcher knows nothing about models: it runs any script or module. Run directories are
rundir.py's, which both sides use (`make_run_dir` and `display_path` are re-exported here).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .rundir import RunDirError, display_path, make_run_dir

DEFAULT_NOTEBOOK_TIMEOUT = 600
# A launch's `timeout` counts from the moment every rank is up (through labsupport.init(): torch
# imported, the others met), so that a start slowed by a loaded machine does not eat a limit meant
# for the ranks' work. The ranks get this long to come up; past it the timeout counts anyway (a
# script that never calls labsupport.init() never says it is up).
STARTUP_TIMEOUT_S = 60
UP_ENV = "LABSUPPORT_SAY_UP"   # set by launch(): labsupport.init() then leaves up-rank{k} in the run directory
# What each rank leaves for its launcher to read back about this launch: its report()s, up and exit marks,
# error, pid and stack dump. A run directory used again holds the last launch's (forget_earlier_launch).
KILLED_S = 5.0  # kill_pids: how long a SIGKILLed process may take to end
RANK_RECORDS = ("report-rank*.jsonl", "up-rank*", "exit-rank*", "error-rank*.json", "pid-rank*", "stack-rank*.txt")
_RANK_LINE = re.compile(r"^\[rank (\d+)\] ")
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|communicator was aborted|Broken pipe", re.I)


class LaunchError(RuntimeError):
    """A launch that was refused, failed, or timed out. Shown in notebooks without a traceback wall."""

    def _render_traceback_(self):  # IPython shows this instead of the full traceback
        return [f"\033[31m{type(self).__name__}\033[0m: {self}"]


class RankFailed(LaunchError):
    pass


class LaunchTimeout(LaunchError):
    pass


# ---------------------------------------------------------------- ports

def free_port() -> int:
    """A port nobody listens on right now (the OS picks it), on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- argument checks

def check_target(script=None, module=None) -> list[str]:
    """The rank command after `python -m labsupport.launch`, or a LaunchError saying what is wrong."""
    import importlib.util
    if (script is None) == (module is None):
        raise LaunchError("give exactly one of a script path or -m MODULE")
    if script is not None:
        path = Path(script)
        if not path.is_file():
            raise LaunchError(f"script not found: {script}")
        return [str(path.resolve())]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise LaunchError(f"module not found: {module} (is it installed in {sys.executable}?)")
    return ["-m", module]


RANK_MEMORY_BYTES = 2**29  # what one CPU rank of a tiny model takes (torch, gloo, the model): ~0.5 GiB


def max_cpu_ranks() -> int:
    """How many CPU ranks this machine can run: 4 per core (at least 8, so the 2 x 2 x 2 grid runs
    on a laptop), and no more than its memory holds at RANK_MEMORY_BYTES each."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(max(8, 4 * cores), memory // RANK_MEMORY_BYTES))


def check_nproc(nproc, device: str = "auto") -> int:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise LaunchError(f"nproc must be an integer >= 1, got {nproc!r}")
    if device in ("auto", "cpu") and nproc > max_cpu_ranks():
        raise LaunchError(f"{nproc} ranks is more than this machine can run on CPU ({max_cpu_ranks()} at most "
                          f"for {os.cpu_count()} cores); use a smaller --nproc")
    if device == "cuda":
        import torch
        have = torch.cuda.device_count()
        if nproc > have:
            raise LaunchError(f"asked for {nproc} ranks on GPUs but this machine has {have} GPU(s); "
                              f"use --nproc {max(have, 1)} or --device cpu")
    elif device not in ("auto", "cpu"):
        raise LaunchError(f"device must be auto, cpu or cuda, got {device!r}")
    return nproc


# ---------------------------------------------------------------- process trees

def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process below `pid`. torchrun puts ranks in sessions of their own, so killpg is not enough."""
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    """Whether process `pid` runs: a zombie (exited, not yet reaped by its parent) does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_pids(pids: list[int], grace_s: float = 3.0, reap=lambda: None) -> None:
    """SIGTERM every pid, SIGKILL what is left after `grace_s`, and wait (up to KILLED_S) until they are
    gone: a process holding torch takes a while to end even after SIGKILL on a loaded machine, and a caller
    that returns must leave none running. `reap` collects our own exited children while we wait (else they
    stay zombies and look alive)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, KILLED_S)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            reap()
            if not any(alive(p) for p in pids):
                break
            time.sleep(0.05)


def kill_tree(proc: subprocess.Popen, grace_s: float = 3.0) -> None:
    """SIGTERM the process and all its descendants, SIGKILL what is left after `grace_s`."""
    kill_pids([proc.pid] + descendants(proc.pid), grace_s, reap=proc.poll)
    proc.wait()


# ---------------------------------------------------------------- the result

@dataclass
class RunResult:
    """What a launch left behind: exit codes, logs, duration, and each rank's `report()`s."""

    run_dir: Path
    nproc: int
    returncode: int
    duration_s: float
    exit_codes: dict[int, int | None] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and all(c == 0 for c in self.exit_codes.values())

    def log_path(self, rank: int) -> Path:
        return self.run_dir / f"rank{rank}.log"

    def log(self, rank: int = 0) -> str:
        return self.log_path(rank).read_text(errors="replace")

    @property
    def reports(self) -> dict[int, list[dict]]:
        out = {}
        for rank in range(self.nproc):
            path = self.run_dir / f"report-rank{rank}.jsonl"
            if path.exists():
                out[rank] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return out

    def report(self, rank: int = 0) -> dict:
        """All values rank `rank` reported, later reports overriding earlier keys."""
        merged: dict = {}
        for r in self.reports.get(rank, []):
            merged.update(r)
        return merged

    def __repr__(self):
        status = "ok" if self.ok else f"failed (exit codes {self.exit_codes})"
        return f"RunResult({status}, {self.nproc} rank(s), {self.duration_s:.1f} s, {display_path(self.run_dir)})"


# ---------------------------------------------------------------- the launcher

def forget_earlier_launch(run_dir: Path) -> None:
    """Remove what an earlier launch's ranks left in `run_dir` for their launcher (RANK_RECORDS): a
    notebook cell run again with the same run_dir must get this launch's reports, not the last one's
    merged in, nor its exit marks or a pid that may be another process's by now. The logs and the
    metrics are appended to, a history a person reads (and a resumed run continues)."""
    for pattern in RANK_RECORDS:
        for path in run_dir.glob(pattern):
            path.unlink()


def launch(script=None, *args, module=None, nproc: int = 2, timeout: float | None = None,
           run_dir=None, ranks: str = "all", device: str = "auto", name: str | None = None,
           env: dict | None = None, check: bool = True, check_collectives: bool = False,
           out=None, accelerate_config=None, startup_timeout: float = STARTUP_TIMEOUT_S) -> RunResult:
    """Run `script` (or `module=`, or "-m", MODULE) on `nproc` ranks under torchrun and wait for it.

    Output of the ranks in `ranks` ("all" or e.g. "0") is written to `out` (default
    sys.stdout) line by line as it arrives, prefixed with the rank. `check_collectives=True`
    makes torch compare every collective's op, shapes and dtypes across ranks first
    (TORCH_DISTRIBUTED_DEBUG=DETAIL), turning a silent mismatch into a named error. With `check=True` a
    failing rank raises RankFailed naming it, a run past `timeout` seconds raises
    LaunchTimeout naming the ranks still running and where; either way no process is left.

    `timeout` counts from the moment every rank is up, that is through `labsupport.init()` (torch
    imported, the process group formed): on a loaded machine starting the ranks can take longer
    than the work a limit is meant for. The ranks get `startup_timeout` seconds to come up; past
    that (or for a script that never calls `labsupport.init()`) the timeout counts anyway.

    `accelerate_config=FILE` starts the ranks with `accelerate launch --config_file FILE` instead of
    torchrun (Accelerate runs torchrun's agent in its own process, with FILE's plugin settings in
    the ranks' environment), under the same supervision; `nproc` overrides FILE's num_processes.
    """
    if script == "-m":  # launch("-m", "pkg.mod", "--flag", ...) reads like the command line
        if not args:
            raise LaunchError("-m needs a module name")
        script, module, args = None, args[0], args[1:]
    target = check_target(script, module)
    nproc = check_nproc(nproc, device)
    if ranks != "all" and not re.fullmatch(r"\d+(,\d+)*", str(ranks)):
        raise LaunchError(f"ranks must be 'all' or a comma-separated list like '0', got {ranks!r}")
    if timeout is not None and timeout <= 0:
        raise LaunchError(f"timeout must be > 0 seconds, got {timeout}")
    if startup_timeout < 0:
        raise LaunchError(f"startup_timeout must be >= 0 seconds, got {startup_timeout}")
    try:
        run_dir = make_run_dir(run_dir, name or Path(script or module).stem)
    except RunDirError as e:
        raise LaunchError(str(e)) from None
    forget_earlier_launch(run_dir)
    out = out or sys.stdout
    shown = None if ranks == "all" else {int(r) for r in str(ranks).split(",")}

    from .rank import die_with_parent  # imported here: `python -m labsupport.rank` must find it unloaded
    from . import forkserver
    from .runtime import forks, threads_per_rank
    port = free_port()
    if accelerate_config is None:
        agent = ["--nnodes=1", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={port}",
                 "--max-restarts=0", "--monitor-interval=0.1", "-m"]
    else:
        if not Path(accelerate_config).is_file():
            raise LaunchError(f"accelerate config not found: {accelerate_config}")
        agent = ["accelerate", "--config_file", str(accelerate_config), "--num_processes", str(nproc),
                 "--num_machines", "1", "--main_process_port", str(port), "--max_restarts", "0",
                 "--monitor_interval", "0.1", "--module"]
    cmd = [sys.executable, "-m", "labsupport.agent", *agent, "labsupport.rank", *target, *map(str, args)]
    child_env = {**os.environ, **(env or {}),
                 "LABSUPPORT_RUN_DIR": str(run_dir), "PYTHONUNBUFFERED": "1", UP_ENV: "1",
                 "OMP_NUM_THREADS": str(threads_per_rank(nproc)),
                 "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
    if device == "cpu":
        child_env["LABSUPPORT_DEVICE"] = "cpu"
    if check_collectives:
        child_env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    (run_dir / "command.txt").write_text(shlex.join(cmd) + "\n")

    start = time.monotonic()
    clock = _Clock(run_dir, nproc, timeout, startup_timeout, start)
    if forks():  # torchrun's agent forked by this process's fork server: no ~4 s import per launch
        try:
            proc = forkserver.start_agent(cmd[3:], child_env)
        except forkserver.ForkServerError as e:
            raise LaunchError(f"torchrun's agent did not start: {e}") from e
    else:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=child_env,
                                start_new_session=True, preexec_fn=die_with_parent)
    try:
        (run_dir / "agent-pid").write_text(f"{proc.pid}\n")
        with open(run_dir / "torchrun.log", "w") as agent_log:
            _pump(proc, clock, shown, out, agent_log)
    except _Timeout:
        waiting = _where_ranks_wait(run_dir, nproc)
        kill_tree(proc)
        logs = f"logs in {display_path(run_dir)}"
        if len(waiting) > 2:  # a line each: a list of more on one line would run far past any output area
            raise LaunchTimeout("\n".join([f"{clock.describe()}; still running:", *(f"  {w}" for w in waiting),
                                           logs])) from None
        raise LaunchTimeout(f"{clock.describe()}; still running: {', '.join(waiting) or 'no rank reported'}; "
                            f"{logs}") from None
    except BaseException:  # KeyboardInterrupt from the notebook's stop button or Ctrl-C
        kill_tree(proc)
        raise
    finally:
        if proc.poll() is None:
            kill_tree(proc)

    result = RunResult(run_dir, nproc, proc.returncode, time.monotonic() - start, _exit_codes(run_dir, nproc))
    if check and not result.ok:
        raise RankFailed(failure_message(result))
    return result


class _Timeout(Exception):
    pass


class _Clock:
    """A launch's deadline: `timeout` seconds after every rank is up (each has left `up-rank{k}`, which
    labsupport.init() writes once its process group is formed), or, for ranks that are not all up
    within `startup` seconds, `timeout` seconds after that."""

    def __init__(self, run_dir: Path, nproc: int, timeout: float | None, startup: float, start: float):
        self.run_dir, self.nproc, self.timeout, self.startup, self.start = run_dir, nproc, timeout, startup, start
        self.up_at: float | None = None

    def up(self) -> list[int]:
        return [r for r in range(self.nproc) if (self.run_dir / f"up-rank{r}").exists()]

    def expired(self, now: float) -> bool:
        if self.timeout is None:
            return False
        if self.up_at is None and now - self.start <= self.startup and len(self.up()) == self.nproc:
            self.up_at = now   # ranks up only after `startup`: the deadline stays
        began = self.up_at if self.up_at is not None else self.start + self.startup
        return now - began > self.timeout

    def describe(self) -> str:
        """What ran out, for the LaunchTimeout's message."""
        if self.up_at is not None:
            return f"timed out after {self.timeout:g} s"
        late = sorted(set(range(self.nproc)) - set(self.up()))
        why = (f"rank(s) {', '.join(map(str, late))} never through labsupport.init()" if late else
               f"the ranks took longer than {self.startup:g} s to start")
        return (f"timed out after {self.startup + self.timeout:g} s ({self.startup:g} s to start, "
                f"then {self.timeout:g} s; {why})")


def _pump(proc, clock, shown, out, agent_log):
    """Copy the ranks' lines to `out` until torchrun exits; raise _Timeout once `clock` has expired."""
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buf = b""
    fd = proc.stdout.fileno()
    while True:
        if clock.expired(time.monotonic()):
            raise _Timeout()
        if not sel.select(timeout=0.1):
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *lines, buf = re.split(rb"\r?\n|\r", buf)
        for raw in lines:
            _route(raw.decode(errors="replace"), shown, out, agent_log)
    if buf:
        _route(buf.decode(errors="replace"), shown, out, agent_log)
    proc.wait()


def _route(line, shown, out, agent_log):
    m = _RANK_LINE.match(line)
    if m is None:  # torchrun's own chatter: kept in torchrun.log, not shown
        agent_log.write(line + "\n")
    elif shown is None or int(m.group(1)) in shown:
        out.write(line + "\n")
        out.flush()


def _exit_codes(run_dir: Path, nproc: int) -> dict[int, int | None]:
    """Each rank's exit code as its wrapper recorded it; None for a rank that was killed."""
    codes = {}
    for rank in range(nproc):
        path = run_dir / f"exit-rank{rank}"
        codes[rank] = int(path.read_text()) if path.exists() else None
    return codes


def failure_message(result: RunResult) -> str:
    """Name the rank that failed first with the tail of its traceback.

    When one rank dies, its peers fail too, with "connection reset/closed by peer" from the
    backend; those are consequences, so they rank after any other error, then by time.
    """
    errors = [json.loads(p.read_text()) for p in result.run_dir.glob("error-rank*.json")]
    errors.sort(key=lambda e: (bool(_PEER_LOST.search(e["error"])), e["time"]))
    crashed = crashed_ranks(result.run_dir, result.nproc)
    if crashed and (not errors or _PEER_LOST.search(errors[0]["error"])):
        return "; ".join(crashed) + f" (logs in {display_path(result.run_dir)})"
    if errors:
        err = errors[0]
        tail = "\n".join(err["traceback"].rstrip().splitlines()[-8:])
        return f"rank {err['rank']} failed: {err['error']}\n{tail}\n(logs in {display_path(result.run_dir)})"
    dead = [r for r, c in result.exit_codes.items() if c is None]
    bad = {r: c for r, c in result.exit_codes.items() if c}
    if bad:  # the cause; ranks still starting or running then were stopped by torchrun and left no code
        stopped = f"; torchrun then stopped rank(s) {dead}" if dead else ""
        return f"rank(s) exited non-zero {bad}{stopped}; logs in {display_path(result.run_dir)}"
    if dead:
        return (f"rank(s) {dead} left no exit code (killed, out of memory, crashed, or never started); "
                f"torchrun exited {result.returncode}; see {display_path(result.run_dir)}/torchrun.log")
    return f"torchrun exited {result.returncode}; see {display_path(result.run_dir)}/torchrun.log"


def crashed_ranks(run_dir: Path, nproc: int) -> list[str]:
    """Ranks that died in C++ (abort, segfault): faulthandler wrote 'Fatal Python error' and the stack.

    A crash inside Python code comes first, then by time: a crash with no Python frame at all
    happened in a backend thread, typically because a peer died first (gloo aborts a rank whose
    connection was reset)."""
    crashes = []
    for rank in range(nproc):
        stack = run_dir / f"stack-rank{rank}.txt"
        dump = stack.read_text(errors="replace") if stack.exists() else ""
        if "Fatal Python error" in dump:
            what = dump.split("Fatal Python error:", 1)[1].splitlines()[0].strip()
            where = innermost_frame(dump)
            crashes.append((not where, stack.stat().st_mtime,
                            f"rank {rank} crashed ({what}) in {where or 'a backend thread, no Python frame'}"))
    return [line for *_, line in sorted(crashes)]


def _where_ranks_wait(run_dir: Path, nproc: int) -> list[str]:
    """Ask every rank still running to dump its stack (SIGUSR1), and say what each is waiting in: one
    "rank k (in ...)" per rank still running."""
    running = []
    for rank in range(nproc):
        pid_file = run_dir / f"pid-rank{rank}"
        if pid_file.exists() and not (run_dir / f"exit-rank{rank}").exists():
            pid = int(pid_file.read_text())
            running.append(rank)
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(0.5)
    parts = []
    for rank in running:
        stack = run_dir / f"stack-rank{rank}.txt"
        where = innermost_frame(stack.read_text(errors="replace")) if stack.exists() else ""
        parts.append(f"rank {rank}" + (f" (in {where})" if where else ""))
    return parts


def innermost_frame(dump: str) -> str:
    """From a faulthandler dump, the innermost labsupport.comm call if any, else the innermost frame."""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', dump)
    if not frames:
        return ""
    if any(func == "_destroy_world" for _, _, func in frames):  # runtime's exit barrier
        return "the exit barrier: its script is done, it waits for the others"
    in_comm = [func for path, _, func in frames if path.endswith(os.path.join("labsupport", "comm.py"))]
    if in_comm:  # faulthandler lists innermost first: the outermost comm frame is the public call
        return f"comm.{in_comm[-1]}"
    # otherwise: the innermost call into torch.distributed, seen from the first frame outside torch
    for i, (path, line, func) in enumerate(frames):
        if f"{os.sep}torch{os.sep}" not in path:
            inner = frames[i - 1][2] if i else func
            return f"{inner} called at {Path(path).name}:{line}"
    return f"{frames[0][2]} at {Path(frames[0][0]).name}:{frames[0][1]}"


# ---------------------------------------------------------------- the %%torchrun cell magic

def _magic_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="%%torchrun", add_help=False)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=DEFAULT_NOTEBOOK_TIMEOUT)
    p.add_argument("--ranks", default="all")
    p.add_argument("--device", default="auto")
    p.add_argument("--name", default="cell")
    p.add_argument("--out", default="last_run", help="variable that receives the RunResult")
    p.add_argument("--check-collectives", action="store_true", help="compare shapes/dtypes of every collective")
    return p


def torchrun_magic(line: str, cell: str, user_ns: dict | None = None) -> None:
    """`%%torchrun --nproc 4`: run the cell's code on 4 ranks; the RunResult lands in `last_run`."""
    try:
        opts = _magic_parser().parse_args(shlex.split(line))
    except SystemExit:
        raise LaunchError(f"bad %%torchrun options {line!r}; usage: {_magic_parser().format_usage().strip()}") from None
    try:
        run_dir = make_run_dir(None, opts.name)
    except RunDirError as e:
        raise LaunchError(str(e)) from None
    script = run_dir / "cell.py"
    script.write_text(cell)
    result = launch(str(script), nproc=opts.nproc, timeout=opts.timeout, run_dir=run_dir,
                    ranks=opts.ranks, device=opts.device, name=opts.name, check_collectives=opts.check_collectives)
    if user_ns is not None:
        user_ns[opts.out] = result

