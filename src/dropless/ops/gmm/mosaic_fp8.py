"""FP8 blockwise grouped matmul, forward and dgrad, for Hopper in Pallas Mosaic GPU.

Measured on one H200 (``benchmarks/fp8_kernel_probe.py``, M=65536 G=32,
balanced, record ``fp8_kernels-20261204-060408`` and ``-060605``): at K=7168
N=4096 fwd 1,181 TF/s by CUPTI (994 wall-clock), dgrad 1,163 (982); at
K=2048 N=7168 fwd 1,076 (897), dgrad 1,164 (1,022); our bf16 kernel runs
about 800; the DeepGEMM anchor is 1,250-1,350. On hardware they are exact on
integer-exact data and within the Hopper FP8 accumulation model on random
data (``tests/ops/test_gmm_mosaic_fp8.py``, GPU tests; ``compute-sanitizer
--tool racecheck`` clean). They are checked too in Pallas GPU interpret mode
on CPU (race detector on) and lowered for CUDA through ``jax.export``.
``quantized.gmm(..., impl="kernel")`` runs them; the config's
``gmm_fp8_impl: auto`` takes them on Hopper (``benchmarks/notes/fp8.md``).

Legend: M rows, C contraction, O output columns, G groups, Cb = C / 128
scale blocks along C, Ob = O / 128.

One kernel computes both products, ``y[rows of g] = a[rows of g] . b[g]^T``
with blockwise scales (the DeepSeek-V3 recipe; float32 powers of two,
dequantize = multiply):

    y[r, o] = sum_cb  sa[cb, r] * sb[g, cb, o // 128]
                      * (aq[r, cb-block] . bq[g, o, cb-block])

  aq [M, C] E4M3 with sa [Cb, M] (1x128 tiles along C, stored transposed so
    that one C block's row scales are contiguous for one TMA copy);
  bq [G, O, C] E4M3 with sb [G, Cb, Ob] (128x128 blocks).

Hopper's FP8 ``wgmma`` takes K-major operands only (the contraction is the
minor dimension of both A and B in shared memory), hence bq [G, O, C]:

  fwd   y  = x . w[g]:     a = xq [M, K],  b = w as [G, N, K] (a transposed
                           byte copy of the quantized w), sb = sw [G, Kb, Nb].
  dgrad dx = dy . w[g]^T:  a = dyq [M, N], b = w as [G, K, N] (the natural
                           layout: its minor dim N is dgrad's contraction),
                           sb = sw transposed to [G, Nb, Kb].

The 128x128 weight blocks serve both products with one set of codes and
scales; only the byte layout differs, so the weight is quantized once and
its codes transposed once (``fwd_operands`` / ``dgrad_operands``).

Design (differences from ``mosaic_gmm``, whose schedule, persistent grid and
row-exact epilogue it reuses):
- block_c is 128, one scale block: each contraction step's wgmma goes into a
  fresh accumulator, which is then scaled by ``sa[rows] * sb`` (a row vector
  times a scalar: one weight block per warpgroup, block_o = 128) and added
  to the running float32 sum in registers. This is DeepSeek-V3's
  "promotion" of the tensor cores' limited-precision FP8 accumulation to
  float32 every 128 elements, and it applies the per-block scales in the
  same step.
- Registers: two float32 accumulators per warpgroup (running sum and step
  product), 64 registers per thread each at block_m = 64, block_o = 128,
  plus the row scales (2 per thread); the compute warpgroups get 232
  registers each (40 go to the TMA warpgroup). block_m = 128 would need
  256 for the accumulators alone. Each warpgroup's tile is 64 x 128 in
  either ``split``: the split decides only which operand tile the two
  warpgroups share in shared memory, not what a thread holds.
- Shared memory per stage: a 64x128 + b 256x128 bytes + 256 bytes of
  scales = 40.25 KiB; 4 stages + epilogue buffers (2 x 16 KiB at bf16)
  stay under the 227 KiB limit.
- The row scales and the weight scales come through the TMA pipeline with the
  operands (TMA clips the last row block at M; ``weight_scales="smem"``, the
  default: a 128-byte window of the step's weight-scale row). Both are read
  from shared memory before the step's wgmma. Until 2026-12-04 the weight scale
  was a scalar load from global memory per step (``weight_scales="gmem"``),
  whose consumer held 7.9% of the forward's samples waiting for it after the
  wgmma (long scoreboard), and the scale reads were fenced with
  ``commit_smem`` (``scale_fence="commit"``). On the H200 the scales in shared
  memory and the fence without the warpgroup barrier ran the forward 1.04x and
  1.05x at K=7168 N=4096 and K=2048 N=7168 (1,181 against 1,138 and 1,076
  against 1,026 TF/s, CUPTI), dgrad 1.05x and 1.04x (1,163 against 1,110, 1,164
  against 1,123), same bits (``fp8_kernels-20261204-060408``, ``-060605``).
- The row scales are read from shared memory by the compute warpgroups
  (generic proxy) and the slot is then refilled by TMA (async proxy). PTX
  orders a generic-proxy access before a later async-proxy access of the
  same shared memory only through a proxy fence, so each warpgroup issues
  ``commit_smem`` (fence.proxy.async) after reading its scales and before the
  pipeline releases the slot. Without it Pallas' interpret-mode race
  detector reports the refill as racing with the read (it models the two
  proxies with separate clocks, joined only by that fence); the operand
  tiles are read by wgmma, itself in the async proxy, and need no fence.

``overlap=True`` (``overlap=False``, the plain step above, is the default):
the plain step waits for its wgmma before promoting, so the tensor cores
idle while each thread runs its 64 multiply-adds (``total + part *
scale``). The pipeline releases a step's shared-memory slot when its body
returns (unless its ``BlockSpec``s set ``delay_release``, as the halves across
steps do: ``gmm_fp8_blockwise``'s ``parts``), so this overlap does not keep a
wgmma in flight across steps; instead each step
carries its product, unscaled, and its row scale ``sa[rows] * sb`` to the
next step, which issues its own wgmma, loads its row scales and evaluates
the previous step's ``total + part * scale`` while the wgmma runs; after the
wait it forms its own scale (two multiplies) and hands its accumulator on. The compute context
promotes the last step's product; the first step promotes a zero product
into the zero sum. Every step's promotion is the plain step's expression on
the same operands, in the same order, so the two equal bit for bit (and the
scales are powers of two, so ``part * scale`` is exact short of underflow
below float32's normal range: fusing the multiply-add or not cannot differ
either).
The wgrad kernel's overlap (``mosaic_fp8_tgmm``) carries the scaled product
instead and multiplies after the wait: its scale is an outer product of a
row and a column vector (34 registers per thread as vectors, 64 formed).
Here the scale is a row vector, 2 registers per thread, so the product can
wait unscaled and the whole promotion runs under the next wgmma.
Registers during the wgmma: running sum, pending product and accumulator
3 x 64, the pending and the new row scales 2 + 2, the weight scale one
scalar: about 200 of the 232, the same in either split (above); the
multiply-add consumes the pending product as it goes.

Ping-pong (the compute warpgroups taking turns at the tensor cores, each
promoting under the other's wgmma) was measured twice and removed: handed over
once a wgmma was issued, 0.87x (both wgmmas were then always pending together,
``kernel_anatomy-20261203-220125``); handed over once it had completed, 0.91x
forward and 0.91-0.93x dgrad at both DeepSeek-V3 shapes, same bits
(``fp8_kernels-pingpong-k7168-n4096-20261204-003649``, ``-k2048-n7168-20261204-004320``).

Timed on the H200 and left opt-in, same bits (``fp8_kernels-s5-early-stagger-fence-
20261204-102810``, K=7168 N=4096 G=32, fwd / dgrad TF/s against the default's 1,176 /
1,154): five stages (``num_stages=5``, they fit in the rows split) 1,088 / 1,106,
``early_release`` 1,153 / 1,127, ``stagger`` 1,144 / 1,121. ``epilogue="batched"`` ran even (1,214 / 1,185 against
1,216 / 1,188, ``fp8_kernels-fwd-batched-wgrad-prefetch-k7168-n4096-20261204-124244``).
``cluster=2`` (CTA pairs with the weight tile multicast, as DeepGEMM's 2-CTA
clusters) gave the same bits and no gain: fwd / dgrad 1,178 / 1,179 against
1,205 / 1,182 at K=7168 N=4096, 1,082 / 1,154 against 1,085 / 1,181 at K=2048
N=7168, 0.95-0.97x under Dirichlet(0.3) and at G=256
(``fp8_kernels-fwd-cluster-*-20261204-16*``): the weight tile's L2 traffic is not
what holds these kernels back.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir.dialects import nvvm

from dropless.ops import quant
from dropless.ops.gmm import reference as ref_backend
from dropless.ops.gmm import schedule as schedule_lib
from dropless.ops.gmm.mosaic_gmm import _store_tile, num_real_tiles, persistent_kernel, walk_row_tiles

BLOCK = quant.BLOCKWISE_TILE  # 128: scale block along the contraction and the outputs (DeepSeek-V3)
BLOCK_M = 64  # two f32 accumulators per thread must fit the register file
# How the two compute warpgroups share a CTA tile: "columns", 64 rows x 256
# columns (each warpgroup its 128 columns, both reading the 64-row a tile), or
# "rows", 128 rows x 128 columns (each its 64 rows, both reading the b tile).
SPLITS = ("columns", "rows")
WEIGHT_SCALES = ("gmem", "smem")  # where a step reads its weight scale (gmm_fp8_blockwise)
SCALE_FENCES = ("auto", "commit", "thread", "none")  # how a step fences its scale reads
# Where the plain step reads its scales from shared memory and fences the reads (the
# fence must come before the slot goes back to TMA, i.e. before the step's body returns):
# "before" (the default) ahead of its wgmma, or "under" it, between the wgmma's issue and
# its wait. In ptxas' SASS for an H200 (``tools/sass_schedule.sh``, 2026-12-06) the fence
# of "before" is a ``MEMBAR.ALL.CTA`` (with "commit" also a warpgroup ``BAR.SYNC``) that
# waits for the scale loads (the wgrad's 22 ``LDS`` at ``block_n=160``, the forward's 4)
# before the warpgroup can issue its ``QGMMA``s; "under" issues them first. The same
# values in the same expression, so the same bits (GPU tests too). Timed on the H200
# (M=65536 G=32 K=2048 N=7168, CUPTI, one process, ``fp8_kernels-20261206-215854``): the
# forward 1.624 against 1.630 ms, dgrad 1.513 against 1.516 (even), the wgrad at 160
# columns 2.535 against 2.185 ms with float32 output and 2.380 against 2.070 with bf16
# (0.86x, 0.87x: slower, presumably the loads competing with the wgmma's own reads of
# shared memory). So "before" stays the default and "under" is kept only as an option.
SCALE_READS = ("before", "under")
# How a warpgroup stores a whole output tile (``mosaic_gmm._store_tile``): a fence and a
# barrier per 64x64 chunk (the default), or both chunks under one fence ("batched",
# opt-in until timed; the wgrad's batched epilogue ran 1.00-1.04x, ``mosaic_fp8_tgmm``).
EPILOGUES = ("chunks", "batched")
# wgmmas per warpgroup step (``parts``): n over 128 / n columns each, or a tuple of the
# slices' widths ((96, 32): the long slice's promotion under the short slice's wgmma, only
# the short one's 16 multiply-adds per thread after the last wait)
PARTS = (1, 2, 4, (96, 32))
_SCALE_WINDOW = 32  # weight-scale columns per step's TMA row with weight_scales="smem"
# Output columns per warpgroup (wgmma's N; ``gmm_fp8_blockwise(block_o=...)``): 128, one
# weight block (the default), or 192, as DeepGEMM's SM90 FP8 GEMM with 128x128 weight
# scales takes tiles up to 128x192 (its heuristic stops there for register spills). A
# 192-column tile starts at a multiple of 64, so it holds three 64-column chunks each
# inside one weight block: the first block's or the next one's, by the tile's offset.
BLOCK_OS = (BLOCK, 192)
_WIDE_CHUNK = 64  # a wide tile's columns under one weight block's scale
_MEMORY_REGISTERS = 40


@plgpu.inline_mgpu()
def proxy_fence(_ctx):
    """``fence.proxy.async.shared::cta`` by each thread, without ``commit_smem``'s
    warpgroup barrier: this thread's generic-proxy shared-memory accesses are ordered
    before its later async-proxy ones (TMA, wgmma)."""
    nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)


def _interpreting():
    """Whether Pallas' GPU interpreter runs the kernels traced now
    (``plgpu.force_gpu_interpret_mode``), which cannot run ``proxy_fence``. jax
    0.11.2 has no public query; its context manager sets this config value."""
    from jax._src import config

    return config.pallas_tpu_interpret_mode_context_manager.value is not None


def resolve_scale_fence(scale_fence, who):
    """``scale_fence`` checked and ``"auto"`` resolved (``gmm_fp8_blockwise``)."""
    if scale_fence not in SCALE_FENCES:
        raise ValueError(f"{who}: {scale_fence=} must be one of {SCALE_FENCES}")
    if scale_fence == "auto":
        return "commit" if _interpreting() else "thread"
    return scale_fence


def fence_scale_reads(scale_fence):
    """Order this thread's generic-proxy reads of a pipeline slot's scales before TMA
    refills the slot: ``"thread"``, the proxy fence; ``"commit"``, ``commit_smem``;
    ``"none"``, nothing (the slot's release barrier alone, as DeepGEMM's kernels do)."""
    if scale_fence == "thread":
        proxy_fence()
    elif scale_fence == "commit":
        plgpu.commit_smem()


def check_scale_reads(scale_reads, not_plain, who):
    """Raise ValueError unless ``scale_reads`` is one of ``SCALE_READS``, or if it is
    ``"under"`` for a step that is not the plain one (``not_plain``)."""
    if scale_reads not in SCALE_READS:
        raise ValueError(f"{who}: {scale_reads=} must be one of {SCALE_READS}")
    if scale_reads == "under" and not_plain:
        raise ValueError(f"{who}: scale_reads='under' takes the plain step (overlap=False, "
                         "parts=1)")


def check_parts(parts, who):
    """Raise ValueError unless ``parts`` is one of ``PARTS``."""
    if parts not in PARTS:
        raise ValueError(f"{who}: {parts=} must be one of {PARTS}")


def part_slices(parts, cols):
    """(first column, width) of each of ``parts``' slices (``PARTS``) of a ``cols``-wide
    step."""
    widths = (cols // parts,) * parts if isinstance(parts, int) else tuple(parts)
    assert sum(widths) == cols, (parts, cols)
    return tuple((sum(widths[:i]), w) for i, w in enumerate(widths))


def promote_in_parts(total, lhs, b_smem, first, parts, scale_of):
    """One step with ``parts`` above 1 (``gmm_fp8_blockwise``'s docstring): the
    warpgroup's wgmmas over ``parts`` column slices of ``b_smem`` (its rows ``first`` on,
    one per output column, contraction-major), each into a fresh accumulator and
    committed in turn; each slice then promoted into ``total`` [rows, cols] as soon as
    its own wgmma has completed, as ``total + part * scale_of(i)``. Shared with the
    wgrad's plain step (``mosaic_fp8_tgmm``), whose scale is an outer product."""
    rows, cols = total.shape
    slices = part_slices(parts, cols)
    rhs = [b_smem.at[pl.ds(first + s, w)].T for s, w in slices]

    def step(*accs):
        for acc, r in zip(accs, rhs):
            plgpu.wgmma(acc, lhs, r)
        out = []
        for i, (acc, (s, w)) in enumerate(zip(accs, slices)):
            # Slice i's wgmma is done; the later ones may still run.
            part = plgpu.wgmma_accumulator_load(acc, wait_n=len(slices) - 1 - i)
            out.append(total[:, s:s + w] + part * scale_of(i))
        return jnp.concatenate(out, axis=1)

    return pl.run_scoped(step, *[plgpu.ACC((rows, w), jnp.float32) for _, w in slices])


