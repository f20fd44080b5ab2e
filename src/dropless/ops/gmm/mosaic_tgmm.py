"""Hopper grouped weight gradient ("tgmm") in Pallas Mosaic GPU.

Legend: M rows, K and N the weight dims, G groups.

    dw[g] = x[rows of g]^T @ dy[rows of g]      -> [G, K, N]

Why our own kernel: jax's example ``transposed_ragged_dot_mgpu`` (one
warpgroup, no warp specialization) measured 567 TF/s on an H200 at M=65536,
G=32 against 718 TF/s for dense cuBLAS, and it masks neighbour rows by
multiplying by 0, which lets a NaN in a row past the total leak into dw.

Design:
- Persistent grid over all SMs walking (group, K band, N tile) output tiles,
  group-major, so the SMs share one group's rows of x and dy in L2 at a time.
  A tile costs its group's step count, so under skewed sizes a flat round
  robin (``tile_order="groups"``) can give some SMs more steps than others
  (most when a group has fewer tiles than there are SMs); the default
  ``"sorted_snake"`` evens that out (see ``tgmm``).
- Each tile contracts over its group's rows with a warp-specialized pipeline
  (one TMA warpgroup, two wgmma warpgroups, each owning block_k rows of K).
  Steps start at the group's first row rounded down to block_m (Mosaic's
  swizzled TMA copies need row offsets that are multiples of the 8-row smem
  tile), so the first and last step can hold rows of the neighbour groups
  (or past the total): both operand tiles of those steps are masked in smem
  with a select (not a multiply: 0 * NaN is NaN), each warpgroup its own
  columns of x and the first one the shared dy tile, then both meet at an
  smem barrier before their wgmma. The number of steps is
  read on device; no code depends on G.
- x is the transposed (A) wgmma operand, read through an smem transpose.
- Empty groups store zero tiles.
- ``TgmmTiling(chain=True)``: one pipeline over all of a CTA's tiles
  (``mosaic_gmm.chained_tile_pipeline``), so the memory warpgroup loads the next
  tile's first steps while the compute warpgroups store; the same steps and
  masks per tile, so the same bits. Where groups are small (G=256 at M=65536:
  256 rows, 4 steps of 64 per tile) the per-tile start is a large share. On the
  H200 at K=7168 N=4096 it ran 785 TF/s against 766 at G=32 and 548 against 510
  at G=256 (``benchmarks/gmm.py --tune``; records
  ``gmm-deepseek-tune-chain-20261203-1306`` and
  ``gmm-deepseek-g256-tune-chain-20261203-1323``, logs of the same names).
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.ops.gmm import schedule as schedule_lib
from dropless.ops.gmm.mosaic_gmm import (_EPI, _MEMORY_REGISTERS, _swizzle_transforms,
                                         batched_store, chained_tile_pipeline, persistent_kernel,
                                         tile_order_operands, walk_tiles)
from dropless.ops.gmm.tuning import TgmmTiling


def check_shapes(x_shape, dy_shape, tiling):
    """Raise ValueError unless the kernel takes these shapes with this tiling."""
    m, k = x_shape
    m2, n = dy_shape
    if m != m2:
        raise ValueError(f"mosaic tgmm: x {x_shape} and dy {dy_shape} must share M")
    if k % (2 * tiling.block_k):
        raise ValueError(f"mosaic tgmm: {k=} must be a multiple of 2 * {tiling.block_k=}")
    if n % tiling.block_n:
        raise ValueError(f"mosaic tgmm: {n=} must be a multiple of {tiling.block_n=}")
    if m < 1 or m % 8:
        # Swizzled TMA views tile the rows in 8s (``mosaic.tgmm`` pads rows).
        raise ValueError(f"mosaic tgmm: rows {m=} must be a positive multiple of 8")
    return m, k, n


def tgmm(x_MK, dy_MN, group_sizes_G, *, num_groups, tiling: TgmmTiling, out_dtype=None,
         sms=None, tile_order="sorted_snake"):
    """Grouped x^T dy; see the module docstring. Returns [G, K, N] in out_dtype.

    ``tile_order`` (``mosaic_gmm.TILE_ORDERS``) picks which CTA computes which output tile,
    not the result's bits (``mosaic_gmm.walk_tiles``): ``"groups"`` is the flat
    round robin, ``"sorted_snake"`` balances the SMs' step counts under skewed
    group sizes. Here the latter also gives up visiting groups in memory order:
    the rows a boundary step shares with the next group are no longer read
    again right after.

    The default is ``"sorted_snake"``: on the H200 (``tgmm_order-20261202-131005``,
    M=65536) it ran 1.03-1.18x faster under Dirichlet(1.0) and Dirichlet(0.3)
    group sizes (G=32 K=7168 N=4096: 6.04 -> 5.66 ms) and cost 0.3-0.7% at
    G=32 and 2-3% at G=128 with equal sizes. Routed tokens are skewed (the
    proxy trains at a load coefficient of variation of 1.2-1.5).

    Raises:
      ValueError for shapes the kernel cannot take or an unknown ``tile_order``.
    """
    m, k, n = check_shapes(x_MK.shape, dy_MN.shape, tiling)
    out_dtype = jnp.dtype(out_dtype or x_MK.dtype)
    bk, bn, bm = tiling.block_k, tiling.block_n, tiling.block_m
    cta_k = 2 * bk
    k_bands, n_tiles = k // cta_k, n // bn
    # 4-byte outputs double the epilogue buffer; one load stage less keeps smem in bounds.
    num_stages = tiling.num_stages if out_dtype.itemsize <= 2 else min(tiling.num_stages, 3)
    starts_G, sizes_G = schedule_lib.group_offsets(group_sizes_G, m)
    x_transforms = _swizzle_transforms(cta_k, x_MK.dtype)
    dy_transforms = _swizzle_transforms(bn, dy_MN.dtype)
    out_transforms = _swizzle_transforms(_EPI, out_dtype)

    def make_pipeline(mma_body, compute_context, steps):
        return plgpu.emit_pipeline_warp_specialized(
            mma_body,
            grid=(steps,),
            memory_registers=_MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, cta_k), lambda s: (s, 0), transforms=x_transforms),
                plgpu.BlockSpec((bm, bn), lambda s: (s, 0), transforms=dy_transforms),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=num_stages,
            compute_context=compute_context,
        )

    order_refs = tile_order_operands(tile_order, group_sizes_G, m, bm)

    def geometry(starts_ref, sizes_ref, g):
        """Group g's (size; first row, rounded down to block_m; step count if it is not
        empty; rows of the neighbour before it in the first step; end of its rows in
        the last step)."""
        start = starts_ref[g]
        size = sizes_ref[g]
        first_row = pl.multiple_of((start // bm) * bm, bm)
        steps = (start + size - first_row + bm - 1) // bm
        head = start - first_row
        return size, first_row, steps, head, start + size - first_row - (steps - 1) * bm

    def tile_store(o_gmem, out_smem, wg, g, k_band, n_tile):
        """Store this warpgroup's part of output tile (g, k_band, n_tile)."""
        return functools.partial(
            _store_tile, out_smem=out_smem, wg=wg, bk=bk, bn=bn,
            dst=o_gmem.at[g, pl.ds(k_band * cta_k + wg * bk, bk), pl.ds(n_tile * bn, bn)],
        )

    def mma_step(wg, mask_barrier, step, steps, head, end_in_last, x_smem, dy_smem, acc_ref):
        """One step: mask the rows of other groups (first and last step), then the wgmma."""
        x_half = x_smem.at[:, pl.ds(wg * bk, bk)]

        lo = jnp.where(step == 0, head, 0)
        hi = jnp.where(step == steps - 1, end_in_last, bm)

        @pl.when((lo > 0) | (hi < bm))
        def _mask_foreign_rows():
            _mask_rows(x_half, lo, hi)  # this warpgroup's own columns of x

            @pl.when(wg == 0)
            def _mask_shared_dy():
                _mask_rows(dy_smem, lo, hi)

            plgpu.commit_smem()
            plgpu.barrier_arrive(mask_barrier)
            plgpu.barrier_wait(mask_barrier)

        plgpu.wgmma(acc_ref, x_half.T, dy_smem)
        plgpu.wgmma_wait(0)
        return acc_ref

    def body(starts_ref, sizes_ref, *refs):
        *order_ref, x_gmem, dy_gmem, o_gmem = refs  # order_ref: [] or [the group order]
        ignore = lambda *_, **__: None
        pipeline_allocs = make_pipeline(ignore, ignore, num_stages).get_allocations(
            x_gmem.at[pl.ds(0, bm), pl.ds(0, cta_k)], dy_gmem.at[pl.ds(0, bm), pl.ds(0, bn)]
        )

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=pipeline_allocs,
            out_smem=plgpu.SMEM((2, 2, _EPI, _EPI), out_dtype, transforms=out_transforms),
            mask_barrier=plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem, mask_barrier):
            wg = lax.axis_index("wg")

            @walk_tiles((num_groups, k_bands, n_tiles), *order_ref)
            def _tile(g, k_band, n_tile):
                size, first_row, steps, head, end_in_last = geometry(starts_ref, sizes_ref, g)
                store = tile_store(o_gmem, out_smem, wg, g, k_band, n_tile)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bk, bn), jnp.float32))
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        store(acc_ref[...].astype(out_dtype))

                def mma_body(idx, x_smem, dy_smem, acc_ref):
                    (step,) = idx
                    return mma_step(wg, mask_barrier, step, steps, head, end_in_last, x_smem,
                                    dy_smem, acc_ref)

                @pl.when(size > 0)
                def _contract():
                    rows = pl.ds(first_row, m)  # may run past M: TMA zero-fills, and we mask
                    make_pipeline(mma_body, compute_context, steps)(
                        x_gmem.at[rows, pl.ds(k_band * cta_k, cta_k)],
                        dy_gmem.at[rows, pl.ds(n_tile * bn, bn)],
                        allocations=pipeline_allocs,
                    )

                @pl.when((size == 0) & (wg < 2))
                def _empty_group():
                    store(plgpu.layout_cast(jnp.zeros((bk, bn), out_dtype), plgpu.Layout.WGMMA))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def chained_body(starts_ref, sizes_ref, *refs):
        """``tiling.chain``: ``mosaic_gmm.chained_tile_pipeline`` over this CTA's tiles."""
        *order_ref, x_gmem, dy_gmem, o_gmem = refs

        @functools.partial(
            pl.run_scoped,
            out_smem=plgpu.SMEM((2, 2, _EPI, _EPI), out_dtype, transforms=out_transforms),
            mask_barrier=plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )
        def _scope(out_smem, mask_barrier):
            wg = lax.axis_index("wg")

            def tile_of(g):
                size, *info = geometry(starts_ref, sizes_ref, g)  # first_row, steps, ...
                return jnp.where(size > 0, info[1], 0), info

            def sources_of(info, k_band, n_tile, s):
                rows = pl.ds(info[0], m)  # may run past M: TMA zero-fills, and we mask
                step_rows = pl.ds(s * bm, bm)
                return (x_gmem.at[rows, pl.ds(k_band * cta_k, cta_k)].at[step_rows],
                        dy_gmem.at[rows, pl.ds(n_tile * bn, bn)].at[step_rows])

            def compute(g, k_band, n_tile, real, info, loop):
                _, steps, head, end_in_last = info

                @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bk, bn), jnp.float32))
                def it_end(acc_ref):  # an empty group's tile stores the zeros it starts as
                    _, it = loop(lambda s, slots, acc: mma_step(wg, mask_barrier, s, steps, head,
                                                               end_in_last, *slots, acc), acc_ref)

                    @pl.when(real)
                    def _store():
                        tile_store(o_gmem, out_smem, wg, g, k_band, n_tile)(
                            acc_ref[...].astype(out_dtype))

                    return it

                return it_end

            chained_tile_pipeline(
                (num_groups, k_bands, n_tiles), order_ref[0] if order_ref else None, wg=wg,
                buffers=(
                    plgpu.SMEM((num_stages, bm, cta_k), x_MK.dtype, transforms=x_transforms),
                    plgpu.SMEM((num_stages, bm, bn), dy_MN.dtype, transforms=dy_transforms)),
                tile_of=tile_of, sources_of=sources_of, compute=compute)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = persistent_kernel(chained_body if tiling.chain else body,
                               jax.ShapeDtypeStruct((num_groups, k, n), out_dtype), sms, name="tgmm")
    return kernel(starts_G, sizes_G, *order_refs, x_MK, dy_MN)


