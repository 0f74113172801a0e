"""Job scripts for several nodes: `labsupport jobscript --scheduler slurm|pbs --nodes N --gpus-per-node G -- CMD`.

On a laptop, `labsupport launch` starts torchrun on 127.0.0.1. On a cluster, the scheduler gives
us N nodes and the job script has to start the same ranks on all of them. Two ways (`--launcher`):

* `torchrun` (the default, Slurm and PBS): the scheduler's launcher (`srun` on Slurm, `mpiexec`
  on PBS) starts ONE torchrun per node. Each torchrun starts one rank per GPU of its node and
  gives it RANK, LOCAL_RANK (its GPU), WORLD_SIZE, MASTER_ADDR and MASTER_PORT. The torchruns
  find each other through a rendezvous (torchrun's `c10d` backend) hosted on the first node of
  the allocation: `scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1` on Slurm,
  `head -n1 "$PBS_NODEFILE"` on PBS. The torchrun whose host name matches it hosts the
  rendezvous; the others connect to it.
* `srun` (Slurm only): srun starts every rank itself, one task per GPU, each bound to its GPU
  (`--gpu-bind=closest`), the way Frontier's own examples launch. Slurm tells each task its rank
  (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID), which `runtime` reads; the script exports
  MASTER_ADDR (the first node) and MASTER_PORT for all of them.

torchrun per node is the default because the per-node command is the same on both schedulers and
torchrun sets every variable a rank needs. The test suite submits the Slurm scripts of both
launchers with sbatch to a two-node Slurm on one machine (labsupport/cluster.py,
tests/test_slurm_cluster.py), so what the script launches is what was tested.

Only the job script knows multi-node addresses; single-node runs keep binding to 127.0.0.1.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import sys

SCHEDULERS = ("slurm", "pbs")
LAUNCHERS = ("torchrun", "srun")
# Cores per GPU that the job asks for. 7 fits every machine the workshop uses:
# Frontier (8 GCDs, 56 usable cores), Polaris (4 GPUs, 32 cores), DGX A100/H100 (8 GPUs, 128+ cores).
DEFAULT_CPUS_PER_GPU = 7

_TIME = re.compile(r"^\d{1,3}:[0-5]\d:[0-5]\d$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")  # job names: also part of the run directory's name
_SITE_WORD = re.compile(r"^[A-Za-z0-9_.@:+-]+$")      # accounts and queues: one word, nothing a directive could break on
_PYTHON = re.compile(r"^python[0-9.]*$")
# Flags of `labsupport train` that drive the local launcher; in a job, the job decides these.
_LOCAL_ONLY = {"--nproc": "the world size is nodes x gpus-per-node",
               "--timeout": "the scheduler's --time limits the job",
               "--ranks": "rank 0 prints, the others write to the run directory",
               "--json": "each rank writes report-rank{k}.jsonl to the run directory"}


def torchrun_command(nodes, gpus_per_node, head, port, job_id, target_args, python: str = "python") -> list[str]:
    """The command every node runs: one torchrun that starts `gpus_per_node` ranks and meets the others.

    `target_args` is what each rank runs: `["-m", "labsupport.train", ...]` or `["script.py", ...]`.
    The job scripts call this with shell variables (`"$NNODES"`, `"$HEAD_NODE"`, ...) as values; the
    two-node test calls it with real ones.
    """
    return [python, "-m", "torch.distributed.run",
            f"--nnodes={nodes}", f"--nproc-per-node={gpus_per_node}",
            # c10d: the rendezvous lives in a TCP store on `head`, started by the torchrun running there.
            "--rdzv-backend=c10d", f"--rdzv-endpoint={head}:{port}", f"--rdzv-id={job_id}",
            *target_args]


def rank_command(command: list[str], world_size: int) -> tuple[str, list[str], str | None]:
    """Split the user's command into (python, what torchrun runs, --run-dir or None); ValueError if unusable.

    Accepted: `labsupport train ARGS`, `python -m MODULE ARGS`, `python SCRIPT ARGS` (any
    python/python3/path-to-python). Training arguments are checked here, so a typo fails now and
    not after the job has waited in the queue.
    """
    if not command or not all(isinstance(word, str) for word in command):
        raise ValueError("give the command each rank runs after --, e.g. -- labsupport train --strategy ddp")
    head = os.path.basename(command[0])
    if head in ("torchrun", "srun", "mpiexec", "mpirun") or "torch.distributed.run" in command[:3]:
        raise ValueError(f"give the command each rank runs, without {command[0]}: the job script starts "
                         "the ranks itself (e.g. -- labsupport train --strategy ddp)")
    if head == "labsupport":
        if command[1:2] != ["train"]:
            raise ValueError(f"`labsupport {' '.join(command[1:2])}` runs on this machine only; in a job give "
                             "`labsupport train ...`, `python -m MODULE ...` or `python SCRIPT ...`")
        python, target = "python", ["-m", "labsupport.train", *command[2:]]
    elif _PYTHON.match(head) and len(command) >= 3 and command[1] == "-m":
        python, target = command[0], command[1:]
    elif _PYTHON.match(head) and len(command) >= 2 and not command[1].startswith("-"):
        python, target = command[0], command[1:]
    else:
        raise ValueError(f"cannot run {shlex.join(command[:3])!s} on every GPU; give `labsupport train ...`, "
                         "`python -m MODULE ...` or `python SCRIPT ...`")
    run_dir = None
    if target[:2] == ["-m", "labsupport.train"]:
        run_dir = _check_train_args(target[2:], world_size)
    return python, target, run_dir


def _check_train_args(argv: list[str], world_size: int) -> str | None:
    """Parse and validate `labsupport.train` arguments as the ranks will; return --run-dir."""
    for word in argv:
        flag = word.split("=")[0]
        if flag in _LOCAL_ONLY:
            raise ValueError(f"drop {flag} from the training command: in a job, {_LOCAL_ONLY[flag]}")
    from .train import build_parser, validate  # validate imports torch (the steps check): only for a training command

    def refuse(message):
        raise ValueError(f"training arguments: {message}")

    parser = build_parser()
    parser.error = refuse  # argparse would print usage and exit; we want one line
    args = parser.parse_args(argv)
    # The data file may exist only on the cluster: check everything else, against the shipped corpus.
    validate(argparse.Namespace(**{**vars(args), "data": None}), world_size)
    return args.run_dir


def _check(scheduler, nodes, gpus_per_node, time, job_name, port, account, queue, cpus_per_gpu,
           launcher, frontier, ofi_plugin) -> None:
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be slurm or pbs, got {scheduler!r}")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher must be torchrun or srun, got {launcher!r}")
    if launcher == "srun" and scheduler == "pbs":
        raise ValueError("--launcher srun needs Slurm: PBS has no srun (its scripts start torchrun with mpiexec)")
    if frontier and scheduler == "pbs":
        raise ValueError("--frontier needs Slurm: Frontier's scheduler is Slurm")
    if ofi_plugin is not None:
        if not frontier:
            raise ValueError("--ofi-plugin goes with --frontier: give both")
        if not isinstance(ofi_plugin, str) or not os.path.isabs(ofi_plugin) or ":" in ofi_plugin:
            raise ValueError(f"--ofi-plugin must be an absolute directory without ':' (the ranks on every "
                             f"node read it from LD_LIBRARY_PATH), got {ofi_plugin!r}")
    for name, value in (("nodes", nodes), ("gpus-per-node", gpus_per_node), ("cpus-per-gpu", cpus_per_gpu)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not isinstance(time, str) or not _TIME.match(time) or not time.strip("0:"):
        raise ValueError(f"time must be HH:MM:SS and more than zero, e.g. 00:30:00; got {time!r}")
    if not isinstance(job_name, str) or not _NAME.match(job_name):
        raise ValueError(f"job name must start with a letter and hold only letters, digits, _ . - "
                         f"(at most 64); got {job_name!r}")
    if not isinstance(port, int) or isinstance(port, bool) or not 1024 <= port <= 65535:
        raise ValueError(f"port must be an integer in 1024..65535, got {port!r}")
    for name, value in (("account", account), ("queue", queue)):
        if value is not None and (not isinstance(value, str) or not _SITE_WORD.match(value)):
            raise ValueError(f"{name} must be one word of letters, digits, _ . @ : + -; got {value!r}")


def _quote(words: list[str], ours: bool) -> list[str]:
    """Quote words for bash. Our own words may hold "$VARIABLES" and are double-quoted so bash
    expands them; the user's words are single-quoted by shlex, so nothing in them expands."""
    if not ours:
        return [shlex.quote(w) for w in words]
    out = []
    for word in words:
        if "$" in word:
            flag, _, value = word.partition("=")
            word = f'{flag}="{value}"' if value else f'"{word}"'
        out.append(word)
    return out


