"""Router math against per-token NumPy brute force and hand-worked examples.

Legend: T tokens, E experts, K experts per token, G expert groups, B batch,
S sequence.

The brute force routes one token at a time in float64: it enumerates groups,
sums each group's two best selection scores, keeps the best groups, sorts the
eligible experts, and reads the weights off the unbiased scores.

The Hypothesis tests route through ``jax.jit`` (one program per example's
shapes: op by op, every op would compile again for each new shape).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from dropless.ops import routing


def brute_force_route(logits, k, score_func, norm, scale, bias, n_groups, topk_groups):
    """Per-token float64 routing; also returns the smallest decision margin."""
    logits = np.asarray(logits, np.float64)
    t, e = logits.shape
    if score_func == "softmax":
        z = np.exp(logits - logits.max(-1, keepdims=True))
        scores = z / z.sum(-1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    selection = scores + (0.0 if bias is None else np.asarray(bias, np.float64))
    experts = np.zeros((t, k), np.int64)
    weights = np.zeros((t, k))
    margin = np.inf
    for i in range(t):
        eligible = list(range(e))
        if n_groups > 1:
            size = e // n_groups
            group_scores = [
                sum(sorted(selection[i, g * size:(g + 1) * size], reverse=True)[:2])
                for g in range(n_groups)
            ]
            order = sorted(range(n_groups), key=lambda g: -group_scores[g])
            if topk_groups < n_groups:
                margin = min(margin, group_scores[order[topk_groups - 1]]
                             - group_scores[order[topk_groups]])
            eligible = [x for g in order[:topk_groups] for x in range(g * size, (g + 1) * size)]
        ranked = sorted(eligible, key=lambda x: -selection[i, x])
        if k < len(ranked):
            margin = min(margin, selection[i, ranked[k - 1]] - selection[i, ranked[k]])
        experts[i] = ranked[:k]
        w = scores[i, ranked[:k]]
        weights[i] = (w / w.sum() if norm else w) * scale
    return experts, weights, scores, margin


@st.composite
def routing_case(draw, grouped=None):
    e = draw(st.sampled_from([4, 8, 16]))
    choices = {None: (-1, 2, 4), True: (2, 4)}[grouped]
    n_groups = draw(st.sampled_from([g for g in choices if g == -1 or e % g == 0]))
    topk_groups = -1 if n_groups == -1 else draw(st.integers(1, n_groups))
    max_k = e if n_groups == -1 else topk_groups * (e // n_groups)
    return dict(
        t=draw(st.sampled_from([1, 5, 12])),  # few shapes: fewer XLA compilations
        e=e,
        k=draw(st.integers(1, min(max_k, 6))),
        score_func=draw(st.sampled_from(routing.SCORE_FUNCS)),
        norm=draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 2.5])),
        use_bias=draw(st.booleans()),
        n_groups=n_groups,
        topk_groups=topk_groups,
    )


_jit_route = functools.partial(jax.jit, static_argnames=(
    "k", "score_func", "norm_topk_prob", "routed_scaling_factor", "n_groups", "topk_groups"))(
        routing.route)


@given(case=routing_case())
def test_route_matches_brute_force(case, rng):
    t, e, k = case["t"], case["e"], case["k"]
    logits = rng.standard_normal((t, e)).astype(np.float32) * 2
    bias = rng.standard_normal(e).astype(np.float32) * 0.3 if case["use_bias"] else None
    args = (k, case["score_func"], case["norm"], case["scale"], bias,
            case["n_groups"], case["topk_groups"])
    experts_ref, weights_ref, scores_ref, margin = brute_force_route(logits, *args)
    assume(margin > 1e-5)  # float32 vs float64 may legitimately break near-ties
    out = _jit_route(
        jnp.asarray(logits), k=k, score_func=case["score_func"], norm_topk_prob=case["norm"],
        routed_scaling_factor=case["scale"], bias_E=None if bias is None else jnp.asarray(bias),
        n_groups=case["n_groups"], topk_groups=case["topk_groups"],
    )
    assert out.experts_TK.dtype == jnp.int32 and out.weights_TK.dtype == jnp.float32
    np.testing.assert_array_equal(out.experts_TK, experts_ref)
    np.testing.assert_allclose(out.weights_TK, weights_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out.scores_TE, scores_ref, rtol=1e-5, atol=1e-6)


@given(case=routing_case(grouped=True))
def test_group_limited_never_leaves_chosen_groups(case, rng):
    t, e, k, g = case["t"], case["e"], case["k"], case["n_groups"]
    logits = rng.standard_normal((t, e)).astype(np.float32)
    out = _jit_route(jnp.asarray(logits), k=k, score_func=case["score_func"],
                     n_groups=g, topk_groups=case["topk_groups"])
    scores = np.asarray(out.scores_TE).reshape(t, g, e // g)
    group_scores = np.sort(scores, axis=-1)[..., ::-1][..., :2].sum(-1)
    chosen = np.argsort(-group_scores, axis=-1, kind="stable")[:, : case["topk_groups"]]
    for i in range(t):
        assert set(np.asarray(out.experts_TK[i]) // (e // g)) <= set(chosen[i])


def test_group_score_is_top2_sum_not_max():
    """The best single expert loses when its group's second best is weak."""
    # Group 0 = experts 0..3 holds the best expert but little else; group 1 =
    # experts 4..7 has two strong ones: sigmoid(2) * 2 = 1.76 > sigmoid(3) + sigmoid(-5) = 0.96.
    logits = jnp.array([[3.0, -5.0, -5.0, -5.0, 2.0, 2.0, -5.0, -5.0]])
    out = routing.route(logits, k=2, score_func="sigmoid", n_groups=2, topk_groups=1)
    assert sorted(np.asarray(out.experts_TK[0]).tolist()) == [4, 5]
    free = routing.route(logits, k=2, score_func="sigmoid")
    assert 0 in np.asarray(free.experts_TK[0]).tolist()


