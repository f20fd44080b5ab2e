"""FP8 quantizers: per-tensor current scaling, blockwise (1x128 / 128x128) and MXFP8.

Every quantizer returns ``(q, scale)``: ``q`` holds the FP8 codes, same shape
as the input, and ``scale`` the dequantization multiplier(s), so that
``dequantize(q, scale) ~= x``. Scales are computed from the current values
("current scaling"): no amax history, no state. All functions are pure JAX,
elementwise plus small reductions, so XLA fuses them with whatever produces
their input; nothing here is a separate kernel.

Formats (OCP 8-bit floating point):

  E4M3 (``float8_e4m3fn``): largest finite 448 = 1.75 * 2^8, smallest normal
    2^-6, subnormals down to 2^-9, no infinity; one NaN code. Relative
    rounding error <= 2^-4 in the normal range, absolute <= 2^-10 below it.
  E5M2 (``float8_e5m2``): largest finite 57344 = 1.75 * 2^15, normals down to
    2^-14, subnormals down to 2^-16; error <= 2^-3 relative, 2^-17 absolute.
  E8M0 (``float8_e8m0fnu``): a bare exponent, 2^(b - 127) for byte b in
    [0, 254]; b = 255 is NaN. No zero, no sign.

Conversion to FP8 rounds to nearest, ties to even, after clamping to the
format's finite range (saturating: a value past the largest finite becomes the
largest finite, never NaN). Inputs are read in float32.

Scaling rules (``amax`` = largest |x| of the tensor or block, in float32):

  ``quantize_tensor`` (per-tensor current scaling, Transformer Engine's
    ``Float8CurrentScaling``): ``inv = fmax / amax`` (float32, not a power of
    two, capped at 2^126), ``q = sat(x * inv)``, ``scale = 1 / inv``, so amax
    maps to the format's largest value. amax = 0 gives scale 1.
  ``quantize_blocks`` (blockwise, the DeepSeek-V3 recipe): one float32 scale
    per block (1x128 tiles of activations, 128x128 blocks of weights). The
    scale is the smallest power of two 2^k with amax <= fmax * 2^k (what
    Transformer Engine's ``Float8BlockScaling`` uses by default), so nothing
    saturates, and ``q * 2^k`` is exact in bfloat16: a bf16 GEMM of the
    dequantized operands computes exactly the FP8 products. k is clamped to
    [-126, 127] (float32 normals); amax = 0 gives scale 1.
  ``quantize_mx`` (MXFP8, OCP Microscaling Formats v1.0 section 6.3): E4M3
    elements, one E8M0 scale 2^X per 32 contiguous elements along one axis,
    ``X = floor(log2(amax)) - 8`` (8 = emax of E4M3) clamped to [-127, 127],
    elements ``sat(x / 2^X)``. |x| / 2^X lies in [0, 512), so the largest
    elements of a block may saturate to 448 (at most 1/7 relative error; the
    spec's rule, unlike Transformer Engine's MXFP8 quantizer, which rounds X
    up instead). amax = 0 gives X = -127 and zero codes.

Special values. Input magnitudes below the smallest float32 normal (2^-126)
are treated as zero, on every platform (XLA flushes them on CPU and GPU
anyway; doing it explicitly makes the result platform-independent). A NaN
or infinity poisons its whole scaling unit: the scale becomes NaN (E8M0 code
0xFF for MXFP8) and every element of the tensor or block dequantizes to NaN,
so a non-finite activation cannot hide inside a quantized step (the trainer
skips steps whose loss is not finite). Dequantized values below 2^-126 (only
possible for blocks with amax below about 2^-110) flush to zero.

Legend for block shapes: a block shape has one entry per axis; 1 means "every
index its own block along this axis". Sizes that are not a multiple of the
block are allowed: the last block is partial (padding with zeros, which do
not change amax).
"""

import math

