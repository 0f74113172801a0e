"""A throwaway two-node Slurm cluster on this machine: `python -m labsupport.cluster up|down|status`.

The job scripts that `labsupport jobscript` writes are meant for `sbatch` at an HPC center. To run
them under a real Slurm here, this module starts one: munge (Slurm's authentication), slurmctld
(the controller) and two slurmd "compute nodes". Each node is a network namespace with its own
address, joined to the others by a bridge, and a UTS namespace with its own host name; the
cluster's name table is bind-mounted over /etc/hosts inside the node only. So a job sees what it
would see on a cluster: `$SLURM_JOB_NODELIST` of two host names, a first node the others reach by
name, srun starting tasks on both.

What differs from a GPU center, on purpose:
* no cgroups: processes are tracked by parent pid (`ProctrackType=proctrack/linuxproc`) and not
  bound to cores (`TaskPlugin=task/none`), so `--cpus-per-task` sets SLURM_CPUS_PER_TASK but no
  affinity; every node also runs on the same two cores.
* GPUs are stand-ins: each node declares `Gres=gpu:2` whose device files are copies of /dev/null
  (Slurm 22.05's gpu plugin ignores a GPU count without files), so `--gpus-per-node` is scheduled and
  `--gpu-bind=closest` gives each task its own CUDA_VISIBLE_DEVICES, but there is no GPU: the ranks
  run on CPU with gloo (`LABSUPPORT_DEVICE=cpu` in the job's environment is up to the caller).
* the nodes declare more cores than they have (`SlurmdParameters=config_overrides`), so the
  scripts' default of 7 cores per GPU fits; a rank still takes its threads from the cores it can
  really use (runtime.threads_per_rank).

Everything of one cluster lives in its directory (config, state, logs, munge key and socket) and
its names carry a tag (the pid that started it), so two clusters never collide. `down` (and the
`running()` context manager, on any exit) cancels the jobs, kills every process in the nodes'
namespaces and the daemons, and removes namespaces, interfaces and mounts.

Needs root, iproute2, util-linux and Debian's slurmctld, slurmd, slurm-client and munge (`make slurm`).
"""
from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .launch import alive, descendants, free_port, kill_pids

# Where `make cluster` keeps the instructor's cluster; notebooks look for one there.
DEFAULT_DIR = Path("/tmp/labsupport-cluster")
NODES = 2
PARTITION = "debug"
GPUS_PER_NODE = 2   # a count for the scheduler only: there are no devices behind it
CPUS_PER_NODE = 16  # declared, not real: enough for the scripts' 7 cores per GPU
ACTIVE = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED")  # job states before the end
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "ip", "unshare", "nsenter")
# Inside a node: its own /etc/hosts (private to the node's mount namespace) and host name, then the daemon.
NODE_SETUP = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


class ClusterError(RuntimeError):
    """The cluster cannot start here; the message says why in one line."""