def _torchrun_lines(per_node: list[str]) -> list[str]:
    """torchrun's part of the launch command, one idea per line: torchrun, sizes, rendezvous."""
    python, torchrun, sizes, rendezvous = per_node[0], per_node[1:3], per_node[3:5], per_node[5:8]
    return [" ".join([shlex.quote(python), *torchrun]), " ".join(_quote(sizes, True)),
            " ".join(_quote(rendezvous, True))]


def _launch_lines(lines: list[str], command: list[str], width: int = 96) -> str:
    """The launch command, one idea per line: `lines` as they are, then the user's `command`."""
    lines = list(lines)
    current = ""
    for word in _quote(command, False):  # the rank's command, wrapped between words
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    lines.append(current)
    return " \\\n    ".join(lines)


def _node_check(nodes: int, gpus_per_node: int, override: str) -> str:
    """The script's check that it got the nodes it was written (and its training arguments checked) for."""
    return f"""\
# Options on the command line override the lines above (`{override} FILE`): the training
# arguments were checked for {nodes} node(s) x {gpus_per_node} GPU(s), so stop if the job got another count.
[ "$NNODES" -eq {nodes} ] || {{ echo "this script was written for {nodes} node(s) and the job got $NNODES:" \\
    "submit it as it is, or write it again with labsupport jobscript --nodes $NNODES" >&2; exit 1; }}"""


