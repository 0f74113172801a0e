"""Notebook 00's exercises: the ring from send/recv, the bytes each collective puts on the wire,
and a find-the-bug lab (a helper that logs the mean loss over the ranks: it works on one process and
hangs on two).

Rank-side checks (`check_*`) run on every rank after the attendee's cell; `grade_*` run in the
notebook and turn the ranks' results into feedback. Expected values come from the one schedule
description (`estimate.collective_steps`) and the one table of wire factors (`estimate.comm_cost`).
"""
from __future__ import annotations


from ..estimate import collective_steps
from ..estimate.comm_cost import BUS_FACTOR
from . import on_ranks
from .exercise import EXERCISES, Exercise, Wrong, attempt, paragraphs, register

RING_RANKS = 4
CHUNK = 2  # elements per chunk: a shape mistake shows too


# ---------------------------------------------------------------- the ring, step by step

def _initial(world: int) -> list[list[float]]:
    """Rank r's chunk c starts as 10c + r + 1: every partial sum says which ranks it came from."""
    return [[float(10 * c + r + 1) for c in range(world)] for r in range(world)]


def _check_ring(fn, collective: str) -> dict:
    """Run the attendee's step function for every step of `collective`'s ring; compare each rank's
    chunks after each step with the simulated schedule. Every rank stops at the first bad step."""
    import torch

    from .. import comm
    rank, world = comm.get_rank(), comm.get_world_size()
    initial = _initial(world)
    if collective == "all_gather":  # rank r starts with chunk r only (where reduce-scatter left it)
        initial = [[v if c == r else None for c, v in enumerate(row)] for r, row in enumerate(initial)]
    states = collective_steps.simulate(collective, world, initial=initial)
    chunks = [torch.full((CHUNK,), v if v is not None else 0.0) for v in initial[rank]]
    name = collective.replace("_", "-")
    for step in range(world - 1):
        comm.reset()
        out = on_ranks.on_rank(fn, chunks, step, rank, world)
        sent = comm.counts()
        if out["status"] == "ok":
            out = _compare(chunks, states[step + 1][rank], sent, rank, step, name)
        flag = torch.tensor([1.0 if out["status"] == "ok" else 0.0])
        comm.all_reduce(flag, "min")  # every rank stops at the first step that failed anywhere
        if out["status"] != "ok" or flag.item() == 0:
            return out if out["status"] != "ok" else {"status": "ok"}
    return {"status": "ok"}


def _compare(chunks, expected, sent, rank, step, name) -> dict:
    others = sorted(set(sent) - {"send", "recv"})
    if others or sent.get("send", {}).get("calls") != 1 or sent.get("recv", {}).get("calls") != 1:
        calls = ", ".join(f"{op} x{c['calls']}" for op, c in sent.items()) or "no communication"
        return {"status": "wrong", "message": f"in step {step} rank {rank} made {calls}; a ring step is exactly "
                                              "one comm.isend to the right and one comm.irecv from the left"}
    for c, want in enumerate(expected):
        if want is None:
            continue
        got = chunks[c]
        if got.shape != (CHUNK,) or not bool((got == want).all()):
            return {"status": "wrong", "message": f"after step {step} of the ring {name} rank {rank} holds "
                                                  f"chunk {c} = {got.tolist()}, expected {want} in each element"}
    return {"status": "ok"}


def check_reduce_scatter_step(fn) -> dict:
    return _check_ring(fn, "reduce_scatter")


def check_all_gather_step(fn) -> dict:
    return _check_ring(fn, "all_gather")


def _grade_ring(name: str, check: str, what: str):
    def grade(fn, source):
        return on_ranks.grade(source, __name__, f"{check}({name})", RING_RANKS,
                              f"all {RING_RANKS - 1} steps on {RING_RANKS} ranks give what the schedule says: {what}",
                              "Post the send and the receive together (isend + irecv), then wait for both", timeout=20)
    return grade


