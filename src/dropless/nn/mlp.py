"""Dense SwiGLU feed-forward block: the shared experts of an MoE layer and the
MLP of dense decoder layers.

Legend: D model dim (``emb_dim``), F hidden dim (``mlp_dim``); ``...`` any
leading batch/sequence axes.

``y = wo(silu(wi_0(x)) * wi_1(x))``, no biases (Llama/DeepSeek convention).
The hidden activations are tagged with ``checkpoint_name`` ("mlpwi_0",
"mlpwi_1", "mlpwo") so remat/offload policies can save or drop them by name.
``dot_general`` replaces the three projections' matmul (e.g. the FP8
``ops.fp8_dot.fp8_dot_general`` for ``quantization: te_fp8_currentscaling``).
"""

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

# Fan-in scaled normal over the input axis, as nnx.Linear does by default.
default_kernel_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


class MLP(nnx.Module):
    """SwiGLU MLP ``[..., D] -> [..., D]`` with hidden width F.

    Parameters: ``wi_0.kernel`` [D, F] (gate), ``wi_1.kernel`` [D, F] (up),
    ``wo.kernel`` [F, D] (down), stored in ``param_dtype`` and computed in
    ``dtype``; ``dot_general`` (default ``lax.dot_general``) computes them.
    """

    def __init__(
        self,
        emb_dim: int,
        mlp_dim: int,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        dot_general=None,
    ):
        if emb_dim <= 0 or mlp_dim <= 0:
            raise ValueError(f"MLP: {emb_dim=} and {mlp_dim=} must be positive")
        self.emb_dim = emb_dim
        self.mlp_dim = mlp_dim
        self.dtype = dtype

        def linear(d_in, d_out):
            return nnx.Linear(
                d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                kernel_init=default_kernel_init, dot_general=dot_general or jax.lax.dot_general,
                rngs=rngs,
            )

        self.wi_0 = linear(emb_dim, mlp_dim)
        self.wi_1 = linear(emb_dim, mlp_dim)
        self.wo = linear(mlp_dim, emb_dim)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [..., D] -> [..., D] in ``dtype``.

        Raises:
          ValueError: last axis of x is not D.
        """
        if x.shape[-1] != self.emb_dim:
            raise ValueError(f"MLP: expected [..., {self.emb_dim}], got {x.shape}")
        x = x.astype(self.dtype)
        gate = checkpoint_name(self.wi_0(x), "mlpwi_0")
        up = checkpoint_name(self.wi_1(x), "mlpwi_1")
        return checkpoint_name(self.wo(jax.nn.silu(gate) * up), "mlpwo")
