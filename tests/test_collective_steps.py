"""Collective schedules: every simulated collective ends in the state its definition says."""
import math

import pytest

from labsupport.estimate.collective_steps import (COLLECTIVES, binomial_tree_broadcast, initial_state,
                                                  ring_all_reduce, schedule, simulate)

SIZES = range(1, 7)


def column_sums(state):
    return [sum(chunks[c] for chunks in state) for c in range(len(state))]


def final(collective, n, root=0):
    return simulate(collective, n, root)[-1]


@pytest.mark.parametrize("n", SIZES)
def test_all_reduce_gives_every_rank_the_sum(n):
    start = initial_state("all_reduce", n)
    assert final("all_reduce", n) == [column_sums(start)] * n


@pytest.mark.parametrize("n", SIZES)
def test_reduce_scatter_leaves_rank_r_the_reduced_chunk_r(n):
    sums = column_sums(initial_state("reduce_scatter", n))
    end = final("reduce_scatter", n)
    assert [end[r][r] for r in range(n)] == sums


@pytest.mark.parametrize("n", SIZES)
def test_all_gather_gives_everybody_everything(n):
    start = initial_state("all_gather", n)
    everything = [start[c][c] for c in range(n)]
    assert final("all_gather", n) == [everything] * n


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("root", [0, -1])
def test_rooted_collectives(n, root):
    root %= n
    start = initial_state("broadcast", n, root)
    assert final("broadcast", n, root) == [start[root]] * n

    sums = column_sums(initial_state("reduce", n, root))
    assert final("reduce", n, root)[root] == sums

    start = initial_state("scatter", n, root)
    end = final("scatter", n, root)
    assert [end[i][i] for i in range(n)] == [start[root][i] for i in range(n)]

    start = initial_state("gather", n, root)
    assert final("gather", n, root)[root] == [start[i][i] for i in range(n)]


@pytest.mark.parametrize("n", SIZES)
def test_all_to_all_transposes_the_chunks(n):
    start = initial_state("all_to_all", n)
    end = final("all_to_all", n)
    assert end == [[start[i][j] for i in range(n)] for j in range(n)]


@pytest.mark.parametrize("n", SIZES)
def test_ring_all_reduce_sends_2_n_minus_1_chunks_per_rank(n):
    steps = ring_all_reduce(n)
    assert len(steps) == 2 * (n - 1)
    for r in range(n):
        sent = [t for step in steps for t in step if t.src == r]
        assert len(sent) == 2 * (n - 1)  # chunks of 1/n: the 2(n-1)/n bandwidth term
        assert all(t.chunk is not None for t in sent)
    for step in steps:  # each rank sends once and receives once per step
        assert sorted(t.src for t in step) == sorted(t.dst for t in step) == list(range(n))


@pytest.mark.parametrize("n", range(1, 17))
def test_tree_broadcast_takes_ceil_log2_n_steps(n):
    assert len(binomial_tree_broadcast(n)) == math.ceil(math.log2(n))
    assert len(schedule("reduce", n, root=n - 1)) == math.ceil(math.log2(n))


def test_labels_show_what_was_summed():
    start = [[f"{r}{c}" for c in range(3)] for r in range(3)]
    end = simulate("all_reduce", 3, initial=start)[-1]
    assert all(sorted(end[r][c].split("+")) == [f"{i}{c}" for i in range(3)] for r in range(3) for c in range(3))


def test_states_start_with_the_input_and_follow_each_step():
    states = simulate("all_reduce", 4)
    assert len(states) == 1 + 2 * 3 and states[0] == initial_state("all_reduce", 4)
    for collective in COLLECTIVES:
        assert simulate(collective, 1)[-1] == initial_state(collective, 1)


@pytest.mark.parametrize("call, match", [
    (lambda: schedule("allreduce", 4), "unknown collective 'allreduce'"),
    (lambda: schedule("broadcast", 0), "from 1 to 16"),
    (lambda: simulate("all_gather", 17), "from 1 to 16"),
    (lambda: schedule("reduce", 4, root=4), "root must be a rank from 0 to 3"),
    (lambda: simulate("all_reduce", 2, initial=[[1, 2]]), "2 chunks for each of 2 ranks"),
    (lambda: simulate("broadcast", 2, initial=[[None, None], [1, 2]]), "does not hold"),
])
def test_bad_input_says_what_is_wrong_in_one_line(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)
