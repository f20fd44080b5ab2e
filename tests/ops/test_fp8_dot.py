"""ops.fp8_dot: the per-tensor current-scaling FP8 dot_general, forward and both gradients.

CPU: the transposes of the backward pass against ``jax.vjp`` of
``lax.dot_general`` (batch dims, permuted contractions); each product equals
the float64 product of the NumPy-model-quantized operands up to float32
accumulation; and against the unquantized float64 product it stays within
the derived bound (E4M3 forward operands, E5M2 output gradient)::

    |y^ - y| <= |ex|.|w| + |x|.|ew| + |ex|.|ew| + accumulation,
    e = 2^-(m+1) |v| + 2^-(p+1) s   per element (fp8_reference.element_error_bound)

With ``bf16_output`` (power-of-two scales, bfloat16 GEMM outputs): the same bound
with the model's power-of-two quantization; bfloat16 results equal the float32
form with those scales bit for bit (round(round(acc) s) == round(acc s) for a
power-of-two s and normal results), integer-exact data gives the exact product,
and the program lowered for CUDA asks each FP8 dot for bfloat16.

GPU (marker ``gpu``): the compiled forward and gradient contain cuBLASLt's
FP8 GEMM custom call, writing bfloat16 with ``bf16_output``.
"""

import collections
import re

import fp8_accumulation as fp8_acc
import fp8_reference as ref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

from dropless.ops import fp8_dot, quant
from dropless.perf import hlo

DIMS = {
    "linear": ((4, 6, 16), (16, 8), (((2,), (0,)), ((), ()))),
    "kernel_transposed": ((12, 16), (8, 16), (((1,), (1,)), ((), ()))),
    "batched_two_contractions": ((3, 5, 4, 6), (6, 3, 4, 5), (((1, 2), (3, 2)), ((0,), (1,)))),
}


def _operands(rng, lhs_shape, rhs_shape):
    x = (rng.standard_normal(lhs_shape) * np.exp(rng.uniform(-3, 3, lhs_shape))).astype(np.float32)
    w = (rng.standard_normal(rhs_shape) * 0.3).astype(np.float32)
    return x, w


def _letters(n):
    return list("abcdefghijklmnopqrstuvwxyz"[:n])


def _dot_np(a, b, dims):
    """float64 ``dot_general(a, b, dims)``: one einsum with explicit letters."""
    (lc, rc), (lb, rb) = dims
    pool = iter(_letters(a.ndim + b.ndim))
    la, lb_ = [None] * a.ndim, [None] * b.ndim
    for i, j in [*zip(lb, rb), *zip(lc, rc)]:
        la[i] = lb_[j] = next(pool)
    la = [c or next(pool) for c in la]
    lb_ = [c or next(pool) for c in lb_]
    out = [la[i] for i in lb] + [la[i] for i in range(a.ndim) if i not in (*lb, *lc)]
    out += [lb_[j] for j in range(b.ndim) if j not in (*rb, *rc)]
    return np.einsum(f"{''.join(la)},{''.join(lb_)}->{''.join(out)}",
                     np.asarray(a, np.float64), np.asarray(b, np.float64))


