"""Hopper grouped matmul (forward and dgrad) in Pallas Mosaic GPU.

Legend: M rows, K contraction, N output columns, G groups, T row tiles.

    y[rows of g] = x[rows of g] @ w[g]        (fwd:   w is [G, K, N])
    y[rows of g] = x[rows of g] @ w[g]^T      (dgrad: w is [G, N, K], read
                                               transposed through smem, no copy)

Why our own kernel: jax's example ``ragged_dot_mgpu`` (one warpgroup, no warp
specialization, per-group unrolled tile lookup) measured 592 TF/s forward
against 718 TF/s for dense cuBLAS on an H200 at M=65536, G=32, and its
``GroupInfo`` is O(G) code; ``lax.ragged_dot`` runs at 23 TF/s there.

Design:
- A device-side schedule (``schedule.row_tile_schedule``) lists one tile per
  (row block, group) pair that intersect; the kernel reads its tile's
  ``(group, row_start, store_lo, store_hi)`` from small int32 arrays, so code
  size and compile time do not depend on G.
- Persistent grid over all SMs (queried from the device); the loop bound is
  the live tile count x column bands, read on device, so padding tiles cost
  nothing.
- Warp specialization as in jax's ``hopper_matmul_mgpu``: a memory warpgroup
  streams TMA loads into a ``num_stages``-deep smem ring, two compute
  warpgroups each run wgmma on a block_m x block_n half of the CTA tile.
- Row blocks sit on the global block_m grid because Mosaic's swizzled TMA
  copies need row offsets that are multiples of the 8-row smem tile. A block
  holding a group boundary is computed once per group in it.
- Epilogue: a tile whose block lies inside its group goes out through
  swizzled 64x64 smem tiles and TMA stores. A boundary tile stores exactly
  its rows ``[store_lo, store_hi)``: it goes through an unswizzled buffer
  (aliased with the swizzled one) and a ladder of power-of-two-row TMA
  stores. Tail tiles store zeros, so rows past ``sum(group_sizes)`` are
  written in the same pass. Rows past M are clipped by TMA.

Shared by the package's other kernels: ``persistent_kernel`` (the kernel shape
all of them have) and, for the two weight-gradient kernels, ``walk_tiles``
(which CTA computes which output tile).
"""

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.ops.gmm import schedule as schedule_lib
from dropless.ops.gmm.tuning import GmmTiling

_EPI = 64  # epilogue tile edge: one 128-byte swizzle row of bf16
_MEMORY_REGISTERS = 40  # the TMA warpgroup needs few registers; the rest go to wgmma


def num_sms(device=None):
    """Streaming multiprocessors of the device (1 where the device has none, e.g. interpret mode)."""
    device = device or jax.devices()[0]
    return int(getattr(device, "core_count", 0) or 1)


def persistent_kernel(body, out_type, sms=None, *, name, cluster=1):
    """``body`` as a persistent, warp-specialised kernel: one CTA per SM (``sms``
    or the device's count), three warpgroups ``wg`` (0, 1 compute; 2 TMA), warpgroup
    lowering. Every kernel of this package has this shape. ``name`` names the CUDA
    kernel (``<name>_mosaic_gpu_kernel``), so a profile tells the kernels apart.

    ``cluster=2``: the CTAs run in clusters of two (axis ``"cluster"``), and the grid
    axis ``"sm"`` counts clusters (``sms // 2`` of them): the two CTAs of a cluster
    see the same ``"sm"`` index, so a walk over ``"sm"`` gives both the same tiles
    (``mosaic_fp8.gmm_fp8_blockwise``'s multicast of the shared weight tile).

    Returns ``call(*operands)``. Inside ``shard_map`` (the MoE layer's experts run
    there) the output varies over the mesh axes its operands vary over
    (``vary_like``); typed as the same on every rank, it made the backward pass
    of expert parallelism fail to type-check.
    """

    if cluster not in (1, 2):
        raise ValueError(f"{name}: {cluster=} must be 1 or 2")

    def call(*operands):
        clusters = (sms or num_sms()) // cluster
        out = plgpu.kernel(
            body,
            out_type=out_type,
            grid=(clusters,),
            grid_names=("sm",),
            **(dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}),
            num_threads=3,
            thread_name="wg",
            kernel_name=name,
            compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        )(*operands)
        return vary_like(out, operands)

    return call


