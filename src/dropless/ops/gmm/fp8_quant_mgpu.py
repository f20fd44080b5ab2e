"""FP8 quantizers in Pallas Mosaic GPU (Hopper): the 128x128 weight quantizer, the
1x128 rows and 128x1 columns quantizers of an activation, and both of those from one
read.

Legend: G groups, K x N the weight dims, Kb = K / 128, Nb = N / 128; M rows,
C columns of an activation, Mb = M / 128, Cb = C / 128.

  weight   w [G, K, N] -> codes [G, K, N] E4M3, codes [G, N, K] E4M3 (optional),
                          scales [G, Kb, Nb]
  rows     a [M, C] -> codes [M, C] E4M3, scales [Cb, M]     (fwd's x, dgrad's dy)
  columns  a [M, C] -> codes [C, M] E4M3, scales [Mb, C]     (wgrad's x and dy)
  rows_and_columns  a [M, C] -> both of the above            (the backward's dy)

the same bits as ``ops.quant.quantize_blocks`` with blocks (1, 128, 128), (1, 128)
and (128, 1) (tested, NaN, infinite, zero and float32-subnormal blocks included)
and as the Pallas-on-Triton kernels of the same names in ``fp8_quant_kernels``,
but for the codes of a block whose scale is NaN: the compiled Triton kernels
write -448 there (their maximum ignores NaN on the GPU), these NaN, as the model
does. Dequantized, both are NaN.

Why the weight kernel: the model stores the layers' expert weights stacked
[L, G, K, N] and each layer quantizes its slice ``w[l]``. XLA reads such a slice
in place for a typed-FFI custom call, as Mosaic GPU's are (its dynamic-slice
fusion; seen for the Mosaic GEMMs in the bf16 step), but copies it out first for
a Triton call: on the H200 those copies took 3.95 ms of a 351 ms FP8 step
(``benchmarks/notes/fp8_hlo.md``, Q2; ``benchmarks/fp8_weight_slice.py`` checks
which happens for each kernel). Why the columns kernel: the Triton one ran at
about 56% of a plain copy's bandwidth on the H200 (``benchmarks/notes/fp8.md``),
and it runs twice per MoE layer. All are off Pallas's Triton backend, which jax
0.11.2 deprecates.

Design, shared: one warpgroup per CTA (lane semantics) walks a line of 128x128
tiles with ``plgpu.emit_pipeline``, TMA loads ``max_concurrent_steps`` tiles
ahead and asynchronous TMA stores of the codes from ``out_slots`` smem buffers,
so the input is read once and each output written once.

- The bf16 tile lands in swizzled smem and is read into registers in the WGMMA
  layout (ldmatrix). Mosaic GPU reduces such a tiled array one axis at a time.
- NaN becomes +inf before the max (``quant._tensor_amax``'s rule), so the
  result does not depend on whether a max propagates NaN; a non-finite amax
  gives the NaN scale either way.
- Mosaic GPU has no register transpose, and storing codes through a transposed
  view of their smem tile does not lower (1-byte elements); a transposed layout
  comes from reading the bf16 tile through its transpose (``smem.T``, a
  transposing ldmatrix).

Weight: one CTA per (group, 128-row band of K), walking the band's Nb tiles.
The block's amax is a max over columns, then over rows. The transposed codes
come from reading the same smem tile again through its transpose and scaling it
again: two smem reads and twice the arithmetic per tile, no extra global
traffic. The scale is stored as a scalar into global memory.

Activations: one CTA per (128-column band of C, run of ``m_tiles`` row
tiles). Whichever the layout, a block is a row of registers, reduced over axis 1
to a row-layout vector (one value per row), broadcast back along the rows to
scale, and the 128 scales are stored from that vector straight into global
memory (each value by the four lanes that hold its row). Rows: the tile is read
as it lies, [128 M, 128 C], so a 1x128 block is a row, and its scales go to
``scales[j, 128 i:128 (i + 1)]`` of the transposed [Cb, M] scales. Columns: the
tile is read transposed, [128 C, 128 M], so a 128x1 block of a is a row and the
codes tile is already in the [C, M] layout. Both: the two reads of one smem tile,
each with its own codes buffer and TMA store.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from dropless.ops import quant
from dropless.ops.gmm.mosaic_gmm import vary_like

BLOCK = quant.BLOCKWISE_TILE  # 128
E4M3 = quant.E4M3


def _swizzle_transforms(dtype, minor=BLOCK):
    """Swizzled smem for a tile with ``minor``-element rows (what the WGMMA-layout loads
    need to be free of bank conflicts; TMA writes and reads it)."""
    swizzle = plgpu.find_swizzle(minor * jnp.dtype(dtype).itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
            plgpu.SwizzleTransform(swizzle))


def _magnitudes(x):
    """|x| in x's dtype, +inf where x is NaN (``quant._tensor_amax``'s rule)."""
    a = jnp.abs(x)
    return jnp.where(jnp.isnan(a), jnp.asarray(jnp.inf, a.dtype), a)


def _flushed(amax):
    """amax as float32, 0 where below the smallest normal (where ``quant._read`` flushes
    every value reduced to zero)."""
    amax = amax.astype(jnp.float32)
    return jnp.where(amax < quant._F32_TINY, jnp.float32(0), amax)


def _amax(x):
    """max |_read(x)| of a tile as float32, +inf where it holds a NaN or an infinity
    (``quant._tensor_amax``, reduced one axis at a time)."""
    return _flushed(jnp.max(jnp.max(_magnitudes(x), axis=1), axis=0))


def _row_amax(x):
    """max |_read(x)| of each row of a tile as float32 [rows], +inf where the row holds a
    NaN or an infinity."""
    return _flushed(jnp.max(_magnitudes(x), axis=1))


def _codes(x, inv):
    """``quant._saturate(quant._read(x) * inv, E4M3)`` without the clamp, which never
    binds here: inv is the power of two that maps the block's amax to at most 448, and
    a product by a power of two is exact, so |x * inv| <= 448 (a NaN stays NaN either
    way). Two instructions per element fewer."""
    return (quant._read(x) * inv).astype(E4M3)


def check_operand(shape, dtype):
    """Raise ValueError unless w is [G, K, N] bfloat16 with K and N positive multiples of 128.

    (A float32 tile does not lower: Mosaic GPU has no transposed smem load for 4-byte
    elements in this layout.)
    """
    if len(shape) != 3 or any(s % BLOCK for s in shape[1:]) or 0 in shape:
        raise ValueError(f"fp8_quant_mgpu.quantize_weight: w must be [G, K, N] with K and N "
                         f"positive multiples of {BLOCK}, got {tuple(shape)}")
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"fp8_quant_mgpu.quantize_weight: w must be bfloat16, got {jnp.dtype(dtype)}")


@functools.partial(jax.jit, static_argnames=("transposed", "max_concurrent_steps", "out_slots"))
def quantize_weight(w_GKN, transposed=True, max_concurrent_steps=2, out_slots=1):
    """128x128 blocks of w [G, K, N] bf16 from one read: (wq [G, K, N] E4M3, wq as [G, N, K],
    sw [G, Kb, Nb] float32), or (wq, sw) when ``transposed`` is False.

    How the kernel runs, not what it returns (the same bits): ``max_concurrent_steps``
    w tiles in flight per CTA (32 KiB of smem each at bf16), ``out_slots`` tiles of
    codes whose stores may be in flight while the next is written (32 KiB each with
    the transposed codes, 16 without). The defaults take 96 KiB, so two CTAs share
    an SM.

    Off a GPU it runs only inside ``plgpu.force_gpu_interpret_mode``.

    Raises:
      ValueError: w not [G, K, N] bfloat16 with K and N positive multiples of 128;
        max_concurrent_steps or out_slots < 1.
    """
    check_operand(w_GKN.shape, w_GKN.dtype)
    if min(max_concurrent_steps, out_slots) < 1:
        raise ValueError(f"fp8_quant_mgpu.quantize_weight: {max_concurrent_steps=} and "
                         f"{out_slots=} must be >= 1")
    g, k, n = w_GKN.shape
    kb, nb = k // BLOCK, n // BLOCK
    out_type = [jax.ShapeDtypeStruct((g, k, n), E4M3)]
    if transposed:
        out_type.append(jax.ShapeDtypeStruct((g, n, k), E4M3))
    out_type.append(jax.ShapeDtypeStruct((g, kb, nb), jnp.float32))
    codes_smem = plgpu.SMEM((out_slots, BLOCK, BLOCK), E4M3, transforms=_swizzle_transforms(E4M3))

    def body(w_gmem, *out_gmem):
        *codes_gmem, s_gmem = out_gmem
        e, i = lax.axis_index("g"), lax.axis_index("k")

        def scoped(out_smem):
            def tile(idx, w_smem):
                (j,) = idx
                slot = j % out_slots
                x = plgpu.load(w_smem, layout=plgpu.Layout.WGMMA)
                scale, inv = quant.pow2_scale_parts(_amax(x), E4M3)
                s_gmem[e, i, j] = scale
                # The stores issued from this slot out_slots tiles ago must have read it.
                plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
                out_smem[0][slot] = _codes(x, inv)
                if transposed:
                    out_smem[1][slot] = _codes(plgpu.load(w_smem.T, layout=plgpu.Layout.WGMMA), inv)
                # Orders this tile's smem writes, and its reads of w_smem (which the
                # pipeline refills next, by TMA), before the asynchronous copies.
                plgpu.commit_smem()
                dst = [codes_gmem[0].at[e, pl.ds(i * BLOCK, BLOCK), pl.ds(j * BLOCK, BLOCK)]]
                if transposed:
                    dst.append(codes_gmem[1].at[e, pl.ds(j * BLOCK, BLOCK), pl.ds(i * BLOCK, BLOCK)])
                for c, (src, d) in enumerate(zip(out_smem, dst)):  # one group per tile
                    plgpu.copy_smem_to_gmem(src.at[slot], d, commit_group=c == len(dst) - 1)

            w_spec = plgpu.BlockSpec((BLOCK, BLOCK), lambda j: (i, j),
                                     transforms=_swizzle_transforms(w_GKN.dtype))
            plgpu.emit_pipeline(tile, grid=(nb,), in_specs=[w_spec],
                                max_concurrent_steps=max_concurrent_steps)(w_gmem.at[e])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scoped, [codes_smem] * len(codes_gmem))

    out = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(g, kb),
        grid_names=("g", "k"),
        kernel_name="fp8_quantize_weight",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(w_GKN)
    return tuple(vary_like(o, (w_GKN,)) for o in out)


def _check_activation(name, shape, dtype):
    if len(shape) != 2 or any(s % BLOCK for s in shape) or 0 in shape:
        raise ValueError(f"fp8_quant_mgpu.{name}: a must be [M, C] with M and C "
                         f"positive multiples of {BLOCK}, got {tuple(shape)}")
    if jnp.dtype(dtype) != jnp.bfloat16:
        raise ValueError(f"fp8_quant_mgpu.{name}: a must be bfloat16, got {jnp.dtype(dtype)}")


def _divisor_at_most(n, cap):
    """The largest divisor of n not above cap."""
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


def _row_blocks(x):
    """(scales [rows] float32, codes E4M3) of a register tile whose blocks are its rows."""
    scale, inv = quant.pow2_scale_parts(_row_amax(x), E4M3)
    return scale, _codes(x, lax.broadcast_in_dim(inv, x.shape, (0,)))


def swiglu(gu_MC2):
    """h [M, C] bf16 = silu(gate) * up of gu [M, 2C] = [gate | up], computed in float32
    and rounded once: what ``swiglu_quantize_rows`` and ``swiglu_quantize_columns``
    quantize (the same expression, so off the GPU the same bits)."""
    g, u = (t.astype(jnp.float32) for t in jnp.split(gu_MC2, 2, axis=-1))
    return _swiglu_f32(g, u).astype(jnp.bfloat16)


def _swiglu_f32(g, u):
    # silu(g) = g * sigmoid(g), spelled out: Mosaic GPU's lane semantics lower exp, not
    # the logistic. exp(-g) = inf for g <= -89 gives g / inf = -0 (silu's limit).
    return g / (1 + jnp.exp(-g)) * u


def _activation_kernel(name, a_MC, rows, columns, m_tiles, max_concurrent_steps, out_slots,
                       prologue=None, half_tiles=False):
    """The rows outputs (codes [M, C], scales [Cb, M]) if ``rows``, then the columns
    outputs (codes [C, M], scales [Mb, C]) if ``columns``, from one read of a [M, C];
    with ``prologue="swiglu"``, of ``swiglu(a)`` from one read of a [M, 2C].

    ``half_tiles`` (one layout only): tiles half as long across the blocks, 64 rows of
    128 columns for rows, 128 rows of 64 columns for columns; half the smem and
    registers per step in flight, so a deeper pipeline still lets two CTAs share an SM.
    ``m_tiles`` then counts 64-row tiles for rows."""
    _check_activation(name, a_MC.shape, a_MC.dtype)
    if min(m_tiles, max_concurrent_steps, out_slots) < 1:
        raise ValueError(f"fp8_quant_mgpu.{name}: {m_tiles=}, {max_concurrent_steps=} "
                         f"and {out_slots=} must be >= 1")
    if half_tiles and rows and columns:
        raise ValueError(f"fp8_quant_mgpu.{name}: half_tiles needs one layout (rows or columns): "
                         "both read the same 128x128 tile")
    m, c = a_MC.shape
    if prologue == "swiglu":
        if c % (2 * BLOCK):
            raise ValueError(f"fp8_quant_mgpu.{name}: gu must be [M, 2C] with C a multiple of "
                             f"{BLOCK}, got {tuple(a_MC.shape)}")
        c //= 2
    # The tile: tm rows of a by tc columns; a block is a row of it (rows) or a column.
    tm = BLOCK // 2 if half_tiles and rows else BLOCK
    tc = BLOCK // 2 if half_tiles and columns else BLOCK
    mb, cb = m // BLOCK, c // BLOCK
    mt, ct = m // tm, c // tc  # tiles down M, bands across C
    steps = _divisor_at_most(mt, m_tiles)
    out_type = []
    if rows:
        out_type += [jax.ShapeDtypeStruct((m, c), E4M3), jax.ShapeDtypeStruct((cb, m), jnp.float32)]
    if columns:
        out_type += [jax.ShapeDtypeStruct((c, m), E4M3), jax.ShapeDtypeStruct((mb, c), jnp.float32)]

    def body(a_gmem, *out_gmem):
        j, chunk = lax.axis_index("c"), lax.axis_index("m")

        def scoped(*codes_smem):
            def tile(idx, *in_smem):
                (k,) = idx
                i, slot = chunk * steps + k, k % out_slots
                tile_i, tile_j = pl.ds(i * tm, tm), pl.ds(j * tc, tc)

                def load(transposed):
                    """The tile to quantize, as it lies or transposed: a's, or swiglu's
                    of the gate and up tiles (elementwise, so either read works)."""
                    t = [plgpu.load(r.T if transposed else r, layout=plgpu.Layout.WGMMA)
                         for r in in_smem]
                    if prologue is None:
                        return t[0]
                    g, u = (v.astype(jnp.float32) for v in t)
                    return _swiglu_f32(g, u).astype(jnp.bfloat16)

                # The stores issued from these slots out_slots tiles ago must have read them.
                plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
                outs, smem, dst = iter(out_gmem), iter(codes_smem), []
                if rows:  # the plain read: a 1x128 block is a row's 128 values
                    codes_gmem, s_gmem = next(outs), next(outs)
                    scale, q = _row_blocks(load(False))
                    s_gmem[j, tile_i] = scale
                    next(smem)[slot] = q
                    dst.append(codes_gmem.at[tile_i, tile_j])
                if columns:  # the transposed read, [C, M]: a 128x1 block is a row
                    codes_gmem, s_gmem = next(outs), next(outs)
                    scale, q = _row_blocks(load(True))
                    s_gmem[i, tile_j] = scale
                    next(smem)[slot] = q
                    dst.append(codes_gmem.at[tile_j, tile_i])
                # Orders this tile's smem writes, and its reads of a_smem (which the
                # pipeline refills next, by TMA), before the asynchronous copies.
                plgpu.commit_smem()
                for n, (src, d) in enumerate(zip(codes_smem, dst, strict=True)):  # one group per tile
                    plgpu.copy_smem_to_gmem(src.at[slot], d, commit_group=n == len(dst) - 1)

            # The gate tile, and with the prologue the up tile C columns (ct tiles) further on.
            specs = [plgpu.BlockSpec((tm, tc), lambda k, o=o: (chunk * steps + k, j + o),
                                     transforms=_swizzle_transforms(a_MC.dtype, tc))
                     for o in ((0,) if prologue is None else (0, ct))]
            plgpu.emit_pipeline(tile, grid=(steps,), in_specs=specs,
                                max_concurrent_steps=max_concurrent_steps)(
                                    *[a_gmem] * len(specs))
            plgpu.wait_smem_to_gmem(0)

        codes_shape = (tm, tc) if rows else (tc, tm)  # as the block rows lie
        codes_smem = plgpu.SMEM((out_slots, *codes_shape), E4M3,
                                transforms=_swizzle_transforms(E4M3, codes_shape[1]))
        pl.run_scoped(scoped, *[codes_smem] * (rows + columns))

    out = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(ct, mt // steps),
        grid_names=("c", "m"),
        kernel_name=f"fp8_{name}",  # fp8_quantize_rows, ...: told apart in a profile
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Lane),
    )(a_MC)
    return tuple(vary_like(o, (a_MC,)) for o in out)


_BOTH_LAYOUTS_KWARGS = ("m_tiles", "max_concurrent_steps", "out_slots")  # one tile feeds both
_TILE_KWARGS = (*_BOTH_LAYOUTS_KWARGS, "half_tiles")


@functools.partial(jax.jit, static_argnames=_TILE_KWARGS)
def quantize_rows(a_MC, m_tiles=8, max_concurrent_steps=2, out_slots=1, half_tiles=False):
    """(aq [M, C] E4M3, sa [Cb, M] float32): 1x128 blocks of a [M, C] bf16 along C, scales
    transposed (``fp8_quant_kernels.quantize_rows``, ``mosaic_fp8.quantize_rows``).

    How the kernel runs, not what it returns (the same bits): as in
    ``quantize_columns``.

    Off a GPU it runs only inside ``plgpu.force_gpu_interpret_mode``.

    Raises:
      ValueError: a not [M, C] bfloat16 with M and C positive multiples of 128;
        m_tiles, max_concurrent_steps or out_slots < 1.
    """
    return _activation_kernel("quantize_rows", a_MC, True, False, m_tiles, max_concurrent_steps,
                              out_slots, half_tiles=half_tiles)


@functools.partial(jax.jit, static_argnames=_TILE_KWARGS)
def swiglu_quantize_rows(gu_MC2, m_tiles=8, max_concurrent_steps=2, out_slots=1, half_tiles=False):
    """``quantize_rows(swiglu(gu))`` from one read of gu [M, 2C] = [gate | up] bf16, h
    never written: (hq [M, C] E4M3, sh [Cb, M] float32), the down projection's operand
    quantized where it is produced.

    Each CTA pipelines the gate tile and the up tile Cb column blocks further on; the
    rest as ``quantize_rows``. Two 128x128 tiles a step take 64 KiB of smem, so at two
    steps in flight one CTA fills an SM (255 registers, compiled for an H200);
    ``half_tiles`` (64-row tiles, the same bits) takes half that per step, so two CTAs
    share an SM at two or three steps in flight (``benchmarks/fp8_quant.py
    --swiglu-variants`` times them).

    Off a GPU it runs only inside ``plgpu.force_gpu_interpret_mode``.

    Raises:
      ValueError: gu not [M, 2C] bfloat16 with M and C positive multiples of 128;
        m_tiles, max_concurrent_steps or out_slots < 1.
    """
    return _activation_kernel("swiglu_quantize_rows", gu_MC2, True, False, m_tiles,
                              max_concurrent_steps, out_slots, prologue="swiglu",
                              half_tiles=half_tiles)


@functools.partial(jax.jit, static_argnames=_TILE_KWARGS)
def swiglu_quantize_columns(gu_MC2, m_tiles=8, max_concurrent_steps=2, out_slots=1, half_tiles=False):
    """``quantize_columns(swiglu(gu))`` from one read of gu [M, 2C] = [gate | up] bf16:
    (hq [C, M] E4M3, sh [Mb, C] float32), the down projection's wgrad operand (the
    backward recomputes h here instead of reading it).

    Off a GPU it runs only inside ``plgpu.force_gpu_interpret_mode``.

    Raises:
      ValueError: as ``swiglu_quantize_rows``.
    """
    return _activation_kernel("swiglu_quantize_columns", gu_MC2, False, True, m_tiles,
                              max_concurrent_steps, out_slots, prologue="swiglu",
                              half_tiles=half_tiles)


@functools.partial(jax.jit, static_argnames=_TILE_KWARGS)
def quantize_columns(a_MC, m_tiles=8, max_concurrent_steps=2, out_slots=1, half_tiles=False):
    """(aq [C, M] E4M3, sa [Mb, C] float32): 128x1 blocks of a [M, C] bf16 along M, codes
    M-major (``fp8_quant_kernels.quantize_columns``, ``mosaic_fp8_tgmm.quantize_columns``).

    How the kernel runs, not what it returns (the same bits): each CTA walks the
    largest divisor of Mb not above ``m_tiles`` tiles down its 128-column band of C
    (more CTAs than bands: C = 2048 has 16), ``max_concurrent_steps`` and
    ``out_slots`` as in ``quantize_weight`` (a tiles 32 KiB of smem each, codes 16:
    the defaults take 80 KiB, so two CTAs share an SM).

    Off a GPU it runs only inside ``plgpu.force_gpu_interpret_mode``.

    Raises:
      ValueError: a not [M, C] bfloat16 with M and C positive multiples of 128;
        m_tiles, max_concurrent_steps or out_slots < 1.
    """
    return _activation_kernel("quantize_columns", a_MC, False, True, m_tiles,
                              max_concurrent_steps, out_slots, half_tiles=half_tiles)


@functools.partial(jax.jit, static_argnames=_BOTH_LAYOUTS_KWARGS)
def quantize_rows_and_columns(a_MC, m_tiles=8, max_concurrent_steps=2, out_slots=1):
    """``(*quantize_rows(a), *quantize_columns(a))`` from one read of a [M, C] bf16:
    (aq [M, C] E4M3, sa [Cb, M], aq's 128x1 codes [C, M] E4M3, their scales [Mb, C]),
    float32 scales (``fp8_quant_kernels.quantize_rows_and_columns``; the backward's
    dy, which dgrad reads in 1x128 blocks and wgrad in 128x1 blocks).

    How the kernel runs, not what it returns (the same bits): as in
    ``quantize_columns``, with two codes tiles per slot (the defaults take 96 KiB of
    smem, so two CTAs share an SM).

    Off a GPU it runs only inside ``plgpu.force_gpu_interpret_mode``.

    Raises:
      ValueError: a not [M, C] bfloat16 with M and C positive multiples of 128;
        m_tiles, max_concurrent_steps or out_slots < 1.
    """
    return _activation_kernel("quantize_rows_and_columns", a_MC, True, True, m_tiles,
                              max_concurrent_steps, out_slots)