def _cot_np(g, other, dims, ndim, lhs):
    """float64 cotangent of the lhs (``lhs=True``, other = rhs) or of the rhs (other = lhs)
    of ``dot_general`` given the output cotangent g: one einsum."""
    (lc, rc), (lb, rb) = dims
    self_c, other_c, self_b, other_b = (lc, rc, lb, rb) if lhs else (rc, lc, rb, lb)
    kept_self = [i for i in range(ndim) if i not in (*self_c, *self_b)]
    kept_other = [j for j in range(other.ndim) if j not in (*other_c, *other_b)]
    nb = len(lb)
    # g is [batch, lhs kept, rhs kept].
    first, second = (kept_self, kept_other) if lhs else (kept_other, kept_self)
    g_first = list(range(nb, nb + len(first)))
    g_second = list(range(nb + len(first), g.ndim))
    g_self, g_other = (g_first, g_second) if lhs else (g_second, g_first)
    pool = iter(_letters(g.ndim + ndim + other.ndim))
    out_l, g_l, o_l = [None] * ndim, [None] * g.ndim, [None] * other.ndim
    for p, (i, j) in enumerate(zip(self_b, other_b)):
        out_l[i] = o_l[j] = g_l[p] = next(pool)
    for p, i in zip(g_self, kept_self):
        out_l[i] = g_l[p] = next(pool)
    for p, j in zip(g_other, kept_other):
        o_l[j] = g_l[p] = next(pool)
    for i, j in zip(self_c, other_c):
        out_l[i] = o_l[j] = next(pool)
    return np.einsum(f"{''.join(g_l)},{''.join(o_l)}->{''.join(out_l)}",
                     np.asarray(g, np.float64), np.asarray(other, np.float64))


def _jax_vjp(x, w, g, dims):
    _, vjp = jax.vjp(lambda a, b: lax.dot_general(a, b, dims, precision=lax.Precision.HIGHEST),
                     jnp.asarray(x), jnp.asarray(w))
    return vjp(jnp.asarray(g, jnp.float32))


