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
FP8, so the float32 to bf16 convert is a separate fusion. Two dequantized
patterns, ``dot(convert(q_a) * s_a, convert(q_b) * s_b)`` in the output
dtype, which the rewriter could make one FP8 call writing bf16, were built
and measured on an H200, and neither gave an FP8 GEMM: with float32 converts
and scales (at 182aad7) XLA folded the f32 -> f8 -> f32 round trip and the
dot ran as a float32 GEMM, the proxy step at 0.25x the direct form (1524.7
against 376.5 ms, step-20261202-022537); with power-of-two scales, bf16
converts and the codes behind an optimization barrier (at d7a6e91) XLA
compiled a plain ``dot`` writing float32, no ``__cublas$lt$matmul$f8``
(gpu-tests-fp8-dot-pow2-20261202-0458-h200.log), the step at 0.988x bf16
against the direct form's 1.062x (step-20261202-045852). So the direct form
is the only one.

``bf16_output`` (config key ``fp8_dot_bf16_output``; opt-in until timed on the
GPU) keeps the direct form and asks its dot for a bfloat16 result
(``preferred_element_type``): XLA's rewriter then builds the cuBLASLt FP8 call
with D in that dtype (its D types are bfloat16, float16, float32 and the FP8
ones), and a multiply of that call by a broadcast scalar is what it folds into
the call as a scale (``F8ScaleD``). That multiply is in bfloat16, exact only for
a power-of-two scale, so with ``bf16_output`` every operand gets a power-of-two
per-tensor scale (``quant.quantize_tensor(pow2=True)``, Transformer Engine's
``force_pow_2_scales``; up to one binade of FP8 range unused). Then, for normal
results, round(round(acc) s) == round(acc s): the same bits as the float32 form
with those scales (the float32 accumulator rounded once, tested on CPU), where
the float32 form writes 4 bytes per element and a pass reads them and writes 2.
In the proxy's FP8 step those float32 outputs cost about 12.6 GB of traffic
(measured in its compiled HLO, ``benchmarks/notes/fp8.md``). In the optimized HLO
for an H200 (compiled without a GPU, ``perf.gpu_compile``) each of the three
products is one ``__cublas$lt$matmul$f8`` call writing bfloat16 with the scale as
its operand and nothing after it, where the float32 form has a convert pass after
each call. Products with other result dtypes keep float32 GEMM outputs.

Numerics (checked in tests/ops/test_fp8_dot.py against float64): with u the
unit roundoff of the operand formats (E4M3 2^-4, E5M2 2^-3), each product is
the exact product of the quantized operands up to the GEMM's accumulation (float32
on CPU; on Hopper the tensor cores' FP8 sums keep about 14 significant bits until
cuBLASLt promotes them into float32, the model of tests/ops/fp8_accumulation.py:
the H200 gave differences from the float32 form that float32 sums cannot make), and
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
from jax.ad_checkpoint import checkpoint_name

from dropless.ops import quant

FWD_DTYPE = quant.E4M3
GRAD_DTYPE = quant.E5M2
# The checkpoint_name of the forward's codes and scales, the backward's residuals.
CODES_NAME = "fp8_dot_codes"


def _on_gpu():
    """Whether the products are traced for a GPU (the backend jax computes on)."""
    return jax.default_backend() == "gpu"


def _precision():
    """FP8 x FP8 -> float32 accumulation: the explicit algorithm on GPU, HIGHEST elsewhere."""
    if _on_gpu():
        return lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
    return lax.Precision.HIGHEST


def _remaining(ndim, *used):
    taken = set(d for axes in used for d in axes)
    return [d for d in range(ndim) if d not in taken]


def _dot(a, b, dims, out_sharding=None, out_dtype=jnp.float32):
    """The direct FP8 product: FP8 codes in, float32 accumulation, ``out_dtype`` out.

    A bfloat16 ``out_dtype`` is the GEMM's own output (cuBLASLt's D) on a GPU: the
    float32 accumulator rounded once. Elsewhere the same is spelled as the float32
    product cast (XLA:CPU runs a bfloat16-output dot of upcast codes with bfloat16
    results, which differs).
    """
    out_dtype = jnp.dtype(out_dtype)
    direct = out_dtype == jnp.float32 or _on_gpu()
    out = lax.dot_general(a, b, dims, precision=_precision(),
                          preferred_element_type=out_dtype if direct else jnp.float32,
                          out_sharding=out_sharding)
    return out if direct else out.astype(out_dtype)


