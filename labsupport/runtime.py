"""One rank's life: who am I, which device, which backend, seeded, logged, torn down.

A rank learns its identity from environment variables that its launcher sets. torchrun sets
RANK/WORLD_SIZE/LOCAL_RANK; Slurm's srun sets SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID;
MPI-style launchers (PBS with mpiexec, Cray PALS, Open MPI, MPICH/Hydra) set their own.
`init()` reads whichever is present, so one training script runs under all of them, and as
a plain `python script.py` with world size 1 and no process group at all.
"""
from __future__ import annotations

import datetime
import gc
import importlib
import ipaddress
import os
import random
import socket
import sys
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

# (rank, world size, local rank, local world size) variable names, most specific first.
LAUNCHER_ENVS = {
    "torchrun": ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
    "slurm": ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"),
    "openmpi": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "pals": ("PALS_RANKID", "PALS_SIZE", "PALS_LOCAL_RANKID", "PALS_LOCAL_SIZE"),
    "pmi": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}


# What a rank must import before its process group exists, see _destroy_world below: these modules'
# functions take `group=group.WORLD` as a default argument, evaluated once at import. torch imports
# them lazily (the first optimizer imports torch._dynamo, which imports FSDP, which imports
# torch.distributed.nn.functional): after init_process_group, that would pin the world group for good.
# torch.distributed.optim (ZeroRedundancyOptimizer, for torch-zero1) does the same.
BEFORE_THE_GROUP = ("torch.distributed.nn.functional", "torch.distributed.optim")


def import_before_the_group() -> None:
    """Import BEFORE_THE_GROUP (~0.5 s of CPU, more alone). A process that forks ranks does it once
    (prepare_to_fork), so that a forked rank finds them imported."""
    for name in BEFORE_THE_GROUP:
        importlib.import_module(name)


def forks() -> bool:
    """Whether this process may fork ranks instead of starting fresh interpreters: Linux, and a torch built
    without CUDA or ROCm. A GPU build may have initialized CUDA here already (torchrun's agent does, in
    `LaunchConfig`, torch 2.13), and a process forked after that cannot use the GPU."""
    return sys.platform == "linux" and not torch.backends.cuda.is_built() and torch.version.hip is None


def prepare_to_fork() -> None:
    """Before forking ranks (torchrun's agent, labsupport.agent; the pool's engines, labsupport.pool):
    import once what every rank imports next (import_before_the_group, and torch._dynamo, which the first
    optimizer imports: ~1.5 s of CPU per rank), and freeze this process's objects right before each fork
    (`gc.freeze()`, as Python's documentation advises), so that a rank's collections never walk, nor
    copy, the pages it inherited."""
    import_before_the_group()
    importlib.import_module("torch._dynamo")
    os.register_at_fork(before=gc.freeze)


@dataclass
class RankInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "none"


def detect(env=None) -> RankInfo:
    """Read rank/world size from whichever launcher's variables are set."""
    env = os.environ if env is None else env
    for launcher, (r, w, lr, lw) in LAUNCHER_ENVS.items():
        if r in env and w in env:
            world = int(env[w])
            local_world = env.get(lw, "")
            # Slurm writes e.g. "4(x2)" for tasks per node; the leading number is ours.
            local_world = int(local_world.split("(")[0]) if local_world else min(world, cpu_count())
            return RankInfo(int(env[r]), world, int(env.get(lr, 0)), local_world, launcher)
    return RankInfo()


def cpu_count() -> int:
    """The cores this process's ranks may use: LABSUPPORT_CPUS where the machine is shared with
    other work that this process cannot see (a JupyterHub node, the test suite's workers), else
    the cores it may run on."""
    given = os.environ.get("LABSUPPORT_CPUS", "")
    if given.isdigit() and int(given) > 0:
        return int(given)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def recommended_nproc() -> int:
    """One rank per GPU; on CPU, no more ranks than cores (and at least 2 to see communication)."""
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(2, min(cpu_count(), 8))


def pick_device(local_rank: int, local_world_size: int) -> tuple[torch.device, str]:
    """This rank's device and backend: its own GPU + nccl when it can have one, else cpu + gloo.

    A rank sees either all of the node's GPUs (torchrun, or srun without binding) and takes
    the one at its local rank, or exactly one GPU because the launcher bound it
    (`srun --gpus-per-node=8 --gpu-bind=closest` sets CUDA/ROCR_VISIBLE_DEVICES per task),
    and then that GPU is cuda:0. GPUs that cannot be shared out one per rank are an error,
    not a silent run on CPU. LABSUPPORT_DEVICE=cpu forces cpu + gloo.
    """
    cpu = torch.device("cpu"), "gloo"
    if os.environ.get("LABSUPPORT_DEVICE") == "cpu" or not torch.cuda.is_available():
        return cpu
    count = torch.cuda.device_count()
    if count == 0:
        return cpu
    if count == 1:  # bound to this rank by the launcher (or a one-GPU machine: run one rank)
        return torch.device("cuda", 0), "nccl"
    if count >= local_world_size:
        return torch.device("cuda", local_rank), "nccl"
    raise RuntimeError(
        f"this rank sees {count} GPUs but there are {local_world_size} ranks on this node, so they "
        f"cannot have one GPU each: start one rank per GPU (--nproc {count} / --ntasks-per-node={count}), "
        "bind one GPU per rank (srun --gpu-bind=closest, or CUDA_VISIBLE_DEVICES), "
        "or set LABSUPPORT_DEVICE=cpu to run on CPU with gloo")


