"""torchrun's agent (`torch.distributed.run`), ending the way a labsupport rank does.

`python -m labsupport.agent ARGS` is `python -m torch.distributed.run ARGS`: the same agent with the
same options, which starts, watches and stops the ranks. Only its end differs: once every rank
succeeded it leaves without the interpreter's teardown of torch (`rank.leave_now`), half a second
of every launch; a failure exits the ordinary way, with torchrun's own report.
"""
from torch.distributed.run import main

from .rank import leave_now

if __name__ == "__main__":
    main()
    leave_now([])
