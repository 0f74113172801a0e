"""The rank side of a launch: what torchrun starts once per rank, around the user's code.

`python -m labsupport.rank SCRIPT [ARGS]` (or `-m MODULE [ARGS]`) runs the script as
`__main__`, and around it: every output line gets a `[rank k] ` prefix (so the launcher can
route and filter it) and is teed to `rank{k}.log`; an exception's traceback (from the user's
code down) and the exit code are written to the run directory; faulthandler dumps the stack
on SIGUSR1 (the launcher asks a hung rank where it waits) and on a native crash. The rank
also dies with its parent, so a killed torchrun leaves no orphans.

Where it is safe (labsupport/agent.py says when), torchrun's agent *forks* the ranks from itself,
which imported torch already (torchrun's own `--start-method fork --run-path rank.py`). A forked rank
starts from the agent's state, so it first takes back what a fresh process has (the default signal
handlers, none of the agent's exit handlers) and ends by returning to torchrun, which ends the process
without the interpreter's teardown. `python -m labsupport.rank` in a fresh interpreter runs the same code.
"""
from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path


def die_with_parent(sig=signal.SIGTERM):
    """Ask Linux to signal this process when its parent dies, so a killed launcher leaves no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class _RankStream:
    """Line-buffered writer that prefixes every line with the rank and tees it to the rank's log."""

    def __init__(self, rank: int, stream, log):
        self.prefix, self.stream, self.log, self.pending = f"[rank {rank}] ", stream, log, ""

    def write(self, text):
        self.pending += text
        *lines, self.pending = re.split(r"(?<=\n)|(?<=\r)", self.pending)
        for line in lines:
            self.stream.write(self.prefix + line)
            self.log.write(line)
        self.flush()
        return len(text)

    def flush(self):
        self.stream.flush()
        self.log.flush()

    def isatty(self):
        return False

    def fileno(self):
        return self.stream.fileno()

    def close_pending(self):
        if self.pending:
            self.write("\n")


def _user_traceback(e: BaseException) -> str:
    """The traceback from the user's code down, without this wrapper's and runpy's frames."""
    frames = traceback.extract_tb(e.__traceback__)
    while frames and (frames[0].filename == __file__ or "runpy" in frames[0].filename):
        frames.pop(0)
    return ("Traceback (most recent call last):\n" + "".join(traceback.format_list(frames))
            + "".join(traceback.format_exception_only(type(e), e)))


def _forked() -> bool:
    """True in a rank torchrun forked from its agent (multiprocessing's child), False in a fresh interpreter."""
    import multiprocessing
    return multiprocessing.parent_process() is not None


def _as_a_fresh_process():
    """Undo what a fork inherits from torchrun's agent, so that the rank starts as a fresh process would:
    - torchrun's handlers that turn signals (SIGTERM, SIGINT, SIGHUP, SIGQUIT, and any named in
      TORCHELASTIC_SIGNALS_TO_HANDLE) into an exception: a rank stops on them, or gets KeyboardInterrupt;
    - the agent's exit handlers and finalizers: they clean up after the agent's objects, not the rank's
      to run; the rank's own still run, logging's shutdown among them;
    - the agent's random state: unseeded draws differ between ranks, as between fresh processes;
    - `os._exit`, while the rank's code runs: a forked rank must return to torchrun, which waits for its
      result, so in the main thread it exits through SystemExit (`os._exit(0)` would leave torchrun
      waiting for good). Returns the real one, which the rank puts back when its code is done: the
      fork's own end calls it."""
    import atexit
    import logging
    import weakref

    import torch
    for sig in signal.valid_signals():
        handler = signal.getsignal(sig)
        if getattr(handler, "__module__", "").startswith("torch.distributed.elastic"):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for finalizer in list(weakref.finalize._registry):
        finalizer.atexit = False
    atexit._clear()
    weakref.finalize._registered_with_atexit = False  # the rank's own finalizers register it again
    atexit.register(logging.shutdown)
    torch.seed()
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    real_exit = os._exit

    def _exit(code):
        if threading.current_thread() is threading.main_thread():
            raise SystemExit(code)
        real_exit(code)
    os._exit = _exit
    return real_exit


def _rank_main(argv: list[str]) -> int:
    import runpy
    forked = _forked()
    real_exit = _as_a_fresh_process() if forked else os._exit
    rank = int(os.environ.get("RANK", 0))
    run_dir = Path(os.environ.get("LABSUPPORT_RUN_DIR", "."))
    die_with_parent(signal.SIGKILL)
    (run_dir / f"pid-rank{rank}").write_text(str(os.getpid()))
    stack_file = open(run_dir / f"stack-rank{rank}.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)  # "where are you waiting?"
    faulthandler.enable(file=stack_file)  # and where a crash in C++ (abort, segfault) happened
    log = open(run_dir / f"rank{rank}.log", "a", encoding="utf-8")
    out = _RankStream(rank, sys.__stdout__, log)
    sys.stdout = sys.stderr = out
    code = 0
    try:
        if argv[0] == "-m":
            if argv[1].startswith("labsupport."):  # it ends with leave_now, before any teardown
                from labsupport import runtime
                runtime.LEAVES_WITHOUT_TEARDOWN = True
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path.insert(0, str(Path(argv[0]).parent))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code)
    except BaseException as e:  # report, then exit non-zero: torchrun stops the other ranks
        code = 1
        tb = _user_traceback(e)
        out.write(tb)
        (run_dir / f"error-rank{rank}.json").write_text(json.dumps(
            {"rank": rank, "time": time.time(), "error": f"{type(e).__name__}: {e}".splitlines()[0],
             "traceback": tb}))
    os._exit = real_exit
    out.close_pending()
    (run_dir / f"exit-rank{rank}").write_text(str(code))
    if forked:  # torchrun's child ends with os._exit once it returns: what an exit owes happens here
        finish([log, stack_file], collect=True)
    elif code == 0 and argv[0] == "-m" and argv[1].startswith("labsupport."):
        leave_now([log, stack_file])
    return code


def finish(files, collect: bool = False) -> None:
    """What an exit owes the world: the atexit handlers run, then (`collect`) what the code left behind is
    collected (a file it never closed is flushed), then this wrapper's own files are flushed and closed."""
    import atexit
    import gc
    atexit._run_exitfuncs()
    if collect:  # after the handlers, dropped: one the script registered keeps its globals alive until then
        atexit._clear()
        gc.collect()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    faulthandler.unregister(signal.SIGUSR1)
    faulthandler.disable()
    for f in (*files, sys.__stdout__, sys.__stderr__):
        f.flush()
    for f in files:
        f.close()


def leave_now(files) -> None:
    """End a rank that ran one of this package's own entry points (`labsupport.train`, ...), skipping
    the interpreter's teardown: unloading torch's thousands of modules takes half a second of CPU
    per rank, paid again by every rank of every launch, and the ranks share a laptop's few cores.
    What an exit owes the world still happens (`finish`). Our entry points close what they open and
    start no threads; a user's script, which may leave a buffered file open, exits the ordinary way."""
    finish(files)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(_rank_main(sys.argv[1:]))
