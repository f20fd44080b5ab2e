"""Tile schedule, tuning table and shape rules of the mosaic gmm backend (CPU only).

Legend: M rows, G groups, T tiles, bm rows per tile block.

The device-side schedule (plain jnp) is checked against a NumPy model that
walks the segments (groups, then the tail past the total) block by block, on
random group sizes that include zeros, one group holding every row, and
totals short of M.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless.ops.gmm import mosaic, quantized, schedule, tuning


@st.composite
def problem_st(draw):
    bm = draw(st.sampled_from([8, 64, 128]))
    m = draw(st.integers(1, 5 * bm + 3))
    g = draw(st.integers(1, 12))
    kind = draw(st.sampled_from(["random", "one_group", "short", "zeros"]))
    if kind == "one_group":
        sizes = [0] * g
        sizes[draw(st.integers(0, g - 1))] = m
    elif kind == "zeros":
        sizes = [0] * g
    else:
        total = m if kind == "random" else draw(st.integers(0, m))
        cuts = sorted(draw(st.lists(st.integers(0, total), min_size=g - 1, max_size=g - 1)))
        sizes = list(np.diff([0, *cuts, total]))
    return m, bm, np.array(sizes, np.int32)


def numpy_schedule(sizes, m, bm):
    """[(group, row_start, lo, hi)] of every live tile, in order (group -1: tail)."""
    ends = np.cumsum(sizes)
    starts = ends - sizes
    segments = [(g, s, e) for g, (s, e) in enumerate(zip(starts, ends))] + [(-1, ends[-1], m)]
    tiles = []
    for g, s, e in segments:
        if e <= s:
            continue
        for b in range(s // bm, (e - 1) // bm + 1):
            tiles.append((g, b * bm, max(s, b * bm), min(e, b * bm + bm)))
    return tiles


_schedule = jax.jit(schedule.row_tile_schedule, static_argnums=(1, 2))
_group_order = jax.jit(schedule.tgmm_group_order, static_argnums=(1, 2))


@given(problem_st())
def test_row_tile_schedule_matches_numpy_model(problem):
    m, bm, sizes = problem
    sched = _schedule(jnp.asarray(sizes), m, bm)
    expected = numpy_schedule(sizes, m, bm)
    n = int(sched.num_tiles[0])
    assert n == len(expected)
    assert sched.group_T.shape == (schedule.max_row_tiles(m, len(sizes), bm),)
    assert n <= sched.group_T.shape[0]
    got = list(zip(*(np.asarray(a)[:n].tolist() for a in sched[:4])))
    assert got == [tuple(int(v) for v in t) for t in expected]
    # Padding slots are inert: group -1 and an empty store range.
    assert np.all(np.asarray(sched.group_T)[n:] == -1)
    assert np.all(np.asarray(sched.store_lo_T)[n:] == np.asarray(sched.store_hi_T)[n:])


@given(problem_st())
def test_tiles_write_every_row_once_with_its_own_group(problem):
    m, bm, sizes = problem
    sched = _schedule(jnp.asarray(sizes), m, bm)
    n = int(sched.num_tiles[0])
    owner = np.repeat(np.arange(len(sizes)), sizes)
    owner = np.concatenate([owner, np.full(m - owner.size, -1)])
    written = np.zeros(m, np.int64)
    for g, start, lo, hi in zip(*(np.asarray(a)[:n] for a in sched[:4])):
        assert start % bm == 0 and start <= lo < hi <= min(start + bm, m)
        assert np.all(owner[lo:hi] == g)
        written[lo:hi] += 1
    np.testing.assert_array_equal(written, 1)


def test_schedule_clamps_a_total_above_m():
    sched = _schedule(jnp.array([5, 9, 7], jnp.int32), 16, 8)
    n = int(sched.num_tiles[0])
    assert int(np.max(np.asarray(sched.store_hi_T)[:n])) == 16
    starts, sizes = schedule.group_offsets(jnp.array([5, 9, 7], jnp.int32), 16)
    np.testing.assert_array_equal(starts, [0, 5, 14])
    np.testing.assert_array_equal(sizes, [5, 9, 2])


@given(problem_st())
def test_tgmm_group_order_sorts_groups_by_steps(problem):
    """Descending step counts, ties in group order; steps as the kernel counts them:
    from the group's first row rounded down to bm, 0 for an empty group."""
    m, bm, sizes = problem
    order = np.asarray(_group_order(jnp.asarray(sizes), m, bm))
    ends = np.minimum(np.cumsum(sizes), m)
    starts = np.concatenate([[0], ends[:-1]])
    steps = [len(range(s // bm, (e - 1) // bm + 1)) if e > s else 0 for s, e in zip(starts, ends)]
    assert sorted(order.tolist()) == list(range(len(sizes)))
    assert [(-steps[g], g) for g in order] == sorted((-steps[g], g) for g in range(len(sizes)))


@pytest.mark.parametrize("num_tiles, num_sms", [(10, 3), (12, 4), (5, 8), (1, 1)])
def test_snake_tile_visits_every_tile_once(num_tiles, num_sms):
    """Round w covers tiles [w S, (w + 1) S), reversed in odd rounds; over the
    rounds a persistent grid runs, every tile is visited once."""
    waves = -(-num_tiles // num_sms)
    t = schedule.snake_tile(np.arange(waves)[:, None], np.arange(num_sms)[None, :], num_sms)
    for w in range(waves):
        expected = w * num_sms + np.arange(num_sms)
        np.testing.assert_array_equal(t[w], expected if w % 2 == 0 else expected[::-1])
    live = t[t < num_tiles]
    np.testing.assert_array_equal(np.sort(live), np.arange(num_tiles))


def test_schedule_size_does_not_depend_on_group_sizes():
    shapes = {
        _schedule(jnp.asarray(s, jnp.int32), 1000, 128).group_T.shape
        for s in ([1000, 0, 0, 0], [250] * 4, [1, 1, 1, 997])
    }
    assert shapes == {(schedule.max_row_tiles(1000, 4, 128),)}


def test_schedules_and_alignment_lower_without_a_loop():
    """The tile schedule and the group alignment run in every MoE layer: their group
    lookups are binary searches written out, which XLA fuses, not a while loop (jnp's
    default), which on the GPU launches each of its steps' kernels on their own."""
    sizes = jnp.asarray([300, 0, 57, 667], jnp.int32)
    for fn in (lambda g: schedule.row_tile_schedule(g, 1024, 128),
               lambda g: quantized.align_groups(jnp.zeros((1024, 8)), g, 128)):
        text = jax.jit(fn).lower(sizes).as_text()
        assert "stablehlo.gather" in text and "stablehlo.while" not in text


@pytest.mark.parametrize("kind", tuning.KINDS)
@pytest.mark.parametrize("k, n", [(7168, 4096), (2048, 7168), (128, 128), (384, 640)])
def test_default_tiling_divides_every_supported_shape(kind, k, n):
    tiling = tuning.default_tiling(kind, k, n)
    assert tiling is not None and tuning.fits(tiling, kind, k, n)
    assert tuning.lookup(kind, jnp.bfloat16, k, n, gpu="h200") == tiling or tuning.fits(
        tuning.lookup(kind, jnp.bfloat16, k, n, gpu="h200"), kind, k, n
    )


@pytest.mark.parametrize("kind", tuning.KINDS)
def test_lookup_rejects_shapes_no_tile_divides(kind):
    with pytest.raises(ValueError, match="multiples of 128"):
        tuning.lookup(kind, jnp.bfloat16, 7168, 4000, gpu="h200")


def test_checked_in_table_entries_fit_their_shapes():
    table = tuning.load_table("h200")
    for (dtype, kind, k, n), tiling in table.items():
        assert dtype in ("bfloat16", "float16")
        assert tuning.fits(tiling, kind, k, n), (kind, k, n, tiling)


def test_tiling_validation():
    with pytest.raises(ValueError, match="multiples of 64"):
        tuning.GmmTiling(block_n=96)
    with pytest.raises(ValueError, match="num_stages"):
        tuning.TgmmTiling(num_stages=1)


@pytest.mark.parametrize(
    "x_shape, w_shape, dtype, ok",
    [
        ((65536, 7168), (32, 7168, 4096), jnp.bfloat16, True),
        ((100, 128), (3, 128, 256), jnp.float16, True),
        ((100, 128), (3, 128, 256), jnp.float32, False),
        ((100, 7168), (3, 7168, 1000), jnp.bfloat16, True),  # N padded to 1024
        ((100, 96), (3, 96, 256), jnp.bfloat16, True),  # K padded to 128
        ((0, 128), (3, 128, 256), jnp.bfloat16, False),
    ],
)
def test_supports_rules(x_shape, w_shape, dtype, ok):
    assert mosaic.supports(x_shape, w_shape, dtype) == ok


def test_unsupported_shapes_raise_clear_errors():
    x = jnp.zeros((64, 96), jnp.bfloat16)
    w = jnp.zeros((2, 96, 256), jnp.bfloat16)
    gs = jnp.array([32, 32], jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mosaic.gmm(x.astype(jnp.float32), w.astype(jnp.float32), gs)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        mosaic.tgmm(x.astype(jnp.float32), jnp.zeros((64, 256), jnp.float32), gs, num_groups=2)
    with pytest.raises(ValueError, match="G >= 1"):
        mosaic.gmm(x, w[:0], gs[:0])


def test_auto_backend_is_xla_without_hopper():
    from dropless.ops.gmm import resolve_backend

    assert not mosaic.is_available()
    assert resolve_backend("auto", (64, 128), (2, 128, 256), jnp.bfloat16) == "xla"
