"""FP8 blockwise grouped weight gradient ("tgmm") for Hopper in Pallas Mosaic GPU.

Measured on one H200 at M=65536 G=32 K=7168 N=4096 with bf16 output (what
training writes for bf16 weights; record ``fp8_kernels-20261202-104520``,
kernel time by CUPTI / wall-clock): the default, ``split="rows",
overlap=True``, 4.863 / 5.412 ms (791 TF/s by CUPTI), against 5.111 / 5.703
for the earlier default (columns, no overlap), 5.164 / 5.381 for rows
alone and 4.963 / 5.632 for columns with overlap; with float32 output
rows + overlap also led (5.258 ms against 5.407 to 5.490). All four agree
bit for bit; exact on integer-exact data and within the FP8 accumulation
model on random data (GPU tests). Also checked in Pallas GPU interpret mode
on CPU (race detector on) and lowered for CUDA through ``jax.export``.
Selected by ``quantized.gmm(..., impl="kernel")`` (config key
``gmm_fp8_impl``).

Legend: M rows (ragged, grouped), K and N the weight dims, G groups,
Mb = M / 128 scale blocks along M.

    dw[g, k, n] = sum_mb over g's blocks  sx[mb, k] * sdy[mb, n]
                  * (xq[mb-block, k] . dyq[mb-block, n])

The contraction runs over the rows, so the DeepSeek-V3 recipe quantizes x
and dy in 128x1 blocks along M (one float32 power-of-two scale per 128 rows
of one column). A block must not hold rows of two groups: every group size
must be a multiple of 128 (the MoE block pads its groups so); then each
group is a whole number of scale blocks and no row needs masking. With
other sizes the blocks that straddle a boundary count the neighbour's rows
(wrong, but every read stays in bounds and TMA zero-fills rows past M).

Operands: Hopper's FP8 ``wgmma`` needs both operands K-major, i.e. the
contraction (here M) minor in shared memory, so the kernel reads M-major
byte copies of the quantized activations:

  xq_KM [K, M] E4M3 (x's codes transposed),  sx [Mb, K] float32;
  dyq_NM [N, M] E4M3 (dy's codes transposed), sdy [Mb, N] float32.

``wgrad_operands`` makes them from x and dy with ``ops.quant``. The
transposes are one byte per element; XLA fuses them with the quantization.

Design (the forward kernel's structure, ``mosaic_fp8``, with the roles of
rows and contraction swapped):
- Persistent grid walking (group, K tile, N band) output tiles group-major,
  as ``mosaic_tgmm``: the SMs share one group's rows in L2 at a time. Which
  CTA takes which tile is ``tile_order``'s (``mosaic_gmm.walk_tiles``): by
  default balanced over the SMs under skewed groups, or the flat round robin.
- CTA tile 64 (K) x 256 (N): both compute warpgroups read the same 64x128
  x tile (A) and each its own 128 columns of the dy tile (B), as the
  forward shares its row tile. Each 128-row step goes into a fresh float32
  accumulator, scaled by ``sx[mb, k rows] (x) sdy[mb, n cols]`` (an outer
  product of a row vector and a column vector) and added to the running
  float32 sum: the scale changes with every step along M, so the promotion
  happens every 128 rows.
- Registers per compute thread: running sum and step product 64 + 64
  (64x128 float32 over 128 threads), the column scales 32, the row scales
  2; under the 232 available.
- Shared memory per stage: 8 KiB (x) + 32 KiB (dy) + 1.25 KiB (scales);
  4 stages (3 for 4-byte outputs) + 2 x 2 64x64 epilogue tiles.
- Scales are read from shared memory (generic proxy) and the slot refilled
  by TMA (async proxy): a ``commit_smem`` (fence.proxy.async) after the
  reads orders them, as in ``mosaic_fp8``.
- Empty groups store zero tiles; the step count is read on device, so no
  code depends on G.

``overlap=True`` (the default; ``overlap=False`` is the plain step): the step
above waits for its wgmma before promoting, so the tensor cores idle while
the scale-multiply-add runs. The pipeline releases a step's shared-memory
slot when its body returns, so a wgmma cannot stay in flight across steps;
instead each step carries, besides the running sum, its scaled product
``pending = part * scale`` to the next step, which issues its own wgmma,
adds ``total + pending`` and loads and forms its scale outer product while
the wgmma runs, then waits and scales its product. The compute context adds
the last step's pending product. The sum runs over the same products in the
same order (the first step adds a zero pending product to the zero sum),
and the scales are powers of two, so ``part * scale`` is exact (short of
underflow below float32's normal range) and a fused multiply-add in the
plain step cannot differ: the two equal bit for bit.
Registers during the wgmma: sum, pending product and accumulator 3 x 64,
then the scale outer product 64 once the pending product is spent (the
scale vectors 34 while it forms); the multiply after the wait is not
overlapped (64 of the 192 per-step float32 operations per thread). ptxas
gave the overlap kernel 168 registers, no spills (H200, 2026-12-02).

``chain=True`` (the default; ``chain=False`` runs a pipeline per tile): a
plain ``emit_pipeline_warp_specialized`` per output tile starts every tile
with its pipeline empty (the compute warpgroups wait for the first TMA) and the
memory warpgroup idles through the epilogue. On the H200 that cost about 1.2-1.6
us per tile: wgrad ran at 827, 727 and 474 TF/s with 64, 16 and 4 steps per tile
(G = 8, 32, 128 at M=65536 K=7168 N=4096; ``notes/fp8.md``), 11-14% of the
kernel at G=32 and about 40% at G=128. jax's pipeline chaining
(``pipeline_state``) needs a static step count that is a multiple of the
stages; a group's step count is read on the device. So ``chain`` runs its own
warp-specialised loop, as DeepGEMM does: both sides walk the CTA's tiles in the
same order (``mosaic_gmm.walk_tiles_carry``) with a slot counter that runs on
from one tile into the next; the memory warpgroup waits for a slot's
``consumed`` barrier (both compute warpgroups arrive) and issues the step's four
TMA copies on its ``loaded`` barrier, the compute warpgroups wait on
``loaded``, run the same step bodies and arrive on ``consumed``. The memory
warpgroup thus loads the next tile's first steps while the compute warpgroups
promote and store the last. The same steps in the same order per tile, so the
same bits. On the H200 at M=65536 K=7168 N=4096 (kernel time, float32 out) the
chain ran 851 TF/s against 723 at G=32, 593 against 470 at G=128 and 797 against
714 at G=32 under Dirichlet(0.3), bit for bit equal (``fp8_kernels-20261203-130033``,
``-130213``, ``-131851``); the training step's FP8 case rose from 1.088x bf16 to
1.093x (``step-20261203-131400``).

Other schedules were measured on the H200 and removed. Two accumulators
promoted in turn (each step's product read with ``wgmma_accumulator_load(wait_n=1)``
while the next step's wgmma runs: two float32 operations per element and no copy,
against the default's three and a copy) gave the same bits but ran 0.83x at G=32
(700 against 842 TF/s) and 0.85x under Dirichlet(0.3) (``fp8_kernels-20261203-150115``,
``-150217``): ptxas serialises every wgmma of that loop (its C7514 warning, a
``WARPGROUP.DEPBAR`` after each ``QGMMA``), since a non-wgmma instruction reads an
accumulator while a wgmma is in flight. A ping-pong that handed the turn over
once a wgmma was issued ran 0.98x the overlapped per-tile kernel with the plain
step and 0.88x with the overlapped one (G=32, ``fp8_kernels-20261203-130033``);
in the forward kernel 0.87x (``-130213``): both warpgroups' wgmmas were then
always pending together (``kernel_anatomy-20261203-220125``). Handed over once
the wgmma had completed instead, it ran even with the chained plain step (819 and
831 against 831 TF/s for the overlapped default, K=7168 N=4096; 816 against 820 at
K=2048 N=7168; ``fp8_kernels-pingpong-k7168-n4096-20261204-003649``, ``-k2048-n7168-
20261204-004320``), so it was removed again.
Deferring the scale multiply (``defer_scale``) ran 0.90x (``-102051``). The
promotion factored as ``(part * cols) * rows + total`` (an ``FMUL`` after the
wait and an ``FFMA`` under the next wgmma, no outer product:
two float32 operations per element against three, 64 fewer instructions per
thread and step, same bits) ran 0.89x at G=32 and 0.92x under Dirichlet(0.3),
against the outer product in the same process (``fp8_kernels-20261203-152538``,
``-152652``): the instruction count is not what limits the step. Its ncu source
page (``kernel_anatomy-20261203-222102``) puts the difference before the next
wgmma: the scale loads (``LDS``, waiting on the shared-memory queue), then the
proxy fence after them and the warpgroup's ``BAR.SYNC``, about 26% of the samples
against about 7% in the outer product's page. Since the scale reads can be fenced
per thread without that barrier (``scale_fence="thread"``), the factored form was
tried again with that fence and lost again, against the default with the same fence
in the same process: 0.99x / 0.97x (float32 / bf16 out) at K=7168 N=4096 G=32, 0.98x /
0.97x at K=2048 N=7168, 0.81x / 0.95x at G=256
(``fp8_kernels-wgrad-factored-*-20261204-15*``), so it was removed.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.ops import quant
from dropless.ops.gmm import reference as ref_backend
from dropless.ops.gmm import schedule as schedule_lib
from dropless.ops.gmm.mosaic_fp8 import (BLOCK, _MEMORY_REGISTERS, _swizzle_transforms,
                                         check_parts, check_scale_reads, fence_scale_reads,
                                         part_slices, promote_in_parts, resolve_scale_fence)
from dropless.ops.gmm.mosaic_gmm import (chained_tile_pipeline, persistent_kernel,
                                        tile_order_operands, walk_tiles)
from dropless.ops.gmm.mosaic_tgmm import _store_tile

BLOCK_K = 64  # rows of dw per warpgroup (wgmma's M)
# How the two compute warpgroups share a CTA tile (as in ``mosaic_fp8``):
# "columns", 64 (K) x 256 (N), both reading one x tile; "rows" (the default),
# 128 (K) x 128 (N), each its 64 K rows, both reading one dy tile.
SPLITS = ("columns", "rows")
# How a warpgroup stores its output tile (``mosaic_tgmm._store_tile``): chunk by chunk,
# or every chunk written under one fence ("batched"); "auto" (the default) batches
# 2-byte outputs only. On the H200 (M=65536, CUPTI, same process, same bits) batched
# ran the bf16 output 1.04x at G=256 K=7168 N=4096 (592 against 569 TF/s,
# ``fp8_kernels-20261204-110306``) and 1.00-1.04x at G=32: 897 against 862 balanced
# (``-110423``), 849 against 848 under Dirichlet(0.3) (``-110717``), 876 against 870 at
# K=2048 N=7168 (``-110654``). The float32 output: even at G=32 (848 against 854) and
# 0.87x by kernel time at G=256 (416 against 476; equal by wall clock), so float32
# keeps the chunks.
EPILOGUES = ("auto", "chunks", "batched")
# Columns of dw per warpgroup (wgmma's N) with the "rows" split, as DeepGEMM's SM90
# wgrad widens its tiles (128x152): 128 (the default), or 160 and 192 with the plain
# step (``overlap=False``; the overlap's three float32 tiles would not fit the
# registers), whole or in halves (``parts=2``: 80 + 80, 96 + 96). The tile's per-step
# work that is not promotion (scale loads, fence, barriers, the wgmma issue) is then
# spread over 1.25-1.5x the elements (``benchmarks/notes/gpu_plan.md``). Opt-in until
# timed on the hardware. N need not be a multiple: the last band's
# columns past N are zeros read by TMA and clipped from the stores.
BLOCK_NS = (BLOCK, 160, 192)


def check_shapes(xq_KM, sx, dyq_NM, sdy, group_sizes_G):
    """Raise ValueError unless the kernel takes these operands; returns (m, k, n)."""
    k, m = xq_KM.shape
    n, m2 = dyq_NM.shape
    if xq_KM.dtype != jnp.float8_e4m3fn or dyq_NM.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"mosaic fp8 tgmm: operands must be float8_e4m3fn, got {xq_KM.dtype} "
                         f"and {dyq_NM.dtype}")
    if m != m2:
        raise ValueError(f"mosaic fp8 tgmm: x [K, M] {xq_KM.shape} and dy [N, M] "
                         f"{dyq_NM.shape} must share M")
    if m < 1 or m % BLOCK:
        # M is the minor dim of the operands: whole scale blocks, 16-byte TMA strides.
        raise ValueError(f"mosaic fp8 tgmm: rows {m=} must be a positive multiple of {BLOCK}")
    if k % BLOCK_K or n % (2 * BLOCK):
        raise ValueError(f"mosaic fp8 tgmm: {k=} must be a multiple of {BLOCK_K} and {n=} of "
                         f"{2 * BLOCK}")
    want = {"sx": (m // BLOCK, k), "sdy": (m // BLOCK, n)}
    got = {"sx": sx.shape, "sdy": sdy.shape}
    for name in want:
        if tuple(got[name]) != want[name]:
            raise ValueError(f"mosaic fp8 tgmm: {name} must have shape {want[name]}, got {got[name]}")
    if group_sizes_G.ndim != 1:
        raise ValueError(f"mosaic fp8 tgmm: group_sizes must be 1-D, got {group_sizes_G.shape}")
    return m, k, n


def tgmm_fp8_blockwise(xq_KM, sx, dyq_NM, sdy, group_sizes_G, *, out_dtype=jnp.float32,
                       num_stages=4, sms=None, split="rows", overlap=True, tile_order="sorted_snake",
                       chain=True, scale_fence="commit", epilogue="auto", prefetch=False,
                       parts=1, block_n=BLOCK, scale_reads="before"):
    """dw [G, K, N] = per-group blockwise-scaled x^T dy; zeros for empty groups.

    See the module docstring for the operand layouts. ``split`` (``SPLITS``),
    ``overlap`` (promote each step's product during the next step's wgmma),
    ``chain`` (one pipeline over all of a CTA's tiles, module docstring),
    ``epilogue`` (``EPILOGUES``: each output tile's two 64x64 chunks fenced and
    stored one by one, or written together under one fence, ``mosaic_tgmm._store_tile``;
    ``"auto"`` batches 2-byte outputs, which ran 1.00-1.04x on the H200),
    ``prefetch`` (with ``chain``: each tile's group data read rounds ahead,
    ``mosaic_gmm.walk_tiles_prefetched``; opt-in until timed),
    ``parts`` (``mosaic_fp8.PARTS``; other than 1 the plain step only, ``overlap=False``;
    opt-in: each step as ``parts`` wgmmas over 128 / ``parts`` columns, or over the
    widths of a tuple, each slice promoted while the later ones run, as the forward's
    ``mosaic_fp8.gmm_fp8_blockwise(parts=...)``, whose docstring says why),
    ``scale_reads`` (``mosaic_fp8.SCALE_READS``; the plain step only): where a step reads
    its scales and fences the reads, ``"before"`` its wgmma is issued or ``"under"`` it,
    between the issue and the wait (opt-in until timed; ``mosaic_fp8.SCALE_READS`` says
    why),
    ``scale_fence`` (``mosaic_fp8.SCALE_FENCES``: the scale reads' proxy fence with
    ``commit_smem``'s warpgroup barrier, or per thread alone, as the forward's
    default since 2026-12-04; here even on the H200, 828 against 830 TF/s with float32
    output, ``fp8_kernels-s5-early-stagger-fence-20261204-102810``, so it stays opt-in;
    ``"none"``: no fence, as DeepGEMM, opt-in: even on the H200 here, 826 / 895 against
    849 / 864 TF/s with float32 / bf16 output in short runs, 778 / 787 against 781 / 787
    under load, ``fp8_kernels-nofence-cluster-sustain-k7168-n4096-20261204-182732``)
    and ``tile_order``
    (``mosaic_gmm.TILE_ORDERS``: which CTA computes which output tile,
    ``mosaic_gmm.walk_tiles``) change how the kernel runs, not its bits;
    the split, overlap and chain defaults had the shortest kernel time on the H200
    (module docstring). ``"sorted_snake"`` ranks groups by their 128-row steps;
    it is the default as in the bf16 kernel (``mosaic_tgmm.tgmm``): at Qwen3-30B's
    M=65536 G=128 K=768 N=2048 it ran 1.07x (float32 out) and 1.05x (bf16 out)
    faster than ``"groups"`` under Dirichlet(0.3) sizes and 0.98x / 0.97x with
    equal sizes (``fp8_kernels-20261202-132026`` and ``-132107``).

    Raises:
      ValueError: shapes or dtypes the kernel cannot take (``check_shapes``), an
        unknown ``split``, ``tile_order``, ``scale_fence`` or ``epilogue``, ``parts`` not
        in ``mosaic_fp8.PARTS`` or above 1 with ``overlap``, ``block_n`` not in
        ``BLOCK_NS`` or wider than 128 with ``overlap``, ``parts`` other than 1 or 2,
        the "columns" split or a K that is not a multiple of 128; ``scale_reads`` not in
        ``mosaic_fp8.SCALE_READS``, or ``"under"`` with the overlap or ``parts`` other than 1.
    """
    m, k, n = check_shapes(xq_KM, sx, dyq_NM, sdy, group_sizes_G)
    scale_fence = resolve_scale_fence(scale_fence, "mosaic fp8 tgmm")
    check_parts(parts, "mosaic fp8 tgmm")
    check_scale_reads(scale_reads, overlap or parts != 1, "mosaic fp8 tgmm")
    if parts != 1 and overlap:
        raise ValueError(f"mosaic fp8 tgmm: {parts=} takes the plain step (overlap=False)")
    if epilogue not in EPILOGUES:
        raise ValueError(f"mosaic fp8 tgmm: {epilogue=} must be one of {EPILOGUES}")
    num_groups = group_sizes_G.shape[0]
    out_dtype = jnp.dtype(out_dtype)
    if epilogue == "auto":
        epilogue = "batched" if out_dtype.itemsize <= 2 else "chunks"
    num_stages = num_stages if out_dtype.itemsize <= 2 else min(num_stages, 3)
    if split not in SPLITS:
        raise ValueError(f"mosaic fp8 tgmm: {split=} must be one of {SPLITS}")
    if block_n not in BLOCK_NS:
        raise ValueError(f"mosaic fp8 tgmm: {block_n=} must be one of {BLOCK_NS}")
    if block_n != BLOCK and (overlap or parts not in (1, 2) or split != "rows"
                             or k % (2 * BLOCK_K)):
        raise ValueError(f"mosaic fp8 tgmm: {block_n=} takes the plain step (overlap=False, "
                         f"parts 1 or 2) and the rows split with K a multiple of {2 * BLOCK_K}; got "
                         f"{overlap=}, {parts=}, {split=}, {k=}")
    if split == "rows" and k % (2 * BLOCK_K):
        split = "columns"  # K = 64 (mod 128): only the 64-row CTA tile fits
    bk, bn, bm = BLOCK_K, block_n, BLOCK  # one warpgroup's tile: 64 (K) x block_n (N)
    slices = part_slices(parts, bn)  # each wgmma's (first column, columns)
    by_rows = split == "rows"
    cta_k, cta_n = (2 * bk, bn) if by_rows else (bk, 2 * bn)
    k_tiles, n_bands = k // cta_k, -(-n // cta_n)  # the last band may run past N
    mb = m // bm
    starts_G, sizes_G = schedule_lib.group_offsets(group_sizes_G, m)
    order_refs = tile_order_operands(tile_order, group_sizes_G, m, bm)
    in_transforms = _swizzle_transforms(bm, xq_KM.dtype)
    # The epilogue's chunk (``mosaic_tgmm._store_tile``): 64x64, or 64x32 where the
    # warpgroup's columns are not a multiple of 64 (160); one slot per chunk.
    chunk_n = 64 if bn % 64 == 0 else 32
    out_slots = max(2, bn // chunk_n)
    out_transforms = _swizzle_transforms(chunk_n, out_dtype)

    def make_pipeline(mma_body, compute_context, steps):
        return plgpu.emit_pipeline_warp_specialized(
            mma_body,
            grid=(steps,),
            memory_registers=_MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((cta_k, bm), lambda s: (0, s), transforms=in_transforms),
                plgpu.BlockSpec((cta_n, bm), lambda s: (0, s), transforms=in_transforms),
                plgpu.BlockSpec((1, cta_k), lambda s: (s, 0)),
                plgpu.BlockSpec((1, cta_n), lambda s: (s, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=num_stages,
            compute_context=compute_context,
        )

    def tile_steps(starts_ref, sizes_ref, g):
        """(first 128-row block, step count) of group g's tiles; no steps if it is empty."""
        start, size = starts_ref[g], sizes_ref[g]
        first_block = start // bm
        # schedule.tgmm_steps at block_m = bm: what "sorted_snake" ranks groups by.
        return first_block, jnp.where(size > 0, (start + size + bm - 1) // bm - first_block, 0)

    def tile_store(o_gmem, out_smem, wg, g, k_tile, band):
        """Store this warpgroup's part of output tile (g, k_tile, band)."""
        return functools.partial(
            _store_tile, out_smem=out_smem, wg=wg, bk=bk, bn=bn, batched=epilogue == "batched",
            dst=o_gmem.at[g, pl.ds(k_tile * cta_k + (wg * bk if by_rows else 0), bk),
                          pl.ds(band * cta_n + (0 if by_rows else wg * bn), bn)],
        )

    def step_functions(wg):
        """(step body, its initial carry, the carry's final sum) for warpgroup ``wg``."""
        zeros = lambda: plgpu.layout_cast(jnp.zeros((bk, bn), jnp.float32),  # noqa: E731
                                          plgpu.Layout.WGMMA)

        def operands(x_smem, dy_smem, sx_smem, sdy_smem):
            """This warpgroup's (lhs, rhs, row scales, column scales) refs."""
            if by_rows:  # [M, N] views of M-major storage
                return (x_smem.at[pl.ds(wg * bk, bk)], dy_smem.T,
                        sx_smem.at[0, pl.ds(wg * bk, bk)], sdy_smem.at[0])
            return (x_smem, dy_smem.at[pl.ds(wg * bn, bn)].T,
                    sx_smem.at[0], sdy_smem.at[0, pl.ds(wg * bn, bn)])

        def load_scale(rows, cols):
            """The step's scale sx[rows] (x) sdy[cols], after the reads' proxy fence."""
            row_scale = plgpu.load(rows, layout=plgpu.Layout.WGMMA.reduce(1))
            col_scale = plgpu.load(cols, layout=plgpu.Layout.WGMMA.reduce(0))
            # Fence the generic-proxy scale reads before TMA refills the slot.
            fence_scale_reads(scale_fence)
            return row_scale, col_scale

        def rows_bcast(row_scale):
            return lax.broadcast_in_dim(row_scale, (bk, bn), (0,))

        def cols_bcast(col_scale):
            return lax.broadcast_in_dim(col_scale, (bk, bn), (1,))

        def outer(row_scale, col_scale):
            return rows_bcast(row_scale) * cols_bcast(col_scale)

        def mma_body_parts(_, x_smem, dy_smem, sx_smem, sdy_smem, total):
            lhs, _, rows, cols = operands(x_smem, dy_smem, sx_smem, sdy_smem)
            row_scale = plgpu.load(rows, layout=plgpu.Layout.WGMMA.reduce(1))
            col_scales = [plgpu.load(cols.at[pl.ds(s, w)], layout=plgpu.Layout.WGMMA.reduce(0))
                          for s, w in slices]
            fence_scale_reads(scale_fence)

            def scale(i):
                width = slices[i][1]
                return (lax.broadcast_in_dim(row_scale, (bk, width), (0,))
                        * lax.broadcast_in_dim(col_scales[i], (bk, width), (1,)))

            return promote_in_parts(total, lhs, dy_smem, 0 if by_rows else wg * bn, parts,
                                    scale)

        def mma_body(_, x_smem, dy_smem, sx_smem, sdy_smem, total):
            lhs, rhs, rows, cols = operands(x_smem, dy_smem, sx_smem, sdy_smem)
            # "before": the scales are read and fenced before the wgmma is issued (the
            # fence waits for the reads); "under": between its issue and its wait.
            scales = load_scale(rows, cols) if scale_reads == "before" else None

            def m_step(acc_ref):
                plgpu.wgmma(acc_ref, lhs, rhs)
                step_scales = load_scale(rows, cols) if scales is None else scales
                plgpu.wgmma_wait(0)
                return acc_ref[...], step_scales

            part, (row_scale, col_scale) = pl.run_scoped(m_step,
                                                         plgpu.ACC((bk, bn), jnp.float32))
            return total + part * outer(row_scale, col_scale)

        def mma_body_overlap(_, x_smem, dy_smem, sx_smem, sdy_smem, carry):
            # carry: the running sum and the previous step's scaled product,
            # added here while this step's wgmma runs (module docstring).
            total, pending = carry
            lhs, rhs, rows, cols = operands(x_smem, dy_smem, sx_smem, sdy_smem)

            def m_step(acc_ref):
                plgpu.wgmma(acc_ref, lhs, rhs)
                # While the tensor cores run: the previous step's add, then
                # this step's scale (loaded after the add: fewer live registers).
                total_next = total + pending
                scale = outer(*load_scale(rows, cols))
                plgpu.wgmma_wait(0)
                return total_next, acc_ref[...] * scale

            return pl.run_scoped(m_step, plgpu.ACC((bk, bn), jnp.float32))

        if overlap:  # the last step's product is still pending
            return mma_body_overlap, lambda: (zeros(), zeros()), lambda c: c[0] + c[1]
        return mma_body_parts if parts != 1 else mma_body, zeros, lambda total: total

    def body(starts_ref, sizes_ref, *refs):
        *order_ref, x_gmem, sx_gmem, dy_gmem, sdy_gmem, o_gmem = refs  # order_ref: [] or [order]
        ignore = lambda *_, **__: None
        pipeline_allocs = make_pipeline(ignore, ignore, num_stages).get_allocations(
            x_gmem.at[pl.ds(0, cta_k), pl.ds(0, bm)], dy_gmem.at[pl.ds(0, cta_n), pl.ds(0, bm)],
            sx_gmem.at[pl.ds(0, 1), pl.ds(0, cta_k)], sdy_gmem.at[pl.ds(0, 1), pl.ds(0, cta_n)],
        )

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=pipeline_allocs,
            out_smem=plgpu.SMEM((2, out_slots, 64, chunk_n), out_dtype,
                                transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")
            step_body, init, finish = step_functions(wg)

            @walk_tiles((num_groups, k_tiles, n_bands), *order_ref)
            def _tile(g, k_tile, band):
                first_block, steps = tile_steps(starts_ref, sizes_ref, g)
                store = tile_store(o_gmem, out_smem, wg, g, k_tile, band)

                def compute_context(eval_pipeline):
                    store(finish(eval_pipeline(init())).astype(out_dtype))

                @pl.when(steps > 0)
                def _contract():
                    # Views may run past M (and Mb): TMA zero-fills, and the
                    # step count stops at the group's last block.
                    cols = pl.ds(first_block * bm, m)
                    blocks = pl.ds(first_block, mb)
                    make_pipeline(step_body, compute_context, steps)(
                        x_gmem.at[pl.ds(k_tile * cta_k, cta_k), cols],
                        dy_gmem.at[pl.ds(band * cta_n, cta_n), cols],
                        sx_gmem.at[blocks, pl.ds(k_tile * cta_k, cta_k)],
                        sdy_gmem.at[blocks, pl.ds(band * cta_n, cta_n)],
                        allocations=pipeline_allocs,
                    )

                @pl.when((steps == 0) & (wg < 2))
                def _empty_group():
                    store(plgpu.layout_cast(jnp.zeros((bk, bn), out_dtype), plgpu.Layout.WGMMA))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    def chained_body(starts_ref, sizes_ref, *refs):
        """``chain=True``: ``mosaic_gmm.chained_tile_pipeline`` over this CTA's tiles."""
        *order_ref, x_gmem, sx_gmem, dy_gmem, sdy_gmem, o_gmem = refs

        @functools.partial(
            pl.run_scoped,
            out_smem=plgpu.SMEM((2, out_slots, 64, chunk_n), out_dtype,
                                transforms=out_transforms),
            collective_axes="wg",
        )
        def _scope(out_smem):
            wg = lax.axis_index("wg")
            step_body, init, finish = step_functions(wg)

            def tile_of(g):
                first_block, steps = tile_steps(starts_ref, sizes_ref, g)
                return steps, first_block

            def sources_of(first_block, k_tile, band, s):
                block = first_block + s
                rows = pl.ds(block * bm, bm)
                return (x_gmem.at[pl.ds(k_tile * cta_k, cta_k), rows],
                        dy_gmem.at[pl.ds(band * cta_n, cta_n), rows],
                        sx_gmem.at[pl.ds(block, 1), pl.ds(k_tile * cta_k, cta_k)],
                        sdy_gmem.at[pl.ds(block, 1), pl.ds(band * cta_n, cta_n)])

            def compute(g, k_tile, band, real, _, loop):
                acc, it = loop(lambda s, slots, acc: step_body(None, *slots, acc), init())

                @pl.when(real)
                def _store():  # an empty group's tile stores the zero sum
                    tile_store(o_gmem, out_smem, wg, g, k_tile, band)(
                        finish(acc).astype(out_dtype))

                return it

            chained_tile_pipeline(
                (num_groups, k_tiles, n_bands), order_ref[0] if order_ref else None, wg=wg,
                buffers=(
                    plgpu.SMEM((num_stages, cta_k, bm), xq_KM.dtype, transforms=in_transforms),
                    plgpu.SMEM((num_stages, cta_n, bm), dyq_NM.dtype, transforms=in_transforms),
                    plgpu.SMEM((num_stages, 1, cta_k), jnp.float32),
                    plgpu.SMEM((num_stages, 1, cta_n), jnp.float32)),
                tile_of=tile_of, sources_of=sources_of, compute=compute, prefetch=prefetch)

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = persistent_kernel(chained_body if chain else body,
                               jax.ShapeDtypeStruct((num_groups, k, n), out_dtype), sms,
                               name="tgmm_fp8")
    return kernel(starts_G, sizes_G, *order_refs, xq_KM, sx, dyq_NM, sdy)


def quantize_columns(a_MC):
    """(aq [C, M] E4M3, sa [Mb, C]): 128x1 blocks along M, codes transposed to M-major.

    Computed as a transpose of the bf16 input (its own pass, kept by the
    optimization barrier) and then 1x128 blocks along rows of the transposed
    copy: the same blocks, so the same codes and scales as quantizing 128x1
    blocks of ``a_MC`` and transposing the codes. XLA fuses the column
    reduction and strided byte transpose of that formulation poorly: on the
    H200 at x [65536, 7168] it took 2.59 ms against 1.32 ms this way
    (``benchmarks/fp8_quant.py``, ``columns`` vs ``columns_T``).
    """
    aq, sa = quant.quantize_blocks(jax.lax.optimization_barrier(a_MC.T), (1, BLOCK))
    return aq, sa.T


def wgrad_operands(x_MK, dy_MN):
    """Kernel operands of dw = x^T . dy: (xq [K, M], sx [Mb, K], dyq [N, M], sdy [Mb, N])."""
    return (*quantize_columns(x_MK), *quantize_columns(dy_MN))


def reference(xq_KM, sx, dyq_NM, sdy, group_sizes_G, out_dtype=jnp.float32):
    """The kernel's result from the dequantized operands (float32 HIGHEST, per group)."""
    x = quant.dequantize_blocks(xq_KM.T, sx, (BLOCK, 1))
    dy = quant.dequantize_blocks(dyq_NM.T, sdy, (BLOCK, 1))
    return ref_backend.tgmm(x, dy, group_sizes_G, num_groups=group_sizes_G.shape[0],
                            out_dtype=out_dtype)
