"""Job scripts for Slurm and PBS: what they contain and what they launch.

The scripts are checked by bash and run with stand-ins for srun/scontrol/mpiexec/python that
record what they were asked to start; with `--launcher srun`, a stand-in srun starts one process
per task with Slurm's task variables. These need no scheduler and no root. Under a real Slurm, on
two nodes, the scripts are submitted, trained with and cancelled in tests/test_slurm_cluster.py
(PBS has no server here: its scripts are checked with the stand-ins only).
"""
import json
import os
import shlex
import subprocess
import sys

import pytest

from labsupport import cli, jobscript, runtime
from labsupport.jobscript import render, torchrun_command

TRAIN = ["labsupport", "train", "--strategy", "ddp", "--model", "nano", "--steps", "1000",
         "--data", "my corpus.txt"]  # an argument with a space, to check the quoting


def directives(script: str, prefix: str) -> list[str]:
    return [line[len(prefix):].strip() for line in script.splitlines() if line.startswith(prefix)]


def bash_ok(script: str, tmp_path) -> None:
    path = tmp_path / "job.sh"
    path.write_text(script)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- what the scripts say

def test_slurm_script_asks_for_the_nodes_and_gpus(tmp_path):
    script = render("slurm", 2, 4, TRAIN, account="ABC123", time="01:15:00", queue="gpu")
    bash_ok(script, tmp_path)
    assert script.startswith("#!/bin/bash\n")
    sbatch = directives(script, "#SBATCH")
    for expected in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--account=ABC123",
                     "--time=01:15:00", "--partition=gpu", "--job-name=labsupport", "--output=%x-%j.out",
                     "--cpus-per-task=28"):
        assert expected in sbatch
    # directives all come before the first command (sbatch stops reading them there)
    lines = script.splitlines()
    first_command = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    assert all(i < first_command for i, line in enumerate(lines) if line.startswith("#SBATCH"))
    assert 'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)' in script
    assert "srun " in script and "--kill-on-bad-exit=1" in script


def test_pbs_script_asks_for_the_nodes_and_gpus(tmp_path):
    script = render("pbs", 2, 4, TRAIN, account="ABC123", time="02:00:00", queue="debug-scaling", job_name="gpt")
    bash_ok(script, tmp_path)
    pbs = directives(script, "#PBS")
    for expected in ("-l select=2:ncpus=28:ngpus=4", "-l place=scatter", "-A ABC123", "-l walltime=02:00:00",
                     "-q debug-scaling", "-N gpt", "-j oe", "-S /bin/bash"):
        assert expected in pbs
    assert 'HEAD_NODE=$(head -n1 "$PBS_NODEFILE")' in script
    assert 'cd "$PBS_O_WORKDIR"' in script
    assert 'mpiexec -n "$NNODES" --ppn 1' in script


@pytest.mark.parametrize("scheduler", ["slurm", "pbs"])
def test_one_torchrun_per_node_one_rank_per_gpu_rendezvous_at_the_head(scheduler):
    script = render(scheduler, 2, 4, TRAIN)
    assert "GPUS_PER_NODE=4" in script
    assert '--nproc-per-node="$GPUS_PER_NODE"' in script
    assert '--nnodes="$NNODES"' in script
    assert '--rdzv-backend=c10d --rdzv-endpoint="$HEAD_NODE:$PORT" --rdzv-id="$JOB_ID"' in script
    assert "PORT=29500" in script
    # torchrun gives every rank its LOCAL_RANK; the script never sets one, nor MASTER_ADDR
    assert "LOCAL_RANK=" not in script and "MASTER_ADDR" not in script
    # `labsupport train` becomes `-m labsupport.train` under torchrun, the spaced argument single-quoted
    assert "-m labsupport.train --strategy ddp --model nano --steps 1000 --data 'my corpus.txt'" in script
    assert "export LABSUPPORT_RUN_DIR=" in script
    assert "# export NCCL_SOCKET_IFNAME=" in script and "# export GLOO_SOCKET_IFNAME=" in script
    # no account and no queue given: none asked for, and a comment says where to add them
    assert not [d for d in directives(script, "#SBATCH") + directives(script, "#PBS")
                if d.startswith(("--account", "--partition", "-A", "-q"))]


