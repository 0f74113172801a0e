"""Interactive ranks: a pool of N real ranks that keep their state between notebook cells.

A `%%torchrun` cell starts fresh processes, and nothing they computed survives the cell. The
pool keeps N ranks running instead: ipyparallel engines on 127.0.0.1, one per rank, each set up
exactly as `labsupport.init()` sets up a torchrun rank (identity, device and backend, threads,
seed, process group on a port rank 0 holds from the moment it is chosen), with `rt` in its namespace:

    %load_ext labsupport
    %ranks start --nproc 2              # from Python: from labsupport.pool import ranks; ranks.start(2)

    %%ranks                             # runs on every rank; --ranks 0,1 for some, --timeout S
    t = torch.tensor([rt.rank + 1.0])
    comm.all_reduce(t)
    t                                   # -> {0: tensor([3.]), 1: tensor([3.])}

    ranks.pull("t"), ranks.push(lr=0.1), ranks.report(0), %ranks status | restart | stop

Each rank's output appears as it is printed, prefixed `[rank k] `. Failures behave as in a
launch. A rank that raises shows its traceback under its name; the pool stays usable. A cell that
runs past its timeout, is interrupted, or loses a rank cannot be stopped inside a collective, so
the pool names the ranks still running and where they wait, then restarts every rank with a
fresh process group and says that their state was lost.

No process outlives the pool: `stop()` ends them all, and so does the kernel's exit. If the
kernel is killed, Linux kills the controller and the engines with it (see `_serve`).

Memory. A pool of 2 ranks holds about twice as much memory as its kernel (each rank imports
torch; README, "Workshops"), and every open notebook has its own. So a pool stops itself after
IDLE_MINUTES without a cell (LABSUPPORT_POOL_IDLE_MINUTES; 0 never; labsupport.idle), and the
next `%%ranks` cell or exercise check starts it again, saying so: what earlier cells left on the
ranks is gone then. And a notebook that starts a pool while another notebook of the same Jupyter
server holds one says which, how much memory it holds, and that `%ranks stop --others` stops it
(`RankPool.stop_others`; labsupport.pool_registry); that notebook starts its ranks again when it
needs them, and says why. Pools never serve two notebooks: each notebook's ranks keep their own state.
"""
from __future__ import annotations

import argparse
import ast
import atexit
import faulthandler
import importlib
import logging
import os
import re
import runpy
import shlex
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from . import pool_registry
from .idle import IdleTimer
from .launch import (DEFAULT_NOTEBOOK_TIMEOUT, LaunchError, LaunchTimeout, RankFailed, RunResult, alive,
                     check_nproc, crashed_ranks, descendants, display_path, innermost_frame, kill_pids,
                     make_run_dir)
from .rank import die_with_parent

START_TIMEOUT_S = 180  # for the engines to register and the process group to form (a start takes ~5 s of CPU,
                       # which on 2 cores shared with other launches has taken over 100 s)
LEAVE_TIMEOUT_S = 10   # for the ranks to leave the process group on stop()
PEER_GRACE_S = 5       # after a rank raised, how long the others may still run (see _gather)
POLL_S = 0.01          # how often output is copied and the ranks are checked while a cell runs
IDLE_MINUTES = 20.0    # a pool with no cell for this long stops itself (LABSUPPORT_POOL_IDLE_MINUTES; 0: never)
IDLE_ENV = "LABSUPPORT_POOL_IDLE_MINUTES"
# Ending a pool's processes: SIGTERM, then SIGKILL after this long. An engine's own SIGTERM handler
# takes seconds and there is nothing to save (stop() left the process group before), but a
# kernel's shutdown waits for it: JupyterLab kills a kernel that takes over 5 s.
END_GRACE_S = 0.3

# What the controller and the engines run: `python -c _SERVE MODULE ARGS...` (see _serve).
_SERVE = "import labsupport.pool; labsupport.pool._serve()"
# Set for the engine's command where ranks may be forked (runtime.forks): that one process forks this
# many engines, one per rank (see _fork_engines).
FORKS_ENV = "LABSUPPORT_POOL_ENGINES"


class PoolError(LaunchError):
    """A request the pool refuses (bad input, no pool, a second pool): one line, nothing started."""