register(Exercise(
    name="ring_reduce_scatter_step", notebook="00", title="One step of the ring reduce-scatter", ranks=RING_RANKS,
    grade=_grade_ring("ring_reduce_scatter_step", "check_reduce_scatter_step",
                      "each rank ends with its own chunk summed over all ranks"),
    hints=("At step s rank r sends chunk (r - s - 1) mod world to rank (r + 1) mod world.",
           "Then rank r receives from (r - 1) mod world the chunk that neighbour sends: (r - s - 2) mod world. "
           "Receive into a fresh buffer (torch.empty_like), wait for both requests, then add it into that chunk.",
           "send = comm.isend(chunks[i], right); recv = comm.irecv(buffer, left); send.wait(); recv.wait(); "
           "chunks[j] += buffer"),
    solution='''
def ring_reduce_scatter_step(chunks, step, rank, world):
    right, left = (rank + 1) % world, (rank - 1) % world
    send_chunk = (rank - step - 1) % world      # what this rank passes on
    recv_chunk = (rank - step - 2) % world      # what the left neighbour passes on
    incoming = torch.empty_like(chunks[recv_chunk])
    requests = [comm.isend(chunks[send_chunk], right), comm.irecv(incoming, left)]
    for request in requests:
        request.wait()
    chunks[recv_chunk] += incoming
'''))

register(Exercise(
    name="ring_all_gather_step", notebook="00", title="One step of the ring all-gather", ranks=RING_RANKS,
    grade=_grade_ring("ring_all_gather_step", "check_all_gather_step",
                      "every rank ends holding every chunk"),
    hints=("Rank r starts with chunk r. At step s it passes chunk (r - s) mod world to the right.",
           "It receives chunk (r - s - 1) mod world from the left and stores it: nothing is added in an all-gather.",
           "Receive straight into chunks[j] with comm.irecv(chunks[j], left), and wait for both requests."),
    solution='''
def ring_all_gather_step(chunks, step, rank, world):
    right, left = (rank + 1) % world, (rank - 1) % world
    requests = [comm.isend(chunks[(rank - step) % world], right),
                comm.irecv(chunks[(rank - step - 1) % world], left)]
    for request in requests:
        request.wait()
'''))


# ---------------------------------------------------------------- bytes on the wire

WIRE_CASES = [(op, n, 1_000_000) for op in ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
              for n in (2, 4, 8)]


def grade_wire_bytes(fn, source) -> str:
    if "BUS_FACTOR" in (source or "") or "comm_cost" in (source or ""):
        raise Wrong("your wire_bytes reads the library's table of factors (BUS_FACTOR in estimate.comm_cost), the "
                    "very table the check compares with: work the bytes out from the ring's steps instead")
    for op, n, payload in WIRE_CASES:
        got = attempt(fn, op, payload, n)
        want = BUS_FACTOR[op](n) * payload
        if got is None or abs(got - want) > 1e-6 * want:
            raise Wrong(f"wire_bytes({op!r}, {payload:,}, {n}) returned {got!r}; under the ring one rank sends "
                        f"{want:,.0f} bytes ({BUS_FACTOR[op](n):.4g} x the payload)")
    return f"all {len(WIRE_CASES)} cases agree with what comm counts (the nccl-tests bus factors)"


register(Exercise(
    name="wire_bytes", notebook="00", title="Bytes one rank sends, per collective",
    grade=grade_wire_bytes,
    hints=("A ring reduce-scatter or all-gather makes n - 1 steps, and each step sends one chunk of payload / n.",
           "An all-reduce is a reduce-scatter followed by an all-gather.",
           "A broadcast down a pipelined chain or tree: every byte still leaves some rank once."),
    solution='''
def wire_bytes(op, payload_bytes, n):
    chunk = payload_bytes / n
    steps = {"reduce_scatter": n - 1, "all_gather": n - 1, "all_reduce": 2 * (n - 1)}
    if op in steps:
        return steps[op] * chunk
    if op == "broadcast":
        return payload_bytes
    raise ValueError(op)
'''))


# ---------------------------------------------------------------- find the bug: a collective on some ranks only

def check_mean_loss(fn) -> dict:
    """Call the attendee's logging helper for 3 steps; every rank must return the mean loss."""
    import torch

    from .. import comm
    rank, world = comm.get_rank(), comm.get_world_size()
    for step in range(3):
        out = on_ranks.on_rank(fn, torch.tensor(float(rank + step)), step)
        if out["status"] != "ok":
            return out
        want = (world - 1) / 2 + step
        if out["value"] is None or abs(float(out["value"]) - want) > 1e-6:
            return {"status": "wrong", "message": f"at step {step} rank {rank} returned {out['value']}, "
                                                  f"expected the mean over the ranks, {want}"}
    return {"status": "ok"}


