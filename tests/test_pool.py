"""Interactive ranks: a pool whose ranks keep their state between cells, and fail as launches do.

Most tests share one pool (`labsupport.pool.ranks`, the notebook's, so the magics see it too);
a test that breaks it (a hang, a dead rank) checks that it comes back working. No test asserts
how long something took; waits have bounds only so that a broken pool fails instead of hanging.
The memory tests (an idle pool stops itself; a notebook hears of another notebook's pool and can
stop it) use an idle limit of a few seconds and a registry folder of their own.
"""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from labsupport import load_ipython_extension, pool as pool_module, pool_registry
from labsupport.launch import LaunchError, LaunchTimeout, RankFailed, alive
from labsupport.lab.exercise import unwrap
from labsupport.pool import IDLE_ENV, PoolError, RankPool, ranks
from labsupport.pool_registry import REGISTRY_ENV
from conftest import REPO, listening_addresses, on_loopback, processes_of

pytestmark = pytest.mark.multiprocess

BOUND_S = 60


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LABSUPPORT_RUNS", str(tmp_path_factory.mktemp("runs")))
        ranks.start(2, timeout=BOUND_S)
        ranks.run("import torch\nimport torch.distributed as dist\nfrom labsupport import comm, report")
    yield ranks
    run_dir = ranks.run_dir
    ranks.stop()
    assert processes_of(run_dir) == []


def gone(pids) -> bool:
    """True once none of `pids` is alive (waits up to BOUND_S)."""
    deadline = time.monotonic() + BOUND_S
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def cell(code: str) -> str:
    return textwrap.dedent(code).strip()


def one_line(err) -> str:
    """The error's message, checked to be a single line and shown by IPython as that one line."""
    message = str(err.value)
    assert "\n" not in message and len(err.value._render_traceback_()) == 1
    return message


def test_the_engines_are_forked_from_one_process_that_imported_what_ranks_import(pool):
    """Where ranks may be forked (runtime.forks: a CPU-only torch on Linux), one process imports torch and
    what every rank imports next, then forks each rank's engine (pool._fork_engines); elsewhere each engine
    is a fresh interpreter. torch._dynamo stands for those imports: no cell here has imported it yet."""
    from labsupport.runtime import forks
    seen = pool.run("import os, sys\nos.getppid(), 'torch._dynamo' in sys.modules")
    parents = {parent for parent, _ in seen.values()}
    forked = len(parents) == 1 and parents.isdisjoint(pool.pids.values()) and all(d for _, d in seen.values())
    assert forked == forks(), seen


def test_state_lives_between_cells_and_values_come_back(pool, capsys):
    assert pool.run(cell("""
        t = torch.tensor([rt.rank + 1.0])
        comm.all_reduce(t)
        print('sum', t.item())
    """)) == {0: None, 1: None}
    assert pool.run("t.item(), rt.rank, rt.world_size") == {0: (3.0, 0, 2), 1: (3.0, 1, 2)}
    lines = capsys.readouterr().out.splitlines()
    assert sorted(lines) == ["[rank 0] sum 3.0", "[rank 1] sum 3.0"]


def test_a_subset_of_ranks(pool):
    pool.run("only = 'here'", ranks=[1])
    assert pool.run("rt.rank * 10", ranks="1") == {1: 10}
    assert pool.pull("only", ranks=1) == {1: "here"}
    with pytest.raises(RankFailed) as err:
        pool.pull("only")
    assert one_line(err) == "rank 0 failed: NameError: name 'only' is not defined"


def test_push_and_pull(pool):
    pool.push(lr=0.5, sizes=[1, 2])
    pool.push({"scale": 3}, ranks=[0])
    assert pool.run("lr * sum(sizes)") == {0: 1.5, 1: 1.5}
    assert pool.pull("scale", ranks=[0]) == {0: 3}
    pool.run("w = torch.full((2,), float(rt.rank))")
    w = pool.pull("w")
    assert w[0].tolist() == [0.0, 0.0] and w[1].tolist() == [1.0, 1.0]


def test_comm_counters_and_report_work_on_ranks(pool):
    pool.run(cell("""
        comm.reset()
        comm.all_reduce(torch.ones(4))
        report(calls=comm.counts()['all_reduce']['calls'], rank=rt.rank)
    """))
    assert pool.report(1) == {"calls": 1, "rank": 1}