def _swizzle_transforms(minor_elems, dtype):
    swizzle = plgpu.find_swizzle(minor_elems * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))


def check_shapes(aq_MC, sa, bq_GOC, sb, group_sizes_G):
    """Raise ValueError unless the kernel takes these operands; returns (m, c, o, g)."""
    m, c = aq_MC.shape
    g, o, cb = bq_GOC.shape
    if aq_MC.dtype != jnp.float8_e4m3fn or bq_GOC.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"mosaic fp8 gmm: operands must be float8_e4m3fn, got {aq_MC.dtype} "
                         f"and {bq_GOC.dtype}")
    if cb != c:
        raise ValueError(f"mosaic fp8 gmm: a has {c} columns but b [G, O, C] has C={cb}")
    if c % BLOCK or o % (2 * BLOCK):
        raise ValueError(f"mosaic fp8 gmm: contraction {c=} must be a multiple of {BLOCK} and "
                         f"output columns {o=} of {2 * BLOCK}")
    if m < 1 or m % 8:
        raise ValueError(f"mosaic fp8 gmm: rows {m=} must be a positive multiple of 8")
    want = {"sa": (c // BLOCK, m), "sb": (g, c // BLOCK, o // BLOCK), "group_sizes": (g,)}
    got = {"sa": sa.shape, "sb": sb.shape, "group_sizes": group_sizes_G.shape}
    for name in want:
        if tuple(got[name]) != want[name]:
            raise ValueError(f"mosaic fp8 gmm: {name} must have shape {want[name]}, got {got[name]}")
    return m, c, o, g


def gmm_fp8_blockwise(aq_MC, sa, bq_GOC, sb, group_sizes_G, *, out_dtype=jnp.bfloat16,
                      num_stages=4, grid_tile_width=8, sms=None, split="rows", overlap=False,
                      chain=False, weight_scales="smem", scale_fence="auto", early_release=False,
                      stagger=False, epilogue="chunks", cluster=1, parts=1, block_o=BLOCK,
                      scale_reads="before"):
    """y [M, O] = per-group blockwise-scaled a . b[g]^T; see the module docstring.

    Rows past ``sum(group_sizes)`` come out as zeros. ``split`` (``SPLITS``),
    ``grid_tile_width`` (the tile walk sweeps the column bands over this many
    row tiles at a time), ``num_stages``, ``overlap`` (promote each step's
    product during the next step's wgmma), ``chain``, ``weight_scales``,
    ``scale_fence``, ``early_release``, ``stagger``, ``epilogue`` (``EPILOGUES``) and
    ``parts`` change how the kernel runs, not its bits.

    ``parts`` (``PARTS``; opt-in; the plain step only): each warpgroup's step is
    ``parts`` wgmmas over 128 / ``parts`` columns each (or over the widths of a tuple,
    ``(96, 32)``), into as many accumulators, committed one after the other; each slice
    is promoted as soon as its wgmma has completed (``wgmma_accumulator_load(wait_n=...)``)
    while the later ones still run, and only the last slice's multiply-adds (64 /
    ``parts`` per thread; 16 with ``(96, 32)``) follow the last wait. In the plain step
    all 64 follow it with the tensor cores idle for this warpgroup, and the other
    warpgroup, waiting on the same stage, promotes at the same time (71% tensor-pipe
    activity, ``kernel_anatomy-20261204-062616``). ``overlap`` was meant to hide the
    promotion too, but ptxas schedules the carried product's 64 register copies and the
    previous step's 64 multiply-adds before the step's wgmma (its SASS,
    ``logs/fp8-fwd-overlap-ptx-20261204-1830/``), so nothing runs under the wgmma.
    Here the accumulators are fresh in each step and nothing is carried, so there is
    nothing to copy. The cost: each slice's wgmma reads the warpgroup's 64-row operand
    tile from shared memory again (per warpgroup and step 24 KiB at ``parts=1``, 32 at
    2, 48 at 4). Each element's promotion is the plain step's expression on the same
    operands, so the bits are the same. On the H200, 2 ran 0-1% faster than the plain
    step, 4 0.79x, 2 with ``scale_fence="none"`` 1.02-1.08x
    (``fp8_kernels-parts-*-20261204-21*``); ``(96, 32)`` is untimed: its 96-column
    slice's 48 multiply-adds per thread have to fit under the 32-column wgmma.

    ``overlap=True`` with ``parts=2`` (opt-in, untimed; per-tile pipelines, no cluster)
    carries the halves across steps: each input slot is released one step late
    (``BlockSpec(delay_release=1)``, as jax's Hopper matmul keeps a wgmma in flight), so
    a step issues its first half's wgmma, promotes the previous step's second half under
    it, issues its own second half into the tile's second-half accumulator and promotes
    its first half under that; the last step's second half is promoted after the
    pipeline. Every promotion then runs under a wgmma, and each element still adds its
    steps' ``part * scale`` in step order, so the bits are the plain step's. Pallas' GPU
    interpreter cannot run it (it has no store into a wgmma accumulator), so its bits
    are checked on the hardware only.

    ``stagger`` (opt-in; the plain step only): at the first step of each tile the
    second compute warpgroup waits until the first one's wgmma has completed, then
    both run free. Both warpgroups otherwise wait for the same stage, issue
    together and promote together while the tensor cores idle (71% tensor-pipe
    activity, ``kernel_anatomy-20261204-062616``); started half a step apart, each
    could promote under the other's wgmma. Unlike the ping-pong (measured, removed:
    module docstring) nothing holds them apart after that first step, so there is
    no per-step hand-over to pay; whether they stay apart is what the hardware
    says.

    ``block_o`` (``BLOCK_OS``; opt-in until timed): a warpgroup's output columns, 128
    or 192 (a CTA tile of 128 x 192 in the rows split, the plain step). One wgmma of N =
    192 per step; its running sum and step product take 2 x 96 registers per thread (the
    default 2 x 64). A tile starts at a multiple of 192 columns, so at offset 0 or 64 in
    its first 128-column weight block: each 64-column chunk lies in that block or the
    next, and its step scale is ``row scale * that block's scale`` (both blocks' scales
    read per step; with ``weight_scales="smem"`` from a 64-wide window), the default's
    expression, so the same bits. O need not be a multiple of 192: the last band's rows
    of b past O are TMA's zeros and its stores are clipped. Per FLOP the wider tile reads
    a 64-row a tile and the scales once for 1.5x the columns, and has two thirds of the
    tiles' epilogues and per-step waits.

    ``cluster=2`` (opt-in; measured 0.95-1.00x on the H200, module docstring;
    ``split="rows"`` per-tile pipelines only): the CTAs run in
    pairs (``persistent_kernel``'s clusters), each pair on 256-row tiles of the
    schedule, each CTA on its 128 rows of one, and the pair's shared weight tile is
    loaded once for both: each CTA's TMA fetches half of it and multicasts it into
    both CTAs' shared memory (``collective_axes`` of its ``BlockSpec``; the slot's
    release barrier then spans the cluster, so neither CTA refills a slot the other
    still reads). DeepGEMM's FP8 kernels use such 2-CTA clusters; it halves the
    weight tile's L2-to-SM traffic. Each tile's steps, promotions and stores are the
    per-CTA kernel's, so the bits are the same. The cost: a 256-row tile that holds
    a group boundary is visited once per group, as a 128-row one is, and a CTA whose
    128 rows lie outside the visited group computes them and stores nothing; with
    groups padded to 128 rows, each group boundary that falls at an odd multiple of
    128 rows costs two 128-row tiles of extra work (the pair tile visited twice,
    half of each visit wasted).

    ``early_release`` (opt-in; the plain step only): each compute warpgroup hands
    a step's shared-memory slot back to the memory warpgroup as soon as its wgmma
    has completed (``manual_consumed_barriers``), before it promotes, instead of
    when the step's body returns, as DeepGEMM's kernels do; the memory warpgroup
    can then refill the slot one promotion earlier. All of the slot's reads are
    done by then: the scales were read (and fenced) before the wgmma's wait (before
    its issue with the default ``scale_reads``), and the operands by the wgmma itself.

    ``weight_scales`` (``WEIGHT_SCALES``): where a step reads its weight block's
    scale. ``"gmem"``: one scalar load from global memory per step, issued before
    the step's wgmma. ``"smem"``: a 128-byte window of the step's row of ``sb`` (32
    column blocks' scales at this contraction block, holding the CTA's; ``sb``
    padded to whole windows) rides the TMA pipeline with the step's codes and row
    scales, so it arrives stages ahead and is read from shared memory (a TMA
    destination in shared memory is 128-byte aligned: a full 224-byte row of 56
    blocks per stage failed on the H200 with a misaligned address,
    ``logs/fp8-wsmem-*-misaligned-20261204-*``). Why: the forward's Nsight Compute
    source page (``logs/fp8-fwd-pingpong-anatomy-20261203-2156/``) had 7.9% of all
    samples on the ``FMUL`` that consumes the global load, after the wgmma's wait
    (long scoreboard); with ``"smem"`` that stall is gone and the tensor pipe is
    active 71.3% of the time against 65.0% (``kernel_anatomy-20261204-062616``).

    ``scale_reads`` (``SCALE_READS``; the plain step, ``parts=1``): whether a step reads
    and fences its row and weight scales ``"before"`` its wgmma is issued (the default)
    or ``"under"`` it, between the issue and the wait; with ``early_release`` the slot
    is still handed back only after both.

    ``scale_fence`` (``SCALE_FENCES``): how a step orders its generic-proxy reads
    of the scales before TMA refills their slot. ``"commit"``: ``plgpu.commit_smem``
    (a proxy fence, then a warpgroup barrier). ``"thread"``: the proxy fence alone.
    ``"auto"`` (the default): ``"thread"``, or ``"commit"`` under Pallas' GPU
    interpreter, whose race detector then checks the same schedule.
    Every thread arrives on the slot's release barrier itself
    (``mbarrier.arrive.release`` per thread in the warp-specialized pipeline), so
    each thread's fence orders its own reads before its own release and the
    barrier adds nothing the release needs. Pallas' GPU interpreter cannot run the
    inline fence (``plgpu.inline_mgpu``), so ``"thread"`` is checked on the
    hardware only (bitwise against ``"commit"``, and ``compute-sanitizer``).
    ``"none"`` (opt-in): no fence; the release barrier alone orders the reads before
    the refill, as in DeepGEMM's SM90 FP8 GEMM (its math warpgroups read the row scales
    with ``ld.shared`` and arrive on the stage's empty barrier after the wgmma, with no
    proxy fence between). PTX's memory model asks for the fence; in practice the
    refill's TMA is issued only after the memory warpgroup has waited on that barrier,
    after the reads' values were consumed. The interpreter's race detector models the
    two proxies apart and would report it, so ``"none"`` is checked on the hardware
    only: the same bits as the default in its GPU tests (``compute-sanitizer`` not yet
    run on it), 1-2% faster in short runs and even after 8 s under the power cap
    (``fp8_kernels-nofence-*-20261204-18*``), so it stays opt-in.

    ``chain`` (opt-in; no faster than per-tile pipelines on the H200,
    ``notes/fp8.md``): each CTA's tile pipelines run as one chain
    (``emit_pipeline_warp_specialized``'s ``pipeline_state``), so the memory
    warpgroup loads a tile's first steps while the compute warpgroups finish the
    previous tile, instead of after. It needs the step count C / 128
    to be a multiple of ``num_stages`` (every slot's barrier phase then lines up
    from one tile to the next). The tiles past the groups' rows (zeros) are
    stored first, in their own loop, so every CTA's chain ends on a real tile.

    Raises:
      ValueError: shapes or dtypes the kernel cannot take (``check_shapes``), an
        unknown ``split``, ``weight_scales`` or ``scale_fence``, ``chain`` with C / 128
        not a multiple of ``num_stages``, ``early_release`` or ``stagger`` with
        ``overlap``, ``cluster`` not 1 or 2, or 2 with ``split="columns"``, ``chain``,
        ``early_release``, ``stagger`` or an odd ``sms``, ``parts`` not in ``PARTS``, or
        other than 1 with ``early_release``, ``stagger`` or (unless 2) ``overlap``, or
        ``overlap`` with ``parts=2`` and ``chain`` or ``cluster=2``; ``block_o`` not in
        ``BLOCK_OS``, or 192 with ``overlap``, ``parts``, ``split="columns"``,
        ``cluster=2``, ``early_release`` or ``stagger``; ``scale_reads`` not in
        ``SCALE_READS``, or ``"under"`` with ``overlap`` or ``parts`` other than 1.
    """
    m, c, o, _ = check_shapes(aq_MC, sa, bq_GOC, sb, group_sizes_G)
    scale_fence = resolve_scale_fence(scale_fence, "mosaic fp8 gmm")
    check_scale_reads(scale_reads, overlap or parts != 1, "mosaic fp8 gmm")
    if block_o not in BLOCK_OS:
        raise ValueError(f"mosaic fp8 gmm: {block_o=} must be one of {BLOCK_OS}")
    wide = block_o != BLOCK
    if wide and (overlap or parts != 1 or split != "rows" or cluster != 1 or early_release
                 or stagger):
        raise ValueError(f"mosaic fp8 gmm: {block_o=} takes the plain step in the rows split "
                         f"(overlap=False, parts=1, cluster=1, no early_release or stagger); got "
                         f"{overlap=}, {parts=}, {split=}, {cluster=}, {early_release=}, "
                         f"{stagger=}")
    if early_release and overlap:
        raise ValueError("mosaic fp8 gmm: early_release=True takes the plain step (overlap=False)")
    if stagger and overlap:
        raise ValueError("mosaic fp8 gmm: stagger=True takes the plain step (overlap=False)")
    check_parts(parts, "mosaic fp8 gmm")
    # overlap with parts=2: the halves across steps (``overlap``'s docstring paragraph)
    cross = overlap and parts == 2
    if parts != 1 and ((overlap and not cross) or early_release or stagger):
        raise ValueError(f"mosaic fp8 gmm: {parts=} takes the plain step (or overlap with "
                         f"parts=2) without early_release or stagger, got {overlap=} "
                         f"{early_release=} {stagger=}")
    if cross and (chain or cluster != 1):
        raise ValueError(f"mosaic fp8 gmm: overlap with parts=2 takes per-tile pipelines "
                         f"(no chain) and cluster=1, got {chain=} {cluster=}")
    if weight_scales not in WEIGHT_SCALES:
        raise ValueError(f"mosaic fp8 gmm: {weight_scales=} must be one of {WEIGHT_SCALES}")
    if epilogue not in EPILOGUES:
        raise ValueError(f"mosaic fp8 gmm: {epilogue=} must be one of {EPILOGUES}")
    scales_in_smem = weight_scales == "smem"
    # With "smem" each step loads the window of 32 column blocks (128 bytes: a TMA
    # destination in shared memory is 128-byte aligned, so each stage's row must be) that
    # holds the CTA's; a wide tile's two blocks may straddle two windows, so it loads 64.
    window_cols = 2 * _SCALE_WINDOW if wide else _SCALE_WINDOW
    if scales_in_smem and (wide or sb.shape[-1] % _SCALE_WINDOW):
        # Pad the column blocks to whole windows (the padding is never used).
        pad = -sb.shape[-1] % _SCALE_WINDOW + (_SCALE_WINDOW if wide else 0)
        sb = jnp.pad(sb, ((0, 0), (0, 0), (0, pad)))
    out_dtype = jnp.dtype(out_dtype)
    # 4-byte outputs double the epilogue buffers; one load stage less keeps smem in bounds.
    num_stages = num_stages if out_dtype.itemsize <= 2 else min(num_stages, 3)
    if split not in SPLITS:
        raise ValueError(f"mosaic fp8 gmm: {split=} must be one of {SPLITS}")
    bm, bo, bc = BLOCK_M, block_o, BLOCK  # one warpgroup's tile: 64 x block_o
    if chain and (c // bc) % num_stages:
        raise ValueError(f"mosaic fp8 gmm: chain=True needs C / {bc} = {c // bc} steps to be a "
                         f"multiple of {num_stages=}")
    by_rows = split == "rows"
    cta_m, cta_o = (2 * bm, bo) if by_rows else (bm, 2 * bo)
    n_bands = -(-o // cta_o)  # a wide tile's last band may run past O (TMA clips it)
    if cluster not in (1, 2):
        raise ValueError(f"mosaic fp8 gmm: {cluster=} must be 1 or 2")
    clustered = cluster == 2
    if clustered and (not by_rows or chain or early_release or stagger or (sms or 0) % 2):
        raise ValueError("mosaic fp8 gmm: cluster=2 takes split='rows' per-tile pipelines "
                         "(no chain, early_release or stagger) and an even sms, got "
                         f"{split=} {chain=} {early_release=} {stagger=} {sms=}")
    # A cluster's tile: its CTAs' row tiles one above the other, one weight tile.
    sched = schedule_lib.row_tile_schedule(group_sizes_G, m, cluster * cta_m)
    in_transforms = _swizzle_transforms(bc, aq_MC.dtype)
    out_transforms = _swizzle_transforms(64, out_dtype)

    # cross: a step's slot is released one step late, after the next step's body, so its
    # second half's wgmma may still run when its own body returns.
    delay = {"delay_release": 1} if cross else {}

    def make_pipeline(mma_body, compute_context, pipeline_state=None):
        return plgpu.emit_pipeline_warp_specialized(
            mma_body,
            grid=(c // bc,),
            memory_registers=_MEMORY_REGISTERS,
            in_specs=[
                plgpu.BlockSpec((cta_m, bc), lambda kk: (0, kk), transforms=in_transforms,
                                **delay),
                plgpu.BlockSpec((cta_o, bc), lambda kk: (0, kk), transforms=in_transforms,
                                **({"collective_axes": ("cluster",)} if clustered else {}),
                                **delay),
                plgpu.BlockSpec((1, cta_m), lambda kk: (kk, 0), **delay),
                *([plgpu.BlockSpec((1, window_cols), lambda kk: (kk, 0), **delay)]
                  if scales_in_smem else []),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=num_stages,
            compute_context=compute_context,
            pipeline_state=pipeline_state,
            manual_consumed_barriers=early_release,
        )

    def body(group_ref, row_start_ref, lo_ref, hi_ref, num_tiles_ref, num_real_ref, a_gmem, sa_gmem,
             b_gmem, sb_gmem, o_gmem):
        ignore = lambda *_, **__: None
        pipeline_allocs = make_pipeline(ignore, ignore).get_allocations(
            a_gmem.at[pl.ds(0, cta_m)], b_gmem.at[0, pl.ds(0, cta_o)],
            sa_gmem.at[:, pl.ds(0, cta_m)],
            *([sb_gmem.at[0, :, pl.ds(0, window_cols)]] if scales_in_smem else []))

        @functools.partial(
            pl.run_scoped,
            pipeline_allocs=pipeline_allocs,
            out_smem=[
                plgpu.RefUnion(
                    plgpu.SMEM((max(2, bo // 64), 64, 64), out_dtype,
                               transforms=out_transforms),
                    plgpu.SMEM((64, bo), out_dtype),
                )
                for _ in range(2)
            ],
            **({"offset": plgpu.Barrier(num_arrivals=1)} if stagger else {}),
            collective_axes="wg",
        )
        def _scope(pipeline_allocs, out_smem, offset=None):
            wg = lax.axis_index("wg")
            # This CTA's 128 rows of its cluster's 256-row tile (cluster=2).
            cta_row = lax.axis_index("cluster") * cta_m if clustered else None

            @walk_row_tiles(num_tiles_ref[0], num_real_ref[0], n_bands, grid_tile_width, chain)
            def _tile(t, band, state):
                group = group_ref[t]
                row_start = row_start_ref[t] if cta_row is None else row_start_ref[t] + cta_row
                row_start = pl.multiple_of(row_start, cta_m)
                # This warpgroup's 64 x 128 part of the CTA tile.
                wg_row = pl.multiple_of(row_start + wg * bm, bm) if by_rows else row_start
                col0 = pl.multiple_of(band * cta_o + (0 if by_rows else wg * bo), bo)
                lo, hi = lo_ref[t], hi_ref[t]

                def store(out):
                    for w in range(2):
                        @pl.when(wg == w)
                        def _store_own():
                            tiles_smem, rows_smem = out_smem[w]
                            _store_tile(out, tiles_smem=tiles_smem, rows_smem=rows_smem,
                                        o_gmem=o_gmem, m=m, bm=bm, bn=bo, row_start=wg_row,
                                        col0=col0, lo=lo, hi=hi,
                                        batched=epilogue == "batched")

                # The warpgroup's weight block (a wide tile's first one).
                col_block = col0 // BLOCK
                # The window of weight-scale columns this CTA's tile reads (``"smem"``);
                # both warpgroups' column blocks lie in it. From the CTA's first column,
                # not the warpgroup's: the memory warpgroup loads it (a wide tile's first
                # block and the next lie in it too).
                window = band * cta_o // BLOCK // _SCALE_WINDOW * _SCALE_WINDOW
                zeros = lambda: plgpu.layout_cast(jnp.zeros((bm, bo), jnp.float32),
                                                  plgpu.Layout.WGMMA)
                no_scale = lambda: plgpu.layout_cast(jnp.zeros((bm,), jnp.float32),
                                                     plgpu.Layout.WGMMA.reduce(1))

                half = bo // 2
                second_half = []  # cross: the tile's second-half accumulator, for the body

                def compute_context(eval_pipeline):
                    if cross:  # the last step's second half is still running
                        def scoped(b_acc):
                            second_half[:] = [b_acc]
                            total, pending_scale = eval_pipeline((zeros(), no_scale()))
                            last = plgpu.wgmma_accumulator_load(b_acc, wait_n=0)
                            upper = total[:, half:] + last * lax.broadcast_in_dim(
                                pending_scale, (bm, half), (0,))
                            return jnp.concatenate([total[:, :half], upper], axis=1)

                        total = pl.run_scoped(scoped, plgpu.ACC((bm, half), jnp.float32))
                    elif overlap:  # the last step's product is still pending
                        first_scale = no_scale()
                        total, pending, pending_scale = eval_pipeline(
                            (zeros(), zeros(), first_scale))
                        total = total + pending * by_row(pending_scale)
                    else:
                        total = eval_pipeline(zeros())
                    store(total.astype(out_dtype))

                def by_row(scale):
                    return lax.broadcast_in_dim(scale, (bm, bo), (0,))

                def operands(a_smem, b_smem, sa_smem):
                    """This warpgroup's (lhs, rhs, row scales) refs."""
                    if by_rows:
                        return (a_smem.at[pl.ds(wg * bm, bm)], b_smem.T,
                                sa_smem.at[0, pl.ds(wg * bm, bm)])
                    # [C, O] view of C-major storage
                    return a_smem, b_smem.at[pl.ds(wg * bo, bo)].T, sa_smem.at[0]

                def load_row_scale(rows):
                    row_scale = plgpu.load(rows, layout=plgpu.Layout.WGMMA.reduce(1))
                    # Fence the generic-proxy read before the pipeline hands the slot
                    # back to TMA (module docstring).
                    fence_scale_reads(scale_fence)
                    return row_scale

                def weight_scale(kk, refs):
                    """This step's weight scale (``weight_scales``), read before the
                    row scales' proxy fence; ``refs``: the body's slot refs after the
                    row scales' (the weight scales' first with ``"smem"``)."""
                    if wide:  # the first block's scale and the next one's
                        if scales_in_smem:
                            return (refs[0][0, col_block - window],
                                    refs[0][0, col_block - window + 1])
                        return (sb_gmem[group, kk, col_block],
                                sb_gmem[group, kk, jnp.minimum(col_block + 1, o // BLOCK - 1)])
                    if scales_in_smem:
                        return refs[0][0, col_block - window]
                    return sb_gmem[group, kk, col_block]

                def wide_scale(row_scale, w_scale):
                    """A wide tile's [bm, bo] step scale: each 64-column chunk lies in the
                    first weight block or the next (by the tile's offset in its block),
                    each element ``row_scale * that block's scale``, as the default's."""
                    first, second = w_scale
                    offset = col0 % BLOCK
                    return jnp.concatenate(
                        [lax.broadcast_in_dim(
                            row_scale * jnp.where(offset + i * _WIDE_CHUNK >= BLOCK, second, first),
                            (bm, _WIDE_CHUNK), (0,)) for i in range(bo // _WIDE_CHUNK)], axis=1)

                def mma_body(idx, a_smem, b_smem, sa_smem, *rest):
                    # rest: the weight scales' slot ("smem"), the consumed barriers
                    # (early_release: one per input), the running sum.
                    (kk,), (*refs, total) = idx, rest
                    consumed = refs[1:] if scales_in_smem else refs
                    if offset is not None:  # stagger: warpgroup 1 starts a wgmma later
                        pl.when((kk == 0) & (wg == 1))(lambda: plgpu.barrier_wait(offset))
                    lhs, rhs, rows = operands(a_smem, b_smem, sa_smem)

                    def read_scales():
                        # This step's weight scale, then its row scales and their fence.
                        w_scale = weight_scale(kk, refs)
                        return w_scale, load_row_scale(rows)

                    # "before" (SCALE_READS): read, and fenced, ahead of the wgmma.
                    scales = read_scales() if scale_reads == "before" else None

                    def c_step(acc_ref):
                        plgpu.wgmma(acc_ref, lhs, rhs)
                        # "under": read beside the running wgmma
                        step_scales = read_scales() if scales is None else scales
                        plgpu.wgmma_wait(0)
                        for barrier in consumed:  # early_release: the slot is read
                            plgpu.barrier_arrive(barrier)
                        if offset is not None:
                            pl.when((kk == 0) & (wg == 0))(
                                lambda: plgpu.barrier_arrive(offset))
                        return acc_ref[...], step_scales

                    if parts != 1:
                        w_scale, row_scale = scales
                        widths = [w for _, w in part_slices(parts, bo)]
                        by_width = {w: lax.broadcast_in_dim(row_scale * w_scale, (bm, w), (0,))
                                    for w in dict.fromkeys(widths)}  # one per distinct width
                        return promote_in_parts(total, lhs, b_smem, 0 if by_rows else wg * bo,
                                                parts, lambda i: by_width[widths[i]])
                    part, (w_scale, row_scale) = pl.run_scoped(
                        c_step, plgpu.ACC((bm, bo), jnp.float32))
                    if wide:
                        return total + part * wide_scale(row_scale, w_scale)
                    return total + part * by_row(row_scale * w_scale)

                def mma_body_overlap(idx, a_smem, b_smem, sa_smem, *rest):
                    # (never with early_release: no consumed barriers here)
                    # carry: the running sum, the previous step's product and its row
                    # scale, promoted here while this step's wgmma runs (module docstring).
                    (kk,), (*refs, carry) = idx, rest
                    total, pending, pending_scale = carry
                    w_scale = weight_scale(kk, refs)  # used after the wait
                    lhs, rhs, rows = operands(a_smem, b_smem, sa_smem)

                    def c_step(acc_ref):
                        plgpu.wgmma(acc_ref, lhs, rhs)
                        # While the tensor cores run: this step's row scales, then the
                        # previous step's promotion, the plain step's expression.
                        row_scale = load_row_scale(rows)
                        total_next = total + pending * by_row(pending_scale)
                        plgpu.wgmma_wait(0)
                        return total_next, acc_ref[...], row_scale * w_scale

                    return pl.run_scoped(c_step, plgpu.ACC((bm, bo), jnp.float32))

                def mma_body_cross(idx, a_smem, b_smem, sa_smem, *rest):
                    # carry: the running sum and the previous step's row scale; its
                    # second half's wgmma (``second_half``) may still run. The first
                    # half's wgmma is issued, then the previous step's second half promoted
                    # under it, then this step's second half issued and left running while
                    # the first half is promoted (``gmm_fp8_blockwise``'s docstring).
                    (kk,), (*refs, (total, pending_scale)) = idx, rest
                    [b_acc] = second_half
                    w_scale = weight_scale(kk, refs)
                    lhs, _, rows = operands(a_smem, b_smem, sa_smem)
                    scale = load_row_scale(rows) * w_scale
                    first = 0 if by_rows else wg * bo
                    rhs = [b_smem.at[pl.ds(first + s, w)].T for s, w in part_slices(2, bo)]

                    def by_row_half(s):
                        return lax.broadcast_in_dim(s, (bm, half), (0,))

                    def c_step(a_acc):
                        plgpu.wgmma(a_acc, lhs, rhs[0])
                        # The previous step's second half is done (this step's first may run).
                        prev = plgpu.wgmma_accumulator_load(b_acc, wait_n=1)
                        upper = total[:, half:] + prev * by_row_half(pending_scale)
                        b_acc[...] = plgpu.layout_cast(jnp.zeros((bm, half), jnp.float32),
                                                       plgpu.Layout.WGMMA)
                        plgpu.wgmma(b_acc, lhs, rhs[1])
                        # This step's first half is done (its second half may run).
                        cur = plgpu.wgmma_accumulator_load(a_acc, wait_n=1)
                        lower = total[:, :half] + cur * by_row_half(scale)
                        return jnp.concatenate([lower, upper], axis=1)

                    total = pl.run_scoped(c_step, plgpu.ACC((bm, half), jnp.float32))
                    return total, scale

                def run(state):
                    make_pipeline(mma_body_cross if cross else
                                  mma_body_overlap if overlap else mma_body, compute_context,
                                  state)(
                        a_gmem.at[pl.ds(row_start, bm)],
                        b_gmem.at[group, pl.ds(band * cta_o, cta_o)],
                        sa_gmem.at[:, pl.ds(row_start, bm)],
                        *([sb_gmem.at[group, :, pl.ds(window, window_cols)]]
                          if scales_in_smem else []),
                        allocations=pipeline_allocs,
                    )

                if state is None:
                    pl.when(group >= 0)(lambda: run(None))
                else:  # a chained tile is a real one (walk_row_tiles)
                    run(state)

                @pl.when((group < 0) & (wg < 2))
                def _zero_tile():
                    store(plgpu.layout_cast(jnp.zeros((bm, bo), out_dtype), plgpu.Layout.WGMMA))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = persistent_kernel(body, jax.ShapeDtypeStruct((m, o), out_dtype), sms, name="gmm_fp8",
                               cluster=cluster)
    return kernel(sched.group_T, sched.row_start_T, sched.store_lo_T, sched.store_hi_T,
                  sched.num_tiles, num_real_tiles(sched, chain), aq_MC, sa, bq_GOC, sb)


# ----------------------------------------------------------------------------
# Operand layouts (quantizers from ``ops.quant``; power-of-two float32 scales).


def quantize_weight(w_GKN):
    """(wq [G, K, N] E4M3, sw [G, Kb, Nb]): 128x128 blocks, serving fwd and dgrad."""
    return quant.quantize_blocks(w_GKN, (1, BLOCK, BLOCK))


def quantize_rows(a_MC):
    """(aq [M, C] E4M3, sa [Cb, M]): 1x128 tiles along C, scales transposed for the kernel."""
    aq, sa = quant.quantize_blocks(a_MC, (1, BLOCK))
    return aq, sa.T


def fwd_operands(x_MK, wq_GKN, sw):
    """Kernel operands of y = x . w[g]: (xq, sx, wq as [G, N, K], sw)."""
    xq, sx = quantize_rows(x_MK)
    return xq, sx, jnp.swapaxes(wq_GKN, 1, 2), sw


def dgrad_operands(dy_MN, wq_GKN, sw):
    """Kernel operands of dx = dy . w[g]^T: (dyq, sdy, wq [G, K, N] as is, sw as [G, Nb, Kb])."""
    dyq, sdy = quantize_rows(dy_MN)
    return dyq, sdy, wq_GKN, jnp.swapaxes(sw, 1, 2)


def reference(aq_MC, sa, bq_GOC, sb, group_sizes_G, out_dtype=jnp.bfloat16):
    """The kernel's result from the dequantized operands (float32 HIGHEST, per-group masked)."""
    a = quant.dequantize_blocks(aq_MC, sa.T, (1, BLOCK))
    b = quant.dequantize_blocks(jnp.swapaxes(bq_GOC, 1, 2), sb, (1, BLOCK, BLOCK))
    return ref_backend.gmm(a, b, group_sizes_G, out_dtype=out_dtype)
