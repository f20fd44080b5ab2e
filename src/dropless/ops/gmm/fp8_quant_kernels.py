"""Single-pass quantization kernels (Pallas, Triton backend) for the FP8 blockwise GEMMs.

Legend: M rows, C columns, G groups, K x N the weight dims; Cb = C / 128,
Mb = M / 128.

Each kernel reads its input once and writes the E4M3 codes and the float32
power-of-two scales in the layout the FP8 kernels read (``mosaic_fp8``,
``mosaic_fp8_tgmm``), with the numerics of ``ops.quant.quantize_blocks``
(the same helper functions compute the scale exponents; results equal bit
for bit, tested):

  rows     a [M, C] -> codes [M, C], scales [Cb, M]     (1x128; fwd's x, dgrad's dy)
  columns  a [M, C] -> codes [C, M], scales [Mb, C]     (128x1 along M, codes M-major;
                                                         wgrad's x and dy)
  rows_and_columns  a [M, C] -> both of the above       (from one read: the backward's
                                                         dy, which dgrad and wgrad read)
  weight   w [G, K, N] -> codes [G, K, N], codes [G, N, K], scales [G, Kb, Nb]
                                                        (128x128; dgrad's and fwd's layouts
                                                         from one read)

Why our own: XLA's fusion of ``quantize_blocks`` splits the block reduction
from the scaling, so it reads its input twice (and the columns layout adds
a strided transpose). On the H200 at x [65536, 7168] bf16 the XLA passes
ran at 1,754 GB/s (rows), 1,088 (columns, from a bf16 transpose) and 1,620
(weight, both layouts) against 3,357 for a plain bf16 copy in the same run
(``benchmarks/fp8_quant.py``, record of 2026-12-01 19:50). One read per
element is the floor these kernels aim at; ``fp8_quant.py`` times both.

Off an NVIDIA GPU (tests) they run in Pallas interpret mode (``interpret``
None picks by the default device). Shapes: M and C multiples of 128 (the kernel path pads rows to 128; the FP8
GEMMs need K and N multiples of 256). Other shapes raise ValueError.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dropless.ops import quant

BLOCK = quant.BLOCKWISE_TILE  # 128
E4M3 = quant.E4M3


def _amax(x32, axis):
    """Largest |x| along ``axis``, NaN where that line holds a NaN (a max reduction on
    the GPU need not propagate NaN, so it is checked on its own)."""
    amax = jnp.max(jnp.abs(x32), axis=axis)
    has_nan = jnp.max(jnp.where(jnp.isnan(x32), 1.0, 0.0), axis=axis) > 0
    return jnp.where(has_nan, jnp.float32(jnp.nan), amax)


def _codes(x32, inv):
    return quant._saturate(x32 * inv, E4M3)


def _check(name, shape):
    if any(s % BLOCK for s in shape[-2:]) or 0 in shape:
        raise ValueError(f"fp8_quant_kernels.{name}: the last two dims {shape[-2:]} must be "
                         f"positive multiples of {BLOCK}")


def default_interpret() -> bool:
    """The kernels compile for NVIDIA GPUs; elsewhere (tests) they are interpreted."""
    return jax.devices()[0].platform != "gpu"


def _call(kernel, operand, grid, in_specs, out_specs, out_shape, interpret, num_warps=8):
    if interpret is None:
        interpret = default_interpret()
    # Inside shard_map (the MoE layer's experts run there) pallas_call needs
    # each output's manual-axis type: the codes and scales vary as the operand.
    axis_type = getattr(jax.typeof(operand), "manual_axis_type", None)
    out_shape = [jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=axis_type) for o in out_shape]
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs,
                          out_shape=out_shape, interpret=interpret,
                          compiler_params=_compiler_params(num_warps))(operand)


def _compiler_params(num_warps=8):
    from jax.experimental.pallas import triton as pltriton

    # A 128x128 tile held in float32 is 64 values per thread at 8 warps, 128 at 4.
    # The rows and weight kernels run at 8. The columns and fused kernels run at 4:
    # the larger share per thread cost nothing there, they ran faster (``NUM_WARPS``).
    return pltriton.CompilerParams(num_warps=num_warps, num_stages=1)


# The (M/128, C/128) grid of the activation kernels reads a in 128x128 tiles and
# writes each layout's tile of codes and its 128 scales.
_TILE = pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (i, j))


def _rows_out(m, c):
    """(out_specs, out_shape) of the rows layout: codes [M, C], scales [Cb, M]."""
    return ([_TILE, pl.BlockSpec((1, BLOCK), lambda i, j: (j, i))],
            [jax.ShapeDtypeStruct((m, c), E4M3), jax.ShapeDtypeStruct((c // BLOCK, m), jnp.float32)])


def _columns_out(m, c):
    """(out_specs, out_shape) of the columns layout: codes [C, M], scales [Mb, C]."""
    return ([pl.BlockSpec((BLOCK, BLOCK), lambda i, j: (j, i)),
             pl.BlockSpec((1, BLOCK), lambda i, j: (i, j))],
            [jax.ShapeDtypeStruct((c, m), E4M3), jax.ShapeDtypeStruct((m // BLOCK, c), jnp.float32)])


def _row_codes(x):
    """(codes [M, C] E4M3, scales [M]) of one read tile x [M, C]: 1x128 blocks."""
    scale, inv = quant.pow2_scale_parts(_amax(x, 1), E4M3)
    return _codes(x, inv[:, None]), scale


# The columns and fused kernels' warp counts. On the H200 at a [65536, C] bf16,
# C = 7168, 4096, 2048, 4 warps ran the columns kernel 1.23-1.24x and the fused
# kernel 1.45-1.47x faster than 8 at every C (C = 7168: 0.926 -> 0.754 ms and
# 1.360 -> 0.941 ms; rows + columns as two kernels took 1.329 ms, so the fused
# kernel only pays at 4), the same bits (record
# ``fp8_quant_columns-20261202-104303``). 8 is kept to be timed
# (``benchmarks/fp8_quant.py --columns-variants``).
NUM_WARPS = (4, 8)


def _column_codes(x):
    """(codes [C, M] E4M3, scales [C]) of one read tile x [M, C]: 128x1 blocks, the codes
    transposed. (Transposing the float32 scaled values or the input tile instead, or
    walking the tiles C-fastest, ran within 1% of this in the same record.)"""
    scale, inv = quant.pow2_scale_parts(_amax(x, 0), E4M3)
    return _codes(x, inv[None, :]).T, scale


def _check_num_warps(name, num_warps):
    if num_warps not in NUM_WARPS:
        raise ValueError(f"fp8_quant_kernels.{name}: num_warps={num_warps!r} is not one of {NUM_WARPS}")


def _rows_kernel(a_ref, q_ref, s_ref):
    q, scale = _row_codes(quant._read(a_ref[...]))
    q_ref[...] = q
    s_ref[...] = scale[None, :]


@functools.partial(jax.jit, static_argnames="interpret")
def quantize_rows(a_MC, interpret=None):
    """(aq [M, C] E4M3, sa [Cb, M]): 1x128 blocks along C (``mosaic_fp8.quantize_rows``)."""
    _check("quantize_rows", a_MC.shape)
    m, c = a_MC.shape
    return _call(_rows_kernel, a_MC, (m // BLOCK, c // BLOCK), [_TILE], *_rows_out(m, c), interpret)


def _columns_kernel(a_ref, q_ref, s_ref):
    q, scale = _column_codes(quant._read(a_ref[...]))  # a tile [BLOCK rows (M), BLOCK cols (C)]
    q_ref[...] = q
    s_ref[...] = scale[None, :]


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def quantize_columns(a_MC, interpret=None, num_warps=4):
    """(aq [C, M] E4M3, sa [Mb, C]): 128x1 blocks along M, codes M-major
    (``mosaic_fp8_tgmm.quantize_columns``).

    ``num_warps`` (one of ``NUM_WARPS``; 4, the faster on the H200, see there)
    chooses how the kernel runs, not what it returns (the same bits).

    Raises:
      ValueError: M or C not a positive multiple of 128; num_warps not in NUM_WARPS.
    """
    _check("quantize_columns", a_MC.shape)
    _check_num_warps("quantize_columns", num_warps)
    m, c = a_MC.shape
    return _call(_columns_kernel, a_MC, (m // BLOCK, c // BLOCK), [_TILE], *_columns_out(m, c),
                 interpret, num_warps)


def _rows_and_columns_kernel(a_ref, qr_ref, sr_ref, qc_ref, sc_ref):
    x = quant._read(a_ref[...])
    q, scale = _row_codes(x)
    qr_ref[...] = q
    sr_ref[...] = scale[None, :]
    q, scale = _column_codes(x)
    qc_ref[...] = q
    sc_ref[...] = scale[None, :]


@functools.partial(jax.jit, static_argnames=("interpret", "num_warps"))
def quantize_rows_and_columns(a_MC, interpret=None, num_warps=4):
    """``(*quantize_rows(a), *quantize_columns(a))`` from one read of a:
    (aq [M, C] E4M3, sa [Cb, M], aq's 128x1 codes [C, M] E4M3, their scales [Mb, C]),
    the same bits as the two kernels (tested). For the backward's dy, which dgrad
    reads in 1x128 blocks and wgrad in 128x1 blocks. ``num_warps`` as in
    ``quantize_columns`` (at 8 this kernel ran slower than the two kernels).

    Raises:
      ValueError: M or C not a positive multiple of 128; num_warps not in NUM_WARPS.
    """
    _check("quantize_rows_and_columns", a_MC.shape)
    _check_num_warps("quantize_rows_and_columns", num_warps)
    m, c = a_MC.shape
    (rows_specs, rows_shape), (cols_specs, cols_shape) = _rows_out(m, c), _columns_out(m, c)
    return tuple(_call(_rows_and_columns_kernel, a_MC, (m // BLOCK, c // BLOCK), [_TILE],
                       rows_specs + cols_specs, rows_shape + cols_shape, interpret, num_warps))


def _weight_kernel(w_ref, *out_refs):
    x = quant._read(w_ref[0])  # [BLOCK (K), BLOCK (N)]
    scale, inv = quant.pow2_scale_parts(_amax(_amax(x, 1), 0), E4M3)
    q = _codes(x, inv)
    out_refs[0][0] = q
    if len(out_refs) == 3:
        out_refs[1][0] = q.T
    out_refs[-1][...] = jnp.broadcast_to(scale, (1, 1, 1))


@functools.partial(jax.jit, static_argnames=("transposed", "interpret"))
def quantize_weight(w_GKN, transposed=True, interpret=None):
    """128x128 blocks of w (``mosaic_fp8.quantize_weight``) from one read:
    (wq [G, K, N] E4M3, wq as [G, N, K], sw [G, Kb, Nb]), or without the
    transposed copy (what only dgrad reads) when ``transposed`` is False."""
    _check("quantize_weight", w_GKN.shape)
    g, k, n = w_GKN.shape
    kb, nb = k // BLOCK, n // BLOCK
    spec = lambda f: pl.BlockSpec((1, BLOCK, BLOCK), f)  # noqa: E731
    out_specs = [spec(lambda e, i, j: (e, i, j))]
    out_shape = [jax.ShapeDtypeStruct((g, k, n), E4M3)]
    if transposed:
        out_specs.append(spec(lambda e, i, j: (e, j, i)))
        out_shape.append(jax.ShapeDtypeStruct((g, n, k), E4M3))
    out_specs.append(pl.BlockSpec((1, 1, 1), lambda e, i, j: (e, i, j)))
    out_shape.append(jax.ShapeDtypeStruct((g, kb, nb), jnp.float32))
    return tuple(_call(_weight_kernel, w_GKN, (g, kb, nb), [spec(lambda e, i, j: (e, i, j))],
                       out_specs, out_shape, interpret))
