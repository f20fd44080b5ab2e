"""The training state and the jitted train step.

Legend: A gradient-accumulation microbatches, B batch, S sequence, V vocabulary,
L MoE layers (all stacks and MTP together), E routed experts, K MTP depth.

The state is a dict of plain pytrees, so Orbax saves it as is::

    params        nnx.Param values of the model, nested dicts of arrays
    router_bias   RouterBias values (aux-loss-free balancing), not optimized
    opt_state     Optax state of ``make_optimizer`` over ``params``
    step          [] int32 steps taken (data position), skipped ones included
    skipped_steps [] int32 steps whose loss or gradients were not finite

One step: per microbatch, loss = cross-entropy + MoE aux losses +
``mtp_loss_scaling_factor`` * mean over depths of the MTP cross-entropies;
gradients are averaged over microbatches in float32; the optimizer updates
the parameters; the router bias takes one balancing step per optimizer step,
from the expert load summed over the microbatches
(``Transformer.apply_router_bias_update``). If the loss or
the gradient norm is not finite, or an expert-parallel receive buffer
overflowed (``MoEStats.overflow_tokens``: some tokens got partial outputs),
the new params, optimizer state and bias are all discarded on device
(``jnp.where``), ``skipped_steps`` counts it, and the step counter still
advances so the data stream moves on.
"""

import logging
from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from dropless.config.sections import ModelConfig
from dropless.nn import moe as moe_lib
from dropless.nn.model import Transformer, moe_stats_concat
from dropless.nn.moe import RouterBias
from dropless.ops import cross_entropy
from dropless.train.data import Batch

_log = logging.getLogger(__name__)


def build_model(cfg: ModelConfig, seed: int, remat=None, ep=None) -> Transformer:
    """A concrete model initialised from ``seed`` (call under jit or eval_shape)."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed), remat=remat, ep=ep)


def split_model(model: Transformer):
    """(graphdef, params, router_bias, rest) with the states as plain nested dicts."""
    graphdef, params, bias, rest = nnx.split(model, nnx.Param, RouterBias, ...)
    return graphdef, nnx.to_pure_dict(params), nnx.to_pure_dict(bias), nnx.to_pure_dict(rest)


def optimizer_start(tx: optax.GradientTransformation, params) -> dict:
    """The state's ``opt_state``, ``step`` and ``skipped_steps`` at step 0 for ``params``.

    With ``init``'s params this completes a random start; with loaded ones it
    builds the rest of the state around them without a random initialisation.
    """
    return {
        "opt_state": tx.init(params),
        "step": jnp.zeros((), jnp.int32),
        "skipped_steps": jnp.zeros((), jnp.int32),
    }


def init_state_fn(cfg: ModelConfig, tx: optax.GradientTransformation, seed: int, remat=None,
                  ep=None):
    """(graphdef, init) where ``init() -> state`` builds the model and optimizer state.

    ``graphdef`` comes from an abstract build, so nothing is allocated here.
    ``remat`` and ``ep`` go to ``Transformer``.
    """

    def init():
        _, params, bias, rest = split_model(build_model(cfg, seed, remat, ep))
        if jax.tree.leaves(rest):
            raise ValueError("the model holds state other than Param and RouterBias")
        return {"params": params, "router_bias": bias, **optimizer_start(tx, params)}

    abstract_model = nnx.eval_shape(lambda: build_model(cfg, seed, remat, ep))
    graphdef = nnx.split(abstract_model, nnx.Param, RouterBias, ...)[0]
    return graphdef, init


def _token_ce(logits_BSV, targets_BS, weights_BS):
    """(weighted sum of token cross-entropies, sum of weights), float32, from the logits in
    the head's dtype (``ops.cross_entropy``: optax's arithmetic, a one-pass backward)."""
    return cross_entropy.weighted_cross_entropy(logits_BSV, targets_BS, weights_BS)


def loss_fn(params, router_bias, graphdef, cfg: ModelConfig, inputs_BS, targets_BS, weights_BS,
            fp8_codes=None):
    """Total loss of one microbatch and its parts.

    ``fp8_codes``: the expert weights' FP8 codes of this step (``moe.fp8_weight_codes``),
    read by the FP8 kernels instead of quantizing the weights again; None: quantized here.

    Returns:
      (loss [] float32, aux) with aux a dict: ``lm_loss``, ``aux_loss``,
      ``mtp_loss`` scalars and ``moe_stats`` (dict of MoEStats per stack).
    """
    model = nnx.merge(graphdef, params, router_bias, {})
    if fp8_codes:
        moe_lib.attach_fp8_weight_codes(model, fp8_codes)
    out = model(inputs_BS, float32_logits=False)
    ce_sum, w_sum = _token_ce(out.logits_BSV, targets_BS, weights_BS)
    lm_loss = ce_sum / jnp.maximum(w_sum, 1.0)
    aux_loss = sum(
        (jnp.sum(s.aux_loss) for s in out.moe_stats.values()), jnp.zeros((), jnp.float32)
    )
    mtp_loss = jnp.zeros((), jnp.float32)
    seq = inputs_BS.shape[1]
    for k, logits_BSV in enumerate(out.mtp_logits, start=1):
        # Position i predicts token i+k+1 = targets[i+k]; the last k positions have none.
        valid_S = (jnp.arange(seq) < seq - k).astype(jnp.float32)
        w_BS = jnp.roll(weights_BS, -k, axis=1) * valid_S
        ce, w = _token_ce(logits_BSV, jnp.roll(targets_BS, -k, axis=1), w_BS)
        mtp_loss += ce / jnp.maximum(w, 1.0) / len(out.mtp_logits)
    loss = lm_loss + aux_loss + cfg.mtp_loss_scaling_factor * mtp_loss
    return loss, {"lm_loss": lm_loss, "aux_loss": aux_loss, "mtp_loss": mtp_loss,
                  "moe_stats": out.moe_stats}


# MoEStats fields that combine over microbatches by max, not sum.
MAX_FIELDS = ("buffer_factor_needed",)


def _field(path) -> str | None:
    """The NamedTuple field name at the end of a pytree path, if any."""
    return getattr(path[-1], "name", None) if path else None


def _accumulate(acc, new):
    """acc + new leaf by leaf (max for MAX_FIELDS), in acc's dtypes."""

    def add(path, a, b):
        b = b.astype(a.dtype)
        return jnp.maximum(a, b) if _field(path) in MAX_FIELDS else a + b

    return jax.tree_util.tree_map_with_path(add, acc, new)