class RankPool:
    """N ranks, alive between cells. `ranks` below is the notebook's pool; the magics use it."""

    def __init__(self):
        self._cluster = None
        self._client = None
        self._engines: dict[int, int] = {}  # rank -> ipyparallel engine id (not always equal)
        self._pids: dict[int, int] = {}     # rank -> engine process id
        self._cells = 0
        self._exit_hook = False
        self._lock = threading.RLock()      # one thing at a time on the ranks: a cell, a start, or the idle stop
        self._idle: IdleTimer | None = None  # ends these processes after idle_minutes without a cell
        self._entry: dict | None = None     # this pool's registry entry, while it runs
        self._stopped: dict | None = None   # stopped by itself or from another notebook: {"settings", "why"}
        self.nproc = 0
        self.port = 0
        self.idle_minutes = IDLE_MINUTES
        self.timeout, self.seed, self.device, self.device_backend = DEFAULT_NOTEBOOK_TIMEOUT, 0, "auto", ""
        self.run_dir: Path | None = None

    @property
    def running(self) -> bool:
        return self._cluster is not None

    # ------------------------------------------------------------ life cycle

    def start(self, nproc: int = 2, timeout: float = DEFAULT_NOTEBOOK_TIMEOUT, seed: int = 0,
              device: str = "auto", idle_minutes: float | None = None) -> RankPool:
        """Start `nproc` ranks; `timeout` is every cell's default limit and the process group's.

        After `idle_minutes` without a cell the ranks stop themselves (None: LABSUPPORT_POOL_IDLE_MINUTES,
        else IDLE_MINUTES; 0: never); the next cell starts them again. If other notebooks hold ranks,
        one line says so (see `stop_others`).
        """
        with self._lock:
            self._stopped = None
            self._start(nproc, timeout, seed, device, idle_minutes)
        self._tell_about_others()
        return self

    def _start(self, nproc: int, timeout: float, seed: int, device: str, idle_minutes: float | None) -> None:
        if self.running:
            raise PoolError(f"a pool of {self.nproc} ranks is already running; stop it first with "
                            "`%ranks stop`, or get fresh ranks with `%ranks restart`")
        nproc = check_nproc(nproc, device)
        if not timeout or timeout <= 0:
            raise PoolError(f"timeout must be > 0 seconds, got {timeout}")
        idle_minutes = _idle_minutes(idle_minutes)
        self.nproc, self.timeout, self.seed, self.device = nproc, timeout, seed, device
        self.idle_minutes = idle_minutes
        self.run_dir = make_run_dir(name="pool")
        began = time.monotonic()
        try:
            self._launch()
            self._become_ranks()
        except BaseException as e:  # nothing may stay half-started, whatever went wrong
            self._end_processes()
            if isinstance(e, _Lost) and e.error is KeyboardInterrupt:
                raise KeyboardInterrupt from None
            if isinstance(e, (_Lost, TimeoutError)):
                raise PoolError(f"the ranks did not start: {e}; logs in {display_path(self.run_dir)}") from None
            raise
        self.start_s = time.monotonic() - began
        if not self._exit_hook:  # before ipyparallel's own hook (atexit runs last-registered first)
            atexit.register(self._end_processes)
            self._exit_hook = True
        self._entry = pool_registry.register(self.nproc, self.port, self.run_dir, _processes(self._cluster),
                                             self.idle_minutes)
        if self.idle_minutes:
            self._idle = IdleTimer(self.idle_minutes * 60, self._lock, self._stop_idle)

    def _launch(self) -> None:
        """The ipyparallel controller and one engine per rank, all on 127.0.0.1, files in the run dir."""
        import ipyparallel as ipp
        from traitlets.config import Config

        from .runtime import forks, threads_per_rank
        env = {"LABSUPPORT_RUN_DIR": str(self.run_dir), "LABSUPPORT_POOL_OWNER": str(os.getpid()),
               "OMP_NUM_THREADS": str(threads_per_rank(self.nproc)),
               "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")}
        if self.device == "cpu":
            env["LABSUPPORT_DEVICE"] = "cpu"
        config = Config()
        config.LocalControllerLauncher.controller_cmd = [sys.executable, "-c", _SERVE, "ipyparallel.controller"]
        config.LocalControllerLauncher.environment = env
        config.LocalEngineSetLauncher.engine_cmd = [sys.executable, "-c", _SERVE, "ipyparallel.engine"]
        config.LocalEngineSetLauncher.engine_args = ["--IPEngine.enable_nanny=False"]  # one process per rank
        # where it is safe, one engine process that forks every rank's engine (_fork_engines)
        engine_processes = 1 if forks() else self.nproc
        config.LocalEngineSetLauncher.environment = {**env, FORKS_ENV: str(self.nproc)} if forks() else env
        log = logging.getLogger(f"labsupport.pool.{id(self)}")  # ipyparallel's messages: to a file, not the cell
        for handler in log.handlers:
            handler.close()
        log.handlers, log.propagate = [logging.FileHandler(self.run_dir / "ipyparallel.log")], False
        self._cluster = ipp.Cluster(
            n=engine_processes, controller_ip="127.0.0.1", profile_dir=str(self.run_dir / "ipyparallel"),
            # schedulers as threads: one controller process; a 0.5 s heartbeat registers engines in
            # about 1 s instead of 6 (the default is 3 s, and registration waits for a beat)
            controller_args=["--usethreads", "--HeartMonitor.period=500"],
            delay=0, engine_timeout=START_TIMEOUT_S, load_profile=False, log=log, parent=None, config=config)
        self._cluster.start_cluster_sync()
        self._client = self._cluster.connect_client_sync()
        self._client.wait_for_engines(self.nproc, timeout=START_TIMEOUT_S, interactive=False)

    def _become_ranks(self) -> None:
        """Give the engines ranks 0..N-1 (kept as a map: ranks are ours, engine ids ipyparallel's)."""
        ids = sorted(self._client.ids)
        pids = self._client[ids].apply_async(os.getpid).get(START_TIMEOUT_S)
        self._engines, self._pids = dict(enumerate(ids)), dict(enumerate(pids))
        # rank 0 binds the store's port and keeps it, then tells it: a port picked here and bound there
        # later could be taken between the two, as happened under load
        port = self.port = self._gather_values({0: (_listen,)})[0]
        self.device_backend = self._gather_values({r: (_become_rank, r, self.nproc, port, self.seed, self.timeout)
                                                   for r in range(self.nproc)})[0]

    def _gather_values(self, jobs: dict) -> dict:
        """`_gather` within the start's time, each rank's value, or _Lost naming the ranks that raised."""
        done = self._gather(jobs, START_TIMEOUT_S)
        errors = {r: res["error"] for r, res in done.items() if "error" in res}
        if errors:
            _print_tracebacks(done)
            raise _Lost(RankFailed, _failure_line(errors), [])
        return {r: res["value"] for r, res in done.items()}

    def stop(self) -> None:
        """Leave the process group cleanly (as `with init()` does at its end), then end every process."""
        with self._lock:
            self._stopped = None  # stopped on purpose: a later cell says there is no pool
            if not self.running:
                return
            try:
                self._gather({r: (_leave_rank,) for r in self._alive_ranks()}, LEAVE_TIMEOUT_S)
            except _Lost:
                pass  # a broken group cannot be left cleanly; the processes end all the same
            finally:
                self._end_processes()

    def restart(self) -> RankPool:
        """Fresh ranks and a fresh process group, with the same settings; all rank state is lost."""
        with self._lock:
            self._notice_stop_from_elsewhere()
            if not self.running and self._stopped is None:
                raise PoolError(_NO_POOL)
            settings = self._settings()
            self.stop()
            self._start(**settings)
        return self

    def _settings(self) -> dict:
        return dict(nproc=self.nproc, timeout=self.timeout, seed=self.seed, device=self.device,
                    idle_minutes=self.idle_minutes)

    @property
    def stopped(self) -> str | None:
        """Why the ranks are not running although nobody stopped them here ("stopped themselves after 20 min
        without a cell", "were stopped from 03_zero_fsdp.ipynb"): the next cell starts them again. Else None."""
        with self._lock:
            self._notice_stop_from_elsewhere()
            return self._stopped["why"] if self._stopped else None

    def serves(self, nproc: int) -> bool:
        """Whether a cell for `nproc` ranks runs on this pool: it runs with `nproc` ranks, or it stopped by
        itself (or from another notebook) with that many and starts again at the next cell."""
        return self.nproc == nproc and (self.stopped is not None or self.running)

    def status(self) -> dict[int, str]:
        """{rank: "idle" or "dead"}. Cells run one at a time, so a live rank is idle between them."""
        return {r: "idle" if alive(pid) else "dead" for r, pid in self._pids.items()}

    @property
    def pids(self) -> dict[int, int]:
        """{rank: process id}, to find a rank with ps or kill it by hand."""
        return dict(self._pids)

    def _alive_ranks(self) -> list[int]:
        return [r for r, pid in self._pids.items() if alive(pid)]

    def _end_processes(self) -> None:
        """Kill the controller, the engines and anything they started; forget them."""
        cluster, client = self._cluster, self._client
        self._cluster = self._client = None
        self._engines, self._pids = {}, {}
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._entry is not None:
            self._entry = None
            pool_registry.unregister()
        if client is not None:
            client.close(linger=0)
        if cluster is None:
            return
        pids = _processes(cluster)
        kill_pids([p for pid in pids for p in (pid, *descendants(pid))], grace_s=END_GRACE_S)
        cluster.stop_cluster_sync()  # ipyparallel's bookkeeping (files, its exit hook); they are gone

    # ------------------------------------------------------------ memory: stopped when idle or from elsewhere

    def _stop_idle(self) -> None:
        """What the idle timer calls (holding the lock, so never during a cell). It says nothing: in a
        kernel its output would land in whatever cell runs; the next cell says it (_ensure_running)."""
        why = f"stopped themselves after {self.idle_minutes:g} min without a cell"
        self._stopped = {"settings": self._settings(), "why": why}
        self._end_processes()

    def _notice_stop_from_elsewhere(self) -> None:
        """If another notebook stopped these ranks (`stop_others` leaves a note beside our registry file),
        forget them."""
        if not self.running:
            return
        by = pool_registry.read_stop_note()
        if by is not None:
            self._stopped = {"settings": self._settings(), "why": f"were stopped from {by}"}
            self._end_processes()  # whatever is left of them, and ipyparallel's bookkeeping

    def _ensure_running(self) -> None:
        """Before a cell: the ranks run, or, stopped by themselves or from another notebook, start again, saying so."""
        self._notice_stop_from_elsewhere()
        if self.running:
            return
        if self._stopped is None:
            raise PoolError(_NO_POOL)
        stopped = self._stopped
        _say(f"The {self.nproc} interactive ranks {stopped['why']}, to free their memory. Starting them "
             f"again: what earlier %%ranks cells left on them is gone.")
        self._start(**stopped["settings"])
        self._stopped = None
        self._tell_about_others()

    def _used(self) -> None:
        """After a cell: the idle limit counts from now, and the registry says when the pool was last used."""
        if self._idle is not None:
            self._idle.touch()
        if self._entry is not None:
            pool_registry.touch(self._entry)

    def _tell_about_others(self) -> None:
        others = pool_registry.other_pools()
        if others:
            _say(pool_registry.others_line(others))

    def stop_others(self) -> list[dict]:
        """Stop the ranks that the user's other notebooks hold (`pool_registry.other_pools`), to free their memory.

        Their kernels go on; each notebook starts its ranks again at its next `%%ranks` cell or
        check, and says why. Returns what was stopped (registry entries, with "memory" in bytes).
        """
        stopped = pool_registry.other_pools()
        for entry in stopped:
            pool_registry.leave_stop_note(entry["owner"])  # first: a cell running there now hears who stopped it
            kill_pids(pool_registry.live_processes(entry), grace_s=END_GRACE_S)
        return stopped

    # ------------------------------------------------------------ running code on the ranks

    def run(self, code: str, ranks=None, timeout: float | None = None) -> dict:
        """Run `code` on the ranks (all, or e.g. [0, 2] / "0,2"); return {rank: value of its last expression}.

        The ranks' output is printed as it arrives, each line prefixed `[rank k] `. Variables stay
        on the ranks for later cells. `timeout` defaults to the pool's.
        """
        targets = self._pick(ranks)
        ast.parse(code)  # a syntax error is the notebook's, before any rank sees it
        with self._lock:
            self._ensure_running()
            try:
                self._cells += 1
                cell = self.run_dir / f"cell{self._cells}.py"  # tracebacks and stack dumps quote its lines
                cell.write_text(code)
                return self._values(self._on_ranks({r: (_run_cell, code, str(cell)) for r in targets}, timeout))
            finally:
                self._used()

    def pull(self, name: str, ranks=None, timeout: float | None = None) -> dict:
        """{rank: the value of `name` on that rank}."""
        targets = self._pick(ranks)
        with self._lock:
            self._ensure_running()
            try:
                return self._values(self._on_ranks({r: (_get, name) for r in targets}, timeout))
            finally:
                self._used()

    def push(self, values: dict | None = None, ranks=None, timeout: float | None = None, **more) -> None:
        """Set variables on the ranks: `push(lr=0.1)` or `push({"lr": 0.1}, ranks=[0])`."""
        values, targets = {**(values or {}), **more}, self._pick(ranks)
        with self._lock:
            self._ensure_running()
            try:
                self._values(self._on_ranks({r: (_set, values) for r in targets}, timeout))
            finally:
                self._used()

    def report(self, rank: int = 0) -> dict:
        """What rank `rank` passed to `report()` since the pool started, later keys overriding earlier ones."""
        if not self.running and self._stopped is None:
            raise PoolError(_NO_POOL)
        return RunResult(self.run_dir, self.nproc, 0, 0.0).report(self._pick(rank)[0])

    def _pick(self, ranks) -> list[int]:
        """Ranks as a sorted list, from None/"all", an int, a list, or a string like "0,2"."""
        if ranks is None or ranks == "all":
            return list(range(self.nproc))
        if isinstance(ranks, str):
            if not re.fullmatch(r"\d+(,\d+)*", ranks):
                raise PoolError(f"ranks must be 'all' or a comma-separated list like '0,2', got {ranks!r}")
            ranks = [int(r) for r in ranks.split(",")]
        elif isinstance(ranks, int):
            ranks = [ranks]
        missing = sorted(set(ranks) - set(range(self.nproc)))
        if missing:
            raise PoolError(f"there is no rank {missing[0]}: the pool's ranks are 0 to {self.nproc - 1}")
        return sorted(set(ranks))

    def _values(self, results: dict) -> dict:
        """{rank: value}, or, if some rank raised, its traceback printed and RankFailed naming it."""
        results = dict(sorted(results.items()))  # in rank order, whichever rank finished first
        errors = {r: res["error"] for r, res in results.items() if "error" in res}
        if errors:
            _print_tracebacks(results)
            raise RankFailed(_failure_line(errors) + ("; the traceback is above" if any(
                results[r]["traceback"] for r in errors) else ""))
        return {r: res["value"] for r, res in results.items()}

    def _on_ranks(self, jobs: dict, timeout: float | None) -> dict:
        """_gather, and when the ranks are lost: say where they were, restart them, and raise."""
        if timeout is not None and timeout <= 0:
            raise PoolError(f"timeout must be > 0 seconds, got {timeout:g}")
        dead = [r for r in range(self.nproc) if r not in self._alive_ranks()]
        try:
            if dead:  # between cells: killed, out of memory...
                raise _Lost(RankFailed, f"{_ranks_word(dead)} died since the last cell", [])
            return self._gather(jobs, self.timeout if timeout is None else timeout)
        except _Lost as lost:
            by = pool_registry.read_stop_note()
            if by is not None:  # another notebook stopped them while this cell ran
                lost.reason = f"the ranks were stopped from {by}"
            print(lost.then(f"restarting all {self.nproc} ranks..."), file=sys.stderr, flush=True)
            settings = self._settings()
            self._end_processes()  # no clean exit: a rank stuck in a collective would never leave
            try:
                self._start(**settings)
            except BaseException as e:
                raise PoolError(lost.then(f"restarting the ranks failed ({e}); "
                                          "start again with `%ranks start --nproc N`")) from None
            message = lost.then(f"restarted all {self.nproc} ranks with a fresh process group: "
                                 "all rank state (variables, tensors, models) was lost")
            if lost.error is KeyboardInterrupt:
                print(message, file=sys.stderr, flush=True)
                raise KeyboardInterrupt from None
            raise lost.error(message) from None

    def _gather(self, jobs: dict, timeout: float) -> dict:
        """Run {rank: (fn, *args)} on the ranks; stream their output; return {rank: {"value"|"error": ...}}.

        Raises _Lost past the timeout, on an interrupt, when a rank dies, and when a rank raised
        and the others are still running PEER_GRACE_S later: as in a launch, where torchrun stops
        the others, they are most likely waiting in a collective for the rank that failed.
        """
        began = time.monotonic()
        calls = {r: self._client[self._engines[r]].apply_async(_on_rank, *job) for r, job in jobs.items()}
        echoes = {r: _Echo(r) for r in calls}
        results, failed_at, running = {}, None, list(calls)
        try:
            while True:
                for r in running:
                    echoes[r].show(calls[r])
                    if calls[r].ready():
                        results[r] = _result(calls[r])
                running = [r for r in calls if r not in results]
                if not running:
                    break
                dead = [r for r in running if not alive(self._pids[r])]
                if dead:
                    crashed = [line for line in crashed_ranks(self.run_dir, self.nproc)  # "rank K crashed (...)"
                               if int(line.split()[1]) in dead]
                    raise _Lost(RankFailed, "; ".join(crashed) or f"{_ranks_word(dead)} died",
                                [r for r in running if r not in dead])
                errors = {r: res["error"] for r, res in results.items() if "error" in res}
                if errors and failed_at is None:
                    failed_at = time.monotonic()
                if errors and time.monotonic() - failed_at > PEER_GRACE_S:
                    raise _Lost(RankFailed, f"{_failure_line(errors)}, and {PEER_GRACE_S} s later "
                                f"the other ranks had not finished", running)
                if time.monotonic() - began > timeout:
                    raise _Lost(LaunchTimeout, f"timed out after {timeout:g} s", running)
                calls[running[0]].wait(POLL_S)
        except (_Lost, KeyboardInterrupt) as e:  # KeyboardInterrupt: the notebook's stop button, Ctrl-C
            lost = e if isinstance(e, _Lost) else _Lost(KeyboardInterrupt, "interrupted", running)
            where = self._where(lost.running)
            for r, call in calls.items():  # what arrived meanwhile, and who raised before the others were lost
                echoes[r].show(call, final=True)
            _print_tracebacks(results)
            if len(where) > 2:  # a line each, as a launch lists them: on one line they run past the output area
                lost.reason += "; still running:\n" + "\n".join(f"  {w}" for w in where) + "\n"
            elif where:
                lost.reason += f"; still running: {', '.join(where)}; "
            raise lost from None
        for r, call in calls.items():  # output may arrive just after the result
            call.wait_for_output(1.0)
            echoes[r].show(call, final=True)
        return results

    def _where(self, ranks: list[int]) -> list[str]:
        """Ask each rank to dump its stack (SIGUSR1, see _become_rank) and say where it is waiting: one
        "rank k (in ...)" per rank."""
        for r in ranks:
            try:
                os.kill(self._pids[r], signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if ranks:
            time.sleep(0.5)
        parts = []
        for r in ranks:
            stack = self.run_dir / f"stack-rank{r}.txt"
            where = innermost_frame(stack.read_text(errors="replace")) if stack.exists() else ""
            parts.append(f"rank {r}" + (f" (in {where})" if where else ""))
        return parts

    def __repr__(self):
        if not self.running:
            return "RankPool(not running)"
        return f"RankPool({self.nproc} ranks, {self.device_backend}, {display_path(self.run_dir)})"


_NO_POOL = "no ranks are running; start one with `%ranks start --nproc N`"


class _Lost(Exception):
    """The ranks can no longer be trusted and must be restarted; `running` are the ranks still busy.

    `error` is the exception the notebook gets once they are restarted.
    """

    def __init__(self, error: type, reason: str, running: list[int]):
        super().__init__(reason)
        self.error, self.reason, self.running = error, reason, running

    def __str__(self):
        return self.reason

    def then(self, text: str) -> str:
        """The reason, and what follows from it (after "; ", unless the reason ends its own list)."""
        return self.reason + ("" if self.reason.endswith(("\n", "; ")) else "; ") + text


class _Echo:
    """Copy one rank's output of one call to our stdout/stderr as it arrives, prefixed `[rank k] `."""

    def __init__(self, rank: int):
        self.prefix = f"[rank {rank}] "
        self.shown = {"stdout": 0, "stderr": 0}  # characters already copied

    def show(self, call, final: bool = False) -> None:
        for name in ("stdout", "stderr"):
            text = getattr(call, name)  # everything the rank printed in this call so far
            end = len(text) if final else text.rfind("\n") + 1  # whole lines only, until the end
            if end > self.shown[name]:
                chunk = text[self.shown[name]:end]
                stream = getattr(sys, name)
                stream.write("".join(self.prefix + line for line in chunk.splitlines(keepends=True)))
                if not chunk.endswith("\n"):
                    stream.write("\n")
                stream.flush()
                self.shown[name] = end


def _result(call) -> dict:
    """A finished call's {"value": ...} or {"error": ...}, also when sending the value back failed."""
    try:
        return call.get(0)
    except Exception as e:  # _on_rank catches the user's errors: this is a value that cannot be pickled
        error = f"{e.ename}: {e.evalue}" if hasattr(e, "ename") else f"{type(e).__name__}: {e}"
        return {"error": f"{error.splitlines()[0]} (sending the value back)", "traceback": ""}


def _print_tracebacks(results: dict) -> None:
    for r, res in sorted(results.items()):
        if res.get("traceback"):
            sys.stderr.write("".join(f"[rank {r}] {line}" for line in res["traceback"].splitlines(keepends=True)))
    sys.stderr.flush()


def _ranks_word(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _failure_line(errors: dict[int, str]) -> str:
    """"rank 1 failed: ValueError: boom", ranks with the same error together."""
    by_error: dict[str, list[int]] = {}
    for r, error in sorted(errors.items()):
        by_error.setdefault(error, []).append(r)
    return "; ".join(f"{_ranks_word(rs)} failed: {error}" for error, rs in by_error.items())


def _idle_minutes(value: float | None) -> float:
    """The idle limit in minutes: `value`, else LABSUPPORT_POOL_IDLE_MINUTES, else IDLE_MINUTES; 0 means never."""
    where = "idle_minutes"
    if value is None:
        value, where = os.environ.get(IDLE_ENV, "").strip() or IDLE_MINUTES, IDLE_ENV
    try:
        minutes = float(value)
    except (TypeError, ValueError):
        minutes = -1.0
    if not minutes >= 0:  # also NaN
        raise PoolError(f"{where} must be a number of minutes >= 0 (0: never stop when idle), got {value!r}")
    return minutes


def _processes(cluster) -> list[int]:
    """The controller's and the engines' process ids."""
    pids = [launcher.pid for engine_set in cluster.engines.values() for launcher in engine_set.launchers.values()]
    if cluster.controller is not None:
        pids.append(cluster.controller.pid)
    return [pid for pid in pids if pid and pid > 0]


def _say(text: str) -> None:
    """Print a message for the notebook in lines that JupyterLab's output area shows whole (lab.exercise.wrap)."""
    from .lab.exercise import wrap
    print(wrap(text), flush=True)


# ---------------------------------------------------------------- inside the controller and engines

def _serve() -> None:
    """`python -c _SERVE MODULE ARGS...`: run ipyparallel's MODULE, but die with the pool's owner.

    ipyparallel starts its controller and engines in sessions of their own, so they would outlive
    a killed kernel. Linux's parent-death signal kills them with it, and children they fork
    (the controller's heart monitor, a cell's workers) with them in turn. (The signal comes when
    the thread that started them ends: the caller's, or in a kernel a thread of ipyparallel's
    that lives as long as the kernel.)
    """
    die_with_parent(signal.SIGKILL)
    os.register_at_fork(after_in_child=lambda: die_with_parent(signal.SIGKILL))
    if os.getppid() != int(os.environ["LABSUPPORT_POOL_OWNER"]):
        os._exit(1)  # the owner died before we asked to die with it
    engines = os.environ.pop(FORKS_ENV, None)
    if engines:
        _fork_engines(int(engines))  # returns in each engine
    runpy.run_module(sys.argv.pop(1), run_name="__main__", alter_sys=True)


def _fork_engines(n: int) -> None:
    """Fork `n` engines from this process, which then only waits for them; return in each engine.

    Like torchrun's agent where ranks are forked (labsupport.agent), this process imports once what
    every engine and rank imports (ipyparallel's engine, torch and what a rank imports before its
    group forms: ~5 s of CPU per process), so that a pool starts in a fraction of the CPU. Each engine
    dies with this process (_serve's fork hook), and this process with the pool's owner; it exits
    once every engine has ended, and a rank that dies leaves the others running, as before.
    """
    from .runtime import prepare_to_fork
    prepare_to_fork()
    importlib.import_module("ipyparallel.engine.app")
    engines = set()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            return
        engines.add(pid)
    while engines:
        engines.discard(os.wait()[0])
    os._exit(0)


_runtime = None  # on an engine: this rank's Runtime, entered by _become_rank, left by _leave_rank
_listener = None  # on rank 0's engine: the store's socket, from _listen until _become_rank hands it to the store


def _namespace() -> dict:
    """The engine's user namespace: where cells run and where pull/push read and write."""
    from IPython import get_ipython
    return get_ipython().user_ns


def _on_rank(fn, *args) -> dict:
    """On a rank: fn(*args), with an exception turned into its traceback from the cell down."""
    try:
        return {"value": fn(*args)}
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename != __file__]
        tb = ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
              + "".join(traceback.format_exception_only(type(e), e))) if frames else ""
        return {"error": f"{type(e).__name__}: {e}".splitlines()[0], "traceback": tb}


