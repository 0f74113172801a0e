"""torchrun's agent (`torch.distributed.run`), ending the way a labsupport rank does.

`python -m labsupport.agent ARGS` is `python -m torch.distributed.run ARGS`: the same agent with the
same options, which starts, watches and stops the ranks. Two things differ. Its store, when it serves
on a loopback address (a single-node launch), listens on that address only (`runtime.tcp_store`),
where torch's static rendezvous would listen on every interface. And once every rank succeeded it
leaves without the interpreter's teardown of torch (`rank.leave_now`), half a second of every
launch; a failure exits the ordinary way, with torchrun's own report.
"""
from torch.distributed.elastic.rendezvous import static_tcp_rendezvous
from torch.distributed.run import main

from .rank import leave_now
from .runtime import tcp_store

if __name__ == "__main__":
    static_tcp_rendezvous.TCPStore = tcp_store
    main()
    leave_now([])
