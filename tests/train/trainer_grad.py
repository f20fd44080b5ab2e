"""The trainer's loss gradient for a preset, for tests that read its jaxpr or values."""

import jax
import jax.numpy as jnp
import optax

from dropless.config.loader import load_config
from dropless.train import remat as remat_lib
from dropless.train import step as step_lib


def preset_model(*keys, model_name="deepseek3-tiny"):
    """The ``ModelConfig`` the CLI builds from ``model_name`` and ``key=value`` overrides."""
    return load_config(None, [f"model_name={model_name}", *keys], environ={}).config.model()


def loss_gradient(model, tokens=None, *, abstract=False):
    """``(grad, params, router_bias)``: ``grad(params, router_bias)`` is the gradient of the
    trainer's loss (``step.loss_fn``, layers under ``model``'s remat policy) with respect to
    the parameters, on ``tokens`` (int [batch, seq]; zeros [2, 16] by default) as inputs
    and targets with unit weights. ``abstract``: the state as shapes only
    (``jax.eval_shape``), for tracing."""
    graphdef, init = step_lib.init_state_fn(model, optax.identity(), 0, remat_lib.layer_remat(model))
    state = jax.eval_shape(init) if abstract else init()
    tokens = jnp.zeros((2, 16), jnp.int32) if tokens is None else tokens
    weights = jnp.ones(tokens.shape, jnp.float32)
    grad = jax.grad(lambda p, bias: step_lib.loss_fn(p, bias, graphdef, model, tokens, tokens,
                                                     weights)[0])
    return grad, state["params"], state["router_bias"]
