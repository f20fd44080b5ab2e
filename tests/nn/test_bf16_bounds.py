"""bf16_bounds against brute force: random roundings stay inside the bound, the real
bf16 run does too, and for a linear map the worst-case rounding signs reach it."""

import jax
import jax.numpy as jnp
import numpy as np

import bf16_bounds

U = 2.0**-8


def swiglu_bf16(x, w_gate, w_up, w_out):
    x, w_gate, w_up, w_out = (a.astype(jnp.bfloat16) for a in (x, w_gate, w_up, w_out))
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # noqa: E731
    return dot(jax.nn.silu(dot(x, w_gate)) * dot(x, w_up), w_out)


def test_random_roundings_and_bf16_run_stay_inside_bound(rng):
    args = [jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(4, 8), (8, 6), (8, 6), (6, 8)]]
    exact, bound = bf16_bounds.error_bounds(swiglu_bf16, *args)
    got = np.asarray(jax.jit(swiglu_bf16)(*args), np.float64)
    assert np.all(np.abs(got - exact) <= bound)
    worst = 0.0
    for seed in range(4):  # each call compiles its own float64 program (~0.4 s)
        sim = bf16_bounds.simulate(swiglu_bf16, seed, *args)
        assert np.all(np.abs(sim - exact) <= bound)
        worst = max(worst, float(np.max(np.abs(sim - exact) / bound)))
    assert worst > 0.05  # the perturbations are not vanishing: the check can fail


def test_linear_map_bound_is_reached_by_worst_signs(rng):
    """y = bf16(x) . bf16(w) (float32 accumulation): the bound is 2u sum|x w| to first
    order, and x, w rounded up or down by u along sign(x w) reach it."""
    x, w = rng.standard_normal(64), rng.standard_normal(64)
    fn = lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),  # noqa: E731
                              preferred_element_type=jnp.float32)
    exact, bound = bf16_bounds.error_bounds(fn, jnp.asarray(x, jnp.float32), jnp.asarray(w, jnp.float32))
    s = np.sign(x * w)
    adversarial = np.sum(x * (1 + U * s) * w * (1 + U * s))
    assert abs(adversarial - exact) <= bound
    assert abs(adversarial - exact) >= 0.99 * bound
