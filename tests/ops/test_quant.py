"""ops.quant: FP8 quantizers bit-for-bit against the NumPy model in ``fp8_reference``.

Covers E4M3/E5M2 saturation and rounding on every code and every midpoint,
per-tensor current scaling, blockwise power-of-two scales and MXFP8 E8M0
scales at their boundaries, zero blocks, blocks whose small elements land in
E4M3's subnormal range, float32-subnormal inputs, NaN/Inf blocks, exact
dequantization (and exactness in bfloat16), and the element error bound.
"""

import fp8_reference as ref
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dropless.ops import quant


# Jitted once per static configuration: far fewer compiles than op-by-op dispatch.
quantize_tensor = jax.jit(quant.quantize_tensor, static_argnames="dtype")
dequantize_tensor = jax.jit(quant.dequantize_tensor, static_argnames="out_dtype")
quantize_blocks = jax.jit(quant.quantize_blocks, static_argnames=("block", "dtype"))
dequantize_blocks = jax.jit(quant.dequantize_blocks, static_argnames=("block", "out_dtype"))
quantize_mx = jax.jit(quant.quantize_mx, static_argnames=("axis", "block"))
dequantize_mx = jax.jit(quant.dequantize_mx, static_argnames=("axis", "block", "out_dtype"))
qdq_blocks = jax.jit(quant.qdq_blocks, static_argnames=("block", "dtype", "out_dtype"))


def _wide_random(rng, shape, lo=-30, hi=12):
    """Normal values times random powers of two: many binades, zeros, E4M3-subnormal tails."""
    x = rng.standard_normal(shape) * np.ldexp(1.0, rng.integers(lo, hi, shape))
    x[rng.random(shape) < 0.05] = 0.0
    return x.astype(np.float32)


def _assert_tensor_quant_matches_model(x, q, s, fmt):
    """q, s from ``quantize_tensor(x)`` against the model's, bit for bit on CPU.

    On a GPU the division is not the correctly rounded one: XLA's NVPTX backend divides
    float32 with ``div.full.f32`` (its ``-nvptx-prec-divf32=1``; at most 2 ulp off),
    seen on the H200 as a scale 1 ulp from the model's
    (``benchmarks/results/logs/test-quant-on-gpu-20261202-1624-h200.log``). Bound, with
    u = 2^-23 (float32's relative spacing): inv = fmax / amax is within 2u of the
    model's, and scale = 1 / inv adds 2u of its own and the model's rounding u / 2, so
    |s / s_ref - 1| <= 4.5u. The product x * inv is then within 2u (plus float32
    rounding, u / 2) of the model's, so a code can differ only where the model's product
    lies within 2.5u of the midpoint between the two codes, and then only as its
    neighbour (a code two steps off has no such midpoint).
    """
    q_ref, s_ref = ref.quantize_tensor(x, fmt)
    if jax.default_backend() == "cpu":
        assert np.float32(s) == s_ref
        np.testing.assert_array_equal(ref.codes(q), ref.codes(q_ref))
        return
    u = 2.0**-23
    assert abs(float(s) / float(s_ref) - 1) <= 4.5 * u
    x64 = ref.read(x)
    inv_ref = np.float32(ref.FMAX[fmt]) / np.float32(np.max(np.abs(x64)))
    differ = ref.codes(q) != ref.codes(q_ref)
    got, want = np.asarray(q, np.float64)[differ], np.asarray(q_ref, np.float64)[differ]
    mid = (got + want) / 2
    assert np.all(np.abs(x64[differ] * np.float64(inv_ref) - mid) <= 2.5 * u * np.abs(mid))


# ----------------------------------------------------------------------------
# Element conversion.


