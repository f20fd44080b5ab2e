"""Device-side tile schedules for the Mosaic GPU grouped matmul kernels.

Legend: M rows (grouped, contiguous, groups in order), G groups, T tiles,
S = G + 1 segments (the G groups, then the "tail" of rows past the total).

The forward/dgrad kernel walks a flat list of tiles, one per (row block,
segment) pair that intersect, so it needs no per-group unrolled code: it
reads its tile's ``(group, row_start, store_lo, store_hi)`` from small int32
arrays computed here with plain jnp (cumsum + searchsorted) before the kernel
launches. Nothing here syncs with the host or has a data-dependent shape: the
arrays have the static length ``max_row_tiles(M, G, block_m)`` and the number
of live tiles is a device scalar the kernel loops up to.

Row blocks lie on the global grid ``row_start = b * block_m``: Mosaic's tiled
(swizzled) TMA copies need the row offset to be a multiple of the 8-row smem
tile, so a tile cannot start at an arbitrary group start. A block holding a
group boundary is visited once per segment it intersects (each visit stores
only its rows ``[store_lo, store_hi)``), which is where the ``+ G`` of the
bound comes from. Tail tiles (rows past ``sum(group_sizes)``) carry group -1:
the kernel stores zeros there.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


def cdiv(a, b):
    return -(-a // b)


def max_row_tiles(m, num_groups, block_m):
    """Static bound on the number of row tiles: sum_s ceil(size_s / bm) over S = G+1 segments."""
    return cdiv(m, block_m) + num_groups


class RowTileSchedule(NamedTuple):
    """Tiles for gmm; arrays have the static length ``max_row_tiles``.

    group_T: int32 group of tile t; -1 for tail tiles (zeros) and padding.
    row_start_T: int32 first row of the tile's block, a multiple of block_m.
    store_lo_T, store_hi_T: int32 rows ``[lo, hi)`` of the block that belong to
      the tile's segment: the only rows the tile may write.
    num_tiles: int32 [1], number of live tiles (a prefix of the arrays).
    """

    group_T: jax.Array
    row_start_T: jax.Array
    store_lo_T: jax.Array
    store_hi_T: jax.Array
    num_tiles: jax.Array


def segment_bounds(group_sizes_G, m):
    """[G] starts and ends of each group's rows, clamped to ``[0, m]``.

    Negative sizes count as zero and a total above ``m`` is cut at ``m``, so
    a contract violation can never make a kernel address rows outside x.
    """
    sizes_G = jnp.maximum(group_sizes_G.astype(jnp.int32), 0)
    ends_G = jnp.minimum(jnp.cumsum(sizes_G), m).astype(jnp.int32)
    starts_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G[:-1]])
    return starts_G, ends_G


def row_tile_schedule(group_sizes_G, m, block_m):
    """The tile schedule of a gmm over ``m`` rows in row blocks of ``block_m``."""
    num_groups = group_sizes_G.shape[0]
    num_slots = max_row_tiles(m, num_groups, block_m)
    starts_G, ends_G = segment_bounds(group_sizes_G, m)
    seg_start_S = jnp.concatenate([starts_G, ends_G[-1:]])
    seg_end_S = jnp.concatenate([ends_G, jnp.full((1,), m, jnp.int32)])
    seg_group_S = jnp.concatenate(
        [jnp.arange(num_groups, dtype=jnp.int32), jnp.full((1,), -1, jnp.int32)]
    )
    first_block_S = seg_start_S // block_m
    # Blocks a non-empty segment touches; an empty segment touches none.
    seg_tiles_S = jnp.where(
        seg_end_S > seg_start_S, (seg_end_S - 1) // block_m - first_block_S + 1, 0
    )
    seg_last_S = jnp.cumsum(seg_tiles_S)  # inclusive prefix sum
    num_tiles = seg_last_S[-1]

    t_T = jnp.arange(num_slots, dtype=jnp.int32)
    # First segment whose inclusive tile count exceeds t: empty segments are skipped.
    # "scan_unrolled": the same binary search as jnp's default "scan", written out
    # (log2(G + 1) steps) so that XLA fuses it; the default is a while loop, which on the
    # GPU runs each of its steps as kernels of their own, in every layer.
    seg_T = jnp.minimum(
        jnp.searchsorted(seg_last_S, t_T, side="right", method="scan_unrolled"), num_groups
    ).astype(jnp.int32)
    block_T = first_block_S[seg_T] + t_T - (seg_last_S[seg_T] - seg_tiles_S[seg_T])
    row_start_T = block_T * block_m
    store_lo_T = jnp.maximum(seg_start_S[seg_T], row_start_T)
    store_hi_T = jnp.minimum(seg_end_S[seg_T], row_start_T + block_m)
    live_T = t_T < num_tiles
    return RowTileSchedule(
        group_T=jnp.where(live_T, seg_group_S[seg_T], -1).astype(jnp.int32),
        row_start_T=jnp.where(live_T, row_start_T, 0).astype(jnp.int32),
        store_lo_T=jnp.where(live_T, store_lo_T, 0).astype(jnp.int32),
        store_hi_T=jnp.where(live_T, store_hi_T, 0).astype(jnp.int32),
        num_tiles=num_tiles.reshape(1).astype(jnp.int32),
    )


def group_offsets(group_sizes_G, m):
    """[G] first row and row count of each group (clamped to m), for tgmm."""
    starts_G, ends_G = segment_bounds(group_sizes_G, m)
    return starts_G, ends_G - starts_G


def tgmm_steps(starts_G, sizes_G, block_m):
    """[G] pipeline steps of each tgmm tile of a group: its rows [start, start + size)
    from the start rounded down to ``block_m``, in steps of ``block_m`` rows; 0 when
    empty. Works on jnp and NumPy arrays alike."""
    first_row_G = starts_G // block_m * block_m
    return (starts_G + sizes_G - first_row_G + block_m - 1) // block_m * (sizes_G > 0)


def tgmm_group_order(group_sizes_G, m, block_m):
    """[G] int32 groups by descending step count (ties by group index), on device.

    The ``"sorted_snake"`` tile order of the weight-gradient kernels
    (``mosaic_gmm.walk_tiles``; ``block_m`` is the kernel's step along M) visits
    groups in this order, so the long tiles come first and the rounds of the
    persistent grid hold tiles of similar length.
    """
    starts_G, sizes_G = group_offsets(group_sizes_G, m)
    steps_G = tgmm_steps(starts_G, sizes_G, block_m)
    return jnp.argsort(-steps_G, stable=True).astype(jnp.int32)


def snake_tile(wave, sm, num_sms):
    """Flat tile index that CTA ``sm`` of ``num_sms`` takes in round ``wave``: rounds
    run left to right when even and right to left when odd, so over two rounds of
    tiles sorted by length every CTA gets one long and one short tile. Integer
    arithmetic only: works on traced scalars and on NumPy arrays."""
    odd = wave % 2
    return wave * num_sms + sm + odd * (num_sms - 1 - 2 * sm)
