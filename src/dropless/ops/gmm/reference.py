"""Exact per-group reference for gmm/tgmm: slow and obviously correct.

Each group is computed as a masked dense product in float32 at HIGHEST
precision, so this backend is the yardstick every fast path is tested against.
Cost is G dense products, fine for tests, useless for training.
"""

import jax
import jax.numpy as jnp


def _row_group_masks(group_sizes, m):
    """[G, M] bool: row r belongs to group g (rows past the total belong to none)."""
    ends = jnp.cumsum(group_sizes)
    starts = ends - group_sizes
    rows = jnp.arange(m, dtype=group_sizes.dtype)
    return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


def gmm(x, w, group_sizes, *, transpose_rhs=False, out_dtype=None):
    """x[M,K] @ w[g] per row group -> [M,N]; w is [G,N,K] if transpose_rhs."""
    out_dtype = out_dtype or x.dtype
    masks = _row_group_masks(group_sizes, x.shape[0])
    w32 = w.astype(jnp.float32)
    if transpose_rhs:
        w32 = jnp.swapaxes(w32, 1, 2)
    x32 = x.astype(jnp.float32)

    def one_group(acc, mw):
        mask, wg = mw
        y = jnp.dot(x32, wg, precision=jax.lax.Precision.HIGHEST)
        return acc + jnp.where(mask[:, None], y, 0.0), None

    init = jnp.zeros((x.shape[0], w32.shape[2]), jnp.float32)
    out, _ = jax.lax.scan(one_group, init, (masks, w32))
    return out.astype(out_dtype)


def tgmm(x, dy, group_sizes, *, num_groups, out_dtype=None):
    """sum over rows r of group g of x[r]^T dy[r] -> [G,K,N]."""
    out_dtype = out_dtype or x.dtype
    masks = _row_group_masks(group_sizes, x.shape[0])[:num_groups]
    x32 = x.astype(jnp.float32)
    dy32 = dy.astype(jnp.float32)

    def one_group(mask):
        # Mask both operands: 0 * NaN is NaN, and rows outside the group (e.g.
        # past the total) may hold anything.
        xm = jnp.where(mask[:, None], x32, 0.0)
        dym = jnp.where(mask[:, None], dy32, 0.0)
        return jnp.dot(xm.T, dym, precision=jax.lax.Precision.HIGHEST)

    return jax.lax.map(one_group, masks).astype(out_dtype)
