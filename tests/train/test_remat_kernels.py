"""``remat_policy=minimal`` keeps the expert kernels' outputs: no recomputed expert forward.

The grouped GEMMs are Mosaic GPU kernels (``mpmd_map`` in the jaxpr), which
``checkpoint_dots_with_no_batch_dims`` cannot see. Tracing needs no GPU: the
kernels are counted in the jaxpr of the gradient, before any compiler runs.
"""

from collections import Counter

import jax
import jax._src.core as jax_core
import jax.numpy as jnp

from dropless.nn.moe import grouped_swiglu
from dropless.train import remat as remat_lib


def _primitives(jaxpr, counts):
    for eqn in jaxpr.eqns:
        counts[eqn.primitive.name] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(sub, jax_core.ClosedJaxpr):
                    _primitives(sub.jaxpr, counts)
                elif isinstance(sub, jax_core.Jaxpr):
                    _primitives(sub, counts)
    return counts


def _kernels_in_grad(policy):
    p, d, f, g = 256, 128, 128, 2
    x = jnp.ones((p, d), jnp.bfloat16)
    sizes = jnp.full((g,), p // g, jnp.int32)
    wi, wo = jnp.ones((g, d, 2 * f), jnp.bfloat16), jnp.ones((g, f, d), jnp.bfloat16)

    def layer(x, wi, wo):
        return grouped_swiglu(jnp.sin(x), sizes, (wi, wo), backend="mosaic").astype(jnp.float32).sum()

    fn = layer if policy is None else jax.checkpoint(layer, policy=policy)
    jaxpr = jax.make_jaxpr(jax.grad(fn, argnums=(0, 1, 2)))(x, wi, wo).jaxpr
    return _primitives(jaxpr, Counter())["mpmd_map"]


def test_minimal_runs_each_expert_kernel_once():
    """2 forward GEMMs + 2 dgrad + 2 wgrad, as without remat; the dots-only policy
    traces a recomputed forward GEMM (7), which is what the names prevent."""
    assert _kernels_in_grad(None) == 6
    assert _kernels_in_grad(remat_lib.checkpoint_policy("minimal")) == 6
    assert _kernels_in_grad(jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims) == 7
    assert _kernels_in_grad(remat_lib.checkpoint_policy("full")) == 7