def threads_per_rank(local_world_size: int, launcher: str = "torchrun") -> int:
    """Threads for one rank: the cores of the machine split between its ranks, so they don't
    oversubscribe it; or, for a rank that srun started as its own task (`--cpus-per-task=C`), the C
    cores Slurm already set aside for it."""
    given = os.environ.get("SLURM_CPUS_PER_TASK", "")
    if launcher == "slurm" and given.isdigit():
        return max(1, min(int(given), cpu_count()))
    return max(1, cpu_count() // max(1, local_world_size))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)  # seeds CUDA too
    try:
        import numpy as np
        np.random.seed(seed)
    except ImportError:
        pass


class Runtime:
    """Context manager for one rank: `with init(seed=0) as rt: ...`.

    On enter the process group exists (when world size > 1), the device is chosen, threads
    are set and RNGs seeded; on a clean exit the ranks meet at a barrier and the group is
    destroyed, its threads with it (see _destroy_world).
    """

    def __init__(self, seed: int = 0, backend: str | None = None, timeout_s: float = 300,
                 print_ranks: str = "0", listener: socket.socket | None = None):
        self.info = detect()
        # rank 0's store socket, already listening on MASTER_PORT: whoever picked the port kept it bound
        # (the pool binds port 0 on rank 0 before publishing it), so no other process can take it
        self.listener = listener
        self.device, default_backend = pick_device(self.info.local_rank, self.info.local_world_size)
        self.backend = backend or default_backend
        self.seed = seed
        self.timeout_s = timeout_s
        self.print_ranks = print_ranks

    # identity, spelled as in torch.distributed
    rank = property(lambda self: self.info.rank)
    world_size = property(lambda self: self.info.world_size)
    local_rank = property(lambda self: self.info.local_rank)
    distributed = property(lambda self: self.info.world_size > 1)

    def __enter__(self):
        if self.distributed and not dist.is_initialized() and "MASTER_ADDR" not in os.environ:
            raise RuntimeError(
                f"world size is {self.world_size} ({self.info.launcher}) but MASTER_ADDR is not set: "
                "launch through torchrun or a labsupport job script")
        if self.info.launcher in ("slurm", "openmpi", "pals", "pmi"):
            # torch.distributed's env:// rendezvous reads the torchrun names; translate.
            os.environ.setdefault("RANK", str(self.info.rank))
            os.environ.setdefault("WORLD_SIZE", str(self.info.world_size))
            os.environ.setdefault("LOCAL_RANK", str(self.info.local_rank))
        torch.set_num_threads(threads_per_rank(self.info.local_world_size, self.info.launcher))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        if self.distributed and not dist.is_initialized():
            kwargs = {"device_id": self.device} if self.device.type == "cuda" else {}
            if is_loopback(os.environ["MASTER_ADDR"]):
                kwargs["store"] = _stay_on_loopback(self.rank, self.world_size, self.timeout_s, self.listener)
            import_before_the_group()
            dist.init_process_group(self.backend, rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=self.timeout_s), **kwargs)
        seed_everything(self.seed)
        _say_up(self.rank)
        return self

    def __exit__(self, exc_type, exc, tb):
        # On an error, keep the group open: closing it would make the healthy ranks fail with
        # "connection reset" before this rank's own error is recorded. Process exit closes it.
        if dist.is_initialized() and exc_type is None:
            _destroy_world()
        return False

    def print(self, *args, ranks: str | None = None, **kwargs):
        """print() on rank 0 only (the default), or on every rank with `ranks="all"`."""
        ranks = ranks or self.print_ranks
        if ranks == "all" or str(self.rank) in ranks.split(","):
            kwargs.setdefault("flush", True)
            print(*args, **kwargs)

    def describe(self) -> str:
        return (f"rank {self.rank}/{self.world_size} (local {self.local_rank}) via {self.info.launcher}, "
                f"{self.device} + {self.backend if self.distributed else 'no process group'}, "
                f"{torch.get_num_threads()} threads")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback: a single-node run."""
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def tcp_store(host: str, port: int, world_size: int | None = None, is_master: bool = False,
              timeout: datetime.timedelta = datetime.timedelta(seconds=300), **kwargs) -> dist.TCPStore:
    """torch's TCPStore, except that a server on a loopback `host` listens on that address only.

    torch's server listens on every interface whatever `host` says, so a single-node run's store,
    which takes any key from anyone, would be open to the network (a laptop on a shared Wi-Fi, a
    shared login node). Handing it a socket already bound to `host` keeps it on this machine
    (`master_listen_fd`: one the caller bound, else one bound here).
    """
    if is_master and is_loopback(host) and "master_listen_fd" not in kwargs:
        kwargs["master_listen_fd"] = socket.create_server((host, port)).detach()
    return dist.TCPStore(host, port, world_size, is_master, timeout, **kwargs)


def _stay_on_loopback(rank: int, world_size: int, timeout_s: float,
                      listener: socket.socket | None = None) -> dist.TCPStore | None:
    """For a single-node group: gloo and NCCL open their sockets on the loopback interface (unless
    the user chose one), and rank 0 serves the store on loopback (on `listener` if given), unless
    torchrun's agent serves it (then None: torch connects to the agent's).
    """
    names = [name for _, name in socket.if_nameindex() if name.startswith("lo")]  # lo, or lo0 on macOS
    if names:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", names[0])
        os.environ.setdefault("NCCL_SOCKET_IFNAME", names[0])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    given = {"master_listen_fd": listener.detach()} if listener is not None and rank == 0 else {}
    return tcp_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, rank == 0,
                     datetime.timedelta(seconds=timeout_s), **given)


# True in a rank of this package's own entry points (rank.py sets it): they end with os._exit
# (rank.leave_now), so a group that outlives destroy_process_group() never meets the interpreter's
# teardown there. DeepSpeed's ZeRO keeps the group on every parameter it partitions.
LEAVES_WITHOUT_TEARDOWN = False


def _destroy_world() -> None:
    """Destroy the process group so that its backend's threads are really gone before exit.

    gloo runs collectives on worker threads that belong to the group object. A finished
    async Work can still be freed on such a thread (a later barrier keeps weak references
    to it), and freeing it needs the GIL: it holds Python objects (its tensors, the context
    captured during backward). While the interpreter runs, that is harmless; during
    interpreter shutdown, the thread is killed inside that destructor and the process aborts
    with "terminate called without an active exception", after the work succeeded.
    destroy_process_group() stops the threads only if it drops the last reference to the
    group. Anything still holding the group keeps them alive into shutdown: the functions
    of torch.distributed.nn.functional (imported in __enter__ for that reason),
    ZeroRedundancyOptimizer's and ShardedGradScaler's defaults if a script imports them
    inside the block, or user code. Once the threads are gone, Work objects the script still
    holds are freed later by the main thread, which may take the GIL even during shutdown.
    labsupport.comm leaves no such work to the threads in the first place (a call, or an async
    call's wait(), returns once its gloo work is freed), which is what keeps a user's script that
    exits without this function, with the group's threads still running, from aborting.
    """
    dist.barrier()  # no rank tears down while a peer still needs it; all work has finished
    world = weakref.ref(dist.group.WORLD)
    dist.destroy_process_group()
    if world() is not None:
        gc.collect()  # a reference cycle (a traceback, a closure) may be what holds it
    if world() is not None and not LEAVES_WITHOUT_TEARDOWN:
        warnings.warn("the process group is still referenced after destroy_process_group(), so its "
                      "threads live until exit and may abort it; import modules that take "
                      "group=group.WORLD as a default before labsupport.init()", RuntimeWarning)


def _say_up(rank: int) -> None:
    """Tell the launcher that this rank is up (torch imported, the group formed): its timeout counts
    from the moment every rank has said so (launch.STARTUP_TIMEOUT_S)."""
    run_dir = os.environ.get("LABSUPPORT_RUN_DIR")
    if run_dir and os.environ.get("LABSUPPORT_SAY_UP") == "1":
        open(os.path.join(run_dir, f"up-rank{rank}"), "w").close()


def init(seed: int = 0, **kwargs) -> Runtime:
    """Start this rank: `with labsupport.runtime.init(seed=0) as rt:`."""
    return Runtime(seed=seed, **kwargs)


def report(**values) -> None:
    """Send values to the launcher: one JSON line in the run directory, read back by RunResult.

    Outside a labsupport launch (no LABSUPPORT_RUN_DIR), values are printed instead.
    """
    import json
    run_dir = os.environ.get("LABSUPPORT_RUN_DIR")
    rank = detect().rank
    if not run_dir:
        print(f"report (rank {rank}):", json.dumps(values), file=sys.stderr)
        return
    with open(os.path.join(run_dir, f"report-rank{rank}.jsonl"), "a", encoding="utf-8") as f:
        f.write(json.dumps(values) + "\n")