def test_an_exception_on_one_rank_names_it_and_keeps_the_pool(pool, capsys):
    pids = pool.pids
    with pytest.raises(RankFailed) as err:
        pool.run("x = rt.rank\nif rt.rank == 1:\n    raise ValueError('boom on purpose')")
    assert one_line(err) == "rank 1 failed: ValueError: boom on purpose; the traceback is above"
    stderr = capsys.readouterr().err.splitlines()
    assert stderr[0] == "[rank 1] Traceback (most recent call last):"
    assert stderr[-1] == "[rank 1] ValueError: boom on purpose"
    assert any(line.startswith("[rank 1]   File ") and "cell" in line and "line 3" in line for line in stderr)
    assert not any("pool.py" in line for line in stderr)
    assert pool.pids == pids and pool.pull("x") == {0: 0, 1: 1}


def test_a_syntax_error_reaches_no_rank(pool):
    with pytest.raises(SyntaxError):
        pool.run("x = = 1")


def test_a_hang_is_stopped_by_the_timeout_and_the_pool_restarts(pool):
    pids = pool.pids
    with pytest.raises(LaunchTimeout) as err:
        pool.run("if rt.rank == 0:\n    comm.all_reduce(torch.ones(1))", timeout=3)
    message = one_line(err)
    assert message.startswith("timed out after 3 s; still running: rank 0 (in comm.all_reduce); ")
    assert "rank 1" not in message and "all rank state" in message and "was lost" in message
    assert gone(pids.values())
    assert pool.run("import torch\nfrom labsupport import comm\nt = torch.ones(1)\ncomm.all_reduce(t)\nt.item()") \
        == {0: 2.0, 1: 2.0}


def test_peers_of_a_failed_rank_left_waiting_are_restarted(pool):
    with pytest.raises(RankFailed) as err:
        pool.run("if rt.rank == 1:\n    raise ValueError('early')\ncomm.all_reduce(torch.ones(1))")
    message = one_line(err)
    assert message.startswith("rank 1 failed: ValueError: early, and 5 s later the other ranks had not finished; "
                              "still running: rank 0 (in comm.all_reduce)")
    assert pool.run("rt.rank") == {0: 0, 1: 1}


def test_a_rank_that_dies_is_named_and_the_pool_restarts(pool):
    with pytest.raises(RankFailed) as err:
        pool.run("import os\nos._exit(3)", ranks=[1])
    assert one_line(err).startswith("rank 1 died; restarted all 2 ranks with a fresh process group")
    assert pool.status() == {0: "idle", 1: "idle"}
    os.kill(pool.pids[0], signal.SIGKILL)
    assert gone([pool.pids[0]]) and pool.status()[0] == "dead"
    with pytest.raises(RankFailed, match=r"^rank 0 died since the last cell; restarted"):
        pool.run("1")
    assert pool.run("rt.rank") == {0: 0, 1: 1}


def test_bad_requests_are_one_line_and_start_nothing(pool):
    with pytest.raises(PoolError) as err:
        pool.start(2)
    assert one_line(err).startswith("a pool of 2 ranks is already running; stop it first")
    with pytest.raises(PoolError) as err:
        pool.run("1", ranks=[0, 2])
    assert one_line(err) == "there is no rank 2: the pool's ranks are 0 to 1"
    with pytest.raises(PoolError) as err:
        pool.run("1", ranks="0;1")
    assert "comma-separated" in one_line(err)
    with pytest.raises(PoolError) as err:
        pool.run("1", timeout=0)
    assert one_line(err) == "timeout must be > 0 seconds, got 0"
    idle = RankPool()
    for call in (lambda: idle.run("1"), lambda: idle.pull("t"), lambda: idle.push(a=1), idle.restart):
        with pytest.raises(PoolError) as err:
            call()
        assert one_line(err) == "no ranks are running; start one with `%ranks start --nproc N`"
    with pytest.raises(LaunchError) as err:
        idle.start(10_000)
    assert "more than this machine can run on CPU" in one_line(err)
    for nproc in (0, -1, 1.5):
        with pytest.raises(LaunchError) as err:
            idle.start(nproc)
        assert one_line(err) == f"nproc must be an integer >= 1, got {nproc!r}"
    with pytest.raises(LaunchError) as err:
        idle.start(2, timeout=0)
    one_line(err)
    with pytest.raises(PoolError) as err:
        idle.start(2, idle_minutes=-1)
    assert one_line(err) == "idle_minutes must be a number of minutes >= 0 (0: never stop when idle), got -1"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(IDLE_ENV, "soon")
        with pytest.raises(PoolError) as err:
            idle.start(2)
    assert one_line(err).startswith(f"{IDLE_ENV} must be a number of minutes >= 0")
    assert not idle.running and idle.run_dir is None


