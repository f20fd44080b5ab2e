"""The ``mosaic`` gmm backend: Pallas Mosaic GPU kernels for Hopper (sm_90).

Forward and dgrad run ``mosaic_gmm.gmm`` (dgrad reads w[g] transposed
through smem); wgrad runs ``mosaic_tgmm.tgmm``. Tiles come from the
checked-in table in ``tuning.py``. ``resolve_backend("auto")`` asks
``is_available`` and ``supports`` before choosing this backend; calling it
directly with shapes it cannot take raises ValueError (never a wrong answer).

Shapes taken: bf16 or fp16 inputs; any M >= 1, any G >= 1, any group
sizes, any K and N. The kernels' tiles need K and N of w[G, K, N] to be
multiples of 128 (each of fwd, dgrad and wgrad then has a tile that divides
its columns and contraction); other K and N are zero-padded to the next
multiple here (copies of w and of the activations on every call, logged once
per shape: right, but slower than an aligned shape; zero columns add
nothing to a contraction and padded output columns are cut off). This keeps
``auto`` on the kernel for such shapes instead of falling back to XLA's
``ragged_dot``, which is 30x slower on Hopper. Mosaic's swizzled TMA views
tile the row dimension of x, dy and the output in 8s, so when M is not a
multiple of 8 the rows are padded to one likewise.
"""

import functools
import logging

import jax
import jax.numpy as jnp

from dropless.ops.gmm import mosaic_gmm, mosaic_tgmm, tuning

SUPPORTED_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ROW_ALIGN = 8
COL_ALIGN = 128
_log = logging.getLogger(__name__)


def _round_up(n, multiple=COL_ALIGN):
    return -(-n // multiple) * multiple


@functools.lru_cache(maxsize=None)
def _log_padding(k, n):
    _log.warning("mosaic gmm: K=%d, N=%d are not multiples of %d; w and the activations are "
                 "zero-padded to K=%d, N=%d on every call (correct, slower than aligned shapes)",
                 k, n, COL_ALIGN, _round_up(k), _round_up(n))


def _pad_last(a, to):
    """Zero-pad the last dimension of ``a`` to ``to``."""
    pad = to - a.shape[-1]
    return a if not pad else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, pad)])


def _pad_rows(*arrays):
    """Pad the rows of each [M, *] array to a multiple of ROW_ALIGN with zeros.

    The padded rows lie past sum(group_sizes) <= M, so the kernels treat them
    as tail rows (zero output rows, ignored by tgmm).
    """
    m = arrays[0].shape[0]
    pad = -m % ROW_ALIGN
    if not pad:
        return arrays
    return tuple(jnp.pad(a, ((0, pad), (0, 0))) for a in arrays)


def is_available():
    """True when the default device is a CUDA GPU of compute capability 9.x (Hopper)."""
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    if device.platform != "gpu":
        return False
    return str(getattr(device, "compute_capability", "")).startswith("9")


def _unsupported_reason(x_shape, w_shape, dtype):
    if len(x_shape) != 2 or len(w_shape) != 3:
        return f"x must be [M, K] and w [G, K, N], got {x_shape} and {w_shape}"
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
        return f"dtype {jnp.dtype(dtype).name} is not bfloat16 or float16"
    m = x_shape[0]
    g, k, n = w_shape
    if m < 1 or g < 1:
        return f"need M >= 1 and G >= 1, got M={m}, G={g}"
    return None


def supports(x_shape, w_shape, dtype):
    """True when all three kernels (fwd, dgrad, wgrad) take these shapes and dtype.

    ``w_shape`` is [G, K, N] with ``x_shape`` [M, K] (the forward layout).
    """
    return _unsupported_reason(tuple(x_shape), tuple(w_shape), dtype) is None


def _require(x_shape, w_shape, dtype):
    reason = _unsupported_reason(tuple(x_shape), tuple(w_shape), dtype)
    if reason is not None:
        raise ValueError(f"mosaic gmm backend cannot take this problem: {reason}")


def gmm(x, w, group_sizes, *, transpose_rhs=False, out_dtype=None, tiling=None):
    """x[M,K'] @ w[g] per row group -> [M, N']; w[G,K,N] read transposed if transpose_rhs.

    Raises:
      ValueError for shapes or dtypes the kernel cannot take.
    """
    if x.dtype != w.dtype:
        raise ValueError(f"mosaic gmm: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    g, k, n = w.shape
    _require((x.shape[0], k), w.shape, x.dtype)
    kp, np_ = _round_up(k), _round_up(n)
    if (kp, np_) != (k, n):
        _log_padding(k, n)
        w = _pad_last(jnp.pad(w, ((0, 0), (0, kp - k), (0, 0))), np_)
        x = _pad_last(x, np_ if transpose_rhs else kp)
        y = gmm(x, w, group_sizes, transpose_rhs=transpose_rhs, out_dtype=out_dtype,
                tiling=tiling)
        return y[:, :k] if transpose_rhs else y[:, :n]
    kind = "dgrad" if transpose_rhs else "fwd"
    tiling = tiling or tuning.lookup(kind, x.dtype, k, n)
    (x_padded,) = _pad_rows(x)
    y = mosaic_gmm.gmm(
        x_padded, w, group_sizes, tiling=tiling, transpose_rhs=transpose_rhs, out_dtype=out_dtype
    )
    return y if x_padded is x else y[: x.shape[0]]


def tgmm(x, dy, group_sizes, *, num_groups, out_dtype=None, tiling=None, tile_order="sorted_snake"):
    """dw[g] = x[rows of g]^T @ dy[rows of g] -> [G, K, N]; zeros for empty groups.

    ``tile_order``: which SM computes which output tile (``mosaic_tgmm.tgmm``);
    the result is the same bit for bit.

    Raises:
      ValueError for shapes or dtypes the kernel cannot take, or an unknown tile_order.
    """
    if x.dtype != dy.dtype:
        raise ValueError(f"mosaic tgmm: x and dy must share a dtype, got {x.dtype} and {dy.dtype}")
    if x.ndim != 2 or dy.ndim != 2:
        raise ValueError(f"mosaic tgmm: x and dy must be 2-D, got {x.shape} and {dy.shape}")
    k, n = x.shape[1], dy.shape[1]
    _require(x.shape, (num_groups, k, n), x.dtype)
    kp, np_ = _round_up(k), _round_up(n)
    if (kp, np_) != (k, n):
        _log_padding(k, n)
        dw = tgmm(_pad_last(x, kp), _pad_last(dy, np_), group_sizes, num_groups=num_groups,
                  out_dtype=out_dtype, tiling=tiling, tile_order=tile_order)
        return dw[:, :k, :n]
    tiling = tiling or tuning.lookup("wgrad", x.dtype, k, n)
    x, dy = _pad_rows(x, dy)
    return mosaic_tgmm.tgmm(
        x, dy, group_sizes, num_groups=num_groups, tiling=tiling, out_dtype=out_dtype,
        tile_order=tile_order,
    )