# Where the ranks meet, as the job script explains it.
HEAD_NOTE = {
    "torchrun": "# The rendezvous runs on the first node of the allocation (where this script runs, too).\n"
                "# Every node must be able to reach it under this name.",
    "srun": "# Rank 0 runs on the first node of the allocation (where this script runs, too): srun hands\n"
            "# out ranks node by node. Every node must be able to reach it under this name.",
}


def _slurm_tasks(srun: bool, gpus_per_node: int, cpus_per_gpu: int) -> str:
    """The #SBATCH lines for tasks, GPUs and cores: one task per node (torchrun) or per GPU (srun)."""
    if srun:
        return f"""\
# One task per GPU: each task is one rank, started by srun below.
#SBATCH --ntasks-per-node={gpus_per_node}
#SBATCH --gpus-per-node={gpus_per_node}
# Each task (rank) gets {cpus_per_gpu} cores.
#SBATCH --cpus-per-task={cpus_per_gpu}"""
    return f"""\
# One task per node: that task is torchrun, and torchrun starts one rank per GPU.
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
# The task gets {cpus_per_gpu} cores per GPU; its ranks share them (runtime splits threads between them).
#SBATCH --cpus-per-task={cpus_per_gpu * gpus_per_node}"""


def _frontier_lines(ofi_plugin: str | None) -> str:
    """The network settings for RCCL on Frontier's Slingshot network, each with the reason for it."""
    if ofi_plugin:
        plugin = f"export LD_LIBRARY_PATH={shlex.quote(ofi_plugin)}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"
    else:
        plugin = ("# No --ofi-plugin given: put the plugin's lib directory (your build, or your site's) here.\n"
                  "# export LD_LIBRARY_PATH=/path/to/aws-ofi-rccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
    return f"""\
# Frontier (--frontier). RCCL, the NCCL of AMD GPUs, reaches the Slingshot network through the
# aws-ofi-rccl plugin (librccl-net.so, found on LD_LIBRARY_PATH); without it, RCCL falls back to
# TCP sockets, which are much slower.
{plugin}
# libfabric's Slingshot provider (cxi): register memory without PCIe Address Translation Services
# (ATS); Frontier runs RCCL through the plugin with this setting.
export FI_CXI_ATS=0
# GPUDirect RDMA: the network card reads and writes GPU memory directly, with no copy through host
# memory, even where the path crosses the CPU's PCIe host bridge (level 3 = PHB). Faster; remove
# this line if the job hangs or crashes at the first collective.
export NCCL_NET_GDR_LEVEL=3

"""


def render(scheduler: str, nodes: int, gpus_per_node: int, command: list[str], account: str | None = None,
           time: str = "00:30:00", job_name: str = "labsupport", port: int = 29500, queue: str | None = None,
           cpus_per_gpu: int = DEFAULT_CPUS_PER_GPU, launcher: str = "torchrun", frontier: bool = False,
           ofi_plugin: str | None = None, environment: list[str] = ()) -> str:
    """The text of a Slurm or PBS job script that runs `command` on `nodes` x `gpus_per_node` ranks.

    `command` is what one rank runs, e.g. `["labsupport", "train", "--strategy", "ddp"]`.
    `queue` is Slurm's partition or PBS's queue. `launcher` is "torchrun" (one per node) or "srun"
    (Slurm starts every rank). `frontier` adds the network settings for RCCL on Slingshot, with the
    aws-ofi-rccl plugin from `ofi_plugin`. `environment` is lines the command needs before it starts
    (comments, exports), e.g. `estimate.planner.megatron_environment`'s. Raises ValueError (one line)
    on bad input.
    """
    _check(scheduler, nodes, gpus_per_node, time, job_name, port, account, queue, cpus_per_gpu,
           launcher, frontier, ofi_plugin)
    python, target, run_dir = rank_command(command, nodes * gpus_per_node)
    srun = launcher == "srun"
    cpus = cpus_per_gpu * gpus_per_node
    world = nodes * gpus_per_node
    run_dir_value = f'"$PWD/runs/{job_name}-$JOB_ID"' if run_dir is None else shlex.quote(run_dir)
    if scheduler == "slurm":
        head = f"""\
#!/bin/bash
# Slurm job: {shlex.join(command)}
# on {nodes} node(s) x {gpus_per_node} GPU(s) = {world} ranks, one rank per GPU.
# Written by `labsupport jobscript`. Submit with `sbatch FILE`; watch with `squeue --me`.
# Log: {job_name}-<job id>.out in the directory you submitted from.
#
# Slurm reads #SBATCH lines up to the first command, so keep them all here, each on its own line.
#SBATCH --job-name={job_name}
{f"#SBATCH --account={account}" if account else "# no account given: add #SBATCH --account=PROJECT if your site needs one"}
{f"#SBATCH --partition={queue}" if queue else "# default partition: add #SBATCH --partition=NAME to choose one"}
#SBATCH --nodes={nodes}
{_slurm_tasks(srun, gpus_per_node, cpus_per_gpu)}
#SBATCH --time={time}
# One log per job (stdout and stderr): <job name>-<job id>.out.
#SBATCH --output=%x-%j.out

# Stop at the first failing command or unset variable. (No pipefail: `head -n1` below may
# close its pipe before scontrol is done writing, which is fine.)
set -eu
: "${{SLURM_JOB_ID:?run this script with sbatch, not bash}}"

NNODES=$SLURM_JOB_NUM_NODES
{_node_check(nodes, gpus_per_node, "sbatch --nodes=1")}
GPUS_PER_NODE={gpus_per_node}
{f"CPUS_PER_GPU={cpus_per_gpu}" if srun else f"CPUS_PER_NODE={cpus}"}
JOB_ID=$SLURM_JOB_ID
{HEAD_NOTE[launcher]}
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)
"""
        if srun:
            launch = ['srun --nodes="$NNODES" --ntasks-per-node="$GPUS_PER_NODE" --cpus-per-task="$CPUS_PER_GPU"',
                      '--gpus-per-node="$GPUS_PER_NODE" --gpu-bind=closest --kill-on-bad-exit=1']
            launch_why = f"""\
# srun starts every rank itself: one task per GPU, {gpus_per_node} per node. --gpu-bind=closest gives each task
# the GPU nearest to its cores, so each rank sees exactly one GPU (cuda:0). Slurm tells every task
# its rank (SLURM_PROCID), the number of ranks (SLURM_NTASKS) and its place on its node
# (SLURM_LOCALID); labsupport's init() reads them (a script of your own: `with labsupport.init()`).
# srun passes this script's environment on, MASTER_ADDR and MASTER_PORT with it.
# --kill-on-bad-exit stops every rank as soon as one fails, instead of letting the others wait
# in a collective until the time limit."""
        else:
            launch = ['srun --nodes="$NNODES" --ntasks-per-node=1 --cpus-per-task="$CPUS_PER_NODE"',
                      '--gpus-per-node="$GPUS_PER_NODE" --kill-on-bad-exit=1']
            launch_why = ("# srun starts one torchrun per node (--ntasks-per-node=1) with all of the node's GPUs;\n"
                          "# --kill-on-bad-exit stops every node as soon as one fails, instead of letting the\n"
                          "# others wait in a collective until the time limit.")
        environment_note = "# sbatch passes on the environment you submitted from; if your site does not, activate it here:"
    else:
        head = f"""\
#!/bin/bash
# PBS job: {shlex.join(command)}
# on {nodes} node(s) x {gpus_per_node} GPU(s) = {world} ranks, one rank per GPU.
# Written by `labsupport jobscript`. Submit with `qsub FILE`; watch with `qstat -u $USER`.
# Log: {job_name}.o<job number> in the directory you submitted from.
#
# PBS reads #PBS lines up to the first command, so keep them all here, each on its own line.
#PBS -N {job_name}
# Run this script with bash, whatever the login shell is.
#PBS -S /bin/bash
{f"#PBS -A {account}" if account else "# no account given: add #PBS -A PROJECT if your site needs one"}
{f"#PBS -q {queue}" if queue else "# default queue: add #PBS -q NAME to choose one"}
# {nodes} chunk(s) of {cpus} cores and {gpus_per_node} GPUs; place=scatter puts each chunk on a node of its own.
#PBS -l select={nodes}:ncpus={cpus}:ngpus={gpus_per_node}
#PBS -l place=scatter
#PBS -l walltime={time}
# One log per job: stdout and stderr joined.
#PBS -j oe
# Site-specific resources go here as well, e.g. on Polaris: #PBS -l filesystems=home:eagle

set -eu  # stop at the first failing command or unset variable
: "${{PBS_JOBID:?run this script with qsub, not bash}}"
cd "$PBS_O_WORKDIR"  # PBS starts jobs in $HOME; work where qsub was run

# $PBS_NODEFILE lists the job's nodes, first node first (a node may appear once per MPI slot).
NNODES=$(sort -u "$PBS_NODEFILE" | wc -l)
{_node_check(nodes, gpus_per_node, "qsub -l select=1:...")}
GPUS_PER_NODE={gpus_per_node}
JOB_ID=${{PBS_JOBID%%.*}}
{HEAD_NOTE[launcher]}
HEAD_NODE=$(head -n1 "$PBS_NODEFILE")
"""
        launch = ['mpiexec -n "$NNODES" --ppn 1 --hostfile "$PBS_NODEFILE" --envall']
        launch_why = ("# mpiexec starts one torchrun per node (-n NNODES --ppn 1) and passes this environment on\n"
                      "# (--envall). That is MPICH / Cray PALS syntax (Polaris); with Open MPI, use\n"
                      "# `--map-by ppr:1:node` instead of `--ppn 1` and pass variables with `-x NAME`.")
        environment_note = "# PBS does not pass on the environment you submitted from: activate it here, e.g."
    if srun:
        meeting = "rank 0"
        masters = """\
# Every rank finds rank 0 here: torch.distributed's env:// rendezvous reads these two.
export MASTER_ADDR=$HEAD_NODE
export MASTER_PORT=$PORT

"""
        torchrun_note = ""
        lines, rank_words = launch, [python, *target]  # srun runs the rank's command directly
    else:
        meeting, masters = "rendezvous", ""
        torchrun_note = f"""\
# Each torchrun starts one rank per GPU (LOCAL_RANK 0..{gpus_per_node - 1} picks the GPU) and joins the
# rendezvous on $HEAD_NODE; the job's id keeps it apart from any other job's rendezvous.
"""
        per_node = torchrun_command("$NNODES", "$GPUS_PER_NODE", "$HEAD_NODE", "$PORT", "$JOB_ID", [], python)
        lines, rank_words = [*launch, *_torchrun_lines(per_node)], target
    command_environment = "\n".join(environment) + "\n\n" if environment else ""
    body = f"""\
# The ranks meet on the head node at this TCP port (--port). Nothing checks that it is free: if
# another program there already listens on it, the job fails at start-up; give another --port.
# Every node must be allowed to connect to it.
PORT={port}

# Software environment: the same Python environment on every node (on a shared filesystem).
{environment_note}
# module load ...
# source /path/to/labsupport/.venv/bin/activate

# All ranks write logs, metrics and reports into one run directory per job (shared filesystem).
export LABSUPPORT_RUN_DIR={run_dir_value}
mkdir -p "$LABSUPPORT_RUN_DIR"

# Network. NCCL (GPUs) and gloo (CPUs) choose a network interface themselves. If the run hangs
# at start-up, name the interface that connects the nodes (see `ip addr` on a compute node):
# export NCCL_SOCKET_IFNAME=hsn0    # Slingshot (Frontier, Polaris); ib0 for InfiniBand
# export GLOO_SOCKET_IFNAME=hsn0
# export NCCL_DEBUG=INFO            # NCCL then logs the interface and transport it picked

{_frontier_lines(ofi_plugin) if frontier else ""}{command_environment}{masters}\
# Which python the ranks will run: the one the environment above puts first on PATH.
echo "$(date): $NNODES node(s) x $GPUS_PER_NODE GPU(s), {meeting} at $HEAD_NODE:$PORT, run directory $LABSUPPORT_RUN_DIR," \\
    "python $(command -v {shlex.quote(python)} || echo {shlex.quote(python)} not found)"

{launch_why}
{torchrun_note}{_launch_lines(lines, rank_words)}
"""
    return head + "\n" + body


# ---------------------------------------------------------------- command line

def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `labsupport jobscript` (cli.py adds --json to every command itself)."""
    p.add_argument("--scheduler", required=True, choices=SCHEDULERS)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--account", default=None, help="project to charge (Slurm --account, PBS -A)")
    p.add_argument("--queue", default=None, help="Slurm partition or PBS queue")
    p.add_argument("--time", default="00:30:00", help="time limit, HH:MM:SS")
    p.add_argument("--job-name", default="labsupport")
    p.add_argument("--port", type=int, default=29500,
                   help="TCP port on the first node where the ranks meet; pick another if it is taken")
    p.add_argument("--cpus-per-gpu", type=int, default=DEFAULT_CPUS_PER_GPU)
    p.add_argument("--launcher", default="torchrun", choices=LAUNCHERS,
                   help="torchrun: one torchrun per node starts the ranks (default); "
                        "srun: Slurm starts one rank per GPU itself")
    p.add_argument("--frontier", action="store_true",
                   help="Slurm: add the network settings for RCCL on Frontier's Slingshot network")
    p.add_argument("--ofi-plugin", default=None, metavar="DIR",
                   help="with --frontier: the lib directory of the aws-ofi-rccl plugin, put on LD_LIBRARY_PATH")
    p.add_argument("--output", default=None, help="write the script here (default: print it)")
    # dest is not "command": cli.py keeps the subcommand's name there.
    p.add_argument("rank_command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="after --: what each rank runs, e.g. labsupport train --strategy ddp")
    return p


def run_cli(args) -> int:
    """`labsupport jobscript` with parsed arguments. ValueError for a user mistake (cli.py prints it)."""
    command = list(args.rank_command)
    if command[:1] == ["--"]:
        command = command[1:]
    script = render(args.scheduler, args.nodes, args.gpus_per_node, command, account=args.account,
                    time=args.time, job_name=args.job_name, port=args.port, queue=args.queue,
                    cpus_per_gpu=args.cpus_per_gpu, launcher=args.launcher, frontier=args.frontier,
                    ofi_plugin=args.ofi_plugin)
    submit = "sbatch" if args.scheduler == "slurm" else "qsub"
    if args.output:
        try:
            with open(args.output, "w", encoding="utf-8") as f:
                f.write(script)
            os.chmod(args.output, 0o755)
        except OSError as e:
            raise ValueError(f"cannot write {args.output}: {e.strerror}") from None
        print(f"wrote {args.output}; submit it with: {submit} {shlex.quote(args.output)}", file=sys.stderr)
    elif not args.json:
        sys.stdout.write(script)
    if args.json:
        print(json.dumps({"scheduler": args.scheduler, "path": args.output, "script": script}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labsupport jobscript",
                                description="Write a Slurm or PBS script that runs a command on N nodes x G GPUs.")
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="last stdout line is one JSON object")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_cli(args)
    except ValueError as e:
        print(f"labsupport jobscript: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