def test_python_commands_keep_their_interpreter_and_shell_characters_stay_literal():
    script = render("slurm", 1, 2, ["/opt/env/bin/python3", "train.py", "--name", "$HOME; rm -rf x", "it's"])
    assert "/opt/env/bin/python3 -m torch.distributed.run" in script
    assert "train.py --name '$HOME; rm -rf x' 'it'\"'\"'s'" in script
    script = render("pbs", 1, 2, ["python", "-m", "my.module", "--x", "1"])
    assert "python -m torch.distributed.run" in script and "-m my.module --x 1" in script


def test_run_dir_of_the_training_command_becomes_the_jobs_run_directory():
    script = render("slurm", 2, 4, [*TRAIN, "--run-dir", "/scratch/me/run 1"])
    assert "export LABSUPPORT_RUN_DIR='/scratch/me/run 1'" in script


def test_srun_launcher_starts_one_rank_per_gpu_itself(tmp_path):
    script = render("slurm", 2, 8, TRAIN, launcher="srun")
    bash_ok(script, tmp_path)
    sbatch = directives(script, "#SBATCH")
    assert {"--nodes=2", "--ntasks-per-node=8", "--gpus-per-node=8", "--cpus-per-task=7"} <= set(sbatch)
    assert ('srun --nodes="$NNODES" --ntasks-per-node="$GPUS_PER_NODE" --cpus-per-task="$CPUS_PER_GPU" \\\n'
            '    --gpus-per-node="$GPUS_PER_NODE" --gpu-bind=closest --kill-on-bad-exit=1 \\\n'
            "    python -m labsupport.train --strategy ddp --model nano --steps 1000 --data 'my corpus.txt'\n") in script
    # rank 0's address for every rank; Slurm itself gives each task its rank
    assert "export MASTER_ADDR=$HEAD_NODE\nexport MASTER_PORT=$PORT\n" in script
    assert "torch.distributed.run" not in script and "rdzv" not in script and "RANK=" not in script


def test_frontier_adds_the_network_settings_each_with_its_reason(tmp_path):
    for launcher in ("torchrun", "srun"):
        script = render("slurm", 2, 8, TRAIN, launcher=launcher, frontier=True, ofi_plugin="/sw/aws ofi-rccl/lib")
        bash_ok(script, tmp_path)
        lines = script.splitlines()
        for setting in ("export LD_LIBRARY_PATH='/sw/aws ofi-rccl/lib'${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}",
                        "export FI_CXI_ATS=0", "export NCCL_NET_GDR_LEVEL=3"):
            assert lines[lines.index(setting) - 1].startswith("# "), f"no comment explains {setting}"
    # no plugin directory given: none is made up; a commented line says where it goes
    script = render("slurm", 2, 8, TRAIN, frontier=True)
    assert "# export LD_LIBRARY_PATH=/path/to/aws-ofi-rccl/lib" in script and "\nexport LD_LIBRARY_PATH" not in script
    assert "export FI_CXI_ATS=0" in script
    for plain in (render("slurm", 2, 8, TRAIN), render("pbs", 2, 4, TRAIN)):
        assert "FI_CXI" not in plain and "NCCL_NET_GDR_LEVEL" not in plain and "LD_LIBRARY_PATH" not in plain


def test_the_commands_environment_comes_after_the_network_settings_and_before_the_launch():
    """`environment`: what the command needs exported (e.g. Megatron's CUDA_DEVICE_MAX_CONNECTIONS), as given."""
    lines = ["# one queue", "export CUDA_DEVICE_MAX_CONNECTIONS=1"]
    for scheduler, frontier in (("slurm", True), ("slurm", False), ("pbs", False)):
        script = render(scheduler, 2, 8, TRAIN, frontier=frontier, environment=lines)
        assert "\n".join(lines) + "\n\n" in script
        at = script.index(lines[0])
        assert script.index("export LABSUPPORT_RUN_DIR") < at < script.index('echo "$(date)')
        assert not frontier or script.index("export NCCL_NET_GDR_LEVEL=3") < at
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in render("slurm", 2, 8, TRAIN, frontier=True)


def test_port_comment_does_not_promise_a_free_port():
    script = render("slurm", 2, 4, TRAIN, port=29611)
    assert "PORT=29611" in script
    assert "Nothing checks that it is free" in script and "Any free TCP port" not in script


