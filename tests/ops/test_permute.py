"""Permutation by expert: layout, round trip, alignment padding and custom VJPs.

Legend: T tokens, K experts per token, C = T*K copies, E experts, D
features, P buffer rows.

The NumPy reference builds the buffer the slow way: walk the experts in
order, append each expert's copies in token order, then pad the expert's
rows with zeros up to a multiple of the alignment.

Each Hypothesis example's JAX work runs as one jitted program: op by op,
every op compiled again for each new shape, the tests took three to four
times as long.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless.ops import permute as P
from dropless.perf import jaxprs


def numpy_buffer(x, experts, num_experts, alignment):
    """(buffer [P, D], group_sizes [E], row_of_copy [C]) built expert by expert."""
    t, k = experts.shape
    flat = experts.ravel()
    rows, sizes, row_of_copy = [], [], np.zeros(t * k, np.int64)
    for e in range(num_experts):
        copies = [c for c in range(t * k) if flat[c] == e]  # token order
        for c in copies:
            row_of_copy[c] = len(rows)
            rows.append(x[c // k])
        padded = -(-len(copies) // alignment) * alignment
        rows.extend([np.zeros(x.shape[1], x.dtype)] * (padded - len(copies)))
        sizes.append(padded)
    p = P.buffer_rows(t * k, num_experts, alignment)
    rows.extend([np.zeros(x.shape[1], x.dtype)] * (p - len(rows)))
    return np.stack(rows), np.array(sizes), row_of_copy


@st.composite
def permute_case(draw):
    t = draw(st.sampled_from([1, 3, 8]))
    e = draw(st.sampled_from([1, 4, 6]))
    k = draw(st.integers(1, min(e, 3)))
    alignment = draw(st.sampled_from([1, 4]))
    skew = draw(st.sampled_from(["distinct", "all_to_zero", "repeats"]))
    return t, e, k, alignment, skew


def draw_experts(rng, t, e, k, skew):
    if skew == "distinct":  # what a router produces
        return np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32)
    if skew == "all_to_zero":
        return np.zeros((t, k), np.int32)
    return rng.integers(0, e, (t, k)).astype(np.int32)  # repeats are still a bijection


@functools.partial(jax.jit, static_argnums=(0, 1))
def _plan_and_permute(num_experts, alignment, experts_TK, x_TD):
    plan = P.make_plan(experts_TK, num_experts, alignment)
    return plan, P.permute(x_TD, plan)


@given(case=permute_case())
def test_layout_matches_numpy(case, rng):
    t, e, k, alignment, skew = case
    experts = draw_experts(rng, t, e, k, skew)
    x = rng.standard_normal((t, 5)).astype(np.float32)
    plan, x_pd = _plan_and_permute(e, alignment, experts, x)
    buf_ref, sizes_ref, row_ref = numpy_buffer(x, experts, e, alignment)
    assert x_pd.shape == (P.buffer_rows(t * k, e, alignment), 5)
    np.testing.assert_array_equal(x_pd, buf_ref)  # padding rows exact zeros
    np.testing.assert_array_equal(plan.group_sizes_E, sizes_ref)
    np.testing.assert_array_equal(plan.row_of_copy_C, row_ref)
    counts = np.bincount(experts.ravel(), minlength=e)
    np.testing.assert_array_equal(plan.tokens_per_expert_E, counts)
    assert plan.group_sizes_E.dtype == jnp.int32
    assert np.all(np.asarray(plan.group_sizes_E) % alignment == 0)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _round_trip(num_experts, alignment, experts_TK, x_TD, w_TK):
    """(x permuted and combined back with weights 1/K, the buffer's rows tagged by
    1 + their index and combined with weights w)."""
    plan = P.make_plan(experts_TK, num_experts, alignment)
    x_PD = P.permute(x_TD, plan)
    back = P.unpermute(x_PD, jnp.full(w_TK.shape, 1.0 / w_TK.shape[1]), plan)
    tag_PD = x_PD * (1.0 + jnp.arange(x_PD.shape[0], dtype=jnp.float32))[:, None]
    return back, P.unpermute(tag_PD, w_TK, plan)


@given(case=permute_case())
def test_round_trip_and_weighted_combine(case, rng):
    t, e, k, alignment, skew = case
    experts = draw_experts(rng, t, e, k, skew)
    x = rng.standard_normal((t, 4)).astype(np.float32)
    w = rng.uniform(-1, 1, (t, k)).astype(np.float32)
    back, got = _round_trip(e, alignment, experts, x, w)
    # Uniform weights 1/K invert permute exactly (up to the float sum).
    np.testing.assert_allclose(back, x, rtol=1e-6, atol=1e-6)
    # A per-row tag shows which buffer row each copy reads back.
    row_ref = numpy_buffer(x, experts, e, alignment)[2]
    tagged_copies = x[:, None, :] * (1.0 + row_ref.reshape(t, k))[..., None]
    expected = np.einsum("tk,tkd->td", w, tagged_copies)
    got = np.asarray(got)
    # The float32 sum of K terms is off by at most ~K u sum|terms| (u = 6e-8), so bound the
    # error by the sum of absolute terms, not by |expected|: terms can cancel (a bound of
    # 1e-5 |expected| failed one draw in many). A wrong row changes a term by O(1) of itself.
    magnitude = np.einsum("tk,tkd->td", np.abs(w), np.abs(tagged_copies))
    assert np.all(np.abs(got - expected) <= 1e-5 * magnitude + 1e-30), np.max(
        np.abs(got - expected) / np.maximum(magnitude, 1e-30))


def _plain_permute(x_TD, plan):
    k = plan.row_of_copy_C.shape[0] // x_TD.shape[0]
    return x_TD.at[plan.copy_of_row_P // k].get(mode="fill", fill_value=0)


def _plain_unpermute(y_PD, w_TK, plan):
    t, k = w_TK.shape
    return jnp.einsum("tkd,tk->td", y_PD[plan.row_of_copy_C].reshape(t, k, -1), w_TK)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _vjps(num_experts, alignment, experts_TK, x_TD, w_TK, y_PD, dy_PD, dout_TD):
    """(ours, plain): the VJPs of permute (dx) and unpermute (dy, dw)."""
    plan = P.make_plan(experts_TK, num_experts, alignment)
    ours = (*jax.vjp(lambda x: P.permute(x, plan), x_TD)[1](dy_PD),
            *jax.vjp(lambda y, w: P.unpermute(y, w, plan), y_PD, w_TK)[1](dout_TD))
    plain = (*jax.vjp(lambda x: _plain_permute(x, plan), x_TD)[1](dy_PD),
             *jax.vjp(lambda y, w: _plain_unpermute(y, w, plan), y_PD, w_TK)[1](dout_TD))
    return ours, plain


@given(case=permute_case())
def test_custom_vjps_equal_autodiff_of_plain_gathers(case, rng):
    t, e, k, alignment, skew = case
    experts = draw_experts(rng, t, e, k, skew)
    rows = P.buffer_rows(t * k, e, alignment)
    x = rng.standard_normal((t, 3)).astype(np.float32)
    w = rng.standard_normal((t, k)).astype(np.float32)
    y = rng.standard_normal((rows, 3)).astype(np.float32)
    dy = rng.standard_normal(y.shape).astype(np.float32)
    dout = rng.standard_normal((t, 3)).astype(np.float32)
    ours, plain = _vjps(e, alignment, experts, x, w, y, dy, dout)
    for got, want in zip(ours, plain, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _primitives(jaxpr):
    """Names of all primitives in a jaxpr, nested calls included."""
    return set(jaxprs.primitive_counts(jaxpr))


@pytest.mark.parametrize("alignment", [1, 4])
def test_backward_uses_gathers_not_scatter_add(alignment, rng):
    """The point of the custom VJPs: the autodiff of the plain gathers scatter-adds."""
    t, e, k, d = 6, 4, 2, 3
    experts = jnp.asarray(draw_experts(rng, t, e, k, "distinct"))
    plan = P.make_plan(experts, e, alignment)
    x = jnp.ones((t, d))
    w = jnp.ones((t, k))

    def loss(x, w, permute, unpermute):
        return jnp.sum(unpermute(permute(x, plan) * 2.0, w, plan))

    ours = jax.make_jaxpr(jax.grad(lambda x, w: loss(x, w, P.permute, P.unpermute),
                                   argnums=(0, 1)))(x, w)
    plain = jax.make_jaxpr(jax.grad(lambda x, w: loss(x, w, _plain_permute, _plain_unpermute),
                                    argnums=(0, 1)))(x, w)
    assert "scatter-add" in _primitives(plain.jaxpr)  # the check can see a scatter-add
    assert "scatter-add" not in _primitives(ours.jaxpr)


def test_bf16_combine_accumulates_in_float32():
    """Each token's two copies are +1 and -1 (bf16) with weights 1 + j 2^-10 and 1 (float32).

    In float32 the combine is exact: (1 + j 2^-10) - 1 = j 2^-10, a bf16 number, so the
    result must equal it exactly. Rounding the weights or the products to bf16 (8 bits)
    turns 1 + j 2^-10 into 1 and the result into 0, whatever the order of the sum.
    """
    t, k = 4, 2
    experts = jnp.tile(jnp.arange(k, dtype=jnp.int32), (t, 1))
    plan = P.make_plan(experts, k)
    # Buffer: expert 0's copies (token order) then expert 1's.
    y = jnp.asarray(np.repeat([1.0, -1.0], t)[:, None] * np.ones((1, 2)), jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(plan.row_of_copy_C).reshape(t, k)[:, 1] // t, 1)
    j = np.arange(1, t + 1, dtype=np.float32)
    w = jnp.asarray(np.stack([1.0 + j * 2.0**-10, np.ones(t, np.float32)], axis=1))
    out = P.unpermute(y, w, plan)
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.float32(out), np.repeat((j * 2.0**-10)[:, None], 2, 1))


def test_bad_args_raise():
    with pytest.raises(ValueError, match="integer"):
        P.make_plan(jnp.zeros((4, 2), jnp.float32), 4)
    with pytest.raises(ValueError, match="2-D"):
        P.make_plan(jnp.zeros((8,), jnp.int32), 4)
    with pytest.raises(ValueError, match="alignment"):
        P.make_plan(jnp.zeros((4, 2), jnp.int32), 4, alignment=0)
    plan = P.make_plan(jnp.zeros((4, 2), jnp.int32), 4)
    with pytest.raises(ValueError, match="T dividing"):
        P.permute(jnp.zeros((3, 5)), plan)
    with pytest.raises(ValueError, match="copies"):
        P.unpermute(jnp.zeros((8, 5)), jnp.zeros((4, 3)), plan)
    with pytest.raises(ValueError, match="y_PD"):
        P.unpermute(jnp.zeros((9, 5)), jnp.zeros((4, 2)), plan)


def test_aligned_buffer_is_whole_blocks():
    """With alignment, P is the worst-case padding rounded up to whole blocks: the FP8
    kernels take it without padding it again (DeepSeek-V3's proxy: 8192 tokens x 8
    copies over 32 experts at 128 -> 69600 rounded to 69632)."""
    assert P.buffer_rows(65536, 32, 128) == 69632
    assert P.buffer_rows(65536, 32, 1) == 65536
    plan = P.make_plan(jnp.zeros((3, 2), jnp.int32), 4, alignment=8)
    assert plan.copy_of_row_P.shape == (40,)  # worst case 6 + 4 * 7 = 34, in blocks of 8
