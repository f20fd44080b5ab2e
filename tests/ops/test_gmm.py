"""gmm/tgmm: every backend against a dense per-group NumPy reference.

Legend: M rows, K contraction, N output features, G groups.

The reference slices the rows of each group and multiplies them by that
group's matrix in float64; its gradients are written out by hand (dx rows of
group g = dy rows @ w[g]^T, dw[g] = x rows^T @ dy rows). Rows past
``sum(group_sizes)`` of x and of the cotangent are poisoned with NaN: they
must not leak into any result, and the output rows there must be exact zeros.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dropless.ops.gmm import gmm, tgmm
from dropless.ops.gmm import reference as reference_backend
from dropless.ops.gmm import xla as xla_backend

BACKENDS = ["reference", "xla"]
# (M, K, N, G): M is deliberately not a multiple of G or of any tile.
SHAPES = [(24, 8, 12, 4), (37, 5, 3, 7)]


@st.composite
def group_sizes_st(draw, m, g):
    """Group sizes with sum <= m: zeros, one full group and short totals all reachable."""
    kind = draw(st.sampled_from(["random", "one_group", "short"]))
    if kind == "one_group":
        sizes = [0] * g
        sizes[draw(st.integers(0, g - 1))] = m
        return np.array(sizes, np.int32)
    total = m if kind == "random" else draw(st.integers(0, m - 1))
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=g - 1, max_size=g - 1)))
    return np.diff([0, *cuts, total]).astype(np.int32)


def dense_gmm(x, w, sizes):
    """float64 per-group slices; rows past the total stay zero."""
    y = np.zeros((x.shape[0], w.shape[2]))
    start = 0
    for g, size in enumerate(sizes):
        y[start:start + size] = x[start:start + size].astype(np.float64) @ w[g]
        start += size
    return y


def dense_grads(x, w, dy, sizes):
    """Hand-derived (dx, dw) of sum(gmm(x, w) * dy)."""
    dx = np.zeros(x.shape)
    dw = np.zeros(w.shape)
    start = 0
    for g, size in enumerate(sizes):
        rows = slice(start, start + size)
        dx[rows] = dy[rows].astype(np.float64) @ w[g].T.astype(np.float64)
        dw[g] = x[rows].T.astype(np.float64) @ dy[rows]
        start += size
    return dx, dw


def poisoned(a, sizes):
    """Copy of a with rows past sum(sizes) set to NaN."""
    a = np.array(a, np.float32)
    a[int(np.sum(sizes)):] = np.nan
    return a


def random_problem(rng, m, k, n, g, sizes):
    x = poisoned(rng.standard_normal((m, k)), sizes)
    w = rng.standard_normal((g, k, n)).astype(np.float32)
    dy = poisoned(rng.standard_normal((m, n)), sizes)
    return x, w, dy


@functools.partial(jax.jit, static_argnames="backend")
def _value_and_grads(x, w, group_sizes, dy, backend):
    y, vjp = jax.vjp(lambda x, w: gmm(x, w, group_sizes, backend=backend), x, w)
    return (y, *vjp(dy))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@given(data=st.data())
def test_gmm_forward_and_grads_match_dense(backend, shape, data, rng):
    m, k, n, g = shape
    sizes = data.draw(group_sizes_st(m, g))
    x, w, dy = random_problem(rng, m, k, n, g, sizes)
    y, dx, dw = _value_and_grads(x, w, jnp.asarray(sizes), dy, backend)
    x0, dy0 = np.nan_to_num(x), np.nan_to_num(dy)
    dx_ref, dw_ref = dense_grads(x0, w, dy0, sizes)
    # Every row is compared, so rows past the total must come out as exact zeros.
    np.testing.assert_allclose(y, dense_gmm(x0, w, sizes), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    total = int(sizes.sum())
    assert not np.any(y[total:]) and not np.any(dx[total:])


def test_grad_of_scalar_loss_through_api(rng):
    """jax.grad of a scalar loss equals the hand-derived dense gradient."""
    m, k, n, g = 19, 6, 5, 4
    sizes = np.array([7, 0, 9, 2], np.int32)  # sum 18 < M
    x, w, c = random_problem(rng, m, k, n, g, sizes)
    x = np.nan_to_num(x)
    c = np.nan_to_num(c)

    def loss(x, w):
        return jnp.sum(gmm(x, w, jnp.asarray(sizes), backend="auto") * c)

    dx, dw = jax.grad(loss, argnums=(0, 1))(x, w)
    dx_ref, dw_ref = dense_grads(x, w, c, sizes)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dw[1], 0.0)  # empty group: exact zero gradient


@pytest.mark.parametrize("backend", BACKENDS)
@given(data=st.data())
def test_tgmm_matches_dense(backend, data, rng):
    m, k, n, g = 30, 4, 6, 5
    sizes = data.draw(group_sizes_st(m, g))
    x, _, dy = random_problem(rng, m, k, n, g, sizes)
    dw = tgmm(x, dy, jnp.asarray(sizes), backend=backend)
    _, dw_ref = dense_grads(np.nan_to_num(x), np.zeros((g, k, n)), np.nan_to_num(dy), sizes)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5)
    for e in np.flatnonzero(sizes == 0):
        np.testing.assert_array_equal(dw[e], 0.0)


@pytest.mark.parametrize("out_dtype", [None, jnp.float32])
def test_xla_bf16_close_to_reference(rng, out_dtype):
    """bf16 inputs: xla against the float64 product of the same bf16 numbers.

    Both products are exact in float64 (8-bit mantissas), so the only errors are the
    float32 accumulation, |err| <= K u32 sum_k |x_k w_k| (u32 = 2^-24; K terms), and,
    for a bf16 output, one rounding to bf16: half an ulp, <= 2^-8 |y| (normal y).
    Accumulating in bf16 instead misses this bound by orders of magnitude.
    """
    m, k, n, g = 64, 32, 16, 4
    sizes = np.array([10, 30, 0, 20], np.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((g, k, n)), jnp.bfloat16)
    y_xla = gmm(x, w, jnp.asarray(sizes), backend="xla", out_dtype=out_dtype)
    assert y_xla.dtype == (out_dtype or jnp.bfloat16)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    y_ref = dense_gmm(x64, w64, sizes)
    bound = k * 2.0**-24 * dense_gmm(np.abs(x64), np.abs(w64), sizes)
    if out_dtype is None:
        bound = bound * (1 + 2.0**-8) + 2.0**-8 * np.abs(y_ref)
    err = np.abs(np.asarray(y_xla, np.float64) - y_ref)
    assert np.all(err <= bound), np.max(err - bound)
    np.testing.assert_array_equal(np.float32(y_xla[60:]), 0.0)


@pytest.mark.parametrize("module", [reference_backend, xla_backend], ids=["reference", "xla"])
def test_backend_transpose_rhs(module, rng):
    """Backends' dgrad form: x @ w[g]^T when w is stored [G, N, K]."""
    sizes = np.array([3, 0, 5], np.int32)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    w_gnk = rng.standard_normal((3, 6, 4)).astype(np.float32)
    y = module.gmm(x, w_gnk, jnp.asarray(sizes), transpose_rhs=True)
    y_ref = dense_gmm(x, w_gnk.transpose(0, 2, 1), sizes)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def test_gmm_inside_jit_and_scan(rng):
    """No host sync or data-dependent shape: group sizes can be scan carries."""
    x = jnp.asarray(rng.standard_normal((12, 4)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((3, 4, 4)), jnp.float32)
    sizes_steps = jnp.array([[4, 4, 4], [0, 12, 0], [1, 2, 3]], jnp.int32)

    @jax.jit
    def run(x):
        def step(h, sizes):
            return gmm(h, w, sizes, backend="xla") / 4.0, None
        return jax.lax.scan(step, x, sizes_steps)[0]

    h = np.asarray(x, np.float64)
    for sizes in np.asarray(sizes_steps):
        h = dense_gmm(h, np.asarray(w), sizes) / 4.0
    np.testing.assert_allclose(run(x), h, rtol=1e-5, atol=1e-5)


def _trace(fn, *args):
    return jax.eval_shape(fn, *args)


@pytest.mark.parametrize(
    "x_shape, w_shape, sizes, match",
    [
        ((8, 4), (2, 5, 3), jnp.zeros((2,), jnp.int32), "contraction"),
        ((8, 4), (2, 4, 3), jnp.zeros((3,), jnp.int32), "group_sizes must have shape"),
        ((8, 4), (2, 4, 3), jnp.zeros((2,), jnp.float32), "int32"),
        ((8, 4), (2, 4, 3), jnp.zeros((2,), jnp.int16), "int32"),
        ((8, 4, 1), (2, 4, 3), jnp.zeros((2,), jnp.int32), r"\[M, K\]"),
        ((8, 4), (4, 3), jnp.zeros((2,), jnp.int32), r"\[G, K, N\]"),
    ],
)
def test_gmm_bad_args_raise_at_trace_time(x_shape, w_shape, sizes, match):
    x = jax.ShapeDtypeStruct(x_shape, jnp.float32)
    w = jax.ShapeDtypeStruct(w_shape, jnp.float32)
    with pytest.raises(ValueError, match=match):
        _trace(lambda x, w, s: gmm(x, w, s, backend="xla"), x, w, sizes)


def test_gmm_dtype_mismatch_and_bad_backend():
    x = jnp.zeros((4, 2), jnp.bfloat16)
    w = jnp.zeros((1, 2, 2), jnp.float32)
    sizes = jnp.array([4], jnp.int32)
    with pytest.raises(ValueError, match="dtype"):
        gmm(x, w, sizes)
    with pytest.raises(ValueError, match="backend"):
        gmm(x.astype(jnp.float32), w, sizes, backend="cutlass")


def test_tgmm_bad_args():
    x = jnp.zeros((4, 2), jnp.float32)
    with pytest.raises(ValueError, match="share M"):
        tgmm(x, jnp.zeros((5, 3), jnp.float32), jnp.array([4], jnp.int32))
    with pytest.raises(ValueError, match="int32"):
        tgmm(x, jnp.zeros((4, 3), jnp.float32), jnp.array([4.0]))