def vary_like(out, operands):
    """``out`` typed as varying over every mesh axis any of ``operands`` varies over
    (inside ``shard_map``; unchanged outside). ``plgpu.kernel`` types its outputs
    as the same on every rank. The cast is a no-op at run time; its transpose
    (a psum) never runs, because every kernel call sits inside a custom_vjp rule."""
    want = frozenset().union(*(_varying(a) for a in operands))
    missing = tuple(sorted(want - _varying(out)))
    return jax.lax.pcast(out, missing, to="varying") if missing else out


def _varying(a) -> frozenset:
    axis_type = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(axis_type.varying) if axis_type is not None else frozenset()


# How the weight-gradient kernels (bf16 ``mosaic_tgmm``, FP8 ``mosaic_fp8_tgmm``) hand
# their (group, K tile, N tile) output tiles to CTAs; see ``walk_tiles``.
TILE_ORDERS = ("groups", "sorted_snake")


def tile_order_operands(tile_order, group_sizes_G, m, block_m):
    """The extra kernel operands ``walk_tiles`` reads for ``tile_order``: none for
    ``"groups"``; for ``"sorted_snake"`` the [G] group order by descending step count
    (``schedule.tgmm_group_order``), where ``block_m`` must be the kernel's own step
    along M, so the order ranks groups by the steps their tiles really take.

    Raises:
      ValueError for a tile_order not in ``TILE_ORDERS``.
    """
    if tile_order not in TILE_ORDERS:
        raise ValueError(f"{tile_order=} is not one of {TILE_ORDERS}")
    if tile_order == "groups":
        return ()
    return (schedule_lib.tgmm_group_order(group_sizes_G, m, block_m),)