# ---------------------------------------------------------------- what the scripts launch

FAKE_PYTHON = """#!/bin/sh
# stands in for python on a compute node: record what it was asked to run, and the variables it got
exec @PYTHON@ -c '
import json, os, sys
env = {k: v for k, v in os.environ.items()
       if k.startswith(("SLURM_", "MASTER_")) or k in ("LD_LIBRARY_PATH", "FI_CXI_ATS", "NCCL_NET_GDR_LEVEL",
                                                     "CUDA_DEVICE_MAX_CONNECTIONS")}
line = json.dumps({"argv": sys.argv[1:], "run_dir": os.environ.get("LABSUPPORT_RUN_DIR"), "env": env}) + "\\n"
os.write(1, line.encode())   # one write: the ranks of a node append to one log at once
' "$@" >> @LOG@
"""
FAKE_SRUN = """#!/bin/sh
# stands in for srun: record our options, then run the command once (for one node)
while [ "${1#-}" != "$1" ]; do printf "%s\n" "$1" >> @LOG@; shift; done
exec "$@"
"""
FAKE_SRUN_TASKS = """#!/bin/sh
# stands in for srun starting the ranks itself: record our options, then start one process per task
# with the variables Slurm gives each task, and wait for them all
exec @PYTHON@ -c '
import os, subprocess, sys
log, args, options = sys.argv[1], sys.argv[2:], {}
while args[0].startswith("--"):
    option = args.pop(0)
    with open(log, "a") as f:
        print(option, file=f)
    key, _, value = option[2:].partition("=")
    options[key] = value
nodes, per_node = int(options["nodes"]), int(options["ntasks-per-node"])
tasks = [subprocess.Popen(args, env={**os.environ, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(nodes * per_node),
                                     "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node)})
         for rank in range(nodes * per_node)]
sys.exit(max(task.wait() for task in tasks))
' @LOG@ "$@"
"""
FAKE_SCONTROL = """#!/bin/sh
[ "$1 $2 $3" = "show hostnames node-[a-b]" ] || exit 3
printf 'node-a\\nnode-b\\n'
"""
FAKE_MPIEXEC = """#!/bin/sh
# stands in for mpiexec: record the launcher's options, then run the command once (for one node)
while [ "${1#-}" != "$1" ]; do printf "%s\n" "$1" >> @LOG@; case "$1" in -n|--ppn|--hostfile) shift; printf "%s\n" "$1" >> @LOG@;; esac; shift; done
exec "$@"
"""


def fake_tools(tmp_path, **tools) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in tools.items():
        path = bin_dir / name
        log = tmp_path / f"{name}.log"
        path.write_text(text.replace("@PYTHON@", shlex.quote(sys.executable)).replace("@LOG@", shlex.quote(str(log))))
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}


def run_script(script, tmp_path, env) -> list[dict]:
    """Run the job script with the stand-ins; what each `python` it started recorded."""
    path = tmp_path / "job.sh"
    path.write_text(script)
    res = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in (tmp_path / "python.log").read_text().splitlines()]


def test_slurm_script_launches_exactly_torchrun_command(tmp_path):
    env = fake_tools(tmp_path, python=FAKE_PYTHON, srun=FAKE_SRUN, scontrol=FAKE_SCONTROL)
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node-[a-b]",
               SLURM_JOB_NAME="labsupport")
    (got,) = run_script(render("slurm", 2, 4, TRAIN), tmp_path, env)
    target = ["-m", "labsupport.train", *TRAIN[2:]]
    assert got["argv"] == torchrun_command(2, 4, "node-a", 29500, "4242", target)[1:]
    assert got["run_dir"] == str(tmp_path / "runs" / "labsupport-4242") and os.path.isdir(got["run_dir"])
    srun_options = (tmp_path / "srun.log").read_text().split()
    assert {"--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--cpus-per-task=28"} <= set(srun_options)


