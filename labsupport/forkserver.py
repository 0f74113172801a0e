"""A fork server for torchrun's agent: a launch starts in a fraction of a second of CPU instead of ~4 s.

Every launch runs torchrun's agent (labsupport.agent), a Python process that imports torch, torch's
launcher and what every rank imports next (runtime.prepare_to_fork) before it forks the ranks: ~4 s
of CPU, more than a tiny model's whole run on a laptop's two cores, paid again by every launch cell.
Where ranks may be forked (runtime.forks), a launcher process starts this server at its first launch
instead; it imports all that once and forks one agent per launch, as Python's multiprocessing
forkserver forks its workers. The agent then runs `agent.run_agent(ARGS)` with the launch's
environment, working directory (first on sys.path, as `python -m` puts it) and arguments, in a session
of its own, its output on the launch's pipe, its input /dev/null.

What a fork cannot change is what was read when the server imported torch: the environment at that
moment. So a server serves only launches whose environment equals its own but for what is read
later (`_read_later`: labsupport's own variables, pytest's, OMP_NUM_THREADS, which the agent sets
again); any other difference (TORCH_DISTRIBUTED_DEBUG, PYTHONPATH, ...) gets a server of its own.
A forked process keeps the environment its program started with in /proc/PID/environ, so the
server's, not the launch's: find a launch's processes by their pid files (rank.py's `pid-rank{k}`,
the launcher's `agent-pid`), not by their environment there.

No process outlives its launcher: the server ends its agents, the ranks it adopted (a child
subreaper: ranks whose agent died come to it) and itself when the launcher's end of their socket
closes, however the launcher ended. It also exits after IDLE_S without a launch, to give back its
memory (~300 MB, torch loaded); the next launch starts another.
"""
from __future__ import annotations

import ctypes
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback

IDLE_S = 120.0     # a server without a launch for this long exits (LABSUPPORT_FORKSERVER_IDLE_S)
POLL_S = 0.05      # how often the server reaps its agents
MESSAGE = 1 << 17  # the largest request (its environment): a Unix datagram socket takes ~200 KB at most
PR_SET_CHILD_SUBREAPER = 36