def test_bias_changes_selection_not_weights():
    logits = jnp.array([[2.0, 1.0, 0.0, -1.0]])
    plain = routing.route(logits, k=2, score_func="sigmoid", norm_topk_prob=True)
    assert np.asarray(plain.experts_TK[0]).tolist() == [0, 1]
    bias = jnp.array([0.0, 0.0, 0.0, 5.0])
    biased = routing.route(logits, k=2, score_func="sigmoid", norm_topk_prob=True, bias_E=bias)
    assert np.asarray(biased.experts_TK[0]).tolist() == [3, 0]
    s = jax.nn.sigmoid(logits[0])
    expected = np.array([s[3], s[0]]) / (s[3] + s[0])
    np.testing.assert_allclose(biased.weights_TK[0], expected, rtol=1e-6)
    # No gradient reaches the bias through the weights.
    grad_bias = jax.grad(
        lambda b: routing.route(logits, k=2, score_func="sigmoid", bias_E=b).weights_TK[0, 1]
    )(bias)
    np.testing.assert_array_equal(grad_bias, 0.0)


def test_weights_are_differentiable_in_logits(rng):
    logits = jnp.asarray(rng.standard_normal((5, 6)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((5, 2)), jnp.float32)
    out = routing.route(logits, k=2, score_func="sigmoid", norm_topk_prob=True)
    idx = out.experts_TK

    def by_hand(lg):
        s = jnp.take_along_axis(jax.nn.sigmoid(lg), idx, axis=-1)
        return jnp.sum(s / s.sum(-1, keepdims=True) * c)

    grad = jax.grad(lambda lg: jnp.sum(
        routing.route(lg, k=2, score_func="sigmoid").weights_TK * c))(logits)
    np.testing.assert_allclose(grad, jax.grad(by_hand)(logits), rtol=1e-5, atol=1e-7)
    assert np.any(np.asarray(grad) != 0)


def test_bias_update_sign_rule():
    counts = jnp.array([10, 2, 4, 0], jnp.int32)  # mean 4
    np.testing.assert_allclose(routing.bias_update(counts, 0.01), [-0.01, 0.01, 0.0, 0.01])
    assert routing.bias_update(counts, 0.01).dtype == jnp.float32


def test_load_balance_loss_by_hand():
    probs = jnp.array([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]])
    experts = jnp.array([[0], [1]])
    # f = [1/2, 1/2, 0], P = [0.4, 0.4, 0.2] -> 3 * (0.2 + 0.2) = 1.2
    np.testing.assert_allclose(routing.load_balance_loss(probs, experts), 1.2, rtol=1e-6)
    uniform = jnp.full((4, 4), 0.25)
    balanced = jnp.array([[0, 1], [2, 3], [1, 0], [3, 2]])
    np.testing.assert_allclose(routing.load_balance_loss(uniform, balanced), 1.0, rtol=1e-6)
    # Sigmoid scores are normalised per token before averaging.
    np.testing.assert_allclose(
        routing.load_balance_loss(probs * 3.0, experts, "sigmoid"), 1.2, rtol=1e-6
    )


def test_seq_aux_loss_matches_formula(rng):
    b, s, e, k = 3, 5, 6, 2
    scores = rng.uniform(0.05, 1.0, (b, s, e)).astype(np.float32)
    experts = np.stack([rng.permutation(e)[:k] for _ in range(b * s)]).reshape(b, s, k)
    expected = []
    for i in range(b):
        counts = np.bincount(experts[i].ravel(), minlength=e)
        f = counts * e / (k * s)
        p = (scores[i] / scores[i].sum(-1, keepdims=True)).mean(0)
        expected.append(np.sum(f * p))
    loss = routing.seq_aux_loss(jnp.asarray(scores), jnp.asarray(experts, jnp.int32))
    np.testing.assert_allclose(loss, np.mean(expected), rtol=1e-5)


def test_router_z_loss(rng):
    logits = rng.standard_normal((7, 5)).astype(np.float32) * 3
    lse = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    np.testing.assert_allclose(routing.router_z_loss(jnp.asarray(logits)), np.mean(lse**2),
                               rtol=1e-5)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(k=9), "top-k"),
        (dict(k=0), "top-k"),
        (dict(k=2, n_groups=3, topk_groups=1), "divisor"),
        (dict(k=2, n_groups=4, topk_groups=5), "topk_groups"),
        (dict(k=2, n_groups=4, topk_groups=-1), "topk_groups"),
        (dict(k=3, n_groups=4, topk_groups=1), "fewer"),
        (dict(k=2, score_func="relu"), "score_func"),
        (dict(k=2, bias_E=jnp.zeros(7)), "bias_E"),
    ],
)
def test_bad_routing_args_raise_at_trace_time(kwargs, match):
    logits = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(lambda lg: routing.route(lg, **kwargs), logits)