def test_magics_in_ipython(pool, capsys):
    from IPython.core.interactiveshell import InteractiveShell
    shell = InteractiveShell.instance()
    load_ipython_extension(shell)
    assert shell.run_cell_magic("ranks", "--ranks 1", "m = rt.rank * 2\nm") == {1: 2}
    assert shell.run_cell_magic("ranks", "--timeout 30", "m = rt.rank") is None  # no last expression
    assert pool.pull("m") == {0: 0, 1: 1}
    shell.run_line_magic("ranks", "status")
    assert capsys.readouterr().out.splitlines() == [f"rank {r}: idle (pid {pid})" for r, pid in pool.pids.items()]
    for line in ("--ranks 5", "--bogus"):
        with pytest.raises(PoolError):
            shell.run_cell_magic("ranks", line, "1")
    with pytest.raises(PoolError, match=r"^%ranks: argument action: invalid choice: 'launch' .*; usage: %ranks "):
        shell.run_line_magic("ranks", "launch")
    with pytest.raises(PoolError, match="already running"):
        shell.run_line_magic("ranks", "start --nproc 2")
    assert capsys.readouterr() == ("", "")  # nothing but the one line of each error


def test_restart_gives_fresh_ranks(pool):
    pool.run("kept = 1")
    pids = pool.pids
    pool.restart()
    assert gone(pids.values()) and pool.run("'kept' in globals(), rt.rank") == {0: (False, 0), 1: (False, 1)}


def test_every_socket_of_the_pool_listens_on_loopback_only(pool):
    """torch's store (rank 0), gloo's sockets and ipyparallel's: none reachable from another machine.
    The store listens on the port rank 0 bound first and published (test_runtime checks the handover)."""
    store_port = int(pool.run("import os\nos.environ['MASTER_PORT']", ranks=0)[0])
    sockets = listening_addresses(processes_of(pool.run_dir))
    assert store_port == pool.port and store_port in {port for _, port in sockets}, sockets
    assert [(str(a), port) for a, port in sockets if not on_loopback(a)] == []


OWNER = """
import time
from labsupport.pool import ranks
ranks.start(2)
print(ranks.run_dir, flush=True)
time.sleep(600)
"""


def test_killing_the_owner_leaves_no_process(tmp_path):
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "LABSUPPORT_RUNS": str(tmp_path)})
    try:
        run_dir = owner.stdout.readline().strip()
        started = processes_of(run_dir)
        assert len(started) >= 3  # the controller and two engines
    finally:
        owner.kill()
        owner.wait()
    try:
        assert gone(started)
    finally:  # a failing test leaves nothing behind either
        for pid in filter(alive, started):
            os.kill(pid, signal.SIGKILL)