@pytest.mark.parametrize("case", sorted(DIMS))
def test_backward_transposes_match_jax_vjp(rng, case):
    lshape, rshape, dims = DIMS[case]
    x, w = _operands(rng, lshape, rshape)
    g = rng.standard_normal(jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), x, w).shape)
    dx, dw = _jax_vjp(x, w, g, dims)
    g32 = jnp.asarray(g, jnp.float32)
    np.testing.assert_allclose(fp8_dot.transpose_lhs(g32, jnp.asarray(w), dims, x.ndim), dx,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(fp8_dot.transpose_rhs(g32, jnp.asarray(x), dims, w.ndim), dw,
                               rtol=1e-5, atol=1e-5)
    # The float64 NumPy cotangents used below agree with jax's too.
    np.testing.assert_allclose(_cot_np(g, w, dims, x.ndim, True), dx, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(_cot_np(g, x, dims, w.ndim, False), dw, rtol=1e-4, atol=1e-4)


def _acc(product, a, b, n):
    """float32 accumulation of n terms plus the float32 output rounding: n 2^-23 B(|a|, |b|)."""
    return (n + 1) * 2.0**-23 * product(np.abs(a), np.abs(b))


def _bound(product, a, ea, b, eb, n):
    """B(ea, |b|) + B(|a|, eb) + B(ea, eb) + accumulation, for a bilinear product B."""
    abs_a, abs_b = np.abs(a), np.abs(b)
    return (product(ea, abs_b) + product(abs_a, eb) + product(ea, eb)
            + _acc(product, abs_a + ea, abs_b + eb, n))


def _quantize_pow2(v, fmt):
    """The NumPy model's power-of-two per-tensor scaling: one block over the whole tensor."""
    q, s = ref.quantize_blocks(v, v.shape, fmt)
    return q, np.float32(s.reshape(()))


@pytest.mark.parametrize("bf16_output", [False, True])
@pytest.mark.parametrize("case", sorted(DIMS))
def test_forward_and_gradients_within_fp8_bound(rng, case, bf16_output):
    """With float32 operands ``bf16_output`` changes only the scales (powers of two); the
    GEMMs still write float32."""
    lshape, rshape, dims = DIMS[case]
    x, w = _operands(rng, lshape, rshape)
    y_shape = jax.eval_shape(lambda a, b: lax.dot_general(a, b, dims), x, w).shape
    g = (rng.standard_normal(y_shape) * np.exp(rng.uniform(-4, 4, y_shape))).astype(np.float32)

    f = jax.jit(lambda a, b: fp8_dot.fp8_dot_general(a, b, dims, bf16_output=bf16_output))
    y, vjp = jax.vjp(f, x, w)
    dx, dw = vjp(jnp.asarray(g))
    assert y.dtype == dx.dtype == dw.dtype == jnp.float32

    quantize = _quantize_pow2 if bf16_output else ref.quantize_tensor
    qx, sx = quantize(x, ref.E4M3)
    qw, sw = quantize(w, ref.E4M3)
    qg, sg = quantize(g, ref.E5M2)
    fx, fw, fg = (np.asarray(q, np.float64) * float(s) for q, s in ((qx, sx), (qw, sw), (qg, sg)))
    ex, ew, eg = (ref.element_error_bound(v, np.full((1,) * v.ndim, float(s)), v.shape, fmt)
                  for v, s, fmt in ((x, sx, ref.E4M3), (w, sw, ref.E4M3), (g, sg, ref.E5M2)))
    products = {  # name: (bilinear product, first operand, its error, second, its error, got)
        "y": (lambda a, b: _dot_np(a, b, dims), x, ex, w, ew, y),
        "dx": (lambda a, b: _cot_np(a, b, dims, x.ndim, True), g, eg, w, ew, dx),
        "dw": (lambda a, b: _cot_np(a, b, dims, w.ndim, False), g, eg, x, ex, dw),
    }
    quantized = {"y": (fx, fw), "dx": (fg, fw), "dw": (fg, fx)}
    n = max(x.size, w.size, g.size)
    for name, (prod, a, ea, b, eb, got) in products.items():
        got = np.asarray(got, np.float64)
        # 1) the float64 product of the model's quantized operands, up to accumulation;
        qa, qb = quantized[name]
        assert np.all(np.abs(got - prod(qa, qb)) <= _acc(prod, qa, qb, n)), name
        # 2) the unquantized float64 product, within the derived bound (not vacuous).
        err, bound = np.abs(got - prod(a, b)), _bound(prod, a, ea, b, eb, n)
        assert np.all(err <= bound), name
        assert np.max(err / bound) > 0.02, name


def _vjp_outputs(f, x, w, g):
    y, vjp = jax.vjp(jax.jit(f), x, w)
    return (y, *vjp(g))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_direct_form_is_the_plain_formula_bit_for_bit(rng, dtype):
    """The FP8 product is the direct formula, written out here with ``lax.dot_general``
    alone: FP8 codes into a float32 dot at HIGHEST (the CPU's choice), times the product
    of the two scales, cast; the gradients
    the same with the E5M2 codes of dy and the transposes spelled out for a [B, S, K] x
    [K, N] linear. Same operations in the same order, so equal bits."""
    x, w = (jnp.asarray(v, dtype) for v in _operands(rng, (4, 6, 16), (16, 8)))
    g = jnp.asarray(rng.standard_normal((4, 6, 8)) * np.exp(rng.uniform(-4, 4, (4, 6, 8))), dtype)
    dims = (((2,), (0,)), ((), ()))

    def dot(a, b, d):
        return lax.dot_general(a, b, d, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    @jax.jit
    def plain(x, w, g):
        (qx, sx), (qw, sw) = (quant.quantize_tensor(v, quant.E4M3) for v in (x, w))
        qg, sg = quant.quantize_tensor(g, quant.E5M2)
        y = (dot(qx, qw, dims) * (sx * sw)).astype(dtype)
        dx = (dot(qg, qw, (((2,), (1,)), ((), ()))) * (sg * sw)).astype(dtype)
        dw = (dot(qg, qx, (((0, 1), (0, 1)), ((), ()))).T * (sg * sx)).astype(dtype)
        return y, dx, dw

    got = _vjp_outputs(lambda a, b: fp8_dot.fp8_dot_general(a, b, dims), x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), got, plain(x, w, g)):
        assert a.dtype == b.dtype == dtype, name
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)


def test_as_nnx_linear_bf16_gradients_flow(rng):
    x = jnp.asarray(rng.standard_normal((2, 7, 32)), jnp.bfloat16)
    lin = nnx.Linear(32, 16, use_bias=False, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                     dot_general=fp8_dot.fp8_dot_general, rngs=nnx.Rngs(0))
    y = lin(x)
    assert y.shape == (2, 7, 16) and y.dtype == jnp.bfloat16
    ref_y = np.asarray(x, np.float32) @ np.asarray(lin.kernel[...], np.float32)
    rel = np.linalg.norm(np.asarray(y, np.float32) - ref_y) / np.linalg.norm(ref_y)
    assert rel < 0.1

    def loss(m, x):
        return jnp.sum(m(x).astype(jnp.float32) ** 2)

    grads = nnx.grad(loss, argnums=(0, 1))(lin, x)
    gk, gx = grads[0]["kernel"][...], grads[1]
    assert gk.dtype == jnp.float32 and gx.dtype == jnp.bfloat16
    assert np.isfinite(np.asarray(gk)).all() and np.abs(np.asarray(gk)).max() > 0
    assert np.abs(np.asarray(gx, np.float32)).max() > 0


def test_min_dim_keeps_narrow_products_plain_and_quantizes_the_rest(rng):
    """``min_dim``: a product with K or N below it is ``lax.dot_general`` itself (the same
    bits, forward and gradients); one at or above it is the FP8 product (not the plain
    one: random data never survives E4M3 rounding unchanged)."""
    x = jnp.asarray(rng.standard_normal((64, 256)), jnp.bfloat16)
    w_narrow = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)   # N = 128
    w_wide = jnp.asarray(rng.standard_normal((256, 256)), jnp.bfloat16)     # K = N = 256
    dims = (((1,), (0,)), ((), ()))

    def run(f, w):
        return jax.value_and_grad(lambda x, w: jnp.sum(f(x, w, dims).astype(jnp.float32) ** 2),
                                  argnums=(0, 1))(x, w)

    gated = lambda x, w, d: fp8_dot.fp8_dot_general(x, w, d, min_dim=256)  # noqa: E731
    plain = lambda x, w, d: lax.dot_general(x, w, d)  # noqa: E731
    for got, want in zip(jax.tree.leaves(run(gated, w_narrow)), jax.tree.leaves(run(plain, w_narrow)),
                         strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.array_equal(np.asarray(gated(x, w_wide, dims), np.float32),
                              np.asarray(plain(x, w_wide, dims), np.float32))
    np.testing.assert_array_equal(np.asarray(gated(x, w_wide, dims), np.float32),
                                  np.asarray(fp8_dot.fp8_dot_general(x, w_wide, dims), np.float32))


def test_shape_errors_come_from_lax():
    with pytest.raises(TypeError):
        fp8_dot.fp8_dot_general(jnp.ones((3, 4)), jnp.ones((5, 6)), (((1,), (0,)), ((), ())))


def test_nonfinite_input_gives_nan_output():
    x = jnp.ones((4, 16)).at[1, 2].set(jnp.inf)
    y = fp8_dot.fp8_dot_general(x, jnp.ones((16, 8)), (((1,), (0,)), ((), ())))
    assert np.isnan(np.asarray(y)).all()


LINEAR = (((2,), (0,)), ((), ()))


def _bf16_linear_operands(rng, b=4, s=6, k=16, n=8):
    x, w = (jnp.asarray(v, jnp.bfloat16) for v in _operands(rng, (b, s, k), (k, n)))
    g = jnp.asarray(rng.standard_normal((b, s, n)) * np.exp(rng.uniform(-4, 4, (b, s, n))),
                    jnp.bfloat16)
    return x, w, g


def _pow2_float32_form(x, w, g):
    """The float32-output form written out with power-of-two per-tensor scales (one block
    over each whole tensor, ``quant.quantize_blocks``): float32 products at HIGHEST, times
    the scales, cast to bfloat16; the gradients of a [B, S, K] x [K, N] linear."""
    def dot(a, b, d):
        return lax.dot_general(a, b, d, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)

    def q(v, fmt):
        codes, scales = quant.quantize_blocks(v, v.shape, fmt)
        return codes, scales.reshape(())

    (qx, sx), (qw, sw), (qg, sg) = q(x, quant.E4M3), q(w, quant.E4M3), q(g, quant.E5M2)
    y = (dot(qx, qw, LINEAR) * (sx * sw)).astype(jnp.bfloat16)
    dx = (dot(qg, qw, (((2,), (1,)), ((), ()))) * (sg * sw)).astype(jnp.bfloat16)
    dw = (dot(qg, qx, (((0, 1), (0, 1)), ((), ()))).T * (sg * sx)).astype(jnp.bfloat16)
    return y, dx, dw


def test_bf16_output_is_the_float32_form_with_pow2_scales_bit_for_bit(rng):
    """bfloat16 operands and results: ``bf16_output``'s products (a bfloat16 product scaled
    in bfloat16) equal the float32 form with the same power-of-two scales, forward and both
    gradients. That holds only if every operand's scale is a power of two (the float32
    form rounds once after an exact scaling; the bfloat16 one scales an already rounded
    value) and the codes are those of ``quantize_blocks`` over the whole tensor."""
    x, w, g = _bf16_linear_operands(rng, k=64, n=32)
    got = _vjp_outputs(lambda a, b: fp8_dot.fp8_dot_general(a, b, LINEAR, bf16_output=True),
                       x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), got, jax.jit(_pow2_float32_form)(x, w, g)):
        assert a.dtype == b.dtype == jnp.bfloat16, name
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), name)
    # Not the default form: its scales are amax / fmax, not powers of two.
    default = _vjp_outputs(lambda a, b: fp8_dot.fp8_dot_general(a, b, LINEAR), x, w, g)
    assert not np.array_equal(np.asarray(got[0], np.float32), np.asarray(default[0], np.float32))