def _listen() -> int:
    """On rank 0's engine: listen on a loopback port the OS picks and keep the socket for the store;
    return the port. It is bound before anyone learns it, so no other process can take it."""
    global _listener
    _listener = socket.create_server(("127.0.0.1", 0))
    return _listener.getsockname()[1]


def _become_rank(rank: int, world_size: int, port: int, seed: int, timeout_s: float) -> str:
    """On an engine: take the identity torchrun would give rank `rank`, then enter `labsupport.init()`.

    faulthandler is set up as in rank.py: SIGUSR1 dumps the stack (where is a hung rank
    waiting?), and a crash in C++ leaves its stack in the same file.
    """
    global _runtime, _listener
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    stack = open(Path(os.environ["LABSUPPORT_RUN_DIR"]) / f"stack-rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=False)
    faulthandler.enable(file=stack, all_threads=False)  # the engine's other threads are ipyparallel's
    from .runtime import init
    listener, _listener = _listener, None  # rank 0's, from _listen: the store takes it over
    _runtime = init(seed=seed, timeout_s=timeout_s, listener=listener).__enter__()
    _namespace()["rt"] = _runtime
    return f"{_runtime.device} + {_runtime.backend}"


def _leave_rank() -> None:
    if _runtime is not None:
        _runtime.__exit__(None, None, None)


def _run_cell(code: str, filename: str):
    """On a rank: run a cell in the rank's namespace; like IPython, return a final expression's value."""
    ns = _namespace()
    tree = ast.parse(code, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), ns)
    return eval(compile(ast.Expression(last.value), filename, "eval"), ns) if last else None


