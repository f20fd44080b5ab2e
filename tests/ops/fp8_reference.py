"""An independent NumPy model of the FP8 formats and scaling rules of ``dropless.ops.quant``.

Written from the format definitions, not from the implementation: exponents
come from searching a table of powers of two in float64 (not from bit
fields), conversions from ``ml_dtypes`` (round to nearest even) after an
explicit clamp, products in float64. Used by the quantizer and the quantized
GEMM tests.

Error model (the bounds the GEMM tests use). An element x quantized with
scale s to a format with m mantissa bits and smallest subnormal 2^-p (E4M3:
m=3, p=9; E5M2: m=2, p=16) is off by at most

    |x^ - x| <= 2^-(m+1) |x| + 2^-(p+1) s + max(0, |x| - fmax s)

(rounding in the normal range, rounding in the subnormal range, saturation).
Only the MX rule can saturate; the others pick s so that |x| <= fmax s.
"""

import ml_dtypes
import numpy as np

E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
FMAX = {E4M3: 448.0, E5M2: 57344.0}
MANT_BITS = {E4M3: 3, E5M2: 2}
MIN_SUB_EXP = {E4M3: 9, E5M2: 16}  # smallest subnormal 2^-p
TINY = 2.0**-126
_EXPS = np.arange(-200, 201)
_POW2 = np.ldexp(1.0, _EXPS)


def read(x):
    """float64 of the float32 value, magnitudes below 2^-126 set to zero."""
    x = np.asarray(x, np.float32).astype(np.float64)
    return np.where(np.abs(x) < TINY, 0.0, x)


def floor_log2(a):
    """floor(log2(a)) for a > 0 by table search (exact in float64)."""
    return _EXPS[np.searchsorted(_POW2, a, side="right") - 1]


def to_fp8(v, fmt):
    """Clamp to +-fmax then round to nearest even (from float64, one rounding)."""
    m = FMAX[fmt]
    return np.clip(v, -m, m).astype(fmt)


def codes(a):
    """The raw bytes of an FP8 array (comparison that treats NaN codes exactly)."""
    return np.asarray(a).view(np.uint8)


def blocked_amax(x64, block):
    """Largest |x| of each block (partial last blocks allowed), by explicit loops over slices."""
    nblocks = [-(-s // b) for s, b in zip(x64.shape, block)]
    out = np.zeros(nblocks)
    for idx in np.ndindex(*nblocks):
        sl = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block))
        out[idx] = np.max(np.abs(x64[sl]))  # NaN propagates
    return out


def expand(s, shape, block):
    for axis, b in enumerate(block):
        s = np.repeat(s, b, axis=axis)
    return s[tuple(slice(0, n) for n in shape)]


def quantize_tensor(x, fmt=E4M3):
    """Per-tensor current scaling in float32: inv = min(fmax / amax, 2^126), q = sat(x * inv), scale = 1 / inv."""
    x64 = read(x)
    amax = np.max(np.abs(x64)) if x64.size else 0.0
    if not np.isfinite(amax):
        inv = np.float32(np.nan)
    elif amax == 0:
        inv = np.float32(1.0)
    else:
        inv = min(np.float32(FMAX[fmt]) / np.float32(amax), np.float32(2.0**126))
    v = (x64.astype(np.float32) * inv).astype(np.float64)  # the product is rounded to float32
    return to_fp8(v, fmt), np.float32(1) / inv


def pow2_block_exponent(amax, fmt=E4M3):
    """Smallest k in [-126, 127] with amax <= fmax * 2^k (0 for amax = 0), by search."""
    fmax = FMAX[fmt]
    k = np.zeros(amax.shape, np.int64)
    for idx in np.ndindex(*amax.shape):
        a = amax[idx]
        if a == 0 or not np.isfinite(a):
            continue
        k[idx] = next(j for j in range(-126, 128) if a <= fmax * 2.0**j)
    return k


def quantize_blocks(x, block, fmt=E4M3):
    """Blockwise, power-of-two float32 scales; NaN scale (and codes) for non-finite blocks."""
    x64 = read(x)
    amax = blocked_amax(x64, block)
    k = pow2_block_exponent(amax, fmt)
    scales = np.where(np.isfinite(amax), np.ldexp(1.0, k), np.nan)
    v = x64 / expand(scales, x64.shape, block)
    return to_fp8(v, fmt), scales.astype(np.float32)


def mx_exponent(amax):
    """OCP MX rule for E4M3: clamp(floor(log2(amax)) - 8, -127, 127); -127 for amax = 0."""
    out = np.full(amax.shape, -127, np.int64)
    pos = np.isfinite(amax) & (amax > 0)
    out[pos] = np.clip(floor_log2(amax[pos]) - 8, -127, 127)
    return out


def quantize_mx(x, axis=-1, block=32):
    """MXFP8: (E4M3 codes, E8M0 scales as ml_dtypes float8_e8m0fnu)."""
    x64 = read(x)
    axis %= x64.ndim
    bshape = tuple(block if i == axis else 1 for i in range(x64.ndim))
    amax = blocked_amax(x64, bshape)
    e = mx_exponent(amax)
    finite = np.isfinite(amax)
    v = x64 / np.ldexp(1.0, expand(e, x64.shape, bshape))
    v = np.where(expand(finite, x64.shape, bshape), v, np.nan)
    scale_codes = np.where(finite, e + 127, 255).astype(np.uint8)
    return to_fp8(v, E4M3), scale_codes.view(ml_dtypes.float8_e8m0fnu)


def mx_scales_f64(scales):
    """E8M0 scales as float64 powers of two (NaN for code 255)."""
    c = codes(scales).astype(np.int64)
    return np.where(c == 255, np.nan, np.ldexp(1.0, c - 127))


def dequantize(q, scales_f64, shape, block):
    """q * scale in float64, exact (scales are powers of two or float32 values)."""
    return np.asarray(q).astype(np.float64) * expand(np.asarray(scales_f64, np.float64), shape, block)


def element_error_bound(x, scales_f64, block, fmt=E4M3):
    """Per-element bound on |x^ - x| (see the module docstring)."""
    x64 = np.abs(read(x))
    s = expand(np.asarray(scales_f64, np.float64), x64.shape, block)
    m, p = MANT_BITS[fmt], MIN_SUB_EXP[fmt]
    return 2.0 ** -(m + 1) * x64 + 2.0 ** -(p + 1) * s + np.maximum(0.0, x64 - FMAX[fmt] * s)