class ForkServerError(OSError):
    """The fork server could not start an agent (it did not start, or a request was too large)."""


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
    """The launcher's end of one server: requests out, "started" and "exited" messages in."""

    def __init__(self, env: dict):
        self.env = _import_time(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # the first launch's environment but its run directory: the server belongs to no one run
        self.proc = subprocess.Popen([sys.executable, "-m", "labsupport.forkserver", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, start_new_session=True,
                                     env={k: v for k, v in env.items() if k != "LABSUPPORT_RUN_DIR"})
        theirs.close()
        self.sock, self.lock, self.ids = ours, threading.Lock(), itertools.count()
        self.started: dict[int, int | str] = {}  # request id -> agent pid, or why none was forked
        self.ended: dict[int, int] = {}     # agent pid -> exit code, until its Agent takes it
        self.live: set[int] = set()         # agents started and not yet ended
        self.abandoned: set[int] = set()    # requests whose launch was interrupted: end their agent on arrival

    def serves(self, env: dict) -> bool:
        return self.proc.poll() is None and _import_time(env) == self.env

    def start(self, args: list[str], env: dict) -> Agent:
        """Fork an agent running `agent.run_agent(ARGS)`; ForkServerError if the server is gone."""
        with self.lock:
            n = next(self.ids)
            data = json.dumps({"id": n, "args": args, "env": env, "cwd": os.getcwd()}).encode()
            if len(data) > MESSAGE:
                raise ForkServerError(f"the launch's environment and arguments take {len(data):,} bytes; "
                                      f"the fork server takes {MESSAGE:,}")
            read, write = os.pipe()
            try:
                socket.send_fds(self.sock, [data], [write])
            except OSError:
                os.close(read)
                raise
            finally:
                os.close(write)
            try:
                while n not in self.started:
                    self._receive(timeout=None)
            except BaseException:  # interrupted, or the server is gone: no agent may run unwatched
                os.close(read)
                self.abandoned.add(n)
                raise
            started = self.started.pop(n)
            if isinstance(started, str):  # the server could not fork
                os.close(read)
                raise ForkServerError(started)
            return Agent(self, started, os.fdopen(read, "rb", buffering=0))

    def exit_code(self, pid: int, wait: bool) -> int | None:
        """The agent's exit code as Popen gives it (-N: killed by signal N); None while it runs."""
        while True:
            with self.lock:
                if pid not in self.ended:
                    try:
                        self._receive(timeout=0.1 if wait else 0)
                    except OSError:  # the server is gone, and its agents with it (parent-death signal)
                        self.ended[pid] = -signal.SIGTERM
                        self.live.discard(pid)
                if pid in self.ended or not wait:
                    return self.ended.pop(pid, None)

    def _receive(self, timeout: float | None) -> None:
        """Read one message from the server, if one comes within `timeout`, into started/ended."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return
        data = self.sock.recv(MESSAGE)
        if not data:
            raise ConnectionError("the fork server ended")
        message = json.loads(data)
        if "started" in message:
            pid = message["started"]
            self.ended.pop(pid, None)  # a pid used again: whatever an earlier agent of that pid left
            self.live.add(pid)
            if message["id"] in self.abandoned:
                from .launch import descendants, kill_pids
                self.abandoned.discard(message["id"])
                kill_pids([pid, *descendants(pid)], grace_s=1.0)
            else:
                self.started[message["id"]] = pid
        elif "exited" in message:
            self.live.discard(message["exited"])
            self.ended[message["exited"]] = message["code"]
        elif "error" in message:
            self.started[message["id"]] = message["error"]

    def close(self) -> None:
        """Close the launcher's end: the server ends what it started and exits."""
        self.sock.close()
        self.proc.wait()


_server: _Server | None = None
_retired: list[_Server] = []  # servers replaced while their launches still ran (another environment)
_lock = threading.Lock()


def start_agent(args: list[str], env: dict) -> Agent:
    """`python -m labsupport.agent ARGS` with environment `env`, forked by this process's fork server
    (started on first use, or again if it exited or reads another environment)."""
    global _server
    with _lock:
        _close_retired()
        for attempt in range(2):
            if _server is None or not _server.serves(env):
                _retire()
                try:
                    _server = _Server(env)
                except OSError as e:
                    raise ForkServerError(f"the fork server did not start: {e}") from e
            try:
                return _server.start(args, env)
            except ForkServerError:
                raise
            except OSError:  # it exited (idle) as the request went out: once more, with a new one
                _retire()
            except BaseException:  # interrupted while the agent starts: closing the server ends that agent,
                _retire()          # unless other launches run there (then it ends on arrival, _receive)
                raise
        raise ForkServerError("the fork server ended twice while starting an agent")


def _retire() -> None:
    """Put the current server aside: closed now if none of its agents runs, else once they have ended."""
    global _server
    if _server is not None:
        _retired.append(_server)
        _server = None
    _close_retired()


def _close_retired() -> None:
    for server in list(_retired):
        if not server.live:
            _retired.remove(server)
            server.close()


def stop() -> None:
    """End this process's fork servers and whatever they still run (the tests, before they look for
    processes left behind, report those first: `running`)."""
    global _server
    servers, _server = [s for s in (_server, *_retired) if s is not None], None
    _retired.clear()
    for server in servers:
        server.close()


def running() -> list[int]:
    """The processes this process's fork servers run now (agents, their ranks, adopted ranks)."""
    from .launch import descendants
    return [p for s in (_server, *_retired) if s is not None and s.proc.poll() is None
            for p in descendants(s.proc.pid)]


def _forget_after_fork() -> None:
    """In a child forked from a launcher: its servers are the parent's, not its own."""
    global _server
    _server, _retired[:] = None, []


os.register_at_fork(after_in_child=_forget_after_fork)


# ---------------------------------------------------------------- the server

def _serve(sock: socket.socket) -> None:
    from . import agent
    from .launch import descendants, kill_pids
    from .runtime import prepare_to_fork
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphaned ranks come here
    prepare_to_fork()
    idle_s = float(os.environ.get("LABSUPPORT_FORKSERVER_IDLE_S", IDLE_S))
    agents: set[int] = set()
    last = time.monotonic()
    try:
        while True:
            ready = select.select([sock], [], [], POLL_S)[0]
            for pid, code in _reaped():
                if pid in agents:
                    agents.discard(pid)
                    sock.send(json.dumps({"exited": pid, "code": code}).encode())
            if agents:
                last = time.monotonic()
            if ready:
                data, fds, _, _ = socket.recv_fds(sock, MESSAGE, 1)
                if not data:
                    return  # the launcher is gone
                request = json.loads(data)
                try:
                    pid = os.fork()
                except OSError as e:  # no process to be had: this launch fails, the others go on
                    os.close(fds[0])
                    sock.send(json.dumps({"error": f"cannot fork an agent: {e}", "id": request["id"]}).encode())
                    continue
                if pid == 0:
                    try:
                        sock.close()
                        _agent(agent, request, fds[0])
                    finally:
                        os._exit(1)  # never back into the server's loop
                os.close(fds[0])
                agents.add(pid)
                sock.send(json.dumps({"started": pid, "id": request["id"]}).encode())
            elif time.monotonic() - last > idle_s:
                return
    except BrokenPipeError:
        return  # the launcher is gone
    finally:
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


def _agent(agent, request: dict, out: int) -> None:
    """In a forked child: become the launch's agent (`agent.run_agent`), then exit as Python would."""
    server = os.getppid()
    os.setsid()
    agent.rank.die_with_parent()  # the server ends only when its launcher did
    if os.getppid() != server:
        os._exit(1)  # the server died before we asked to die with it
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    code = 0
    try:
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # where `python -m` looks first
        os.environ.clear()
        os.environ.update(request["env"])
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit():
            import torch
            torch.set_num_threads(int(threads))
        sys.argv = [agent.__file__, *request["args"]]
        agent.run_agent(request["args"])
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    import atexit
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