def test_bf16_output_leaves_float16_results_to_float32_gemm_outputs(rng):
    """float16 results keep the float32 GEMM output (only the scales become powers of two):
    float16 cannot hold every power-of-two scale (its smallest value is 2^-24), so scaling
    in it would flush. Here the operands (magnitudes about 2^-9 and 2^-7) get scales of
    about 2^-16 and 2^-13, whose product is 0 in float16 (scaled there, the result came
    out NaN); the float32 form gives the product within E4M3's error."""
    x = jnp.asarray(rng.standard_normal((8, 64)) * 2.0**-9, jnp.float16)
    w = jnp.asarray(rng.standard_normal((64, 16)) * 2.0**-7, jnp.float16)
    dims = (((1,), (0,)), ((), ()))
    y = fp8_dot.fp8_dot_general(x, w, dims, bf16_output=True)
    ref_y = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert y.dtype == jnp.float16 and np.all(np.isfinite(np.asarray(y, np.float64)))
    rel = np.linalg.norm(np.asarray(y, np.float64) - ref_y) / np.linalg.norm(ref_y)
    assert rel < 0.1, rel


def _ints(rng, shape):
    """Integers in [-8, 8] (at most 3 significant bits), the first 8 (so amax is 8)."""
    v = rng.integers(-8, 9, shape).astype(np.float32)
    v.flat[0] = 8.0
    return v


