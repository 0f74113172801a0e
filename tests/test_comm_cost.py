"""The alpha-beta cost model of collectives, checked against its sources.

The worked example uses alpha = 10 us, beta = 1 ns/byte (1 GB/s), M = 1 MB and p = 8
(lg p = 3); every expected number is worked out by hand in the comment beside it from the
formula printed in the source: Thakur, Rabenseifner & Gropp, IJHPCA 2005, Sec. 4 (TRG05),
Patarasuk & Yuan, JPDC 2009, and nccl-tests doc/PERFORMANCE.md.
"""
import pytest

from labsupport.estimate.comm_cost import ALGORITHMS, BUS_FACTOR, algbw, busbw, collective_time, fit_alpha_beta

ALPHA, BETA, M, P = 10e-6, 1e-9, 1e6, 8


@pytest.mark.parametrize("op, algorithm, expected", [
    ("all_reduce", "ring", 1.89e-3),                  # 2*7 alpha + 2*7/8 M beta = 140 us + 1.75 ms
    ("all_reduce", "tree", 6.06e-3),                  # 2*3 (alpha + M beta) = 6 * 1.01 ms
    ("all_reduce", "recursive_doubling", 3.03e-3),    # 3 alpha + 3 M beta
    ("all_reduce", "rabenseifner", 1.81e-3),          # 2*3 alpha + 2*7/8 M beta = 60 us + 1.75 ms
    ("all_gather", "ring", 0.945e-3),                 # 7 alpha + 7/8 M beta = 70 us + 875 us
    ("all_gather", "recursive_doubling", 0.905e-3),   # 3 alpha + 7/8 M beta
    ("reduce_scatter", "ring", 0.945e-3),             # 7 alpha + 7/8 M beta
    ("reduce_scatter", "recursive_halving", 0.905e-3),
    ("broadcast", "tree", 3.03e-3),                   # 3 (alpha + M beta)
    ("broadcast", "ring", 1.85e-3),                   # (3 + 7) alpha + 2*7/8 M beta (van de Geijn)
    ("reduce", "tree", 3.03e-3),                      # 3 (alpha + M beta)
    ("reduce", "ring", 1.85e-3),                      # (7 + 3) alpha + 2*7/8 M beta
])
def test_worked_example(op, algorithm, expected):
    assert collective_time(op, algorithm, M, P, ALPHA, BETA) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("p, rounds", [(2, 1), (5, 3), (6, 3), (8, 3), (9, 4), (1024, 10)])
def test_lg_p_rounds_up_for_other_rank_counts(p, rounds):
    # a binomial tree on p ranks takes ceil(log2 p) rounds of alpha + M beta
    assert collective_time("broadcast", "tree", M, p, ALPHA, BETA) == pytest.approx(rounds * 1.01e-3, rel=1e-12)


def test_ring_all_reduce_matches_the_nccl_tests_bound():
    # PERFORMANCE.md: at best t = (S/B) * 2(n-1)/n, with B the bandwidth of one rank's link
    bandwidth, n = 25e9, 8
    t = collective_time("all_reduce", "ring", M, n, 0.0, 1 / bandwidth)
    assert t == pytest.approx(M / bandwidth * 2 * (n - 1) / n, rel=1e-12)


def test_ring_all_reduce_is_bandwidth_optimal():
    # Patarasuk & Yuan: no all-reduce has a bandwidth term below 2 (p-1)/p M beta; the ring meets it
    for p in range(2, 65):
        lower_bound = 2 * (p - 1) / p * M * BETA
        bandwidth_terms = {name: f(M, p, 0.0, BETA) for name, f in ALGORITHMS["all_reduce"].items()}
        assert bandwidth_terms["ring"] == pytest.approx(lower_bound, rel=1e-12)
        assert all(term >= lower_bound * (1 - 1e-12) for term in bandwidth_terms.values())


@pytest.mark.parametrize("op", ALGORITHMS)
def test_one_rank_is_free(op):
    for algorithm in ALGORITHMS[op]:
        assert collective_time(op, algorithm, 1e9, 1, ALPHA, BETA) == 0


# a fast link: 5 us latency, 25 GB/s
LINK_ALPHA, LINK_BETA = 5e-6, 1 / 25e9


def _winner(nbytes, p):
    ring = collective_time("all_reduce", "ring", nbytes, p, LINK_ALPHA, LINK_BETA)
    tree = collective_time("all_reduce", "tree", nbytes, p, LINK_ALPHA, LINK_BETA)
    return "ring" if ring < tree else "tree"


def test_tree_wins_small_messages_on_many_ranks_ring_wins_large_ones():
    assert _winner(1024, 2) == "ring"  # 2 ranks: same latency, the ring sends half the bytes
    assert all(_winner(1024, 2**k) == "tree" for k in range(2, 11))
    assert all(_winner(2**30, 2**k) == "ring" for k in range(1, 11))