def _fp8_codes_once(state, graphdef, cfg: ModelConfig):
    """The expert weights' FP8 codes for all the step's microbatches (``moe.fp8_weight_codes``),
    or None: ``gmm_fp8_weights_once_per_step`` off, or no FP8 kernel reads the weights.
    Where the kernels run but the codes cannot be shared (expert parallelism over several
    devices), a warning says so and each microbatch quantizes them."""
    if not cfg.moe.gmm_fp8_weights_once_per_step:
        return None
    model = nnx.merge(graphdef, state["params"], state["router_bias"], {})
    for why in moe_lib.fp8_weight_codes_refusals(model):
        _log.warning("gmm_fp8_weights_once_per_step: the expert weights are quantized in every "
                     "microbatch: %s", why)
    codes = moe_lib.fp8_weight_codes(model)
    if codes:
        _log.info("FP8 expert weights: quantized once per optimizer step for its "
                  "microbatches (%d MoE blocks)", len(codes))
    return codes or None


def _grads(state, batch: Batch, graphdef, cfg: ModelConfig):
    """Mean loss, aux and float32-averaged gradients over the A microbatches."""
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    num_micro = batch.inputs.shape[0]
    fp8_codes = _fp8_codes_once(state, graphdef, cfg) if num_micro > 1 else None

    def micro(i):
        return grad_fn(
            state["params"], state["router_bias"], graphdef, cfg,
            batch.inputs[i], batch.targets[i], batch.weights[i], fp8_codes,
        )

    if num_micro == 1:
        (loss, aux), grads = micro(0)
        return loss, aux, grads

    def body(acc, i):
        return _accumulate(acc, micro(i)), None

    def zeros_like(x):
        # Sums in float32 (or int32 for counts), whatever the parameter dtype.
        dtype = jnp.int32 if jnp.issubdtype(x.dtype, jnp.integer) else jnp.float32
        return jnp.zeros(x.shape, dtype)

    total, _ = jax.lax.scan(body, jax.tree.map(zeros_like, jax.eval_shape(micro, 0)),
                            jnp.arange(num_micro))
    (loss, aux), grads = total

    def mean(path, x):
        # Losses, gradients and bias updates average; counts stay sums, maxima maxima.
        keep = jnp.issubdtype(x.dtype, jnp.integer) or _field(path) in MAX_FIELDS
        return x if keep else x / num_micro

    loss, aux, grads = jax.tree_util.tree_map_with_path(mean, (loss, aux, grads))
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state["params"])
    return loss, aux, grads


