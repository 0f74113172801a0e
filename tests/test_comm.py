"""comm.py: every wrapper gives torch's result and counts calls, payload and wire bytes as DESIGN.md 4 says."""
import textwrap
import time

import pytest

from labsupport import comm
from labsupport.launch import launch

pytestmark = pytest.mark.multiprocess

RANK_SCRIPT = textwrap.dedent("""
    import torch
    from labsupport import comm, init, report
    failures = []
    def check(name, ok):
        if not ok:
            failures.append(name)
    with init() as rt:
        r, n = rt.rank, rt.world_size
        x = torch.arange(6, dtype=torch.float32) + r            # 24 bytes
        t = x.clone(); comm.all_reduce(t)
        check("all_reduce sum", torch.equal(t, n * torch.arange(6.) + sum(range(n))))
        t = x.clone(); comm.all_reduce(t, "avg")
        check("all_reduce avg", torch.allclose(t, torch.arange(6.) + (n - 1) / 2))
        t = x.clone(); comm.all_reduce(t, "max"); check("all_reduce max", torch.equal(t, torch.arange(6.) + n - 1))
        t = x.clone(); comm.broadcast(t, src=1); check("broadcast", torch.equal(t, torch.arange(6.) + 1))
        t = x.clone(); comm.reduce(t, dst=0)
        check("reduce", r != 0 or torch.equal(t, n * torch.arange(6.) + sum(range(n))))
        out = [torch.empty(6) for _ in range(n)]; comm.all_gather(out, x)
        check("all_gather", all(torch.equal(o, torch.arange(6.) + k) for k, o in enumerate(out)))
        flat = torch.empty(6 * n); comm.all_gather_into_tensor(flat, x)
        check("all_gather_into_tensor", torch.equal(flat, torch.cat(out)))
        shard = torch.empty(2); comm.reduce_scatter_tensor(shard, torch.arange(2. * n))
        check("reduce_scatter", torch.equal(shard, n * torch.arange(2. * r, 2. * r + 2)))
        got = torch.empty(2)
        comm.scatter(got, [torch.full((2,), float(k)) for k in range(n)] if r == 0 else None, src=0)
        check("scatter", torch.equal(got, torch.full((2,), float(r))))
        gl = [torch.empty(6) for _ in range(n)] if r == 0 else None; comm.gather(x, gl, dst=0)
        check("gather", r != 0 or all(torch.equal(g, torch.arange(6.) + k) for k, g in enumerate(gl)))
        outs = [torch.empty(1) for _ in range(n)]; comm.all_to_all(outs, [torch.tensor([10. * r + k]) for k in range(n)])
        check("all_to_all", all(o.item() == 10 * k + r for k, o in enumerate(outs)))
        # uneven blocks, as an expert-parallel dispatch sends: k + 1 rows to rank k, each row 10 r + k
        rows = torch.cat([torch.full((k + 1, 2), 10. * r + k) for k in range(n)])
        got = torch.empty((r + 1) * n, 2)
        comm.all_to_all_single(got, rows, [r + 1] * n, [k + 1 for k in range(n)])
        check("all_to_all_single", torch.equal(got, torch.cat([torch.full((r + 1, 2), 10. * k + r) for k in range(n)])))
        buf = torch.empty(6)
        if r == 0:
            comm.send(x, 1)
        elif r == 1:
            comm.recv(buf, 0); check("send/recv", torch.equal(buf, torch.arange(6.)))
        with comm.timing() as events:
            work = comm.all_reduce(x.clone(), async_op=True); work.wait()
        check("timed async", events and events[0]["op"] == "all_reduce" and events[0]["end"] >= events[0]["start"])
        comm.barrier()
        report(failures=failures, counts=comm.counts())
""")