def test_a_jupyter_kernel_streams_rank_output_interrupts_and_ends_the_pool_on_shutdown(tmp_path):
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(REPO),
                              env={**os.environ, "LABSUPPORT_RUNS": str(tmp_path)})
    try:
        def execute(code, interrupt_after=None):
            """(stdout, stderr, error name) of one cell; interrupt the kernel once `interrupt_after` is printed."""
            msg_id = kc.execute(code)
            out, err, error = "", "", None
            while True:
                msg = kc.get_iopub_msg(timeout=BOUND_S)
                if msg["parent_header"].get("msg_id") != msg_id:
                    continue
                content = msg["content"]
                if msg["msg_type"] == "stream" and content["name"] == "stdout":
                    out += content["text"]
                    if interrupt_after and interrupt_after in out:
                        km.interrupt_kernel()
                        interrupt_after = None
                elif msg["msg_type"] == "stream":
                    err += content["text"]
                elif msg["msg_type"] == "error":
                    error = content["ename"]
                elif msg["msg_type"] == "status" and content["execution_state"] == "idle":
                    return out, err, error

        assert "2 ranks ready" in execute("%load_ext labsupport\n%ranks start --nproc 2")[0]
        out, _, error = execute("%%ranks\nprint('hello from', rt.rank)")
        assert sorted(out.splitlines()) == ["[rank 0] hello from 0", "[rank 1] hello from 1"] and error is None
        hang = cell("""
            %%ranks
            import torch
            from labsupport import comm
            print('waiting')
            if rt.rank == 0:
                comm.all_reduce(torch.ones(1))
        """)
        _, err, error = execute(hang, interrupt_after="[rank 0] waiting")
        assert error == "KeyboardInterrupt" and "interrupted; still running: rank 0 (in comm.all_reduce)" in err
        assert "all rank state (variables, tensors, models) was lost" in err
        out, _, error = execute("%%ranks\nprint(rt.rank)")
        assert sorted(out.splitlines()) == ["[rank 0] 0", "[rank 1] 1"] and error is None
        run_dir = execute("print(ranks.run_dir)")[0].strip()
        pids = processes_of(run_dir)
        assert len(pids) >= 3
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert gone(pids)


def test_a_killed_kernel_leaves_no_process(tmp_path):
    """JupyterLab's "shut down" ends the pool through the kernel's exit (the test above); a kernel
    that is killed takes the pool with it too: nbval ends each notebook's kernel so (SIGKILL, as an
    out-of-memory kill or kill -9 would), and notebooks leave their pool running."""
    from jupyter_client.manager import start_new_kernel
    km, kc = start_new_kernel(kernel_name="python3", cwd=str(REPO),
                              env={**os.environ, "LABSUPPORT_RUNS": str(tmp_path)})
    out = []
    try:
        kc.execute_interactive("%load_ext labsupport\n%ranks start --nproc 2\nprint(ranks.run_dir)",
                               timeout=BOUND_S, output_hook=lambda msg: out.append(msg["content"].get("text", "")))
        pids = processes_of("".join(out).splitlines()[-1])
        assert len(pids) >= 3, out
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)  # SIGKILL, no shutdown request
    try:
        assert gone(pids)
    finally:
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)


# ---------------------------------------------------------------- memory: the idle stop, other notebooks' pools

def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"still waiting after {BOUND_S} s for {what}"
        time.sleep(0.1)


def test_an_idle_pool_stops_itself_and_a_check_starts_it_again_saying_so(tmp_path, monkeypatch, capsys):
    from labsupport.lab import on_ranks
    monkeypatch.setenv(REGISTRY_ENV, str(tmp_path / "registry"))
    idle = RankPool()
    monkeypatch.setattr(pool_module, "ranks", idle)  # the checks' pool
    try:
        idle.start(2, timeout=BOUND_S, idle_minutes=0.02)  # 1.2 s
        run_dir, pids = idle.run_dir, list(idle.pids.values())
        assert [p.name for p in (tmp_path / "registry").iterdir()] == [f"{os.getpid()}.json"]
        assert idle.run("import time\ntime.sleep(2)\nrt.rank") == {0: 0, 1: 1}  # a long cell is not cut
        wait_for(lambda: not idle.running, "the idle stop")
        # the idle stop ends the processes after the pool says it stopped: the engines, the process they were
        # forked from and the controller end within the bound
        wait_for(lambda: processes_of(run_dir) == [], "the pool's processes to end")
        assert gone(pids) and list((tmp_path / "registry").iterdir()) == []
        assert idle.stopped == "stopped themselves after 0.02 min without a cell" and idle.serves(2)
        capsys.readouterr()
        values = on_ranks.run("", "os", "getpid()", nproc=2)  # a check: on the pool again, not on fresh ranks
        out = unwrap(capsys.readouterr().out)
        assert out.splitlines()[0] == ("The 2 interactive ranks stopped themselves after 0.02 min without a cell, "
                                       "to free their memory. Starting them again: what earlier %%ranks cells left "
                                       "on them is gone."), out
        assert "fresh ranks" not in out and values == idle.pids and idle.running and idle.stopped is None
    finally:
        run_dir = idle.run_dir
        idle.stop()
    assert processes_of(run_dir) == [] and not idle.serves(2)
    with pytest.raises(PoolError, match="^no ranks are running"):  # stopped on purpose: no restart
        idle.run("1")