@pytest.mark.parametrize("fmt", [ref.E4M3, ref.E5M2])
def test_saturating_conversion_every_code_and_midpoint(fmt):
    finite = np.arange(256, dtype=np.uint8).view(fmt).astype(np.float64)
    finite = np.unique(finite[np.isfinite(finite)])
    mids = (finite[:-1] + finite[1:]) / 2  # ties: round to even
    fmax = ref.FMAX[fmt]
    beyond = np.array([fmax * 1.01, fmax * 1.0625, fmax * 4, 1e30, np.inf])
    v = np.concatenate([finite, mids, beyond, -beyond]).astype(np.float32)
    got = jax.jit(lambda a: quant._saturate(a, jnp.dtype(fmt)))(v)
    want = ref.to_fp8(v.astype(np.float64), fmt)
    np.testing.assert_array_equal(ref.codes(got), ref.codes(want))
    assert np.all(np.abs(np.asarray(got, np.float64)[-10:]) == fmax)  # saturated, not NaN
    assert quant.fp8_max(fmt) == fmax


def test_fp8_max_rejects_other_dtypes():
    with pytest.raises(ValueError, match="fp8 dtype"):
        quant.fp8_max(jnp.bfloat16)


# ----------------------------------------------------------------------------
# Per-tensor current scaling.


@pytest.mark.parametrize("fmt", [ref.E4M3, ref.E5M2])
def test_quantize_tensor_matches_model(rng, fmt):
    x = _wide_random(rng, (64, 48))
    x[0, :4] = [1e-40, -3e-39, 2.0**-127, 0.0]  # float32 subnormals: read as zero
    q, s = quantize_tensor(x, jnp.dtype(fmt))
    _assert_tensor_quant_matches_model(x, q, s, fmt)
    assert np.max(np.abs(np.asarray(q, np.float64))) == ref.FMAX[fmt]  # amax maps to fmax
    assert np.all(np.asarray(q, np.float64)[0, :4] == 0)
    back = np.asarray(dequantize_tensor(q, s), np.float64)
    bound = ref.element_error_bound(x, np.full((1, 1), float(s)), x.shape, fmt)
    assert np.all(np.abs(back - ref.read(x)) <= bound)


@pytest.mark.parametrize("fmt", [ref.E4M3, ref.E5M2])
def test_quantize_tensor_of_bf16_matches_model_on_its_float32_values(rng, fmt):
    """bf16 input (what the dense layers quantize): the amax is taken in bf16, which must
    change nothing, so the result equals the model's on the same values in float32 (bf16
    to float32 is exact). bf16 subnormals (below 2^-126, down to 2^-133) read as zero, and
    a tensor whose largest value is one of them has amax 0."""
    x = _wide_random(rng, (64, 48)).astype(jnp.bfloat16)
    x[0, :4] = np.array([2.0**-130, -2.0**-133, 2.0**-127, 0.0], jnp.bfloat16)
    x32 = x.astype(np.float32)
    q, s = quantize_tensor(x, jnp.dtype(fmt))
    _assert_tensor_quant_matches_model(x32, q, s, fmt)
    assert np.all(np.asarray(q, np.float64)[0, :4] == 0)
    sub = np.array([2.0**-130, -2.0**-127, 0.0], jnp.bfloat16)
    q, s = quantize_tensor(sub, jnp.dtype(fmt))
    assert float(s) == 1.0 and not np.any(np.asarray(q, np.float32))


def test_quantize_tensor_amax_reads_the_input_not_the_flushed_copy():
    """The amax reduces |x| in x's own dtype, not the flushed float32 copy the cast reads:
    when both read one flushed value, XLA computes it once and writes it out between the
    amax and the cast fusions (a full-size mask or float32 copy per tensor on the H200,
    ``benchmarks/notes/fp8_hlo.md``). One reduction (max) carries the NaN check too."""
    jaxpr = jax.make_jaxpr(quant.quantize_tensor)(jnp.zeros((64, 48), jnp.bfloat16)).jaxpr
    reductions = [e for e in jaxpr.eqns if e.primitive.name.startswith("reduce_")]
    assert [e.primitive.name for e in reductions] == ["reduce_max"]
    assert reductions[0].invars[0].aval.dtype == jnp.bfloat16


