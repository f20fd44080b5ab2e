"""Token cross-entropy of the output head, with a one-pass backward.

``weighted_cross_entropy(logits, targets, weights)`` is ``optax``'s
``softmax_cross_entropy_with_integer_labels`` on the float32 logits, weighted and
summed, with the same arithmetic in the same order, so the same bits for the loss
and for the logits' gradient rounded to the logits' dtype (tests compare both).
It exists for the traffic of its backward pass. Autodiff of the optax form, the
head's bf16 logits cast to float32 first, compiles for an H200 to four passes over
[tokens, vocab] after the head's GEMM (the softmax in float32, a scatter adding the
label's term into a float32 copy, a convert to bf16, besides the forward's three
reductions): in the deepseek3-proxy step 25.7 GiB of traffic, about 8 ms at HBM
speed. Here the backward is one elementwise pass, reading the logits in their own
dtype and writing their gradient in it, with the label's term as a compare against
an iota instead of a scatter (``tools/compile_step_for_gpu.py`` reads the step's
passes).

Forward, per token (float32): ``m = max(x)`` (0 where not finite, as
``jax.nn.logsumexp``), ``s = sum(exp(x - m))``, ``nll = (log(s) + m) - x[label]``;
returns ``(sum(nll * w), sum(w))``. Backward, for the cotangent ``g`` of the sum:
``dx = exp(x - m) * ((g w) / s) + (x's label ? -(g w) : 0)``, rounded once to the
logits' dtype.
"""

import jax
import jax.numpy as jnp
from jax import lax


def _nll(logits_BSV, targets_BS):
    """(m, s, nll) per token, float32: the forward's pieces (module docstring)."""
    x = logits_BSV.astype(jnp.float32)
    m = jnp.max(x, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    s = jnp.abs(jnp.sum(jnp.exp(x - m[..., None]), axis=-1))
    label = jnp.take_along_axis(x, targets_BS[..., None], axis=-1)[..., 0]
    return m, s, (jnp.log(s) + m) - label


def _fwd(logits_BSV, targets_BS, weights_BS):
    m, s, nll = _nll(logits_BSV, targets_BS)
    out = (jnp.sum(nll * weights_BS), jnp.sum(weights_BS))
    return out, (logits_BSV, targets_BS, weights_BS, m, s, nll)


@jax.custom_vjp
def weighted_cross_entropy(logits_BSV, targets_BS, weights_BS):
    """(sum over tokens of ``weights * nll``, sum of weights), float32 scalars.

    Args:
      logits_BSV: [..., V] logits, any float dtype (the math is float32).
      targets_BS: [...] int labels in [0, V).
      weights_BS: [...] float token weights (0 masks a token).
    """
    return _fwd(logits_BSV, targets_BS, weights_BS)[0]


def _bwd(res, cts):
    logits_BSV, targets_BS, weights_BS, m, s, nll = res
    g_sum, g_count = cts
    ct = g_sum * weights_BS  # d sum / d nll, per token
    x = logits_BSV.astype(jnp.float32)
    softmax_part = jnp.exp(x - m[..., None]) * (ct / s)[..., None]
    vocab = lax.broadcasted_iota(targets_BS.dtype, logits_BSV.shape, logits_BSV.ndim - 1)
    label_part = jnp.where(vocab == targets_BS[..., None], -ct[..., None], 0.0)
    d_logits = (softmax_part + label_part).astype(logits_BSV.dtype)
    d_weights = (g_sum * nll + g_count).astype(weights_BS.dtype)
    return d_logits, None, d_weights


weighted_cross_entropy.defvjp(_fwd, _bwd)