def walk_tiles(grid, order_ref_G=None):
    """Decorator: call ``tile(g, k_tile, n_tile)`` for this CTA's share of the
    weight-gradient ``grid`` (G, K tiles, N tiles) of a ``persistent_kernel``.

    A tile costs its group's step count, so the order decides how evenly the SMs
    are loaded under skewed group sizes; every tile is still computed whole by
    one CTA in the same steps, so the result is the same bit for bit:
    - without ``order_ref_G`` (``"groups"``): ``nd_loop``'s round robin over the
      flat grid, tile i on CTA i mod SMs. A CTA gets whatever mix of long and
      short tiles its slots fall on: most uneven when a group has fewer tiles
      than there are SMs (``benchmarks/tgmm_balance.py`` models both orders).
    - with it (``"sorted_snake"``, ``tile_order_operands``): grid rank r is group
      ``order_ref_G[r]`` (descending step count) and the rounds of the grid run
      as a snake (``schedule.snake_tile``), so every CTA gets about the same
      number of steps. The last round may be partial: CTAs skip indices past
      the grid. Both orders are group-major, so the SMs share one group's rows
      in L2 at a time; this one costs an argsort of G step counts before the
      launch and one more int32 read per tile.
    """

    def decorator(tile):
        if order_ref_G is None:
            plgpu.nd_loop(grid, collective_axes="sm")(lambda info: tile(*info.index))
            return
        num_groups, k_tiles, n_tiles = grid
        num_tiles = num_groups * k_tiles * n_tiles
        sm, num_sms = lax.axis_index("sm"), lax.axis_size("sm")

        @pl.loop(0, (num_tiles + num_sms - 1) // num_sms)
        def _round(wave):
            t = schedule_lib.snake_tile(wave, sm, num_sms)

            @pl.when(t < num_tiles)
            def _visit():
                tile(*_tile_indices(grid, t, order_ref_G))

    return decorator


def _tile_indices(grid, t, order_ref_G):
    """(g, k_tile, n_tile) of flat grid index ``t``; group rank r is group
    ``order_ref_G[r]`` when given (``walk_tiles``)."""
    _, k_tiles, n_tiles = grid
    rank, rest = t // (k_tiles * n_tiles), t % (k_tiles * n_tiles)
    g = rank if order_ref_G is None else order_ref_G[rank]
    return g, rest // n_tiles, rest % n_tiles


def walk_tiles_carry(grid, tile, init, order_ref_G=None):
    """``walk_tiles``'s order with a carry: ``tile(g, k_tile, n_tile, real, carry)`` returns
    the next carry, for every round of the CTA's walk; returns the last carry. A CTA
    whose last round falls past the grid gets ``real`` False there (and the last tile's
    indices): the caller must neither load nor store for it. For loops that run on
    from one tile into the next (``chained_tile_pipeline``)."""
    sm, num_sms = lax.axis_index("sm"), lax.axis_size("sm")

    def visit(wave, carry):
        return tile(*_round_tile(grid, wave, sm, num_sms, order_ref_G), carry)

    return lax.fori_loop(0, _num_rounds(grid, num_sms), visit, init)


def _num_rounds(grid, num_sms):
    """Rounds of a CTA's walk over ``grid``: the tiles over the SMs, rounded up."""
    return (math.prod(grid) + num_sms - 1) // num_sms


def _round_tile(grid, wave, sm, num_sms, order_ref_G):
    """(g, k_tile, n_tile, real) of CTA ``sm``'s tile in round ``wave`` of the walk
    ``walk_tiles`` describes; past the grid, the last tile's indices with ``real``
    False."""
    num_tiles = math.prod(grid)
    if order_ref_G is None:  # "groups": nd_loop's round robin
        t = wave * num_sms + sm
    else:  # "sorted_snake"
        t = schedule_lib.snake_tile(wave, sm, num_sms)
    real = t < num_tiles
    return (*_tile_indices(grid, jnp.minimum(t, num_tiles - 1), order_ref_G), real)


def walk_tiles_prefetched(grid, tile, init, order_ref_G, tile_of):
    """``walk_tiles_carry`` with each tile's group data read ahead: ``tile(g, k_tile,
    n_tile, real, meta, carry)`` gets ``meta = tile_of(g)`` already loaded. The round
    after next's group index (``order_ref_G[rank]``) and the next round's ``tile_of``
    are read at the start of each round and used only in the rounds after, so neither
    global-load latency sits before a tile's first step, where ``walk_tiles_carry``
    puts both, one after the other (25% of the FP8 wgrad's compute samples at 2 steps
    per tile were before the first step, ``kernel_anatomy-20261204-105729``). The
    same tiles in the same order: the same bits. Reads past the last round name the
    last tile (read, never used)."""
    sm, num_sms = lax.axis_index("sm"), lax.axis_size("sm")

    def indices(wave):
        return _round_tile(grid, wave, sm, num_sms, order_ref_G)

    def with_meta(idx):
        return idx, tile_of(idx[0])

    def visit(wave, carry):
        user, (idx, meta), idx_next = carry
        ahead = indices(wave + 2), with_meta(idx_next)  # issued now, used next round
        user = tile(*idx, meta, user)
        return user, ahead[1], ahead[0]

    first = (with_meta(indices(0)), indices(1))
    return lax.fori_loop(0, _num_rounds(grid, num_sms), visit, (init, *first))[0]


# A chained tile pipeline's compute warpgroups take what the memory warpgroup leaves of
# the 512 registers per thread slot, split in two and rounded down to 8 (as
# ``emit_pipeline_warp_specialized`` does).
_COMPUTE_REGISTERS = (512 - _MEMORY_REGISTERS) // 2 // 8 * 8


def chained_tile_pipeline(grid, order_ref_G, *, wg, buffers, tile_of, sources_of, compute,
                          prefetch=False):
    """One warp-specialised pipeline over all of this CTA's weight-gradient tiles: the
    slot counter and the barriers' phases run on from one tile into the next, so the
    memory warpgroup (``wg`` 2) loads a tile's first steps while the compute
    warpgroups (0, 1) finish the tile before (DeepGEMM's structure). jax's own
    chaining (``pipeline_state``) needs a static step count that is a multiple of the
    stages; a group's step count is read on the device. Call it from every
    warpgroup: it allocates the stage buffers and their two barriers (``loaded``: one
    TMA copy per buffer arrives; ``consumed``: each compute warpgroup arrives once it
    has read the slot).

    Args:
      grid, order_ref_G: the tiles and their order, as ``walk_tiles``.
      buffers: ``plgpu.SMEM`` types [stages, ...], one per operand of a step.
      tile_of(g): (the tiles' step count in group g, 0 if it is empty; ``info``, what
        ``sources_of`` and ``compute`` need of the group), read once per tile.
      sources_of(info, k_tile, n_tile, s): the gmem refs of step s, one per buffer.
      compute(g, k_tile, n_tile, real, info, loop): a compute warpgroup's work on a
        tile, ``real`` False past the grid (store nothing). It calls
        ``loop(body, init)`` once, which runs ``carry = body(s, slot_refs, carry)``
        over the tile's steps and returns (the last carry, the slot counter after
        them), and it returns that counter (so the counter leaves any ``run_scoped``
        it was made in).
      prefetch: read each tile's group data rounds ahead (``walk_tiles_prefetched``)
        instead of at the tile's start (``walk_tiles_carry``); the same bits.
    """
    num_stages = buffers[0].shape[0]

    def walk(tile):
        """Both sides' walk over the CTA's tiles: ``tile(g, k, n, real, (count, info), it)``."""
        if prefetch:
            return walk_tiles_prefetched(grid, tile, jnp.int32(0), order_ref_G, tile_of)
        return walk_tiles_carry(grid, lambda g, k, n, real, it: tile(g, k, n, real, tile_of(g), it),
                                jnp.int32(0), order_ref_G)

    @functools.partial(
        pl.run_scoped,
        buffers=list(buffers),
        loaded=plgpu.Barrier(num_arrivals=len(buffers), num_barriers=num_stages),
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=num_stages),
        collective_axes="wg",
    )
    def _scope(buffers, loaded, consumed):
        @pl.when(wg == 2)
        def _memory():
            plgpu.set_max_registers(_MEMORY_REGISTERS, action="decrease")

            def tile(g, k_tile, n_tile, real, meta, it):
                count, info = meta

                def load(s, it):
                    slot = lax.rem(it, num_stages)

                    @pl.when(it >= num_stages)
                    def _wait_for_the_slot():
                        plgpu.barrier_wait(consumed.at[slot])

                    for src, dst in zip(sources_of(info, k_tile, n_tile, s), buffers,
                                        strict=True):
                        plgpu.copy_gmem_to_smem(src, dst.at[slot], loaded.at[slot])
                    return it + 1

                return lax.fori_loop(0, jnp.where(real, count, 0), load, it)

            loads = walk(tile)

            # See the last stages' slots consumed before the barriers go (as jax's
            # pipeline does): no arrival is left unobserved.
            @pl.loop(jnp.maximum(loads - num_stages, 0), loads)
            def _quiesce(it):
                plgpu.barrier_wait(consumed.at[lax.rem(it, num_stages)])

        @pl.when(wg < 2)
        def _compute():
            plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")

            def tile(g, k_tile, n_tile, real, meta, it):
                count, info = meta

                def loop(body, init):
                    def step(s, carry):
                        it, acc = carry
                        slot = lax.rem(it, num_stages)
                        plgpu.barrier_wait(loaded.at[slot])
                        acc = body(s, [b.at[slot] for b in buffers], acc)
                        plgpu.barrier_arrive(consumed.at[slot])
                        return it + 1, acc

                    it_end, acc = lax.fori_loop(0, jnp.where(real, count, 0), step, (it, init))
                    return acc, it_end

                return compute(g, k_tile, n_tile, real, info, loop)

            walk(tile)


