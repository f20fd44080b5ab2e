"""Windows of a load larger than one buffer (``ep_overflow_rounds``), single device.

``exchange.layouts(..., first_row=j * capacity)`` over j = 0, 1, ... must
deliver every row of every receiver's stream exactly once, to the right
buffer row; ``ep.compact_plan(..., first=i * rows)`` over i must place every
real copy exactly once, with group sizes that sum to the uncut ones.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from dropless.ops import permute as permute_ops
from dropless.parallel import ep as ep_lib
from dropless.parallel import exchange as exchange_lib


@pytest.mark.parametrize("capacity", [1, 3, 7])
def test_layout_windows_deliver_each_row_once(capacity, rng):
    r = 4
    counts_RR = rng.integers(0, 5, size=(r, r)).astype(np.int32)
    windows = -(-int(counts_RR.sum(0).max()) // capacity) + 1  # one past the last needed
    for q in range(r):
        stream = [(s, i) for s in range(r) for i in range(counts_RR[s, q])]  # by hand
        got = {}
        for j in range(windows):
            recv = exchange_lib.layouts(jnp.asarray(counts_RR), capacity, q, j * capacity)
            assert int(recv.recv_rows) == len(stream[j * capacity:(j + 1) * capacity])
            assert int(recv.dropped_rows) == max(len(stream) - (j + 1) * capacity, 0)
            for s in range(r):
                send = exchange_lib.layouts(jnp.asarray(counts_RR), capacity, s, j * capacity)
                n = int(send.out.send_sizes[q])
                assert n == int(recv.out.recv_sizes[s])
                start = int(send.out.input_offsets[q]) - int(counts_RR[s, :q].sum())
                at = int(send.out.output_offsets[q])
                for i in range(n):
                    assert (s, start + i) not in got, "a row delivered twice"
                    got[(s, start + i)] = (j, at + i)
                    # The return trip puts the result back where the row left.
                    assert int(recv.back.output_offsets[s]) == int(send.out.input_offsets[q])
                    assert int(recv.back.input_offsets[s]) == at
                    assert 0 <= at + i < capacity
        assert sorted(got) == sorted(stream)
        for n, row in enumerate(stream):
            assert got[row] == (n // capacity, n % capacity)


@pytest.mark.parametrize("alignment", [1, 4])
def test_plan_windows_place_each_copy_once(alignment, rng):
    groups, t, k = 5, 12, 3
    keys_TK = rng.integers(0, groups + 1, size=(t, k)).astype(np.int32)  # groups = absent
    keys_TK = jnp.asarray(keys_TK)
    full = permute_ops.make_plan(keys_TK, groups + 1, alignment)
    rows = 8  # a multiple of both alignments
    real = np.asarray(keys_TK).reshape(-1) < groups
    seen = np.zeros(t * k, int)
    sizes = np.zeros(groups, int)
    for i in range(-(-full.copy_of_row_P.shape[0] // rows)):
        plan = ep_lib.compact_plan(keys_TK, groups, rows, alignment, i * rows, full)
        row_C = np.asarray(plan.row_of_copy_C)
        inside = row_C < rows
        assert not np.any(inside & ~real), "an absent copy got a row"
        seen += inside
        copy_P = np.asarray(plan.copy_of_row_P)
        for c in np.flatnonzero(inside):
            assert copy_P[row_C[c]] == c
        # Rows of the window hold the copies of their groups, in group order.
        gs = np.asarray(plan.group_sizes_E)
        if alignment > 1:
            assert np.all(gs % alignment == 0)
        group_of_row = np.repeat(np.arange(groups), gs)
        for row, c in enumerate(copy_P[:gs.sum()]):
            if c < t * k:
                assert np.asarray(keys_TK).reshape(-1)[c] == group_of_row[row]
        sizes += gs
    np.testing.assert_array_equal(seen, real.astype(int))
    np.testing.assert_array_equal(sizes, np.asarray(full.group_sizes_E[:groups]))
