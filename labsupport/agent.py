"""torchrun's agent (`torch.distributed.run`), ending the way a labsupport rank does.

`python -m labsupport.agent ARGS` is `python -m torch.distributed.run ARGS`: the same agent with the
same options, which starts, watches and stops the ranks. Three things differ.

Where it is safe (`runtime.forks`), it forks the ranks from itself instead of starting a fresh
interpreter for each: torchrun's own `--start-method fork --run-path rank.py` in place of
`-m labsupport.rank`. Importing torch costs ~2 s of CPU per process, more than a tiny model's whole run
on a laptop's two cores. A forked rank finds torch imported, and what every rank imports next, which the
agent imports once (`runtime.prepare_to_fork`, which also freezes the agent's objects before each fork).

Safe means Linux and a torch built without CUDA or ROCm: on a GPU node torchrun's own start-up
initializes CUDA in the agent (`torch.cuda.is_available()` in `LaunchConfig`, torch 2.13), and a rank
forked after that cannot use the GPU, so there every rank is a fresh interpreter, as under a plain torchrun.

Its store, when it serves on a loopback address (a single-node launch), listens on that address
only (`runtime.tcp_store`), where torch's static rendezvous would listen on every interface. And once
every rank succeeded it leaves without the interpreter's teardown of torch (`rank.leave_now`), half a
second of every launch; a failure exits the ordinary way, with torchrun's own report.

`python -m labsupport.agent accelerate ARGS` is `accelerate launch ARGS`: for an FSDP or DeepSpeed
config file on one machine, Accelerate puts the file's settings in the environment and runs the same
agent in this process (static rendezvous), so the last two differences hold there too.
"""
import sys

from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
from torch.distributed.run import main

from . import rank
from .runtime import forks, prepare_to_fork, tcp_store

RANK_MODULE = ["-m", "labsupport.rank"]  # how launch() names the rank wrapper to torchrun


def forking(argv: list[str]) -> list[str]:
    """`argv` with the rank wrapper run in ranks forked from this process, in place of `-m labsupport.rank`."""
    at = next((i for i in range(len(argv) - 1) if argv[i:i + 2] == RANK_MODULE), None)
    if at is None:
        return argv
    return [*argv[:at], "--start-method=fork", "--run-path", rank.__file__, *argv[at + 2:]]


def run_agent(argv: list[str]) -> None:
    """What `python -m labsupport.agent ARGV` does; the fork server calls it in each agent it forks."""
    static_tcp_rendezvous.TCPStore = tcp_store
    if argv[:1] == ["accelerate"]:  # `accelerate launch ARGS`: Accelerate's front, the same agent inside
        sys.argv = [sys.argv[0], *argv[1:]]
        from accelerate.commands.launch import main as accelerate_launch
        accelerate_launch()
    else:
        if forks() and forking(argv) != argv:
            argv = forking(argv)
            prepare_to_fork()
        main(argv)
    rank.leave_now([])


if __name__ == "__main__":
    run_agent(sys.argv[1:])