import jax
import jax.numpy as jnp
from jax import lax

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
E8M0 = jnp.dtype(jnp.float8_e8m0fnu)
FP8_DTYPES = (E4M3, E5M2)
MX_BLOCK = 32  # elements per E8M0 scale (OCP MX)
BLOCKWISE_TILE = 128  # DeepSeek-V3: activations 1x128, weights 128x128
# The quantizers run under this jax name scope, so their fusions (amax, scale,
# convert) carry it in XLA's op metadata and a profile counts them as
# quantization (perf.breakdown.QUANT_SCOPE).
QUANT_SCOPE = "fp8_quantize"
_F32_TINY = float(jnp.finfo(jnp.float32).tiny)  # 2^-126
_MAX_INV = 2.0**126
_E4M3_EMAX = 8


def fp8_max(dtype) -> float:
    """Largest finite value of an FP8 dtype (448 for E4M3, 57344 for E5M2).

    Raises:
      ValueError: ``dtype`` is not E4M3 or E5M2.
    """
    dtype = jnp.dtype(dtype)
    if dtype not in FP8_DTYPES:
        raise ValueError(f"fp8 dtype must be one of {[d.name for d in FP8_DTYPES]}, got {dtype}")
    return float(jnp.finfo(dtype).max)


def _read(x):
    """x as float32 with magnitudes below the smallest normal set to zero."""
    x = x.astype(jnp.float32)
    return jnp.where(jnp.abs(x) < _F32_TINY, jnp.float32(0), x)


def _saturate(v, dtype):
    """Clamp to the finite range of ``dtype`` and round to nearest even (NaN stays NaN)."""
    m = fp8_max(dtype)
    return jnp.clip(v, -m, m).astype(dtype)


def _pow2(n):
    """2.0**n as float32 for integer n in [-126, 127], built from the exponent bits."""
    return lax.bitcast_convert_type(((n + 127) << 23).astype(jnp.int32), jnp.float32)


def _mul_pow2(v, n):
    """v * 2^n for integer n in [-254, 254], exact whenever the result is a float32 normal.

    Two factors so that neither is a float32 subnormal (2^-127 would flush to zero).
    """
    half = n // 2
    return v * _pow2(half) * _pow2(n - half)


def _floor_log2(a):
    """floor(log2(a)) for float32 a > 0 normal (-127 for a = 0), from the exponent field."""
    return (lax.bitcast_convert_type(a, jnp.int32) >> 23) - 127


def _mantissa(a):
    """a / 2^floor(log2(a)) in [1, 2) for float32 a > 0 normal: the exponent field set to 0."""
    bits = lax.bitcast_convert_type(a, jnp.int32)
    return lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F800000, jnp.float32)


def _nan_max(v, axis=None):
    """``jnp.max(v, axis)``, NaN where the values reduced hold a NaN.

    A max reduction need not propagate NaN (XLA:CPU's drops it in large arrays,
    once a block spans 16 or more rows), so the NaN is found on its own.
    """
    return jnp.where(jnp.any(jnp.isnan(v), axis=axis), jnp.float32(jnp.nan), jnp.max(v, axis=axis))


# ----------------------------------------------------------------------------
# Per-tensor current scaling.


