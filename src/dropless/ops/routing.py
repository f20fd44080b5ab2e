"""Router math for Mixture-of-Experts: scores, top-k selection, balancing, aux losses.

Pure JAX on arrays and static Python numbers; every function computes in
float32 whatever the input dtype, because small differences in router logits
change which expert a token goes to.

Legend: T tokens, E experts, K experts per token (top-k), B batch, S sequence
(T = B*S where a function needs the sequence structure).

Two routing families:

- **softmax** (Mixtral, Qwen): probabilities = softmax(logits); the top-k
  probabilities are the weights, optionally renormalised to sum to 1.
- **sigmoid** (DeepSeek-V3): scores = sigmoid(logits). An expert bias (the
  aux-loss-free balancing state) is added to the scores to *select* experts,
  but the weights are the *unbiased* scores of the selected experts, normalised
  and multiplied by ``routed_scaling_factor``.

Either family can be group-limited: experts are split into ``n_groups`` equal
groups, each group is scored by the sum of its top-2 selection scores, and
only the ``topk_groups`` best groups stay eligible (DeepSeek-V3 uses this to
bound how many nodes a token is sent to).
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

SCORE_FUNCS = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """The router's decision for T tokens.

    weights_TK: [T, K] float32 combine weights (differentiable in the logits).
    experts_TK: [T, K] int32 chosen expert ids, distinct within a row.
    scores_TE: [T, E] float32 unbiased scores (softmax probs or sigmoids),
      the input of the auxiliary losses.
    """

    weights_TK: jax.Array
    experts_TK: jax.Array
    scores_TE: jax.Array


def check_routing_args(num_experts, k, n_groups=-1, topk_groups=-1):
    """Raise ValueError for a routing configuration that cannot work.

    Raises:
      ValueError: ``k`` outside [1, num_experts]; ``n_groups`` not dividing
        ``num_experts``; ``topk_groups`` outside [1, n_groups]; or fewer
        eligible experts (topk_groups * group size) than ``k``.
    """
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k {k=} must be in [1, {num_experts=}]")
    if n_groups in (-1, 0, 1) and topk_groups in (-1, 0):
        return
    if n_groups <= 0 or num_experts % n_groups:
        raise ValueError(f"{n_groups=} must be a positive divisor of {num_experts=}")
    if not 1 <= topk_groups <= n_groups:
        raise ValueError(f"{topk_groups=} must be in [1, {n_groups=}]")
    if topk_groups * (num_experts // n_groups) < k:
        raise ValueError(
            f"{topk_groups=} groups of {num_experts // n_groups} experts hold fewer than {k=}"
        )


def scores(logits_TE, score_func):
    """float32 router scores: softmax probabilities or elementwise sigmoids.

    Raises:
      ValueError: unknown ``score_func``.
    """
    logits_TE = logits_TE.astype(jnp.float32)
    if score_func == "softmax":
        return jax.nn.softmax(logits_TE, axis=-1)
    if score_func == "sigmoid":
        return jax.nn.sigmoid(logits_TE)
    raise ValueError(f"{score_func=} is not one of {SCORE_FUNCS}")


def group_limited_mask(selection_TE, n_groups, topk_groups):
    """[T, E] bool: expert lies in one of the token's ``topk_groups`` best groups.

    A group's score is the sum of its top-2 selection scores (its top-1 when a
    group holds a single expert). Ties between groups go to the lower index.
    """
    t, e = selection_TE.shape
    per_group = e // n_groups
    sel_TGX = selection_TE.reshape(t, n_groups, per_group)
    top2_TGX, _ = jax.lax.top_k(sel_TGX, min(2, per_group))
    group_score_TG = top2_TGX.sum(axis=-1)
    _, best_groups_TK = jax.lax.top_k(group_score_TG, topk_groups)
    keep_TG = jnp.zeros((t, n_groups), bool).at[
        jnp.arange(t)[:, None], best_groups_TK
    ].set(True)
    return jnp.repeat(keep_TG, per_group, axis=1)


def route(
    logits_TE,
    *,
    k,
    score_func="softmax",
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    bias_E=None,
    n_groups=-1,
    topk_groups=-1,
):
    """Pick ``k`` experts per token and their combine weights.

    Args:
      logits_TE: [T, E] router logits, any float dtype (math is float32).
      k: experts per token.
      score_func: "softmax" or "sigmoid".
      norm_topk_prob: renormalise the k chosen weights to sum to 1.
      routed_scaling_factor: multiplies the final weights.
      bias_E: optional [E] selection bias (aux-loss-free balancing); it changes
        which experts are chosen, never the weights. No gradient flows into it.
      n_groups, topk_groups: group-limited routing; -1 turns it off.

    Returns:
      ``Routing(weights_TK float32, experts_TK int32, scores_TE float32)``.
      Ties between experts go to the lower index (``lax.top_k``).

    Raises:
      ValueError: see ``check_routing_args``; ``bias_E`` not of shape [E].
    """
    num_experts = logits_TE.shape[-1]
    check_routing_args(num_experts, k, n_groups, topk_groups)
    scores_TE = scores(logits_TE, score_func)
    selection_TE = scores_TE
    if bias_E is not None:
        if bias_E.shape != (num_experts,):
            raise ValueError(f"bias_E must have shape ({num_experts},), got {bias_E.shape}")
        selection_TE = selection_TE + jax.lax.stop_gradient(bias_E.astype(jnp.float32))
    # Selection is piecewise constant: no gradient would flow through it anyway,
    # and stopping it keeps the top-k indices out of the backward pass.
    selection_TE = jax.lax.stop_gradient(selection_TE)
    if n_groups > 1:
        keep_TE = group_limited_mask(selection_TE, n_groups, topk_groups)
        selection_TE = jnp.where(keep_TE, selection_TE, -jnp.inf)
    _, experts_TK = jax.lax.top_k(selection_TE, k)
    weights_TK = jnp.take_along_axis(scores_TE, experts_TK, axis=-1)
    if norm_topk_prob:
        # The epsilon only matters for sigmoid scores that all underflow to 0.
        weights_TK = weights_TK / (weights_TK.sum(axis=-1, keepdims=True) + 1e-20)
    weights_TK = weights_TK * routed_scaling_factor
    return Routing(weights_TK, experts_TK.astype(jnp.int32), scores_TE)


def tokens_per_expert(experts_TK, num_experts):
    """[E] int32: how many token copies each expert receives."""
    return jnp.bincount(experts_TK.reshape(-1), length=num_experts).astype(jnp.int32)


def bias_update(tokens_per_expert_E, rate):
    """Aux-loss-free balancing step: ``rate * sign(mean_load - load)``, [..., E] float32.

    Overloaded experts get their bias lowered, idle ones raised. This is a state
    update for the caller to add to the bias after the optimizer step, not a
    gradient. Leading axes (e.g. [L, E] of a layer stack) are independent rows.
    """
    load_E = tokens_per_expert_E.astype(jnp.float32)
    return rate * jnp.sign(load_E.mean(axis=-1, keepdims=True) - load_E)


def _normalized_probs(scores_TE, score_func):
    # Sigmoid scores do not sum to 1; the balance losses need a distribution.
    if score_func == "sigmoid":
        return scores_TE / (scores_TE.sum(axis=-1, keepdims=True) + 1e-20)
    return scores_TE


def load_balance_loss(scores_TE, experts_TK, score_func="softmax"):
    """Switch-Transformer load-balance loss ``E * sum_e f_e * P_e``, [] float32.

    f_e is the fraction of the T*K token copies routed to expert e and P_e the
    mean router probability of e; the loss is 1 when both are uniform. Only P
    carries gradient.
    """
    num_experts = scores_TE.shape[-1]
    k = experts_TK.shape[-1]
    f_E = tokens_per_expert(experts_TK, num_experts) / (experts_TK.shape[0] * k)
    p_E = _normalized_probs(scores_TE.astype(jnp.float32), score_func).mean(axis=0)
    return num_experts * jnp.sum(f_E * p_E)


def seq_aux_loss(scores_BSE, experts_BSK, score_func="sigmoid"):
    """DeepSeek-V3 sequence-wise balance loss, averaged over sequences, [] float32.

    Per sequence: ``sum_e f_e * P_e`` with ``f_e = E / (K*S) * count_e`` and P_e
    the mean over the sequence of the normalised scores. Equals 1 when balanced.
    """
    b, s, num_experts = scores_BSE.shape
    k = experts_BSK.shape[-1]
    onehot_BSKE = jax.nn.one_hot(experts_BSK, num_experts, dtype=jnp.float32)
    f_BE = onehot_BSKE.sum(axis=(1, 2)) * (num_experts / (k * s))
    p_BE = _normalized_probs(scores_BSE.astype(jnp.float32), score_func).mean(axis=1)
    return jnp.mean(jnp.sum(f_BE * p_BE, axis=-1))


def router_z_loss(logits_TE):
    """ST-MoE router z-loss ``mean_t logsumexp(logits_t)^2``, [] float32."""
    lse_T = jax.nn.logsumexp(logits_TE.astype(jnp.float32), axis=-1)
    return jnp.mean(jnp.square(lse_T))