def test_ring_and_tree_cross_over_once_at_the_predicted_size():
    # p = 64: ring 126 alpha + 2*63/64 M beta, tree 12 alpha + 12 M beta; equal at
    # M = 114 alpha / (10.03125 beta) = 1.42 MB for this link
    p = 64
    crossover = 114 * LINK_ALPHA / (10.03125 * LINK_BETA)
    assert crossover == pytest.approx(1.4206e6, rel=1e-4)
    assert _winner(0.99 * crossover, p) == "tree" and _winner(1.01 * crossover, p) == "ring"
    winners = [_winner(2**k, p) for k in range(31)]
    assert winners == ["tree"] * winners.count("tree") + ["ring"] * winners.count("ring")


@pytest.mark.parametrize("op, algorithm", [(op, a) for op in ALGORITHMS for a in ALGORITHMS[op]])
@pytest.mark.parametrize("p", [2, 6, 8, 64])
def test_fit_recovers_alpha_beta_from_the_model(op, algorithm, p):
    sizes = [2**k for k in range(10, 31, 4)]
    times = [collective_time(op, algorithm, m, p, LINK_ALPHA, LINK_BETA) for m in sizes]
    alpha, beta = fit_alpha_beta(sizes, times, op, algorithm, p=p)
    assert alpha == pytest.approx(LINK_ALPHA, rel=1e-9)
    assert beta == pytest.approx(LINK_BETA, rel=1e-9)


def test_fit_never_returns_a_negative_latency_or_bandwidth():
    sizes = [2**20, 2**24, 2**28]
    # large messages only, each measured 1 us fast: plain least squares gives alpha < 0
    times = [collective_time("all_reduce", "ring", m, 8, 0.0, LINK_BETA) - 1e-6 for m in sizes]
    alpha, beta = fit_alpha_beta(sizes, times, p=8)
    assert alpha == 0.0 and beta == pytest.approx(LINK_BETA, rel=1e-3)
    # times that fall as messages grow: beta is fixed at 0 and alpha alone fits the times
    # (ring: t = 2(p-1) alpha = 6 alpha), minimising relative errors sum((6 alpha / t - 1)^2)
    times = [30e-6, 20e-6]
    alpha, beta = fit_alpha_beta([1e3, 1e4], times, p=4)
    best = sum(6 / t for t in times) / sum((6 / t) ** 2 for t in times)
    assert beta == 0.0 and alpha == pytest.approx(best, rel=1e-12)


@pytest.mark.parametrize("sizes, times, p, message", [
    ([1e6, 1e6], [1e-3, 1.1e-3], 8, "2 distinct"),
    ([1e3, 1e6], [1e-3], 8, "sizes but"),
    ([1e3, 1e6], [1e-5, 1e-3], 1, "nothing to fit"),
    ([-1, 1e6], [1e-5, 1e-3], 8, ">= 0"),
])
def test_fit_rejects_data_it_cannot_fit(sizes, times, p, message):
    with pytest.raises(ValueError, match=message):
        fit_alpha_beta(sizes, times, p=p)


@pytest.mark.parametrize("args, message", [
    (("all_to_all", "ring", M, P, ALPHA, BETA), "unknown collective"),
    (("all_gather", "tree", M, P, ALPHA, BETA), "no 'tree' algorithm for all_gather"),
    (("all_reduce", "ring", M, 0, ALPHA, BETA), "p must be"),
    (("all_reduce", "ring", M, 2.5, ALPHA, BETA), "p must be"),
    (("all_reduce", "ring", -1, P, ALPHA, BETA), "nbytes must be"),
    (("all_reduce", "ring", M, P, -ALPHA, BETA), "alpha and beta"),
])
def test_collective_time_rejects_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        collective_time(*args)


def test_bus_factors_for_eight_ranks():
    # nccl-tests doc/PERFORMANCE.md, "Summary"; scatter, gather, send from src/*.cu; recv, barrier ours
    expected = {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "all_to_all": 0.875,
                "scatter": 0.875, "gather": 0.875, "broadcast": 1.0, "reduce": 1.0, "send": 1.0,
                "recv": 0.0, "barrier": 0.0}
    assert {op: factor(8) for op, factor in BUS_FACTOR.items()} == expected


def test_algbw_and_busbw():
    assert algbw(1e9, 0.5) == 2e9
    assert busbw("all_reduce", 1e9, 0.5, 8) == pytest.approx(3.5e9)
    assert busbw("broadcast", 1e9, 0.5, 8) == 2e9
    with pytest.raises(ValueError, match="unknown op"):
        busbw("allreduce", 1e9, 0.5, 8)
    with pytest.raises(ValueError, match="seconds"):
        algbw(1e9, 0)


@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
@pytest.mark.parametrize("n", [2, 3, 8, 64])
def test_busbw_of_a_bandwidth_bound_ring_is_the_link_bandwidth(op, n):
    # what the bus bandwidth is for: the same number, 1 / beta, whatever the number of ranks
    t = collective_time(op, "ring", M, n, 0.0, LINK_BETA)
    assert busbw(op, M, t, n) == pytest.approx(1 / LINK_BETA, rel=1e-12)
