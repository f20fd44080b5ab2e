"""Grouped matrix multiplication over ragged, contiguous row groups.

``gmm(x[M,K], w[G,K,N], group_sizes[G]) -> [M,N]`` and its weight-gradient
partner ``tgmm(x[M,K], dy[M,N], group_sizes[G]) -> [G,K,N]``, differentiable
through one ``jax.custom_vjp`` whose backward pass uses the same backend.
"""

from dropless.ops.gmm.api import BACKENDS, gmm, resolve_backend, tgmm

__all__ = ["BACKENDS", "gmm", "resolve_backend", "tgmm"]
