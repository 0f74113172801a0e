"""Run an attendee's cell and a rank-side check on real ranks, for distributed exercises.

On the interactive ranks (labsupport.pool) when a pool of the right size is running, so feedback
comes back in well under a second (a pool that stopped itself after idling starts again first, and
says so); otherwise through a fresh launch (a few seconds). Either way
each rank runs the cell's source, then `check(answer)`, and returns a small dict; a hang becomes
feedback (the timeout names where the ranks waited) instead of a stuck notebook.
"""
from __future__ import annotations

import io
import re
import tempfile
from pathlib import Path

from ..launch import LaunchError, launch
from .exercise import wrap

# A check's limit is for the ranks' work. Through a fresh launch it counts from the moment every rank
# is up (launch's timeout does): torchrun importing torch and the ranks meeting take a few seconds on an idle laptop and
# over 10 on CI's two loaded cores, and get launch's own allowance (STARTUP_TIMEOUT_S).
CHECK_TIMEOUT_S = 60
# What an exercise cell may use without importing it, on the ranks as in the notebook.
PRELUDE = "import torch\nfrom labsupport import comm\n"

# What a launched rank runs: the cell and the check's import, then the check, reported as JSON.
_SCRIPT = """
import labsupport
with labsupport.init(seed=0) as rt:
    exec(compile({setup!r}, "<your cell>", "exec"), globals())
    labsupport.report(result=eval({call!r}))
"""


def run(source: str, module: str, call: str, nproc: int, timeout: float = CHECK_TIMEOUT_S) -> dict[int, dict]:
    """{rank: the value of `call` (e.g. "check_x(my_fn)", a function of `module`) on that rank},
    after running the attendee's cell `source` there.

    Raises RanksFailed (with the launcher's or the pool's message) if the ranks did not finish in time.
    """
    from .. import pool
    setup = f"{PRELUDE}{source}\nfrom {module} import {call.split('(')[0]}\n"
    if pool.ranks.serves(nproc):
        try:
            pool.ranks.run(setup, timeout=timeout)
            results = pool.ranks.run(call, timeout=timeout)
        except LaunchError as e:
            raise RanksFailed(str(e)) from None
        if any(isinstance(r, dict) and r.get("status") == "error" for r in results.values()):
            # The attendee's code raised, perhaps between posting a send or a receive and waiting for it:
            # such a message would meet the next check's. Fresh ranks make the next check start clean.
            print(wrap("(your code raised on the ranks, maybe with messages still in flight: restarting the "
                       "ranks, so that your next attempt starts clean)"), flush=True)
            pool.ranks.restart()
        return results
    why = (f"the pool has {pool.ranks.nproc} ranks, this check needs {nproc}" if pool.ranks.running else
           f"no pool is running; `%ranks start --nproc {nproc}` makes checks fast")
    print(wrap(f"(checking on {nproc} fresh ranks, a few seconds: {why})"), flush=True)
    with tempfile.TemporaryDirectory(prefix="labsupport-check-") as tmp:
        script = Path(tmp) / "check.py"
        script.write_text(_SCRIPT.format(setup=setup, call=call))
        try:  # the ranks' output goes to a buffer: the verdict is what the attendee needs to see
            res = launch(str(script), nproc=nproc, timeout=timeout, run_dir=Path(tmp) / "run", out=io.StringIO())
        except LaunchError as e:
            raise RanksFailed(str(e)) from None
        return {r: res.report(r)["result"] for r in range(nproc)}


def grade(source: str, module: str, call: str, nproc: int, success: str, hang_advice: str,
          timeout: float = CHECK_TIMEOUT_S) -> str:
    """Run the check on the ranks and turn what they return into the exercise's verdict."""
    from .exercise import Wrong
    try:
        results = run(source, module, call, nproc, timeout)
    except RanksFailed as e:  # the check's run directory is gone with its temporary folder: no "logs in"
        where = re.sub(r"[;,]? *\(?logs in [^\s)]+\)?", "", str(e)).strip()
        raise Wrong(f"the ranks did not finish: {where}. {hang_advice}") from None
    return verdict(results, success)


class RanksFailed(Exception):
    """The ranks did not finish (a deadlock, or a rank that crashed): the message says where."""


def on_rank(fn, *args) -> dict:
    """Rank side: call the attendee's `fn`; its exception becomes a result, never a crash."""
    try:
        return {"status": "ok", "value": fn(*args)}
    except NotImplementedError:
        return {"status": "unsolved"}
    except Exception as e:  # the attendee's bug: report it as feedback, with its type
        return {"status": "error", "message": f"{type(e).__name__}: {e}"}


def verdict(results: dict[int, dict], success: str) -> str:
    """The exercise's verdict from every rank's result: the first problem found, by rank."""
    from .exercise import Unsolved, Wrong
    if any(r["status"] == "unsolved" for r in results.values()):
        raise Unsolved("it still raises NotImplementedError")
    for rank in sorted(results):
        r = results[rank]
        if r["status"] == "error":
            raise Wrong(f"on rank {rank} your code raised {r['message']}")
        if r["status"] == "wrong":
            raise Wrong(r["message"])
    return success