def _rounded_bf16(v):
    return np.asarray(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16), np.float64)


def _integer_case(rng, b, s, k, n):
    """bfloat16 operands x [b, s, k], w [k, n], dy [b, s, n] of ``_ints`` and the exact
    products (float64) rounded once to bfloat16: y, dx, dw."""
    x, w, g = _ints(rng, (b, s, k)), _ints(rng, (k, n)), _ints(rng, (b, s, n))
    want = (np.einsum("bsk,kn->bsn", x.astype(np.float64), w),
            np.einsum("bsn,kn->bsk", g.astype(np.float64), w),
            np.einsum("bsk,bsn->kn", x.astype(np.float64), g))
    return [jnp.asarray(v, jnp.bfloat16) for v in (x, w, g)], [_rounded_bf16(v) for v in want]


def test_bf16_output_exact_on_integer_data(rng):
    """Integer data in [-8, 8] with amax 8: the power-of-two scales are 2^-5 (E4M3:
    8 <= 448 / 32, 8 > 448 / 64) and 2^-12 (E5M2: 8 <= 57344 / 4096), so every code is the
    integer times 32 or 4096, exact (3 significant bits fit either format); every sum is an
    integer below 2^24, exact in float32. So each product is the exact one rounded once to
    bfloat16 (sums above 256 need not be bfloat16 values)."""
    operands, want = _integer_case(rng, 4, 2, 4, 6)
    f = lambda a, b: fp8_dot.fp8_dot_general(a, b, LINEAR, bf16_output=True)  # noqa: E731
    for name, got, exact in zip(("y", "dx", "dw"), _vjp_outputs(f, *operands), want):
        np.testing.assert_array_equal(np.asarray(got, np.float64), exact, name)


