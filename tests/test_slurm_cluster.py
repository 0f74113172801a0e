"""The job scripts under a real Slurm: two nodes (network and UTS namespaces), `sbatch`, srun, scancel.

One throwaway cluster (labsupport/cluster.py) serves the whole module. The scripts are written
by `labsupport jobscript` and `labsupport plan --emit jobscript` exactly as an instructor gets
them; the only edit is the one the script asks for, its venv activation line, and the
submitting environment has no venv on PATH, so the ranks find python only through that line.
No GPUs: each node declares two stand-in GPUs (the cluster module says how), the ranks run on
CPU with gloo.
"""
import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

import harness
from conftest import cli, processes_of
from labsupport import cluster as slurm

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

NODES, GPUS = 2, 2
STEPS = ("--model", "nano", "--steps", "4", "--global-batch", "8", "--sample-chars", "0", "--eval-batches", "1")
TRAIN = ["labsupport", "train", "--strategy", "ddp", *STEPS]
# Stands in for Megatron-DeepSpeed's pretrain script under `plan --emit jobscript`: the world the
# layout asks for forms, every rank takes part in one all-reduce, and rank 0 says what it saw.
MEGATRON_STANDIN = """\
import sys
import torch
import torch.distributed as dist
def arg(flag):
    return int(sys.argv[sys.argv.index(flag) + 1])
dist.init_process_group("gloo")
layout = arg("--tensor-model-parallel-size") * arg("--pipeline-model-parallel-size")
total = torch.ones(1)
dist.all_reduce(total)
if dist.get_rank() == 0:
    print(f"megatron stand-in: world {dist.get_world_size()}, tp x pp {layout}, all-reduce {total.item():g}")
dist.destroy_process_group()
"""
# Ranks 0-2 wait in a collective that never completes; the last rank, on the second node, fails.
CRASH = """\
import socket
import labsupport
from labsupport import comm
with labsupport.init() as rt:
    if rt.rank == rt.world_size - 1:
        raise SystemExit(f"rank {rt.rank} on {socket.gethostname()} fails on purpose")
    comm.barrier()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = slurm.missing()
    if why:
        pytest.skip(why)
    start = time.monotonic()
    with slurm.running(tmp_path_factory.mktemp("slurm")) as c:
        c.start_s = time.monotonic() - start
        print(f"cluster started in {c.start_s:.1f} s")
        yield c
    for node in c.nodes:  # down() removed the namespaces, and with them their interfaces
        assert node["ns"] not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert c.bridge not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def submit_env() -> dict:
    """The submitting shell: no venv on PATH (the job script's activation line must bring it), CPU ranks."""
    venv_bin = str(Path(sys.executable).parent)
    path = os.pathsep.join(d for d in os.environ["PATH"].split(os.pathsep) if d != venv_bin)
    return {**os.environ, "PATH": path, "LABSUPPORT_DEVICE": "cpu"}


def activated(script: str) -> str:
    """The script with its venv activation line filled in, as the script asks its user to do."""
    line = "# source /path/to/labsupport/.venv/bin/activate"
    assert line in script
    return script.replace(line, f"source {shlex.quote(sys.prefix)}/bin/activate")


def write(workdir: Path, script: str, name: str = "job.sh") -> Path:
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / name).write_text(script)
    return workdir / name


def jobscript(*args) -> str:
    res = cli("jobscript", "--scheduler", "slurm", *map(str, args))
    assert res.returncode == 0, res.stderr
    return res.stdout


def rank_reports(run_dir: Path, world: int) -> list[dict]:
    return [json.loads((run_dir / f"report-rank{r}.jsonl").read_text().splitlines()[-1]) for r in range(world)]


