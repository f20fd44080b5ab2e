"""Public grouped-matmul API: validation, backend choice and the custom VJP.

Legend: M rows (token copies sorted by group), K contraction, N output
features, G groups (experts). Rows of group g are contiguous and groups come
in order; rows past ``sum(group_sizes)`` produce zeros.

Backends share one interface (see ``reference.py``)::

    gmm(x, w, group_sizes, *, transpose_rhs, out_dtype) -> [M, N]
    tgmm(x, dy, group_sizes, *, num_groups, out_dtype) -> [G, K, N]

The VJP of ``y = gmm(x, w)`` is ``dx = gmm(dy, w, transpose_rhs=True)`` (dgrad,
no transposed copy of w) and ``dw = tgmm(x, dy)`` (wgrad), both through the
same backend, so a fast kernel speeds up all three products of a layer.
"""

import functools
import importlib

import jax
import jax.numpy as jnp

BACKENDS = ("reference", "xla", "mosaic", "auto")


def _backend_module(name):
    return importlib.import_module(f"dropless.ops.gmm.{name}")


def resolve_backend(backend, x_shape=None, w_shape=None, dtype=None):
    """Map ``backend`` (one of BACKENDS) to a concrete backend name.

    ``auto`` picks ``mosaic`` on a Hopper GPU when the shapes are ones the
    kernel takes, else ``xla``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"gmm backend={backend!r} is not one of {BACKENDS}")
    if backend != "auto":
        return backend
    try:
        mosaic = _backend_module("mosaic")
    except ImportError:
        return "xla"
    if mosaic.is_available() and (x_shape is None or mosaic.supports(x_shape, w_shape, dtype)):
        return "mosaic"
    return "xla"


def _check_gmm_args(x, w, group_sizes, transpose_rhs):
    if x.ndim != 2:
        raise ValueError(f"gmm: x must be [M, K], got shape {x.shape}")
    if w.ndim != 3:
        raise ValueError(f"gmm: w must be [G, K, N], got shape {w.shape}")
    k_w = w.shape[2] if transpose_rhs else w.shape[1]
    if x.shape[1] != k_w:
        raise ValueError(
            f"gmm: contraction sizes differ: x is {x.shape} (K={x.shape[1]}) but "
            f"w is {w.shape} (K={k_w}{', transposed' if transpose_rhs else ''})"
        )
    _check_group_sizes(group_sizes, w.shape[0])
    if x.dtype != w.dtype:
        raise ValueError(f"gmm: x and w must share a dtype, got {x.dtype} and {w.dtype}")


def _check_group_sizes(group_sizes, num_groups):
    if group_sizes.shape != (num_groups,):
        raise ValueError(
            f"gmm: group_sizes must have shape ({num_groups},) (one per group), "
            f"got {group_sizes.shape}"
        )
    if group_sizes.dtype != jnp.int32:
        raise ValueError(f"gmm: group_sizes must be int32, got {group_sizes.dtype}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _gmm(x, w, group_sizes, backend, out_dtype):
    return _backend_module(backend).gmm(
        x, w, group_sizes, transpose_rhs=False, out_dtype=out_dtype
    )


def _gmm_fwd(x, w, group_sizes, backend, out_dtype):
    y = _gmm(x, w, group_sizes, backend, out_dtype)
    return y, (x, w, group_sizes)


def _gmm_bwd(backend, out_dtype, res, dy):
    x, w, group_sizes = res
    impl = _backend_module(backend)
    dy = dy.astype(x.dtype)
    dx = impl.gmm(dy, w, group_sizes, transpose_rhs=True, out_dtype=x.dtype)
    dw = impl.tgmm(x, dy, group_sizes, num_groups=w.shape[0], out_dtype=w.dtype)
    # group_sizes is integer: its cotangent is float0 zeros.
    dgs = jnp.zeros(group_sizes.shape, jax.dtypes.float0)
    return dx, dw, dgs


_gmm.defvjp(_gmm_fwd, _gmm_bwd)


def gmm(x, w, group_sizes, *, backend="auto", out_dtype=None):
    """Grouped matmul: rows of group g of ``x`` times ``w[g]``.

    Args:
      x: [M, K] rows sorted by group, contiguous, groups in order.
      w: [G, K, N] one weight matrix per group, same dtype as x.
      group_sizes: [G] int32 rows per group; ``sum <= M`` (rows past it -> 0).
      backend: one of ``BACKENDS``.
      out_dtype: output dtype (default: x.dtype). Accumulation is float32.

    Returns:
      [M, N] in ``out_dtype``. Differentiable in x and w.

    Raises:
      ValueError at trace time for bad ranks, K mismatch, dtype mismatch, or
      group_sizes of the wrong length or dtype.
    """
    _check_gmm_args(x, w, group_sizes, transpose_rhs=False)
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    name = resolve_backend(backend, x.shape, w.shape, x.dtype)
    return _gmm(x, w, group_sizes, name, out_dtype)


def tgmm(x, dy, group_sizes, *, num_groups=None, backend="auto", out_dtype=None):
    """Weight gradient of gmm: ``dw[g] = x[rows of g]^T @ dy[rows of g]``.

    Args:
      x: [M, K]; dy: [M, N], same dtype, rows grouped as in ``gmm``.
      group_sizes: [G] int32. Empty groups give zero matrices.
      num_groups: G (default: len(group_sizes)).

    Returns:
      [G, K, N] in ``out_dtype`` (default: x.dtype), accumulated in float32.
    """
    if x.ndim != 2 or dy.ndim != 2 or x.shape[0] != dy.shape[0]:
        raise ValueError(f"tgmm: x [M,K] and dy [M,N] must share M, got {x.shape} and {dy.shape}")
    if x.dtype != dy.dtype:
        raise ValueError(f"tgmm: x and dy must share a dtype, got {x.dtype} and {dy.dtype}")
    num_groups = num_groups or group_sizes.shape[0]
    _check_group_sizes(group_sizes, num_groups)
    name = resolve_backend(backend, x.shape, (num_groups, x.shape[1], dy.shape[1]), x.dtype)
    return _backend_module(name).tgmm(
        x, dy, group_sizes, num_groups=num_groups, out_dtype=jnp.dtype(out_dtype or x.dtype)
    )