@jax.named_scope(QUANT_SCOPE)
def quantize_tensor(x, dtype=E4M3, pow2=False):
    """Per-tensor current scaling: ``(q, scale)`` with ``x ~= q * scale``.

    Args:
      x: any shape, any float dtype.
      dtype: E4M3 (default) or E5M2.
      pow2: round the scale up to a power of two (``pow2_scale_parts``, as
        ``quantize_blocks`` with one block over the whole tensor; Transformer
        Engine's ``force_pow_2_scales``): then multiplying by the scale is exact
        in any float format, bfloat16 included, at the cost of up to one
        binade of FP8 range left unused.

    Returns:
      q: x's shape in ``dtype``, ``sat(x * inv)`` with ``inv = min(fmax / amax,
      2^126)`` in float32 (with ``pow2``: ``2^-k``, k the smallest with amax <=
      fmax 2^k); scale: [] float32 ``1 / inv`` (1 when amax = 0, NaN when x
      holds a NaN or infinity).

    Raises:
      ValueError: ``dtype`` is not an FP8 dtype.
    """
    fmax = fp8_max(dtype)
    amax = _tensor_amax(x) if x.size else jnp.float32(0)
    if pow2:
        scale, inv = pow2_scale_parts(amax, dtype)
        return _saturate(_read(x) * inv, dtype), scale
    # Multiply by the inverse, as Transformer Engine does: XLA rewrites a division
    # by a broadcast scalar into a multiplication anyway, so this is what runs.
    # The cap keeps 1 / inv a float32 normal (a subnormal scale would flush to 0).
    # On a GPU XLA divides with div.full.f32 (at most 2 ulp off the correctly
    # rounded quotient), so inv and the scale may differ from a CPU's in the last
    # bits (seen: 1 ulp on the H200; tests/ops/test_quant.py bounds it).
    inv = jnp.where(amax > 0, jnp.minimum(fmax / amax, _MAX_INV), jnp.float32(1))
    inv = jnp.where(jnp.isfinite(amax), inv, jnp.float32(jnp.nan))
    return _saturate(_read(x) * inv, dtype), 1 / inv


def _tensor_amax(x):
    """max |_read(x)| as float32, +inf where x holds a NaN or an infinity, from one
    reduction in x's dtype that shares no elementwise value with the cast.

    Equal to the max over the flushed values bit for bit: |x| and its max are exact in
    any float dtype, and a max below 2^-126 means every element flushes to zero. A NaN
    becomes +inf before the max (a max need not propagate NaN: XLA:CPU's drops it in
    large arrays), and a non-finite amax gives the NaN scale either way. Why not max
    over ``_read(x)``: on the H200 XLA then computed the flush once, in the amax
    fusion, and wrote it out for the cast fusion (a full-size mask or, for weights, a
    float32 copy: 5.6 GB of masks and 4.2 GB of copies per proxy step, about 3 ms;
    ``benchmarks/notes/fp8_hlo.md``).
    """
    a = jnp.abs(x)
    amax = jnp.max(jnp.where(jnp.isnan(a), jnp.asarray(jnp.inf, a.dtype), a)).astype(jnp.float32)
    return jnp.where(amax < _F32_TINY, jnp.float32(0), amax)


def dequantize_tensor(q, scale, out_dtype=jnp.float32):
    """``q * scale`` (computed in float32) in ``out_dtype``; shape of q."""
    return (q.astype(jnp.float32) * scale).astype(out_dtype)


# ----------------------------------------------------------------------------
# Block machinery: amax per block and scale broadcast back, with partial blocks.


def _check_block(shape, block):
    if len(block) != len(shape) or any(b < 1 for b in block):
        raise ValueError(f"block {block} must give a size >= 1 for each of the {len(shape)} "
                         f"axes of shape {shape}")