def _mask_rows(tile_ref, lo, hi):
    """Zero the rows outside [lo, hi) of an smem tile, in place, with a select."""
    vals = tile_ref[...]
    rows = plgpu.layout_cast(
        lax.broadcasted_iota(jnp.int32, vals.shape, 0), plgpu.Layout.WGMMA
    )
    tile_ref[...] = jnp.where((rows >= lo) & (rows < hi), vals, jnp.zeros_like(vals))


def _store_tile(out, *, out_smem, wg, bk, bn, dst, batched=False):
    """Store a warpgroup's [bk, bn] result through swizzled smem chunks.

    The chunk is a slot of ``out_smem`` [warpgroups, slots, rows, columns]: 64x64
    here and in the FP8 wgrad at 128 columns per warpgroup; 64x32 for its 160. Chunk by
    chunk (the default): each chunk waits for its slot, is written, fenced
    (``commit_smem``: the async-proxy fence and a warpgroup barrier) and stored, one
    store in flight while the next slot fills. ``batched``: when the warpgroup's slots
    hold the whole tile, every chunk is written first and one ``commit_smem`` fences
    them all before the stores: one fence and barrier per tile instead of one per chunk
    (the FP8 wgrad's epilogue spent most of its samples in those at 2 steps per tile,
    ``kernel_anatomy-20261204-105729``). Same stores of the same values either way.
    """
    ch, cw = out_smem.shape[-2:]
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    if batched:
        batched_store(out, bk, bn, out_smem.shape[1], lambda slot: out_smem.at[wg, slot],
                      lambda i, j: dst.at[pl.ds(i * ch, ch), pl.ds(j * cw, cw)], (ch, cw))()
        return
    for i in range(bk // ch):
        for j in range(bn // cw):
            slot = (i * (bn // cw) + j) % 2
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem[wg, slot] = out[i * ch:(i + 1) * ch, j * cw:(j + 1) * cw]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, slot],
                dst.at[pl.ds(i * ch, ch), pl.ds(j * cw, cw)],
            )
