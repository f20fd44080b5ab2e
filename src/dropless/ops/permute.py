"""Sort token copies by expert and back: the local half of MoE dispatch/combine.

Legend: T tokens, K experts per token, C = T*K token copies (copy ``c = t*K +
j`` is token t's j-th choice), E experts, D features, P rows of the permuted
buffer (P = C, or C + E*(alignment-1) rounded up to a multiple of the
alignment).

``make_plan`` turns the router's ``experts_TK`` into index maps; ``permute``
gathers token rows into an expert-sorted buffer ``x_PD`` whose rows of expert
e are contiguous and in expert order (the layout ``gmm`` expects), and
``unpermute`` gathers them back and sums each token's K copies weighted by
the router. All shapes are static: no host sync, safe under jit/scan/shard_map.

Sorting is a stable argsort of the expert ids, so copies of one expert stay
in token order and the result is deterministic.

With ``alignment > 1`` each expert's row count is rounded up to a multiple of
``alignment`` (for kernels that quantize per block of rows); the padding rows
are zeros, and ``unpermute`` never reads them, so they never reach an output.

Both maps are bijections between copies and real buffer rows, so the
transpose of each gather is a gather by the inverse map. The custom VJPs
below use that instead of the scatter-add autodiff would emit.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class PermutePlan(NamedTuple):
    """Index maps between token copies and rows of the expert-sorted buffer.

    row_of_copy_C: [C] int32, buffer row holding copy c; a row >= P marks a
      copy left out of the buffer (it reads as zeros and gets no gradient).
    copy_of_row_P: [P] int32, copy held by buffer row p; C marks a padding row.
    group_sizes_E: [E] int32 rows per expert in the buffer (padded counts when
      aligned); rows past their sum are zeros.
    tokens_per_expert_E: [E] int32 real copies per expert (unpadded).
    """

    row_of_copy_C: jax.Array
    copy_of_row_P: jax.Array
    group_sizes_E: jax.Array
    tokens_per_expert_E: jax.Array


def buffer_rows(num_copies, num_experts, alignment=1):
    """Static size P of the permuted buffer: the worst case of the padding, rounded up
    to a multiple of ``alignment`` (so a kernel that works in blocks of that many rows,
    as the FP8 kernels do in 128, takes the buffer without padding it again)."""
    worst = num_copies + num_experts * (alignment - 1)
    return -(-worst // alignment) * alignment


def make_plan(experts_TK, num_experts, alignment=1):
    """Index maps that sort the token copies of ``experts_TK`` by expert.

    Args:
      experts_TK: [T, K] integer expert ids in [0, E).
      num_experts: E (static).
      alignment: round each expert's rows up to a multiple of this (static).

    Returns:
      ``PermutePlan`` (see its docstring); P = ``buffer_rows(T*K, E, alignment)``.

    Raises:
      ValueError: ``experts_TK`` not 2-D or not integer; alignment < 1.
    """
    if experts_TK.ndim != 2 or not jnp.issubdtype(experts_TK.dtype, jnp.integer):
        raise ValueError(f"experts_TK must be a 2-D integer array, got {experts_TK.shape} "
                         f"{experts_TK.dtype}")
    if alignment < 1:
        raise ValueError(f"{alignment=} must be >= 1")
    experts_C = experts_TK.reshape(-1).astype(jnp.int32)
    c = experts_C.shape[0]
    p = buffer_rows(c, num_experts, alignment)
    counts_E = jnp.bincount(experts_C, length=num_experts).astype(jnp.int32)
    sorted_copy_C = jnp.argsort(experts_C, stable=True).astype(jnp.int32)
    iota_C = jnp.arange(c, dtype=jnp.int32)
    if alignment == 1:
        group_sizes_E = counts_E
        row_of_sorted_C = iota_C
    else:
        group_sizes_E = (counts_E + alignment - 1) // alignment * alignment
        # The j-th sorted copy (expert e) moves from row j to j - start_e + padded_start_e.
        shift_E = jnp.cumsum(group_sizes_E) - jnp.cumsum(counts_E) - (group_sizes_E - counts_E)
        row_of_sorted_C = iota_C + shift_E[experts_C[sorted_copy_C]]
    # Integer index scatters of size C/P: cheap next to the [*, D] data moves.
    row_of_copy_C = jnp.zeros((c,), jnp.int32).at[sorted_copy_C].set(
        row_of_sorted_C, unique_indices=True
    )
    copy_of_row_P = jnp.full((p,), c, jnp.int32).at[row_of_sorted_C].set(
        sorted_copy_C, unique_indices=True
    )
    return PermutePlan(row_of_copy_C, copy_of_row_P, group_sizes_E, counts_E)


def _gather_rows(x_ND, idx_M):
    """x_ND[idx_M] with out-of-range indices giving zero rows."""
    return x_ND.at[idx_M].get(mode="fill", fill_value=0, unique_indices=False)


# ----------------------------------------------------------------------------
# permute: x_TD -> x_PD, row p holds token copy_of_row_P[p] // K.


@jax.custom_vjp
def _permute(x_TD, row_of_copy_C, copy_of_row_P):
    k = row_of_copy_C.shape[0] // x_TD.shape[0]
    # Padding rows hold copy C, whose token index T is out of range -> zeros.
    return _gather_rows(x_TD, copy_of_row_P // k)


def _permute_fwd(x_TD, row_of_copy_C, copy_of_row_P):
    return _permute(x_TD, row_of_copy_C, copy_of_row_P), (row_of_copy_C, x_TD.shape[0])


def _permute_bwd(res, dx_PD):
    row_of_copy_C, t = res
    k = row_of_copy_C.shape[0] // t
    # Each token's K copies sit in K distinct rows: gather them and sum.
    dx_TKD = _gather_rows(dx_PD, row_of_copy_C).reshape(t, k, dx_PD.shape[-1])
    dx_TD = dx_TKD.sum(axis=1, dtype=jnp.float32).astype(dx_PD.dtype)
    return dx_TD, None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def permute(x_TD, plan):
    """Expert-sorted copies of the token rows.

    Args:
      x_TD: [T, D] tokens, any dtype.
      plan: from ``make_plan`` for these T tokens.

    Returns:
      x_PD: [P, D], same dtype; rows of expert e contiguous in expert order,
      padding rows and rows past ``sum(plan.group_sizes_E)`` are zeros.

    Raises:
      ValueError: T does not divide the plan's copy count.
    """
    c = plan.row_of_copy_C.shape[0]
    if x_TD.ndim != 2 or c % x_TD.shape[0]:
        raise ValueError(f"x_TD must be [T, D] with T dividing {c} copies, got {x_TD.shape}")
    return _permute(x_TD, plan.row_of_copy_C, plan.copy_of_row_P)


# ----------------------------------------------------------------------------
# unpermute: y_PD, weights_TK -> out_TD = sum_j weights[t, j] * y[row_of_copy[t*K + j]].


def _weighted_sum(y_TKD, weights_TK, out_dtype):
    out_TD = jnp.einsum(
        "tkd,tk->td", y_TKD, weights_TK, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    )
    return out_TD.astype(out_dtype)


@jax.custom_vjp
def _unpermute(y_PD, weights_TK, row_of_copy_C, copy_of_row_P):
    t, k = weights_TK.shape
    y_TKD = _gather_rows(y_PD, row_of_copy_C).reshape(t, k, y_PD.shape[-1])
    return _weighted_sum(y_TKD, weights_TK.astype(jnp.float32), y_PD.dtype)


def _unpermute_fwd(y_PD, weights_TK, row_of_copy_C, copy_of_row_P):
    out = _unpermute(y_PD, weights_TK, row_of_copy_C, copy_of_row_P)
    # Keep the buffer, not its [T, K, D] gather: the backward gathers again.
    return out, (y_PD, weights_TK, row_of_copy_C, copy_of_row_P)


def _unpermute_bwd(res, dout_TD):
    y_PD, weights_TK, row_of_copy_C, copy_of_row_P = res
    t, k = weights_TK.shape
    d = y_PD.shape[-1]
    y_TKD = _gather_rows(y_PD, row_of_copy_C).reshape(t, k, d)
    dout32_TD = dout_TD.astype(jnp.float32)
    dweights_TK = jnp.einsum(
        "tkd,td->tk", y_TKD, dout32_TD, preferred_element_type=jnp.float32,
        precision=jax.lax.Precision.HIGHEST,
    ).astype(weights_TK.dtype)
    dy_CD = (weights_TK.astype(jnp.float32)[:, :, None] * dout32_TD[:, None, :]).reshape(t * k, d)
    # Transpose of the gather by row_of_copy is the gather by its inverse;
    # padding rows (copy index C) get zero gradient.
    dy_PD = _gather_rows(dy_CD.astype(y_PD.dtype), copy_of_row_P)
    return dy_PD, dweights_TK, None, None


_unpermute.defvjp(_unpermute_fwd, _unpermute_bwd)


def unpermute(y_PD, weights_TK, plan):
    """Inverse of ``permute`` with the weighted combine of each token's K copies.

    Args:
      y_PD: [P, D] expert outputs in the buffer layout of ``plan``.
      weights_TK: [T, K] combine weights (float32 from the router).
      plan: the ``PermutePlan`` used for ``permute``.

    Returns:
      out_TD: [T, D] in y_PD's dtype, ``sum_j weights_TK[t, j] * y(copy t*K+j)``,
      accumulated in float32. Differentiable in y_PD and weights_TK.

    Raises:
      ValueError: shapes inconsistent with the plan.
    """
    c = plan.row_of_copy_C.shape[0]
    if weights_TK.ndim != 2 or weights_TK.shape[0] * weights_TK.shape[1] != c:
        raise ValueError(f"weights_TK {weights_TK.shape} does not hold the plan's {c} copies")
    if y_PD.ndim != 2 or y_PD.shape[0] != plan.copy_of_row_P.shape[0]:
        raise ValueError(f"y_PD must be [{plan.copy_of_row_P.shape[0]}, D], got {y_PD.shape}")
    return _unpermute(y_PD, weights_TK, plan.row_of_copy_C, plan.copy_of_row_P)