def _get(name: str):
    ns = _namespace()
    if name not in ns:
        raise NameError(f"name {name!r} is not defined")
    return ns[name]


def _set(values: dict) -> None:
    _namespace().update(values)


# ---------------------------------------------------------------- the notebook's pool and its magics

ranks = RankPool()


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one PoolError line, instead of a usage print and SystemExit."""

    def error(self, message):
        usage = " ".join(self.format_usage().split()[1:])
        raise PoolError(f"{self.prog}: {message}; usage: {usage}")


def _line_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%ranks", add_help=False)
    p.add_argument("action", choices=["start", "stop", "restart", "status"])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=DEFAULT_NOTEBOOK_TIMEOUT)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto")
    p.add_argument("--idle-minutes", type=float, default=None)
    p.add_argument("--others", action="store_true")
    return p


def _cell_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="%%ranks", add_help=False)
    p.add_argument("--ranks", default="all")
    p.add_argument("--timeout", type=float, default=None)
    return p


def ranks_magic(line: str, cell: str | None = None, user_ns: dict | None = None):
    """`%ranks start|stop|restart|status` and `%%ranks [--ranks 0,2] [--timeout S]` over `ranks`."""
    if cell is not None:
        opts = _cell_parser().parse_args(shlex.split(line))
        values = ranks.run(cell, ranks=opts.ranks, timeout=opts.timeout)
        return values if any(v is not None for v in values.values()) else None  # else no Out[]
    opts = _line_parser().parse_args(shlex.split(line))
    if opts.others and opts.action != "stop":
        raise PoolError("%ranks: --others goes with stop: `%ranks stop --others`")
    if opts.action == "stop" and opts.others:
        _say(pool_registry.stopped_line(ranks.stop_others()))
    elif opts.action == "stop":
        was = ranks.nproc if ranks.running else 0
        ranks.stop()
        print(f"stopped {was} ranks" if was else "no ranks were running")
    elif opts.action == "status":
        why = ranks.stopped
        if ranks.running:
            print("\n".join(f"rank {r}: {state} (pid {ranks.pids[r]})" for r, state in ranks.status().items()))
        else:
            _say(f"the {ranks.nproc} ranks {why}; the next %%ranks cell or check starts them again" if why else _NO_POOL)
        ranks._tell_about_others()
    else:
        if opts.action == "start":
            ranks.start(opts.nproc, timeout=opts.timeout, seed=opts.seed, device=opts.device,
                        idle_minutes=opts.idle_minutes)
        else:
            ranks.restart()
        if user_ns is not None:
            user_ns["ranks"] = ranks  # so that the next cell can say ranks.pull("t")
        print(f"{ranks.nproc} ranks ready in {ranks.start_s:.1f} s ({ranks.device_backend}); each has `rt`; "
              f"run directory {display_path(ranks.run_dir)}")