def transpose_lhs(g, rhs, dims, lhs_ndim, out_dtype=jnp.float32, scale=None):
    """Cotangent of the lhs of ``dot_general(lhs, rhs, dims)`` given the output cotangent g.

    g has the output layout [batch..., lhs kept..., rhs kept...]; the result
    has lhs's layout, in ``out_dtype`` (the product's, ``_dot``), times ``scale``
    if given (after the transpose, as the float32 form scales: the H200's compiled
    HLO then has the multiply folded into the FP8 GEMM call; before the transpose
    it stayed a pass of its own in the wgrad).
    """
    (lc, rc), (lb, rb) = dims
    l_kept = _remaining(lhs_ndim, lc, lb)
    r_kept = _remaining(rhs.ndim, rc, rb)
    nb = len(lb)
    g_rkept = list(range(nb + len(l_kept), g.ndim))
    out = _dot(g, rhs, ((g_rkept, r_kept), (list(range(nb)), list(rb))), out_dtype=out_dtype)
    # out: [batch..., lhs kept..., rhs contracting axes in rhs order] -> lhs axes.
    contract_in_rhs_order = [lc[list(rc).index(a)] for a in sorted(rc)]
    out = lax.transpose(out, tuple(np.argsort(list(lb) + l_kept + contract_in_rhs_order)))
    return out if scale is None else out * scale


def transpose_rhs(g, lhs, dims, rhs_ndim, out_dtype=jnp.float32, scale=None):
    """Cotangent of the rhs of ``dot_general(lhs, rhs, dims)`` in rhs's layout; ``out_dtype``
    and ``scale`` as for ``transpose_lhs``."""
    (lc, rc), (lb, rb) = dims
    l_kept = _remaining(lhs.ndim, lc, lb)
    r_kept = _remaining(rhs_ndim, rc, rb)
    nb = len(lb)
    g_lkept = list(range(nb, nb + len(l_kept)))
    out = _dot(g, lhs, ((g_lkept, l_kept), (list(range(nb)), list(lb))), out_dtype=out_dtype)
    # out: [batch..., rhs kept..., lhs contracting axes in lhs order] -> rhs axes.
    contract_in_lhs_order = [rc[list(lc).index(a)] for a in sorted(lc)]
    out = lax.transpose(out, tuple(np.argsort(list(rb) + r_kept + contract_in_lhs_order)))
    return out if scale is None else out * scale


def _canonical(dims):
    (lc, rc), (lb, rb) = dims
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb)))


def _writes_directly(dtype, bf16_output):
    """Whether a product with result ``dtype`` is written by the GEMM itself, scaled in
    ``dtype`` (``bf16_output`` and a bfloat16 result; the module docstring). Not float16:
    its range does not hold every power-of-two scale (2^-30 is below its smallest value)."""
    return bf16_output and jnp.dtype(dtype) == jnp.bfloat16


def _scaled(q_a, q_b, s, dtype, bf16_output, product):
    """``product(q_a, q_b, out_dtype, scale)`` times the scale ``s``, in ``dtype``."""
    if _writes_directly(dtype, bf16_output):
        # s is a power of two: exact in dtype, and round(round(acc) * s) == round(acc * s).
        return product(q_a, q_b, dtype, s.astype(dtype))
    return (product(q_a, q_b, jnp.float32, None) * s).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _fp8_dot(lhs, rhs, dims, out_dtype, out_sharding, bf16_output):
    y, _ = _fp8_dot_fwd(lhs, rhs, dims, out_dtype, out_sharding, bf16_output)
    return y


