"""AdamW with warmup + cosine decay and global-norm clipping (Optax).

    lr(t) = learning_rate * t / W                      for t < W = warmup_steps_fraction * steps
          = cosine from learning_rate down to learning_rate * cosine_learning_rate_final_fraction
            over the remaining steps, then flat

The chain is ``clip_by_global_norm -> adamw``; the first moment is stored in
``mu_dtype`` (bfloat16 halves its memory), the second in the parameter dtype.
Weight decay skips RMSNorm scales and biases (1-element-per-feature vectors
whose decay only fights the normalisation). The router's balancing bias is not
an ``nnx.Param`` and never reaches the optimizer.
"""

import jax
import jax.numpy as jnp
import optax

from dropless.config.sections import OptimizerConfig

# Leaf names (last key of a parameter's path) that weight decay leaves alone.
NO_DECAY_NAMES = ("scale", "bias")


def learning_rate_schedule(cfg: OptimizerConfig, steps: int) -> optax.Schedule:
    """Linear warmup from 0 then cosine decay; ``steps`` is the run's total.

    Raises:
      ValueError: non-positive steps or learning rate, or fractions outside [0, 1].
    """
    if steps <= 0:
        raise ValueError(f"steps={steps} must be positive")
    if cfg.learning_rate <= 0:
        raise ValueError(f"learning_rate={cfg.learning_rate} must be positive")
    for name in ("warmup_steps_fraction", "cosine_learning_rate_final_fraction"):
        if not 0.0 <= getattr(cfg, name) <= 1.0:
            raise ValueError(f"{name}={getattr(cfg, name)} must be in [0, 1]")
    warmup = min(int(round(cfg.warmup_steps_fraction * steps)), steps - 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.learning_rate,
        warmup_steps=warmup,
        decay_steps=steps,
        end_value=cfg.learning_rate * cfg.cosine_learning_rate_final_fraction,
    )


def decay_mask(params):
    """True for parameters that take weight decay (all but NO_DECAY_NAMES leaves)."""

    def keep(path, _):
        last = path[-1]
        name = getattr(last, "key", getattr(last, "name", None))
        return name not in NO_DECAY_NAMES

    return jax.tree_util.tree_map_with_path(keep, params)


def make_optimizer(cfg: OptimizerConfig, steps: int) -> optax.GradientTransformation:
    """``clip_by_global_norm(threshold) -> adamw(schedule, mu_dtype, mask)``.

    A threshold of 0 turns clipping off.

    Raises:
      ValueError: as ``learning_rate_schedule``, or a negative threshold.
    """
    if cfg.gradient_clipping_threshold < 0:
        raise ValueError(f"gradient_clipping_threshold={cfg.gradient_clipping_threshold} must be >= 0")
    adamw = optax.adamw(
        learning_rate=learning_rate_schedule(cfg, steps),
        b1=cfg.adam_b1,
        b2=cfg.adam_b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.adam_weight_decay,
        mu_dtype=jnp.dtype(cfg.mu_dtype),
        mask=decay_mask,
    )
    if cfg.gradient_clipping_threshold > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.gradient_clipping_threshold), adamw)
    return adamw
