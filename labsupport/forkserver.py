"""A fork server for torchrun's agent: a launch starts in a fraction of a second of CPU instead of ~4 s.

Every launch runs torchrun's agent (labsupport.agent), a Python process that imports torch, torch's
launcher and what every rank imports next (runtime.prepare_to_fork) before it forks the ranks: ~4 s
of CPU, more than a tiny model's whole run on a laptop's two cores, paid again by every launch cell.
Where ranks may be forked (runtime.forks), the launcher starts this server once instead; it imports
all that once and forks one agent per launch, as Python's multiprocessing forkserver forks its
workers. The agent then runs as `python -m labsupport.agent ARGS` would: the launch's environment,
working directory and arguments, a session of its own, its output on the launch's pipe.

What a fork cannot change is what was read when the server imported torch: the environment at that
moment. So a server serves only launches whose environment equals its own but for what is read
later (`_read_later`: labsupport's own variables, pytest's, OMP_NUM_THREADS, which the agent
sets again); any other difference (TORCH_DISTRIBUTED_DEBUG, PYTHONPATH, ...) starts a new server.
A forked process keeps the environment its program started with in /proc/PID/environ, so the
server's, not the launch's: find a launch's processes by their pid files (rank.py's `pid-rank{k}`,
the launcher's `agent-pid`), not by their environment there.

No process outlives its launcher: the server ends its agents and itself when the launcher's end of
their socket closes (the launcher exited, however), and adopts orphaned ranks to end them too
(a child subreaper). It also exits after IDLE_S without a launch, to give back its memory (~400 MB,
torch loaded); the next launch starts another.
"""
from __future__ import annotations

import atexit
import ctypes
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

IDLE_S = 120.0    # a server without a launch for this long exits (LABSUPPORT_FORKSERVER_IDLE_S)
POLL_S = 0.05     # how often the server reaps its agents
MESSAGE = 1 << 20  # the largest request: an environment of up to 1 MB


def _read_later(name: str) -> bool:
    """Variables a fork may differ in: read after torch's import (labsupport's, pytest's), or set again by
    the forked agent (OMP_NUM_THREADS, which OpenMP read when the server loaded torch)."""
    return name.startswith(("LABSUPPORT_", "PYTEST_")) or name == "OMP_NUM_THREADS"


def _import_time(env: dict) -> dict:
    return {k: v for k, v in env.items() if not _read_later(k)}


# ---------------------------------------------------------------- the launcher's side

class Agent:
    """A forked agent, used as launch() uses a subprocess.Popen: pid, stdout, returncode, poll(), wait()."""

    def __init__(self, server: _Server, pid: int, stdout):
        self.server, self.pid, self.stdout, self.returncode = server, pid, stdout, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, wait=False)
        return self.returncode

    def wait(self) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, wait=True)
        return self.returncode