_DOT = re.compile(r"stablehlo\.dot_general .*?: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)")


def _cuda_dots(monkeypatch, bf16_output):
    """(lhs, rhs, result) tensor types of every dot_general in the value and gradient of a
    bfloat16 linear's sum, traced as on a GPU and lowered for CUDA (no GPU needed)."""
    monkeypatch.setattr(fp8_dot, "_on_gpu", lambda: True)
    x, w = jnp.ones((4, 256, 512), jnp.bfloat16), jnp.ones((512, 384), jnp.bfloat16)

    def loss(x, w):
        y = fp8_dot.fp8_dot_general(x, w, LINEAR, bf16_output=bf16_output)
        return jnp.sum(y.astype(jnp.float32))

    f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    text = jax.export.export(f, platforms=["cuda"])(x, w).mlir_module()
    return _DOT.findall(text)


@pytest.mark.parametrize("bf16_output", [False, True])
def test_cuda_program_asks_the_fp8_dots_for_bf16_with_bf16_output(monkeypatch, bf16_output):
    """What the GPU compiles: three FP8 x FP8 dots (forward, dgrad, wgrad) and no other
    dot; with ``bf16_output`` each writes bfloat16 (cuBLASLt's D), without it float32."""
    dots = _cuda_dots(monkeypatch, bf16_output)
    assert len(dots) == 3, dots
    want = "bf16" if bf16_output else "f32"
    for lhs, rhs, out in dots:
        assert "f8E" in lhs and "f8E" in rhs, (lhs, rhs)
        assert out.endswith(f"x{want}>"), out


def _fp8_gemm_results(text):
    """Each cuBLASLt FP8 GEMM call of an optimized HLO ``text`` as ``(name, form)``: ``form``
    is ``"bf16"`` where the call writes bfloat16 itself; ``"split"`` where it writes float32
    partials ``[s, *dims]`` (XLA's split of the contraction into ``s`` batched GEMMs) that a
    fusion or reduce sums into one ``bf16[*dims]`` (followed through get-tuple-element and
    bitcast); otherwise the type it writes."""
    insts = {(i.computation, i.name): i for i in hlo.instructions(text)}
    users = collections.defaultdict(list)
    for (comp, name), inst in insts.items():
        for _, operand in inst.operands:
            users[(comp, operand)].append((comp, name))
    out = []
    for key, inst in insts.items():
        if inst.custom_call_target != "__cublas$lt$matmul$f8":
            continue
        written = inst.result_types[0].split("{")[0]
        form = "bf16" if written.startswith("bf16[") else written
        dims = written[len("f32["):-1].split(",")
        if written.startswith("f32[") and len(dims) >= 3:
            summed = f"bf16[{','.join(dims[1:])}]"
            todo, seen = list(users[key]), set()
            while todo:
                user = todo.pop()
                if user in seen:
                    continue
                seen.add(user)
                u = insts[user]
                if u.opcode in ("get-tuple-element", "bitcast"):
                    todo += users[user]
                elif u.opcode in ("fusion", "reduce") and u.type.split("{")[0] == summed:
                    form = "split"
        out.append((inst.name, form))
    return out