def _blocked(x, block):
    """Pad to a multiple of ``block`` and split each axis into (blocks, within)."""
    pads = [(0, -s % b) for s, b in zip(x.shape, block)]
    if any(p for _, p in pads):
        x = jnp.pad(x, pads)
    split = []
    for s, b in zip(x.shape, block):
        split += [s // b, b]
    return x.reshape(split)


def _block_amax(x32, block):
    """Largest |x| per block -> shape ceil(x.shape / block); NaN if a block holds a NaN."""
    xb = _blocked(jnp.abs(x32), block)
    return _nan_max(xb, tuple(range(1, xb.ndim, 2)))


def _expand(s, shape, block):
    """Broadcast per-block values ``s`` back to ``shape`` (partial last blocks sliced off)."""
    for axis, b in enumerate(block):
        if b > 1:
            s = jnp.repeat(s, b, axis=axis)
    if s.shape != tuple(shape):
        s = s[tuple(slice(0, n) for n in shape)]
    return s


def blocks_shape(shape, block):
    """Shape of the per-block scales of an array of ``shape``: ceil(shape / block)."""
    return tuple(math.ceil(s / b) for s, b in zip(shape, block))


# ----------------------------------------------------------------------------
# Blockwise (power-of-two float32 scales).


def _finite_amax(amax):
    """``isfinite`` for amaxes (never negative: a NaN or +inf is what is not finite), as a
    comparison, which Pallas Mosaic GPU lowers (it has no ``is_finite``)."""
    return amax < jnp.inf


def _pow2_exponent(amax, dtype):
    """Smallest k with amax <= fmax * 2^k (fmax = 1.75 * 2^emax), clamped to [-126, 127]."""
    emax = int(math.log2(fp8_max(dtype) / 1.75))
    safe = jnp.where(_finite_amax(amax) & (amax > 0), amax, jnp.float32(1))
    # amax / 2^(floor(log2 amax) - emax) = mantissa * 2^emax in [2^emax, 2^(emax+1)):
    # past fmax exactly when the mantissa is past 1.75.
    k = _floor_log2(safe) - emax + (_mantissa(safe) > 1.75).astype(jnp.int32)
    k = jnp.where(amax > 0, k, 0)
    return jnp.clip(k, -126, 127)


def pow2_scale_parts(amax, dtype):
    """(scale, inverse) float32 powers of two ``2^k``, ``2^-k`` for amaxes (``_pow2_exponent``);
    NaN both where an amax is not finite (a NaN or infinity in its block)."""
    k = _pow2_exponent(amax, dtype)
    finite = _finite_amax(amax)
    nan = jnp.float32(jnp.nan)
    return jnp.where(finite, _pow2(k), nan), jnp.where(finite, _pow2(-k), nan)


@jax.named_scope(QUANT_SCOPE)
def quantize_blocks(x, block, dtype=E4M3):
    """Blockwise scaling with power-of-two float32 scales: ``(q, scales)``.

    Args:
      x: any shape, any float dtype.
      block: block size per axis, e.g. ``(1, 128)`` for 1x128 activation
        tiles of [M, K], ``(1, 128, 128)`` for 128x128 blocks of w [G, K, N].
      dtype: E4M3 (default) or E5M2.

    Returns:
      q: x's shape in ``dtype``; scales: ``blocks_shape(x.shape, block)``
      float32 powers of two (NaN for a block holding a NaN or infinity).

    Raises:
      ValueError: bad block or dtype.
    """
    block = tuple(block)
    _check_block(x.shape, block)
    x32 = _read(x)
    amax = _block_amax(x32, block)
    scales, inv = pow2_scale_parts(amax, dtype)
    q = _saturate(x32 * _expand(inv, x.shape, block), dtype)
    return q, scales


def dequantize_blocks(q, scales, block, out_dtype=jnp.float32):
    """``q * scale of its block`` in ``out_dtype``; exact in bfloat16 (power-of-two scales).

    Raises:
      ValueError: ``scales`` does not have ``blocks_shape(q.shape, block)``.
    """
    block = tuple(block)
    _check_block(q.shape, block)
    if scales.shape != blocks_shape(q.shape, block):
        raise ValueError(f"scales {scales.shape} do not match q {q.shape} in blocks of {block}")
    return (q.astype(jnp.float32) * _expand(scales, q.shape, block)).astype(out_dtype)


# ----------------------------------------------------------------------------
# MXFP8 (E4M3 elements, E8M0 scales per 32 along one axis).


def _mx_block(ndim, axis, block):
    axis = axis % ndim
    return tuple(block if i == axis else 1 for i in range(ndim))


def mx_exponent(amax):
    """OCP MX shared exponent for E4M3: clamp(floor(log2(amax)) - 8, -127, 127), int32.

    amax = 0 gives -127. (Callers map a non-finite amax to the NaN scale.)
    """
    safe = jnp.where(jnp.isfinite(amax), amax, jnp.float32(0))
    return jnp.clip(_floor_log2(safe) - _E4M3_EMAX, -127, 127)


@jax.named_scope(QUANT_SCOPE)
def quantize_mx(x, axis=-1, block=MX_BLOCK):
    """MXFP8: E4M3 codes and one E8M0 scale per ``block`` elements along ``axis``.

    Args:
      x: any shape (ndim >= 1), any float dtype. ``axis`` is the contraction
        axis of the product the operand feeds.
      axis: the axis the blocks run along.
      block: elements per scale (32 in the OCP spec).

    Returns:
      q: x's shape, E4M3; scales: x's shape with ``axis`` divided by ``block``
      (rounded up), ``float8_e8m0fnu`` (NaN code for a block holding a NaN or
      infinity).

    Raises:
      ValueError: bad axis or block.
    """
    if x.ndim == 0 or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"quantize_mx: axis={axis} is not an axis of shape {x.shape}")
    bshape = _mx_block(x.ndim, axis, block)
    _check_block(x.shape, bshape)
    x32 = _read(x)
    amax = _block_amax(x32, bshape)
    e = mx_exponent(amax)
    finite = jnp.isfinite(amax)
    v = _mul_pow2(x32, -_expand(e, x.shape, bshape))
    v = jnp.where(_expand(finite, x.shape, bshape), v, jnp.float32(jnp.nan))
    codes = jnp.where(finite, e + 127, 255).astype(jnp.uint8)
    return _saturate(v, E4M3), lax.bitcast_convert_type(codes, E8M0)