def make_train_step(graphdef, cfg: ModelConfig, tx, schedule) -> Callable:
    """``train_step(state, batch) -> (state, metrics)``, pure, ready for ``jax.jit``.

    Args:
      graphdef: from ``init_state_fn``.
      tx: the Optax transformation whose state is ``state["opt_state"]``.
      schedule: the learning-rate schedule inside ``tx`` (for logging).

    Returns metrics, all on device: ``loss``, ``lm_loss``, ``aux_loss``,
    ``mtp_loss``, ``grad_norm`` (before clipping), ``learning_rate``,
    ``finite`` and ``applied`` (bool), ``skipped_steps``, and when the model
    has MoE layers ``tokens_per_expert`` [L, E] int32, ``overflow_tokens``
    [L] int32 and ``buffer_factor_needed`` [L] float32 per layer (for
    ``parallel.overflow``), ``dropped_tokens``, ``ep_rows_sent``,
    ``ep_rows_saved``, ``ep_extra_rounds`` [] int32.
    """

    def train_step(state, batch: Batch):
        loss, aux, grads = _grads(state, batch, graphdef, cfg)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        stats = moe_stats_concat(aux["moe_stats"])
        overflow = jnp.zeros((), jnp.int32) if stats is None else jnp.sum(stats.overflow_tokens)
        # Tokens an expert-parallel buffer could not hold got partial outputs: skip the step too.
        applied = finite & (overflow == 0)
        params, opt_state = state["params"], state["opt_state"]

        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        model = nnx.merge(graphdef, new_params, state["router_bias"], {})
        model.apply_router_bias_update(aux["moe_stats"])
        new_bias = nnx.to_pure_dict(nnx.state(model, RouterBias))

        # A select, not lax.cond: on the GPU a conditional reads its predicate on the
        # host, so the step's dispatch would block until the backward pass is done
        # (on the H200 the dispatch returned 27 ms before a 1255 ms step ended, the seed
        # recipe log of 2026-12-02), and the loop could not run ahead. XLA fuses the
        # select into the update's own pass over the weights.
        def keep_if_finite(new, old):
            return jax.tree.map(lambda n, o: jnp.where(applied, n, o), new, old)

        updates_applied = state["step"] - state["skipped_steps"]  # the optimizer's count
        new_state = {
            "params": keep_if_finite(new_params, params),
            "router_bias": keep_if_finite(new_bias, state["router_bias"]),
            "opt_state": keep_if_finite(new_opt_state, opt_state),
            "step": state["step"] + 1,
            "skipped_steps": state["skipped_steps"] + (~applied).astype(jnp.int32),
        }
        metrics = {
            "loss": loss,
            "lm_loss": aux["lm_loss"],
            "aux_loss": aux["aux_loss"],
            "mtp_loss": aux["mtp_loss"],
            "grad_norm": grad_norm,
            "learning_rate": jnp.asarray(schedule(updates_applied), jnp.float32),
            "finite": finite,
            "applied": applied,
            "skipped_steps": new_state["skipped_steps"],
        }
        if stats is not None:
            metrics.update(
                tokens_per_expert=stats.tokens_per_expert,
                dropped_tokens=jnp.sum(stats.dropped_tokens),
                overflow_tokens=stats.overflow_tokens,
                buffer_factor_needed=stats.buffer_factor_needed,
                ep_rows_sent=jnp.sum(stats.ep_rows_sent),
                ep_rows_saved=jnp.sum(stats.ep_rows_saved),
                ep_extra_rounds=jnp.sum(stats.ep_extra_rounds),
            )
        return new_state, metrics

    return train_step
