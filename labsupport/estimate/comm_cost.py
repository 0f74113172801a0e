"""How long a collective takes: the alpha-beta (latency-bandwidth) cost model.

Sending one message of M bytes between two ranks costs alpha + M beta: alpha is the latency
of a message (seconds) and beta the time per byte (seconds per byte, one over the link
bandwidth). This is Hockney's model (R. W. Hockney, "The communication challenge for MPP",
Parallel Computing 20(3), 1994). Every algorithm below is a sequence of such messages, and its
cost is the one given by Thakur, Rabenseifner & Gropp, "Optimization of Collective
Communication Operations in MPICH", IJHPCA 19(1), 2005, Sec. 4 (cited as TRG05 below).

Conventions, the same throughout:

* M (`nbytes`) is the size of the whole logical buffer: for all-gather the gathered result,
  for reduce-scatter the input before it is split. This is TRG05's n, nccl-tests' S and the
  `payload_bytes` that `labsupport.comm` counts, so measured and predicted line up.
* lg p means ceil(log2 p), the number of rounds of a binomial tree. TRG05 give the recursive
  doubling and halving costs for p a power of two; for other p MPICH adds a step or two,
  which this model leaves out.
* The gamma term of TRG05 (time per byte to add two buffers) is left out. On a GPU the
  addition runs at memory bandwidth, far faster than any link, so it hardly shows; and when
  alpha and beta are fitted to measured times (`fit_alpha_beta`) what remains of it is
  folded into beta.

Each formula function takes (nbytes, p, alpha, beta) and returns seconds, assuming p >= 1
and nbytes >= 0; `collective_time` checks its arguments and picks the formula by name.
"""
from __future__ import annotations


def _lg(p) -> int:
    """ceil(log2 p): the rounds of a binomial tree or of recursive doubling (0 when p = 1)."""
    return (int(p) - 1).bit_length()


# ---------------------------------------------------------------- all-reduce

def all_reduce_ring(nbytes, p, alpha, beta):
    """Ring all-reduce: a ring reduce-scatter, then a ring all-gather.

    2 (p-1) alpha + 2 (p-1)/p M beta (Patarasuk & Yuan, "Bandwidth optimal all-reduce
    algorithms for clusters of workstations", JPDC 69(2), 2009). Its bandwidth term equals
    their lower bound for any all-reduce, so no algorithm sends fewer bytes per rank; its
    latency term grows with p, which is why trees win for small messages.
    """
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def all_reduce_tree(nbytes, p, alpha, beta):
    """Tree all-reduce: a binomial-tree reduce to one rank, then a binomial-tree broadcast.

    2 lg p (alpha + M beta): TRG05 Sec. 4 give lg p (alpha + M beta) for each of the binomial
    reduce and broadcast. Few rounds, but the whole buffer crosses every level. (NCCL's "tree"
    pipelines chunks through two binary trees, which brings its bandwidth term close to the
    ring's; this is the textbook tree without pipelining.)
    """
    return 2 * _lg(p) * (alpha + nbytes * beta)


def all_reduce_recursive_doubling(nbytes, p, alpha, beta):
    """Recursive doubling: in round k each rank swaps its whole buffer with rank XOR 2^k.

    lg p alpha + lg p M beta (TRG05 Sec. 4, all-reduce; MPICH's choice for short messages).
    """
    return _lg(p) * (alpha + nbytes * beta)


def all_reduce_rabenseifner(nbytes, p, alpha, beta):
    """Rabenseifner: reduce-scatter by recursive halving, then all-gather by recursive doubling.

    2 lg p alpha + 2 (p-1)/p M beta (TRG05 Sec. 4, all-reduce; MPICH's choice for long
    messages): the ring's bandwidth term with the tree's number of rounds.
    """
    return 2 * _lg(p) * alpha + 2 * (p - 1) / p * nbytes * beta


# ---------------------------------------------------------------- all-gather, reduce-scatter

def all_gather_ring(nbytes, p, alpha, beta):
    """Ring all-gather: p-1 steps, each passing one block of M/p bytes to the next rank.

    (p-1) alpha + (p-1)/p M beta (TRG05 Sec. 4, all-gather, ring algorithm).
    """
    return (p - 1) * alpha + (p - 1) / p * nbytes * beta