def _fp8_dot_fwd(lhs, rhs, dims, out_dtype, out_sharding, bf16_output):
    q_l, s_l = quant.quantize_tensor(lhs, FWD_DTYPE, pow2=bf16_output)
    q_r, s_r = quant.quantize_tensor(rhs, FWD_DTYPE, pow2=bf16_output)
    # The backward's operands, named so a remat policy can keep them (``minimal`` does:
    # one byte per element) instead of recomputing both inputs and quantizing them again
    # (an amax and a cast pass over each) when the backward pass recomputes the layer.
    # Named before the product reads them: a backward pass that recomputes the output
    # (for a consumer's gradient: SwiGLU, a norm, an activation) then rescales the kept
    # GEMM output (``minimal`` keeps dots) by the kept scales. Named after, the
    # recomputed output depended on the unnamed scales, and every forward quantization
    # ran again in the backward pass (``tests/train/test_remat_kernels.py``).
    q_l, s_l, q_r, s_r = (checkpoint_name(a, CODES_NAME) for a in (q_l, s_l, q_r, s_r))

    def forward(a, b, dtype, scale):
        y = _dot(a, b, dims, out_sharding, dtype)
        return y if scale is None else y * scale

    y = _scaled(q_l, q_r, s_l * s_r, out_dtype, bf16_output, forward)
    # Zero-size arrays carry the input dtypes (the cotangents must have them).
    dtypes = (jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))
    return y, (q_l, s_l, q_r, s_r, dtypes)


def _fp8_dot_bwd(dims, out_dtype, out_sharding, bf16_output, res, g):
    q_l, s_l, q_r, s_r, (lhs_like, rhs_like) = res
    q_g, s_g = quant.quantize_tensor(g, GRAD_DTYPE, pow2=bf16_output)
    d_lhs = _scaled(q_g, q_r, s_g * s_r, lhs_like.dtype, bf16_output,
                    lambda a, b, dt, sc: transpose_lhs(a, b, dims, q_l.ndim, dt, sc))
    d_rhs = _scaled(q_g, q_l, s_g * s_l, rhs_like.dtype, bf16_output,
                    lambda a, b, dt, sc: transpose_rhs(a, b, dims, q_r.ndim, dt, sc))
    return d_lhs, d_rhs


_fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


def stays_plain(k: int, n: int, min_dim: int) -> bool:
    """A product of contraction size ``k`` and output width ``n`` that ``fp8_dot_general``
    with ``min_dim`` computes as the plain ``lax.dot_general`` (either below ``min_dim``)."""
    return min(k, n) < min_dim


def fp8_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    out_sharding=None, min_dim=0, bf16_output=False):
    """``lax.dot_general`` computed in FP8 with per-tensor current scaling.

    Args:
      lhs, rhs: float arrays (any float dtypes); typically activations and a
        kernel, as ``nnx.Linear`` passes them.
      dimension_numbers: as for ``lax.dot_general`` (batch dims allowed).
      precision: ignored (the FP8 products always accumulate in float32); kept
        for the ``dot_general`` signature.
      preferred_element_type: output dtype (default: the promoted input dtype).
      out_sharding: passed to the forward product.
      min_dim: a product whose contraction size K or output width N (the
        product of rhs's free dimensions) is below this runs as the plain
        ``lax.dot_general`` with the arguments given (config key
        ``fp8_min_dim``): on an H200 the FP8 forms of MLA's narrow projections
        and the shared experts were 0.57-0.97x their bf16 time
        (``fp8_dense-20261202-001951``: quantization passes cost more than the
        GEMM saves at these sizes). 0 quantizes every product.
      bf16_output: power-of-two scales for every operand, and each product whose
        result is bfloat16 (bfloat16 activations, weights and gradients) written by
        the FP8 GEMM in bfloat16 and scaled in it, instead of float32 then a
        scale-and-convert pass (config key ``fp8_dot_bf16_output``; module
        docstring). Products with other result dtypes keep float32 GEMM outputs.

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
        if stays_plain(k, n, min_dim):
            return lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                                   preferred_element_type=preferred_element_type,
                                   out_sharding=out_sharding)
    del precision
    out_dtype = jnp.dtype(preferred_element_type or jnp.promote_types(lhs.dtype, rhs.dtype))
    # Let lax check the shapes (and raise its usual errors) before quantizing.
    jax.eval_shape(functools.partial(lax.dot_general, dimension_numbers=dims), lhs, rhs)
    return _fp8_dot(lhs, rhs, dims, out_dtype, out_sharding, bool(bf16_output))