def mx_scale_exponents(scales):
    """(exponent X int32, finite bool) of E8M0 scales: 2^X, or NaN where not finite."""
    codes = lax.bitcast_convert_type(scales, jnp.uint8).astype(jnp.int32)
    return codes - 127, codes != 255


def dequantize_mx(q, scales, axis=-1, block=MX_BLOCK, out_dtype=jnp.float32):
    """``q * 2^X`` per block in ``out_dtype``; exact in bfloat16 while the result is normal.

    Raises:
      ValueError: ``scales`` does not have the block shape ``quantize_mx`` gives.
    """
    bshape = _mx_block(q.ndim, axis, block)
    if scales.shape != blocks_shape(q.shape, bshape):
        raise ValueError(f"scales {scales.shape} do not match q {q.shape} in blocks of "
                         f"{block} along axis {axis}")
    e, finite = mx_scale_exponents(scales)
    v = _mul_pow2(q.astype(jnp.float32), _expand(e, q.shape, bshape))
    v = jnp.where(_expand(finite, q.shape, bshape), v, jnp.float32(jnp.nan))
    return v.astype(out_dtype)


# ----------------------------------------------------------------------------
# Quantize-dequantize in one step (what the emulated grouped GEMMs use).


def keep_codes(q, scales):
    """``(q, scales)`` behind an optimization barrier, so the FP8 rounding survives ``jit``.

    Without it XLA:GPU's float-conversion simplification (on by default,
    ``xla_allow_excess_precision``) folds the f32 -> f8 -> f32 round trip of a
    quantize-dequantize into the identity: under ``jit`` on an H200 the
    emulated recipes then computed exactly the bf16 products (relative
    difference 0.0 against bf16, where the recipe's is ~4e-2) while the log
    said FP8. The barrier costs the codes' one-byte write and read: the
    quantize fusion ends at the codes and the dequantize fusion starts from
    them.
    """
    return lax.optimization_barrier((q, scales))


def qdq_blocks(x, block, dtype=E4M3, out_dtype=None):
    """``dequantize_blocks(*quantize_blocks(x, block))`` in ``out_dtype`` (default x.dtype).

    The codes really are FP8 under ``jit`` on every platform (``keep_codes``).
    """
    q, s = keep_codes(*quantize_blocks(x, block, dtype))
    return dequantize_blocks(q, s, block, out_dtype or x.dtype)


def qdq_mx(x, axis=-1, out_dtype=None):
    """``dequantize_mx(*quantize_mx(x, axis))`` in ``out_dtype`` (default x.dtype).

    The codes really are FP8 under ``jit`` on every platform (``keep_codes``).
    """
    q, s = keep_codes(*quantize_mx(x, axis))
    return dequantize_mx(q, s, axis, out_dtype=out_dtype or x.dtype)
