"""Multi-head Latent Attention (MLA, DeepSeek-V2/V3) with causal attention backends.

Legend: B batch, S sequence (queries), T sequence (keys), D model dim, H heads,
N ``qk_nope_head_dim``, R ``qk_rope_head_dim``, Q = N + R query/key head dim,
V ``v_head_dim``, Lq ``q_lora_rank``, Lkv ``kv_lora_rank``.

MLA compresses keys and values into one latent of Lkv features per token (the
only thing an inference cache must keep) and queries into Lq features:

    q_BSHQ  = wq_b(q_norm(wq_a(x)))                      (or wq(x) when Lq = 0)
    [c_kv, k_pe] = wkv_a(x)                              [B,S,Lkv] and [B,S,R]
    [k_nope, v] = wkv_b(kv_norm(c_kv))                   per head: N and V features
    q = [q_nope, rope(q_pe)],  k = [k_nope, rope(k_pe) shared by all heads]
    y = wo(softmax(q k^T * scale, causal) v)

The position information rides on a separate, decoupled R-dim part of each
head (``k_pe`` is shared by all heads), so the latent stays position-free.

Activations carry ``checkpoint_name`` tags for remat/offload policies:
``mla_q`` (q latent), ``mla_kv`` (kv latent + k_pe), ``query_proj``,
``key_proj``, ``value_proj``, ``context`` (attention output), ``out_proj``.

Backends (``MLAConfig.attention``; ``nn.gqa`` uses the same two, with k and v
of fewer heads than q):
  * ``dot_product``: two einsums and a float32 softmax, any platform.
  * ``cudnn_flash_te``: cuDNN fused flash attention through
    ``jax.nn.dot_product_attention(implementation="cudnn")``. That API wants one
    head dim for q, k and v, so v (V=128 in V3) is zero-padded to Q (192) and the
    padding is sliced off the output; zeros in v only add zero columns. With
    ``MLAConfig.cudnn_mla_unpadded_v`` the same cuDNN kernels are reached through
    jax's private ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``,
    which takes V != Q ("MLA" in cuDNN >= 9.10, Hopper or newer): P.V and its
    gradients then run at V instead of Q, a sixth of the attention FLOPs in V3.
"""

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from dropless.config.sections import MLAConfig
from dropless.nn import rope

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("dot_product", "cudnn_flash_te")

default_kernel_init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def check_backend(attention: str, dtype, unpadded_v: bool | str = False) -> None:
    """The attention modules' one guard on their backend keys (MLA and GQA call it
    when built). The user-facing checks, naming the config key and the fix, are
    ``config.schema``'s; this catches a module section built by hand.

    Raises:
      ValueError: ``attention`` not in ``ATTENTION_BACKENDS``; ``cudnn_flash_te``
        with a ``dtype`` other than bfloat16/float16; ``unpadded_v`` true without
        ``cudnn_flash_te``.
    """
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention={attention!r} is not one of {ATTENTION_BACKENDS}")
    if attention == "cudnn_flash_te" and jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        raise ValueError(f"attention='cudnn_flash_te' needs dtype bfloat16 or float16, got {jnp.dtype(dtype)}")
    if unpadded_v is True and attention != "cudnn_flash_te":
        raise ValueError(f"cudnn_mla_unpadded_v=true needs attention=cudnn_flash_te, got {attention!r}")