def walk_row_tiles(num_tiles, num_real, n_bands, grid_tile_width, chain):
    """Decorator: call ``tile(t, band, state)`` for this CTA's share of a forward-style
    kernel's (row tile, column band) grid, ``num_tiles`` row tiles of which the first
    ``num_real`` have a group (``schedule.row_tile_schedule``: the rows past the total
    come last).

    Without ``chain``: one ``nd_loop`` over the whole grid, walking
    ``grid_tile_width`` row tiles per band (``planar_snake``: concurrent CTAs share
    rows of x and columns of w in L2), ``state`` None.
    With ``chain``: the zero tiles first, in a loop of their own (``state`` None), then
    the real tiles in the same walk, each CTA's as one chain of pipelines
    (``emit_pipeline_warp_specialized``'s ``pipeline_state``: START, STEADY..., STOP,
    a traced value), so the memory warpgroup loads a tile's first steps while the
    compute warpgroups finish the one before; a CTA's chain of one tile gets ``state``
    None (an ordinary pipeline: it must both start and stop). The chain needs the
    pipeline's step count to be a multiple of its stages (the caller's to check).
    """

    def decorator(tile):
        if not chain:
            @plgpu.nd_loop((num_tiles * n_bands,), collective_axes="sm")
            def _tile_loop(loop_info):
                t, band = plgpu.planar_snake(loop_info.index[0], (num_tiles, n_bands), 0,
                                             grid_tile_width)
                tile(t, band, None)
            return

        @plgpu.nd_loop(((num_tiles - num_real) * n_bands,), collective_axes="sm")
        def _zero_loop(loop_info):
            flat = loop_info.index[0]
            tile(num_real + lax.div(flat, n_bands), lax.rem(flat, n_bands), None)

        @plgpu.nd_loop((num_real * n_bands,), collective_axes="sm")
        def _chain_loop(loop_info):
            t, band = plgpu.planar_snake(loop_info.index[0], (num_real, n_bands), 0,
                                         grid_tile_width)
            i, n = loop_info.local_index, loop_info.num_local_steps
            stage = plgpu.PipelinePipeline
            pl.when(n == 1)(lambda: tile(t, band, None))
            state = jnp.where(i == 0, int(stage.START),
                              jnp.where(i == n - 1, int(stage.STOP), int(stage.STEADY)))
            pl.when(n > 1)(lambda: tile(t, band, state))

    return decorator


