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


def scanned_bf16(x, w_LDD):
    """A layer scan in bf16 with the rules added for the train step: rsqrt, sin,
    cos, pow, stack, and the scan itself (carry and stacked outputs)."""
    dot = lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)  # noqa: E731

    def layer(h, w):
        h = dot(h, w)
        h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1)
        h = (jnp.sin(h) + jnp.cos(h)).astype(jnp.bfloat16)
        return h, jnp.stack([h, h * h])

    h, ys = jax.lax.scan(layer, x.astype(jnp.bfloat16), w_LDD.astype(jnp.bfloat16))
    return h, ys, jnp.power(jnp.abs(h.astype(jnp.float32)) + 1, 1.5)


def test_scan_rsqrt_sin_cos_pow_random_roundings_and_bf16_run_stay_inside_bound(rng):
    # Two layers, weights of scale 0.3: the bf16 worst case stays below the values
    # (a third layer makes rsqrt's input bound exceed the input: an infinite bound).
    args = [jnp.asarray(rng.standard_normal((4, 8)), jnp.float32),
            jnp.asarray(0.3 * rng.standard_normal((2, 8, 8)), jnp.float32)]
    exact, bound = bf16_bounds.error_bounds(scanned_bf16, *args)
    got = jax.jit(scanned_bf16)(*args)
    flat = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]  # noqa: E731
    for g, x, b in zip(flat(got), flat(exact), flat(bound)):
        assert np.all(np.isfinite(b)) and np.all(np.abs(g - x) <= b)
    worst = 0.0
    for seed in range(3):
        for s, x, b in zip(flat(bf16_bounds.simulate(scanned_bf16, seed, *args)), flat(exact), flat(bound)):
            assert np.all(np.abs(s - x) <= b)
            worst = max(worst, float(np.max(np.abs(s - x) / b)))
    assert worst > 0.05  # the perturbations are not vanishing: the check can fail


def test_replay_bound_holds_against_exact_rational_arithmetic(rng):
    """replay=True bounds the float64 replay itself: a float32 dot of 64 terms with
    heavy cancellation, checked against the exact sum in Fractions."""
    from fractions import Fraction

    x = rng.standard_normal(64).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    w[-1] = np.float32(-np.dot(x[:-1].astype(np.float64), w[:-1]) / x[-1])  # near-cancelling
    fn = lambda x, w: jnp.sum(x * w)  # noqa: E731
    replay, bound = bf16_bounds.error_bounds(fn, x, w, replay=True)
    exact = sum(Fraction(float(a)) * Fraction(float(b)) for a, b in zip(x, w))
    err = abs(Fraction(float(replay)) - exact)
    assert err <= Fraction(float(bound))
    scale = float(np.sum(np.abs(x.astype(np.float64) * w)))
    assert float(bound) <= 2 * 65 * 2.0**-53 * scale  # gamma_64(u64) sum |x w| and the products' u64


def test_decisions_report_a_top_k_margin_below_the_bound():
    """top-k of bf16 scores: a gap of 1e-4 between the 2nd and 3rd is inside bf16's
    bound (ratio > 1), a gap of 0.5 is not (ratio < 1); float comparisons too."""
    def fn(s):
        s = s.astype(jnp.bfloat16).astype(jnp.float32)
        values, _ = jax.lax.top_k(s, 2)
        return values, (s > 0.2).astype(jnp.float32)

    for gap, expect_safe in [(1e-4, False), (0.5, True)]:
        s = jnp.asarray([[3.0, 1.0, 1.0 - gap, -2.0]], jnp.float32)
        _, _, worst = bf16_bounds.error_bounds(fn, s, decisions=True)
        assert (worst["top_k"] < 1) == expect_safe, (gap, worst)
        assert worst["gt"] < 1  # no score within bf16's reach of 0.2
    _, _, worst = bf16_bounds.error_bounds(fn, jnp.asarray([[3.0, 1.0, 0.2001, -2.0]]), decisions=True)
    assert worst["gt"] > 1
