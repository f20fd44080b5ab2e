"""Grouped-query attention (GQA; Llama, Qwen3, Mixtral) with optional per-head q/k RMSNorm.

Legend: B batch, S sequence, D model dim, H query heads, K kv heads (K
divides H), G = H // K query heads per kv head, Dh head dim (q, k and v).

    q_BSHD = wq(x), k_BSKD = wk(x), v_BSKD = wv(x)       full-rank projections
    q, k   = q_norm(q), k_norm(k)                        per head, when use_qk_norm
    q, k   = rope_half(q), rope_half(k)                  rotate-half pairs (j, j + Dh/2)
    y      = wo(softmax(q k^T / sqrt(Dh), causal) v)     query head h reads kv head h // G

This is transformers' ``Qwen3MoeAttention`` (no projection biases, RMSNorm
over the head dim before RoPE, scale ``Dh**-0.5``) and, without
``use_qk_norm``, its ``MixtralAttention`` (with ``sliding_window: null``). The attention itself is
``attention.dot_product_attention`` or ``attention.fused_attention``, which
take k and v with K heads and never repeat them H // K times in memory.

Activations carry the ``checkpoint_name`` tags of the remat policies:
``query_proj``, ``key_proj``, ``value_proj`` (after norm and RoPE for q and
k), ``context`` (attention output), ``out_proj``.
"""

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dropless.config.sections import GQAConfig
from dropless.nn import rope
from dropless.nn.attention import attend, check_backend, default_kernel_init


def check_gqa_config(cfg: GQAConfig, dtype) -> None:
    """Raise ValueError for a GQA config the module cannot build.

    Raises:
      ValueError: a non-positive head count; ``num_kv_heads`` not dividing
        ``num_heads``; an odd or non-positive ``head_dim``; as
        ``attention.check_backend``.
    """
    if cfg.num_heads <= 0 or cfg.num_kv_heads <= 0:
        raise ValueError(f"GQA: num_heads={cfg.num_heads} and num_kv_heads={cfg.num_kv_heads} must be positive")
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError(f"GQA: num_kv_heads={cfg.num_kv_heads} must divide num_heads={cfg.num_heads}")
    if cfg.head_dim <= 0 or cfg.head_dim % 2:
        raise ValueError(f"GQA: head_dim={cfg.head_dim} must be a positive even number (rotate-half RoPE)")
    check_backend(cfg.attention, dtype)


class GQA(nnx.Module):
    """Grouped-query attention ``[B, S, D] -> [B, S, D]``, causal.

    Parameters (kernels ``[in, out]``, in ``param_dtype``): ``wq`` [D, H*Dh],
    ``wk`` and ``wv`` [D, K*Dh], ``wo`` [H*Dh, D]; with ``use_qk_norm``,
    ``q_norm`` and ``k_norm`` [Dh] (one scale shared by all heads).
    ``dot_general`` (default ``lax.dot_general``) computes the four projections.

    Raises:
      ValueError: see ``check_gqa_config``.
    """

    def __init__(self, cfg: GQAConfig, *, emb_dim: int, dtype, param_dtype, rngs: nnx.Rngs,
                 dot_general=None):
        check_gqa_config(cfg, dtype)
        self.cfg = cfg
        self.dtype = dtype
        h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

        def linear(d_in, d_out):
            return nnx.Linear(
                d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                kernel_init=default_kernel_init, dot_general=dot_general or jax.lax.dot_general,
                rngs=rngs,
            )

        def norm():
            return nnx.RMSNorm(
                hd, epsilon=cfg.normalization_layer_epsilon, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs,
            )

        self.wq = linear(emb_dim, h * hd)
        self.wk = linear(emb_dim, kv * hd)
        self.wv = linear(emb_dim, kv * hd)
        self.wo = linear(h * hd, emb_dim)
        self.q_norm = norm() if cfg.use_qk_norm else None
        self.k_norm = norm() if cfg.use_qk_norm else None

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array) -> jax.Array:
        """x [B, S, D] (any float dtype), positions [B, S] int -> [B, S, D] in ``dtype``."""
        cfg = self.cfg
        b, s, _ = x_BSD.shape
        h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x_BSD = x_BSD.astype(self.dtype)
        q_BSHD = self.wq(x_BSD).reshape(b, s, h, hd)
        k_BSKD = self.wk(x_BSD).reshape(b, s, kv, hd)
        v_BSKD = self.wv(x_BSD).reshape(b, s, kv, hd)
        if cfg.use_qk_norm:
            q_BSHD, k_BSKD = self.q_norm(q_BSHD), self.k_norm(k_BSKD)
        cos_BSR2, sin_BSR2 = rope.half_cos_sin(positions_BS, hd, cfg.rope_theta)
        q_BSHD = checkpoint_name(rope.apply_rope_half(q_BSHD, cos_BSR2, sin_BSR2), "query_proj")
        k_BSKD = checkpoint_name(rope.apply_rope_half(k_BSKD, cos_BSR2, sin_BSR2), "key_proj")
        v_BSKD = checkpoint_name(v_BSKD, "value_proj")

        scale = hd**-0.5
        out_BSHD = checkpoint_name(attend(q_BSHD, k_BSKD, v_BSKD, scale=scale,
                                          attention=cfg.attention), "context")
        y_BSD = self.wo(out_BSHD.reshape(b, s, h * hd))
        return checkpoint_name(y_BSD, "out_proj")