def test_quantize_tensor_zero_tiny_and_nonfinite():
    q, s = quantize_tensor(jnp.zeros((3, 5)))
    assert float(s) == 1.0 and not np.any(np.asarray(q, np.float32))
    # 448 / amax would overflow float32: inv stops at 2^126, so the scale stays normal.
    tiny = np.array([2.0**-126, -2.0**-125], np.float32)
    q, s = quantize_tensor(tiny)
    assert float(s) == 2.0**-126
    np.testing.assert_array_equal(np.asarray(q, np.float32), [1.0, -2.0])
    for bad in (np.nan, np.inf, -np.inf):
        q, s = quantize_tensor(jnp.array([1.0, bad, 2.0]))
        assert np.isnan(float(s))
        assert np.all(np.isnan(np.asarray(dequantize_tensor(q, s))))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("fmt", [ref.E4M3, ref.E5M2])
def test_quantize_tensor_pow2_is_one_block_over_the_whole_tensor(rng, fmt, dtype):
    """``pow2=True`` (``fp8_dot_bf16_output``'s scaling): the NumPy model's blockwise
    power-of-two scaling with one block of the tensor's shape, bit for bit, codes and
    scale; the zero tensor, float32 subnormals (read as zero), a NaN and an infinity too.
    The scale is a power of two at most twice the exact amax / fmax."""
    x = _wide_random(rng, (64, 48)).astype(dtype)
    x[0, :3] = np.array([1e-40, -3e-39, 0.0], np.float32).astype(dtype)
    for v in (x, np.zeros((3, 5), dtype), np.array([1.0, np.nan, 2.0], dtype),
              np.array([1.0, -np.inf], dtype)):
        q, s = jax.jit(quant.quantize_tensor, static_argnames=("dtype", "pow2"))(
            v, jnp.dtype(fmt), pow2=True)
        want_q, want_s = ref.quantize_blocks(np.asarray(v, np.float32), v.shape, fmt)
        assert s.shape == () and s.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(s), want_s.reshape(()))
        np.testing.assert_array_equal(ref.codes(np.asarray(q)), ref.codes(want_q))
    _, s = quant.quantize_tensor(x, jnp.dtype(fmt), pow2=True)
    amax = np.max(np.abs(np.asarray(x, np.float64)))
    assert float(s) == 2.0 ** np.round(np.log2(float(s)))
    assert amax / ref.FMAX[fmt] <= float(s) < 2 * amax / ref.FMAX[fmt]


# ----------------------------------------------------------------------------
# Blockwise (power-of-two float32 scales).


@pytest.mark.parametrize("shape, block", [
    ((5, 300), (1, 128)),          # activations 1x128, K not a multiple of 128
    ((2, 200, 130), (1, 128, 128)),  # weights 128x128 with partial blocks
    ((300, 7), (128, 1)),          # 128x1 (wgrad operands, blocks along M)
])
def test_quantize_blocks_matches_model(rng, shape, block):
    x = _wide_random(rng, shape)
    x.reshape(-1)[:130] = 0.0  # a whole zero block in every layout
    q, s = quantize_blocks(x, block)
    q_ref, s_ref = ref.quantize_blocks(x, block)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(ref.codes(q), ref.codes(q_ref))
    back = np.asarray(dequantize_blocks(q, s, block), np.float64)
    np.testing.assert_array_equal(back, ref.dequantize(q_ref, s_ref, shape, block))
    assert np.all(np.abs(back - ref.read(x)) <= ref.element_error_bound(x, s_ref, block))
    assert np.all(np.abs(np.asarray(q, np.float64)) <= 448)


def test_blockwise_scale_boundaries():
    """amax exactly fmax * 2^k keeps k; one float32 ulp more takes k + 1; nothing saturates."""
    ks = np.array([-20, -3, 0, 5, 40])
    amax = (448.0 * np.ldexp(1.0, ks)).astype(np.float32)
    above = np.nextafter(amax, np.float32(np.inf))
    rows = np.zeros((2 * len(ks), 128), np.float32)
    rows[: len(ks), 0], rows[len(ks):, 0] = amax, above
    rows[:, 1] = rows[:, 0] / 3  # a second element that is not the amax
    _, s = quantize_blocks(rows, (1, 128))
    np.testing.assert_array_equal(np.log2(np.asarray(s)[:, 0]), np.concatenate([ks, ks + 1]))
    q, _ = quantize_blocks(rows, (1, 128))
    assert np.all(np.asarray(q, np.float32)[: len(ks), 0] == 448)


