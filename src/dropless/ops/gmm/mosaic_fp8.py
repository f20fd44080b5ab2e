"""Sketch: the FP8 blockwise grouped matmul (forward) for Hopper in Pallas Mosaic GPU.

NOT WIRED IN: no backend calls this, ``auto`` never picks it. It has been
lowered for CUDA (``jax.export``, on CPU) but never run on a GPU; its
numbers are unmeasured and its numerics unchecked on hardware. It is the
starting point of the performance path of ``te_fp8_blockwise`` (target: 1.6x
our bf16 kernel, about 1,100 TF/s on an H200), which today runs as
quantize -> dequantize -> bf16 kernel (``quantized.py``).

Legend: M rows, K contraction, N output columns, G groups, Kb = K / 128
scale blocks along K, Nb = N / 128.

    y[rows r of g, n] = sum_kb  sx[kb, r] * sw[g, kb, n // 128]
                                * (xq[r, kb-block] . wq[g, n, kb-block])

Operands (the DeepSeek-V3 recipe; scales are float32, dequantize = multiply):
  xq [M, K] E4M3 with sx [Kb, M] (1x128 tiles, stored transposed so that a
  K-block's row scales are contiguous for one TMA copy);
  wq [G, N, K] E4M3 with sw [G, Kb, Nb] (128x128 blocks). The weights are
  stored N x K because Hopper's FP8 ``wgmma`` takes K-major operands only;
  the quantizer writes this layout (one byte per element, once per step).

Design (differences from ``mosaic_gmm``, whose schedule, persistent grid and
row-exact epilogue it reuses):
- block_k is 128, one scale block: each K step's wgmma goes into a fresh
  accumulator, which is then scaled by ``sx[rows] * sw`` (a row vector times
  a scalar: one weight block per warpgroup, block_n = 128) and added to the
  running float32 sum in registers. This is DeepSeek-V3's "promotion" of the
  tensor cores' limited-precision FP8 accumulation to float32 every 128
  elements of K, and it applies the per-block scales in the same step.
- Two float32 accumulators per warpgroup (running sum and K-step product),
  so block_m is 64 (64 registers per thread each).
- The weight scale is read as a scalar from global memory per K step (tiny,
  cached); the row scales come through the TMA pipeline with the operands
  (TMA clips the last row block at M; a plain global load would not, and
  Mosaic does not lower a register load from global memory in this layout).

Open question for the GPU session: Pallas' interpret-mode race detector
reports the compute warpgroups' plain loads of the pipelined row-scale slot
as racing with the TMA refill of that slot, although the pipeline arrives
on the slot's consumed barrier only after the body returns (the results in
interpret mode are right). Either the detector does not model that ordering
for non-wgmma reads or the pipeline releases the slot early; check with
``compute-sanitizer --tool racecheck`` before trusting the kernel.

What is missing before it can replace the emulation: dgrad and wgrad
kernels (wgrad contracts over rows: x and dy need 128x1 scales and M-major
FP8 copies), a GPU test against ``quantized.gmm``, tuning (stages, block_m,
cluster multicast), and the measured TF/s.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.ops.gmm import schedule as schedule_lib
from dropless.ops.gmm.mosaic_gmm import _store_tile, num_sms

BLOCK = 128  # scale block along K and N (DeepSeek-V3)
BLOCK_M = 64  # two f32 accumulators per thread must fit the register file
_MEMORY_REGISTERS = 40


def _swizzle_transforms(minor_elems, dtype):
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def check_shapes(xq_MK, sx, wq_GNK, sw, group_sizes_G):
    """Raise ValueError unless the kernel takes these operands; returns (m, k, n, g)."""
    m, k = xq_MK.shape
    g, n, kw = wq_GNK.shape
    if xq_MK.dtype != jnp.float8_e4m3fn or wq_GNK.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"mosaic fp8 gmm: operands must be float8_e4m3fn, got {xq_MK.dtype} "
                         f"and {wq_GNK.dtype}")
    if kw != k:
        raise ValueError(f"mosaic fp8 gmm: x has {k} columns but w [G, N, K] has K={kw}")
    if k % BLOCK or n % (2 * BLOCK):
        raise ValueError(f"mosaic fp8 gmm: {k=} must be a multiple of {BLOCK} and {n=} of "
                         f"{2 * BLOCK}")
    if m < 1 or m % 8:
        raise ValueError(f"mosaic fp8 gmm: rows {m=} must be a positive multiple of 8")
    want = {"sx": (k // BLOCK, m), "sw": (g, k // BLOCK, n // BLOCK), "group_sizes": (g,)}
    got = {"sx": sx.shape, "sw": sw.shape, "group_sizes": group_sizes_G.shape}
    for name in want:
        if tuple(got[name]) != want[name]:
            raise ValueError(f"mosaic fp8 gmm: {name} must have shape {want[name]}, got {got[name]}")
    return m, k, n, g


def gmm_fp8_blockwise(xq_MK, sx, wq_GNK, sw, group_sizes_G, *, out_dtype=jnp.bfloat16,
                      num_stages=4, grid_tile_width=1, sms=None):
    """y [M, N] = per-group blockwise-scaled FP8 products; see the module docstring.

    Raises:
      ValueError: shapes or dtypes the kernel cannot take (``check_shapes``).
    """
    m, k, n, _ = check_shapes(xq_MK, sx, wq_GNK, sw, group_sizes_G)
    out_dtype = jnp.dtype(out_dtype)
    bm, bn, bk = BLOCK_M, BLOCK, BLOCK
    cta_n = 2 * bn
    n_bands = n // cta_n
    sched = schedule_lib.row_tile_schedule(group_sizes_G, m, bm)
    in_transforms = _swizzle_transforms(bk, xq_MK.dtype)
    out_transforms = _swizzle_transforms(64, out_dtype)

    def make_pipeline(mma_body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            mma_body,
            grid=(k // bk,),
            memory_registers=_MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=in_transforms),
                plgpu.BlockSpec((cta_n, bk), lambda kk: (0, kk), transforms=in_transforms),
                plgpu.BlockSpec((1, bm), lambda kk: (kk, 0)),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=num_stages,
            compute_context=compute_context,
        )

    def body(group_ref, row_start_ref, lo_ref, hi_ref, num_tiles_ref, x_gmem, sx_gmem, w_gmem,
             sw_gmem, o_gmem):
        ignore = lambda *_, **__: None
        pipeline_allocs = make_pipeline(ignore, ignore).get_allocations(
            x_gmem.at[pl.ds(0, bm)], w_gmem.at[0, pl.ds(0, cta_n)], sx_gmem.at[:, pl.ds(0, bm)]
        )

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=pipeline_allocs,
            out_smem=[
                plgpu.RefUnion(
                    plgpu.SMEM((2, 64, 64), out_dtype, transforms=out_transforms),
                    plgpu.SMEM((64, bn), out_dtype),
                )
                for _ in range(2)
            ],
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((num_tiles_ref[0] * n_bands,), collective_axes="sm")
            def _tile_loop(loop_info):
                t, band = plgpu.planar_snake(loop_info.index[0], (num_tiles_ref[0], n_bands), 0,
                                             grid_tile_width)
                group = group_ref[t]
                row_start = pl.multiple_of(row_start_ref[t], bm)
                col0 = pl.multiple_of(band * cta_n + wg * bn, bn)
                lo, hi = lo_ref[t], hi_ref[t]

                def store(out):
                    for w in range(2):
                        @pl.when(wg == w)
                        def _store_own():
                            tiles_smem, rows_smem = out_smem[w]
                            _store_tile(out, tiles_smem=tiles_smem, rows_smem=rows_smem,
                                        o_gmem=o_gmem, m=m, bm=bm, bn=bn, row_start=row_start,
                                        col0=col0, lo=lo, hi=hi)

                def compute_context(eval_pipeline):
                    zeros = plgpu.layout_cast(jnp.zeros((bm, bn), jnp.float32), plgpu.Layout.WGMMA)
                    store(eval_pipeline(zeros).astype(out_dtype))

                def mma_body(idx, x_smem, w_smem, sx_smem, total):
                    (kk,) = idx
                    rhs = w_smem.at[pl.ds(wg * bn, bn)].T  # [K, N] view of K-major storage

                    def k_step(acc_ref):
                        plgpu.wgmma(acc_ref, x_smem, rhs)
                        plgpu.wgmma_wait(0)
                        return acc_ref[...]

                    part = pl.run_scoped(k_step, plgpu.ACC((bm, bn), jnp.float32))
                    row_scale = plgpu.load(sx_smem.at[0], layout=plgpu.Layout.WGMMA.reduce(1))
                    block_scale = sw_gmem[group, kk, band * 2 + wg]
                    scale = lax.broadcast_in_dim(row_scale * block_scale, (bm, bn), (0,))
                    return total + part * scale

                @pl.when(group >= 0)
                def _matmul_tile():
                    make_pipeline(mma_body, compute_context)(
                        x_gmem.at[pl.ds(row_start, bm)],
                        w_gmem.at[group, pl.ds(band * cta_n, cta_n)],
                        sx_gmem.at[:, pl.ds(row_start, bm)],
                        allocations=pipeline_allocs,
                    )

                @pl.when((group < 0) & (wg < 2))
                def _zero_tile():
                    store(plgpu.layout_cast(jnp.zeros((bm, bn), out_dtype), plgpu.Layout.WGMMA))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(sms or num_sms(),),
        grid_names=("sm",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(sched.group_T, sched.row_start_T, sched.store_lo_T, sched.store_hi_T,
                  sched.num_tiles, xq_MK, sx, wq_GNK, sw)


def quantize_operands(x_MK, w_GKN):
    """(xq, sx, wq, sw) in this kernel's layouts from bf16/f32 x [M, K] and w [G, K, N].

    Uses ``ops.quant.quantize_blocks`` (power-of-two scales): x in 1x128 tiles,
    w in 128x128 blocks, then the layout changes the kernel wants (sx
    transposed, w as [G, N, K]).
    """
    from dropless.ops import quant

    xq, sx = quant.quantize_blocks(x_MK, (1, BLOCK))
    wq, sw = quant.quantize_blocks(w_GKN, (1, BLOCK, BLOCK))
    return xq, sx.T, jnp.swapaxes(wq, 1, 2), sw


def reference(xq_MK, sx, wq_GNK, sw, group_sizes_G, out_dtype=jnp.bfloat16):
    """The kernel's result from the dequantized operands (float32, per-group masked)."""
    from dropless.ops import quant
    from dropless.ops.gmm import reference as ref_backend

    x = quant.dequantize_blocks(xq_MK, sx.T, (1, BLOCK))
    w = quant.dequantize_blocks(jnp.swapaxes(wq_GNK, 1, 2), sw, (1, BLOCK, BLOCK))
    return ref_backend.gmm(x, w, group_sizes_G, out_dtype=out_dtype)
