"""teardown: leaving `labsupport.init()` really frees the process group, so no gloo thread outlives it.

The bug this guards against: gloo's worker threads belong to the process group object. If
anything still holds that object after destroy_process_group() (torch.distributed.nn.functional
takes `group=group.WORLD` as a default argument, and torch imports it lazily when the first
optimizer is built), the threads run on into interpreter shutdown, where one that frees a
finished all-reduce needs the GIL and the process aborts (SIGABRT, "terminate called without an
active exception") after all the work succeeded. The abort is a race; "the group is freed" is not.

A user's own script has no labsupport.init() to free the group, and building an optimizer pins
it: there the threads always run into shutdown, and what keeps such a script from aborting is
that nothing of ours leaves them a work to free. That is tested in test_ddp_library.py, with a user's
script run several times.
"""
import io
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch.distributed as dist

from labsupport import runtime
from labsupport.launch import free_port, launch

NOTEBOOK_02 = Path(__file__).resolve().parent.parent / "notebooks" / "02_data_parallel.ipynb"

FREED = """
import os, weakref
import torch, torch.distributed as dist
import labsupport

def threads():
    return len(os.listdir("/proc/self/task"))

with labsupport.init() as rt:
    world = weakref.ref(dist.group.WORLD)
    torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())  # imports torch._dynamo, after init
    inside = threads()
labsupport.report(freed=world() is None, threads_inside=inside, threads_after=threads())
"""

# The communication pattern of a bucketed DataParallel with one parameter per bucket, by hand.
SCENARIO = """
import sys, weakref
import torch, torch.distributed as dist
from torch import nn
import labsupport

class TiedMLP(nn.Module):
    def __init__(self, vocab=32, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: one parameter, two uses

    def forward(self, x):
        return self.head(torch.relu(self.hidden(self.embed(x))))

with labsupport.init(seed=0) as rt:
    world = weakref.ref(dist.group.WORLD)
    model = TiedMLP()
    works = []
    for p in model.parameters():  # all-reduce each gradient as soon as it is complete
        p.register_post_accumulate_grad_hook(
            lambda p: works.append(dist.all_reduce(p.grad, async_op=True)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(5):
        x = torch.randint(0, 32, (8, 4))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        opt.zero_grad()
        loss.backward()
        for w in works:
            w.wait()
        works.clear()
        opt.step()
    dist.barrier()
if world() is not None:
    sys.exit("the process group is still alive after labsupport.init() exited")
"""


def test_a_group_still_referenced_after_teardown_is_reported():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    held = dist.group.WORLD  # like a default argument evaluated after init
    with pytest.warns(RuntimeWarning, match="still referenced after destroy_process_group"):
        runtime._destroy_world()
    group = weakref.ref(held)
    del held
    assert group() is None


@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_group_and_its_threads_are_gone_after_init_exits(tmp_path):
    script = tmp_path / "freed.py"
    script.write_text(FREED)
    res = launch(str(script), nproc=2, device="cpu", run_dir=tmp_path / "run", out=io.StringIO(), timeout=120)
    for rank in range(2):
        r = res.report(rank)
        assert r["freed"], f"rank {rank}: process group still referenced after exit"
        assert r["threads_after"] < r["threads_inside"], f"rank {rank}: gloo threads still running: {r}"


def _run_pair(script, tmp_path) -> list[tuple[int, str]]:
    """Start 2 ranks as plain processes (no torchrun: faster); their (exit code, output)."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1",
           "LABSUPPORT_DEVICE": "cpu", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    procs = [subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outs)]
    finally:
        for p in procs:  # only after a timeout: never leave a rank behind
            if p.poll() is None:
                p.kill()
                p.wait()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_repeated_runs_never_abort_at_exit(tmp_path):
    """Fresh 2-rank runs of the abort scenario, one after another: every rank exits 0.

    LABSUPPORT_TEARDOWN_RUNS sets how many (default 3, about 3 s each on 2 cores: the suite's budget; a
    regression hunt sets 50). What prevents the abort, a freed group, is held on every run by
    test_group_and_its_threads_are_gone_after_init_exits.
    """
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    runs = int(os.environ.get("LABSUPPORT_TEARDOWN_RUNS", "3"))
    failures = []
    for run in range(runs):
        for rank, (code, out) in enumerate(_run_pair(script, tmp_path)):
            if code != 0:
                what = "SIGABRT" if code == -6 else f"exit code {code}"
                failures.append(f"run {run} rank {rank}: {what}\n" + "\n".join(out.splitlines()[-5:]))
    assert not failures, f"{len(failures)} rank(s) failed in {runs} runs:\n" + "\n".join(failures)


@pytest.mark.multiprocess
def test_the_plain_ddp_script_of_notebook_02_frees_its_group(tmp_path):
    """The script attendees copy to a cluster: nothing holds the group when it is destroyed."""
    cell = next(c for c in json.loads(NOTEBOOK_02.read_text())["cells"]
                if "".join(c["source"]).startswith('SCRIPT = """'))
    script = "".join(cell["source"]).split('"""')[1]
    destroy = "    dist.destroy_process_group()\n"
    assert script.count(destroy) == 1
    script = script.replace(destroy, "    import weakref\n    world = weakref.ref(dist.group.WORLD)\n" + destroy
                            + "    assert world() is None, 'the group outlives destroy_process_group()'\n")
    (tmp_path / "train_ddp.py").write_text(script)
    for rank, (code, out) in enumerate(_run_pair(tmp_path / "train_ddp.py", tmp_path)):
        assert code == 0, f"rank {rank}:\n{out[-1500:]}"