def test_every_wrapper_matches_torch_and_is_counted(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    n = 3
    res = launch(str(script), nproc=n, run_dir=tmp_path / "run", timeout=120)
    for rank in range(n):
        assert res.report(rank)["failures"] == [], rank
    c0, c1 = res.report(0)["counts"], res.report(1)["counts"]
    # four all-reduces of 24 bytes: payload 96, wire 2(n-1)/n x 96 = 128
    assert c0["all_reduce"] == {"calls": 4, "payload_bytes": 96, "wire_bytes": 128}
    # all_gather: the full gathered buffer (n x 24 bytes) is the payload, (n-1)/n of it on the wire
    assert c0["all_gather"] == {"calls": 2, "payload_bytes": 2 * 72, "wire_bytes": 2 * 48}
    assert c0["reduce_scatter"] == {"calls": 1, "payload_bytes": 24, "wire_bytes": 16}
    assert c0["broadcast"]["wire_bytes"] == 24 and c0["send"] == {"calls": 1, "payload_bytes": 24, "wire_bytes": 24}
    assert c1["recv"] == {"calls": 1, "payload_bytes": 24, "wire_bytes": 0} and "send" not in c1
    # all_to_all: 3 one-element blocks (12 bytes), then all_to_all_single's 1 + 2 + 3 rows of 8 bytes
    assert c0["all_to_all"]["calls"] == 2 and c0["all_to_all"]["payload_bytes"] == 12 + 48


ASYNC_AVG_SCRIPT = textwrap.dedent("""
    import torch
    from labsupport import comm, init, report
    with init() as rt:
        r, n = rt.rank, rt.world_size
        results = {}
        t = torch.tensor([r + 1.0]); work = comm.all_reduce(t, "avg", async_op=True)
        work.wait(); work.wait()                      # a second wait must not divide again
        results["world"] = t.item()                   # mean of 1..n
        pair = comm.new_group([0, 1], "pair")         # every rank creates it, ranks 0 and 1 use it
        if r in (0, 1):
            t = torch.tensor([r + 1.0]); comm.all_reduce(t, "avg", group=pair, async_op=True).wait()
            results["pair"] = t.item()                # mean of 1 and 2
        report(**results)
""")


def test_async_avg_gives_the_mean_after_wait(tmp_path):
    """"avg" is a sum and then a division (gloo has no AVG): the division must come with wait()."""
    script = tmp_path / "avg.py"
    script.write_text(ASYNC_AVG_SCRIPT)
    n = 3
    res = launch(str(script), nproc=n, run_dir=tmp_path / "run", timeout=300)
    for rank in range(n):
        assert res.report(rank)["world"] == 2.0, rank   # (1 + 2 + 3) / 3, not the sum 6
    assert res.report(0)["pair"] == res.report(1)["pair"] == 1.5 and "pair" not in res.report(2)


def test_unsupported_reduction_is_a_clear_error():
    with pytest.raises(ValueError, match="unsupported reduction 'median'"):
        comm.all_reduce(None, "median")


def test_wire_factors_are_the_nccl_tests_bus_factors():
    assert comm.WIRE_FACTOR["all_reduce"](4) == 1.5 and comm.WIRE_FACTOR["all_gather"](4) == 0.75
    assert comm.WIRE_FACTOR["broadcast"](4) == 1.0


def test_waiting_for_a_work_to_be_freed_outlasts_a_descheduled_worker_thread(monkeypatch):
    """The worker thread drops its references one at a time; descheduled in between (a loaded
    machine), the count stalls part way. `_until_freed` must wait for it rather than call it settled."""
    start = time.monotonic()
    # held 4, the thread drops two at once, stalls 20 ms (a slice of a busy core), then the rest
    monkeypatch.setattr(comm, "_use_count", lambda t: 2 if time.monotonic() - start < 0.02 else 1)
    comm._until_freed(object(), before=1, held=4)
    assert time.monotonic() - start >= 0.02, "returned while the worker thread still held the tensor"


def test_a_count_the_caller_holds_above_the_start_settles(monkeypatch):
    """References the caller took itself never go away: the wait ends once the count stays put."""
    monkeypatch.setattr(comm, "_use_count", lambda t: 2)
    start = time.monotonic()
    comm._until_freed(object(), before=1, held=4)
    assert time.monotonic() - start < 1.0 and comm._waits_for_free