def test_a_notebook_hears_of_another_notebooks_pool_stops_it_and_nothing_is_left(tmp_path):
    """Two notebooks of one Jupyter server (two kernels of this process): the second pool's start names the
    first, `%ranks stop --others` ends it, the first notebook's next cell starts its ranks again and says
    why; an idle pool in a kernel stops itself; a killed kernel's pool and registry file go."""
    from jupyter_client.manager import start_new_kernel
    registry = tmp_path / "registry"
    env = {**os.environ, "LABSUPPORT_RUNS": str(tmp_path / "runs"), REGISTRY_ENV: str(registry)}
    kernels = {}
    try:
        for name, idle_minutes in (("a", "20"), ("b", "0.05")):
            kernels[name] = start_new_kernel(kernel_name="python3", cwd=str(REPO), env={
                **env, IDLE_ENV: idle_minutes, "JPY_SESSION_NAME": str(tmp_path / f"{name}.ipynb")})

        def execute(name, code):
            out = []
            reply = kernels[name][1].execute_interactive(
                code, timeout=BOUND_S, output_hook=lambda msg: out.append(msg["content"].get("text", "")))
            assert reply["content"]["status"] == "ok", (code, reply["content"], out)
            return unwrap("".join(out))

        assert "2 ranks ready" in execute("a", "%load_ext labsupport\n%ranks start --nproc 2")
        run_a = execute("a", "print(ranks.run_dir)").strip()
        out = execute("b", "%load_ext labsupport\n%ranks start --nproc 2")
        lines = out.splitlines()
        assert re.fullmatch(r"a\.ipynb still holds 2 interactive ranks \(\d+\.\d GB, used in the last minute\)\.",
                            lines[0]), out
        assert lines[1] == "`%ranks stop --others` stops them; that notebook starts them again when it needs them."
        assert "2 ranks ready" in lines[2]
        run_b = execute("b", "print(ranks.run_dir)").strip()
        assert re.fullmatch(r"stopped the 2 ranks of a\.ipynb \(\d+\.\d GB\); it starts them again when it "
                            r"needs them\n", execute("b", "%ranks stop --others"))
        assert gone(processes_of(run_a)) and execute("b", "%ranks stop --others") == \
            "no other notebook holds interactive ranks\n"
        out = execute("a", "%%ranks\nprint('rank', rt.rank)")
        assert out.splitlines()[0] == ("The 2 interactive ranks were stopped from b.ipynb, to free their memory. "
                                       "Starting them again: what earlier %%ranks cells left on them is gone.")
        assert sorted(out.splitlines()[1:]) == ["[rank 0] rank 0", "[rank 1] rank 1"], out
        run_a = execute("a", "print(ranks.run_dir)").strip()
        wait_for(lambda: processes_of(run_b) == [], "b's idle stop (3 s)")  # in a kernel, from its watcher thread
        out = execute("b", "%%ranks\nprint('rank', rt.rank)")
        assert out.startswith("The 2 interactive ranks stopped themselves after 0.05 min without a cell") and \
            "a.ipynb still holds 2 interactive ranks (" in out, out
        run_b = execute("b", "print(ranks.run_dir)").strip()
        pids_a = processes_of(run_a)
        km, kc = kernels.pop("a")
        kc.stop_channels()
        km.shutdown_kernel(now=True)  # SIGKILL: its pool dies with it, its registry file stays behind
        assert gone(pids_a)
        out = execute("b", "%ranks status")
        assert out.splitlines()[0].startswith("rank 0: idle") and "still holds" not in out, out
        assert [p.name for p in registry.iterdir()] == [f"{kernels['b'][0].provisioner.process.pid}.json"]
        pids_b = processes_of(run_b)
    finally:
        for km, kc in kernels.values():
            kc.stop_channels()
            km.shutdown_kernel(now=False)
    assert gone(pids_b)
    with pytest.MonkeyPatch.context() as mp:  # a kernel killed before its exit hook ran leaves a file; the next
        mp.setenv(REGISTRY_ENV, str(registry))  # notebook's start (or status) removes it
        assert pool_registry.other_pools() == [] and list(registry.iterdir()) == []
