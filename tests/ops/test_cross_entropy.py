"""ops.cross_entropy against optax's ``softmax_cross_entropy_with_integer_labels`` on
float32 logits, the form the trainer used before: the same arithmetic in the same order
(``ops.cross_entropy``'s docstring), so the loss and the logits' gradient, rounded to
the logits' dtype, are equal bit for bit, under ``jit`` too; the weights' gradient is
the sum of two products per token in either form, also equal. Awkward inputs: masked
tokens (weight 0), labels at both ends of the vocabulary, a token whose logits are all
equal, logits spread over many binades; and a non-finite logit, which makes its
token's loss and gradient NaN in both forms alike.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dropless.ops import cross_entropy


def _reference(logits, targets, weights):
    nll = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.sum(nll * weights), jnp.sum(weights)


def _case(rng, dtype, b=2, s=7, v=300):
    logits = (rng.standard_normal((b, s, v)) * np.exp(rng.uniform(-2, 3, (b, s, 1))))
    logits[0, 1] = 0.5  # all equal
    targets = rng.integers(0, v, (b, s))
    targets[0, 0], targets[1, 0] = 0, v - 1
    weights = (rng.uniform(size=(b, s)) > 0.3).astype(np.float32)
    weights[1, 2] = 0.0
    return jnp.asarray(logits, dtype), jnp.asarray(targets, jnp.int32), jnp.asarray(weights)


def _loss(fn):
    # As the trainer's loss_fn: the mean over the weighted tokens, so the cotangent is not 1.
    def loss(logits, targets, weights):
        ce, w = fn(logits, targets, weights)
        return ce / jnp.maximum(w, 1.0)
    return loss


def _value_and_grads(fn, *args, jit):
    f = jax.value_and_grad(_loss(fn), argnums=(0, 2))
    return (jax.jit(f) if jit else f)(*args)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_loss_and_gradients_equal_optax_bit_for_bit(rng, dtype, jit):
    args = _case(rng, dtype)
    sums = cross_entropy.weighted_cross_entropy(*args)
    for a, b in zip(sums, _reference(*args)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (value, (d_logits, d_weights)) = _value_and_grads(cross_entropy.weighted_cross_entropy,
                                                      *args, jit=jit)
    (want, (want_logits, want_weights)) = _value_and_grads(_reference, *args, jit=jit)
    assert d_logits.dtype == dtype
    np.testing.assert_array_equal(np.asarray(value), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(d_logits, np.float32),
                                  np.asarray(want_logits, np.float32))
    np.testing.assert_array_equal(np.asarray(d_weights), np.asarray(want_weights))
    # masked tokens get no gradient
    np.testing.assert_array_equal(np.asarray(d_logits[1, 2], np.float32), 0.0)


def test_non_finite_logit_gives_nan_like_optax(rng):
    logits, targets, weights = _case(rng, jnp.float32)
    logits = logits.at[1, 3, 5].set(jnp.nan).at[0, 4, 9].set(jnp.inf)
    weights = weights.at[1, 3].set(1.0).at[0, 4].set(1.0)
    got = _value_and_grads(cross_entropy.weighted_cross_entropy, logits, targets, weights,
                           jit=True)
    want = _value_and_grads(_reference, logits, targets, weights, jit=True)
    assert np.isnan(np.asarray(got[0]))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_backward_has_no_scatter_and_writes_the_logits_dtype(rng):
    """The point of the op: the label's term is a compare against an iota (optax's
    gradient scatters it into a float32 copy), and the logits' gradient is written in
    their dtype by the same expression."""
    args = _case(rng, jnp.bfloat16)
    grad = jax.grad(_loss(cross_entropy.weighted_cross_entropy))
    jaxpr = str(jax.make_jaxpr(grad)(*args))
    assert "scatter" not in jaxpr
    assert "scatter" in str(jax.make_jaxpr(jax.grad(_loss(_reference)))(*args))
    assert grad(*args).dtype == jnp.bfloat16