def test_blockwise_bf16_dequant_is_exact(rng):
    x = _wide_random(rng, (4, 256), lo=-20)
    q, s = quantize_blocks(x, (1, 128))
    f32 = dequantize_blocks(q, s, (1, 128), jnp.float32)
    bf16 = dequantize_blocks(q, s, (1, 128), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(bf16, np.float32), np.asarray(f32))
    qdq = qdq_blocks(jnp.asarray(x, jnp.bfloat16), (1, 128))
    assert qdq.dtype == jnp.bfloat16


def test_tensor_nan_gives_a_nan_scale_in_a_large_tensor():
    """One NaN in 4096 x 4096: the per-tensor scale is NaN, as documented (XLA:CPU's max
    reduction alone returned a finite one at this size)."""
    x = np.ones((4096, 4096), np.float32)
    x[200, 130] = np.nan
    _, s = quantize_tensor(jnp.asarray(x))
    assert np.isnan(float(s))


@pytest.mark.parametrize("block", [(128, 1), (128, 128), (1, 128)])
def test_block_nan_poisons_its_scale_at_any_block_height(block):
    """A NaN anywhere in a block gives that block a NaN scale, also in blocks of 128 rows
    (XLA:CPU's max reduction drops NaN once it spans 16 or more rows)."""
    x = np.ones((256, 256), np.float32)
    x[200, 130] = np.nan
    _, s = quantize_blocks(x, block)
    s = np.asarray(s)
    nan_at = (200 // block[0], 130 // block[1])
    assert np.isnan(s[nan_at]) and np.isnan(s).sum() == 1


def test_blockwise_nonfinite_poisons_only_its_block():
    x = np.ones((3, 256), np.float32)
    x[1, 5] = np.nan
    x[2, 200] = -np.inf
    q, s = quantize_blocks(x, (1, 128))
    s = np.asarray(s)
    assert np.isnan(s[1, 0]) and np.isnan(s[2, 1])
    assert np.isfinite(s[[0, 0, 1, 2], [0, 1, 1, 0]]).all()
    back = np.asarray(dequantize_blocks(q, s, (1, 128)))
    assert np.isnan(back[1, :128]).all() and np.isnan(back[2, 128:]).all()
    assert (back[0] == 1).all() and (back[1, 128:] == 1).all() and (back[2, :128] == 1).all()


def test_block_validation():
    with pytest.raises(ValueError, match="block"):
        quantize_blocks(jnp.ones((4, 4)), (1,))
    with pytest.raises(ValueError, match="block"):
        quantize_blocks(jnp.ones((4, 4)), (0, 4))
    q, s = quantize_blocks(jnp.ones((4, 256)), (1, 128))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_blocks(q, s[:, :1], (1, 128))


# ----------------------------------------------------------------------------
# MXFP8.


@pytest.mark.parametrize("shape, axis", [((6, 100), -1), ((70, 9), 0), ((2, 64, 40), 1)])
def test_quantize_mx_matches_model(rng, shape, axis):
    x = _wide_random(rng, shape, lo=-40)
    q, s = quantize_mx(x, axis)
    q_ref, s_ref = ref.quantize_mx(x, axis)
    np.testing.assert_array_equal(ref.codes(s), ref.codes(s_ref))
    np.testing.assert_array_equal(ref.codes(q), ref.codes(q_ref))
    bshape = tuple(32 if i == axis % len(shape) else 1 for i in range(len(shape)))
    scales = ref.mx_scales_f64(s_ref)
    back = np.asarray(dequantize_mx(q, s, axis), np.float64)
    np.testing.assert_array_equal(back, ref.dequantize(q_ref, scales, shape, bshape))
    assert np.all(np.abs(back - ref.read(x)) <= ref.element_error_bound(x, scales, bshape))


def test_mx_e8m0_exponent_rule_and_saturation():
    """X = floor(log2 amax) - 8 at and around powers of two; elements past 448 * 2^X saturate."""
    js = np.array([-100, -7, 0, 1, 8, 100])
    p = np.ldexp(1.0, js).astype(np.float32)
    amaxes = np.concatenate([p, np.nextafter(p, np.float32(0)), (p * 1.75), (p * 1.99)])
    x = np.zeros((len(amaxes), 32), np.float32)
    x[:, 3] = amaxes
    x[:, 4] = amaxes / 3  # a non-amax element
    q, s = quantize_mx(x)
    e, finite = quant.mx_scale_exponents(s)
    n = len(js)
    want = np.concatenate([js - 8, js - 9, js - 8, js - 8])
    np.testing.assert_array_equal(np.asarray(e)[:, 0], want)
    assert np.asarray(finite).all()
    top = np.asarray(q, np.float64)[:, 3]
    np.testing.assert_array_equal(top[:n], 256.0)     # 2^j / 2^(j-8)
    np.testing.assert_array_equal(top[2 * n: 3 * n], 448.0)  # 1.75 * 256 exactly
    np.testing.assert_array_equal(top[3 * n:], 448.0)  # 1.99 * 256 = 509.4 saturates


def test_mx_zero_tiny_subnormal_and_nonfinite_blocks():
    x = np.zeros((6, 32), np.float32)
    x[1, :] = 1e-40                     # float32 subnormals: a zero block
    x[2, 0], x[2, 1] = 2.0**-120, 2.0**-125  # X clamps at -127
    x[3, 0], x[3, 1:] = 1.0, 2.0**-16   # X = -8: 2^-16 / 2^X = 2^-8, an E4M3 subnormal
    x[3, 2] = 2.0**-18                  # 2^-10: half the smallest subnormal, ties to zero
    x[4, 7] = np.nan
    x[5, 9] = np.inf
    q, s = quantize_mx(x)
    q_ref, s_ref = ref.quantize_mx(x)
    np.testing.assert_array_equal(ref.codes(s), ref.codes(s_ref))
    np.testing.assert_array_equal(ref.codes(q), ref.codes(q_ref))
    codes = ref.codes(s)[:, 0]
    assert codes[0] == 0 and codes[1] == 0   # zero blocks: 2^-127
    assert codes[2] == 0                     # floor(log2 2^-120) - 8 = -128 -> clamped
    assert codes[4] == 255 and codes[5] == 255
    qf = np.asarray(q, np.float64)
    assert not qf[:2].any()
    assert qf[3, 1] == 2.0**-8 and qf[3, 2] == 0.0
    back = np.asarray(dequantize_mx(q, s))
    assert np.isnan(back[4]).all() and np.isnan(back[5]).all()
    assert back[3, 0] == 1.0 and back[3, 1] == 2.0**-16


def test_mx_validation():
    with pytest.raises(ValueError, match="axis"):
        quantize_mx(jnp.ones((4, 32)), axis=2)
    q, s = quantize_mx(jnp.ones((4, 64)))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mx(q, s, axis=0)


# ----------------------------------------------------------------------------
# The emulation claim: E4M3 x 2^X is exact in bfloat16 (while the result is normal).


def test_every_e4m3_code_times_every_normal_scale_is_exact_in_bf16():
    vals = np.arange(256, dtype=np.uint8).view(ref.E4M3).astype(np.float64)
    vals = vals[np.isfinite(vals)]
    xs = np.arange(-117, 120)  # 2^-9 * 2^-117 = 2^-126: the smallest normal
    prod = vals[:, None] * np.ldexp(1.0, xs)[None, :]
    as_bf16 = prod.astype(ml_dtypes.bfloat16).astype(np.float64)
    np.testing.assert_array_equal(as_bf16, prod)
    # Through the library's own dequantizer, for every code and the extreme exponents.
    q = jnp.asarray(np.tile(vals.astype(np.float32), (2, 1)).astype(ref.E4M3))
    for x_exp in (-117, 0, 119):
        codes = np.full((2, q.shape[1] // 32 + (q.shape[1] % 32 > 0)), x_exp + 127, np.uint8)
        s = jnp.asarray(codes.view(ml_dtypes.float8_e8m0fnu))
        got = np.asarray(dequantize_mx(q, s, out_dtype=jnp.bfloat16), np.float64)
        np.testing.assert_array_equal(got[0], vals * 2.0**x_exp)
