"""How each collective moves data, step by step: one description for the runtime and the widget.

Every rank's buffer is cut into n chunks (n = number of ranks). A `Transfer` says "rank `src`
sends its chunk `chunk` to rank `dst`", which either adds it into its own copy of that chunk
(`reduce=True`) or stores it (`reduce=False`). A schedule is a list of steps; the transfers of
one step happen at the same time. `labsupport.algorithms` executes the ring and tree schedules
with real messages, and the collectives widget draws `simulate()`'s states, so what learners see
is what runs.

Conventions (the same as torch.distributed):

* reduce-scatter leaves rank r holding the fully reduced chunk r;
* all-gather starts from rank r holding chunk r;
* `chunk=None` means the whole buffer (broadcast and reduce move the buffer in one piece);
* all-to-all sends rank i's chunk j to rank j, which stores it at position i: `dst_chunk`
  names the position a transfer lands in when it differs from `chunk`.

Ring schedules: Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for clusters of
workstations"; the same ring is Baidu's ring all-reduce and one of NCCL's algorithms. Binomial
trees: Thakur, Rabenseifner & Gropp 2005, "Optimization of collective communication operations
in MPICH". Scatter, gather and all-to-all are shown in their direct, one-step form.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

COLLECTIVES = ("broadcast", "reduce", "all_reduce", "all_gather", "reduce_scatter", "scatter", "gather",
               "all_to_all")
MAX_RANKS = 16  # the widget draws 1..16 ranks


@dataclass(frozen=True)
class Transfer:
    """`src` sends its chunk `chunk` (None: the whole buffer) to `dst`, which adds it in or stores it."""

    src: int
    dst: int
    chunk: int | None
    reduce: bool
    dst_chunk: int | None = None  # where it lands at `dst` when not at the same position (all-to-all)

    @property
    def into(self) -> int | None:
        """The chunk of `dst` that receives the data."""
        return self.chunk if self.dst_chunk is None else self.dst_chunk


Schedule = list[list[Transfer]]


# ---------------------------------------------------------------- the ring (bandwidth-optimal)

def ring_reduce_scatter(n: int) -> Schedule:
    """n-1 steps; at step s rank r sends chunk (r-s-1) mod n to its right neighbour, which adds it in.

    What a rank receives at step s is what it sends on at step s+1, with its own part added, so
    after n-1 steps chunk r has passed through every rank and ends, fully reduced, on rank r.
    Each rank sends n-1 chunks: (n-1)/n of the buffer.
    """
    return [[Transfer(r, (r + 1) % n, (r - s - 1) % n, reduce=True) for r in range(n)]
            for s in range(n - 1)]


def ring_all_gather(n: int) -> Schedule:
    """n-1 steps; at step s rank r passes chunk (r-s) mod n to its right neighbour, which stores it.

    Rank r starts with chunk r (where reduce-scatter left it) and forwards at each step the chunk
    it received at the previous one, so every chunk travels once around the ring.
    """
    return [[Transfer(r, (r + 1) % n, (r - s) % n, reduce=False) for r in range(n)]
            for s in range(n - 1)]


def ring_all_reduce(n: int) -> Schedule:
    """Reduce-scatter then all-gather: 2(n-1) steps, each rank sends 2(n-1)/n of the buffer.

    That 2(n-1)/n does not grow with n, which is why the ring is bandwidth-optimal.
    """
    return ring_reduce_scatter(n) + ring_all_gather(n)


# ---------------------------------------------------------------- binomial trees (latency-optimal)

def binomial_tree_broadcast(n: int, root: int = 0) -> Schedule:
    """ceil(log2 n) steps; at step k every rank that has the buffer sends it 2^k ranks further.

    Ranks are counted relative to the root, so relative rank v < 2^k has the data at step k and
    sends it to v + 2^k: the number of ranks holding the buffer doubles every step.
    """
    steps, distance = [], 1
    while distance < n:
        steps.append([Transfer((v + root) % n, (v + distance + root) % n, None, reduce=False)
                      for v in range(min(distance, n - distance))])
        distance *= 2
    return steps


def binomial_tree_reduce(n: int, root: int = 0) -> Schedule:
    """The broadcast tree played backwards: partial sums flow towards the root, which ends with the total."""
    return [[Transfer(t.dst, t.src, None, reduce=True) for t in step]
            for step in reversed(binomial_tree_broadcast(n, root))]


# ---------------------------------------------------------------- direct, one step

def direct_scatter(n: int, root: int = 0) -> Schedule:
    """The root sends chunk i to rank i."""
    step = [Transfer(root, i, i, reduce=False) for i in range(n) if i != root]
    return [step] if step else []


def direct_gather(n: int, root: int = 0) -> Schedule:
    """Rank i sends its chunk i to the root."""
    step = [Transfer(i, root, i, reduce=False) for i in range(n) if i != root]
    return [step] if step else []


def direct_all_to_all(n: int) -> Schedule:
    """Rank i sends its chunk j to rank j, which stores it at position i: a transpose across ranks."""
    step = [Transfer(i, j, j, reduce=False, dst_chunk=i) for i in range(n) for j in range(n) if i != j]
    return [step] if step else []


# ---------------------------------------------------------------- by name, for the widget

def _check(collective: str, n: int, root: int) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if not isinstance(n, int) or not 1 <= n <= MAX_RANKS:
        raise ValueError(f"n must be a number of ranks from 1 to {MAX_RANKS} (what the widget can draw), got {n!r}")
    if not isinstance(root, int) or not 0 <= root < n:
        raise ValueError(f"root must be a rank from 0 to {n - 1}, got {root!r}")


def schedule(collective: str, n: int, root: int = 0) -> Schedule:
    """The steps of `collective` on n ranks (1..16); `root` matters for broadcast, reduce, scatter, gather."""
    _check(collective, n, root)
    return {
        "broadcast": lambda: binomial_tree_broadcast(n, root),
        "reduce": lambda: binomial_tree_reduce(n, root),
        "all_reduce": lambda: ring_all_reduce(n),
        "all_gather": lambda: ring_all_gather(n),
        "reduce_scatter": lambda: ring_reduce_scatter(n),
        "scatter": lambda: direct_scatter(n, root),
        "gather": lambda: direct_gather(n, root),
        "all_to_all": lambda: direct_all_to_all(n),
    }[collective]()


def initial_state(collective: str, n: int, root: int = 0) -> list[list]:
    """What each rank holds before `collective`: rank r's chunk c is the number 100 r + c, or None.

    Broadcast and scatter start with data on the root only; all-gather and gather with rank r
    holding its chunk r only; the reductions and all-to-all with every rank holding a full buffer.
    """
    _check(collective, n, root)

    def holds(r: int, c: int) -> bool:
        if collective in ("broadcast", "scatter"):
            return r == root
        if collective in ("all_gather", "gather"):
            return c == r
        return True
    return [[100 * r + c if holds(r, c) else None for c in range(n)] for r in range(n)]


def _combine(mine, incoming):
    """Reduce two chunk values: numbers add up, labels join into a sum like "a+b"."""
    if mine is None:
        return incoming
    return f"{mine}+{incoming}" if isinstance(mine, str) else mine + incoming


def simulate(collective: str, n: int, root: int = 0, initial: list[list] | None = None) -> list[list[list]]:
    """Play the schedule on chunk values; returns the state before the first step and after each step.

    A state is a list over ranks of lists over chunks; None means the rank holds nothing there.
    `initial` defaults to `initial_state(collective, n, root)`; values may be numbers (reductions
    add them) or strings (reductions write "a+b"). A transfer reads the state from before its
    step, since the transfers of one step happen at the same time.
    """
    steps = schedule(collective, n, root)
    state = copy.deepcopy(initial if initial is not None else initial_state(collective, n, root))
    if len(state) != n or any(len(chunks) != n for chunks in state):
        raise ValueError(f"initial must hold {n} chunks for each of {n} ranks")
    states = [state]
    for i, step in enumerate(steps):
        before, state = state, copy.deepcopy(state)
        for t in step:
            moves = [(c, c) for c in range(n)] if t.chunk is None else [(t.chunk, t.into)]
            for c, into in moves:
                value = before[t.src][c]
                if value is None:
                    raise ValueError(f"step {i}: rank {t.src} would send chunk {c}, which it does not hold")
                state[t.dst][into] = _combine(state[t.dst][into], value) if t.reduce else value
        states.append(state)
    return states