def num_real_tiles(sched, chain):
    """[1] int32: the row tiles of ``sched`` that have a group (they come first); only
    a chained walk reads it, so without ``chain`` it is ``num_tiles`` as is (no extra
    XLA reduction before each launch)."""
    if not chain:
        return sched.num_tiles
    return jnp.sum(sched.group_T >= 0, dtype=jnp.int32).reshape(1)


def _swizzle_transforms(minor_elems, dtype):
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def check_shapes(x_shape, w_shape, tiling, transpose_rhs):
    """Raise ValueError unless the kernel takes these shapes with this tiling."""
    m, k = x_shape
    _, kw, nw = w_shape
    k_in, n_out = (nw, kw) if transpose_rhs else (kw, nw)
    if k != k_in:
        raise ValueError(f"mosaic gmm: x has {k} columns but w contracts over {k_in}")
    if k % tiling.block_k:
        raise ValueError(f"mosaic gmm: contraction {k=} must be a multiple of {tiling.block_k=}")
    if n_out % (2 * tiling.block_n):
        raise ValueError(
            f"mosaic gmm: output columns {n_out=} must be a multiple of 2 * {tiling.block_n=}"
        )
    if m < 1 or m % 8:
        # Swizzled TMA views tile the rows in 8s (``mosaic.gmm`` pads rows).
        raise ValueError(f"mosaic gmm: rows {m=} must be a positive multiple of 8")
    return m, k, n_out