class _Server:
    def __init__(self, env: dict):
        self.env = _import_time(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # the first launch's environment but its run directory: the server belongs to no one run
        self.proc = subprocess.Popen([sys.executable, "-m", "labsupport.forkserver", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, start_new_session=True,
                                     env={k: v for k, v in env.items() if k != "LABSUPPORT_RUN_DIR"})
        theirs.close()
        self.sock, self.ended, self.lock = ours, {}, threading.Lock()

    def serves(self, env: dict) -> bool:
        return self.proc.poll() is None and _import_time(env) == self.env

    def start(self, args: list[str], env: dict) -> Agent:
        """Fork an agent running `python -m labsupport.agent ARGS`; OSError if the server is gone."""
        read, write = os.pipe()
        try:
            with self.lock:
                request = json.dumps({"args": args, "env": env, "cwd": os.getcwd()}).encode()
                socket.send_fds(self.sock, [request], [write])
                while True:
                    message = self._receive(timeout=None)
                    if "started" in message:
                        return Agent(self, message["started"], os.fdopen(read, "rb", buffering=0))
        except BaseException:
            os.close(read)
            raise
        finally:
            os.close(write)

    def exit_code(self, pid: int, wait: bool) -> int | None:
        """The agent's exit code as Popen gives it (-N: killed by signal N); None while it runs."""
        while pid not in self.ended:
            with self.lock:
                if pid not in self.ended:
                    try:
                        self._receive(timeout=0.1 if wait else 0)
                    except OSError:  # the server is gone, and its agents with it (parent-death signal)
                        self.ended.setdefault(pid, -signal.SIGTERM)
            if not wait:
                break
        return self.ended.get(pid)

    def _receive(self, timeout: float | None) -> dict:
        """One message from the server ({} if none came within `timeout`); exits are kept in self.ended."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return {}
        data = self.sock.recv(MESSAGE)
        if not data:
            raise ConnectionError("the fork server ended")
        message = json.loads(data)
        if "exited" in message:
            self.ended[message["exited"]] = message["code"]
        return message

    def stop(self) -> None:
        self.sock.close()  # the server sees its launcher go, ends what it started and exits
        self.proc.wait()


_server: _Server | None = None
_lock = threading.Lock()


def start_agent(args: list[str], env: dict) -> Agent:
    """`python -m labsupport.agent ARGS` with environment `env`, forked by this process's fork server
    (started on first use, or again if it exited or reads another environment)."""
    global _server
    with _lock:
        for attempt in range(2):
            if _server is None or not _server.serves(env):
                stop()
                _server = _Server(env)
            try:
                return _server.start(args, env)
            except OSError:  # it exited (idle) as the request went out: once more, with a new one
                stop()
        raise OSError("the fork server did not start an agent")


def stop() -> None:
    """End this process's fork server, if it runs (a launcher that is done; the tests, before they look
    for processes left behind)."""
    global _server
    server, _server = _server, None
    if server is not None:
        server.stop()


# ---------------------------------------------------------------- the server

def _serve(sock: socket.socket) -> None:
    from .launch import descendants, kill_pids
    from .runtime import prepare_to_fork
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphaned ranks come here
    importlib.import_module("labsupport.agent")  # torch and torchrun's agent
    prepare_to_fork()
    idle_s = float(os.environ.get("LABSUPPORT_FORKSERVER_IDLE_S", IDLE_S))
    agents: set[int] = set()
    last = time.monotonic()
    while True:
        ready = select.select([sock], [], [], POLL_S)[0]
        try:
            for pid, code in _reaped():
                if pid in agents:
                    agents.discard(pid)
                    sock.send(json.dumps({"exited": pid, "code": code}).encode())
            if agents:
                last = time.monotonic()
            if ready:
                data, fds, _, _ = socket.recv_fds(sock, MESSAGE, 1)
                if not data:
                    break  # the launcher is gone
                pid = os.fork()
                if pid == 0:
                    sock.close()
                    _agent(json.loads(data), fds[0])
                os.close(fds[0])
                agents.add(pid)
                sock.send(json.dumps({"started": pid}).encode())
            elif time.monotonic() - last > idle_s:
                break
        except OSError:  # the launcher is gone
            break
    everyone = [p for pid in agents for p in (pid, *descendants(pid))] + descendants(os.getpid())
    kill_pids(everyone, grace_s=3.0, reap=_reaped)


def _reaped() -> list[tuple[int, int]]:
    """(pid, exit code) of every child that ended, agents and adopted orphans alike."""
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, os.waitstatus_to_exitcode(status)))


def _agent(request: dict, out: int) -> None:
    """In a forked child: become `python -m labsupport.agent ARGS` as the launch asked, then exit."""
    from .rank import die_with_parent
    os.setsid()
    die_with_parent()  # the server ends only when its launcher did
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit():
        import torch
        torch.set_num_threads(int(threads))
    sys.argv = ["labsupport.agent", *request["args"]]
    code = 0
    try:
        runpy.run_module("labsupport.agent", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