def dot_product_attention(q_BSHQ, k_BTKQ, v_BTKV, *, scale: float) -> jax.Array:
    """Causal softmax attention in XLA; logits and softmax in float32.

    Args:
      q_BSHQ: queries, H heads.
      k_BTKQ, v_BTKV: keys and values with K heads, K dividing H: query head h
        reads kv head ``h // (H // K)`` (grouped-query attention; K = H is
        plain multi-head attention). V may differ from Q.
      scale: multiplier of q.k before the softmax.

    Returns:
      [B, S, H, V] in v's dtype. Query i attends to keys 0..i (S == T).

    Raises:
      ValueError: K does not divide H.
    """
    b, s, h, q_dim = q_BSHQ.shape
    t, kv = k_BTKQ.shape[1], k_BTKQ.shape[2]
    if h % kv:
        raise ValueError(f"{kv} kv heads must divide {h} query heads")
    causal_ST = jnp.arange(s)[:, None] >= jnp.arange(t)[None, :]
    if kv == h:  # the MHA program, written without the unit group axis
        logits_BHST = jnp.einsum(
            "bshq,bthq->bhst", q_BSHQ, k_BTKQ, preferred_element_type=jnp.float32
        ) * scale
        logits_BHST = jnp.where(causal_ST, logits_BHST, jnp.finfo(jnp.float32).min)
        probs_BHST = jax.nn.softmax(logits_BHST, axis=-1)
        return jnp.einsum("bhst,bthv->bshv", probs_BHST.astype(v_BTKV.dtype), v_BTKV)
    # G = H // K query heads per kv head, contracted against their kv head
    # without materialising K x G copies of k and v.
    q_BSKGQ = q_BSHQ.reshape(b, s, kv, h // kv, q_dim)
    logits_BKGST = jnp.einsum(
        "bskgq,btkq->bkgst", q_BSKGQ, k_BTKQ, preferred_element_type=jnp.float32
    ) * scale
    logits_BKGST = jnp.where(causal_ST, logits_BKGST, jnp.finfo(jnp.float32).min)
    probs_BKGST = jax.nn.softmax(logits_BKGST, axis=-1)
    out_BSKGV = jnp.einsum("bkgst,btkv->bskgv", probs_BKGST.astype(v_BTKV.dtype), v_BTKV)
    return out_BSKGV.reshape(b, s, h, v_BTKV.shape[-1])


def fused_attention(q_BSHQ, k_BTHQ, v_BTHV, *, scale: float, implementation="cudnn",
                    unpadded_v: bool | str = False):
    """Causal attention through ``jax.nn.dot_product_attention``, v padded to Q
    (or, with ``unpadded_v``, through jax's private cuDNN call at V).

    k and v may have fewer heads than q (a divisor of H: grouped-query
    attention, which ``jax.nn.dot_product_attention`` and cuDNN take natively).

    Args:
      implementation: ``"cudnn"`` (GPU flash attention) or ``"xla"`` / None;
        the CPU tests use ``"xla"`` to check the padding logic.
      unpadded_v: with ``implementation="cudnn"`` and V < Q, give cuDNN v at
        its own head dim through jax's private cuDNN attention (no padding, no
        slice). No effect when V == Q. ``"auto"``: unpadded where jax and cuDNN
        take it, else padded, logged once with the reason; with another
        implementation, padded.

    Returns:
      [B, S, H, V] in q's dtype.

    Raises:
      ValueError: V > Q; ``unpadded_v`` with another implementation, or where jax's
        private cuDNN attention is missing or refuses the shapes (no GPU,
        cuDNN < 9.10, a GPU older than Hopper). The unpadded path never falls
        back to the padded one silently.
    """
    qk_dim, v_dim = q_BSHQ.shape[-1], v_BTHV.shape[-1]
    if v_dim > qk_dim:
        raise ValueError(f"v head dim {v_dim} larger than q/k head dim {qk_dim} is not supported")
    if unpadded_v == "auto":
        if implementation == "cudnn" and v_dim < qk_dim:
            try:
                out = _cudnn_unpadded_v(q_BSHQ, k_BTHQ, v_BTHV, scale=scale)
            except UnpaddedRefused as e:
                _log_once(f"cudnn_mla_unpadded_v=auto: MLA's v goes to cuDNN zero-padded to the q/k "
                          f"head dim ({v_dim} -> {qk_dim}), because {e.reason}")
            else:
                _log_once(f"cudnn_mla_unpadded_v=auto: MLA's v goes to cuDNN at its own head dim {v_dim} "
                          f"(q/k {qk_dim}; no padding)")
                return out
    elif unpadded_v and implementation != "cudnn":
        raise ValueError(f"cudnn_mla_unpadded_v=true needs cuDNN attention, got implementation={implementation!r}")
    elif unpadded_v and v_dim < qk_dim:
        return _cudnn_unpadded_v(q_BSHQ, k_BTHQ, v_BTHV, scale=scale)
    pad = [(0, 0)] * 3 + [(0, qk_dim - v_dim)]
    v_BTHQ = jnp.pad(v_BTHV, pad) if v_dim < qk_dim else v_BTHV
    out_BSHQ = jax.nn.dot_product_attention(
        q_BSHQ, k_BTHQ, v_BTHQ, scale=scale, is_causal=True, implementation=implementation
    )
    return out_BSHQ[..., :v_dim]


class UnpaddedRefused(ValueError):
    """jax or cuDNN cannot take v at its own head dim. The message is for
    ``cudnn_mla_unpadded_v=true`` (it names the key); ``reason`` is the bare cause."""

    def __init__(self, reason: str, wording: str = ": "):
        super().__init__(f"cudnn_mla_unpadded_v=true{wording}{reason}; set cudnn_mla_unpadded_v=false")
        self.reason = reason


@functools.cache
def _log_once(message: str) -> None:
    """One line in the log per distinct message (attention traces once per layer stack)."""
    logger.warning(message)


def _private_cudnn_attention():
    """jax's private cuDNN attention entry point and its causal mask type.

    Imported only when asked for: it is not public API (jax 0.11.2 as pinned)
    and may move in another version, which then gets an error naming the key.
    """
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        return fa.dot_product_attention, fa.MaskType.CAUSAL
    except (ImportError, AttributeError) as e:
        raise UnpaddedRefused(
            f"needs jax's private cuDNN attention (jax._src.cudnn.fused_attention_stablehlo, "
            f"as in jax 0.11.2), not found in jax {jax.__version__}: {e}", wording=" "
        ) from e


def _cudnn_unpadded_v(q_BSHQ, k_BTHQ, v_BTHV, *, scale: float) -> jax.Array:
    """cuDNN causal flash attention with V < Q: [B, S, H, V] straight from the kernel.

    jax's checks run while tracing (its custom VJP traces the forward rule
    when a gradient is taken); a refusal there becomes one ValueError naming
    the key. (The public ``jax.nn`` wrapper is this same function with one
    head dim enforced, so sharding rules and gradients are the same ones.)
    """
    attention_fn, causal = _private_cudnn_attention()
    try:
        return attention_fn(q_BSHQ, k_BTHQ, v_BTHV, scale=scale, mask_type=causal)
    except (NotImplementedError, RuntimeError, ValueError) as e:
        raise UnpaddedRefused(
            f"jax's cuDNN attention refused v head dim {v_BTHV.shape[-1]} with q/k head dim "
            f"{q_BSHQ.shape[-1]} (it needs cuDNN >= 9.10 on a Hopper or newer GPU): "
            f"{' '.join(str(e).split()).rstrip('.')}"
        ) from e


def attend(q, k, v, *, scale: float, attention: str, unpadded_v: bool | str = False) -> jax.Array:
    """Softmax attention by the ``attention`` key: ``cudnn_flash_te`` (cuDNN flash
    attention; ``unpadded_v`` as in ``fused_attention``) or ``dot_product`` (XLA).
    k and v may have fewer heads than q (GQA). The keys are the ones the calling
    module was built with (``check_backend``)."""
    if attention == "cudnn_flash_te":
        return fused_attention(q, k, v, scale=scale, implementation="cudnn", unpadded_v=unpadded_v)
    return dot_product_attention(q, k, v, scale=scale)


class MLA(nnx.Module):
    """Multi-head Latent Attention ``[B, S, D] -> [B, S, D]``, causal.

    Parameters (kernels ``[in, out]``, in ``param_dtype``): ``wq_a`` [D, Lq],
    ``q_norm`` [Lq], ``wq_b`` [Lq, H*Q] (or ``wq`` [D, H*Q] when Lq = 0),
    ``wkv_a`` [D, Lkv + R], ``kv_norm`` [Lkv], ``wkv_b`` [Lkv, H*(N+V)],
    ``wo`` [H*V, D]. ``dot_general`` (default ``lax.dot_general``) computes
    the six projections (e.g. FP8 for ``quantization: te_fp8_currentscaling``);
    the attention itself is unchanged.

    Raises:
      ValueError: a non-positive head count or dim; as ``check_backend``.
    """

    def __init__(self, cfg: MLAConfig, *, emb_dim: int, dtype, param_dtype, rngs: nnx.Rngs,
                 dot_general=None):
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(cfg, name) <= 0:
                raise ValueError(f"MLA: {name}={getattr(cfg, name)} must be positive")
        check_backend(cfg.attention, dtype, cfg.cudnn_mla_unpadded_v)
        self.cfg = cfg
        self.dtype = dtype
        h, q_dim = cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim

        def linear(d_in, d_out):
            return nnx.Linear(
                d_in, d_out, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                kernel_init=default_kernel_init, dot_general=dot_general or jax.lax.dot_general,
                rngs=rngs,
            )

        def norm(n):
            return nnx.RMSNorm(
                n, epsilon=cfg.normalization_layer_epsilon, dtype=dtype,
                param_dtype=param_dtype, rngs=rngs,
            )

        if cfg.q_lora_rank > 0:
            self.wq_a = linear(emb_dim, cfg.q_lora_rank)
            self.q_norm = norm(cfg.q_lora_rank)
            self.wq_b = linear(cfg.q_lora_rank, h * q_dim)
        else:
            self.wq = linear(emb_dim, h * q_dim)
        self.wkv_a = linear(emb_dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.kv_norm = norm(cfg.kv_lora_rank)
        self.wkv_b = linear(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        self.wo = linear(h * cfg.v_head_dim, emb_dim)

    def _query(self, x_BSD):
        cfg = self.cfg
        if cfg.q_lora_rank > 0:
            q_lat_BSL = checkpoint_name(self.wq_a(x_BSD), "mla_q")
            q = self.wq_b(self.q_norm(q_lat_BSL))
        else:
            q = self.wq(x_BSD)
        b, s = x_BSD.shape[:2]
        return q.reshape(b, s, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)

    def __call__(self, x_BSD: jax.Array, positions_BS: jax.Array) -> jax.Array:
        """x [B, S, D] (any float dtype), positions [B, S] int -> [B, S, D] in ``dtype``."""
        cfg = self.cfg
        b, s, _ = x_BSD.shape
        h, n, r, v_dim = cfg.num_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        x_BSD = x_BSD.astype(self.dtype)
        cos_BSR2, sin_BSR2 = rope.rope_cos_sin(positions_BS, cfg)

        q_BSHQ = self._query(x_BSD)
        q_nope_BSHN, q_pe_BSHR = q_BSHQ[..., :n], q_BSHQ[..., n:]
        q_BSHQ = jnp.concatenate([q_nope_BSHN, rope.apply_rope(q_pe_BSHR, cos_BSR2, sin_BSR2)], -1)
        q_BSHQ = checkpoint_name(q_BSHQ, "query_proj")

        kv_a_BSX = checkpoint_name(self.wkv_a(x_BSD), "mla_kv")
        c_kv_BSL, k_pe_BSR = kv_a_BSX[..., : cfg.kv_lora_rank], kv_a_BSX[..., cfg.kv_lora_rank :]
        kv_BSHX = self.wkv_b(self.kv_norm(c_kv_BSL)).reshape(b, s, h, n + v_dim)
        k_nope_BSHN, v_BSHV = kv_BSHX[..., :n], kv_BSHX[..., n:]
        k_pe_BS1R = rope.apply_rope(k_pe_BSR[:, :, None, :], cos_BSR2, sin_BSR2)
        k_BSHQ = jnp.concatenate([k_nope_BSHN, jnp.broadcast_to(k_pe_BS1R, (b, s, h, r))], -1)
        k_BSHQ = checkpoint_name(k_BSHQ, "key_proj")
        v_BSHV = checkpoint_name(v_BSHV, "value_proj")

        scale = rope.yarn_softmax_scale(cfg)
        out_BSHV = checkpoint_name(attend(q_BSHQ, k_BSHQ, v_BSHV, scale=scale, attention=cfg.attention,
                                          unpadded_v=cfg.cudnn_mla_unpadded_v), "context")
        y_BSD = self.wo(out_BSHV.reshape(b, s, h * v_dim))
        return checkpoint_name(y_BSD, "out_proj")