def gmm(x_MK, w, group_sizes_G, *, tiling: GmmTiling, transpose_rhs=False, out_dtype=None,
        sms=None):
    """Grouped matmul; see the module docstring. Returns [M, N_out] in out_dtype."""
    m, k, n_out = check_shapes(x_MK.shape, w.shape, tiling, transpose_rhs)
    out_dtype = jnp.dtype(out_dtype or x_MK.dtype)
    bm, bn, bk = tiling.block_m, tiling.block_n, tiling.block_k
    cta_n = 2 * bn
    n_bands = n_out // cta_n
    k_steps = k // bk
    # 4-byte outputs double the epilogue buffers; one load stage less keeps smem in bounds.
    num_stages = tiling.num_stages if out_dtype.itemsize <= 2 else min(tiling.num_stages, 3)
    # ``tiling.chain`` where the chain's slots line up (``GmmTiling``); else the plain walk.
    chain = tiling.chain and k_steps % num_stages == 0
    sched = schedule_lib.row_tile_schedule(group_sizes_G, m, bm)
    in_transforms = _swizzle_transforms(bk, x_MK.dtype)
    out_transforms = _swizzle_transforms(_EPI, out_dtype)

    def make_pipeline(mma_body, compute_context, pipeline_state=None):
        w_block = (cta_n, bk) if transpose_rhs else (bk, cta_n)
        w_index = (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0))
        return plgpu.emit_pipeline_warp_specialized(
            mma_body,
            grid=(k_steps,),
            memory_registers=_MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=in_transforms),
                plgpu.BlockSpec(w_block, w_index, transforms=in_transforms),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=num_stages,
            compute_context=compute_context,
            pipeline_state=pipeline_state,
        )

    def body(group_ref, row_start_ref, lo_ref, hi_ref, num_tiles_ref, num_real_ref, x_gmem, w_gmem,
             o_gmem):
        ignore = lambda *_, **__: None
        w_alloc_ref = w_gmem.at[0, :, pl.ds(0, cta_n)] if not transpose_rhs else w_gmem.at[0, pl.ds(0, cta_n)]
        pipeline_allocs = make_pipeline(ignore, ignore).get_allocations(
            x_gmem.at[pl.ds(0, bm)], w_alloc_ref
        )

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=pipeline_allocs,
            # One union per compute warpgroup: its swizzled tiles (whole-tile
            # stores) alias its unswizzled rows (row-exact stores). A union
            # shared by both warpgroups would let one warpgroup's rows overlap
            # the other's tiles while they work on different output tiles.
            out_smem=[
                plgpu.RefUnion(
                    plgpu.SMEM((2, _EPI, _EPI), out_dtype, transforms=out_transforms),
                    plgpu.SMEM((_EPI, bn), out_dtype),
                )
                for _ in range(2)
            ],
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            @walk_row_tiles(num_tiles_ref[0], num_real_ref[0], n_bands, tiling.grid_tile_width,
                            chain)
            def _tile(t, band, state):
                group = group_ref[t]
                row_start = pl.multiple_of(row_start_ref[t], bm)
                col0 = pl.multiple_of(band * cta_n + wg * bn, bn)
                lo, hi = lo_ref[t], hi_ref[t]

                def store(out):
                    for w in range(2):  # static buffers per warpgroup
                        @pl.when(wg == w)
                        def _store_own():
                            tiles_smem, rows_smem = out_smem[w]
                            _store_tile(
                                out, tiles_smem=tiles_smem, rows_smem=rows_smem, o_gmem=o_gmem,
                                m=m, bm=bm, bn=bn, row_start=row_start, col0=col0, lo=lo, hi=hi,
                            )

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, bn), jnp.float32))
                    def _acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        store(acc_ref[...].astype(out_dtype))

                def mma_body(_, x_smem, w_smem, acc_ref):
                    if transpose_rhs:
                        rhs = w_smem.at[pl.ds(wg * bn, bn)].T
                    else:
                        rhs = w_smem.at[:, pl.ds(wg * bn, bn)]
                    plgpu.wgmma(acc_ref, x_smem, rhs)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                def matmul_tile():
                    w_cols = pl.ds(band * cta_n, cta_n)
                    w_ref = w_gmem.at[group, w_cols] if transpose_rhs else w_gmem.at[group, :, w_cols]
                    make_pipeline(mma_body, compute_context, state)(
                        x_gmem.at[pl.ds(row_start, bm)], w_ref, allocations=pipeline_allocs
                    )

                if state is None:
                    pl.when(group >= 0)(matmul_tile)
                else:  # a chained tile is a real one (walk_row_tiles)
                    matmul_tile()

                @pl.when((group < 0) & (wg < 2))
                def _zero_tile():
                    zeros = plgpu.layout_cast(jnp.zeros((bm, bn), out_dtype), plgpu.Layout.WGMMA)
                    store(zeros)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = persistent_kernel(body, jax.ShapeDtypeStruct((m, n_out), out_dtype), sms, name="gmm")
    return kernel(
        sched.group_T, sched.row_start_T, sched.store_lo_T, sched.store_hi_T, sched.num_tiles,
        num_real_tiles(sched, chain), x_MK, w,
    )