def test_fp8_gemm_results_reads_direct_and_split_forms():
    """``_fp8_gemm_results`` on HLO written like the H200's: a GEMM writing bf16; one split
    four ways whose partials a fusion sums into bf16 (through a get-tuple-element); one
    whose partials are summed into float32 (not the bf16 output asked for); one writing
    float32 unsplit."""
    text = """
  %cublas-gemm.1 = (bf16[512,384]{1,0}, s8[4194304]{0}) custom-call(%a, %b, %c), custom_call_target="__cublas$lt$matmul$f8"
  %cublas-batch-gemm.3 = (f32[4,512,384]{2,1,0}, s8[33554432]{0}) custom-call(%a, %b, %c), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.7 = f32[4,512,384]{2,1,0} get-tuple-element(%cublas-batch-gemm.3), index=0
  %reduce_fusion.2 = bf16[512,384]{1,0} fusion(%get-tuple-element.7), kind=kInput, calls=%fused_reduce
  %cublas-batch-gemm.4 = (f32[2,512,384]{2,1,0}, s8[33554432]{0}) custom-call(%a, %b, %c), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.8 = f32[2,512,384]{2,1,0} get-tuple-element(%cublas-batch-gemm.4), index=0
  %reduce_fusion.3 = f32[512,384]{1,0} fusion(%get-tuple-element.8), kind=kInput, calls=%fused_reduce
  %cublas-gemm.5 = (f32[512,384]{1,0}, s8[4194304]{0}) custom-call(%a, %b, %c), custom_call_target="__cublas$lt$matmul$f8"
  %cublas-gemm.6 = (bf16[512,384]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul"
"""
    forms = [form for _, form in _fp8_gemm_results(text)]
    assert forms == ["bf16", "split", "f32[2,512,384]", "f32[512,384]"]


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU with FP8 (sm_89+)")
def test_bf16_output_compiles_to_cublaslt_fp8_gemms_whose_results_are_bf16(rng):
    """``bf16_output`` on the GPU: every FP8 GEMM of the value and gradient is a
    ``__cublas$lt$matmul$f8`` call whose result is bfloat16: written by the call itself, or,
    where XLA's ``splitk-rewriter`` pass splits the contraction into batched GEMMs, float32
    partials summed into bfloat16 by one fusion (``_fp8_gemm_results``). The pass decides
    by shape alone, to spread a small product over the SMs: at this test's shapes (512 x
    384 outputs from 512 or 384 terms) it splits all three GEMMs, 4, 2 and 4 ways, both on
    the H200 and in the program compiled for one without it (``perf.gpu_compile``); the
    proxy's step has no split GEMM (``tests/perf/test_gpu_compile.py``). A split GEMM
    writes its partials in float32, so the traffic ``bf16_output`` saves is not saved for
    it; the test prints which GEMMs were split.

    Values. On integer data (``_integer_case``, every sum exact, in float32 and in the
    tensor cores alike) the result is the exact product rounded once: equal bit for bit
    to it and to the float32 form with the same power-of-two scales
    (``_pow2_float32_form``, float32 GEMMs at HIGHEST on the GPU).

    On random data the bound is Hopper's, not float32's: the H200's FP8 GEMMs (cuBLASLt's,
    as the kernels') sum FP8 products in the tensor cores, which keep about 14 significant
    bits of the running sum (``fp8_accumulation``; on the H200 an element of dx differed
    from the float32 form by more than float32 sums and one rounding each can). How often
    cuBLASLt promotes its partial sums into float32 is not documented, so the bound takes
    the whole contraction of n terms as one tensor-core sum (k = 32 per instruction,
    n_add = n + n/32 additions, each losing at most 2^-13 of a magnitude at most P, the
    scaled sum of magnitudes |a^| . |b^|); a promotion every 128 or fewer terms only lowers
    the error (float32 adds, partial sums no larger). A split GEMM's partials are shorter
    sums added in float32. Then one rounding to bfloat16 (8 significand bits, unit
    roundoff 2^-8, relative to the result). So, elementwise against the float64 product
    of the dequantized operands,
    |y - exact| <= 2^-8 |y| + (n_add 2^-13 + 2^-24 n/32) P,
    and in Frobenius norm, with the model's independent zero-mean errors
    (``fp8_accumulation.check`` with n_add for its 132 and bfloat16's roundoff, Q = a^^2 . b^^2),
    ||y - exact|| <= 2^-8 ||y|| + 2 sqrt(sum (2 n_add / 3) 2^-26 Q).
    The test prints each product's relative error beside the float32 form's.
    """
    x, w, g = _bf16_linear_operands(rng, b=2, s=256, k=512, n=384)
    fn = lambda a, b: fp8_dot.fp8_dot_general(a, b, LINEAR, bf16_output=True)  # noqa: E731

    def loss(x, w):
        return jnp.sum(fn(x, w).astype(jnp.float32))

    text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    results = _fp8_gemm_results(text)
    assert len(results) >= 3, text[:4000]
    assert all(form in ("bf16", "split") for _, form in results), results
    print("FP8 GEMMs:", [form for _, form in results])

    def dequantized(v, fmt):
        codes, scales = quant.quantize_blocks(v, v.shape, fmt)
        return np.asarray(codes, np.float64) * float(scales.reshape(()))

    ax, aw, ag = dequantized(x, quant.E4M3), dequantized(w, quant.E4M3), dequantized(g, quant.E5M2)
    products = {"y": ("bsk,kn->bsn", ax, aw, 512), "dx": ("bsn,kn->bsk", ag, aw, 384),
                "dw": ("bsk,bsn->kn", ax, ag, 512)}
    got, f32_form = _vjp_outputs(fn, x, w, g), jax.jit(_pow2_float32_form)(x, w, g)
    for name, a, b in zip(("y", "dx", "dw"), got, f32_form):
        spec, u, v, n = products[name]
        exact = np.einsum(spec, u, v)
        rel, rel_bound = fp8_acc.check(
            np.asarray(a, np.float64), exact, np.einsum(spec, np.abs(u), np.abs(v)),
            np.einsum(spec, u * u, v * v), n // 32, name, n_add=n + n // 32, out_roundoff=2.0**-8)
        rel_f32 = np.linalg.norm(np.asarray(b, np.float64) - exact) / np.linalg.norm(exact)
        print(f"{name}: relative error {rel:.2e} (float32 form {rel_f32:.2e}, bound {rel_bound:.2e})")

    operands, exact = _integer_case(rng, 2, 256, 16, 384)
    for name, a, b, e in zip(("y", "dx", "dw"), _vjp_outputs(fn, *operands),
                             jax.jit(_pow2_float32_form)(*operands), exact):
        np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64), name)
        np.testing.assert_array_equal(np.asarray(a, np.float64), e, name)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a CUDA GPU with FP8 (sm_89+)")
def test_compiles_to_cublaslt_fp8_gemm():
    """Forward and both gradients run as ``__cublas$lt$matmul$f8`` custom calls."""
    x = jnp.ones((256, 512), jnp.bfloat16)
    w = jnp.ones((512, 384), jnp.bfloat16)
    dims = (((1,), (0,)), ((), ()))

    def loss(x, w):
        return jnp.sum(fp8_dot.fp8_dot_general(x, w, dims).astype(jnp.float32))

    fwd = jax.jit(lambda x, w: fp8_dot.fp8_dot_general(x, w, dims)).lower(x, w).compile().as_text()
    assert "__cublas$lt$matmul$f8" in fwd, fwd[:4000]
    both = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert both.count("__cublas$lt$matmul$f8") >= 2, both[:4000]
    full = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(x, w).compile().as_text()
    assert full.count("__cublas$lt$matmul$f8") >= 3