@pytest.fixture(scope="module")
def jobs(cluster, tmp_path_factory):
    """The jobs that run to their end, submitted together (Slurm queues what does not fit) and waited for:
    name -> (job id, state, exit code, log text, submit directory)."""
    root = tmp_path_factory.mktemp("jobs")
    scripts = {
        "torchrun": jobscript("--nodes", NODES, "--gpus-per-node", GPUS, "--cpus-per-gpu", 1, "--port", 29510,
                              "--", *TRAIN),
        "srun": jobscript("--nodes", NODES, "--gpus-per-node", GPUS, "--cpus-per-gpu", 1, "--port", 29511,
                          "--launcher", "srun", "--", *TRAIN),
        # runtime's own smoke test: every rank prints what it read from Slurm's variables
        "runtime": jobscript("--nodes", NODES, "--gpus-per-node", GPUS, "--cpus-per-gpu", 1, "--port", 29514,
                             "--launcher", "srun", "--", "python", "-m", "labsupport.smoke"),
        "crash": jobscript("--nodes", NODES, "--gpus-per-node", GPUS, "--cpus-per-gpu", 1, "--port", 29512,
                           "--job-name", "crash", "--", "python", "crash.py"),
    }
    plan = cli("plan", "--model", "nano", "--gpus", NODES * GPUS, "--gpus-per-node", GPUS, "--device", "a100-40gb",
               "--gpu-memory-gb", 16, "--intra-node-gbps", 100, "--inter-node-gbps", 25, "--tp", 2,
               "--emit", "jobscript", "--scheduler", "slurm", "--json")
    assert plan.returncode == 0, plan.stderr
    scripts["plan"] = json.loads(plan.stdout.splitlines()[-1])["jobscript"]
    submitted = {}
    for name, script in scripts.items():
        workdir = root / name
        write(workdir, activated(script))
        write(workdir, MEGATRON_STANDIN, "pretrain_gpt_deepspeed.py")
        write(workdir, CRASH, "crash.py")
        submitted[name] = (cluster.submit(workdir / "job.sh", env=submit_env()), workdir)
    done = {}
    for name, (job_id, workdir) in submitted.items():
        state, exit_code = cluster.wait(job_id, timeout_s=150)
        job_name = "crash" if name == "crash" else "labsupport"
        log = (workdir / f"{job_name}-{job_id}.out").read_text()  # where the script says its log goes
        done[name] = (job_id, state, exit_code, log, workdir)
    return done


def test_cluster_has_two_named_nodes_with_their_own_addresses(cluster):
    out = cluster.command("sinfo", "-h", "-N", "-o", "%N %t %G").stdout.split("\n")
    assert [line.split() for line in out if line] == [[n["name"], "idle", f"gpu:{GPUS}"] for n in cluster.nodes]
    hosts = subprocess.run(["srun", "-N2", "--ntasks-per-node=1", "sh", "-c", 'echo "$(hostname) $(getent hosts $(hostname))"'],
                           capture_output=True, text=True, env=cluster.env, timeout=30)
    assert sorted(line.split() for line in hosts.stdout.splitlines()) == \
        [[n["name"], n["addr"], n["name"]] for n in cluster.nodes], hosts