def batched_store(out, bm, bn, num_slots, slot_ref, dst_ref, chunk=(_EPI, _EPI)):
    """The store of a whole [bm, bn] tile under one fence, as a function to call where it
    belongs: every ``chunk`` (64x64 unless given) written to its own slot
    (``slot_ref(slot)``), one ``commit_smem`` (the async-proxy fence and a warpgroup
    barrier), then each chunk stored to ``dst_ref(i, j)``, instead of a fence and a
    barrier per chunk. Shared by the forward's and the wgrad's ``_store_tile``.

    Raises:
      ValueError: more chunks than ``num_slots`` (checked now, at trace time).
    """
    ch, cw = chunk
    chunks = [(i, j) for i in range(bm // ch) for j in range(bn // cw)]
    if len(chunks) > num_slots:
        raise ValueError(f"batched store: {len(chunks)} chunks need as many slots, got {num_slots}")

    def store():
        for slot, (i, j) in enumerate(chunks):
            slot_ref(slot)[...] = out[i * ch:(i + 1) * ch, j * cw:(j + 1) * cw]
        plgpu.commit_smem()
        for slot, (i, j) in enumerate(chunks):
            plgpu.copy_smem_to_gmem(slot_ref(slot), dst_ref(i, j))

    return store


def _store_tile(out, *, tiles_smem, rows_smem, o_gmem, m, bm, bn, row_start, col0, lo, hi,
                batched=False):
    """Store rows [lo, hi) of a warpgroup's [bm, bn] result (block rows row_start..).

    Other rows of the block belong to other groups and must not be written,
    except rows past M (TMA clips those). ``batched``: a whole tile whose 64x64
    chunks fit the slots is written chunk by chunk, fenced once (``commit_smem``)
    and then stored, instead of a fence and a barrier per chunk (as
    ``mosaic_tgmm._store_tile``'s; more chunks than slots is an error); the row-exact
    path is unchanged.
    """
    # The previous tile's stores must have read the (aliased) smem buffers.
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    # lo <= row_start and hi past the block: the block is inside [lo, hi) (the FP8
    # kernel's warpgroups store 64-row parts of a 128-row tile with its bounds).
    full = (lo <= row_start) & ((hi >= row_start + bm) | (hi == m))

    store_batched = batched and batched_store(
        out, bm, bn, tiles_smem.shape[0], lambda slot: tiles_smem.at[slot],
        lambda i, j: o_gmem.at[pl.ds(row_start + i * _EPI, _EPI), pl.ds(col0 + j * _EPI, _EPI)])

    @pl.when(full)
    def _whole_tile():
        if batched:
            store_batched()
            return
        for i in range(bm // _EPI):
            for j in range(bn // _EPI):
                slot = (i * (bn // _EPI) + j) % 2
                # Keep one store in flight while filling the other slot.
                plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                tiles_smem[slot] = out[i * _EPI:(i + 1) * _EPI, j * _EPI:(j + 1) * _EPI]
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    tiles_smem.at[slot],
                    o_gmem.at[pl.ds(row_start + i * _EPI, _EPI), pl.ds(col0 + j * _EPI, _EPI)],
                )

    @pl.when(~full)
    def _row_exact():
        # TMA boxes have static shapes: store the rows of each 64-row half as a
        # ladder of power-of-two row counts (64, 32, ..., 1), from an
        # unswizzled buffer that allows any row offset.
        for i in range(bm // _EPI):
            half_lo = jnp.clip(lo - row_start - i * _EPI, 0, _EPI)
            half_hi = jnp.clip(hi - row_start - i * _EPI, 0, _EPI)
            num_rows = half_hi - half_lo

            @pl.when(num_rows > 0)
            def _half():
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                rows_smem[...] = out[i * _EPI:(i + 1) * _EPI, :]
                plgpu.commit_smem()
                offset = half_lo
                size = _EPI
                while size >= 1:
                    @pl.when((num_rows & size) != 0)
                    def _store_rows():
                        plgpu.copy_smem_to_gmem(
                            rows_smem.at[pl.ds(offset, size)],
                            o_gmem.at[pl.ds(row_start + i * _EPI + offset, size), pl.ds(col0, bn)],
                        )
                    offset = offset + (num_rows & size)
                    size //= 2