def all_gather_recursive_doubling(nbytes, p, alpha, beta):
    """Recursive doubling all-gather: lg p rounds, exchanging M/p, 2M/p, 4M/p ... bytes.

    lg p alpha + (p-1)/p M beta (TRG05 Sec. 4, all-gather). For p not a power of two this
    is the cost TRG05 give for Bruck's algorithm.
    """
    return _lg(p) * alpha + (p - 1) / p * nbytes * beta


def reduce_scatter_ring(nbytes, p, alpha, beta):
    """Ring (or pairwise-exchange) reduce-scatter: p-1 steps of M/p bytes each.

    (p-1) alpha + (p-1)/p M beta (TRG05 Sec. 4, reduce-scatter, pairwise exchange).
    """
    return (p - 1) * alpha + (p - 1) / p * nbytes * beta


def reduce_scatter_recursive_halving(nbytes, p, alpha, beta):
    """Recursive halving reduce-scatter: lg p rounds, exchanging M/2, M/4 ... bytes.

    lg p alpha + (p-1)/p M beta (TRG05 Sec. 4, reduce-scatter).
    """
    return _lg(p) * alpha + (p - 1) / p * nbytes * beta


# ---------------------------------------------------------------- broadcast, reduce

def broadcast_tree(nbytes, p, alpha, beta):
    """Binomial-tree broadcast: each round doubles the ranks that hold the whole buffer.

    lg p (alpha + M beta) (TRG05 Sec. 4, broadcast, short messages).
    """
    return _lg(p) * (alpha + nbytes * beta)


def broadcast_ring(nbytes, p, alpha, beta):
    """Van de Geijn's broadcast: binomial scatter of M/p blocks, then a ring all-gather.

    (lg p + p - 1) alpha + 2 (p-1)/p M beta (TRG05 Sec. 4, broadcast, long messages): the
    scatter costs lg p alpha + (p-1)/p M beta, the ring all-gather the rest.
    """
    return (_lg(p) + p - 1) * alpha + 2 * (p - 1) / p * nbytes * beta


def reduce_tree(nbytes, p, alpha, beta):
    """Binomial-tree reduce: the broadcast tree run backwards, adding on the way.

    lg p (alpha + M beta) (TRG05 Sec. 4, reduce, short messages).
    """
    return _lg(p) * (alpha + nbytes * beta)


def reduce_ring(nbytes, p, alpha, beta):
    """Ring reduce-scatter, then a binomial gather of the reduced blocks to the root.

    (p - 1 + lg p) alpha + 2 (p-1)/p M beta. This is Rabenseifner's reduce (TRG05 Sec. 4,
    reduce, long messages: reduce-scatter then binomial gather, the gather costing
    lg p alpha + (p-1)/p M beta) with the ring reduce-scatter in place of recursive halving;
    the mirror image of `broadcast_ring`.
    """
    return (p - 1 + _lg(p)) * alpha + 2 * (p - 1) / p * nbytes * beta


ALGORITHMS = {
    "all_reduce": {"ring": all_reduce_ring, "tree": all_reduce_tree,
                   "recursive_doubling": all_reduce_recursive_doubling,
                   "rabenseifner": all_reduce_rabenseifner},
    "all_gather": {"ring": all_gather_ring, "recursive_doubling": all_gather_recursive_doubling},
    "reduce_scatter": {"ring": reduce_scatter_ring, "recursive_halving": reduce_scatter_recursive_halving},
    "broadcast": {"ring": broadcast_ring, "tree": broadcast_tree},
    "reduce": {"ring": reduce_ring, "tree": reduce_tree},
}


def _formula(op, algorithm):
    if op not in ALGORITHMS:
        raise ValueError(f"unknown collective {op!r}; choose one of {', '.join(ALGORITHMS)}")
    if algorithm not in ALGORITHMS[op]:
        raise ValueError(f"no {algorithm!r} algorithm for {op}; choose one of {', '.join(ALGORITHMS[op])}")
    return ALGORITHMS[op][algorithm]


def _check_ranks(p):
    if p < 1 or int(p) != p:
        raise ValueError(f"p must be a whole number of ranks >= 1, got {p!r}")


def collective_time(op, algorithm, nbytes, p, alpha, beta):
    """Seconds for one collective of `nbytes` on p ranks under the alpha-beta model.

    `op` and `algorithm` name a formula in ALGORITHMS; p = 1 costs nothing.
    """
    formula = _formula(op, algorithm)
    _check_ranks(p)
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
    if alpha < 0 or beta < 0:
        raise ValueError(f"alpha and beta must be >= 0, got alpha={alpha!r}, beta={beta!r}")
    return formula(nbytes, p, alpha, beta)


