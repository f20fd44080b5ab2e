"""Offset arithmetic of the expert-parallel exchange, on one device.

``exchange.layouts`` is checked against a hand example and against a NumPy
simulation of ``ragged_all_to_all`` (its documented semantics: rank s sends
``operand[input_offsets[q]:+send_sizes[q]]`` to rank q, which writes it at the
sender's ``output_offsets[q]``) on random row counts and capacities: every
row that fits lands once, contiguously in sender order, the rest is counted
as overflow, and the return trip brings each computed row back to the slot
it left from. ``capacity`` and ``compact_plan`` are checked by hand.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless.parallel import ep as ep_lib
from dropless.parallel import exchange


def _trip(counts, capacity, rank):
    trips = exchange.layouts(jnp.asarray(counts, jnp.int32), capacity, rank)
    return [[np.asarray(v).tolist() for v in lay] for lay in (trips.out, trips.back)], trips


def test_hand_example():
    # Rank s sends counts[s, q] rows to rank q; receivers hold 4 rows.
    counts = [[1, 2, 0],
              [3, 0, 1],
              [2, 2, 2]]
    (out, back), trips = _trip(counts, 4, rank=1)
    # Rank 1 sends 3 rows to rank 0 (landing after rank 0's own row: offset 1)
    # and 1 row to rank 2 (after rank 0's none: offset 0), from buffer rows 0 and 3.
    assert out == [[0, 0, 3], [3, 0, 1], [1, 0, 0], [2, 0, 2]]
    # Rank 1 receives 2 from rank 0 at rows 0..1 and 2 of rank 2's 2 at rows 2..3.
    assert int(trips.recv_rows) == 4 and int(trips.wanted_rows) == 4
    assert int(trips.dropped_rows) == 0
    # Returning: rank 1 sends rows 0..1 to rank 0 (they left rank 0's buffer at row 1)
    # and rows 2..3 to rank 2 (left at rows 2..3 of rank 2's buffer).
    assert back == [[0, 0, 2], [2, 0, 2], [1, 0, 2], [3, 0, 1]]
    # Rank 0 wants 1 + 3 + 2 = 6 rows into 4: rank 2's 2 rows are cut.
    (out0, _), trips0 = _trip(counts, 4, rank=0)
    assert out0[3] == [1, 3, 0] and int(trips0.dropped_rows) == 2
    (out2, _), _ = _trip(counts, 4, rank=2)
    assert out2[1] == [0, 2, 2]  # rank 2's rows for rank 0 do not fit at all


def simulate(counts, capacity):
    """Run both trips for all ranks in NumPy; return (receive buffers, returned buffers, dropped)."""
    r = len(counts)
    sends = [np.arange(sum(counts[s])) + 1000 * (s + 1) for s in range(r)]  # row ids
    trips = [exchange.layouts(jnp.asarray(counts, jnp.int32), capacity, q) for q in range(r)]
    recv = [np.full(capacity, -1) for _ in range(r)]
    for s in range(r):
        lay = [np.asarray(v) for v in trips[s].out]
        for q in range(r):
            n = lay[1][q]
            recv[q][lay[2][q]:lay[2][q] + n] = sends[s][lay[0][q]:lay[0][q] + n]
    # Receivers "compute" -row and send it back.
    returned = [np.zeros(len(sends[s]), int) for s in range(r)]
    for q in range(r):
        lay = [np.asarray(v) for v in trips[q].back]
        for s in range(r):
            n = lay[1][s]
            returned[s][lay[2][s]:lay[2][s] + n] = -recv[q][lay[0][s]:lay[0][s] + n]
    dropped = [int(t.dropped_rows) for t in trips]
    recv_rows = [int(t.recv_rows) for t in trips]
    return sends, recv, returned, dropped, recv_rows, trips


@given(st.integers(1, 5).flatmap(lambda r: st.tuples(
    st.lists(st.lists(st.integers(0, 6), min_size=r, max_size=r), min_size=r, max_size=r),
    st.integers(0, 20))))
def test_matches_ragged_all_to_all_simulation(args):
    counts, capacity = args
    r = len(counts)
    sends, recv, returned, dropped, recv_rows, trips = simulate(counts, capacity)
    for q in range(r):
        # The rows that fit, contiguous from row 0, in sender order.
        expect = np.concatenate([np.asarray(sends[s][sum(counts[s][:q]):][:counts[s][q]])
                                 for s in range(r)] + [np.zeros(0, int)])[:capacity]
        assert recv_rows[q] == len(expect)
        np.testing.assert_array_equal(recv[q][:len(expect)], expect)
        assert np.all(recv[q][len(expect):] == -1)
        wanted = sum(counts[s][q] for s in range(r))
        assert dropped[q] == wanted - len(expect) == max(0, wanted - capacity)
        # Each rank's send sizes match what its receivers expect from it.
        for s in range(r):
            assert int(trips[s].out.send_sizes[q]) == int(trips[q].out.recv_sizes[s])
            assert int(trips[q].back.send_sizes[s]) == int(trips[s].back.recv_sizes[q])
    for s in range(r):
        # A row comes back negated iff it fitted at its receiver; else zero.
        fitted = np.isin(sends[s], np.concatenate(recv))
        np.testing.assert_array_equal(returned[s], np.where(fitted, -sends[s], 0))
        for lay in (trips[s].out, trips[s].back):
            assert np.all(np.asarray(lay.input_offsets)[np.asarray(lay.send_sizes) == 0] == 0)


def test_layouts_rejects_bad_input():
    with pytest.raises(ValueError, match=r"must be \[R, R\]"):
        exchange.layouts(jnp.zeros((2, 3), jnp.int32), 4, 0)
    with pytest.raises(ValueError, match="capacity"):
        exchange.layouts(jnp.zeros((2, 2), jnp.int32), -1, 0)


def test_resolve_impl():
    assert exchange.resolve_impl("auto", "gpu") == "ragged"
    assert exchange.resolve_impl("auto", "cpu") == "padded"
    assert exchange.resolve_impl("padded", "gpu") == "padded"
    with pytest.raises(ValueError, match="needs a GPU"):
        exchange.resolve_impl("ragged", "cpu")
    with pytest.raises(ValueError, match="not one of"):
        exchange.resolve_impl("nccl", "gpu")


def test_capacity_by_hand():
    # T=10 tokens, K=4, R=8, L=2: balanced rows 10*4 = 40, copies 40.
    cap = ep_lib.capacity(10, 4, 8, 2, 2.0)
    assert cap == ep_lib.Capacity(send=40, recv=80, expert=80, balanced_rows=40,
                                  balanced_copies=40)
    # Factor -1: every token of every rank here (80 rows), each with min(K, L) = 2 copies.
    assert ep_lib.capacity(10, 4, 8, 2, -1) == (40, 80, 160, 40, 40)
    # Large factors are cut at the worst case; alignment pads every local expert, and the
    # buffer is a whole number of aligned blocks (166 -> 168).
    assert ep_lib.capacity(10, 4, 8, 2, 100.0, alignment=4) == (40, 80, 168, 40, 40)
    # K > R: a token reaches at most R ranks.
    assert ep_lib.capacity(10, 8, 4, 4, 1.0)[:2] == (40, 40)
    with pytest.raises(ValueError, match="must be -1 or >= 1"):
        ep_lib.capacity(10, 4, 8, 2, 0.5)


def test_compact_plan_by_hand():
    # 3 tokens x 2 slots, 2 groups; key 2 = absent. Buffer of 3 rows.
    keys = jnp.array([[1, 2], [0, 1], [2, 0]], jnp.int32)
    plan = ep_lib.compact_plan(keys, 2, 3)
    # Sorted real copies: group 0: copies 2, 5; group 1: copies 0, 3 -> row 3 is cut.
    np.testing.assert_array_equal(plan.copy_of_row_P, [2, 5, 0])
    np.testing.assert_array_equal(plan.row_of_copy_C, [2, 3, 0, 3, 3, 1])
    np.testing.assert_array_equal(plan.group_sizes_E, [2, 1])
    np.testing.assert_array_equal(plan.tokens_per_expert_E, [2, 2])