def test_pbs_script_launches_exactly_torchrun_command(tmp_path):
    env = fake_tools(tmp_path, python=FAKE_PYTHON, mpiexec=FAKE_MPIEXEC)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("x1001c0s0b0n0.hsn.example.org\nx1001c0s1b0n0.hsn.example.org\n")
    workdir = tmp_path / "submitted-here"
    workdir.mkdir()
    env.update(PBS_JOBID="777.pbs-server.example.org", PBS_NODEFILE=str(nodefile), PBS_O_WORKDIR=str(workdir),
               PBS_JOBNAME="gpt")
    (got,) = run_script(render("pbs", 2, 4, TRAIN, job_name="gpt"), tmp_path, env)
    target = ["-m", "labsupport.train", *TRAIN[2:]]
    assert got["argv"] == torchrun_command(2, 4, "x1001c0s0b0n0.hsn.example.org", 29500, "777", target)[1:]
    assert got["run_dir"] == str(workdir / "runs" / "gpt-777")
    assert (tmp_path / "mpiexec.log").read_text().split()[:4] == ["-n", "2", "--ppn", "1"]


def test_srun_script_gives_every_rank_what_runtime_reads(tmp_path):
    env = fake_tools(tmp_path, python=FAKE_PYTHON, srun=FAKE_SRUN_TASKS, scontrol=FAKE_SCONTROL)
    # sbatch's variables; SLURM_NTASKS_PER_NODE comes from the script's --ntasks-per-node
    env.update(SLURM_JOB_ID="4242", SLURM_JOB_NUM_NODES="2", SLURM_JOB_NODELIST="node-[a-b]",
               SLURM_NTASKS_PER_NODE="4")
    env.pop("LD_LIBRARY_PATH", None)  # unset: the script must not trip over it under `set -u`
    script = render("slurm", 2, 4, TRAIN, launcher="srun", port=29611, frontier=True,
                    ofi_plugin="/sw/aws ofi-rccl/lib", environment=["# why", "export CUDA_DEVICE_MAX_CONNECTIONS=1"])
    got = run_script(script, tmp_path, env)
    ranks = sorted((runtime.detect(r["env"]) for r in got), key=lambda info: info.rank)
    assert [(i.rank, i.world_size, i.local_rank, i.local_world_size, i.launcher) for i in ranks] == \
        [(rank, 8, rank % 4, 4, "slurm") for rank in range(8)]
    for r in got:
        assert r["argv"] == ["-m", "labsupport.train", *TRAIN[2:]]
        assert r["run_dir"] == str(tmp_path / "runs" / "labsupport-4242")
        assert {k: r["env"][k] for k in ("MASTER_ADDR", "MASTER_PORT", "LD_LIBRARY_PATH", "FI_CXI_ATS",
                                          "NCCL_NET_GDR_LEVEL", "CUDA_DEVICE_MAX_CONNECTIONS")} == \
            {"MASTER_ADDR": "node-a", "MASTER_PORT": "29611", "LD_LIBRARY_PATH": "/sw/aws ofi-rccl/lib",
             "FI_CXI_ATS": "0", "NCCL_NET_GDR_LEVEL": "3", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    srun_options = set((tmp_path / "srun.log").read_text().split())
    assert {"--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--cpus-per-task=7", "--gpu-bind=closest",
            "--kill-on-bad-exit=1"} <= srun_options


def test_script_refuses_to_run_outside_a_job(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PBS_"))}
    path = tmp_path / "job.sh"
    path.write_text(render("slurm", 2, 4, TRAIN))
    res = subprocess.run(["bash", str(path)], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert res.returncode != 0 and "run this script with sbatch" in res.stderr


# ---------------------------------------------------------------- mistakes

@pytest.mark.parametrize("kwargs, message", [
    ({"scheduler": "lsf"}, "scheduler must be slurm or pbs"),
    ({"nodes": 0}, "nodes must be an integer >= 1"),
    ({"nodes": "2"}, "nodes must be an integer >= 1"),
    ({"gpus_per_node": 0}, "gpus-per-node must be an integer >= 1"),
    ({"command": []}, "give the command each rank runs"),
    ({"time": "30:00"}, "time must be HH:MM:SS"),
    ({"time": "00:00:00"}, "time must be HH:MM:SS"),
    ({"time": "1 hour"}, "time must be HH:MM:SS"),
    ({"port": 80}, "port must be an integer in 1024..65535"),
    ({"account": "ABC 123"}, "account must be one word"),
    ({"account": "ABC\n#SBATCH --nodes=99"}, "account must be one word"),
    ({"job_name": "my job"}, "job name must start with a letter"),
    ({"command": ["torchrun", "--nproc-per-node=4", "train.py"]}, "without torchrun"),
    ({"command": ["python", "-m", "torch.distributed.run", "train.py"]}, "the job script starts the ranks itself"),
    ({"launcher": "mpirun"}, "launcher must be torchrun or srun"),
    ({"scheduler": "pbs", "launcher": "srun"}, "--launcher srun needs Slurm: PBS has no srun"),
    ({"scheduler": "pbs", "frontier": True}, "--frontier needs Slurm"),
    ({"ofi_plugin": "/sw/aws-ofi-rccl/lib"}, "--ofi-plugin goes with --frontier"),
    ({"frontier": True, "ofi_plugin": "aws-ofi-rccl/lib"}, "--ofi-plugin must be an absolute directory"),
    ({"frontier": True, "ofi_plugin": "/a/lib:/b/lib"}, "--ofi-plugin must be an absolute directory"),
    ({"command": ["bash", "train.sh"]}, "cannot run"),
    ({"command": ["python"]}, "cannot run"),
    ({"command": ["labsupport", "launch", "--nproc", "2", "x.py"]}, "runs on this machine only"),
    ({"command": ["labsupport", "train", "--nproc", "8"]}, "drop --nproc"),
    ({"command": ["labsupport", "train", "--strategy", "nope"]}, "unknown strategy 'nope'"),
    ({"command": ["labsupport", "train", "--steps", "5"]}, "strategy 'single' runs on one rank, but the run has 8"),
    ({"command": ["labsupport", "train", "--strategy", "ddp", "--global-batch", "12"]}, "--global-batch 12 must be divisible"),
    ({"command": ["labsupport", "train", "--stpes", "5"]}, "training arguments: unrecognized arguments: --stpes"),
])
def test_bad_input_is_one_line(kwargs, message):
    call = {"scheduler": "slurm", "nodes": 2, "gpus_per_node": 4,
            "command": ["labsupport", "train", "--strategy", "ddp"], **kwargs}
    with pytest.raises(ValueError) as err:
        render(**call)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- the command line (until cli.py wires it)

def test_main_prints_the_script_or_writes_it(tmp_path, capsys):
    argv = ["--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--account", "ABC123", "--", *TRAIN]
    assert jobscript.main(argv) == 0
    assert capsys.readouterr().out == render("slurm", 2, 4, TRAIN, account="ABC123")

    out = tmp_path / "job.pbs"
    assert jobscript.main(["--scheduler", "pbs", "--nodes", "2", "--gpus-per-node", "4", "--output", str(out),
                           "--json", "--", *TRAIN]) == 0
    captured = capsys.readouterr()
    payload = json.loads(captured.out.splitlines()[-1])
    assert payload == {"scheduler": "pbs", "path": str(out), "script": out.read_text()}
    assert payload["script"] == render("pbs", 2, 4, TRAIN)
    assert f"qsub {out}" in captured.err and os.access(out, os.X_OK)


def test_main_reports_a_mistake_in_one_line(capsys):
    assert jobscript.main(["--scheduler", "slurm", "--nodes", "0", "--gpus-per-node", "4", "--", *TRAIN]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "labsupport jobscript: error: nodes must be an integer >= 1, got 0"


def test_labsupport_jobscript_takes_the_launcher_options(capsys):
    argv = ["jobscript", "--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "8", "--launcher", "srun",
            "--frontier", "--ofi-plugin", "/sw/aws-ofi-rccl/lib", "--", *TRAIN]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == render("slurm", 2, 8, TRAIN, launcher="srun", frontier=True,
                                             ofi_plugin="/sw/aws-ofi-rccl/lib")

    pbs = ["jobscript", "--scheduler", "pbs", "--nodes", "2", "--gpus-per-node", "4", "--launcher", "srun", "--", *TRAIN]
    assert cli.main(pbs) == 2
    assert capsys.readouterr().err == ("labsupport jobscript: error: --launcher srun needs Slurm: PBS has no srun "
                                       "(its scripts start torchrun with mpiexec)\n")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["jobscript", "--scheduler", "slurm", "--nodes", "2", "--gpus-per-node", "4", "--launcher", "mpirun"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "argument --launcher: invalid choice: 'mpirun'" in err