def grade_mean_loss(fn, source) -> str:
    return on_ranks.grade(source, __name__, "check_mean_loss(mean_loss)", EXERCISES["mean_loss"].ranks,
                          "every rank made the same all-reduce: no hang, and the mean is right",
                          'lab.hint("mean_loss") helps.', timeout=10)



MEAN_LOSS_LESSON = paragraphs(
    "Why it hung. The all-reduce sat inside `if comm.get_rank() == 0 and step % 2 == 0`, so only rank 0 called "
    "it, and only on even steps. A collective returns only once every rank of its group has called it: rank 0 "
    "waited in comm.all_reduce for a partner that never came, while rank 1 ran through its steps and waited at "
    "the end of its script, in the barrier that `with labsupport.init()` passes on the way out, which is where "
    "the timeout found them. On one process there is no partner to wait for, so the helper worked there. Under "
    "NCCL the hang shows one line later: the all-reduce call returns at once (it only queues the work on the "
    "GPU's stream), and rank 0 waits at the next host sync, here total.item().",
    "The fix: every rank computes the mean; only the printing belongs under the `if`. The rule holds for "
    "anything that communicates inside: a metric averaged for logging, a barrier, an evaluation that all-reduces "
    "its loss, a state_dict of a sharded model (FSDP and ZeRO-3 gather the shards with collectives). Call it on "
    "every rank; let rank 0 alone print or write.")

register(Exercise(
    name="mean_loss", notebook="00", title="Find the bug: logging the mean loss hangs", ranks=2,
    grade=grade_mean_loss, bug_lab=True, lesson=MEAN_LOSS_LESSON,
    cause=("only rank 0", "rank 0 alone", "rank 0 calls", "one rank skips", "nobody joins", "never joins",
           "one rank make alone", "one rank makes alone",
           "inside the if", "under the if", "inside the `if`", "under the `if`"),
    hints=("Which ranks reach the all_reduce? Follow one call of mean_loss on rank 1, line by line.",
           "Every rank must make the same collective calls in the same order; which call does one rank make "
           "alone? Look at the `if` around the all_reduce. A collective is a meeting: it returns only when every rank of "
           "the group has called it. Do the all-reduce on every rank; only the print belongs under `if rank == 0`."),
    solution='''
def mean_loss(loss, step):
    total = loss.detach().clone()
    comm.all_reduce(total, "avg")          # every rank takes part
    if comm.get_rank() == 0 and step % 2 == 0:
        print(f"step {step}: mean loss {total.item():.3f}")
    return total.item()
'''))


# Predict, then run: what `lab.reveal(guess_NAME, ..., why="NAME")` prints after the answer, kept here
# and not in the notebook's cell, which the attendee reads before predicting.
WHY = {
    "all_to_all": ("Rank 1 sends its piece 3, 13, to rank 3, which stores it at position 1: rank 3 ends with "
                   "[3, 13, 23, 33], piece 3 of every rank. Read the buffers as the rows of a matrix and the "
                   "all-to-all transposes it."),
    "ring_bytes": ("2(n-1) = 6 steps of one chunk of M/4 = 256 KiB each: 1.5 MiB, 2(n-1)/n x M, section 4's "
                   "all-reduce line applied. The check below counts the sends."),
    "alpha_us": ("A message between two processes of one machine costs a system call and a wake-up on each side: "
                 "tens to hundreds of microseconds on a laptop, mostly the operating system waking up the "
                 "receiving process."),
}


def counter_table(counts: dict, n: int) -> None:
    """Section 4's table of what `comm` counted: calls, payload and wire bytes, their ratio, and the
    nccl-tests factor for n ranks, asserted equal to the ratio. Kept here, not in the cell, so that
    the cell above the wire_bytes exercise does not show the one line that solves it."""
    print(f"{'op':<16}{'calls':>6}{'payload bytes':>15}{'wire bytes':>12}{'wire / payload':>16}"
          f"{f'factor for n = {n}':>18}")
    for op, c in counts.items():
        factor = BUS_FACTOR[op](n)
        assert c["wire_bytes"] == factor * c["payload_bytes"], op
        print(f"{op:<16}{c['calls']:>6}{c['payload_bytes']:>15}{c['wire_bytes']:>12}"
              f"{c['wire_bytes'] / c['payload_bytes']:>16.2f}{factor:>18.2f}")
