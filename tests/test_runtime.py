"""runtime: identity from every launcher's variables, device choice, threads; and the house rules."""
import ast
import os
import socket
from pathlib import Path

import pytest
import torch

from labsupport import runtime

PKG = Path(runtime.__file__).parent


@pytest.mark.parametrize("env, expected", [
    ({}, (0, 1, 0, "none")),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (3, 8, 1, "torchrun")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x4)"},
     (5, 16, 1, "slurm")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}, (2, 4, 0, "openmpi")),
    ({"PALS_RANKID": "7", "PALS_SIZE": "8", "PALS_LOCAL_RANKID": "3", "PALS_LOCAL_SIZE": "4"}, (7, 8, 3, "pals")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, (1, 2, 1, "pmi")),
])
def test_rank_identity_from_each_launcher(env, expected):
    info = runtime.detect(env)
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == expected


def test_slurm_tasks_per_node_with_repeat_count():
    assert runtime.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_NTASKS_PER_NODE": "4(x2)"}).local_world_size == 4


def _gpus(monkeypatch, count):
    """Pretend this process sees `count` GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.delenv("LABSUPPORT_DEVICE", raising=False)


def test_cpu_gets_gloo_and_threads_are_split(monkeypatch):
    _gpus(monkeypatch, 0)
    assert runtime.pick_device(0, 2) == (torch.device("cpu"), "gloo")
    monkeypatch.setattr(runtime, "cpu_count", lambda: 8)
    assert runtime.threads_per_rank(4) == 2 and runtime.threads_per_rank(16) == 1


def test_labsupport_cpus_is_the_share_of_a_shared_machine(monkeypatch):
    """On a node shared with work the process cannot see (a JupyterHub, the test suite's other
    worker), LABSUPPORT_CPUS says how many cores its ranks split; without it, the cores it may use."""
    monkeypatch.setenv("LABSUPPORT_CPUS", "1")
    assert runtime.cpu_count() == 1 and runtime.threads_per_rank(1) == 1
    monkeypatch.setenv("LABSUPPORT_CPUS", "6")
    assert runtime.threads_per_rank(2) == 3
    monkeypatch.delenv("LABSUPPORT_CPUS")
    assert runtime.cpu_count() == len(os.sched_getaffinity(0))


def test_a_rank_srun_started_with_its_own_cores_uses_them(monkeypatch):
    """Frontier's launch: srun --ntasks-per-node=8 --cpus-per-task=7 gives each rank 7 cores of 56;
    under torchrun on the same node (one task of 56 cores, 8 ranks) the 56 are split."""
    monkeypatch.setattr(runtime, "cpu_count", lambda: 7)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "7")
    assert runtime.threads_per_rank(8, launcher="slurm") == 7
    monkeypatch.setattr(runtime, "cpu_count", lambda: 56)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "56")
    assert runtime.threads_per_rank(8, launcher="torchrun") == 7


def test_cuda_available_but_no_device_is_cpu(monkeypatch):
    _gpus(monkeypatch, 0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert runtime.pick_device(0, 1) == (torch.device("cpu"), "gloo")


def test_every_local_rank_gets_its_own_gpu(monkeypatch):
    _gpus(monkeypatch, 8)
    assert runtime.pick_device(3, 8) == (torch.device("cuda", 3), "nccl")
    assert runtime.pick_device(1, 2) == (torch.device("cuda", 1), "nccl")  # more GPUs than ranks
    assert runtime.pick_device(0, 1) == (torch.device("cuda", 0), "nccl")  # what doctor asks


@pytest.mark.parametrize("local_rank, local_world_size", [(0, 1), (5, 8), (7, 8)])
def test_a_rank_bound_to_one_gpu_uses_it(monkeypatch, local_rank, local_world_size):
    # srun --ntasks-per-node=8 --gpus-per-node=8 --gpu-bind=closest: each task sees one GPU
    _gpus(monkeypatch, 1)
    assert runtime.pick_device(local_rank, local_world_size) == (torch.device("cuda", 0), "nccl")


def test_gpus_that_cannot_go_one_per_rank_are_an_error(monkeypatch):
    _gpus(monkeypatch, 2)
    with pytest.raises(RuntimeError) as e:
        runtime.pick_device(3, 4)
    msg = str(e.value)
    assert "\n" not in msg and "2 GPUs" in msg and "4 ranks" in msg
    assert "--nproc 2" in msg and "--ntasks-per-node=2" in msg and "LABSUPPORT_DEVICE=cpu" in msg


@pytest.mark.parametrize("count", [0, 1, 2, 8])
def test_labsupport_device_cpu_forces_cpu(monkeypatch, count):
    _gpus(monkeypatch, count)
    monkeypatch.setenv("LABSUPPORT_DEVICE", "cpu")
    assert runtime.pick_device(0, 4) == (torch.device("cpu"), "gloo")


def test_single_process_needs_no_process_group():
    with runtime.init(seed=7) as rt:
        assert rt.world_size == 1 and not rt.distributed and not torch.distributed.is_initialized()
        a = torch.rand(3)
    with runtime.init(seed=7):
        assert torch.equal(a, torch.rand(3))  # seeded


def test_rank_0s_store_serves_on_the_socket_that_chose_its_port():
    """The pool's rank 0 binds port 0 and publishes the port it got (pool.py); its store takes that socket
    over (`master_listen_fd`), so between choosing the port and serving on it nothing else can take it
    (a port chosen by free_port() and bound later was lost under load)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with pytest.raises(OSError):  # held from the moment it was chosen
        socket.create_server(("127.0.0.1", port)).close()
    store = runtime.tcp_store("127.0.0.1", port, 2, True, master_listen_fd=listener.detach(), wait_for_workers=False)
    store.set("published", "yes")
    assert store.port == port
    assert torch.distributed.TCPStore("127.0.0.1", port, 2, False).get("published") == b"yes"


def test_world_size_without_rendezvous_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RuntimeError, match="MASTER_ADDR is not set"):
        with runtime.init():
            pass
    # refused before it touched anything: no torchrun variables left behind for later code to find
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK"} & set(os.environ)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("folder", ["estimate", "widgets"])
def test_estimate_and_widgets_never_import_torch_distributed(folder):
    for path in (PKG / folder).glob("*.py"):
        assert not any(n.startswith("torch.distributed") for n in _imports(path)), path


# torch's own implementations that the reference strategies wrap; never its collectives.
TORCH_REFERENCES = {"torch.distributed.optim", "torch.distributed.fsdp", "torch.distributed.fsdp.wrap",
                    "torch.distributed.device_mesh", "torch.distributed.tensor", "torch.distributed.tensor.parallel",
                    "torch.distributed.pipelining"}


def test_parallel_strategies_communicate_only_through_comm():
    for path in (PKG / "parallel").glob("*.py"):
        source = path.read_text()
        allowed = TORCH_REFERENCES if path.name.startswith(("torch_", "accelerate_")) else set()
        assert not any(n.startswith("torch.distributed") and n not in allowed for n in _imports(path)), path
        assert "dist." not in source and "print(" not in source and "argparse" not in source, path
