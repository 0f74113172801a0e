"""Ring and tree collectives from send/recv give torch.distributed's results, on real ranks."""
import io
import textwrap

import pytest
import torch

from labsupport import launch
from labsupport.algorithms import ring_all_gather, ring_all_reduce, ring_reduce_scatter, tree_broadcast

RANK_SCRIPT = """
    import torch
    import torch.distributed as dist
    from labsupport import comm, init, report
    from labsupport.algorithms import ring_all_gather, ring_all_reduce, ring_reduce_scatter, tree_broadcast

    with init(seed=0) as rt:
        n, me = rt.world_size, rt.rank
        gen = torch.Generator().manual_seed(1234 + me)  # different data on every rank
        failures = []

        def check(name, ours, reference, exact):
            same = torch.equal(ours, reference) if exact else torch.allclose(ours, reference, rtol=1e-5, atol=1e-6)
            if not same or ours.dtype != reference.dtype:
                failures.append(f"{name}: ours {ours.tolist()[:4]} vs torch {reference.tolist()[:4]}")

        for length in sorted({0, 1, n - 1, 7, 1000, 1001}):
            for dtype in (torch.float32, torch.float64, torch.int64):
                x = (torch.randint(-1000, 1000, (length,), generator=gen) if dtype == torch.int64
                     else torch.randn(length, generator=gen, dtype=dtype))
                case = f"n={n} length={length} {dtype}"
                for op in ("sum", "avg", "max", "min", "product"):
                    if op == "avg" and dtype == torch.int64:
                        continue
                    exact = op in ("max", "min") or dtype == torch.int64  # float sums, products: order matters
                    reference = x.clone()
                    comm.all_reduce(reference, op=op)
                    check(f"all_reduce {op} {case}", ring_all_reduce(x.clone(), op=op), reference, exact)
                    mine = torch.tensor_split(reference, n)[me]
                    check(f"reduce_scatter {op} {case}", ring_reduce_scatter(x, op=op), mine, exact)

                chunk = torch.tensor_split(x, n)[me]
                reference = torch.zeros_like(x)  # every rank's chunk in its place, summed: the gathered buffer
                torch.tensor_split(reference, n)[me].copy_(chunk)
                dist.all_reduce(reference)
                check(f"all_gather {case}", ring_all_gather(torch.empty_like(x), chunk), reference, True)

                for src in range(n):
                    reference = x.clone()
                    dist.broadcast(reference, src)
                    check(f"broadcast src={src} {case}", tree_broadcast(x.clone(), src), reference, True)

        grid = torch.randn(6, 5, generator=gen).t()  # not contiguous: reduced in place all the same
        reference = grid.clone()
        dist.all_reduce(reference)
        check(f"all_reduce of a transposed tensor n={n}", ring_all_reduce(grid), reference, False)

        comm.reset()
        ring_all_reduce(torch.ones(n * 1000))
        report(failures=failures, send=comm.counts()["send"])
"""


@pytest.mark.multiprocess
@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_and_tree_match_torch_and_send_2_n_minus_1_over_n(tmp_path, n):
    script = tmp_path / "collectives.py"
    script.write_text(textwrap.dedent(RANK_SCRIPT))
    result = launch(script, nproc=n, timeout=120, run_dir=tmp_path / "run", out=io.StringIO())
    payload = n * 1000 * 4  # float32 bytes
    for rank in range(n):
        report = result.report(rank)
        assert report["failures"] == [], f"rank {rank}: " + "; ".join(report["failures"][:5])
        assert report["send"]["calls"] == 2 * (n - 1)
        assert report["send"]["payload_bytes"] == 2 * (n - 1) * payload // n


def test_one_process_is_a_world_of_one():
    x = torch.arange(7.0)
    assert torch.equal(ring_all_reduce(x.clone(), op="avg"), x)
    assert torch.equal(ring_reduce_scatter(x), x)
    assert torch.equal(ring_all_gather(torch.empty(7), x), x)
    assert torch.equal(tree_broadcast(x.clone()), x)
    assert ring_all_reduce(torch.empty(0)).numel() == 0


@pytest.mark.parametrize("call, match", [
    (lambda: ring_all_reduce(torch.ones(3), op="mean"), "unsupported reduction 'mean'"),
    (lambda: ring_all_reduce(torch.ones(3, dtype=torch.int64), op="avg"), "floating-point"),
    (lambda: ring_all_gather(torch.empty(4), torch.ones(3)), "input has 3 elements"),
    (lambda: tree_broadcast(torch.ones(3), src=1), "src must be a rank from 0 to 0"),
])
def test_bad_arguments_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()