def fit_alpha_beta(sizes_bytes, seconds, op="all_reduce", algorithm="ring", *, p):
    """The alpha and beta that best explain measured times of one collective on p ranks.

    Every formula is linear in alpha and beta, t = a alpha + b beta, so evaluating it at
    (alpha, beta) = (1, 0) and (0, 1) gives the coefficients a and b of each measurement, and
    least squares (of relative errors) is a 2x2 system (the normal equations). A negative alpha or beta has no
    physical meaning; it shows up when the data cannot resolve that term (say alpha, when
    only large messages were timed and it is smaller than the noise). That one is then fixed
    at 0 and the other fitted alone, which for two unknowns is exactly the least-squares fit
    with alpha, beta >= 0.
    """
    formula = _formula(op, algorithm)
    _check_ranks(p)
    sizes, times = list(sizes_bytes), list(seconds)
    if len(sizes) != len(times):
        raise ValueError(f"got {len(sizes)} sizes but {len(times)} times")
    if len(set(sizes)) < 2:
        raise ValueError("need times for at least 2 distinct message sizes to separate alpha from beta")
    if min(sizes) < 0:
        raise ValueError("message sizes must be >= 0")
    if p == 1:
        raise ValueError("p = 1 communicates nothing, so there is nothing to fit; measure with p >= 2")

    if min(times) <= 0:
        raise ValueError("measured times must be > 0 seconds")
    # Each row is divided by its measured time: the fit minimises relative errors, so a 10 %
    # wobble of a 16 MB message weighs no more than one of a 4 KB message and cannot swamp alpha.
    a = [formula(m, p, 1.0, 0.0) / t for m, t in zip(sizes, times)]  # messages on the critical path
    b = [formula(m, p, 0.0, 1.0) / t for m, t in zip(sizes, times)]  # bytes on the critical path
    times = [1.0] * len(times)
    saa = sum(x * x for x in a)
    sab = sum(x * y for x, y in zip(a, b))
    sbb = sum(y * y for y in b)
    sat = sum(x * t for x, t in zip(a, times))
    sbt = sum(y * t for y, t in zip(b, times))
    det = saa * sbb - sab * sab
    alpha = (sbb * sat - sab * sbt) / det
    beta = (saa * sbt - sab * sat) / det
    if alpha < 0:
        alpha, beta = 0.0, max(sbt / sbb, 0.0)
    elif beta < 0:
        alpha, beta = max(sat / saa, 0.0), 0.0
    return alpha, beta


# ---------------------------------------------------------------- nccl-tests bandwidths

# op -> factor(n) that turns algorithm bandwidth into bus bandwidth on n ranks: the bytes one
# rank must send per byte of the buffer, so that busbw can be compared with a link's peak
# whatever n is. NVIDIA nccl-tests, doc/PERFORMANCE.md ("Summary"): all-reduce 2(n-1)/n;
# reduce-scatter, all-gather and all-to-all (n-1)/n; broadcast and reduce 1. Scatter and
# gather (n-1)/n and send 1 are those of nccl-tests' src/scatter.cu, gather.cu and
# sendrecv.cu. recv and barrier are 0 by our own convention: a receive puts nothing on the
# wire (its send already counted it) and a barrier carries no payload. labsupport.comm uses
# this table to count wire bytes.
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n,
    "gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "send": lambda n: 1.0,
    "recv": lambda n: 0.0,
    "barrier": lambda n: 0.0,
}


def algbw(nbytes, seconds):
    """Algorithm bandwidth S / t in bytes per second (nccl-tests, doc/PERFORMANCE.md).

    S is the whole buffer, as M above: for all-gather and reduce-scatter nccl-tests take the
    gathered size, n times the per-rank count.
    """
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    return nbytes / seconds


def busbw(op, nbytes, seconds, n):
    """Bus bandwidth algbw x BUS_FACTOR[op](n), in bytes per second (nccl-tests, doc/PERFORMANCE.md).

    For a bandwidth-bound ring it is the link bandwidth 1 / beta, whatever n is.
    """
    if op not in BUS_FACTOR:
        raise ValueError(f"unknown op {op!r}; choose one of {', '.join(BUS_FACTOR)}")
    return algbw(nbytes, seconds) * BUS_FACTOR[op](n)
