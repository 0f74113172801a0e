"""torchrun's agent (`torch.distributed.run`), ending the way a labsupport rank does.

`python -m labsupport.agent ARGS` is `python -m torch.distributed.run ARGS`: the same agent with the
same options, which starts, watches and stops the ranks. Three things differ. It imports once what
every rank would import (what `runtime.init` imports before the group forms, and torch._dynamo, which
the first optimizer imports: ~1.5 s of CPU together): `launch()` has it fork the ranks, which then find
it imported. Its store, when it serves
on a loopback address (a single-node launch), listens on that address only (`runtime.tcp_store`),
where torch's static rendezvous would listen on every interface. And once every rank succeeded it
leaves without the interpreter's teardown of torch (`rank.leave_now`), half a second of every
launch; a failure exits the ordinary way, with torchrun's own report.

`python -m labsupport.agent accelerate ARGS` is `accelerate launch ARGS`: for an FSDP or DeepSpeed
config file on one machine, Accelerate puts the file's settings in the environment and runs the same
agent in this process (static rendezvous), so both differences hold there too.
"""
import importlib
import sys

from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
from torch.distributed.run import main

from .rank import leave_now
from .runtime import import_before_the_group, tcp_store

if __name__ == "__main__":
    static_tcp_rendezvous.TCPStore = tcp_store
    if sys.argv[1:2] == ["accelerate"]:  # `accelerate launch ARGS`: Accelerate's front, the same agent inside
        del sys.argv[1]
        from accelerate.commands.launch import main as accelerate_launch
        accelerate_launch()
    else:
        import_before_the_group()
        importlib.import_module("torch._dynamo")
        main()
    leave_now([])
