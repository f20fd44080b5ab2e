"""The baseline backend: ``jax.lax.ragged_dot`` / ``ragged_dot_general``.

On GPU, XLA (jaxlib 0.11.2) expands ragged_dot into a masked dense product,
G times the necessary work; it is kept as the unoptimized baseline and as the
default on platforms without a dedicated kernel.
"""

import jax
import jax.numpy as jnp
from jax import lax

_TGMM_DIMS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([0], [0]), ([], [])),
    lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[],
)


def gmm(x, w, group_sizes, *, transpose_rhs=False, out_dtype=None):
    """x[M,K] @ w[g] per row group -> [M,N]; w is [G,N,K] if transpose_rhs."""
    out_dtype = out_dtype or x.dtype
    if transpose_rhs:
        w = jnp.swapaxes(w, 1, 2)
    y = lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def tgmm(x, dy, group_sizes, *, num_groups, out_dtype=None):
    """sum over rows of group g of x^T dy -> [G,K,N]; rows past the total ignored."""
    out_dtype = out_dtype or x.dtype
    del num_groups  # equal to group_sizes.shape[0]
    dw = lax.ragged_dot_general(
        x, dy, group_sizes, _TGMM_DIMS, preferred_element_type=jnp.float32
    )
    return dw.astype(out_dtype)