def missing() -> str | None:
    """Why no cluster can start on this machine (one line), or None."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (network namespaces, daemons)"
    absent = [tool for tool in TOOLS if shutil.which(tool) is None]
    if absent:
        return (f"Slurm is not installed here ({', '.join(absent)} missing): `make slurm` installs it "
                "(apt-get install slurmctld slurmd slurm-client munge)")
    return None


def _run(*cmd, check=True) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    if check and res.returncode != 0:
        raise ClusterError(f"{' '.join(map(str, cmd))}: {res.stderr.strip() or res.stdout.strip()}")
    return res


def _free_subnet(tag: int) -> str:
    """A /24 of 10.124.x.0 that no interface on this machine uses yet."""
    used = _run("ip", "-o", "-4", "addr").stdout
    for i in range(250):
        subnet = f"10.124.{(tag + i) % 250 + 1}"
        if f" {subnet}." not in used:
            return subnet
    raise ClusterError("no free 10.124.x.0/24 subnet for the cluster's bridge")


class Cluster:
    """One cluster's names, addresses and files; `up()` starts it, `down()` removes all of it."""

    def __init__(self, directory: Path, tag: int, subnet: str, port: int, pids: dict | None = None):
        self.dir, self.tag, self.subnet, self.port = Path(directory), tag, subnet, port
        self.pids = pids or {}  # daemon name -> pid
        self.conf = self.dir / "slurm.conf"
        self.bridge = f"lsbr{tag}"
        self.nodes = [{"name": f"ls{tag}-n{i}", "ns": f"ls{tag}-n{i}", "veth": f"ls{tag}n{i}",
                       "addr": f"{subnet}.{i}"} for i in range(1, NODES + 1)]

    @property
    def env(self) -> dict:
        """The environment for Slurm's commands (sbatch, squeue, ...) to talk to this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def command(self, *cmd, check=True) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster, e.g. `command("sinfo")`."""
        res = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=self.env)
        if check and res.returncode != 0:
            raise ClusterError(f"{' '.join(map(str, cmd))}: {res.stderr.strip()}")
        return res

    # ------------------------------------------------------------ files

    def _write_files(self) -> None:
        d = self.dir
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        (d / "plugstack.conf").write_text("")  # no SPANK plugins, whatever /etc/slurm holds
        (d / "hosts").write_text("127.0.0.1 localhost\n" + f"{self.subnet}.254 {socket.gethostname()}\n" +
                                 "".join(f"{n['addr']} {n['name']}\n" for n in self.nodes))
        # Slurm's gpu plugin counts device files, and ignores a count without them: stand-ins, each
        # the character device /dev/null is (1, 3), so nothing can be done with them.
        for i in range(GPUS_PER_NODE):
            os.mknod(d / f"gpu{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))
        (d / "gres.conf").write_text("".join(f"NodeName={n['name']} Name=gpu File={d}/gpu[0-{GPUS_PER_NODE - 1}]\n"
                                             for n in self.nodes))
        nodes = "".join(f"NodeName={n['name']} NodeHostname={n['name']} NodeAddr={n['addr']} "
                        f"CPUs={CPUS_PER_NODE} Gres=gpu:{GPUS_PER_NODE} State=UNKNOWN\n" for n in self.nodes)
        self.conf.write_text(f"""\
# Written by labsupport.cluster: a throwaway two-node cluster (see the module's docstring).
ClusterName=ls{self.tag}
SlurmctldHost={socket.gethostname()}({self.subnet}.254)
SlurmctldPort={self.port}
SlurmdPort=6818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={d / 'munge.socket'}
CredType=cred/munge
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'spool'}/slurmd-%n.pid
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log'}/slurmd-%n.log
PlugStackConfig={d / 'plugstack.conf'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
GresTypes=gpu
ReturnToService=2
# A cancelled task gets SIGTERM, then SIGKILL after KillWait seconds (centers: 30).
KillWait=5
MinJobAge=300
# Refuse at submission a job the partition can never run (more nodes than it has), as centers do;
# Slurm's default queues it, pending for ever.
EnforcePartLimits=ALL
{nodes}PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    # ------------------------------------------------------------ start and stop

    def _daemon(self, name: str, cmd: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "w")
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # outlives `python -m labsupport.cluster up`
        log.close()
        self.pids[name] = proc.pid
        self._save()

    def _save(self) -> None:
        state = {"tag": self.tag, "subnet": self.subnet, "port": self.port, "pids": self.pids}
        (self.dir / "cluster.json").write_text(json.dumps(state))

    def _network(self) -> None:
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        for n in self.nodes:
            _run("ip", "netns", "add", n["ns"])
            _run("ip", "link", "add", n["veth"], "type", "veth", "peer", "name", "eth0", "netns", n["ns"])
            _run("ip", "link", "set", n["veth"], "master", self.bridge, "up")
            _run("ip", "-n", n["ns"], "addr", "add", f"{n['addr']}/24", "dev", "eth0")
            _run("ip", "-n", n["ns"], "link", "set", "eth0", "up")
            _run("ip", "-n", n["ns"], "link", "set", "lo", "up")

    def up(self, timeout_s: float = 30.0) -> "Cluster":
        """Start munge, slurmctld and the nodes; return once every node is idle (ClusterError if not)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self._save()  # first, so that `down` finds what a failed start left
        self._write_files()
        self._network()
        d = self.dir
        self._daemon("munged", ["munged", "--foreground", "--force", f"--socket={d / 'munge.socket'}",
                                f"--key-file={d / 'munge.key'}", f"--pid-file={d / 'munged.pid'}",
                                f"--log-file={d / 'log' / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"])
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for n in self.nodes:
            (d / "spool" / n["name"]).mkdir()
            # nsenter, not `ip netns exec`: that remounts /sys, and slurmd wants the host's /sys/fs/cgroup.
            self._daemon(n["name"], ["nsenter", f"--net=/run/netns/{n['ns']}", "unshare", "--mount", "--uts",
                                     "sh", "-c", NODE_SETUP,
                                     "node", str(d / "hosts"), n["name"], "slurmd", "-D", "-N", n["name"],
                                     "-f", str(self.conf)])
        deadline = time.monotonic() + timeout_s
        while True:
            res = self.command("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
            if len(states) == NODES and all(s == "idle" for s in states.values()):
                return self
            dead = [name for name, pid in self.pids.items() if not alive(pid)]
            bad = {name: s for name, s in states.items() if s.startswith(("inval", "drain", "down"))}
            if dead or bad or time.monotonic() > deadline:
                why = (f"{', '.join(dead)} exited" if dead else f"nodes {bad}: see `scontrol show node`" if bad
                       else f"nodes not idle after {timeout_s:.0f} s: {states}")
                raise ClusterError(f"the cluster did not start ({why}); logs in {d / 'log'}")
            time.sleep(0.2)

    def down(self) -> None:
        """Cancel every job, kill everything on the nodes and the daemons, remove the network. Idempotent."""
        if self.pids.get("slurmctld") and alive(self.pids["slurmctld"]):
            self.command("scancel", "--full", f"--partition={PARTITION}", check=False)
        pids = []
        for n in self.nodes:  # everything that ever ran on a node lives in its network namespace
            res = _run("ip", "netns", "pids", n["ns"], check=False)
            pids += [int(p) for p in res.stdout.split()]
        for pid in self.pids.values():
            if alive(pid) and _ours(pid, self.dir, self.tag):
                pids += [pid, *descendants(pid)]
        kill_pids(sorted(set(pids)), grace_s=2.0, reap=_reap)
        for n in self.nodes:
            _run("ip", "netns", "del", n["ns"], check=False)  # takes the veth pairs with it
            _run("ip", "link", "del", n["veth"], check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        self.pids = {}
        if self.dir.exists():
            self._save()

    def submit(self, script: Path, *options: str, env: dict | None = None) -> str:
        """`sbatch [OPTIONS] SCRIPT` from the script's directory; the job's id. ClusterError with
        sbatch's own message if Slurm refuses the job."""
        res = subprocess.run(["sbatch", "--parsable", *options, Path(script).name], cwd=Path(script).parent,
                             capture_output=True, text=True, env={**(env or os.environ), "SLURM_CONF": str(self.conf)})
        if res.returncode != 0:
            raise ClusterError(res.stderr.strip())
        return res.stdout.strip().split(";")[0]

    def state(self, job_id: str) -> tuple[str, str]:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...) and exit code ("0:0")."""
        fields = dict(word.split("=", 1) for word in self.command("scontrol", "-o", "show", "job", job_id)
                      .stdout.split() if "=" in word)
        return fields["JobState"], fields["ExitCode"]

    def wait(self, job_id: str, log: Path | None = None, out=None, timeout_s: float = 120.0,
             shown_as: dict | None = None) -> tuple[str, str]:
        """Wait for the job to end, writing its `log` to `out` (a file, e.g. sys.stdout) line by line as it
        grows, each path in `shown_as` written as its short name (a notebook stores no absolute path);
        returns `state()`'s answer. On timeout, cancels the job and raises ClusterError."""
        deadline, shown = time.monotonic() + timeout_s, 0
        while True:
            state, exit_code = self.state(job_id)
            if out is not None and log is not None and Path(log).exists():
                text = Path(log).read_text(errors="replace")
                end = len(text) if state not in ACTIVE else text.rfind("\n") + 1  # whole lines until the end
                new = text[shown:end]
                for path, name in (shown_as or {}).items():
                    new = new.replace(str(path), name)
                out.write(new)
                out.flush()
                shown = max(shown, end)
            if state not in ACTIVE:  # read after the job ended: the log is complete
                return state, exit_code
            if time.monotonic() > deadline:
                self.command("scancel", job_id, check=False)
                raise ClusterError(f"job {job_id} still {state} after {timeout_s:.0f} s; cancelled it")
            time.sleep(0.2)

    def status(self) -> str:
        """sinfo's view of the nodes, and the queue."""
        return (self.command("sinfo", "-N", "-o", "%N %t %c %G").stdout +
                self.command("squeue", "-o", "%i %j %T %D %R").stdout)


def _ours(pid: int, directory: Path, tag: int) -> bool:
    """Whether `pid` is still one of this cluster's daemons (and not a pid reused since)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(directory) in cmdline or f"ls{tag}-" in cmdline


def _reap() -> None:
    """Collect our own exited daemons, so that they do not linger as zombies."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def load(directory: Path = DEFAULT_DIR) -> Cluster | None:
    """The cluster whose files are in `directory`, or None if none was started there."""
    try:
        state = json.loads((Path(directory) / "cluster.json").read_text())
    except (OSError, ValueError):
        return None
    return Cluster(directory, state["tag"], state["subnet"], state["port"], state["pids"])


def start(directory: Path) -> Cluster:
    """A new cluster in `directory` (removed first), tagged with this process's pid."""
    why = missing()
    if why:
        raise ClusterError(why)
    shutil.rmtree(directory, ignore_errors=True)
    tag = os.getpid()
    cluster = Cluster(directory, tag, _free_subnet(tag), free_port())
    try:
        return cluster.up()
    except BaseException:
        cluster.down()
        raise


@contextlib.contextmanager
def running(directory: Path):
    """A cluster for the duration of a `with` block; torn down on any exit, and at interpreter exit
    should the block never end (an interrupted test session)."""
    cluster = start(Path(directory))
    atexit.register(cluster.down)
    try:
        yield cluster
    finally:
        cluster.down()
        atexit.unregister(cluster.down)


@contextlib.contextmanager
def available(directory: Path = DEFAULT_DIR):
    """The cluster `make cluster` started in `directory` while it is up, else one for the `with` block."""
    cluster = load(directory)
    if cluster is not None and cluster.pids and all(alive(pid) for pid in cluster.pids.values()):
        yield cluster
        return
    with tempfile.TemporaryDirectory(prefix="labsupport-cluster-") as tmp, running(Path(tmp)) as cluster:
        yield cluster


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m labsupport.cluster",
                                description="A throwaway two-node Slurm cluster on this machine (needs root).")
    p.add_argument("action", choices=("up", "down", "status"))
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"the cluster's files (default {DEFAULT_DIR})")
    args = p.parse_args(argv)
    old = load(args.dir)
    try:
        if args.action == "up":
            if old is not None:
                old.down()
            t0 = time.monotonic()
            cluster = start(args.dir)
            nodes = ", ".join(f"{n['name']} ({n['addr']})" for n in cluster.nodes)
            print(f"cluster up in {time.monotonic() - t0:.1f} s: nodes {nodes}, controller port {cluster.port}\n"
                  f"submit to it from this machine, in a shell with the venv activated (sbatch passes it on):\n"
                  f"  export SLURM_CONF={cluster.conf} LABSUPPORT_DEVICE=cpu\n"
                  f"  labsupport jobscript --scheduler slurm --nodes 2 --gpus-per-node 2 --cpus-per-gpu 1 "
                  f"--output job.sh -- labsupport train --strategy ddp --model nano --steps 5\n"
                  f"  sbatch job.sh && squeue\n"
                  f"stop it with: python -m labsupport.cluster down")
        elif old is None:
            print(f"no cluster in {args.dir}" + ("" if args.action == "down" else "; start one with `up`"))
            return 0 if args.action == "down" else 1
        elif args.action == "down":
            old.down()
            shutil.rmtree(args.dir, ignore_errors=True)
            print(f"cluster in {args.dir} is down")
        else:
            print(old.status(), end="")
    except ClusterError as e:
        print(f"labsupport.cluster: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
