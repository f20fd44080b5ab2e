"""FP8 ``dot_general`` with per-tensor current scaling (``quantization: te_fp8_currentscaling``).

A drop-in for ``jax.lax.dot_general`` (``nnx.Linear(..., dot_general=fp8_dot_general)``)
whose three products run in FP8 with float32 accumulation::

    forward  y  = (q(x) . q(w))            * sx * sw      q: E4M3
    dgrad    dx = (q(dy) . q(w)^T)         * sdy * sw     q(dy): E5M2
    wgrad    dw = (q(x)^T . q(dy))         * sx * sdy

Each operand is quantized with its own per-tensor scale computed from its
current amax (``ops.quant.quantize_tensor``), every step, so there is no amax
history to carry. Gradients use E5M2 (Transformer Engine's HYBRID format, the
default of its ``Float8CurrentScaling`` recipe): a per-tensor scale must cover
a gradient's whole dynamic range, and E5M2 has 2^7 more of it than E4M3 at
one mantissa bit less. The residuals kept for the backward pass are the FP8
codes and scales of x and w (half the bytes of bf16 residuals).

How this reaches cuBLASLt's FP8 GEMM on GPU: the FP8 arrays go straight into
``lax.dot_general`` with ``preferred_element_type=float32`` and the scales
multiply the float32 product afterwards ("direct quantization", what Flax's
``Fp8DirectDotGeneralOp`` and Transformer Engine's JAX GEMM do). XLA's GEMM
rewriter turns an FP8 x FP8 dot into ``__cublas$lt$matmul$f8`` (E4M3 x E4M3,
E4M3 x E5M2 and E5M2 x E4M3 are supported; E5M2 x E5M2 is not and never
occurs here), inserting the K-major transposes cuBLASLt needs on the one-byte
operands. The older pattern (dequantize to bf16, then dot) relies on XLA
matching convert-multiply-dot and broke across XLA versions; Flax deprecated
it. On GPU the dots ask for the ``ANY_F8_ANY_F8_F32`` algorithm: FP8 inputs
with float32 accumulation and without cuBLASLt's fast (reduced-precision)
FP8 accumulation; other platforms, which reject that algorithm, get
``Precision.HIGHEST`` (XLA:CPU upcasts the codes, exact, and accumulates in
float32).

The GEMM writes float32; the scales and the cast to the output dtype come
after. XLA folds the scale into the cuBLASLt call (``F8ScaleD``), but its
``HandleConvert`` fuses a convert into an FP8 GEMM only when the output is
FP8, so the float32 to bf16 convert is a separate fusion.

``pow2_scales=True`` takes the other pattern XLA's GEMM rewriter knows (its
test ``ScaledABUnscaledDApproxGeluActivationF8``): FP8 values converted to
bf16, times a broadcast bf16 scalar scale, into a bf16 x bf16 -> bf16 dot,
which it makes one ``__cublas$lt$matmul$f8`` call writing bf16 with the
scales as operands ("dequantized form"). Two things make it usable:

* the codes and scale pass ``quant.keep_codes`` (an optimization barrier).
  An earlier dequantized form without it, f32 converts and f32 scales, was
  not FP8 on the GPU: measured on an H200 at 182aad7, XLA folded the
  f32 -> f8 -> f32 round trip, the dot ran as a float32 GEMM, and the proxy
  step took 1524.7 ms against the direct form's 376.5 (step-20261202-022537);
* power-of-two scales (``quant.quantize_tensor(pow2=True)``, Transformer
  Engine's ``force_pow_2_scales``). A bf16 scale 2^k is then exact, and so is
  ``code * 2^k`` in bf16 (E4M3's and E5M2's mantissas fit in bf16's, and
  every nonzero product is a float32 normal unless the tensor's amax is
  below about 2^-109 for E4M3, 2^-95 for E5M2, where the smallest
  subnormal codes times the scale fall below 2^-126). The dequantized operands are the FP8 values exactly,
  their products are exact in float32, and scaling every term of a float32
  sum by a power of two commutes with its roundings: the bf16 result is the
  direct form's (with the same scales) bit for bit, given the same
  accumulation order and no float32 under- or overflow. The price is up to
  one bit of range: amax maps into (fmax / 2, fmax] instead of onto fmax.

Outputs other than bf16, and every output off the GPU (``_bf16_gemm``),
dequantize to float32, which is as exact, and dot in float32.

Numerics (checked in tests/ops/test_fp8_dot.py against float64): with u the
unit roundoff of the operand formats (E4M3 2^-4, E5M2 2^-3), each product is
the exact product of the quantized operands up to float32 accumulation, and
the quantized operands differ from the originals by at most u relative (plus
2^-10 s absolute for E4M3 values in the subnormal range), so
|y^ - y| <= (2u + u^2) |x|.|w| + subnormal terms, elementwise.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from dropless.ops import quant

FWD_DTYPE = quant.E4M3
GRAD_DTYPE = quant.E5M2


def _precision():
    """FP8 x FP8 -> float32 accumulation: the explicit algorithm on GPU, HIGHEST elsewhere."""
    if jax.default_backend() == "gpu":
        return lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
    return lax.Precision.HIGHEST


def _remaining(ndim, *used):
    taken = set(d for axes in used for d in axes)
    return [d for d in range(ndim) if d not in taken]


def _dot(a, b, dims, out_sharding=None):
    """The direct FP8 product: FP8 codes in, float32 out."""
    return lax.dot_general(a, b, dims, precision=_precision(),
                           preferred_element_type=jnp.float32, out_sharding=out_sharding)


def _bf16_gemm():
    """Whether the dequantized form of a bf16-output product runs in bf16 (operands and dot): on GPU.

    There the rewriter's pattern needs it and cuBLASLt accumulates in float32
    before its one rounding. XLA:CPU's loop emitter accumulates a bf16-output
    dot in bf16 (a transposed wgrad dot of a 4x6x16 test was off by up to 3
    bf16 ulps in 75 of 128 elements) and its dot thunk has no bf16 x bf16 ->
    float32, so elsewhere the operands dequantize to float32 (as exact) and
    the dot writes float32; the cast to bf16 is the same single rounding.
    """
    return jax.default_backend() == "gpu"


def _dequantized_dot(a, b, dims, out_sharding=None):
    """The dequantized form's product, in the operands' dtype.

    Precision is left at DEFAULT: the operands are bf16 or float32 here, and
    XLA's GEMM rewriter, not an algorithm preset, decides that the product is
    an FP8 GEMM (it finds the FP8 codes behind the converts).
    """
    return lax.dot_general(a, b, dims, preferred_element_type=a.dtype, out_sharding=out_sharding)


def transpose_lhs(g, rhs, dims, lhs_ndim, dot=_dot):
    """Cotangent of the lhs of ``dot_general(lhs, rhs, dims)`` given the output cotangent g.

    g has the output layout [batch..., lhs kept..., rhs kept...]; the result
    has lhs's layout, in the dtype ``dot`` writes (float32 for the direct FP8
    product).
    """
    (lc, rc), (lb, rb) = dims
    l_kept = _remaining(lhs_ndim, lc, lb)
    r_kept = _remaining(rhs.ndim, rc, rb)
    nb = len(lb)
    g_rkept = list(range(nb + len(l_kept), g.ndim))
    out = dot(g, rhs, ((g_rkept, r_kept), (list(range(nb)), list(rb))))
    # out: [batch..., lhs kept..., rhs contracting axes in rhs order] -> lhs axes.
    contract_in_rhs_order = [lc[list(rc).index(a)] for a in sorted(rc)]
    return lax.transpose(out, tuple(np.argsort(list(lb) + l_kept + contract_in_rhs_order)))


def transpose_rhs(g, lhs, dims, rhs_ndim, dot=_dot):
    """Cotangent of the rhs of ``dot_general(lhs, rhs, dims)``; rhs's layout, ``dot``'s dtype."""
    (lc, rc), (lb, rb) = dims
    l_kept = _remaining(lhs.ndim, lc, lb)
    r_kept = _remaining(rhs_ndim, rc, rb)
    nb = len(lb)
    g_lkept = list(range(nb, nb + len(l_kept)))
    out = dot(g, lhs, ((g_lkept, l_kept), (list(range(nb)), list(lb))))
    # out: [batch..., rhs kept..., lhs contracting axes in lhs order] -> rhs axes.
    contract_in_lhs_order = [rc[list(lc).index(a)] for a in sorted(lc)]
    return lax.transpose(out, tuple(np.argsort(list(rb) + r_kept + contract_in_lhs_order)))


def _canonical(dims):
    (lc, rc), (lb, rb) = dims
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def _quantize(x, dtype, pow2, form):
    q, s = quant.quantize_tensor(x, dtype, pow2=pow2)
    # The dequantized form converts the codes back up before its dot: without the
    # barrier XLA folds the f32 -> f8 -> f32 round trip and no FP8 GEMM remains.
    return quant.keep_codes(q, s) if form == "dequantized" else (q, s)


def _product(product, a, b, out_dtype, form):
    """``product(a_operand, b_operand, dot)`` of two quantized operands ``(q, scale)``, in out_dtype.

    direct: the FP8 codes into ``_dot`` (float32 out), times both scales, cast.
    dequantized: ``q * scale`` in bf16 (bf16 outputs on GPU) or float32
    (otherwise) into a dot writing that dtype; exact operands when the scales
    are powers of two, so the result is the direct form's, rounded once.
    """
    (q_a, s_a), (q_b, s_b) = a, b
    if form == "direct":
        return (product(q_a, q_b, _dot) * (s_a * s_b)).astype(out_dtype)
    dtype = jnp.bfloat16 if out_dtype == jnp.bfloat16 and _bf16_gemm() else jnp.float32
    deq_a, deq_b = (q.astype(dtype) * s.astype(dtype) for q, s in ((q_a, s_a), (q_b, s_b)))
    return product(deq_a, deq_b, _dequantized_dot).astype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _fp8_dot(lhs, rhs, dims, out_dtype, out_sharding, pow2, form):
    y, _ = _fp8_dot_fwd(lhs, rhs, dims, out_dtype, out_sharding, pow2, form)
    return y


def _fp8_dot_fwd(lhs, rhs, dims, out_dtype, out_sharding, pow2, form):
    lhs_q = _quantize(lhs, FWD_DTYPE, pow2, form)
    rhs_q = _quantize(rhs, FWD_DTYPE, pow2, form)
    y = _product(lambda a, b, dot: dot(a, b, dims, out_sharding), lhs_q, rhs_q, out_dtype, form)
    # Zero-size arrays carry the input dtypes (the cotangents must have them).
    dtypes = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return y, (lhs_q, rhs_q, dtypes)


def _fp8_dot_bwd(dims, out_dtype, out_sharding, pow2, form, res, g):
    lhs_q, rhs_q, (lhs_like, rhs_like) = res
    g_q = _quantize(g, GRAD_DTYPE, pow2, form)
    lhs_ndim, rhs_ndim = lhs_q[0].ndim, rhs_q[0].ndim
    d_lhs = _product(lambda g, r, dot: transpose_lhs(g, r, dims, lhs_ndim, dot),
                     g_q, rhs_q, lhs_like.dtype, form)
    d_rhs = _product(lambda g, l, dot: transpose_rhs(g, l, dims, rhs_ndim, dot),
                     g_q, lhs_q, rhs_like.dtype, form)
    return d_lhs, d_rhs


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None, pow2_scales=False, min_dim=0):
    """``lax.dot_general`` computed in FP8 with per-tensor current scaling.

    Args:
      lhs, rhs: float arrays (any float dtypes); typically activations and a
        kernel, as ``nnx.Linear`` passes them.
      dimension_numbers: as for ``lax.dot_general`` (batch dims allowed).
      precision: ignored (the FP8 products always accumulate in float32); kept
        for the ``dot_general`` signature.
      preferred_element_type: output dtype (default: the promoted input dtype).
      out_sharding: passed to the forward product.
      pow2_scales: power-of-two scales (``quant.quantize_tensor(pow2=True)``)
        and the dequantized form: each product is a dot of ``q * scale`` in the
        output dtype (bf16 for bf16 activations), which XLA's GEMM rewriter can
        make one FP8 GEMM writing that dtype. Bit for bit the direct form's
        result with the same scales (module docstring).
      min_dim: a product whose contraction size K or output width N (the
        product of rhs's free dimensions) is below this runs as the plain
        ``lax.dot_general`` with the arguments given (config key
        ``fp8_min_dim``): on an H200 the FP8 forms of MLA's narrow projections
        and the shared experts were 0.57-0.97x their bf16 time
        (``fp8_dense-20261202-001951``: quantization passes cost more than the
        GEMM saves at these sizes). 0 quantizes every product.

    Returns:
      The product in ``preferred_element_type``. Differentiable in lhs and rhs
      (gradients in their dtypes, computed from FP8 operands as described in
      the module docstring).

    Raises:
      TypeError / ValueError from ``lax.dot_general`` for inconsistent shapes.
    """
    dims = _canonical(dimension_numbers)
    if min_dim:
        (lc, rc), (_, rb) = dims
        k = math.prod(lhs.shape[a] for a in lc)
        n = math.prod(rhs.shape[a] for a in _remaining(rhs.ndim, rc, rb))
        if min(k, n) < min_dim:
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type,
                                   out_sharding=out_sharding)
    del precision
    out_dtype = jnp.dtype(preferred_element_type or jnp.promote_types(lhs.dtype, rhs.dtype))
    # Let lax check the shapes (and raise its usual errors) before quantizing.
    jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=dims), lhs, rhs)
    return _fp8_dot(lhs, rhs, dims, out_dtype, out_sharding, bool(pow2_scales),
                    "dequantized" if pow2_scales else "direct")