@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_job_trains_on_two_nodes_like_single(jobs, cluster, launcher):
    job_id, state, exit_code, log, workdir = jobs[launcher]
    assert (state, exit_code) == ("COMPLETED", "0:0"), log[-3000:]
    meeting = "rendezvous" if launcher == "torchrun" else "rank 0"
    head = cluster.nodes[0]["name"]  # the first of $SLURM_JOB_NODELIST, expanded by scontrol
    assert f"2 node(s) x 2 GPU(s), {meeting} at {head}:" in log, log
    assert f"python {sys.prefix}/bin/python" in log, "the job did not run the python its activation line chose"
    run_dir = workdir / "runs" / f"labsupport-{job_id}"
    reports = rank_reports(run_dir, NODES * GPUS)
    assert [r["world_size"] for r in reports] == [NODES * GPUS] * NODES * GPUS
    ref = harness.single(settings=STEPS)  # DESIGN 5: the losses and, before the optimizer, the gradients' norm
    assert (reports[0]["model"], reports[0]["steps"]) == (ref["model"], ref["steps"])
    assert reports[0]["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=0)
    assert reports[0]["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-4)
    assert processes_of(run_dir) == []


def test_srun_gives_each_rank_its_place_and_threads_from_cpus_per_task(jobs):
    job_id, state, exit_code, log, workdir = jobs["runtime"]
    assert (state, exit_code) == ("COMPLETED", "0:0"), log[-3000:]
    found = re.findall(r"rank (\d+)/(\d+) \(local (\d+)\) via (\w+), cpu \+ gloo, (\d+) threads", log)
    # SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID as srun set them; SLURM_CPUS_PER_TASK=1 (--cpus-per-gpu 1): one thread
    assert sorted(found) == [(str(r), "4", str(r % GPUS), "slurm", "1") for r in range(NODES * GPUS)], log
    sums = [r["all_reduce_sum"] for r in rank_reports(workdir / "runs" / f"labsupport-{job_id}", NODES * GPUS)]
    assert sums == [1 + 2 + 3 + 4] * 4


def test_plan_jobscript_runs_its_layout(jobs):
    _, state, exit_code, log, _ = jobs["plan"]
    assert (state, exit_code) == ("COMPLETED", "0:0"), log[-3000:]
    assert "megatron stand-in: world 4, tp x pp 2, all-reduce 4" in log


def test_a_rank_that_crashes_on_the_second_node_ends_the_job_and_is_named(jobs, cluster):
    job_id, state, exit_code, log, workdir = jobs["crash"]
    assert state == "FAILED" and exit_code != "0:0"
    second = cluster.nodes[1]["name"]
    assert f"rank 3 on {second} fails on purpose" in log, log[-3000:]
    assert re.search(rf"host\s*:\s*{second}\s+rank\s*:\s*3 \(local_rank: 1\)", log), log[-3000:]
    assert processes_of(workdir / "runs" / f"crash-{job_id}") == []


def test_scancel_ends_every_rank_on_both_nodes(cluster, tmp_path):
    script = jobscript("--nodes", NODES, "--gpus-per-node", GPUS, "--cpus-per-gpu", 1, "--port", 29513, "--",
                       "labsupport", "train", "--strategy", "ddp", "--model", "nano", "--steps", "100000",
                       "--global-batch", "8", "--sample-chars", "0", "--eval-batches", "1")
    job_id = cluster.submit(write(tmp_path, activated(script)), env=submit_env())
    run_dir = tmp_path / "runs" / f"labsupport-{job_id}"
    deadline = time.monotonic() + 90
    while not all((run_dir / f"metrics-rank{r}.jsonl").exists() for r in range(NODES * GPUS)):  # all training
        assert time.monotonic() < deadline and cluster.state(job_id)[0] in slurm.ACTIVE, \
            (tmp_path / f"labsupport-{job_id}.out").read_text()[-3000:]
        time.sleep(0.3)
    ranks = processes_of(run_dir)
    cluster.command("scancel", job_id)
    state, _ = cluster.wait(job_id, timeout_s=60)
    assert state == "CANCELLED"
    deadline = time.monotonic() + 10
    while (left := processes_of(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"left running after scancel: {left} of {ranks}"
    for node in cluster.nodes:  # nothing but slurmd on either node
        pids = subprocess.run(["ip", "netns", "pids", node["ns"]], capture_output=True, text=True).stdout.split()
        assert [Path(f"/proc/{p}/comm").read_text().strip() for p in pids] == ["slurmd"]


def test_more_nodes_than_exist_are_refused(cluster, tmp_path):
    script = write(tmp_path, activated(jobscript("--nodes", NODES + 1, "--gpus-per-node", GPUS, "--cpus-per-gpu", 1,
                                                 "--", "python", "-m", "labsupport.smoke")))
    with pytest.raises(slurm.ClusterError, match="Node count specification invalid"):
        cluster.submit(script, env=submit_env())
    # sbatch's own --nodes overrides the script's: Slurm runs it, the script's check stops it
    script = write(tmp_path, activated(jobscript("--nodes", NODES, "--gpus-per-node", GPUS, "--cpus-per-gpu", 1,
                                                 "--", *TRAIN)))
    job_id = cluster.submit(script, "--nodes=1", env=submit_env())
    state, _ = cluster.wait(job_id, timeout_s=60)
    log = (tmp_path / f"labsupport-{job_id}.out").read_text()
    assert state == "FAILED" and "this script was written for 2 node(s) and the job got 1" in log, log


def test_wait_streams_whole_lines_with_paths_under_their_short_names(tmp_path, monkeypatch):
    """What a notebook cell shows of a job's log: every line once, the job's folder and the venv by name."""
    log = tmp_path / "job.out"
    states = iter([("RUNNING", ""), ("RUNNING", ""), ("COMPLETED", "0:0")])
    writes = [f"run directory {tmp_path}/runs, pyth", f"on {sys.prefix}/bin/python\nstep 1\n", "done"]

    def state(job_id):
        with log.open("a") as f:
            f.write(writes.pop(0))
        return next(states)
    fake = slurm.Cluster(tmp_path, 0, "10.124.1", 0)
    monkeypatch.setattr(fake, "state", state)
    out = []
    got = fake.wait("1", log, out=type("Out", (), {"write": lambda _, s: out.append(s), "flush": lambda _: None})(),
                    shown_as={tmp_path: "$JOB_DIR", sys.prefix: "$VENV"})
    assert got == ("COMPLETED", "0:0")
    assert out == ["", "run directory $JOB_DIR/runs, python $VENV/bin/python\nstep 1\n", "done"]
